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
  all-reduced over the data-parallel group.
* **Context parallelism.** Labels are built on the whole window, then inputs and labels are
  sharded by the trainer's global positions (``cp_positions``: zigzag for ring and allgather,
  contiguous for ulysses), and RoPE gets those positions. Each cp rank sums the losses of its own
  tokens (the ignored last label sits on whichever rank holds position N-1); the sums, divided
  by the global N-1, are all-reduced over ``dp_cp`` (data and context ranks).
* **Pipeline parallelism.** A forward-only pass over the chunks the ranks hold, in the
  schedule's own placement, V-shaped ones included (:mod:`llmtrain.engine.eval_pipeline`: not a
  torch schedule, which cannot run zbv / dualpipev forward-only in torch 2.13). Each round's
  windows go as microbatches of ``micro`` windows (``llmtrain eval``: one; the periodic eval:
  the training step's microbatch size and count); the last stage computes per-window sums,
  all-reduced over the pp group (only the last stage's ranks hold one), so every rank, rank 0
  included, has the answer.
* **The periodic eval** (``train.eval_interval``) runs in every layout the trainer runs, on the
  trainer's own model chunks, beside (never through) the training schedule. The chunks'
  ``positions`` and ``return_hidden`` (the chunked loss's last pipeline stage returns hidden
  states) are set for eval and put back after, and FSDP parameters the forwards gathered are
  re-sharded, so the next training step starts from the state it would have had.
* **Fine-tuning data** (``data.source`` chat, instruction or text: the periodic eval of an SFT
  run). ``data.eval_path`` is read exactly as ``data.path`` is (same source, tokenizer, chat
  template, fields, ``data.overlong``), one sample per row (never packed: a packed row would need
  the training step's document isolation), padded to ``train.seq_len``; the labels are the
  training labels (loss on the targets only: the assistant replies for chat, the completion for
  instruction, every token for text). loss = sum of the target-token losses / number of target
  tokens over the evaluated rows (training's token-weighted loss), ``tokens`` = those targets.
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

from llmtrain.engine.data.sft_sources import FINETUNE_SOURCES
from llmtrain.errors import LLMTrainError
from llmtrain.safeio import printable
from llmtrain.recipe.schema import bf16_compute

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

def token_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the next-token losses of each row of ``labels`` [b, s] (float64 [b]); -100 is ignored.
    Under TP (``loss_parallel``) the vocabulary-sharded logits give a DTensor, made whole here."""
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none", ignore_index=IGNORE)
    if isinstance(per_token, DTensor):
        per_token = per_token.full_tensor()
    return per_token.view(labels.shape).double().sum(1)


def window_labels(windows: torch.Tensor) -> torch.Tensor:
    """Labels of whole windows: position i predicts token i+1, the last position is ignored. Built on
    the FULL window, before any sequence sharding (CP shards inputs and labels alike afterwards)."""
    labels = torch.full_like(windows, IGNORE)
    labels[:, :-1] = windows[:, 1:]
    return labels


def window_losses(model: torch.nn.Module, windows: torch.Tensor, tp: bool) -> torch.Tensor:
    """Mean next-token loss of each window of ``windows`` [b, N] (float64 [b]), one process, no CP."""
    from llmtrain.engine.step import loss_context

    with loss_context(tp):
        return token_sums(model(windows), window_labels(windows)) / (windows.shape[1] - 1)


def dp_coords(dims) -> tuple[int, int]:
    c = dims.coord_dict(dist.get_rank())
    return c["dp_replicate"] * dims.dp_shard + c["dp_shard"], dims.dp


class _Forward:
    """Per-window loss sums of one round (``[batch, N]`` windows) on this rank: a plain forward, or
    (PP) the forward-only pipeline pass (:class:`~llmtrain.engine.eval_pipeline.PipelineEval`) of
    the round split into microbatches of ``micro`` windows, whose last stage computes the sums.

    With CP the windows and their labels (built on the whole window) are sharded by the same
    global positions the trainer uses (:func:`cp_positions`: zigzag for ring and allgather), RoPE gets those
    positions, and each rank's sums cover only its tokens: the caller all-reduces them over the
    cp group (part of ``dp_cp``). Returns None on pipeline ranks without the last stage."""

    def __init__(self, parts, meshes, device, seq_len: int, recipe=None, micro: int = 1, act_dtype=torch.float32):
        from llmtrain.engine.parallel.context import cp_positions

        dims = meshes.dims
        self.parts, self.tp, self.device, self.pipeline, self.micro = parts, dims.tp > 1, device, None, micro
        self.positions = None
        # the trainer's chunked loss makes a pipeline's last stage return the final norm's output
        # (``return_hidden``); eval computes its sums from logits: put both back in close()
        self.saved = [(part.positions, getattr(part, "return_hidden", False)) for part in parts.parts]
        for part in parts.parts:
            part.return_hidden = False
        if dims.cp > 1 or dims.pp > 1:
            if recipe is None:
                raise LLMTrainError("pipeline / context parallel eval needs the recipe", "pass recipe=",
                                    path="parallel")
            method = recipe.parallel.cp_method
            self.positions = cp_positions(seq_len, dims.cp, meshes.cp.get_local_rank(), method).to(device)
            for part in parts.parts:  # global RoPE positions (PP: later stages get hidden states)
                part.positions = self.positions
        if dims.pp > 1:
            from llmtrain.engine.eval_pipeline import PipelineEval

            self.pipeline = PipelineEval(parts, meshes, recipe, device, seq_len, token_sums, act_dtype)

    def __call__(self, windows: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor | None:
        from llmtrain.engine.parallel.context import shard_sequence
        from llmtrain.engine.step import loss_context

        inputs, labels = windows, window_labels(windows) if labels is None else labels
        if self.positions is not None:
            inputs, labels = shard_sequence(inputs, self.positions), shard_sequence(labels, self.positions)
        with loss_context(self.tp):
            if self.pipeline is None:
                return token_sums(self.parts.parts[0](inputs), labels)
            return self.pipeline(list(inputs.split(self.micro)), list(labels.split(self.micro)))

    def close(self) -> None:
        """Put back the chunks' positions and re-shard FSDP parameters the forwards gathered (with
        PP they stay gathered after a forward): the state between two training steps."""
        from torch.distributed.fsdp import FSDPModule

        for part, (positions, hidden) in zip(self.parts.parts, self.saved):
            part.positions, part.return_hidden = positions, hidden
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        self.pipeline = None


def evaluate(parts, windows: np.ndarray, batch: int, device: torch.device, meshes, recipe=None, micro: int = 1,
             act_dtype=torch.float32, labels: np.ndarray | None = None) -> EvalResult:
    """Loss over ``windows`` with the (parallelized) model ``parts`` on every rank of the mesh,
    ``batch`` windows per forward round and data-parallel rank (with PP: in microbatches of
    ``micro`` windows, boundaries sent as ``act_dtype``). ``recipe`` (its ``parallel`` and
    ``model``) is needed for pipeline and context parallelism. ``labels`` (``[W, N]``, -100 =
    ignored; fine-tuning rows): the loss is then the mean over all target tokens, not over windows."""
    dims = meshes.dims
    dp_rank, dp = dp_coords(dims)
    n, seq_len = windows.shape
    rounds = math.ceil(math.ceil(n / batch) / dp)
    total = torch.zeros((), dtype=torch.float64, device=device)
    modes = [part.training for part in parts.parts]
    for part in parts.parts:
        part.eval()
    forward = None
    try:
        forward = _Forward(parts, meshes, device, seq_len, recipe, micro, act_dtype)
        with torch.no_grad():
            for r in range(rounds):
                lo = (r * dp + dp_rank) * batch
                real = len(windows[lo:lo + batch])
                rows = slice(lo, lo + batch) if real else slice(0, 1)  # none left: a dummy forward (weight 0), as
                # every rank takes part in the collectives
                sums = forward(torch.from_numpy(windows[rows]).to(device),
                               None if labels is None else torch.from_numpy(labels[rows]).to(device))
                if sums is not None:
                    total += sums[:real].sum()
    finally:
        if forward is not None:
            forward.close()
        for part, mode in zip(parts.parts, modes):
            part.train(mode)
    if dp * dims.cp > 1:  # data-parallel ranks: other windows; cp ranks: other tokens of the same windows
        dist.all_reduce(total, group=meshes.dp_cp.get_group())
    if dims.pp > 1:  # only the last stage's ranks hold the sum: give it to every rank (rank 0 prints)
        dist.all_reduce(total, group=meshes.pp.get_group())
    # every window predicts its N - 1 next tokens, so the mean of the windows' means is the mean over
    # all predictions, which is what fine-tuning rows (their targets only) are averaged over too
    targets = n * (seq_len - 1) if labels is None else int((labels != IGNORE).sum())
    loss = float(total.item()) / targets
    return EvalResult(loss, math.exp(loss) if loss < 700 else float("inf"), n * seq_len if labels is None else targets, n)


# -- during training ----------------------------------------------------------------------------

class PeriodicEval:
    """``train.eval_interval``: the first ``eval_batches x global batch`` windows of
    ``data.eval_path`` (train.seq_len tokens each), evaluated every interval steps and at the end."""

    def __init__(self, recipe, dims, gbs: int):
        t = recipe.train
        if not recipe.data.eval_path:
            raise LLMTrainError(f"train.eval_interval is {t.eval_interval} but data.eval_path is not set",
                                "set data.eval_path to held-out text, or train.eval_interval=0", path="data.eval_path")
        self.labels = None
        if recipe.data.source in FINETUNE_SOURCES:  # the fine-tuning rows (module docstring)
            from llmtrain.engine.data.sft import build_eval_sft_data

            self.windows, self.labels = build_eval_sft_data(recipe).rows(t.eval_batches * gbs)
        else:
            path = Path(recipe.data.eval_path)
            tokenizer = None if path.is_dir() else recipe_tokenizer(recipe.data)
            tokens = read_token_stream(path, tokenizer, field="data.eval_path", limit=t.eval_batches * gbs * t.seq_len)
            windows = make_windows(tokens, t.seq_len, recipe.model.vocab_size, str(path), field="data.eval_path")
            self.windows = windows[: t.eval_batches * gbs]
        self.recipe, self.interval, self.micro = recipe, t.eval_interval, t.micro_batch_size
        # PP: one round = one training step's microbatches (count and size) per data-parallel rank
        self.batch = self.micro * (gbs // (self.micro * dims.dp) if dims.pp > 1 else 1)

    def due(self, step: int, total_steps: int) -> bool:
        return step % self.interval == 0 or step == total_steps

    def run(self, parts, meshes, device, step: int, writer, verbose: bool) -> EvalResult:
        start = time.perf_counter()
        from llmtrain.engine.parallelize import uses_fsdp

        # the eval forward's boundary dtype: bf16 under FSDP's bf16 parameters; eval runs without autocast,
        # so zero 0/1 compute (and send) fp32 here, unlike their training steps (models/llama.py)
        bf16 = bf16_compute(self.recipe.train.precision) and uses_fsdp(self.recipe, meshes)
        result = evaluate(parts, self.windows, self.batch, device, meshes, self.recipe, self.micro,
                          torch.bfloat16 if bf16 else torch.float32, labels=self.labels)
        if dist.get_rank() == 0:
            writer.log({"step": step, "eval_loss": result.loss, "eval_perplexity": result.perplexity,
                        "eval_tokens": result.tokens, "eval_windows": result.windows,
                        "eval_s": time.perf_counter() - start})
            if verbose:
                what = (f"{result.windows} samples, {result.tokens} target tokens" if self.labels is not None
                        else f"{result.windows} windows")
                print(f"eval: step {step}: loss {result.loss:.6g}, perplexity {result.perplexity:.6g} ({what})", flush=True)
        return result
