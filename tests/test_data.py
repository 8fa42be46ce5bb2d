"""Data pipeline: tokenizers, `data prepare` (library and CLI), memmap windows, sampler, synthetic chain.

Real parts: real files on disk (txt/jsonl/parquet), a BPE really trained on real text (Python
stdlib sources plus multilingual paragraphs), the installed CLI run as a subprocess.
Tolerances are stated where statistics are involved.
"""

from __future__ import annotations

import difflib
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from llmtrain.engine.data import (
    BatchSampler, ByteTokenizer, MarkovChain, MemmapDataset, build_data, load_tokenizer, microbatches, prepare,
)
from llmtrain.engine.data.prepare import token_dtype
from llmtrain.errors import LLMTrainError
from llmtrain.recipe.schema import DataConfig

MULTILINGUAL = [
    "Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München, Zürich und Köln!",
    "Le cœur a ses raisons que la raison ne connaît point. « Déjà vu », dit-elle, naïvement.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю. Привет, мир!",
    "日本語のテキストも正しく扱えるべきです。東京都の天気は晴れ、気温は二十度。",
    "中文分词是一个有趣的问题：机器学习模型需要大量的训练数据。",
    "한국어 문장도 포함합니다. 안녕하세요, 세계!",
    "مرحبا بالعالم، هذه جملة باللغة العربية تُكتب من اليمين إلى اليسار.",
    "Ελληνικά: Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. हिन्दी: नमस्ते दुनिया।",
    "Emoji and symbols 🙂🚀👩‍👩‍👧 ∑∫√∞ ≤≥ — “quotes” ‘single’ … tabs\tand\r\nCRLF  double  spaces ",
    "Zero-width joiner\u200d, NBSP\u00a0, combining e\u0301 vs é, control \x00\x01\x7f chars.",
]


def real_texts() -> list[str]:
    """A few tens of KB of real English/code text from stdlib sources that always exist."""
    return [Path(m.__file__).read_text(encoding="utf-8")[:20000] for m in (textwrap, json, difflib)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Real-ish inputs on disk: .txt files, a .jsonl and a .parquet, in a directory tree."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "sub").mkdir()
    txt = real_texts() + [MULTILINGUAL[0] + "\n" + MULTILINGUAL[3]]
    txt_paths = [root / f"doc{i}.txt" for i in range(len(txt) - 1)] + [root / "sub" / "z_multi.txt"]
    for path, text in zip(txt_paths, txt):
        path.write_text(text, encoding="utf-8", newline="")
    jsonl = MULTILINGUAL[:6] + ["short", "a line with \"quotes\" and \\ backslash\nand newline"]
    with (root / "sub" / "m.jsonl").open("w", encoding="utf-8") as f:
        for i, text in enumerate(jsonl):
            f.write(json.dumps({"text": text, "id": i}, ensure_ascii=i % 2 == 0) + "\n")
            if i == 2:
                f.write("\n")  # blank lines are skipped
    import pyarrow as pa
    import pyarrow.parquet as pq

    par = MULTILINGUAL[6:] + [t[:3000] for t in real_texts()]
    pq.write_table(pa.table({"text": par, "n": list(range(len(par)))}), root / "sub" / "p.parquet", row_group_size=3)
    (root / "sub" / "README.md").write_text("ignored: not a supported extension inside a directory")
    # sorted path order is the document order of a directory input
    order = sorted([*txt_paths, root / "sub" / "m.jsonl", root / "sub" / "p.parquet"])
    docs = {p: [t] for p, t in zip(txt_paths, txt)}
    docs[root / "sub" / "m.jsonl"] = jsonl
    docs[root / "sub" / "p.parquet"] = par
    return {"root": root, "texts": [t for p in order for t in docs[p]], "jsonl": root / "sub" / "m.jsonl"}


def decode_docs(out: Path) -> list[str]:
    """Decode tokens.bin document by document (using index.npy), dropping each trailing EOS."""
    meta = json.loads((out / "meta.json").read_text())
    tokens = np.fromfile(out / "tokens.bin", dtype=meta["dtype"])
    starts = np.load(out / "index.npy")
    ends = list(starts[1:]) + [len(tokens)]
    tok = load_tokenizer(str(out))
    texts = []
    for s, e in zip(starts, ends):
        ids = tokens[s:e].tolist()
        if meta["eos_id"] is not None:
            assert ids[-1] == meta["eos_id"]
            ids = ids[:-1]
        texts.append(tok.decode(ids))
    return texts


# ---------------------------------------------------------------------------------------------
# Tokenizers


def test_byte_tokenizer_round_trip(tmp_path):
    tok = load_tokenizer("byte")
    assert tok.vocab_size == 256 and tok.eos_id is None
    for text in MULTILINGUAL + real_texts() + [""]:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text
    tok.save(tmp_path)
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)


def test_bpe_trained_on_real_text_round_trips(tmp_path):
    train = real_texts() + MULTILINGUAL
    tok = load_tokenizer("bpe:600", train_texts=iter(train))
    assert 257 <= tok.vocab_size <= 600 and tok.eos_id == 0
    unseen = ["A sentence never seen in training: Quixotic zephyrs — ½ ünïcödé 🙂", "  leading and trailing  ", "\n\n\t"]
    for text in train + unseen:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    real = "".join(real_texts())
    assert len(tok.encode(real)) < 0.6 * len(real.encode()), "BPE should compress English/code text vs bytes"
    tok.save(tmp_path)
    again = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert again.encode(MULTILINGUAL[2]) == tok.encode(MULTILINGUAL[2]) and again.eos_id == 0


def test_tokenizer_spec_errors(tmp_path):
    for spec, needle in [("bpe:abc", "not an integer"), ("bpe:100", "out of range"), ("bpe:1000", "trained first"),
                         ("wordpiece", "unknown tokenizer"), (str(tmp_path / "none.json"), "does not exist"),
                         (str(tmp_path), "neither")]:
        with pytest.raises(LLMTrainError, match=needle):
            load_tokenizer(spec)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(LLMTrainError, match="not a valid Hugging Face tokenizer"):
        load_tokenizer(str(tmp_path / "bad.json"))


# ---------------------------------------------------------------------------------------------
# prepare


@pytest.mark.parametrize("spec", ["byte", "bpe:800"])
def test_prepare_txt_jsonl_parquet_round_trip(corpus, tmp_path, spec):
    out = tmp_path / "out"
    meta = prepare([corpus["root"]], out, spec, progress=False)
    assert decode_docs(out) == corpus["texts"]
    assert meta == json.loads((out / "meta.json").read_text())
    assert meta["n_docs"] == len(corpus["texts"]) and meta["dtype"] == "uint16" and meta["tokenizer"] == spec
    assert (out / "tokens.bin").stat().st_size == 2 * meta["n_tokens"]
    assert len(meta["inputs"]) == 6 and all(i["bytes"] > 0 for i in meta["inputs"])
    if spec == "byte":
        assert meta["eos_id"] is None and meta["n_tokens"] == sum(len(t.encode()) for t in corpus["texts"])
    else:
        assert meta["eos_id"] == 0 and (out / "tokenizer.json").is_file()
        # the saved tokenizer.json as a spec reproduces the same tokens
        out2 = tmp_path / "out2"
        prepare([corpus["root"]], out2, str(out / "tokenizer.json"), progress=False)
        assert (out2 / "tokens.bin").read_bytes() == (out / "tokens.bin").read_bytes()


def test_token_dtype():
    assert token_dtype(256) == np.uint16 and token_dtype(65535) == np.uint16 and token_dtype(65536) == np.uint32


def test_prepare_errors_are_one_line(corpus, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "unterminated\n')
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"text": "ok"}\n\n{"body": "x"}\n')
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    weird = tmp_path / "data.csv"
    weird.write_text("a,b")
    cases = [([bad], "bad.jsonl:2: invalid JSON"), ([nofield], "nofield.jsonl:3: JSON line has no string field 'text'"),
             ([empty], "no text found"), ([weird], "unsupported file type '.csv'"),
             ([tmp_path / "missing.txt"], "missing.txt: no such file")]
    for inputs, needle in cases:
        with pytest.raises(LLMTrainError) as info:
            prepare(inputs, tmp_path / "out", "byte", progress=False)
        assert needle in str(info.value) and "\n" not in str(info.value) and info.value.problems[0].hint
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "c.parquet")
    with pytest.raises(LLMTrainError, match="no column 'text'"):
        prepare([tmp_path / "c.parquet"], tmp_path / "out", "byte", progress=False)
    assert not (tmp_path / "out" / "meta.json").exists() and not list((tmp_path / "out").glob("*.tmp"))


def test_prepare_failure_keeps_previous_output(corpus, tmp_path):
    out = tmp_path / "out"
    prepare([corpus["jsonl"]], out, "byte", progress=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n' * 5 + "not json\n")
    with pytest.raises(LLMTrainError, match="bad.jsonl:6"):
        prepare([corpus["jsonl"], bad], out, "byte", progress=False, force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no build left behind


def test_parquet_without_pyarrow_is_a_clear_error(corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # makes `import pyarrow.parquet` raise ImportError
    with pytest.raises(LLMTrainError, match="needs pyarrow"):
        prepare([corpus["root"] / "sub" / "p.parquet"], tmp_path / "out", "byte", progress=False)


def llmtrain_cmd() -> list[str]:
    script = Path(sys.executable).parent / "llmtrain"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]


def test_cli_prepare(corpus, tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run([*llmtrain_cmd(), "data", "prepare", str(corpus["root"] / "sub"), str(corpus["root"] / "doc0.txt"),
                           "--out", str(out), "--tokenizer", "byte", "--no-progress"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert proc.stdout.strip() == f"prepared {meta['n_tokens']:,} tokens in {meta['n_docs']:,} documents (uint16, vocab 256) -> {out}"
    assert meta["n_docs"] == 1 + 8 + 7 + 1  # sub/: z_multi.txt, m.jsonl (8 lines), p.parquet (7 rows); doc0.txt
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 1}\n')
    proc = subprocess.run([*llmtrain_cmd(), "data", "prepare", str(bad), "--out", str(tmp_path / "x")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "bad.jsonl:1" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "x" / "meta.json").exists()


# ---------------------------------------------------------------------------------------------
# Memmap dataset


def test_memmap_windows(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text("".join(chr(ord("a") + i % 26) for i in range(1000)))
    out = tmp_path / "data"
    prepare([src], out, "byte", progress=False)
    tokens = np.fromfile(out / "tokens.bin", dtype=np.uint16)
    for seq_len in (1, 7, 64, 999):
        ds = MemmapDataset(out, seq_len)
        assert len(ds) == ds.length == (1000 - 1) // seq_len
        for i in sorted({0, min(1, len(ds) - 1), len(ds) - 1}):
            window = ds.sample(i)
            assert window.dtype == np.int64 and window.tolist() == tokens[i * seq_len:i * seq_len + seq_len + 1].tolist()
        with pytest.raises(IndexError):
            ds.sample(len(ds))
    with pytest.raises(LLMTrainError, match="fewer than one sample"):
        MemmapDataset(out, 1000)
    with pytest.raises(LLMTrainError, match="meta.json is missing"):
        MemmapDataset(tmp_path, 8)
    with (out / "tokens.bin").open("r+b") as f:
        f.truncate(100)
    with pytest.raises(LLMTrainError, match="has 100 bytes but meta.json says 1000"):
        MemmapDataset(out, 8)


# ---------------------------------------------------------------------------------------------
# Sampler


def all_steps(sampler: BatchSampler, steps: int) -> list[list[list[int]]]:
    out = []
    for _ in range(steps):
        out.append(sampler.step_indices())
        sampler.advance()
    return out


def test_sampler_deterministic_and_dp_slices_tile_the_step():
    a = all_steps(BatchSampler(100, 16, 2, 1, 4, seed=7), 10)
    b = all_steps(BatchSampler(100, 16, 2, 1, 4, seed=7), 10)
    assert a == b and a != all_steps(BatchSampler(100, 16, 2, 1, 4, seed=8), 10)
    samplers = [BatchSampler(None, 24, 3, r, 2, seed=0) for r in range(2)]  # grad_accum 4
    for step in range(3):
        positions = [s.step_positions() for s in samplers]
        flat = [p for rank in positions for micro in rank for p in micro]
        assert len(flat) == 24 and set(flat) == set(range(24 * step, 24 * step + 24))
        assert all(len(rank) == 4 and all(len(m) == 3 for m in rank) for rank in positions)
        assert [s.step_indices() for s in samplers] == positions  # infinite dataset: index = position
        for s in samplers:
            s.advance()


def test_sampler_epoch_covers_every_index_once():
    n = 48
    seen = [i for s in all_steps(BatchSampler(n, 8, 2, 0, 1, seed=3), n // 8) for m in s for i in m]
    assert sorted(seen) == list(range(n)) and seen != list(range(n))  # a permutation, shuffled
    ranks = [BatchSampler(n, 8, 1, r, 4, seed=3) for r in range(4)]
    per_rank = [[i for s in all_steps(sampler, 2 * n // 8) for m in s for i in m] for sampler in ranks]
    epoch0 = [i for r in per_rank for i in r[:len(r) // 2]]
    epoch1 = [i for r in per_rank for i in r[len(r) // 2:]]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    unshuffled = [i for s in all_steps(BatchSampler(n, 8, 2, 0, 1, seed=3, shuffle=False), 7) for m in s for i in m]
    assert unshuffled == list(range(n)) + list(range(8))
    # a global batch larger than the dataset straddles epochs: positions 0..9 are two full epochs
    ranks = [BatchSampler(5, 12, 3, r, 2, seed=1) for r in range(2)]
    big = sorted(i for s in ranks for m in s.step_indices() for i in m)
    assert big == sorted(ranks[0].indices_of(range(12))) and sorted(ranks[0].indices_of(range(10))) == sorted(list(range(5)) * 2)


def step_sets(dataset_len, global_batch, micro, dp, steps, seed=11):
    samplers = [BatchSampler(dataset_len, global_batch, micro, r, dp, seed) for r in range(dp)]
    sets = []
    for _ in range(steps):
        sets.append(sorted(i for s in samplers for m in s.step_indices() for i in m))
        for s in samplers:
            s.advance()
    return sets


@pytest.mark.parametrize("dataset_len", [None, 37])
def test_sampler_steps_independent_of_layout(dataset_len):
    reference = step_sets(dataset_len, 16, 4, 2, 6)
    assert step_sets(dataset_len, 16, 2, 4, 6) == reference
    assert step_sets(dataset_len, 16, 1, 1, 6) == reference
    assert step_sets(dataset_len, 16, 8, 2, 6) == reference


def test_sampler_state_dict_resumes_exactly():
    full = all_steps(BatchSampler(50, 12, 2, 1, 3, seed=5), 9)
    first = BatchSampler(50, 12, 2, 1, 3, seed=5)
    all_steps(first, 4)
    state = json.loads(json.dumps(first.state_dict()))  # survives serialization
    assert state == {"consumed_samples": 48}
    resumed = BatchSampler(50, 12, 2, 1, 3, seed=5)
    resumed.load_state_dict(state)
    assert all_steps(resumed, 5) == full[4:]
    # resuming on a different DP size continues the same global stream
    sets_after = step_sets(50, 12, 2, 3, 9)[4:]
    other = [BatchSampler(50, 12, 3, r, 2, seed=11) for r in range(2)]
    for s in other:
        s.load_state_dict({"consumed_samples": np.int64(48)})
    for expected in sets_after:
        assert sorted(i for s in other for m in s.step_indices() for i in m) == expected
        for s in other:
            s.advance()
    with pytest.raises(LLMTrainError, match="consumed_samples"):
        resumed.load_state_dict({"consumed": 3})


def test_sampler_rejects_indivisible_batch():
    with pytest.raises(LLMTrainError, match="not divisible by micro_batch 3 x dp 2 = 6"):
        BatchSampler(None, 16, 3, 0, 2, seed=0)


# ---------------------------------------------------------------------------------------------
# Synthetic Markov chain


def test_markov_deterministic_and_index_addressable():
    a, b = MarkovChain(512, 256, seed=3), MarkovChain(512, 256, seed=3)
    first = {i: a.sample(i) for i in (5, 0, 1000)}
    assert all(np.array_equal(first[i], b.sample(i)) for i in (1000, 0, 5, 5))  # any order, any instance
    assert not np.array_equal(a.sample(0), a.sample(1))
    assert not np.array_equal(a.sample(0), MarkovChain(512, 256, seed=4).sample(0))
    s = a.sample(7)
    assert s.shape == (257,) and s.dtype == np.int64 and 0 <= s.min() and s.max() < 512
    allowed = {(x, y) for x in range(512) for y in a.successors[x].tolist()}
    assert all((x, y) in allowed for x, y in zip(s[:-1].tolist(), s[1:].tolist()))
    assert 0.3 < a.entropy_rate() < math.log(4) < a.uniform_entropy()


def test_markov_entropy_rate_is_exact_and_matches_empirical():
    chain = MarkovChain(16, 4096, seed=1)
    # exact: the stationary distribution equals the dense eigenvector of P^T for eigenvalue 1
    P = chain.transition_matrix()
    w, v = np.linalg.eig(P.T)
    pi = np.real(v[:, np.argmin(np.abs(w - 1))])
    pi /= pi.sum()
    assert np.abs(pi - chain.stationary).max() < 1e-10
    rows = -np.sum(np.where(P > 0, P * np.log(np.where(P > 0, P, 1)), 0), axis=1)
    assert abs(chain.entropy_rate() - float(pi @ rows)) < 1e-10
    # empirical plug-in conditional entropy from 49 x 4096 = 200k transitions. Its standard error
    # is ~sqrt(Var(-log p)/N) ~ 2e-3 and its bias ~(#transitions - #states)/(2N) ~ 1e-4, so 0.01 nats
    # is a ~5-sigma tolerance.
    counts = np.zeros((16, 16))
    for i in range(49):
        s = chain.sample(i)
        np.add.at(counts, (s[:-1], s[1:]), 1)
    joint = counts / counts.sum()
    cond = counts / counts.sum(axis=1, keepdims=True).clip(min=1)
    empirical = -np.sum(np.where(counts > 0, joint * np.log(np.where(cond > 0, cond, 1)), 0))
    assert abs(empirical - chain.entropy_rate()) < 0.01, (empirical, chain.entropy_rate())


def test_markov_samples_start_from_the_stationary_distribution():
    # 20000 first tokens over V=16 states: the expected total-variation distance to pi is
    # ~0.5 * sum_s sqrt(2 pi_s / (pi N)) <= 0.012; 0.03 is a comfortable bound. A uniform start
    # would be off by TV(uniform, pi), asserted > 0.1 for this seed so the test can tell them apart.
    chain = MarkovChain(16, 1, seed=1)
    firsts = np.array([chain.sample(i)[0] for i in range(20000)])
    freq = np.bincount(firsts, minlength=16) / len(firsts)
    assert 0.5 * np.abs(freq - chain.stationary).sum() < 0.03
    assert 0.5 * np.abs(np.full(16, 1 / 16) - chain.stationary).sum() > 0.1


# ---------------------------------------------------------------------------------------------
# Loader


def test_build_data_and_microbatches(tmp_path):
    synth = build_data(DataConfig(), seq_len=32, vocab_size=300, seed=2)
    assert isinstance(synth, MarkovChain) and synth.length is None and synth.vocab_size == 300
    sampler = BatchSampler(synth.length, 12, 3, 1, 2, seed=2)
    batches = microbatches(synth, sampler)
    assert len(batches) == 2 and sampler.consumed_samples == 0
    for (inputs, labels), indices in zip(batches, sampler.step_indices()):
        assert inputs.dtype == labels.dtype == torch.long and inputs.shape == labels.shape == (3, 32)
        full = torch.from_numpy(np.stack([synth.sample(i) for i in indices]))
        assert torch.equal(inputs, full[:, :-1]) and torch.equal(labels, full[:, 1:])

    src = tmp_path / "t.txt"
    src.write_text("hello world " * 100)
    prepare([src], tmp_path / "d", "bpe:300", progress=False)
    cfg = DataConfig(source="memmap", path=str(tmp_path / "d"))
    data = build_data(cfg, seq_len=4, vocab_size=300, seed=0)
    assert isinstance(data, MemmapDataset) and data.length == len(data) > 0
    with pytest.raises(LLMTrainError, match="larger than the model's vocab_size 200"):
        build_data(cfg, seq_len=4, vocab_size=200, seed=0)
    with pytest.raises(LLMTrainError, match="data.path is not set"):
        build_data(DataConfig(source="memmap"), seq_len=4, vocab_size=300, seed=0)
    with pytest.raises(LLMTrainError, match="does not exist"):
        build_data(DataConfig(source="memmap", path=str(tmp_path / "nope")), seq_len=4, vocab_size=300, seed=0)


def test_prepare_cli_is_registered_without_torch():
    """`llmtrain --help` (and so `llmtrain plan`) must not import torch because of the data commands."""
    code = "import sys; from llmtrain.cli import app, data; print('torch' in sys.modules, 'tokenizers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["False", "False"], out.stderr
