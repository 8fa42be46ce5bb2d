"""A windowed layer's attention without CP on its score boxes (engine/models/window_attention.py) against the
model's dense masked call, in fp64: outputs and q/k/v gradients, with packed rows' samples, Gemma 2's soft-cap,
the model's masks (models/masks.py forward_masks); and the box rule (plan/localwindow.py) against brute force:
every visible score inside exactly one box, each box the tight bounding box of its pair's visible scores."""

from __future__ import annotations

import pytest
import torch

from llmtrain.engine.models.masks import forward_masks, masked_sdpa
from llmtrain.engine.models.softcap import softcap_attention
from llmtrain.engine.models.window_attention import local_window_attention, runs_local
from llmtrain.plan.localwindow import local_boxes, local_chunk, local_window_work

SHAPES = [(64, 8), (96, 20), (256, 40), (120, 31), (48, 30)]  # (seq, window)


@pytest.mark.parametrize("seq, window", SHAPES)
def test_boxes_cover_every_visible_score_once_and_tightly(seq, window):
    c = local_chunk(seq, window)
    assert c is not None and seq % c == 0 and window / 2 <= c <= 2 * window
    covered = torch.zeros(seq, seq, dtype=torch.int64)
    for g, h, r0, r1, k0, k1 in local_boxes(seq, window):
        block = torch.zeros(seq, seq, dtype=torch.int64)
        block[g * c + r0:g * c + r1, h * c + k0:h * c + k1] = 1
        covered += block
        p = torch.arange(g * c, (g + 1) * c).unsqueeze(1)
        q = torch.arange(h * c, (h + 1) * c).unsqueeze(0)
        seen = ((p - q >= 0) & (p - q < window)).nonzero()
        assert (seen[:, 0].min().item(), seen[:, 0].max().item() + 1, seen[:, 1].min().item(),
                seen[:, 1].max().item() + 1) == (r0, r1, k0, k1)  # tight
    p, q = torch.arange(seq).unsqueeze(1), torch.arange(seq).unsqueeze(0)
    visible = (p - q >= 0) & (p - q < window)
    assert (covered[visible] == 1).all() and (covered <= 1).all()
    executed, saved = local_window_work(seq, window)
    assert executed == covered.sum().item() / seq**2 < 1
    assert saved == sum(r1 - r0 for _, _, r0, r1, _, _ in local_boxes(seq, window)) / seq


def test_rows_that_do_not_chunk_keep_the_dense_call():
    assert local_chunk(997, 300) is None and not runs_local(997, 300)  # a prime row: no divisor near the window
    assert local_chunk(64, 64) is None and local_chunk(64, None) is None  # no band
    assert local_window_work(997, 300) is None


def _masks(seq: int, window: int, packed: bool):
    segments = None
    if packed:  # samples of 23, 17, 40, ... tokens
        cuts = torch.tensor([0, 23, 40, 80, 101, 150, 190, 230])
        segments = torch.bucketize(torch.arange(seq), cuts[1:], right=True).unsqueeze(0)
    _, band = forward_masks(torch.arange(seq), segments, window, seq, 1, None, False, torch.float64)
    return band


@pytest.mark.parametrize("seq, window", SHAPES)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_boxes_equal_the_dense_masked_call_in_fp64(seq, window, packed, softcap):
    gen = torch.Generator().manual_seed(seq + window)
    q, k, v, dout = (torch.randn(2, 4, seq, 16, generator=gen, dtype=torch.float64) for _ in range(4))
    mask = _masks(seq, window, packed)

    def run(fn):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*ins)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in ins]

    dense = run(lambda a, b, c: masked_sdpa(a, b, c, mask) if softcap is None else softcap_attention(a, b, c, mask, softcap))
    boxes = run(lambda a, b, c: local_window_attention(a, b, c, mask, window, softcap))
    worst = max((x - y).abs().max().item() for x, y in zip(boxes, dense))
    assert worst < 1e-10, worst


@pytest.mark.parametrize("first", ["llmtrain.engine.parallel.context_blocks", "llmtrain.engine.models.window_attention",
                                   "llmtrain.engine.models.llama"])
def test_the_kernel_blocks_and_the_models_import_in_any_order(first):
    """context_blocks imports the models package (the soft-capped kernel), whose llama.py imports
    window_attention, which uses context_blocks: a fresh interpreter importing any of them first works."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", f"import {first}; import llmtrain.engine.models.window_attention as w; "
                           "w.blocks.box_forward_"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
