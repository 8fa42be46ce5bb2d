"""The selective recomputation policy (engine/parallel/checkpointing.py), single process.

- Gradients equal no recomputation **exactly** (same kernels, same order: recomputation re-runs
  the identical element-wise ops), over two forward/backward passes of the same module: the
  second pass catches policy state left over from the first (torch stops recomputing inside w2,
  so w2's exit hook never runs in backward). LoRA on every projection too.
- w2's output (the block's last matmul) is not kept: the policy stores a placeholder for it,
  and the bytes saved after forward are below plain "save every mm" SAC by w2's output size.
- ``selective_mm`` (torchtitan's op policy, by module): the same exact gradients, with and
  without LoRA; in the SAC storage the mm outputs of wk, wo (no TP here) and w3 are marked for
  recomputation (no tensor held) while wq's, wv's and w1's are saved, also with LoRA adapters on
  every projection (their own mm outputs stay saved: decided by module, the adapters' extra
  matmuls do not shift which base outputs go); the bytes saved fall by exactly those outputs.
Multi-rank TP (the partial sums, the saved reduction) is covered by tests/test_engine_parity.py
(tp2_fsdp2_ac_selective, zero1_ac_selective and zero1_ac_selective_mm at tp 2 + SP) and the byte
counts by tests/test_costmodel.py (tp2_sp_selective_mm: wo's reduced output kept under TP).
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


@pytest.mark.parametrize("mode", ["selective", "selective_mm"])
@pytest.mark.parametrize("lora", [False, True])
def test_selective_gradients_equal_no_recomputation(lora, mode):
    ref, got = _grads(_model("none", lora)), _grads(_model(mode, lora))
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


# the block's matmuls in forward order (engine/models/llama.py); with LoRA each base mm is
# followed by its lora_a and lora_b mm (LoRALinear.forward)
ORDER = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")


_CONTEXT = ck._selective_context  # the unpatched one (each test may patch it more than once)


def _block_storages(mode: str, lora: bool, monkeypatch) -> list:
    original = _CONTEXT
    storages = []

    def context(region=None):
        modes = original(region)
        storages.append(modes[0].storage)
        return modes

    monkeypatch.setattr(ck, "_selective_context", context)
    _model(mode, lora)(torch.randint(0, 512, (2, 32)))
    return storages


def _held(entry) -> torch.Tensor | None:
    leaves = entry if isinstance(entry, (tuple, list)) else [entry]
    vals = [getattr(leaf, "val", None) for leaf in leaves]
    return vals[0] if isinstance(vals[0], torch.Tensor) else None


@pytest.mark.parametrize("lora", [False, True])
def test_selective_mm_recomputes_wk_wo_w3_outputs(lora, monkeypatch):
    storages = _block_storages("selective_mm", lora, monkeypatch)
    assert len(storages) == 2  # one per block (two blocks)
    widths = {"wq": 128, "wk": 64, "wv": 64, "wo": 128, "w1": 352, "w3": 352, "w2": 128}  # debug: h 128, kv 64, f 352
    per = 3 if lora else 1  # base, lora_a, lora_b
    for storage in storages:
        mm = storage[torch.ops.aten.mm.default]
        assert len(mm) == per * len(ORDER)
        for i, name in enumerate(ORDER):
            base = _held(mm[per * i])
            if name in ("wk", "wo", "w3"):
                assert base is None, f"{name}'s output is in the SAC storage"
            elif name != "w2":  # w2: a placeholder (test_w2_output_is_not_kept)
                assert base is not None and tuple(base.shape) == (64, widths[name]), name
            if lora:  # lora_a's [b s, rank] and lora_b's output stay saved (w2's lora_b: a placeholder)
                a, b = _held(mm[per * i + 1]), _held(mm[per * i + 2])
                assert a is not None and tuple(a.shape) == (64, 4), name
                assert (b is None) == (name == "w2"), name
    # bytes: exactly wk's, wo's and w3's outputs fewer than selective, per block
    sel = sum(_stored_bytes(st) for st in _block_storages("selective", lora, monkeypatch))
    got = sum(_stored_bytes(st) for st in storages)
    assert sel - got == 2 * 64 * (64 + 128 + 352) * 4, (sel, got)


def test_every_fused_attention_backend_is_saved():
    """Whichever fused kernel ``F.scaled_dot_product_attention`` dispatches to (flash, efficient, cuDNN
    on Hopper with torch >= 2.11, the CPU flash, an out-of-tree backend), its output is saved, not
    recomputed: every forward ``_scaled_dot_product_*`` op the dispatcher registers (its default
    overload) is in the policy's save set, and the policy says MUST_SAVE for it. Left out: ops with a
    CompositeImplicitAutograd kernel (``_scaled_dot_product_attention_math``: it decomposes before the
    policy's dispatch mode sees it, into the matmuls the policy saves). The dispatcher's registry, not
    ``dir(torch.ops.aten)``, which lists only the ops some code has already touched. cuDNN's was missing
    until a GPU check on an H100."""
    import torch

    forward = sorted({name.split("::")[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
                      if name.startswith("aten::_scaled_dot_product_") and not name.endswith("_backward")
                      and not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")})
    assert {"_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention"} <= set(forward), forward
    missing = [n for n in forward if getattr(torch.ops.aten, n).default not in ck._SAVE]
    assert not missing, f"SDPA backends the selective policy would recompute: {missing}"
    policy = ck._decide(ck._Region(), torch.ops.aten._scaled_dot_product_cudnn_attention.default,
                        torch.empty(1))
    assert policy == ck.CheckpointPolicy.MUST_SAVE, policy
