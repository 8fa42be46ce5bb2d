"""Data pipeline: tokenizers, `data prepare` (library and CLI), memmap windows, build_data (the
sampler and the synthetic chain: tests/test_data_sampling.py).

Real parts: real files on disk (txt/jsonl/parquet), a BPE really trained on real text (Python
stdlib sources plus multilingual paragraphs), the installed CLI run as a subprocess.
Tolerances are stated where statistics are involved.
"""

from __future__ import annotations

import difflib
import json
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
    # an unpaired surrogate escape (valid JSON, not Unicode) crashed every tokenizer with a traceback;
    # a paired one (an emoji) and an escaped backslash before "ud800" are text
    lone = tmp_path / "lone.jsonl"
    lone.write_text('{"text": "pair \\ud83d\\ude00 and \\\\ud800 ok"}\n{"text": "cut \\ud83d"}\n')
    cases = [([bad], "bad.jsonl:2: invalid JSON"), ([nofield], "nofield.jsonl:3: JSON line has no string field 'text'"),
             ([lone], "lone.jsonl:2: field 'text' holds an unpaired surrogate escape"),
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
