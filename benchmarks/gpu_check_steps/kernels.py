"""Cheap checks of kernels whose CUDA paths have never run: context-parallel attention blocks
(engine/parallel/context_blocks.py: flash on CUDA bf16; ring CP's masked blocks on the memory-efficient
kernel with a bias) and quantized AdamW moments
(engine/quant_optim.py, torchao). The CP check runs before the speed steps (seconds; a wrong
result there would make later numbers meaningless for CP runs). The torchao step is an
option, not an acceptance number, and costs ~45 s of per-shape kernel compiles on CUDA: it runs
in group (g), after the speed rows (``group="options"``)."""

from __future__ import annotations

from . import CheckFailed, Skip, recipe, step, train_run
from .fp8_rates import fp8_rows
from .masked_refs import masked_blocks, window_boxes


@step("cp_attention_blocks", est_s=3)
def cp_attention_blocks(ctx) -> dict:
    """Ring-style causal attention from the CP block kernels on one device: the sequence in 4
    chunks, each query chunk against its own chunk (causal) and every earlier one (full), merged
    by log-sum-exp, backward through the blocks with the merged out/lse (exactly what ring CP
    does per step, without the P2P), plus the engine's ``PrefixCausalAttention`` (all-gather CP)
    for the last chunk; vs ``scaled_dot_product_attention(is_causal=True)`` in fp32 on the same
    inputs; and the masked blocks of ring CP with packed rows (:func:`.masked_refs.masked_blocks`, ``masked_*``), and a
    windowed layer's score boxes without CP (:func:`.masked_refs.window_boxes`, ``window_*``). CUDA runs bf16 through the flash kernels: relative L2 <= 2e-2 (bf16 inputs, outputs
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
        masked_backend,
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
    errs["prefix_out"] = rel(pa.detach(), part(ref.detach(), chunks - 1))
    errs["prefix_dq"] = rel(qa.grad, part(qr.grad, chunks - 1))
    errs.update(masked_blocks(q, k, v, dout, chunks))
    errs.update(window_boxes(q, k, v, dout))
    tol = 2e-2 if ctx.cuda else 1e-5
    out = {"kernel": backend(q), "masked_kernel": masked_backend(q, None), "dtype": str(dtype), "shape": [b, h, s, d],
           "chunks": chunks, "rel_l2": errs, "tolerance_rel_l2": tol}
    if not max(errs.values()) <= tol:
        raise CheckFailed(f"CP blocks vs full causal attention: {errs} (tolerance {tol})")
    return out


# (m, n, k) of y = x W^T, x (m, k), W (n, k): the speed rows' 1.2B model at micro 4 x 2048 tokens (wq, wk/wv, w1/w3,
# w2, the head), Llama 3 8B at 8,192 tokens (wq/wo, wk/wv, w1/w3, w2, the head) and its TP 8 shares (kv, w1/w3, w2,
# the head): what time model v2 prices per shape (plan/gemmtime.py) at the shapes the published rows run
GEMM_SHAPES = [(8192, 2048, 2048), (8192, 1024, 2048), (8192, 8192, 2048), (8192, 2048, 8192), (8192, 32000, 2048),
               (8192, 4096, 4096), (8192, 1024, 4096), (8192, 14336, 4096), (8192, 4096, 14336), (8192, 128256, 4096),
               (8192, 128, 4096), (8192, 1792, 4096), (8192, 4096, 1792), (8192, 16032, 4096)]
TINY_GEMM_SHAPES = [(64, 32, 32), (64, 128, 32), (64, 32, 128)]
# (batch, heads, sequence) of causal SDPA at head dim 128: Llama 3 8B's 32 heads at 2k / 8k (the rows' lengths;
# 4 local heads = TP 8) and 32k (torchtitan's CP rows' per-call keys at CP 1); v2 prices FA2's published curve
ATTENTION_SHAPES = [(4, 32, 2048), (1, 32, 8192), (1, 4, 8192), (1, 8, 32768)]
TINY_ATTENTION_SHAPES = [(1, 2, 64)]
SUSTAIN_S = 3.0  # back-to-back 8192^3 GEMMs while nvidia-smi samples the SM clock and the board power
SMI_FIELDS = ("clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "temperature.gpu")


def _timed(fn, reps: int, cuda: bool) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls after 3 warm-up calls (CUDA events on a GPU)."""
    import statistics
    import time

    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sustained(ctx) -> dict:
    """``SUSTAIN_S`` of back-to-back bf16 8192^3 GEMMs: their mean TFLOP/s, and nvidia-smi's samples
    (every 100 ms) of the SM clock, its maximum, the board power, its limit and the temperature (medians):
    whether the matmul rate MAMF measures in short bursts holds under sustained load."""
    import shutil
    import statistics
    import subprocess
    import time

    import torch

    n = 8192
    a, b = (torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16) for _ in range(2))
    cmd = ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits", "-lms", "100",
           "-i", str(ctx.device.index or 0)]
    smi = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) \
        if shutil.which("nvidia-smi") else None  # no nvidia-smi: the rate alone, no samples
    try:
        torch.cuda.synchronize()
        t0, count = time.perf_counter(), 0
        while time.perf_counter() - t0 < SUSTAIN_S:
            for _ in range(20):
                torch.mm(a, b)
            count += 20
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        text = ""
        if smi is not None:
            smi.terminate()
            text = smi.communicate(timeout=10)[0]
    samples = [[float(x) for x in line.split(",")] for line in text.splitlines()
               if line.count(",") == len(SMI_FIELDS) - 1 and "N/A" not in line]
    out = {"gemm": [n, n, n], "seconds": wall, "tflops": 2 * n**3 * count / wall / 1e12, "samples": len(samples)}
    for i, name in enumerate(SMI_FIELDS):
        if samples:
            out[name.replace(".", "_") + "_median"] = statistics.median(s[i] for s in samples)
    return out


def _sdpa_backend(q) -> str:
    """The backend ``F.scaled_dot_product_attention`` picks for causal ``q, q, q`` (torch's own choice
    function; "unknown" where this torch lacks it)."""
    import torch

    try:
        from torch.nn.attention import SDPBackend
        return SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name
    except Exception:  # noqa: BLE001 - a private function: a record without the name, not a failed step
        return "unknown"


def _attention_rows(ctx, dtype, reps: int) -> list[dict]:
    """Causal SDPA forward and forward + backward per ``ATTENTION_SHAPES``, the backend SDPA chose,
    beside v2's price of the engine's kernel (``plan.attentiontime.attention_seconds``: on Hopper the
    rate this check measured before, ``SDPA_MEASURED``) and of FA2's published curve (``fa2_*``)."""
    import torch
    import torch.nn.functional as F

    from llmtrain.plan.attentiontime import attention_seconds
    from llmtrain.recipe.gpus import GPUS

    rows, d = [], (128 if not ctx.tiny else 16)
    for b, h, s in (TINY_ATTENTION_SHAPES if ctx.tiny else ATTENTION_SHAPES):
        q, k, v = (torch.randn(b, h, s, d, device=ctx.device, dtype=dtype, requires_grad=True) for _ in range(3))
        dout = torch.randn(b, h, s, d, device=ctx.device, dtype=dtype)
        fwd = _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps, ctx.cuda)

        def both():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), dout)
        total = _timed(both, reps, ctx.cuda)
        p_fwd, p_bwd = attention_seconds(b, s, s, h, d, 0.5, GPUS[ctx.gpu_key])
        a_fwd, a_bwd = attention_seconds(b, s, s, h, d, 0.5, GPUS[ctx.gpu_key], kernel="fa2")
        flops = 4.0 * b * s * s * h * d * 0.5  # causal: half the scores (v2's convention)
        rows.append({"batch": b, "heads": h, "seq": s, "head_dim": d, "backend": _sdpa_backend(q),
                     "fa2_fwd_bwd_tflops": 3.5 * flops / (a_fwd + a_bwd) / 1e12,
                     "fwd_tflops": flops / fwd / 1e12,
                     "fwd_bwd_tflops": 3.5 * flops / total / 1e12, "v2_fwd_tflops": flops / p_fwd / 1e12,
                     "v2_fwd_bwd_tflops": 3.5 * flops / (p_fwd + p_bwd) / 1e12, "fwd_vs_v2": p_fwd / fwd,
                     "fwd_bwd_vs_v2": (p_fwd + p_bwd) / total})
        del q, k, v, dout
    return rows


@step("kernel_rates", est_s=20, group="options")
def kernel_rates(ctx) -> dict:
    """Issue 18 item 6: bf16 GEMMs of the published rows' per-rank shapes (``GEMM_SHAPES``), timed as
    the engine runs them (``F.linear`` forward; the input gradient ``dy W`` and the weight gradient
    ``dy^T x`` backward), beside time model v2's price of the same shape on this GPU
    (``plan.gemmtime.gemm_fwd_bwd``: the measured-best matmul fraction x tile/wave efficiency); the
    same for causal SDPA (``ATTENTION_SHAPES``, v2: the engine's SDPA price, and FA2's curve beside it), and
    for FP8 GEMMs of the same shapes on FP8 GPUs (fp8_rates.py); and on CUDA the rate held
    over ``SUSTAIN_S`` of back-to-back GEMMs with nvidia-smi's SM clock and power. A record for
    calibration, not a target: the check is only that no rate exceeds the datasheet peak (a timing
    that does is broken)."""
    import torch
    import torch.nn.functional as F

    from llmtrain.plan.gemmtime import gemm_fwd_bwd
    from llmtrain.recipe.gpus import GPUS

    gpu = GPUS[ctx.gpu_key]
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    reps = 20 if ctx.cuda else 2
    rows = []
    for m, n, k in (TINY_GEMM_SHAPES if ctx.tiny else GEMM_SHAPES):
        x, w = torch.randn(m, k, device=ctx.device, dtype=dtype), torch.randn(n, k, device=ctx.device, dtype=dtype)
        dy = torch.randn(m, n, device=ctx.device, dtype=dtype)
        fwd = _timed(lambda: F.linear(x, w), reps, ctx.cuda)
        bwd = _timed(lambda: (dy @ w, dy.t() @ x), reps, ctx.cuda)
        p_fwd, p_bwd = gemm_fwd_bwd(m, n, k, gpu)
        flops = 2.0 * m * n * k
        rows.append({"m": m, "n": n, "k": k, "fwd_tflops": flops / fwd / 1e12, "bwd_tflops": 2 * flops / bwd / 1e12,
                     "v2_fwd_tflops": flops / p_fwd / 1e12, "v2_bwd_tflops": 2 * flops / p_bwd / 1e12,
                     "fwd_vs_v2": p_fwd / fwd, "bwd_vs_v2": p_bwd / bwd})
        del x, w, dy
    out = {"gpu": ctx.gpu_key, "dtype": str(dtype), "gemms": rows, "attention": _attention_rows(ctx, dtype, reps)}
    out |= fp8_rows(ctx, TINY_GEMM_SHAPES if ctx.tiny else GEMM_SHAPES, reps, _timed)
    if ctx.cuda:
        torch.cuda.empty_cache()
        out["sustained"] = _sustained(ctx)
        fastest = max([r[f] for r in rows for f in ("fwd_tflops", "bwd_tflops")] + [out["sustained"]["tflops"]]
                      + [r[f] for r in out["attention"] for f in ("fwd_tflops", "fwd_bwd_tflops")])
        if fastest > 1.02 * ctx.peak_flops / 1e12:
            raise CheckFailed(f"a GEMM ran at {fastest:.0f} TFLOP/s, above the {ctx.peak_flops / 1e12:.0f} peak: "
                              "the timing is broken")
        fp8 = [r[f] for r in out.get("fp8_gemms", []) for f in ("fwd_tflops", "bwd_tflops")]
        if fp8 and max(fp8) > 1.02 * GPUS[ctx.gpu_key].peak_flops_fp8 / 1e12:
            raise CheckFailed(f"an FP8 GEMM ran at {max(fp8):.0f} TFLOP/s, above the FP8 peak: the timing is broken")
    return out


# (tokens, vocabulary, hidden) of the output layer and its loss: Llama 3 8B's, one micro batch of 8,192 tokens
LOSS_SHAPE = (8192, 128256, 4096)
TINY_LOSS_SHAPE = (256, 512, 64)
OLD_LOSS_CHUNK = 256  # the chunk the 128 MiB rule alone gave at a 128K vocabulary, before the twenty-fourth session


@step("loss_rates", est_s=10, group="options")
def loss_rates(ctx) -> dict:
    """The output layer and its cross-entropy at Llama 3 8B's shape (``LOSS_SHAPE``), forward and
    backward as the engine runs them: its chunked loss at the chunk its rule gives now
    (plan/losschunk.py: at least half the hidden size) and at the 256 tokens it gave before, and
    torch's ``F.cross_entropy`` over the whole fp32 logits, each beside time model v2's price
    (plan/losstime.py; the twenty-fourth session planned 166 / 67 / 52 ms on an H100). Checks: the
    three losses agree (relative 1e-2: bf16 GEMMs, fp32 loss math; 1e-5 in fp32 on CPU) and no
    rate exceeds the datasheet peak."""
    import torch
    import torch.nn.functional as F

    from llmtrain.engine.parallel.loss import chunked_cross_entropy
    from llmtrain.plan.losschunk import loss_chunk_tokens
    from llmtrain.plan.losstime import head_loss_seconds
    from llmtrain.recipe.gpus import GPUS

    gpu = GPUS[ctx.gpu_key]
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    tokens, vocab, hidden = TINY_LOSS_SHAPE if ctx.tiny else LOSS_SHAPE
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).to(ctx.device, dtype).requires_grad_()
    w = (0.02 * torch.randn(vocab, hidden, generator=g)).to(ctx.device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(ctx.device)
    losses = {}

    def engine(chunk):
        def run():
            loss = chunked_cross_entropy(h, w, labels, reduction="sum", chunk_tokens=chunk)
            torch.autograd.grad(loss, (h, w))
            losses[f"engine_{chunk}"] = float(loss.detach())
        return run

    def unchunked():
        loss = F.cross_entropy(F.linear(h, w).float(), labels, reduction="sum")
        torch.autograd.grad(loss, (h, w))
        losses["unchunked"] = float(loss.detach())

    now = loss_chunk_tokens(tokens, vocab, hidden)
    old = min(OLD_LOSS_CHUNK, tokens) if not ctx.tiny else max(1, now // 2)
    reps, e = (5 if ctx.cuda else 2), h.element_size()
    rows, flops = {}, 6.0 * tokens * vocab * hidden
    for name, fn, kind, chunk in ((f"engine_{now}", engine(now), "engine", now), (f"engine_{old}", engine(old), "engine", old),
                                  ("unchunked", unchunked, "unchunked", None)):
        seconds = _timed(fn, reps, ctx.cuda)
        planned = sum(head_loss_seconds(kind, tokens, vocab, hidden, e, gpu, chunk=chunk))
        rows[name] = {"seconds": seconds, "v2_seconds": planned, "v2_vs_measured": planned / seconds,
                      "tflops": flops / seconds / 1e12}
    spread = max(losses.values()) / min(losses.values()) - 1
    tol = 1e-2 if ctx.cuda else 1e-5
    out = {"gpu": ctx.gpu_key, "dtype": str(dtype), "shape": {"tokens": tokens, "vocab": vocab, "hidden": hidden},
           "chunk_now": now, "chunk_before": old, "rows": rows, "loss_spread": spread, "tolerance": tol}
    if not spread <= tol:
        raise CheckFailed(f"the losses disagree: {losses} (relative spread {spread:.2e}, tolerance {tol})")
    fastest = max(r["tflops"] for r in rows.values())
    if ctx.cuda and fastest > 1.02 * ctx.peak_flops / 1e12:
        raise CheckFailed(f"the head ran at {fastest:.0f} TFLOP/s, above the {ctx.peak_flops / 1e12:.0f} peak")
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
