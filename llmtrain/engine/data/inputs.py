"""Inputs of ``llmtrain data prepare``: finding them, and reading documents out of each.

Supported inputs (``--text-field`` names the text field/column, default ``text``):

- ``.txt``: the whole file is one document (read whole, at most ``MAX_TXT_BYTES``);
- ``.jsonl``: one JSON object per line, the text field is a document; blank lines are skipped;
- ``.parquet``: one document per row of the text column (pyarrow, one row group at a time);
- through the ``datasets`` library (:mod:`llmtrain.engine.data.inputs_hf`, extra
  ``llmtrain[datasets]``): ``.arrow`` files (as ``datasets`` writes them), ``.json`` (JSON lines
  or one JSON array), ``.json.gz`` / ``.jsonl.gz``, and directories written by
  ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (``--split`` picks a split);
- other directories: searched recursively for all of the above, in sorted path order (other
  files ignored); a ``save_to_disk`` directory found inside is one input (its ``.arrow`` shards
  are not read again as files).

Design decisions:

- ``.jsonl`` and ``.parquet`` keep their own readers rather than going through ``datasets``:
  no extra dependency, ``file:line`` / row numbers in every error, a bounded line size, and one
  row group in memory. Files that ``datasets`` writes (``to_json``, ``to_parquet``) are read
  identically (tested).
- Each reader yields ``(text, bytes)`` pairs: ``text`` None means "no document, only progress"
  (a blank line, the tail of a file); bytes drive the progress bar.
- Bounded reads: inputs must be regular files (a FIFO or device is refused, not read).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator

from llmtrain.engine.data import inputs_hf
from llmtrain.errors import LLMTrainError
from llmtrain.safeio import GIB, MIB, human_bytes, open_regular, printable

BUILTIN_SUFFIXES = (".txt", ".jsonl", ".parquet")
SUFFIXES = BUILTIN_SUFFIXES + inputs_hf.SUFFIXES
SHOWN_TYPES = ".txt, .jsonl, .parquet, .arrow, .json(.gz) files or save_to_disk directories"
MAX_TXT_BYTES = 2 * GIB  # one .txt is one document, held in memory whole
MAX_JSONL_LINE = 256 * MIB


def input_suffix(path: Path) -> str | None:
    """The supported suffix ``path`` ends with (``.jsonl.gz`` counts as one), or None."""
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def _expand_dir(path: Path) -> list[Path]:
    if inputs_hf.is_saved_dataset(path):
        return [path]
    saved = []
    for d in sorted(p for p in path.rglob("*") if p.is_dir()):
        if not any(s in d.parents for s in saved) and inputs_hf.is_saved_dataset(d):
            saved.append(d)
    files = [p for p in path.rglob("*") if p.is_file() and input_suffix(p) and not any(s in p.parents for s in saved)]
    return sorted(files + saved)


def collect_files(inputs: list[Path]) -> list[Path]:
    """Expand directories (recursively, sorted) and check every input exists and is supported."""
    if not inputs:
        raise LLMTrainError("no input files given", f"pass {SHOWN_TYPES}, or directories of them")
    files: list[Path] = []
    for raw in inputs:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = _expand_dir(path)
            if not found:
                raise LLMTrainError(f"{printable(path)}: directory holds no supported input ({SHOWN_TYPES})",
                                    "point at a directory with such files, or list the files")
            files.extend(found)
        elif path.exists():
            if not path.is_file():
                raise LLMTrainError(f"{printable(path)}: not a regular file (a FIFO, device or socket)",
                                    "pass regular .txt, .jsonl or .parquet files")
            if input_suffix(path) is None:
                raise LLMTrainError(f"{printable(path)}: unsupported file type {path.suffix or '(no extension)'!r}",
                                    "use .txt (one document per file), .jsonl (field 'text'), .parquet (column 'text'), "
                                    ".arrow, .json or .json.gz (datasets)")
            files.append(path)
        else:
            raise LLMTrainError(f"{printable(path)}: no such file or directory", "check the input path")
    return files


def input_size(path: Path, split: str | None = None) -> int:
    """Bytes of one input (a saved dataset: its chosen split's shards): the progress total."""
    if path.is_dir():
        return inputs_hf.saved_dataset_size(path, split)
    return path.stat().st_size


# A JSON escape of a UTF-16 surrogate: \ud800-\udfff. json.loads pairs a high and a low escape into one
# character, but an unpaired one becomes a lone surrogate in the str, which is not Unicode: UTF-8
# cannot encode it and HF tokenizers refuse it (TypeError / UnicodeEncodeError deep in a tokenizer,
# seen in data prepare and in fine-tuning data; scraped text cut inside an emoji's pair has them).
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
SURROGATE_HINT = "fix or drop the line (text cut between the two halves of an escaped pair, e.g. an emoji)"


def lone_surrogate(line: bytes, value: object) -> bool:
    """Whether ``value`` (``json.loads(line)``, any nesting, keys too) holds an unpaired surrogate.
    Only lines with a surrogate escape are checked (a byte search), so valid lines cost nothing."""
    if SURROGATE_ESCAPE.search(line) is None:
        return False
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _read_txt(path: Path, text_field: str = "text") -> Iterator[tuple[str | None, int]]:
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


def _read_jsonl(path: Path, text_field: str = "text") -> Iterator[tuple[str | None, int]]:
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
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                what = f"has no string field {text_field!r}" if isinstance(record, dict) else f"is a {type(record).__name__}, not an object"
                raise LLMTrainError(f"{path}:{lineno}: JSON line {what}",
                                    f'each line must be one JSON object like {{"{text_field}": "..."}} (or pass --text-field NAME)')
            if lone_surrogate(line, record[text_field]):
                raise LLMTrainError(f"{printable(path)}:{lineno}: field {text_field!r} holds an unpaired surrogate escape "
                                    "(\\ud800-\\udfff), which is not Unicode text", SURROGATE_HINT)
            yield record[text_field], len(line)


def _read_parquet(path: Path, text_field: str = "text") -> Iterator[tuple[str | None, int]]:
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
    if text_field not in pf.schema_arrow.names:
        raise LLMTrainError(f"{path}: no column {text_field!r} (columns: {printable(', '.join(pf.schema_arrow.names))})",
                            "pass --text-field COLUMN naming the text column")
    size = path.stat().st_size
    n_groups = pf.num_row_groups
    row = 0
    done = 0
    for g in range(n_groups):
        column = pf.read_row_group(g, columns=[text_field]).column(text_field)
        texts = column.to_pylist()
        target = size * (g + 1) // n_groups  # progress by bytes, attributed per row group
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise LLMTrainError(f"{path}: row {row + i}: {text_field!r} is {'null' if text is None else type(text).__name__}, not a string",
                                    "drop or fill null rows, and store text as a string column")
            step = target - done if i == len(texts) - 1 else 0
            done += step
            yield text, step
        row += len(texts)
    if done < size:
        yield None, size - done


READERS: dict[str, Callable[..., Iterator[tuple[str | None, int]]]] = {
    ".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet,
}


def iter_documents(path: Path, text_field: str = "text", split: str | None = None) -> Iterator[tuple[str | None, int]]:
    """Yield ``(text, bytes_read_since_last)`` per document of one input; text None = bytes only, no document."""
    if path.is_dir():
        return inputs_hf.read_saved(path, text_field, split)
    suffix = input_suffix(path)
    if suffix in READERS:
        return READERS[suffix](path, text_field)
    return inputs_hf.read_file(path, text_field)
