"""Cheap checks of kernels whose CUDA paths have never run: context-parallel attention blocks
(engine/parallel/context_blocks.py: flash on CUDA bf16) and quantized AdamW moments
(engine/quant_optim.py, torchao). The CP check runs before the speed steps (seconds; a wrong
result there would make later numbers meaningless for CP runs). The torchao step is an
option, not an acceptance number, and costs ~45 s of per-shape kernel compiles on CUDA: it runs
in group (g), after the speed rows (``group="options"``)."""

from __future__ import annotations

from . import CheckFailed, Skip, recipe, step, train_run


@step("cp_attention_blocks", est_s=3)
def cp_attention_blocks(ctx) -> dict:
    """Ring-style causal attention from the CP block kernels on one device: the sequence in 4
    chunks, each query chunk against its own chunk (causal) and every earlier one (full), merged
    by log-sum-exp, backward through the blocks with the merged out/lse (exactly what ring CP
    does per step, without the P2P), plus the engine's ``PrefixCausalAttention`` (all-gather CP)
    for the last chunk; vs ``scaled_dot_product_attention(is_causal=True)`` in fp32 on the same
    inputs. CUDA runs bf16 through the flash kernels: relative L2 <= 2e-2 (bf16 inputs, outputs
    rounded to bf16, 2^-9 relative, through softmax and two matmuls; a wrong mask or merge is
    O(1)). CPU runs fp32: <= 1e-5."""
    import torch
    import torch.nn.functional as F

    from llmtrain.engine.parallel.context_blocks import (
        PrefixCausalAttention,
        backend,
        block_backward,
        block_forward,
        default_scale,
        merge_,
        start_accumulators,
    )

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    b, h, s, d = (2, 8, 1024, 128) if not ctx.tiny else (1, 2, 64, 16)
    chunks = 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g).to(ctx.device, dtype) for _ in range(3))
    dout = torch.randn(b, h, s, d, generator=g).to(ctx.device, dtype)
    qr, kr, vr = (t.detach().float().clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
    ref.backward(dout.float())
    scale, c = default_scale(q), s // chunks
    view = lambda t, i: t[:, :, i * c:(i + 1) * c]
    part = lambda t, i: view(t, i).contiguous()
    outs, dq = [], torch.zeros_like(q, dtype=torch.float32)
    dk, dv = torch.zeros_like(dq), torch.zeros_like(dq)
    for i in range(chunks):
        blocks = [(i, True)] + [(j, False) for j in range(i)]
        fwd = [(j, causal, *block_forward(part(q, i), part(k, j), part(v, j), causal, scale)) for j, causal in blocks]
        out, lse = start_accumulators(fwd[0][2], fwd[0][3])
        for _, _, bo, bl, _ in fwd[1:]:
            merge_(out, lse, bo, bl)
        outs.append(out)
        for j, causal, _, _, aux in fwd:
            gq, gk, gv = block_backward(part(dout, i), part(q, i), part(k, j), part(v, j), out, lse, causal, scale, aux)
            view(dq, i).add_(gq.float())
            view(dk, j).add_(gk.float())
            view(dv, j).add_(gv.float())
    rel = lambda a, r: float((a.float() - r).norm() / r.norm())
    errs = {"out": rel(torch.cat(outs, dim=2), ref.detach()), "dq": rel(dq, qr.grad), "dk": rel(dk, kr.grad),
            "dv": rel(dv, vr.grad)}
    # the engine's autograd Function for the all-gather method: the last chunk against all keys
    # (its key gradients hold only that chunk's share, so out and dq are what compare to ref)
    qa, ka, va = (t.detach().clone().requires_grad_() for t in (part(q, chunks - 1), k, v))
    pa = PrefixCausalAttention.apply(qa, ka, va, (chunks - 1) * c)
    pa.backward(part(dout, chunks - 1))
    errs["prefix_out"] = rel(pa, part(ref.detach(), chunks - 1))
    errs["prefix_dq"] = rel(qa.grad, part(qr.grad, chunks - 1))
    tol = 2e-2 if ctx.cuda else 1e-5
    out = {"kernel": backend(q), "dtype": str(dtype), "shape": [b, h, s, d], "chunks": chunks, "rel_l2": errs,
           "tolerance_rel_l2": tol}
    if not max(errs.values()) <= tol:
        raise CheckFailed(f"CP blocks vs full causal attention: {errs} (tolerance {tol})")
    return out


# Every matrix of this model is [128, 128] (MHA, ffn = hidden = vocab): torchao compiles its AdamW
# kernel once per parameter shape on CUDA (seconds each), so two shapes (matrices, norms) keep
# the step short; 128 x 128 = 16384 elements, a multiple of 256: the 8-bit path quantizes them.
SQUARE_MODEL = dict(layers=2, hidden=128, heads=4, kv_heads=4, ffn_hidden=128, vocab_size=128, max_seq_len=64,
                    rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False)


@step("adamw_quantized_states", est_s=45, group="options")
def adamw_quantized_states(ctx) -> dict:
    """``train.optimizer.states`` 8bit and bf16 (torchao's AdamW kernels) on the device: the tiny
    model's 20-step loss curve vs fp32 states, same run otherwise. Block-wise 8-bit moments
    carry ~1 % relative error per element, bf16 ones 0.4 %; the curves may drift by a few
    percent (seen on CPU: 1.4 % for 8bit, 4e-5 for bf16): relative difference <= 5 % per step, and
    each run must learn (last < first)."""
    try:
        import torchao  # noqa: F401
        from torchao.optim import AdamW8bit  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means: not available here
        raise Skip(f"torchao not available: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None
    prec = "bf16" if ctx.cuda else "fp32"
    base = dict(precision=prec, seq=32, micro=4, steps=20)
    ref, _ = train_run(ctx, recipe(ctx, SQUARE_MODEL, **base), ctx.device)
    out = {"loss_fp32_states": ref.losses}
    worst = 0.0
    for states in ("8bit", "bf16"):
        got, _ = train_run(ctx, recipe(ctx, SQUARE_MODEL, states=states, **base), ctx.device)
        rel = max(abs(a - b) / abs(b) for a, b in zip(got.losses, ref.losses))
        out[f"loss_{states}_states"], out[f"max_rel_diff_{states}"] = got.losses, rel
        worst = max(worst, rel)
        if not got.losses[-1] < got.losses[0]:
            raise CheckFailed(f"{states} states did not learn: {got.losses[0]:.4f} -> {got.losses[-1]:.4f}")
    out["tolerance_rel"] = 0.05
    if not worst <= 0.05:
        raise CheckFailed(f"quantized AdamW states vs fp32: max relative loss difference {worst:.4f} > 0.05")
    return out
