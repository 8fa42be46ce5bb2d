"""``llmtrain data prepare``: tokenize text files into one memory-mappable token file.

Inputs are ``.txt`` (the whole file is one document), ``.jsonl`` (one JSON object per line,
its ``text`` field is a document; blank lines are skipped), ``.parquet`` (column ``text``, one
document per row; needs pyarrow) and directories (searched recursively for those extensions,
in sorted path order, other files ignored). The output directory gets::

    tokens.bin   all documents' token ids concatenated, each followed by the EOS id when the
                 tokenizer has one (byte has none); uint16 when vocab_size <= 65535, else uint32
    index.npy    int64 start offset of every document in tokens.bin (document i spans
                 index[i] .. index[i+1] or n_tokens, including its trailing EOS)
    meta.json    dtype, n_tokens, n_docs, vocab_size, eos_id, tokenizer spec, inputs + sizes
    tokenizer.json (HF/BPE) or tokenizer.llmtrain.json (byte): load with ``load_tokenizer(out_dir)``

Design decisions:

- **Streaming**: documents are encoded in batches (HF ``encode_batch`` runs in parallel in
  Rust) and appended to the token file, so memory is bounded by one batch (plus one ``.txt``
  file, which is a single document by definition).
- **Atomic result, all files together**: the output is built in a hidden sibling directory
  (``.DIR.prepare-PID``) and swapped in by renames at the end, so a failed run (bad JSONL line,
  Ctrl-C) leaves an earlier preparation intact and a re-preparation never leaves a stale file
  of the previous one behind (a byte tokenizer's ``tokenizer.llmtrain.json`` beside a new
  ``tokenizer.json`` would load the wrong tokenizer).
- **Never destroys an input**: ``--out`` must be missing or empty; a directory holding an
  earlier preparation is replaced only with ``--force``, and a directory holding any other file
  is refused even then (it would be deleted along with the old output).
- **Bounded reads**: inputs must be regular files (a FIFO or device is refused, not read); a
  ``.txt`` is read whole up to ``MAX_TXT_BYTES``, a ``.jsonl`` line up to ``MAX_JSONL_LINE``.
- **Empty documents** (empty string) are skipped and counted in ``meta["skipped_empty_docs"]``:
  they would contribute nothing but an EOS.
- **bpe:VOCAB** reads the inputs twice: once to train the tokenizer, once to encode.
- Errors are :class:`~llmtrain.errors.LLMTrainError` naming the file (and line or row) and the
  fix; no partial output is published.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from llmtrain.engine.data.tokenizer import BYTE_FILE, HF_FILE, ByteTokenizer, load_tokenizer, parse_bpe_vocab
from llmtrain.errors import LLMTrainError
from llmtrain.safeio import GIB, MIB, human_bytes, open_regular, output_dir, printable

SUFFIXES = (".txt", ".jsonl", ".parquet")
BATCH_DOCS = 1024  # documents per encode_batch call
BATCH_CHARS = 8 << 20  # ... or this many characters, whichever comes first
FORMAT = "llmtrain-tokens"
FORMAT_VERSION = 1
MAX_TXT_BYTES = 2 * GIB  # one .txt is one document, held in memory whole
MAX_JSONL_LINE = 256 * MIB
# Every name a preparation writes: an --out directory holding only these is an earlier output.
OUTPUT_NAMES = frozenset({"tokens.bin", "index.npy", "meta.json", HF_FILE, BYTE_FILE,
                          "tokens.bin.tmp", "index.npy.tmp", "meta.json.tmp"})


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65535), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


# ---------------------------------------------------------------------------------------------
# Inputs


def collect_files(inputs: list[Path]) -> list[Path]:
    """Expand directories (recursively, sorted) and check every input exists and is supported."""
    if not inputs:
        raise LLMTrainError("no input files given", "pass .txt, .jsonl or .parquet files or directories")
    files: list[Path] = []
    for raw in inputs:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES)
            if not found:
                raise LLMTrainError(f"{printable(path)}: directory holds no .txt, .jsonl or .parquet files",
                                    "point at a directory with such files, or list the files")
            files.extend(found)
        elif path.exists():
            if not path.is_file():
                raise LLMTrainError(f"{printable(path)}: not a regular file (a FIFO, device or socket)",
                                    "pass regular .txt, .jsonl or .parquet files")
            if path.suffix.lower() not in SUFFIXES:
                raise LLMTrainError(f"{printable(path)}: unsupported file type {path.suffix or '(no extension)'!r}",
                                    "use .txt (one document per file), .jsonl (field 'text') or .parquet (column 'text')")
            files.append(path)
        else:
            raise LLMTrainError(f"{printable(path)}: no such file or directory", "check the input path")
    return files


def _read_txt(path: Path) -> Iterator[tuple[str | None, int]]:
    f, _ = open_regular(path, "input file", MAX_TXT_BYTES, field=printable(path),
                        hint=f"a .txt is one document (at most {human_bytes(MAX_TXT_BYTES)}); split it or use .jsonl")
    with f:
        data = f.read(MAX_TXT_BYTES + 1)
    if len(data) > MAX_TXT_BYTES:
        raise LLMTrainError(f"{printable(path)}: over the {human_bytes(MAX_TXT_BYTES)} limit for one .txt document",
                            "split it or use .jsonl")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LLMTrainError(f"{path}: not UTF-8 text (byte offset {exc.start})",
                            "convert the file to UTF-8, e.g. iconv -f latin1 -t utf-8") from None
    yield text, len(data)


def _read_jsonl(path: Path) -> Iterator[tuple[str | None, int]]:
    f, _ = open_regular(path, "input file", field=printable(path))
    with f:
        for lineno, line in enumerate(iter(lambda: f.readline(MAX_JSONL_LINE + 1), b""), start=1):
            if len(line) > MAX_JSONL_LINE:
                raise LLMTrainError(f"{printable(path)}:{lineno}: line over the {human_bytes(MAX_JSONL_LINE)} limit",
                                    "write one document per line, each under the limit")
            if not line.strip():
                yield None, len(line)  # blank line: no document
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
                reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
                raise LLMTrainError(f"{path}:{lineno}: invalid JSON ({reason})",
                                    'each line must be one JSON object like {"text": "..."}') from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                what = "has no string field 'text'" if isinstance(record, dict) else f"is a {type(record).__name__}, not an object"
                raise LLMTrainError(f"{path}:{lineno}: JSON line {what}",
                                    'each line must be one JSON object like {"text": "..."}')
            yield record["text"], len(line)


def _read_parquet(path: Path) -> Iterator[tuple[str | None, int]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise LLMTrainError(f"{path}: reading .parquet needs pyarrow, which is not installed",
                            "pip install pyarrow (or llmtrain[parquet]), or convert to .jsonl") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError with long messages
        raise LLMTrainError(f"{path}: not a readable parquet file ({str(exc).splitlines()[0]})",
                            "check the file is complete parquet") from None
    if "text" not in pf.schema_arrow.names:
        raise LLMTrainError(f"{path}: no column 'text' (columns: {', '.join(pf.schema_arrow.names)})",
                            "rename the text column to 'text'")
    size = path.stat().st_size
    n_groups = pf.num_row_groups
    row = 0
    done = 0
    for g in range(n_groups):
        column = pf.read_row_group(g, columns=["text"]).column("text")
        texts = column.to_pylist()
        target = size * (g + 1) // n_groups  # progress by bytes, attributed per row group
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise LLMTrainError(f"{path}: row {row + i}: 'text' is {'null' if text is None else type(text).__name__}, not a string",
                                    "drop or fill null rows, and store text as a string column")
            step = target - done if i == len(texts) - 1 else 0
            done += step
            yield text, step
        row += len(texts)
    if done < size:
        yield None, size - done


READERS: dict[str, Callable[[Path], Iterator[tuple[str | None, int]]]] = {
    ".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet,
}


def iter_documents(path: Path) -> Iterator[tuple[str | None, int]]:
    """Yield ``(text, bytes_read_since_last)`` per document of one file; text None = bytes only, no document."""
    return READERS[path.suffix.lower()](path)


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


def _encode(tok, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, list[int]]:
    """Encode a batch: the concatenated ids (EOS after each document) and each document's length."""
    eos = tok.eos_id
    if isinstance(tok, ByteTokenizer):
        arrays = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    else:
        arrays = [np.asarray(ids, dtype=np.int64) for ids in tok.encode_batch(texts)]
    if eos is not None:
        tail = np.array([eos], dtype=np.int64)
        arrays = [np.concatenate([a, tail]) for a in arrays]
    lengths = [len(a) for a in arrays]
    flat = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.empty(0, dtype)
    return flat, lengths


def prepare(inputs: list[Path], out_dir: Path, tokenizer_spec: str, progress: bool = True,
            force: bool = False) -> dict:
    """Tokenize ``inputs`` into ``out_dir`` (tokens.bin, index.npy, meta.json, tokenizer); return the meta.
    ``out_dir`` must be missing or empty, or (with ``force``) hold only an earlier preparation."""
    files = collect_files([Path(p) for p in inputs])
    sizes = [f.stat().st_size for f in files]
    total_bytes = sum(sizes)
    out_dir = output_dir(out_dir, "--out", force, ours=OUTPUT_NAMES)

    def documents(advance):
        for f in files:
            for text, n in iter_documents(f):
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
    n_empty = 0
    try:
        with tmp_tokens.open("wb") as sink, _progress(progress, total_bytes, "tokenizing") as advance:
            batch: list[str] = []
            chars = 0

            def flush():
                nonlocal n_tokens, chars
                flat, lengths = _encode(tok, batch, dtype)
                for n in lengths:
                    starts.append(n_tokens)
                    n_tokens += n
                sink.write(flat.tobytes())
                batch.clear()
                chars = 0

            for f in files:
                for text, n in iter_documents(f):
                    advance(n)
                    if not text:
                        n_empty += text is not None  # "" is an empty document, None only progress
                        continue
                    batch.append(text)
                    chars += len(text)
                    if len(batch) >= BATCH_DOCS or chars >= BATCH_CHARS:
                        flush()
            if batch:
                flush()
        if n_tokens == 0:
            raise LLMTrainError(f"no text found in {len(files)} input file(s) ({', '.join(map(str, files[:3]))}{', ...' if len(files) > 3 else ''})",
                                "give files that contain text: non-empty .txt, .jsonl lines with a non-empty 'text'")
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
            "tokenizer": tokenizer_spec,
            "tokenizer_file": BYTE_FILE if isinstance(tok, ByteTokenizer) else HF_FILE,
            "skipped_empty_docs": n_empty,
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
