"""Fine-tuning datasets (``data.source`` chat / instruction / text): samples with loss masks, padded or packed rows.

Contract (the trainer codes against it)::

    data = build_sft_data(recipe.data, seq_len, model_vocab_size)
    data.length, data.seq_len, data.vocab_size, data.packed, data.summary
    data.sample(i) -> {"inputs", "labels"[, "positions", "segments"]}   # int64 arrays of seq_len
    data.target_count(i) -> int                                         # labels != -100 in row i

``labels[j]`` is the target of ``inputs[j]`` (the next token) or ``-100`` (no loss). A sample of
``n`` tokens gives ``n - 1`` input/label pairs; a label is set where the *next* token is a
target (see :mod:`llmtrain.engine.data.sft_sources`).

Rows:

- **unpacked** (``data.packing: false``): row ``i`` is sample ``i``, padded to ``seq_len`` with
  the tokenizer's pad id (0 when it has none) and labels ``-100``;
- **packed**: whole samples packed by first-fit decreasing (:mod:`llmtrain.engine.data.packing`);
  ``positions`` restart at 0 per sample (padding: 0), ``segments`` number the samples of the row
  ``0..k-1`` (padding: ``-1``, labels ``-100``). A label never crosses samples: the label of a
  sample's last input is that sample's own last token.

Over-long samples (more than ``seq_len + 1`` tokens): ``data.overlong: truncate`` keeps the first
``seq_len + 1``, ``drop`` removes the sample. A sample left without any target (a reply cut off
by truncation, an instruction with an empty completion and no EOS) is dropped. Everything is
counted in :class:`DataSummary` (the run log prints ``summary.line()``).

Cost: every row is read, rendered and tokenized once, when the dataset is built, on every rank
(deterministic, so all ranks agree without talking). Tokens live in memory as int32 (+1 byte of
target flag per token): ~5 bytes per token. Rendering a chat template is Python (Jinja): roughly
0.1-1 ms per row, i.e. minutes for a million rows; ``llmtrain launch`` builds it once up front
(:func:`check_finetune_data`) so data errors surface before any rank starts.
"""

from __future__ import annotations

from array import array
from dataclasses import asdict, dataclass, field

import numpy as np

from llmtrain.engine.data.packing import pack_ffd
from llmtrain.engine.data.sft_sources import FINETUNE_SOURCES, Encoded, iter_samples, source_files
from llmtrain.engine.data.tokenizer import load_tokenizer
from llmtrain.errors import LLMTrainError
from llmtrain.safeio import printable

SHOWN_DROPS = 5  # first dropped rows listed in the summary


@dataclass
class DataSummary:
    """Counts of one fine-tuning dataset build (``line()`` for the run log, ``as_dict()`` for JSON)."""

    source: str
    path: str
    files: int = 0
    seq_len: int = 0
    packed: bool = False
    rows_read: int = 0
    samples: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_no_targets: int = 0
    dropped_empty: int = 0
    tokens: int = 0
    target_tokens: int = 0
    rows: int = 0
    first_dropped: list[str] = field(default_factory=list)

    @property
    def dropped(self) -> int:
        return self.dropped_overlong + self.dropped_no_targets + self.dropped_empty

    def _drop(self, where: str, why: str) -> None:
        if len(self.first_dropped) < SHOWN_DROPS:
            self.first_dropped.append(f"{where} ({why})")

    def line(self) -> str:
        files = f"{self.files} files in {self.path}" if self.files != 1 else self.path
        fill = self.tokens - self.samples  # input/label pairs
        text = (f"{self.source}: {self.rows_read} rows from {files} -> {self.samples} samples "
                f"({self.truncated} truncated; {self.dropped} dropped: {self.dropped_overlong} over-long, "
                f"{self.dropped_no_targets} without targets, {self.dropped_empty} empty), {self.tokens} tokens, "
                f"{self.target_tokens} targets")
        if self.packed:
            text += (f"; packed into {self.rows} rows of {self.seq_len} "
                     f"({100.0 * fill / max(1, self.rows * self.seq_len):.1f}% filled)")
        else:
            text += f"; {self.rows} rows of {self.seq_len} (unpacked, {100.0 * fill / max(1, self.rows * self.seq_len):.1f}% filled)"
        if self.first_dropped:
            text += "; first dropped: " + ", ".join(self.first_dropped)
        return text

    def as_dict(self) -> dict:
        out = asdict(self)
        out["dropped"] = self.dropped
        return out


class SFTDataset:
    """Rows of fine-tuning samples with label masks (see module docstring)."""

    def __init__(self, tokens: np.ndarray, targets: np.ndarray, offsets: np.ndarray, seq_len: int, vocab_size: int,
                 pad_id: int, packed: bool, summary: DataSummary):
        self.tokens = tokens  # int32, all kept samples concatenated
        self.targets = targets  # bool per token: is it a loss target (the label of the token before it)
        self.offsets = offsets  # int64 (n_samples + 1): sample s spans tokens[offsets[s]:offsets[s + 1]]
        self.seq_len = int(seq_len)
        self.vocab_size = int(vocab_size)
        self.pad_id = int(pad_id)
        self.packed = bool(packed)
        pairs = np.diff(offsets) - 1  # input/label pairs of each sample
        if packed:
            self.row_start, self.row_items = pack_ffd(pairs, self.seq_len)
        else:
            self.row_start, self.row_items = np.arange(pairs.size + 1, dtype=np.int64), np.arange(pairs.size, dtype=np.int64)
        self.length = int(self.row_start.size - 1)
        # per-sample targets (targets[first token] is always False), then per row
        cum = np.concatenate([[0], np.cumsum(targets, dtype=np.int64)])
        per_sample = cum[offsets[1:]] - cum[offsets[:-1]]
        per_item = per_sample[self.row_items]
        cum_rows = np.concatenate([[0], np.cumsum(per_item, dtype=np.int64)])
        self.target_counts = cum_rows[self.row_start[1:]] - cum_rows[self.row_start[:-1]]
        self.summary = summary
        summary.rows = self.length
        summary.target_tokens = int(self.target_counts.sum())

    def __len__(self) -> int:
        return self.length

    def samples_of_row(self, index: int) -> list[int]:
        return self.row_items[self.row_start[index]:self.row_start[index + 1]].tolist()

    def target_count(self, index: int) -> int:
        return int(self.target_counts[index])

    def sample(self, index: int) -> dict[str, np.ndarray]:
        index = int(index)
        if not 0 <= index < self.length:
            raise IndexError(f"row {index} out of range [0, {self.length})")
        n = self.seq_len
        inputs = np.full(n, self.pad_id, dtype=np.int64)
        labels = np.full(n, -100, dtype=np.int64)
        positions = np.zeros(n, dtype=np.int64)
        segments = np.full(n, -1, dtype=np.int64)
        at = 0
        for k, s in enumerate(self.samples_of_row(index)):
            a, b = int(self.offsets[s]), int(self.offsets[s + 1])
            m = b - a - 1
            inputs[at:at + m] = self.tokens[a:b - 1]
            labels[at:at + m] = np.where(self.targets[a + 1:b], self.tokens[a + 1:b], -100)
            positions[at:at + m] = np.arange(m)
            segments[at:at + m] = k
            at += m
        if not self.packed:
            return {"inputs": inputs, "labels": labels}
        return {"inputs": inputs, "labels": labels, "positions": positions, "segments": segments}

    def rows(self, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The first ``limit`` rows (all by default) as int64 ``[W, seq_len]`` inputs and labels."""
        got = [self.sample(i) for i in range(self.length if limit is None else min(limit, self.length))]
        return np.stack([r["inputs"] for r in got]), np.stack([r["labels"] for r in got])

    def __repr__(self) -> str:
        return f"SFTDataset({self.summary.source}, rows={self.length}, seq_len={self.seq_len}, packed={self.packed})"


def build_sft_data(data_cfg, seq_len: int, model_vocab_size: int | None = None) -> SFTDataset:
    """Read, tokenize, mask and (optionally) pack the rows named by ``data_cfg`` (see module docstring)."""
    source = data_cfg.source
    if source not in FINETUNE_SOURCES:
        raise ValueError(f"not a fine-tuning source: {source!r}")
    if seq_len < 1:
        raise LLMTrainError(f"train.seq_len {seq_len} must be >= 1", "set train.seq_len", path="train.seq_len")
    files = source_files(data_cfg.path, source)
    tokenizer = load_tokenizer(data_cfg.tokenizer)
    if model_vocab_size is not None and tokenizer.vocab_size > model_vocab_size:
        raise LLMTrainError(f"the tokenizer {printable(data_cfg.tokenizer)} has vocab_size {tokenizer.vocab_size}, "
                            f"larger than the model's vocab_size {model_vocab_size}",
                            f"set model.vocab_size >= {tokenizer.vocab_size}, or use the model's own tokenizer",
                            path="model.vocab_size")
    summary = DataSummary(source=source, path=printable(data_cfg.path), files=len(files), seq_len=seq_len,
                          packed=bool(data_cfg.packing))
    limit = seq_len + 1
    tokens, flags, lengths = array("i"), bytearray(), array("q")  # compact growing buffers (no object per sample)
    for item in iter_samples(source, files, tokenizer, data_cfg):
        summary.rows_read += 1
        if not isinstance(item, Encoded):
            summary.dropped_empty += 1
            summary._drop(item.where, item.why)
            continue
        ids, targets = item.ids, item.targets
        cut = len(ids) > limit
        if cut and data_cfg.overlong == "drop":
            summary.dropped_overlong += 1
            summary._drop(item.where, f"{len(ids)} tokens > seq_len + 1 = {limit}")
            continue
        if cut:
            ids, targets = ids[:limit], targets[:limit]
        if not any(targets[1:]):
            summary.dropped_no_targets += 1
            summary._drop(item.where, "no target tokens" + (" left after truncation" if cut else ""))
            continue
        summary.truncated += cut
        summary.samples += 1
        summary.tokens += len(ids)
        tokens.extend(ids)
        flags.append(0)  # the first token is no one's label
        flags.extend(bytes(targets[1:]))  # bools are 0/1 ints
        lengths.append(len(ids))
    if summary.samples == 0:
        raise LLMTrainError(f"{printable(data_cfg.path)}: no {source} sample left ({summary.rows_read} rows read, "
                            f"{summary.dropped} dropped: {summary.dropped_overlong} over-long, {summary.dropped_no_targets} "
                            f"without targets, {summary.dropped_empty} empty)",
                            "check the data, raise train.seq_len, or use data.overlong truncate", path="data.path")
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(np.frombuffer(lengths, dtype=np.int64), out=offsets[1:])
    tokens = np.frombuffer(tokens, dtype=np.int32)
    targets = np.frombuffer(bytes(flags), dtype=np.bool_)
    pad_id = getattr(tokenizer, "pad_id", None)
    return SFTDataset(tokens, targets, offsets, seq_len, tokenizer.vocab_size, 0 if pad_id is None else pad_id,
                      bool(data_cfg.packing), summary)


def check_finetune_data(recipe) -> DataSummary | None:
    """Build the recipe's fine-tuning dataset exactly as the engine will (pure Python, no torch) and
    return its summary; ``None`` for synthetic/memmap data. Raises the one-line data error. The
    held-out rows of ``train.eval_interval`` (``data.eval_path``) are built and checked too."""
    if recipe.data.source not in FINETUNE_SOURCES:
        return None
    summary = build_sft_data(recipe.data, recipe.train.seq_len, recipe.model.vocab_size).summary
    if recipe.train.eval_interval and recipe.data.eval_path:
        build_eval_sft_data(recipe)
    return summary


def build_eval_sft_data(recipe) -> SFTDataset:
    """``data.eval_path`` read as ``data.path`` is (:func:`build_unpacked_at`); problems name ``data.eval_path``."""
    return build_unpacked_at(recipe.data, recipe.data.eval_path, recipe.train.seq_len, recipe.model.vocab_size,
                             "data.eval_path")


def build_unpacked_at(data_cfg, path: str, seq_len: int, vocab_size: int, key: str,
                      tokenizer: str | None = None) -> SFTDataset:
    """The held-out samples at ``path`` read as ``data_cfg`` reads ``data.path`` (same source,
    tokenizer unless ``tokenizer``, template, fields, ``data.overlong``), one sample per row
    (unpacked: a packed row would need the training step's document isolation); a data problem
    names ``key`` (``data.eval_path``, ``--data``) instead of ``data.path``."""
    from dataclasses import replace

    update = {"path": path, "packing": False} | ({"tokenizer": tokenizer} if tokenizer else {})
    try:
        return build_sft_data(data_cfg.model_copy(update=update), seq_len, vocab_size)
    except LLMTrainError as exc:
        raise LLMTrainError([replace(p, path=key, message=p.message.replace("data.path", key),
                                     hint=p.hint.replace("data.path", key)) if p.path == "data.path" else p
                             for p in exc.problems]) from None
