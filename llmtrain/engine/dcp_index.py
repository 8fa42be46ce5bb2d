"""DCP's checkpoint index (``.metadata``) read without executing code, and checked against ``metadata.json``.

``torch.distributed.checkpoint.FileSystemReader.read_metadata`` is a plain ``pickle.load``: a
crafted ``.metadata`` runs any code its ``__reduce__`` names. :func:`load_index` reads it instead

* as a regular file of at most :data:`INDEX_CAP` bytes (:func:`llmtrain.safeio.read_regular`);
* through :class:`IndexUnpickler`, whose ``find_class`` resolves exactly the globals a torch
  2.13 index holds (see :data:`ALLOWED`: the dataclasses of
  ``torch.distributed.checkpoint.metadata``, ``_StorageInfo``, ``torch.Size``, torch dtypes,
  layouts via ``torch.serialization._get_layout``, ``pathlib.PosixPath`` for
  ``storage_meta.checkpoint_id``) and refuses every other one — no builtins, no functions;
* then checks the object it built (:func:`check_index`) so that nothing DCP does with it can
  leave the checkpoint or allocate more than the files hold:

  - every entry is a tensor (``TensorStorageMetadata``). A ``BytesStorageMetadata`` entry is
    refused: DCP loads bytes entries with ``torch.load(weights_only=False)``, i.e. a pickle that
    runs code, and llmtrain checkpoints never hold one;
  - chunk offsets/sizes lie inside their tensor, their element counts add up to the tensor's
    (so the shapes DCP allocates are bounded by the data on disk), and each chunk has exactly
    one storage entry;
  - every storage entry names a ``*.distcp`` file that ``metadata.json`` lists, with a byte
    range inside its listed size at least as long as the chunk's data, and no stream transforms;
  - ``planner_data`` maps each key to the string path it was flattened from.

A problem raises :class:`LLMTrainError` naming the ``.metadata`` file (one line).
"""

from __future__ import annotations

import io
import math
import pickle
import re
from collections.abc import Mapping
from pathlib import Path, PosixPath

import torch
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md

from llmtrain.errors import LLMTrainError
from llmtrain.safeio import GIB, printable, read_regular

INDEX = ".metadata"
INDEX_CAP = 2 * GIB  # ~150 bytes per chunk: an FSDP checkpoint over 1,024 ranks of a 400B model is ~0.6 GB
HINT = "the checkpoint is damaged or crafted; use another one (--ckpt step-N)"
SHARD_RE = re.compile(r"^[^/]+\.distcp$")
_DTYPES = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}  # vars(): no lazy imports
_DATA_DTYPES = {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                torch.int16, torch.int8, torch.uint8, torch.bool}
ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_md, name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_fs._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): PosixPath,
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
}


class IndexUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only :data:`ALLOWED` globals and torch dtypes."""

    def find_class(self, module: str, name: str):
        found = ALLOWED.get((module, name))
        if found is None and module == "torch" and name in _DTYPES:
            found = _DTYPES[name]
        if found is None:
            raise pickle.UnpicklingError(f"refused global {printable(module, 60)}.{printable(name, 60)} "
                                         "(not a DCP metadata class)")
        return found

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refused persistent id")


def unpickle_index(raw: bytes, where: str):
    try:
        return IndexUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # noqa: BLE001  (only allow-listed callables ran: any failure means "corrupt")
        raise LLMTrainError(f"{where}: not a DCP index this llmtrain reads ({type(exc).__name__}: "
                            f"{printable(exc, 160)})", HINT, path="--ckpt") from None


def _size(value, what: str) -> tuple[int, ...]:
    if type(value) is not torch.Size or not all(type(d) is int and 0 <= d < 2**62 for d in value):
        raise ValueError(f"{what} is not a torch.Size of non-negative ints")
    return tuple(value)


def _check_tensor(fqn: str, md, storage: Mapping, files: Mapping, used: set) -> None:
    if type(md) is dcp_md.BytesStorageMetadata:
        raise ValueError(f"entry {fqn!r} is a pickled object, not a tensor (llmtrain checkpoints hold tensors only)")
    if type(md) is not dcp_md.TensorStorageMetadata:
        raise ValueError(f"entry {fqn!r} is a {type(md).__name__}")
    props = md.properties
    if type(props) is not dcp_md.TensorProperties or props.dtype not in _DATA_DTYPES or props.layout != torch.strided:
        raise ValueError(f"entry {fqn!r}: unsupported tensor properties")
    size = _size(md.size, f"entry {fqn!r} size")
    if len(size) > 8 or type(md.chunks) is not list or not md.chunks:
        raise ValueError(f"entry {fqn!r}: more than 8 dimensions or no chunks")
    itemsize, total = props.dtype.itemsize, 0
    for chunk in md.chunks:
        if type(chunk) is not dcp_md.ChunkStorageMetadata:
            raise ValueError(f"entry {fqn!r}: a chunk is a {type(chunk).__name__}")
        offsets, sizes = _size(chunk.offsets, f"{fqn!r} chunk offsets"), _size(chunk.sizes, f"{fqn!r} chunk sizes")
        if len(offsets) != len(size) or len(sizes) != len(size) or any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise ValueError(f"entry {fqn!r}: chunk at {list(offsets)} of {list(sizes)} outside the tensor {list(size)}")
        key = dcp_md.MetadataIndex(fqn, offsets)
        info = storage.get(key)
        if info is None or key in used:
            raise ValueError(f"entry {fqn!r}: chunk at {list(offsets)} has no (or a second) storage entry")
        used.add(key)
        numel = math.prod(sizes)
        _check_storage(fqn, info, files, numel * itemsize)
        total += numel
    if total != math.prod(size):
        raise ValueError(f"entry {fqn!r}: chunks hold {total} elements, the tensor {list(size)} has {math.prod(size)}")


def _check_storage(fqn: str, info, files: Mapping, nbytes: int) -> None:
    if type(info) is not dcp_fs._StorageInfo:
        raise ValueError(f"entry {fqn!r}: storage is a {type(info).__name__}")
    rel, offset, length = info.relative_path, info.offset, info.length
    if type(rel) is not str or not SHARD_RE.match(rel) or rel not in files:
        raise ValueError(f"entry {fqn!r} is stored in {printable(repr(rel), 80)}, not a *.distcp file listed "
                         "in metadata.json")
    if type(offset) is not int or type(length) is not int or offset < 0 or length < nbytes:
        raise ValueError(f"entry {fqn!r}: byte range {offset!r}+{length!r} shorter than its {nbytes} bytes of data")
    if offset + length > files[rel].bytes:
        raise ValueError(f"entry {fqn!r}: byte range {offset}+{length} past the end of {rel} ({files[rel].bytes} bytes)")
    if getattr(info, "transform_descriptors", None):
        raise ValueError(f"entry {fqn!r}: stream transforms {printable(info.transform_descriptors, 60)} are not supported")


def check_index(index, files: Mapping) -> None:
    """Raise ``ValueError`` (why) unless ``index`` is a DCP ``Metadata`` that only names listed
    shard files (``files``: ``metadata.json``'s entries) and tensors (see the module docstring)."""
    if type(index) is not dcp_md.Metadata:
        raise ValueError(f"the index is a {type(index).__name__}, not DCP Metadata")
    entries, storage, planner = index.state_dict_metadata, index.storage_data, index.planner_data
    if type(entries) is not dict or not all(type(k) is str for k in entries):
        raise ValueError("state_dict_metadata is not a dict of names")
    if type(storage) is not dict or not all(type(k) is dcp_md.MetadataIndex for k in storage):
        raise ValueError("storage_data is not a dict of MetadataIndex")
    used: set = set()
    for fqn, md in entries.items():
        _check_tensor(fqn, md, storage, files, used)
    if len(used) != len(storage):
        raise ValueError(f"storage_data has {len(storage) - len(used)} entries no tensor chunk uses")
    if planner is not None:
        if type(planner) is not dict or set(planner) - set(entries):
            raise ValueError("planner_data is not a dict of the index's keys")
        for fqn, path in planner.items():
            if type(path) not in (tuple, list) or not all(type(p) is str for p in path) or ".".join(path) != fqn:
                raise ValueError(f"planner_data[{fqn!r}] is not the string path of {fqn!r}")
    meta = index.storage_meta
    if meta is not None and type(meta) is not dcp_md.StorageMeta:
        raise ValueError(f"storage_meta is a {type(meta).__name__}")
    if index.version is not None and type(index.version) is not str:
        raise ValueError("version is not a string")


def load_index(ckpt_dir: str | Path, files: Mapping):
    """DCP's ``Metadata`` of ``ckpt_dir``, read through the allow-list and checked against
    ``files`` (``metadata.json``'s entries, already verified). :class:`LLMTrainError` names it."""
    path = Path(ckpt_dir) / INDEX
    where = printable(path)
    if INDEX not in files:
        raise LLMTrainError(f"{where}: not listed in metadata.json", HINT, path="--ckpt")
    try:
        raw = read_regular(path, "DCP index", INDEX_CAP, field="--ckpt", hint=HINT)
    except LLMTrainError as exc:
        msg = exc.problems[0].message
        raise LLMTrainError(msg if where in msg else f"{where}: {msg}", HINT, path="--ckpt") from None
    index = unpickle_index(raw, where)
    try:
        check_index(index, files)
    except (ValueError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
        raise LLMTrainError(f"{where}: {printable(exc, 240)}", HINT, path="--ckpt") from None
    return index
