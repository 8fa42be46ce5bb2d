"""The ring CP's overlapped hops (plan/ringtime.py): pure arithmetic, hand-computed."""

from __future__ import annotations

import pytest

from llmtrain.plan.activations import ActShape, cp_transient_bytes
from llmtrain.plan.api import plan_recipe
from llmtrain.plan.costmodel import estimate
from llmtrain.plan.ringtime import ring_exposed_share, ring_grad_units, ring_units
from llmtrain.recipe.load import validate_recipe_dict


def test_units_and_grad_dtype():
    """dK/dV accumulate in fp32 at least: 2 K/V-sized messages per hop in bf16, 1 in fp32; per layer
    and micro batch (cp - 1)(passes + 1 + g) + g messages (fp32 cp 4, one pass: 3 x 3 + 1 = 10, the
    count the planner fidelity check measured before the overlap)."""
    assert (ring_grad_units(2), ring_grad_units(4), ring_grad_units(8)) == (2, 1, 1)
    assert ring_units(4, 1, 1) == 10 and ring_units(4, 2, 2) == 17 and ring_units(2, 1, 2) == 6


def test_exposed_share_hand_computed():
    """cp 4, one forward pass, bf16 (g = 2), hop h = 1: forward steps hide behind a_f / 4 = 0.5
    each (3 x 0.5 exposed); backward c = a_b / 4 = 1.5: step 0 max(0, 1 - 1.5) = 0, two middle steps
    max(0, 3 - 1.5) = 1.5 each, the last max(0, 2 - 1.5) = 0.5, the hop home 2: 5.5; over 3 x 4 + 2
    = 14 messages: (1.5 + 5.5) / 14."""
    assert ring_exposed_share(4, 1, 2, 1.0, 2.0, 6.0) == pytest.approx(7.0 / 14.0, rel=1e-12)
    # no compute to hide behind: everything exposed; endless compute: only the hop home
    assert ring_exposed_share(4, 1, 2, 1.0, 0.0, 0.0) == pytest.approx(1.0)
    assert ring_exposed_share(4, 1, 2, 1.0, 1e9, 1e9) == pytest.approx(2.0 / 14.0)
    assert ring_exposed_share(1, 1, 2, 1.0, 0.0, 0.0) == 1.0


def _ring(seq: int, nodes: int = 1):
    recipe = validate_recipe_dict(dict(
        model=dict(preset="llama3-8b"), parallel=dict(cp=2, cp_method="ring"),
        train=dict(seq_len=seq, micro_batch_size=1, global_batch_size=4),
        cluster=dict(nodes=nodes, gpus_per_node=8 // nodes, gpu="h100-sxm")))
    plan = plan_recipe(recipe)
    est = estimate(recipe, plan.validation.dims, plan.validation.batch, plan.placement)
    return [c for c in est.comms if c.dim == "cp"][0]


def test_plan_hides_the_ring_behind_its_blocks():
    """Llama 3 8B, cp 2 in bf16: over NVLink at 8K tokens every hop hides behind its block but the
    dK/dV hop home (2 of the layer's 6 K/V-sized messages); split over 8 nodes (cp across the
    network) at 1K tokens the blocks are too short, and more is exposed."""
    ring = _ring(8192)
    assert ring.exposed_s == pytest.approx(ring.seconds * 2 / 6, rel=1e-9)
    assert "behind its block" in ring.note
    short = _ring(1024, nodes=8)
    assert short.seconds * 2 / 6 < short.exposed_s <= short.seconds


def test_ring_working_memory_counts_the_transfers_in_flight():
    """Without GQA at one head, fp32: cp 2 peaks at step 0's block (3 acc + 7 e = 40 bytes per q
    element), cp 4 at a middle q_half block (5 acc + 6.5 e = 46); bf16 cp 4: 20 + 13 = 33."""
    def q_bytes(cp: int, e: int) -> float:
        x = ActShape(b=1, s=1024, h=64, heads=1, kv_heads=1, ffn=256, vocab=256, tp=1, sp=False, e=e, cp=cp,
                     cp_method="ring")
        return cp_transient_bytes(x) / (1024 * 64)
    assert (q_bytes(2, 4), q_bytes(4, 4), q_bytes(4, 2)) == (40.0, 46.0, 33.0)


def test_steps_without_work_hide_nothing():
    """A windowed layer's chunk pairs (plan/ringwindow.py) leave ring steps with nothing to compute: their
    hops are exposed whole, which equal steps (the zigzag blocks) would hide behind the average step."""
    from llmtrain.plan.ringwindow import ring_window_steps

    equal = ring_exposed_share(4, 1, 2, 1.0, 2.0, 6.0)
    assert ring_exposed_share(4, 1, 2, 1.0, 2.0, 6.0, (0.25,) * 4) == pytest.approx(equal, rel=1e-12)
    lopsided = ring_exposed_share(4, 1, 2, 1.0, 2.0, 6.0, (1.0, 0.0, 0.0, 0.0))
    # forward: 3 hops, the first behind 2 s of work (0 exposed), two bare (1 each); backward: the first K/V
    # hop behind 6 s (0), two K/V + dK/dV hops bare (3 each), the last dK/dV bare (2), the hop home (2): 12 of 14
    assert lopsided == pytest.approx(12.0 / 14.0, rel=1e-12) and lopsided > equal
    steps = ring_window_steps(8, 32768, 4096)  # Mistral's window at 32K on cp 8: the most loaded rank
    assert sum(steps) == pytest.approx(1.0) and min(steps) == 0.0 and len(steps) == 8


def _cp_comms(model: dict, seq: int, cp: int = 4, recompute: str = "none", nodes: int = 1):
    recipe = validate_recipe_dict(dict(
        model=model, parallel=dict(cp=cp, cp_method="ring"),
        train=dict(seq_len=seq, micro_batch_size=1, global_batch_size=4, activation_checkpointing=recompute),
        cluster=dict(nodes=nodes, gpus_per_node=cp // nodes, gpu="h100-sxm")))
    plan = plan_recipe(recipe)
    est = estimate(recipe, plan.validation.dims, plan.validation.batch, plan.placement)
    return recipe, {(c.phase, c.note): c for c in est.comms if c.dim == "cp"}


def test_windowed_layers_exchange_only_their_keys_and_the_rest_walk_the_ring():
    """Gemma 3 1B (a full-attention layer every sixth, window 512) at 8K tokens on cp 4: chunks of 1,024
    tokens, so each windowed layer needs only the last 511 keys of its neighbours' chunks
    (plan/ringwindow.py): the busiest rank sends 2 x 511 of its 2,048 key positions per forward pass, again
    in the backward, and receives as many, whose fp32 dK/dV it sends back; the full-attention layers walk the
    ring. With full recomputation the forward runs twice."""
    for recompute, passes in (("none", 1), ("full", 2)):
        recipe, cp = _cp_comms(dict(preset="gemma3-1b"), 8192, recompute=recompute)
        m = recipe.model
        windowed = len(m.windowed_layers)
        assert 0 < windowed < m.layers
        kv = 2 * 2 * (8192 // 4) * m.kv_heads * m.head_dim  # K and V of the local 2,048 tokens, bf16
        exchange = [c for c in cp.values() if c.phase == "cp-exchange"]
        assert [(c.message_bytes, c.count) for c in exchange] == [
            (kv * 1022 / 2048, 4 * windowed * (passes + 1)),  # 4 micro batches
            (kv * 1022 / 2048 * 2, 4 * windowed)]  # dK/dV in fp32
        assert all(c.exposed_s == pytest.approx(c.seconds) for c in exchange)  # not overlapped (context_exchange.py)
        ring = next(c for c in cp.values() if c.phase == "cp-ring")
        assert ring.message_bytes == kv and ring.count == 4 * (m.layers - windowed) * ring_units(4, passes, 2)
    # a window reaching over several chunks (4,096 of 1,024-token chunks): every layer on the ring
    _, wide = _cp_comms(dict(preset="gemma3-1b", sliding_window=4096), 8192)
    assert [c.phase for c in wide.values()] == ["cp-ring"]
    assert next(iter(wide.values())).count == 4 * 26 * ring_units(4, 1, 2)


def test_the_ring_hides_behind_the_full_attention_layers_when_the_windowed_ones_exchange():
    """Gemma 3 1B at 8K on cp 4 across 4 nodes: its full-attention layers' hops hide behind those layers' own
    blocks (attnshare.ring_layers_executed), not behind the average layer's, which the windowed layers' few
    boxes make short: the same exposed share as the model without a window, where every layer is such a
    layer (0.444; behind the average layer 0.660)."""
    _, mixed = _cp_comms(dict(preset="gemma3-1b"), 8192, nodes=4)
    _, full = _cp_comms(dict(preset="gemma3-1b", sliding_window=None, full_attention_layers=None,
                             local_rope_theta=None), 8192, nodes=4)
    ring, alone = (next(c for c in comms.values() if c.phase == "cp-ring") for comms in (mixed, full))
    assert ring.per_item_s == pytest.approx(alone.per_item_s)
    assert ring.exposed_share == pytest.approx(alone.exposed_share, rel=1e-9)
    assert 0.3 < ring.exposed_share < 0.5


def test_soft_capped_ring_layers_are_priced_by_the_scores_their_calls_run():
    """Gemma 2 9B at 32K on cp 8: the soft-capped kernel runs every score of its calls, the ring's blocks
    (cp + 1) / (2 cp) of [s, S] in the full-attention layers (18,432 keys per query) and the pairs' boxes in
    the windowed half (window 4,096: 0.1874 of [s, S]), 12,287 keys per query on average; the ring's hops hide
    behind the full-attention layers' calls alone."""
    from dataclasses import replace

    from llmtrain.plan import ops
    from llmtrain.plan.attnshare import softcap_call_keys
    from llmtrain.plan.ringwindow import ring_window_work
    from llmtrain.recipe.gpus import GPUS

    recipe = validate_recipe_dict(dict(
        model=dict(preset="gemma2-9b", max_seq_len=32768), parallel=dict(tp=4, cp=8, cp_method="ring"),
        train=dict(seq_len=32768, micro_batch_size=1, global_batch_size=8, activation_checkpointing="full"),
        cluster=dict(nodes=8, gpus_per_node=8, gpu="h100-sxm")))
    plan = plan_recipe(recipe)
    gpu = GPUS["h100-sxm"]
    shape = ops.shape_of(recipe, plan.validation.dims, gpu, 0.5)
    window = ring_window_work(8, 32768, 4096)[1]
    assert len(recipe.model.windowed_layers) * 2 == recipe.model.layers
    assert shape.attention == "softcap" and shape.softcap_keys == round(32768 * (window + 9 / 16) / 2) == 12287
    assert softcap_call_keys(recipe, 8, ring_only=True) == 32768 * 9 // 16
    blocks_only = ops.layer_attention_seconds(replace(shape, softcap_keys=0), gpu)  # every layer as the ring's blocks
    assert ops.layer_attention_seconds(shape, gpu)[0] < 0.75 * blocks_only[0]
