"""HF tokenizer directories and `data prepare` from local HF datasets (issue 13, items 5 and 6).

Real parts only: tokenizer directories are written by transformers' own ``save_pretrained``
(a tiny byte-level BPE trained with ``tokenizers`` on a few lines, wrapped in
``PreTrainedTokenizerFast``, shaped like each family's tokenizer: Llama 3 = BOS by the
post-processor template, Qwen = no BOS, Mistral = ``<s>``/``</s>`` at ids 1/2), and compared
with ``transformers.AutoTokenizer`` (exact equality of ids: tokenization is deterministic, so
no tolerance). Data files are written by ``datasets`` itself (``to_parquet``, ``to_json``,
``save_to_disk``). No network. Corrupted configs are real files edited after transformers
wrote them (a real fault, not a hand-made fixture).
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets", reason="needs the 'datasets' package (pip install 'llmtrain[datasets]')")
transformers = pytest.importorskip("transformers", reason="needs transformers to write and compare tokenizer dirs")

from llmtrain.engine.data.prepare import prepare  # noqa: E402
from llmtrain.engine.data.tokenizer import load_tokenizer  # noqa: E402
from llmtrain.errors import LLMTrainError  # noqa: E402

datasets.disable_progress_bars()

TRAIN = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello tokenizer!",
         "def f(x):\n    return x * 2  # code", "Grüße aus München; 日本語のテキスト; Привет, мир."] * 4
TEXTS = ["Hello world", "  leading spaces and\ttabs\n", "Grüße, 東京, 🙂 emoji",
         "a literal <|endoftext|> and <s> inside a document", "def g():\n    pass", "x"]
FAMILIES = {
    # name: (special tokens in id order, bos, eos, pad, BOS template in tokenizer.json)
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>"], "<|begin_of_text|>", "<|end_of_text|>", None, True),
    "qwen": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|endoftext|>", "<|endoftext|>", False),
    "mistral": (["<unk>", "<s>", "</s>"], "<s>", "</s>", None, True),
}
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def tokenizer_dir(root: Path, family: str) -> Path:
    """A tiny tokenizer of ``family``'s shape, saved by transformers' save_pretrained."""
    import tokenizers as tk
    from transformers import PreTrainedTokenizerFast

    specials, bos, eos, pad, bos_template = FAMILIES[family]
    out = root / f"tok-{family}"
    if out.exists():
        return out
    tok = tk.Tokenizer(tk.models.BPE(unk_token="<unk>" if "<unk>" in specials else None))
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAIN, trainer)
    if bos_template:  # Llama 3 / Mistral tokenizer.json: TemplateProcessing "BOS $A"
        tok.post_processor = tk.processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                              special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                   unk_token="<unk>" if "<unk>" in specials else None,
                                   chat_template=TEMPLATE if family == "qwen" else None)
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def tokdirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tok")
    return {f: tokenizer_dir(root, f) for f in FAMILIES}


def read_docs(out: Path) -> list[list[int]]:
    meta = json.loads((out / "meta.json").read_text())
    tokens = np.fromfile(out / "tokens.bin", dtype=meta["dtype"])
    starts = list(np.load(out / "index.npy")) + [len(tokens)]
    return [tokens[s:e].tolist() for s, e in zip(starts[:-1], starts[1:])]


# ---------------------------------------------------------------------------------------------
# Tokenizer directories


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ids_and_special_tokens_match_transformers(tokdirs, family):
    from transformers import AutoTokenizer

    d = tokdirs[family]
    ref = AutoTokenizer.from_pretrained(d)
    for spec in (str(d), str(d / "tokenizer.json")):  # the directory, or its tokenizer.json (config beside it)
        tok = load_tokenizer(spec)
        want = [ref(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
        assert tok.encode_batch(TEXTS) == want and [tok.encode(t) for t in TEXTS] == want
        assert (tok.eos_id, tok.bos_id) == (ref.eos_token_id, ref.bos_token_id)
        # add_bos is what transformers does with add_special_tokens=True
        assert tok.add_bos == (ref("x")["input_ids"][0] == ref.bos_token_id) == FAMILIES[family][4]
        assert tok.chat_template == ref.chat_template
        assert tok.vocab_size == len(ref)
    if family == "qwen":
        assert tok.chat_template == TEMPLATE and tok.pad_id == tok.eos_id


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prepare_marks_boundaries_and_carries_the_tokenizer(tokdirs, tmp_path, family):
    from transformers import AutoTokenizer

    d = tokdirs[family]
    ref = AutoTokenizer.from_pretrained(d)
    src = tmp_path / "in.jsonl"
    datasets.Dataset.from_dict({"text": TEXTS}).to_json(src)
    out = tmp_path / "out"
    meta = prepare([src], out, str(d), progress=False)
    bos = [ref.bos_token_id] if FAMILIES[family][4] else []
    assert read_docs(out) == [bos + ref(t, add_special_tokens=False)["input_ids"] + [ref.eos_token_id] for t in TEXTS]
    assert (meta["bos_id"], meta["eos_id"]) == ((bos or [None])[0], ref.eos_token_id)
    assert sorted(p.name for p in out.iterdir()) == ["index.npy", "meta.json", "special_tokens_map.json",
                                                     "tokenizer.json", "tokenizer_config.json", "tokens.bin"]
    # the prepared directory is itself a HF tokenizer directory that transformers loads the same
    again = AutoTokenizer.from_pretrained(out)
    assert [again(t, add_special_tokens=False)["input_ids"] for t in TEXTS] == [ref(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    assert (again.bos_token_id, again.eos_token_id, again.pad_token_id) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    assert again.chat_template == ref.chat_template
    # ... and so does llmtrain, with the same boundaries: re-preparing from it gives the same bytes
    out2 = tmp_path / "out2"
    prepare([src], out2, str(out), progress=False)
    assert (out2 / "tokens.bin").read_bytes() == (out / "tokens.bin").read_bytes()


def test_config_flags_and_bad_configs(tokdirs, tmp_path):
    import shutil

    d = tmp_path / "mistral"
    shutil.copytree(tokdirs["mistral"], d)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # Hub-style config: an explicit add_bos_token wins over the post-processor; auto_map is never carried
    cfg_path.write_text(json.dumps({**cfg, "add_bos_token": False, "add_eos_token": False, "auto_map": {"AutoTokenizer": "x.Tok"}}))
    tok = load_tokenizer(str(d))
    assert tok.add_bos is False and tok.bos_id is not None and tok.config.add_eos_token is False
    (tmp_path / "saved").mkdir()
    tok.save(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert "auto_map" not in saved and saved["add_bos_token"] is False
    assert json.loads((tmp_path / "saved" / "special_tokens_map.json").read_text()) == {
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    # split_special_tokens: a special-token string in text is then plain text, as in transformers
    cfg_path.write_text(json.dumps({**cfg, "split_special_tokens": True}))
    assert tokdirs["mistral"] and 2 not in load_tokenizer(str(d)).encode("a </s> b")
    assert 2 in load_tokenizer(str(tokdirs["mistral"])).encode("a </s> b")
    bad = [({**cfg, "eos_token": "<|nope|>"}, "eos_token '<|nope|>' of tokenizer_config.json is not in the vocabulary"),
           ({**cfg, "bos_token": 7}, "bos_token is a int, not a token string"),
           ({**cfg, "add_bos_token": "yes"}, "add_bos_token is yes, not true/false"),
           ({**cfg, "chat_template": 3}, "chat_template is neither"),
           ("[" * 100000, "nested too deeply"), ("{not json", "not valid JSON")]
    for content, needle in bad:
        cfg_path.write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(LLMTrainError) as info:
            load_tokenizer(str(d))
        assert needle in str(info.value) and "\n" not in str(info.value) and info.value.problems[0].hint, str(info.value)
    cfg_path.unlink()
    os.mkfifo(cfg_path)
    with pytest.raises(LLMTrainError, match="FIFO"):
        load_tokenizer(str(d))


# ---------------------------------------------------------------------------------------------
# Inputs written by datasets


@pytest.fixture(scope="module")
def hf_inputs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hfin")
    train = [f"train doc {i}: " + TEXTS[i % len(TEXTS)] for i in range(23)]
    val = [f"validation doc {i}" for i in range(5)]
    ds = datasets.Dataset.from_dict({"content": train, "n": list(range(len(train)))})
    ds.to_parquet(root / "a.parquet")
    ds.to_json(root / "b.jsonl")
    ds.to_json(root / "c.json", lines=False)
    ds.to_json(root / "d.jsonl.gz", compression="gzip")
    ds.save_to_disk(root / "saved", num_shards=3)
    datasets.DatasetDict({"train": ds, "validation": datasets.Dataset.from_dict({"content": val})}).save_to_disk(root / "dict")
    return {"root": root, "train": train, "val": val}


def byte_docs(out: Path) -> list[str]:
    return [bytes(d).decode("utf-8") for d in read_docs(out)]  # byte tokenizer: no EOS, ids are bytes


def test_every_datasets_format(hf_inputs, tmp_path):
    root, train = hf_inputs["root"], hf_inputs["train"]
    arrow = sorted((root / "saved").glob("*.arrow"))
    assert len(arrow) == 3
    cases = {"a.parquet": [root / "a.parquet"], "b.jsonl": [root / "b.jsonl"], "c.json": [root / "c.json"],
             "d.jsonl.gz": [root / "d.jsonl.gz"], "arrow shards": arrow, "save_to_disk": [root / "saved"],
             "dict train": [root / "dict"]}
    for name, inputs in cases.items():
        out = tmp_path / name.replace(" ", "_")
        meta = prepare(inputs, out, "byte", progress=False, text_field="content", split="train")
        assert byte_docs(out) == train, name
        assert meta["text_field"] == "content" and len(meta["inputs"]) == len(inputs) and meta["inputs"][0]["bytes"] > 0
    meta = prepare([root / "dict"], tmp_path / "val", "byte", progress=False, text_field="content", split="validation")
    assert byte_docs(tmp_path / "val") == hf_inputs["val"] and meta["split"] == "validation"


def test_directory_with_saved_datasets_reads_each_once(hf_inputs, tmp_path):
    """A save_to_disk directory found while walking is one input: its .arrow shards are not read twice."""
    import shutil

    tree = tmp_path / "tree"
    shutil.copytree(hf_inputs["root"] / "saved", tree / "x_saved")
    shutil.copy(hf_inputs["root"] / "b.jsonl", tree / "a.jsonl")
    meta = prepare([tree], tmp_path / "out", "byte", progress=False, text_field="content")
    assert byte_docs(tmp_path / "out") == hf_inputs["train"] * 2
    assert [Path(i["path"]).name for i in meta["inputs"]] == ["a.jsonl", "x_saved"]


def test_hf_input_errors_are_one_line(hf_inputs, tmp_path, monkeypatch):
    import shutil

    root = hf_inputs["root"]
    crafted = tmp_path / "crafted"
    shutil.copytree(root / "saved", crafted)
    state = json.loads((crafted / "state.json").read_text())
    state["_data_files"][0]["filename"] = "../../etc/passwd.arrow"
    (crafted / "state.json").write_text(json.dumps(state))
    corrupt = tmp_path / "corrupt.arrow"
    corrupt.write_bytes(next((root / "saved").glob("*.arrow")).read_bytes()[:100])
    cases = [([root / "dict"], {}, "a DatasetDict with splits train, validation; pass --split NAME"),
             ([root / "dict"], {"split": "test"}, "no split 'test' (splits: train, validation)"),
             ([root / "saved"], {"text_field": "body"}, "no column 'body' (columns: content, n)"),
             ([root / "d.jsonl.gz"], {"text_field": "body"}, "no field 'body'"),
             ([crafted], {}, "is not a plain file name inside the directory"),
             ([corrupt], {}, "corrupt.arrow: not a readable Arrow file"),
             ([root / "a.parquet"], {"text_field": "body"}, "no column 'body'")]
    for inputs, kwargs, needle in cases:
        kwargs = {"text_field": "content", **kwargs}
        with pytest.raises(LLMTrainError) as info:
            prepare(inputs, tmp_path / "out", "byte", progress=False, **kwargs)
        assert needle in str(info.value) and "\n" not in str(info.value) and info.value.problems[0].hint, str(info.value)
    assert not (tmp_path / "out").exists()
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(LLMTrainError, match=r"needs the 'datasets' package.*llmtrain\[datasets\]"):
        prepare([root / "saved"], tmp_path / "out", "byte", progress=False, text_field="content")


# ---------------------------------------------------------------------------------------------
# Workers and the CLI


def test_workers_give_byte_identical_output(tokdirs, tmp_path, monkeypatch):
    """Several batches (BATCH_DOCS lowered to 16) spread over 3 spawned workers: every output file equal."""
    import importlib

    monkeypatch.setattr(importlib.import_module("llmtrain.engine.data.prepare"), "BATCH_DOCS", 16)
    src = tmp_path / "many.jsonl"
    datasets.Dataset.from_dict({"text": [f"{i} " + TEXTS[i % len(TEXTS)] * (1 + i % 5) for i in range(300)]}).to_json(src)
    outs = {}
    for n in (1, 3):
        outs[n] = tmp_path / f"w{n}"
        prepare([src], outs[n], str(tokdirs["llama3"]), progress=False, workers=n)
    files = sorted(p.name for p in outs[1].iterdir())
    assert files == sorted(p.name for p in outs[3].iterdir())
    for name in files:
        assert (outs[1] / name).read_bytes() == (outs[3] / name).read_bytes(), name
    assert len(read_docs(outs[3])) == 300
    with pytest.raises(LLMTrainError, match="--workers 0"):
        prepare([src], tmp_path / "w0", "byte", progress=False, workers=0)


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "llmtrain"
    cmd = [str(script)] if script.exists() else [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]
    kw = {"capture_output": True, "text": True, **kw}
    return subprocess.run([*cmd, *args], timeout=120, **kw)


def test_cli_split_text_field_workers_and_progress(hf_inputs, tokdirs, tmp_path):
    d = hf_inputs["root"] / "dict"
    out = tmp_path / "cli"
    proc = cli("data", "prepare", str(d), "--split", "validation", "--text-field", "content", "--workers", "2",
               "--tokenizer", str(tokdirs["qwen"]), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["n_docs"] == 5 and meta["bos_id"] is None and proc.stderr == ""  # not a tty: no bar
    assert proc.stdout.startswith(f"prepared {meta['n_tokens']:,} tokens in 5 documents")
    proc = cli("data", "prepare", str(d), "--text-field", "content", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "pass --split NAME" in proc.stderr, proc.stderr
    # on a terminal the progress bar is drawn on stderr
    leader, follower = pty.openpty()
    proc = cli("data", "prepare", str(hf_inputs["root"] / "saved"), "--text-field", "content", "--out", str(tmp_path / "tty"),
               stderr=follower, stdout=subprocess.PIPE, capture_output=False, text=False, env={**os.environ, "COLUMNS": "100"})
    os.close(follower)
    drawn = b""
    try:
        while chunk := os.read(leader, 65536):
            drawn += chunk
    except OSError:  # EIO once the child's end is closed
        pass
    os.close(leader)
    assert proc.returncode == 0 and b"tokenizing" in drawn, drawn[-300:]
