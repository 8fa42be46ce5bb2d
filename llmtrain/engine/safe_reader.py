"""Reading a verified checkpoint's tensors without executing code or leaving the directory.

:class:`SafeReader` is torch's own ``FileSystemReader`` with three changes:

* ``read_metadata`` returns the index that :func:`llmtrain.engine.dcp_index.load_index` read
  through the allow-list unpickler and checked against ``metadata.json`` *before* DCP runs
  (so it can never fail inside DCP, whose fallback would read a per-rank ``__R.metadata``
  and log a traceback). Its signature takes no ``rank`` keyword, so DCP never tries that
  fallback;
* ``read_data`` reads one shard file at a time, refuses byte (pickled object) items — DCP
  would ``torch.load(weights_only=False)`` them — and turns any failure into a one-line
  :class:`LLMTrainError` naming the shard (tensors themselves are read by DCP with
  ``torch.load(weights_only=True)``);
* ``reset`` cannot point it at another directory.

:func:`dcp_guard` turns what DCP raises (``CheckpointException``, whose text is a traceback)
into one :class:`LLMTrainError` line. :func:`load_rng` reads a rank's ``rng/rank-R.pt``
(listed in ``metadata.json``, regular, capped) with ``torch.load(weights_only=True)`` and
checks its shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from llmtrain.engine.dcp_index import HINT, load_index
from llmtrain.errors import LLMTrainError
from llmtrain.safeio import MIB, printable, read_regular

RNG_CAP = 16 * MIB
DCP_FAILURES = (RuntimeError, ValueError, KeyError, IndexError, TypeError, AssertionError, OSError, EOFError,
                pickle.UnpicklingError)


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {printable(str(exc).splitlines()[0] if str(exc) else '', 200)}"


class SafeReader(FileSystemReader):
    """A ``FileSystemReader`` over a checkpoint whose ``metadata.json`` was verified (``files``:
    its entries, name -> object with ``.bytes``). Raises :class:`LLMTrainError` at construction
    when ``.metadata`` is not a DCP index this llmtrain reads."""

    def __init__(self, path: str | Path, files: Mapping) -> None:
        super().__init__(path)
        self.dir = Path(path)
        self.index = load_index(self.dir, files)

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id is not None and Path(checkpoint_id) != self.dir:
            raise LLMTrainError(f"{printable(self.dir)}: the reader cannot be moved to {printable(checkpoint_id)}")
        super().reset(None)

    def read_metadata(self):  # no **kwargs: DCP must not fall back to a per-rank index
        self.index.storage_meta = self.index.storage_meta or StorageMeta()
        self.index.storage_meta.load_id = self.load_id
        return self.index

    def read_data(self, plan, planner) -> Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            info = self.storage_data.get(item.storage_index)
            if info is None or item.type == LoadItemType.BYTE_IO:
                raise LLMTrainError(f"{printable(self.dir / '.metadata')}: a read of "
                                    f"{printable(item.storage_index.fqn, 80)} that is not a tensor chunk of the index",
                                    HINT, path="--ckpt")
            per_file.setdefault(info.relative_path, []).append(item)
        for rel, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except LLMTrainError:
                raise
            except DCP_FAILURES as exc:
                raise LLMTrainError(f"{printable(self.dir / rel)}: unreadable shard ({_one_line(exc)})", HINT,
                                    path="--ckpt") from exc
        done: Future = Future()
        done.set_result(None)
        return done


def _cause(exc: CheckpointException) -> BaseException:
    for failure in exc.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return inner
    return exc


@contextlib.contextmanager
def dcp_guard(path: str | Path) -> Iterator[None]:
    """Run a DCP load; its failures become one :class:`LLMTrainError` line naming ``path``
    (an :class:`LLMTrainError` from :class:`SafeReader` passes through unchanged)."""
    try:
        yield
    except CheckpointException as exc:
        cause = _cause(exc)
        if isinstance(cause, LLMTrainError):
            raise LLMTrainError(cause.problems) from None
        raise LLMTrainError(f"{printable(path)}: DCP could not load it ({_one_line(cause)})", HINT,
                            path="--ckpt") from cause
    except DCP_FAILURES as exc:
        raise LLMTrainError(f"{printable(path)}: DCP could not load it ({_one_line(exc)})", HINT, path="--ckpt") from exc


def load_rng(path: str | Path, rel: str, files: Mapping) -> dict[str, torch.Tensor] | None:
    """The RNG states in ``path/rel`` (``{"torch": ByteTensor[, "cuda": ByteTensor]}``), or
    None when ``metadata.json`` does not list it. :class:`LLMTrainError` names a bad file."""
    if rel not in files:
        return None
    f = Path(path) / rel
    where = printable(f)
    try:
        raw = read_regular(f, "RNG state", RNG_CAP, field="--ckpt", hint=HINT)
    except LLMTrainError as exc:
        msg = exc.problems[0].message
        raise LLMTrainError(msg if where in msg else f"{where}: {msg}", HINT, path="--ckpt") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4": refused or read, nothing to tell
            state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001  (weights_only: nothing but tensors and containers was built)
        raise LLMTrainError(f"{where}: not an RNG state ({_one_line(exc)})", HINT, path="--ckpt") from None
    want = torch.get_rng_state().numel()
    ok = (type(state) is dict and set(state) <= {"torch", "cuda"} and "torch" in state
          and all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and v.dim() == 1 for v in state.values())
          and state["torch"].numel() == want)
    if not ok:
        raise LLMTrainError(f"{where}: not an RNG state (expected {{'torch': uint8[{want}]}})", HINT, path="--ckpt")
    return state
