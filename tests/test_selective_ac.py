"""The selective recomputation policy (engine/parallel/checkpointing.py), single process.

- Gradients equal no recomputation **exactly** (same kernels, same order: recomputation re-runs
  the identical element-wise ops), over two forward/backward passes of the same module: the
  second pass catches policy state left over from the first (torch stops recomputing inside w2,
  so w2's exit hook never runs in backward). LoRA on every projection too.
- w2's output (the block's last matmul) is not kept: the policy stores a placeholder for it,
  and the bytes saved after forward are below plain "save every mm" SAC by w2's output size.
Multi-rank TP (the partial sums, the saved reduction) is covered by tests/test_engine_parity.py
(tp2_fsdp2_ac_selective, zero1_ac_selective at tp 2) and the byte counts by tests/test_costmodel.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from llmtrain.engine.finetune.lora import apply_lora  # noqa: E402
from llmtrain.engine.models.llama import Transformer  # noqa: E402
from llmtrain.engine.parallel import checkpointing as ck  # noqa: E402
from llmtrain.recipe.load import load_recipe  # noqa: E402
from tests.helpers_plan import REPO  # noqa: E402


def _model(mode: str, lora: bool):
    recipe = load_recipe(REPO / "recipes/debug.yaml", ["parallel.tp=1", "model.layers=2"] + (["train.lora.rank=4"] if lora else []))
    torch.manual_seed(0)
    model = Transformer(recipe.model)
    if lora:
        apply_lora(model, recipe.train.lora)
    for p in model.parameters():
        p.data.normal_(std=0.05)
    ck.apply_activation_checkpointing(model, mode)
    return model


def _grads(model, passes: int = 2):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(passes):
        tokens = torch.randint(0, 512, (2, 32), generator=g)
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        out.append({n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                    for n, p in model.named_parameters() if p.grad is not None})
    return out


@pytest.mark.parametrize("lora", [False, True])
def test_selective_gradients_equal_no_recomputation(lora):
    ref, got = _grads(_model("none", lora)), _grads(_model("selective", lora))
    for a, b in zip(ref, got):
        assert set(a) == set(b) and a
        for k in a:
            assert torch.equal(a[k], b[k]), k


def _stored_bytes(storage) -> int:
    """Bytes of the tensors a forward left in the selective-checkpoint storages (placeholders hold none)."""
    total = 0
    for entries in storage.values():
        for entry in entries.values():
            leaves = entry if isinstance(entry, (tuple, list)) else [entry]
            for leaf in leaves:
                val = getattr(leaf, "val", None)
                if isinstance(val, torch.Tensor):
                    total += val.numel() * val.element_size()
    return total


def test_w2_output_is_not_kept(monkeypatch):
    original = ck._selective_context
    storages = []

    def capture(plain: bool):
        def context(region=None):
            modes = original(None if plain else region)
            storages.append(modes[0].storage)
            return modes
        return context

    measured = {}
    for plain in (False, True):
        storages.clear()
        monkeypatch.setattr(ck, "_selective_context", capture(plain))
        _model("selective", False)(torch.randint(0, 512, (2, 32)))
        measured[plain] = sum(_stored_bytes(st) for st in storages)
    w2_out = 2 * 32 * 128 * 4  # [b s, hidden] fp32, per block; two blocks
    assert measured[True] - measured[False] == 2 * w2_out, measured  # torch's SAC "save every mm" keeps it
