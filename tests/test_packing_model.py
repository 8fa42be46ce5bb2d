"""Packed rows in the model: block-diagonal causal attention and per-sample RoPE positions.

Acceptance of issue 14 (packing isolation), at the model level, in fp32 on CPU:

* changing one packed sample leaves the logits of the other samples of its row unchanged
  (<= 1e-6; the masked scores are exactly -inf, so in exact arithmetic nothing leaks and
  the only difference allowed is rounding in the kernel's blocking, which is far below 1e-6);
* a sample's logits in a packed row equal its logits alone in an unpacked row (<= 1e-5: the
  same arithmetic, but SDPA with an explicit mask and with ``is_causal`` reduce in different
  block orders over different lengths);
* the token-weighted loss of packed rows equals the unpacked rows' (<= 1e-5, same reason).
"""

from __future__ import annotations

import pytest
import torch

from llmtrain.engine.models.llama import Transformer, packed_mask
from llmtrain.engine.models.init import init_weights
from llmtrain.engine.step import IGNORE, StepLoss
from llmtrain.recipe.schema import ModelConfig

LENGTHS = (5, 9, 7)  # tokens per sample (inputs); the row has a padding tail
SEQ = 24


def tiny(**kw) -> Transformer:
    cfg = ModelConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn_hidden=64, vocab_size=97, max_seq_len=64,
                      rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False, **kw)
    torch.manual_seed(0)
    model = Transformer(cfg)
    init_weights(model, seed=3)
    return model.eval()


def samples(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n + 1,), generator=g) for n in LENGTHS]  # n inputs + the last label


def pack(parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    inputs = torch.zeros(SEQ, dtype=torch.long)
    labels = torch.full((SEQ,), IGNORE, dtype=torch.long)
    positions = torch.zeros(SEQ, dtype=torch.long)
    segments = torch.full((SEQ,), -1, dtype=torch.long)
    at = 0
    for k, s in enumerate(parts):
        n = len(s) - 1
        inputs[at:at + n], labels[at:at + n] = s[:-1], s[1:]
        positions[at:at + n], segments[at:at + n] = torch.arange(n), k
        at += n
    return {k: v.unsqueeze(0) for k, v in dict(inputs=inputs, labels=labels, positions=positions,
                                                  segments=segments).items()}


def spans() -> list[slice]:
    out, at = [], 0
    for n in LENGTHS:
        out.append(slice(at, at + n))
        at += n
    return out


def test_mask_is_block_diagonal_causal_and_keeps_the_diagonal():
    seg = torch.tensor([[0, 0, 1, 1, 1, -1]])
    m = packed_mask(seg)[0, 0]
    assert m.shape == (6, 6) and bool(m.diagonal().all())
    assert m[3].tolist() == [False, False, True, True, False, False]  # sample 1 sees only itself, causally
    assert not bool(m[2, :2].any()) and not bool(m[5, :5].any())


def test_changing_one_sample_leaves_the_others_logits_unchanged():
    model = tiny()
    parts = samples()
    with torch.no_grad():
        a = pack(parts)
        ref = model(a["inputs"], positions=a["positions"], segments=a["segments"])
        changed = list(parts)
        changed[1] = (parts[1] + 1) % 97
        b = pack(changed)
        out = model(b["inputs"], positions=b["positions"], segments=b["segments"])
    s0, s1, s2 = spans()
    assert (out[0, s1] - ref[0, s1]).abs().max() > 1e-3  # the changed sample did change
    for s in (s0, s2):
        assert (out[0, s] - ref[0, s]).abs().max() <= 1e-6


def test_packed_logits_and_loss_equal_unpacked():
    for kw in ({}, {"qkv_bias": True}):
        model = tiny(**kw)
        parts = samples(1)
        with torch.no_grad():
            p = pack(parts)
            packed = model(p["inputs"], positions=p["positions"], segments=p["segments"])
            alone = []
            for s in parts:
                alone.append(model(s[:-1].unsqueeze(0)))
        for sl, logits in zip(spans(), alone):
            assert (packed[0, sl] - logits[0]).abs().max() <= 1e-5
        loss = StepLoss()
        targets = sum(LENGTHS)
        loss.set_targets(targets, ranks_averaged=1)
        packed_loss = loss(packed, p["labels"])
        unpacked = sum(loss(logits, s[1:].unsqueeze(0)) for logits, s in zip(alone, parts))
        mean = torch.nn.functional.cross_entropy(
            torch.cat([l[0] for l in alone]), torch.cat([s[1:] for s in parts]))
        assert abs(float(packed_loss) - float(unpacked)) <= 1e-5
        assert abs(float(unpacked) - float(mean)) <= 1e-6


def test_gradients_do_not_cross_samples():
    """The loss of sample 0 alone has no gradient through sample 2's input embeddings."""
    model = tiny()
    p = pack(samples(2))
    emb = model.tok_embeddings(p["inputs"]).detach().requires_grad_(True)
    model.tok_embeddings, keep = None, model.tok_embeddings
    try:
        out = model(emb, positions=p["positions"], segments=p["segments"])
    finally:
        model.tok_embeddings = keep
    s0, _, s2 = spans()
    out[0, s0].sum().backward()
    assert emb.grad[0, s2].abs().max() == 0 and emb.grad[0, s0].abs().max() > 0


@pytest.mark.parametrize("switches, reference", [
    ({"sliding_window": 4}, {}),  # the window acts (every sample is longer than 4)
    ({"attention_softcap": 0.5, "logit_softcap": 0.3}, {}),  # Gemma 2's caps (our kernel) take the packed mask
    ({"attention_softcap": 0.5, "logit_softcap": 0.3, "sliding_window": 4}, {"sliding_window": 4}),
])
def test_packed_samples_equal_their_logits_alone(switches, reference):
    """A window of 4 (shorter than samples of 5, 9 and 7 tokens) and / or soft-capped attention: each
    packed sample's logits equal its logits alone, and differ from the model without the switch (it
    acts). The band is by position, which restarts per sample, so a sample never sees the previous
    one's tail; the capped kernel takes the same additive mask as SDPA."""
    model, plain = tiny(**switches), tiny(**reference)
    parts = samples(3)
    with torch.no_grad():
        p = pack(parts)
        packed = model(p["inputs"], positions=p["positions"], segments=p["segments"])
        for sl, s in zip(spans(), parts):
            alone = model(s[:-1].unsqueeze(0))
            assert (packed[0, sl] - alone[0]).abs().max() <= 1e-5
            assert (alone - plain(s[:-1].unsqueeze(0))).abs().max() > 1e-3


def test_window_mask_is_saved_once_per_forward_and_planned_so():
    """Every layer's attention saves the band mask for its backward; given the additive float mask
    (``attention_bias``) they all save the same tensor, so one ``[s, s]`` mask per forward is held,
    which is what the plan counts (``activations.stage_terms``: e x S^2, S = s x cp under Ulysses;
    nothing when the window covers the sequence). With SDPA's own conversion of a boolean mask it
    would be one per layer."""
    from dataclasses import replace

    from llmtrain.plan.activations import ActShape, stage_terms

    model = tiny(sliding_window=4)
    seen: dict[int, tuple] = {}

    def pack_hook(t):
        if t.dim() >= 2 and t.shape[-2:] == (SEQ, SEQ) and t.is_floating_point():
            seen[t.untyped_storage().data_ptr()] = tuple(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        model(torch.randint(0, 97, (2, SEQ))).sum().backward()
    assert len(seen) == 1 and model.cfg.layers == 2, seen
    x = ActShape(b=2, s=SEQ, h=32, heads=4, kv_heads=2, ffn=64, vocab=97, e=4, window=4)
    assert stage_terms(x)["window_mask"] == 4 * SEQ * SEQ
    assert stage_terms(replace(x, cp=2, cp_method="ulysses"))["window_mask"] == 4 * (2 * SEQ) ** 2
    assert stage_terms(replace(x, cp=2, cp_method="allgather"))["window_mask"] == 4 * SEQ * 2 * SEQ  # its rows
    assert "window_mask" not in stage_terms(replace(x, window=SEQ))


@pytest.mark.parametrize("window, full_layers, masks", [(None, None, 1), (4, None, 1), (4, [1], 2)])
def test_packed_masks_are_saved_once_per_kind_and_planned_so(window, full_layers, masks):
    """Packed rows: the layers save their additive sample mask ``[b, 1, s, s]``, one tensor per forward
    per kind of layer in use (windowed layers the sample mask with the band, full-attention layers the
    sample mask alone); the plan counts exactly those (``stage_terms`` ``packed_mask``, S = s x cp
    under Ulysses)."""
    from dataclasses import replace

    from llmtrain.plan.activations import ActShape, stage_terms

    model = tiny(sliding_window=window, full_attention_layers=full_layers)
    seen: dict[int, tuple] = {}

    def pack_hook(t):
        if t.dim() >= 2 and t.shape[-2:] == (SEQ, SEQ) and t.is_floating_point():
            seen[t.untyped_storage().data_ptr()] = tuple(t.shape)
        return t

    p = pack(samples(5))
    rows = {k: v.expand(2, -1) for k, v in p.items()}
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        model(rows["inputs"], positions=rows["positions"], segments=rows["segments"]).sum().backward()
    assert len(seen) == masks and all(shape == (2, 1, SEQ, SEQ) for shape in seen.values()), seen
    x = ActShape(b=2, s=SEQ, h=32, heads=4, kv_heads=2, ffn=64, vocab=97, e=4, window=window or 0,
                 full_layers=bool(full_layers), packed=True)
    assert stage_terms(x)["packed_mask"] == masks * 4 * 2 * SEQ * SEQ == 4 * sum(2 * SEQ * SEQ for _ in seen)
    assert "window_mask" not in stage_terms(x)
    assert stage_terms(replace(x, cp=2, cp_method="ulysses"))["packed_mask"] == masks * 4 * 2 * (2 * SEQ) ** 2
    assert stage_terms(replace(x, cp=2, cp_method="allgather"))["packed_mask"] == masks * 4 * 2 * SEQ * 2 * SEQ


@pytest.mark.parametrize("packed, window, causal_rows", [(True, None, False), (False, 5, False), (True, 5, True),
                                                         (False, None, True), (False, 5, True)])
def test_all_gather_masks_are_the_rows_of_the_whole_rows_masks(packed, window, causal_rows):
    """Under all-gather CP a rank's masks (models/masks.py ``forward_masks`` with its zigzag rows) are
    exactly its rows of the masks the model builds without CP: the sample mask, the band, and (the
    soft-capped kernel) the causal mask; at cp 2 and 4, every rank."""
    from llmtrain.engine.models.masks import forward_masks, zigzag_rows

    seq = 32
    segments = torch.tensor([[0] * 7 + [1] * 12 + [2] * 9 + [-1] * 4]) if packed else None
    positions = torch.arange(seq)
    whole = forward_masks(positions, segments, window, seq, 1, None, False, torch.float32)
    causal = torch.zeros(seq, seq).masked_fill_(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    want_full = whole[0] if whole[0] is not None else (causal if causal_rows else None)
    want_band = whole[1] if window is not None else want_full
    for cp in (2, 4):
        for rank in range(cp):
            rows = zigzag_rows(seq, cp, rank)
            full, band = forward_masks(rows, segments, window, seq, cp, rows, causal_rows, torch.float32)
            for got, want in ((full, want_full), (band, want_band)):
                if want is None:
                    assert got is None
                else:
                    assert torch.equal(got, want.index_select(-2, rows)), (cp, rank)


def test_longest_sample_of_packed_rows():
    """longrope's regime under CP comes from the whole row's sample ids (a rank holds a shard of the
    positions): the longest run of one id, padding (-1) excluded, equal to max(positions) + 1."""
    from llmtrain.engine.models.llama import longest_sample

    p = pack(samples(6))
    assert int(longest_sample(p["segments"])) == max(LENGTHS) == int(p["positions"].max()) + 1
    rows = torch.tensor([[0, 0, 1, 1, 1, -1, -1, -1, -1, -1], [0] * 4 + [1] * 6])
    assert int(longest_sample(rows[:1])) == 3 and int(longest_sample(rows)) == 6
