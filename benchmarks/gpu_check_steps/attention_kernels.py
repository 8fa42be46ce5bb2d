"""The engine's own attention kernels on the device: Gemma 2's soft-capped attention
(engine/models/softcap.py), whose CUDA path (bf16 products, fp32 element-wise math, scores
recomputed by blocks of queries in the backward) has not run on a GPU in the session that wrote
it. Correctness against the eager formula in fp32, and its time beside time model v2's price
(plan/attentiontime.py ``SOFTCAP_BYTES``) and beside SDPA's causal flash kernel at the same shape.
Also GQA's unrepeated K/V in causal attention and all-gather CP's masked call of one rank's rows, both
written without a GPU. Options (group (g)): they run after the speed rows."""

from __future__ import annotations

from . import CheckFailed, step
from .kernels import _timed

def _extra_gib(run, cuda: bool) -> float | None:
    """GiB one call of ``run`` allocates beyond what is allocated before it (CUDA; None elsewhere)."""
    if not cuda:
        return None
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


# Gemma 2 9B's attention on one rank at TP 4 (16 / 4 heads of 256) over 4,096 tokens
SOFTCAP_SHAPE = (1, 4, 4096, 256)
TINY_SOFTCAP_SHAPE = (1, 2, 64, 16)


@step("softcap_attention", est_s=8, group="options")
def softcap_attention_step(ctx) -> dict:
    """Soft-capped causal attention (cap 50, as Gemma 2) forward and backward: outputs and the three
    gradients vs autograd over transformers' eager formula in fp32 on the same inputs (relative L2
    <= 2e-2 in bf16: inputs and products in bf16, 2^-9 relative, through softmax and two products;
    a wrong mask, cap or derivative is O(1); CPU fp32: 1e-5); then its time (median of 5, CUDA
    events) beside v2's price for the engine's kernel and beside SDPA's causal kernel (no cap), and
    the memory it allocates beyond its inputs (CUDA)."""
    import torch
    import torch.nn.functional as F

    from llmtrain.engine.models.softcap import softcap_attention
    from llmtrain.plan.attentiontime import attention_seconds
    from llmtrain.recipe.gpus import GPUS

    cap = 50.0
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    b, h, s, d = TINY_SOFTCAP_SHAPE if ctx.tiny else SOFTCAP_SHAPE
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g).to(ctx.device, dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(b, h, s, d, generator=g).to(ctx.device, dtype)

    def eager(q, k, v):  # transformers' Gemma 2 eager attention, fp32
        scores = torch.matmul(q, k.transpose(-1, -2)) / d ** 0.5
        scores = torch.tanh(scores / cap) * cap
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        return torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), v)

    ref = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = eager(*ref)
    want.backward(dout.float())
    out = softcap_attention(q, k, v, None, cap)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    rel = lambda a, w: float((a.detach().float() - w.detach()).norm() / w.detach().norm())
    errors = {"out": rel(out, want), **{f"d{n}": rel(gr, r.grad) for n, gr, r in zip("qkv", grads, ref)}}
    del want, ref

    def run_softcap():
        o = softcap_attention(q, k, v, None, cap)
        torch.autograd.grad(o, (q, k, v), dout)

    def run_sdpa():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(o, (q, k, v), dout)

    reps = 5 if ctx.cuda else 2
    extra_gib = _extra_gib(run_softcap, ctx.cuda)
    seconds = {"softcap": _timed(run_softcap, reps, ctx.cuda), "sdpa_causal": _timed(run_sdpa, reps, ctx.cuda)}
    gpu = GPUS[ctx.gpu_key]
    e = q.element_size()
    planned = {"softcap": sum(attention_seconds(b, s, s, h, d, 1.0, gpu, kernel="softcap", e=e)),
               "sdpa_causal": sum(attention_seconds(b, s, s, h, d, 0.5, gpu, kernel="engine", e=e))}
    tol = 2e-2 if ctx.cuda else 1e-5
    result = {"gpu": ctx.gpu_key, "dtype": str(dtype), "shape": {"b": b, "heads": h, "s": s, "head_dim": d},
              "cap": cap, "rel_l2": errors, "tolerance": tol, "seconds": seconds, "v2_seconds": planned,
              "v2_vs_measured": {n: planned[n] / seconds[n] for n in seconds},
              "softcap_over_sdpa": seconds["softcap"] / seconds["sdpa_causal"], "extra_gib": extra_gib}
    worst = max(errors.values())
    if not worst <= tol:
        raise CheckFailed(f"soft-capped attention is off: relative L2 {errors} (tolerance {tol})")
    return result


# Llama 3 8B's attention on one rank (32 query heads, 8 K/V heads of 128) over 4,096 tokens
GQA_SHAPE = (1, 32, 8, 4096, 128)
TINY_GQA_SHAPE = (1, 8, 2, 64, 16)


@step("gqa_attention", est_s=6, group="options")
def gqa_attention_step(ctx) -> dict:
    """The engine's causal attention with GQA's K/V as they are (engine/models/llama.py ``causal_sdpa``:
    ``enable_gqa`` where ``gqa_native`` says the flash kernel takes it; written in a session without a
    GPU): whether it takes that path on this device and dtype, its output and gradients against SDPA on
    K/V repeated to the query heads (relative L2 <= 1e-2 in bf16: the same flash kernel reading shared
    K/V heads, differing only in summation order; a wrong head mapping is O(1)), the time of both
    (median of 5) and the memory each allocates beyond its inputs (CUDA)."""
    import torch
    import torch.nn.functional as F

    from llmtrain.engine.models.llama import causal_sdpa, gqa_native

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    b, h, kv, s, d = TINY_GQA_SHAPE if ctx.tiny else GQA_SHAPE
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, s, d, generator=g).to(ctx.device, dtype).requires_grad_()
    k, v = (torch.randn(b, kv, s, d, generator=g).to(ctx.device, dtype).requires_grad_() for _ in range(2))
    dout = torch.randn(b, h, s, d, generator=g).to(ctx.device, dtype)
    native = gqa_native(q, k, v)

    def repeated(q, k, v):
        return F.scaled_dot_product_attention(q, k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1),
                                              is_causal=True)

    outs = {}
    for name, fn in (("engine", causal_sdpa), ("repeated", repeated)):
        o = fn(q, k, v)
        outs[name] = (o.detach(), *torch.autograd.grad(o, (q, k, v), dout))
    rel = lambda a, w: float((a.float() - w.float()).norm() / w.float().norm())
    errors = {n: rel(a, w) for n, a, w in zip(("out", "dq", "dk", "dv"), outs["engine"], outs["repeated"])}
    del outs

    def timed(fn):
        def run():
            o = fn(q, k, v)
            torch.autograd.grad(o, (q, k, v), dout)
        return run

    extra_gib = {name: _extra_gib(timed(fn), True) for name, fn in (("engine", causal_sdpa), ("repeated", repeated))
                 if ctx.cuda}
    reps = 5 if ctx.cuda else 2
    seconds = {"engine": _timed(timed(causal_sdpa), reps, ctx.cuda), "repeated": _timed(timed(repeated), reps, ctx.cuda)}
    tol = 1e-2 if ctx.cuda else 1e-5
    result = {"gpu": ctx.gpu_key, "dtype": str(dtype), "shape": {"b": b, "heads": h, "kv_heads": kv, "s": s, "head_dim": d},
              "gqa_native": native, "rel_l2": errors, "tolerance": tol, "seconds": seconds,
              "engine_over_repeated": seconds["engine"] / seconds["repeated"], "extra_gib": extra_gib or None}
    if not max(errors.values()) <= tol:
        raise CheckFailed(f"GQA attention differs from the repeated K/V: relative L2 {errors} (tolerance {tol})")
    if ctx.cuda and dtype == torch.bfloat16 and not native:
        raise CheckFailed("the flash kernel refused enable_gqa for bf16 causal attention (head_dim 128): the engine "
                          "repeats K/V here, which plan/gqa.py does not price")
    return result


# all-gather CP's masked call on one rank: Llama 3 8B's heads at TP 8 (4 / 1 of 128), 8,192 tokens, cp 4
MASKED_SHAPE = (1, 4, 1, 8192, 128, 4)
TINY_MASKED_SHAPE = (1, 2, 1, 64, 16, 2)


@step("masked_rows_attention", est_s=6, group="options")
def masked_rows_attention_step(ctx) -> dict:
    """All-gather CP's attention with a mask (engine/parallel/context.py ``masked_rows_attention``: packed
    rows' document mask and a window, as one rank's zigzag rows against the whole sequence's K/V; written
    in a session without a GPU): a float mask of non-square rows through SDPA's memory-efficient kernel in
    bf16. Its output and gradients against the same rows of the whole-sequence masked attention
    (relative L2 <= 1e-2 in bf16; CPU fp32 1e-5), time (median of 5) and memory beyond the inputs."""
    import torch
    import torch.nn.functional as F

    from llmtrain.engine.models.masks import forward_masks, zigzag_rows
    from llmtrain.engine.parallel.context import masked_rows_attention

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    b, h, kv, S, d, cp = TINY_MASKED_SHAPE if ctx.tiny else MASKED_SHAPE
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, S, d, generator=g).to(ctx.device, dtype)
    k, v = (torch.randn(b, kv, S, d, generator=g).to(ctx.device, dtype).requires_grad_() for _ in range(2))
    dout = torch.randn(b, h, S, d, generator=g).to(ctx.device, dtype)
    segments = (torch.arange(S, device=ctx.device) * 5 // S).unsqueeze(0)  # 5 packed samples
    window = S // 3
    rows = zigzag_rows(S, cp, 1, device=ctx.device)
    _, whole = forward_masks(torch.arange(S, device=ctx.device), segments, window, S, 1, None, False, dtype)
    _, mask = forward_masks(rows, segments, window, S, cp, rows, False, dtype)
    q_rows = q.index_select(2, rows).requires_grad_()
    q_all = q.clone().requires_grad_()
    dout_rows = dout.index_select(2, rows)
    out = masked_rows_attention(q_rows, k, v, mask)
    got = (out.detach(), *torch.autograd.grad(out, (q_rows, k, v), dout_rows))
    kr, vr = (t.repeat_interleave(h // kv, 1) for t in (k, v))
    ref = F.scaled_dot_product_attention(q_all, kr, vr, attn_mask=whole)
    masked_dout = torch.zeros_like(dout).index_copy_(2, rows, dout_rows)  # only these rows' gradient
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref, (q_all, k, v), masked_dout)
    want = (ref.detach().index_select(2, rows), ref_dq.index_select(2, rows), ref_dk, ref_dv)
    rel = lambda a, w: float((a.float() - w.float()).norm() / w.float().norm())
    errors = {n: rel(a, w) for n, a, w in zip(("out", "dq", "dk", "dv"), got, want)}

    def run():
        o = masked_rows_attention(q_rows, k, v, mask)
        torch.autograd.grad(o, (q_rows, k, v), dout_rows)

    extra_gib = _extra_gib(run, ctx.cuda)
    tol = 1e-2 if ctx.cuda else 1e-5
    result = {"gpu": ctx.gpu_key, "dtype": str(dtype), "shape": {"b": b, "heads": h, "kv_heads": kv, "S": S,
              "rows": int(rows.numel()), "head_dim": d}, "rel_l2": errors, "tolerance": tol,
              "seconds": _timed(run, 5 if ctx.cuda else 2, ctx.cuda), "extra_gib": extra_gib}
    if not max(errors.values()) <= tol:
        raise CheckFailed(f"all-gather CP's masked rows differ from the whole sequence's: relative L2 {errors} "
                          f"(tolerance {tol})")
    return result

