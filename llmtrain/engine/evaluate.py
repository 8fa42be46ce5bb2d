"""Held-out loss and perplexity: ``llmtrain eval`` and the periodic eval of ``train.eval_interval``.

One definition for both (docs/eval.md)::

    tokens  = the file as ONE token stream            (read_token_stream)
    windows = tokens cut into non-overlapping runs of N tokens; a last partial run is dropped
    loss    = mean over windows of (mean next-token cross-entropy inside the window)
    perplexity = exp(loss)

Decisions:

* **transformers' convention.** A window of N tokens gives N-1 predictions (inputs = the window,
  labels = the window; position i predicts token i+1), exactly ``model(input_ids=w,
  labels=w).loss`` of a Hugging Face causal LM, so the number can be checked against
  transformers window by window. (Training windows are N+1 tokens with N predictions: the
  training loss and the eval loss of the same text differ slightly by construction.)
* **The token stream.** A ``.txt`` is one document, encoded with no special token added (no
  BOS, no EOS). A ``.jsonl`` is read as ``llmtrain data prepare`` reads it (field ``text``,
  blank lines and empty documents skipped) and joined as prepare joins it: each document
  followed by the tokenizer's EOS when it has one. So ``eval FILE.jsonl`` equals ``eval`` of
  FILE's prepared directory, whose ``tokens.bin`` is used as is (a directory with ``meta.json``).
* **Labels.** The last position of each window gets label -100 (ignored) so the model runs on
  exactly the N tokens and the loss layout matches training's (``loss_parallel`` under TP keeps
  the logits vocabulary-sharded); each window's loss is the sum of its N-1 token losses / (N-1).
* **Layouts.** Windows are dealt out to data-parallel ranks in micro-batches (round r, rank d
  takes micro-batch ``r * dp + d``); every rank runs the same number of forwards (a rank without
  work runs a dummy micro-batch with weight 0: FSDP/EP collectives need every rank), TP ranks of
  one group see the same windows, and the per-window losses are summed in float64 and
  all-reduced over the data-parallel group. Pipeline and context parallelism are refused (one
  line): the eval forward is not written for stages or sequence shards.
* **No effect on training.** No RNG is drawn, the forward runs under ``torch.no_grad`` in eval
  mode (MoE routers count no tokens for the bias update in eval mode) and the previous mode
  is restored.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from llmtrain.errors import LLMTrainError
from llmtrain.safeio import printable

IGNORE = -100


@dataclass
class EvalResult:
    loss: float
    perplexity: float
    tokens: int  # tokens inside the evaluated windows (windows x N)
    windows: int

    def as_dict(self) -> dict:
        return {"loss": self.loss, "perplexity": self.perplexity, "tokens": self.tokens, "windows": self.windows}


# -- the token stream ---------------------------------------------------------------------------

def recipe_tokenizer(data_cfg, override: str | None = None):
    """The tokenizer of a run: ``override`` (``--tokenizer``), else ``data.tokenizer``; a trained
    ``bpe:VOCAB`` spec means the tokenizer ``data prepare`` saved beside ``data.path``."""
    from llmtrain.engine.data.tokenizer import load_tokenizer

    spec = override or data_cfg.tokenizer
    if spec.startswith("bpe:") and not override:
        if not data_cfg.path:
            raise LLMTrainError(f"data.tokenizer is {spec!r} (trained) and data.path is not set, so the trained "
                                "tokenizer cannot be found", "pass --tokenizer PATH/tokenizer.json", path="--tokenizer")
        return load_tokenizer(data_cfg.path)
    return load_tokenizer(spec)


def read_token_stream(path: str | Path, tokenizer, field: str = "--data", limit: int | None = None) -> np.ndarray:
    """The file as one int64 token stream (see the module docstring). ``tokenizer`` may be None
    for a prepared directory (its tokens are used as they are). With ``limit``, reading stops
    once that many tokens are there (the periodic eval needs only its first windows)."""
    from llmtrain.engine.data.prepare import iter_documents

    p = Path(path).expanduser()
    if p.is_dir():
        return _prepared_tokens(p, field)
    if not p.exists():
        raise LLMTrainError(f"{printable(p)}: no such file or directory", "pass a .txt, a .jsonl or a directory "
                            "written by `llmtrain data prepare`", path=field)
    suffix = p.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise LLMTrainError(f"{printable(p)}: unsupported file type {suffix or '(no extension)'!r}",
                            "use .txt (one document), .jsonl (field 'text') or a `data prepare` directory", path=field)
    if tokenizer is None:
        raise LLMTrainError(f"{printable(p)}: text needs a tokenizer", "pass --tokenizer", path="--tokenizer")
    ids: list[int] = []
    for text, _ in iter_documents(p):  # regular file, capped, UTF-8, `path:line` errors
        if not text:
            continue
        ids.extend(tokenizer.encode(text))
        if suffix == ".jsonl" and tokenizer.eos_id is not None:
            ids.append(tokenizer.eos_id)
        if limit is not None and len(ids) >= limit:
            break
    return np.asarray(ids, dtype=np.int64)


def _prepared_tokens(p: Path, field: str) -> np.ndarray:
    from llmtrain.engine.data.memmap import read_meta
    from llmtrain.safeio import open_regular

    if not (p / "meta.json").exists():
        raise LLMTrainError(f"{printable(p)}: a directory without meta.json", "pass a .txt, a .jsonl or a directory "
                            "written by `llmtrain data prepare`", path=field)
    meta = read_meta(p)
    dtype = np.dtype(meta["dtype"])
    f, size = open_regular(p / "tokens.bin", "token file", field=field)
    with f:
        if size != meta["n_tokens"] * dtype.itemsize:
            raise LLMTrainError(f"{printable(p / 'tokens.bin')} has {size} bytes, meta.json says {meta['n_tokens']} "
                                f"{dtype.name} tokens", "prepare the data again", path=field)
        data = np.frombuffer(f.read(size), dtype=dtype)
    return data.astype(np.int64)


def make_windows(tokens: np.ndarray, seq_len: int, vocab_size: int, where: str, field: str = "--data") -> np.ndarray:
    """``[W, seq_len]`` non-overlapping windows (the partial tail dropped); ids checked against the vocab."""
    if seq_len < 2:
        raise LLMTrainError(f"seq_len {seq_len}: a window needs at least 2 tokens (1 prediction)",
                            "use --seq-len >= 2", path="--seq-len")
    n = len(tokens) // seq_len
    if n == 0:
        raise LLMTrainError(f"{printable(where)}: {len(tokens)} tokens, fewer than one window of {seq_len}",
                            "use more text or a smaller --seq-len", path=field)
    windows = tokens[: n * seq_len].reshape(n, seq_len)
    top = int(windows.max())
    if top >= vocab_size or int(windows.min()) < 0:
        raise LLMTrainError(f"{printable(where)}: token id {top} is outside the model's vocabulary ({vocab_size})",
                            "tokenize with the model's own tokenizer (--tokenizer)", path=field)
    return np.ascontiguousarray(windows)


# -- the forward --------------------------------------------------------------------------------

def window_losses(model: torch.nn.Module, windows: torch.Tensor, tp: bool) -> torch.Tensor:
    """Mean next-token loss of each window of ``windows`` [b, N] (float64 [b])."""
    from llmtrain.engine.step import loss_context

    labels = torch.full_like(windows, IGNORE)
    labels[:, :-1] = windows[:, 1:]
    with loss_context(tp):
        logits = model(windows)
        per_token = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none",
                                    ignore_index=IGNORE)
        if isinstance(per_token, DTensor):
            per_token = per_token.full_tensor()
    return per_token.view(windows.shape).double().sum(1) / (windows.shape[1] - 1)


def refuse_layout(dims, field: str) -> None:
    for name in ("pp", "cp"):
        if getattr(dims, name) > 1:
            raise LLMTrainError(f"parallel.{name}={getattr(dims, name)}: evaluation does not run with "
                                f"{'pipeline' if name == 'pp' else 'context'} parallelism",
                                f"evaluate with parallel.{name}=1 (tp, dp_shard, dp_replicate and zero work)", path=field)


def dp_coords(dims) -> tuple[int, int]:
    c = dims.coord_dict(dist.get_rank())
    return c["dp_replicate"] * dims.dp_shard + c["dp_shard"], dims.dp


def evaluate(parts, windows: np.ndarray, batch: int, device: torch.device, meshes) -> EvalResult:
    """Loss over ``windows`` with the (parallelized) model ``parts`` on every rank of the mesh."""
    dims = meshes.dims
    refuse_layout(dims, "parallel")
    model = parts.parts[0]
    dp_rank, dp = dp_coords(dims)
    n = len(windows)
    rounds = math.ceil(math.ceil(n / batch) / dp)
    total = torch.zeros((), dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for r in range(rounds):
                lo = (r * dp + dp_rank) * batch
                chunk = windows[lo:lo + batch]
                real = len(chunk)
                if real == 0:
                    chunk = windows[:1]  # a dummy forward: every rank takes part in the collectives
                losses = window_losses(model, torch.from_numpy(chunk).to(device), dims.tp > 1)
                total += losses[:real].sum()
    finally:
        model.train(was_training)
    if dp > 1:
        dist.all_reduce(total, group=meshes.dp_cp.get_group())
    loss = float(total.item()) / n
    return EvalResult(loss, math.exp(loss) if loss < 700 else float("inf"), n * windows.shape[1], n)


# -- during training ----------------------------------------------------------------------------

class PeriodicEval:
    """``train.eval_interval``: the first ``eval_batches x global batch`` windows of
    ``data.eval_path`` (train.seq_len tokens each), evaluated every interval steps and at the end."""

    def __init__(self, recipe, dims, gbs: int):
        t = recipe.train
        if not recipe.data.eval_path:
            raise LLMTrainError(f"train.eval_interval is {t.eval_interval} but data.eval_path is not set",
                                "set data.eval_path to held-out text, or train.eval_interval=0", path="data.eval_path")
        refuse_layout(dims, "train.eval_interval")
        path = Path(recipe.data.eval_path)
        tokenizer = None if path.is_dir() else recipe_tokenizer(recipe.data)
        tokens = read_token_stream(path, tokenizer, field="data.eval_path", limit=t.eval_batches * gbs * t.seq_len)
        windows = make_windows(tokens, t.seq_len, recipe.model.vocab_size, str(path), field="data.eval_path")
        self.windows = windows[: t.eval_batches * gbs]
        self.interval, self.batch = t.eval_interval, t.micro_batch_size

    def due(self, step: int, total_steps: int) -> bool:
        return step % self.interval == 0 or step == total_steps

    def run(self, parts, meshes, device, step: int, writer, verbose: bool) -> EvalResult:
        start = time.perf_counter()
        result = evaluate(parts, self.windows, self.batch, device, meshes)
        if dist.get_rank() == 0:
            writer.log({"step": step, "eval_loss": result.loss, "eval_perplexity": result.perplexity,
                        "eval_tokens": result.tokens, "eval_windows": result.windows,
                        "eval_s": time.perf_counter() - start})
            if verbose:
                print(f"eval: step {step}: loss {result.loss:.6g}, perplexity {result.perplexity:.6g} "
                      f"({result.windows} windows)", flush=True)
        return result
