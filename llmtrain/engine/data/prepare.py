"""``llmtrain data prepare``: tokenize documents into one memory-mappable token file.

Inputs are described in :mod:`llmtrain.engine.data.inputs` (``.txt``, ``.jsonl``, ``.parquet``;
through ``datasets``: ``.arrow``, ``.json(.gz)`` and ``save_to_disk`` directories; directories
of them). The output directory gets::

    tokens.bin   all documents' token ids concatenated, each document as [BOS] ids [EOS]: the
                 BOS when the tokenizer adds one (meta bos_id), the EOS when it has one (meta
                 eos_id; byte has none); uint16 when vocab_size <= 65535, else uint32
    index.npy    int64 start offset of every document in tokens.bin (document i spans
                 index[i] .. index[i+1] or n_tokens, including its BOS/EOS)
    meta.json    dtype, n_tokens, n_docs, vocab_size, eos_id, bos_id, tokenizer spec, inputs + sizes
    tokenizer.json (HF/BPE; with tokenizer_config.json + special_tokens_map.json when the
                 tokenizer came from a HF directory) or tokenizer.llmtrain.json (byte): load with
                 ``load_tokenizer(out_dir)``

Design decisions:

- **Streaming**: documents are encoded in batches (HF ``encode_batch`` runs in parallel in
  Rust; ``workers > 1`` adds processes, see :mod:`llmtrain.engine.data.encode`) and appended to
  the token file, so memory is bounded by a few batches (plus one ``.txt`` file, which is a
  single document by definition). The output is byte-identical for any ``workers``.
- **Atomic result, all files together**: the output is built in a hidden sibling directory
  (``.DIR.prepare-PID``) and swapped in by renames at the end, so a failed run (bad JSONL line,
  Ctrl-C) leaves an earlier preparation intact and a re-preparation never leaves a stale file
  of the previous one behind (a byte tokenizer's ``tokenizer.llmtrain.json`` beside a new
  ``tokenizer.json`` would load the wrong tokenizer).
- **Never destroys an input**: ``--out`` must be missing or empty; a directory holding an
  earlier preparation is replaced only with ``--force``, and a directory holding any other file
  is refused even then (it would be deleted along with the old output).
- **Empty documents** (empty string) are skipped and counted in ``meta["skipped_empty_docs"]``:
  they would contribute nothing but an EOS.
- **bpe:VOCAB** reads the inputs twice: once to train the tokenizer, once to encode.
- ``meta.json`` records what determines the tokens (tokenizer, inputs, text field, split), not
  how they were computed (no worker count), so equal inputs give equal bytes.
- Errors are :class:`~llmtrain.errors.LLMTrainError` naming the file (and line or row) and the
  fix; no partial output is published.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from llmtrain.engine.data.encode import encode_stream
from llmtrain.engine.data.inputs import MAX_JSONL_LINE, MAX_TXT_BYTES, SUFFIXES, collect_files, input_size, iter_documents  # noqa: F401
from llmtrain.engine.data.tokenizer import BYTE_FILE, HF_FILE, ByteTokenizer, load_tokenizer, parse_bpe_vocab
from llmtrain.engine.data.tokenizer_config import CONFIG_FILE, SPECIAL_MAP_FILE
from llmtrain.errors import LLMTrainError
from llmtrain.safeio import output_dir

BATCH_DOCS = 1024  # documents per encode_batch call
BATCH_CHARS = 8 << 20  # ... or this many characters, whichever comes first
FORMAT = "llmtrain-tokens"
FORMAT_VERSION = 1
# Every name a preparation writes: an --out directory holding only these is an earlier output.
OUTPUT_NAMES = frozenset({"tokens.bin", "index.npy", "meta.json", HF_FILE, BYTE_FILE, CONFIG_FILE, SPECIAL_MAP_FILE,
                          "tokens.bin.tmp", "index.npy.tmp", "meta.json.tmp"})


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65535), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


# ---------------------------------------------------------------------------------------------
# Progress


@contextmanager
def _progress(enabled: bool, total: int, description: str):
    """Yield ``advance(n_bytes)``: a rich progress bar over bytes read on stderr, or a no-op.

    The bar is shown only when stderr is a terminal: in logs and pipes it would be one stale
    line of noise (and would break the "errors are one line" contract of the CLI).
    """
    console = None
    if enabled:
        from rich.console import Console

        console = Console(stderr=True)
    if console is None or not console.is_terminal:
        yield lambda n: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


# ---------------------------------------------------------------------------------------------
# Prepare


def prepare(inputs: list[Path], out_dir: Path, tokenizer_spec: str, progress: bool = True,
            force: bool = False, *, text_field: str = "text", split: str | None = None, workers: int = 1) -> dict:
    """Tokenize ``inputs`` into ``out_dir`` (tokens.bin, index.npy, meta.json, tokenizer); return the meta.

    ``out_dir`` must be missing or empty, or (with ``force``) hold only an earlier preparation.
    ``text_field`` names the JSON field / column holding the text; ``split`` picks the split of
    a ``DatasetDict.save_to_disk`` directory; ``workers`` encoding processes (>= 1) do not
    change the output."""
    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= 1024:
        raise LLMTrainError(f"--workers {workers!r} is not between 1 and 1024", "pass --workers N, e.g. the number of cores",
                            path="--workers")
    if not isinstance(text_field, str) or not text_field:
        raise LLMTrainError("--text-field is empty", "pass the name of the text field/column, e.g. --text-field text",
                            path="--text-field")
    files = collect_files([Path(p) for p in inputs])
    sizes = [input_size(f, split) for f in files]
    total_bytes = sum(sizes)
    out_dir = output_dir(out_dir, "--out", force, ours=OUTPUT_NAMES)

    def documents(advance):
        for f in files:
            for text, n in iter_documents(f, text_field, split):
                advance(n)
                if text:
                    yield text

    if tokenizer_spec.strip().startswith("bpe:"):
        parse_bpe_vocab(tokenizer_spec.strip())  # fail fast on a bad spec before reading anything
        with _progress(progress, total_bytes, "training BPE") as advance:
            tok = load_tokenizer(tokenizer_spec, train_texts=documents(advance))
    else:
        tok = load_tokenizer(tokenizer_spec)
    dtype = token_dtype(tok.vocab_size)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    build = out_dir.parent / f".{out_dir.name}.prepare-{os.getpid()}"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir()
    tmp_tokens, tmp_index = build / "tokens.bin", build / "index.npy"
    starts: list[int] = []
    n_tokens = 0
    counts = {"empty": 0}

    def batches(advance):
        batch: list[str] = []
        chars = 0
        for f in files:
            for text, n in iter_documents(f, text_field, split):
                advance(n)
                if not text:
                    counts["empty"] += text is not None  # "" is an empty document, None only progress
                    continue
                batch.append(text)
                chars += len(text)
                if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
                    yield batch
                    batch, chars = [], 0
        if batch:
            yield batch

    try:
        with tmp_tokens.open("wb") as sink, _progress(progress, total_bytes, "tokenizing") as advance:
            for data, lengths in encode_stream(tok, batches(advance), dtype, workers):
                for n in lengths:
                    starts.append(n_tokens)
                    n_tokens += n
                sink.write(data)
        if n_tokens == 0:
            raise LLMTrainError(f"no text found in {len(files)} input file(s) ({', '.join(map(str, files[:3]))}{', ...' if len(files) > 3 else ''})",
                                f"give files that contain text: non-empty .txt, .jsonl lines with a non-empty {text_field!r}")
        with tmp_index.open("wb") as f:
            np.save(f, np.asarray(starts, dtype=np.int64))
        meta = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "dtype": dtype.name,
            "n_tokens": n_tokens,
            "n_docs": len(starts),
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
            "bos_id": tok.bos_id if tok.add_bos else None,
            "tokenizer": tokenizer_spec,
            "tokenizer_file": BYTE_FILE if isinstance(tok, ByteTokenizer) else HF_FILE,
            "text_field": text_field,
            "split": split,
            "skipped_empty_docs": counts["empty"],
            "inputs": [{"path": str(f.resolve()), "bytes": s} for f, s in zip(files, sizes)],
        }
        tok.save(build)
        (build / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        _publish(build, out_dir)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return meta


def _publish(build: Path, out_dir: Path) -> None:
    """Swap the finished ``build`` directory in for ``out_dir`` (which, if present, holds only an
    earlier preparation: checked by :func:`output_dir`). Between the two renames ``out_dir`` is
    briefly absent, never a mix of old and new files."""
    if not out_dir.exists():
        os.rename(build, out_dir)
        return
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    os.rename(out_dir, old)
    os.rename(build, out_dir)
    shutil.rmtree(old, ignore_errors=True)
