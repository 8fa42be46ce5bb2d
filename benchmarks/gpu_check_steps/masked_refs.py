"""The masked halves of the GPU check's ``cp_attention_blocks`` step (kernels.py): ring CP's blocks with
packed rows' document mask and a windowed layer's score boxes, each against SDPA with the whole mask in
fp32. Helpers, not steps (the step module imports them), as fp8_rates.py for the fp8 steps."""

from __future__ import annotations


def masked_blocks(q, k, v, dout, chunks: int) -> dict:
    """Ring CP's masked blocks (engine/parallel/context_ring.py with packed rows): the same chunks, each
    block given its view of one additive document mask (3 samples of uneven lengths, so some blocks hold
    rows that see none of their keys: lse -inf), merged and differentiated as the ring does; vs SDPA with
    the whole mask in fp32. On CUDA the memory-efficient kernel with a bias (``masked_backend``)."""
    import torch
    import torch.nn.functional as F

    from llmtrain.engine.models.masks import attention_bias, packed_mask
    from llmtrain.engine.parallel.context_blocks import block_backward, block_forward, default_scale, merge_, start_accumulators

    s = q.shape[2]
    segments = torch.zeros(1, s, dtype=torch.long, device=q.device)
    segments[:, s // 3:] = 1
    segments[:, s // 3 + s // 5:] = 2
    mask = attention_bias(packed_mask(segments), q.dtype)  # [1, 1, s, s]
    qr, kr, vr = (t.detach().float().clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask.float())
    ref.backward(dout.float())
    scale, c = default_scale(q), s // chunks
    part = lambda t, i: t[:, :, i * c:(i + 1) * c].contiguous()
    outs, dq = [], torch.zeros_like(q, dtype=torch.float32)
    dk, dv = torch.zeros_like(dq), torch.zeros_like(dq)
    for i in range(chunks):
        blocks = [i] + list(range(i))  # the diagonal first: every row sees itself
        views = {j: mask[..., i * c:(i + 1) * c, j * c:(j + 1) * c] for j in blocks}
        fwd = [(j, *block_forward(part(q, i), part(k, j), part(v, j), False, scale, mask=views[j])) for j in blocks]
        out, lse = start_accumulators(fwd[0][1], fwd[0][2])
        for _, bo, bl, _ in fwd[1:]:
            merge_(out, lse, bo, bl)
        outs.append(out)
        for j, _, _, aux in fwd:
            gq, gk, gv = block_backward(part(dout, i), part(q, i), part(k, j), part(v, j), out, lse, False, scale, aux,
                                        views[j])
            dq[:, :, i * c:(i + 1) * c].add_(gq.float())
            dk[:, :, j * c:(j + 1) * c].add_(gk.float())
            dv[:, :, j * c:(j + 1) * c].add_(gv.float())
    rel = lambda a, r: float((a.float() - r).norm() / r.norm())
    return {"masked_out": rel(torch.cat(outs, dim=2), ref.detach()), "masked_dq": rel(dq, qr.grad),
            "masked_dk": rel(dk, kr.grad), "masked_dv": rel(dv, vr.grad)}


def window_boxes(q, k, v, dout) -> dict:
    """A windowed layer without CP on its score boxes (engine/models/window_attention.py, forty-second session:
    each box one masked kernel call, on CUDA the memory-efficient kernel with a bias) with a window of a
    quarter of the row, vs SDPA with the whole band mask in fp32."""
    import torch
    import torch.nn.functional as F

    from llmtrain.engine.models.masks import forward_masks
    from llmtrain.engine.models.window_attention import local_window_attention

    s = q.shape[2]
    window = s // 4
    _, band = forward_masks(torch.arange(s, device=q.device), None, window, s, 1, None, False, q.dtype)
    qr, kr, vr = (t.detach().float().clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=band.float())
    ref.backward(dout.float())
    qb, kb, vb = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = local_window_attention(qb, kb, vb, band, window)
    out.backward(dout)
    rel = lambda a, r: float((a.float() - r).norm() / r.norm())
    return {"window_out": rel(out.detach(), ref.detach()), "window_dq": rel(qb.grad, qr.grad),
            "window_dk": rel(kb.grad, kr.grad), "window_dv": rel(vb.grad, vr.grad)}
