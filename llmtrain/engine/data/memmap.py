"""Memory-mapped token data written by ``llmtrain data prepare``.

Sample ``i`` is the window ``tokens[i * seq_len : i * seq_len + seq_len + 1]``: ``seq_len``
inputs plus one more token for the shifted labels. Windows do not overlap except for that
shared last token, so one epoch sees every token once as a label target (except the first) and
``len = (n_tokens - 1) // seq_len``; the tail that does not fill a window is dropped.

Design decisions:

- Windows ignore document boundaries (GPT-style packing): documents are separated by the EOS
  id, and attention is not masked at boundaries. ``index.npy`` keeps the boundaries for
  tooling that wants them.
- ``np.memmap`` is opened read-only once per process; pages are loaded on demand by the OS and
  shared between the ranks of one node, so every rank can open the full file cheaply.
- ``meta.json`` is the completeness marker (prepare writes it last): a missing or inconsistent
  meta (wrong dtype, file size that does not match ``n_tokens``) is an error, never a guess.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from llmtrain.errors import LLMTrainError
from llmtrain.safeio import MIB, read_text

DTYPES = ("uint16", "uint32")
MAX_META_BYTES = 64 * MIB  # meta.json lists every input file: large only for huge corpora
PREPARE_HINT = "run `llmtrain data prepare INPUT... --out DIR` and set data.path to DIR"


def read_meta(path: Path) -> dict:
    """Load and check ``meta.json`` of a prepared data directory."""
    path = Path(path).expanduser()
    meta_path = path / "meta.json"
    if not path.is_dir():
        raise LLMTrainError(f"data directory {path} does not exist", PREPARE_HINT, path="data.path")
    if not meta_path.exists():
        raise LLMTrainError(f"{meta_path} is missing (not prepared, or preparation did not finish)", PREPARE_HINT, path="data.path")
    text = read_text(meta_path, "data meta.json", MAX_META_BYTES, field="data.path", hint=PREPARE_HINT)
    try:
        meta = json.loads(text)
    except ValueError as exc:
        raise LLMTrainError(f"{meta_path}: not valid JSON ({exc})", PREPARE_HINT, path="data.path") from None
    if not isinstance(meta, dict):
        raise LLMTrainError(f"{meta_path}: not a JSON object", PREPARE_HINT, path="data.path")
    for key in ("dtype", "n_tokens", "vocab_size"):
        if key not in meta:
            raise LLMTrainError(f"{meta_path}: field {key!r} is missing", PREPARE_HINT, path="data.path")
    if meta["dtype"] not in DTYPES:
        raise LLMTrainError(f"{meta_path}: dtype {meta['dtype']!r} is not one of {', '.join(DTYPES)}", PREPARE_HINT, path="data.path")
    for key in ("n_tokens", "vocab_size"):
        if not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < 0:
            raise LLMTrainError(f"{meta_path}: {key} {meta[key]!r} is not a non-negative integer", PREPARE_HINT, path="data.path")
    return meta


class MemmapDataset:
    """Fixed-length windows over ``DIR/tokens.bin``; ``sample(i)`` returns ``seq_len + 1`` int64 tokens."""

    def __init__(self, path: str | Path, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.path = Path(path).expanduser()
        self.seq_len = int(seq_len)
        self.meta = read_meta(self.path)
        self.vocab_size = int(self.meta["vocab_size"])
        self.n_tokens = int(self.meta["n_tokens"])
        dtype = np.dtype(self.meta["dtype"])
        bin_path = self.path / "tokens.bin"
        if not bin_path.exists():
            raise LLMTrainError(f"{bin_path} is missing", PREPARE_HINT, path="data.path")
        if not bin_path.is_file():
            raise LLMTrainError(f"{bin_path} is not a regular file", PREPARE_HINT, path="data.path")
        size = bin_path.stat().st_size
        if size != self.n_tokens * dtype.itemsize:
            raise LLMTrainError(
                f"{bin_path} has {size} bytes but meta.json says {self.n_tokens} {dtype.name} tokens "
                f"({self.n_tokens * dtype.itemsize} bytes)", "the data is inconsistent; " + PREPARE_HINT, path="data.path")
        self.length = (self.n_tokens - 1) // self.seq_len if self.n_tokens > 0 else 0
        if self.length < 1:
            raise LLMTrainError(
                f"{self.path} holds {self.n_tokens} tokens, fewer than one sample of seq_len {self.seq_len} + 1",
                f"prepare more text (>= {self.seq_len + 1} tokens) or lower train.seq_len", path="data.path")
        self.tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(self.n_tokens,))

    def __len__(self) -> int:
        return self.length

    def sample(self, index: int) -> np.ndarray:
        """Window ``index``: tokens[index*seq_len : index*seq_len + seq_len + 1] as int64."""
        index = int(index)
        if not 0 <= index < self.length:
            raise IndexError(f"sample {index} out of range [0, {self.length})")
        start = index * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def __repr__(self) -> str:
        return f"MemmapDataset({str(self.path)!r}, seq_len={self.seq_len}, samples={self.length}, tokens={self.n_tokens})"
