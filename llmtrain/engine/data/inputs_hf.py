"""Inputs read through Hugging Face ``datasets``: ``.arrow``, ``.json(.gz)`` files and ``save_to_disk`` directories.

``datasets`` is an optional extra (``pip install 'llmtrain[datasets]'``): it is imported only
when such an input is given, and its absence is a one-line error naming the extra.

- ``.arrow`` (the Arrow stream files ``datasets`` writes) -> ``Dataset.from_file``: memory-mapped,
  read ``BATCH_ROWS`` rows at a time, so memory stays bounded whatever the file size.
- ``.json`` / ``.json.gz`` / ``.jsonl.gz`` -> ``load_dataset("json", ..., streaming=True)``: an
  ``IterableDataset`` read in batches, nothing cached on disk. JSON *lines* stream in blocks; a
  file holding one JSON array is parsed whole by ``datasets`` (use JSON lines for big corpora).
- a ``Dataset.save_to_disk`` directory (``state.json`` + ``dataset_info.json`` + ``*.arrow``) ->
  ``load_from_disk`` (memory-mapped); a ``DatasetDict.save_to_disk`` directory
  (``dataset_dict.json`` + one such directory per split) needs ``--split`` unless it holds a
  single split. A single saved ``Dataset`` is read whole (``--split`` does not apply to it).

Design decisions:

- **Untrusted directory, checked before ``datasets`` sees it**: ``dataset_dict.json`` and
  ``state.json`` are read through :mod:`llmtrain.safeio` (regular files, capped) and every split
  name and shard file name they list must be a plain name that resolves inside the directory
  (``"../../etc/x.arrow"`` or a symlink out is refused), each shard a regular file. Nothing in
  these formats executes code (JSON metadata and Arrow data; no dataset scripts are involved:
  only the packaged ``json`` builder is used, on local files).
- ``datasets``' own progress bars are turned off; ``data prepare`` shows one bar over bytes.
  For a memory-mapped dataset the bytes are attributed by rows read; a streamed JSON file
  reports its bytes when it ends.
- Only the text column is selected (``select_columns``) and the format reset to plain Python,
  so other columns are never decoded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from llmtrain.errors import LLMTrainError
from llmtrain.safeio import MIB, inside, open_regular, printable, read_json_object

SUFFIXES = (".arrow", ".json", ".json.gz", ".jsonl.gz")
BATCH_ROWS = 1024
MAX_STATE_BYTES = 16 * MIB  # state.json / dataset_dict.json list shard names: small
MAX_INFO_BYTES = 64 * MIB  # dataset_info.json: features and descriptions
EXTRA_HINT = "pip install 'llmtrain[datasets]' (or pip install datasets)"
SAVED_HINT = "pass a directory written by Dataset.save_to_disk / DatasetDict.save_to_disk"


def import_datasets(path: Path):
    try:
        import datasets
    except ImportError:
        raise LLMTrainError(f"{printable(path)}: reading it needs the 'datasets' package, which is not installed",
                            EXTRA_HINT) from None
    datasets.disable_progress_bars()
    return datasets


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return printable(text.splitlines()[0] if text else type(exc).__name__, 160)


def is_saved_dataset(directory: Path) -> bool:
    """Whether ``directory`` looks like ``save_to_disk`` output (a Dataset or a DatasetDict)."""
    d = Path(directory)
    return (d / "dataset_dict.json").is_file() or ((d / "state.json").is_file() and (d / "dataset_info.json").is_file())


def _load_json(path: Path, what: str, cap: int) -> dict:
    return read_json_object(path, what, cap, hint=SAVED_HINT)


def _plain_name(name: object) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\x00" not in name)


def _resolve_split(directory: Path, split: str | None) -> Path:
    """The saved-``Dataset`` directory to read: ``directory`` itself, or its split ``split``."""
    dict_file = directory / "dataset_dict.json"
    if not dict_file.is_file():
        return directory
    splits = _load_json(dict_file, "dataset_dict.json", MAX_STATE_BYTES).get("splits")
    if not isinstance(splits, list) or not splits or not all(_plain_name(s) for s in splits):
        raise LLMTrainError(f"{printable(dict_file)}: 'splits' is not a list of plain split names", SAVED_HINT)
    shown = ", ".join(printable(s, 40) for s in splits)
    if split is None:
        if len(splits) > 1:
            raise LLMTrainError(f"{printable(directory)}: a DatasetDict with splits {shown}", "pass --split NAME")
        split = splits[0]
    if split not in splits:
        raise LLMTrainError(f"{printable(directory)}: no split {printable(split, 40)!r} (splits: {shown})",
                            f"pass --split with one of: {shown}")
    sub = directory / split
    if not inside(directory, sub) or not sub.is_dir() or not is_saved_dataset(sub):
        raise LLMTrainError(f"{printable(sub)}: split directory missing or not a saved dataset", SAVED_HINT)
    return sub


def _shards(directory: Path) -> list[Path]:
    """The ``.arrow`` shards ``state.json`` lists, each checked to be a regular file inside ``directory``."""
    state_file = directory / "state.json"
    state = _load_json(state_file, "state.json", MAX_STATE_BYTES)
    entries = state.get("_data_files")
    if not isinstance(entries, list) or not entries:
        raise LLMTrainError(f"{printable(state_file)}: '_data_files' is not a non-empty list", SAVED_HINT)
    shards = []
    for entry in entries:
        name = entry.get("filename") if isinstance(entry, dict) else None
        if not _plain_name(name) or not inside(directory, directory / name):
            raise LLMTrainError(f"{printable(state_file)}: shard {printable(name, 60)!r} is not a plain file name "
                                "inside the directory", "the dataset directory is corrupt or crafted; write it again with save_to_disk")
        path = directory / name
        f, _ = open_regular(path, "dataset shard", field=printable(path), hint=SAVED_HINT)
        f.close()
        shards.append(path)
    _load_json(directory / "dataset_info.json", "dataset_info.json", MAX_INFO_BYTES)
    return shards


def saved_dataset_size(directory: Path, split: str | None) -> int:
    """Bytes of the shards that will be read (the progress total)."""
    return sum(p.stat().st_size for p in _shards(_resolve_split(Path(directory), split)))


def _guard(batches: Iterable, path: Path) -> Iterator:
    """``batches`` with any library error (corrupt Arrow, bad JSON) turned into one line naming ``path``."""
    it = iter(batches)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except LLMTrainError:
            raise
        except Exception as exc:  # pyarrow / datasets raise many types with long messages
            raise LLMTrainError(f"{printable(path)}: cannot read it ({_first_line(exc)})",
                                "check the file is complete and was written by datasets / pyarrow") from None
        yield batch


def _texts(batch: dict, field: str, path: Path, row: int) -> list[str]:
    if field not in batch:
        raise LLMTrainError(f"{printable(path)}: no field {field!r} (fields: {printable(', '.join(map(str, batch)), 120)})",
                            "pass --text-field NAME naming the text column")
    texts = batch[field]
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise LLMTrainError(f"{printable(path)}: row {row + i}: {field!r} is "
                                f"{'null' if text is None else type(text).__name__}, not a string",
                                "drop or fill null rows, store text as a string column, or pass --text-field NAME")
    return texts


def _iter_mapped(ds, field: str, path: Path, total: int) -> Iterator[tuple[str | None, int]]:
    """Rows of a memory-mapped ``Dataset``, ``BATCH_ROWS`` at a time; bytes attributed by rows."""
    if field not in ds.column_names:
        raise LLMTrainError(f"{printable(path)}: no column {field!r} (columns: {printable(', '.join(ds.column_names), 120)})",
                            "pass --text-field COLUMN naming the text column")
    ds = ds.select_columns([field]).with_format(None)
    n_rows = max(ds.num_rows, 1)
    row = done = 0
    for batch in _guard(ds.iter(batch_size=BATCH_ROWS), path):
        texts = _texts(batch, field, path, row)
        row += len(texts)
        step = total * row // n_rows - done
        done += step
        for i, text in enumerate(texts):
            yield text, step if i == len(texts) - 1 else 0
    if done < total:
        yield None, total - done


def read_saved(directory: Path, field: str, split: str | None) -> Iterator[tuple[str | None, int]]:
    """Documents of a ``save_to_disk`` directory (one split of a DatasetDict)."""
    directory = Path(directory)
    sub = _resolve_split(directory, split)
    total = sum(p.stat().st_size for p in _shards(sub))
    datasets = import_datasets(directory)
    try:
        ds = datasets.load_from_disk(str(sub))
    except Exception as exc:
        raise LLMTrainError(f"{printable(sub)}: not a readable saved dataset ({_first_line(exc)})", SAVED_HINT) from None
    if not isinstance(ds, datasets.Dataset):
        raise LLMTrainError(f"{printable(sub)}: not a single saved dataset", SAVED_HINT)
    yield from _iter_mapped(ds, field, sub, total)


def read_file(path: Path, field: str) -> Iterator[tuple[str | None, int]]:
    """Documents of one ``.arrow`` or ``.json(.gz)`` file."""
    path = Path(path)
    f, size = open_regular(path, "input file", field=printable(path))  # refuses FIFOs/devices before datasets opens it
    f.close()
    datasets = import_datasets(path)
    if path.name.lower().endswith(".arrow"):
        try:
            ds = datasets.Dataset.from_file(str(path))
        except Exception as exc:
            raise LLMTrainError(f"{printable(path)}: not a readable Arrow file ({_first_line(exc)})",
                                "pass .arrow files written by datasets (Arrow stream format)") from None
        yield from _iter_mapped(ds, field, path, size)
        return
    try:
        stream = datasets.load_dataset("json", data_files=[str(path)], split="train", streaming=True)
    except Exception as exc:
        raise LLMTrainError(f"{printable(path)}: cannot read it as JSON ({_first_line(exc)})",
                            'write JSON lines like {"text": "..."}') from None
    row = 0
    for batch in _guard(stream.iter(batch_size=BATCH_ROWS), path):
        texts = _texts(batch, field, path, row)
        row += len(texts)
        for text in texts:
            yield text, 0
    yield None, size
