"""FP8 training (torchao ``Float8Linear``, CPU emulation) under tensor parallelism, inside a torchrun job.

Called by tests/dist_worker.py for a case ``{"check": "tests.fp8_tp_check:tp2"}`` (every rank of a
4-rank job: mesh (dp 2, tp 2)); asserted in tests/test_engine_parity.py::test_fp8_tp2_matches_one_process.
The model is the GPU check's tiny one (every projection a multiple of 16, so all 14 block Linears
convert), built on meta, converted with the engine's ``apply_float8(emulate=True)``, sharded with the
engine's ``apply_tensor_parallel`` (torchao's Float8 styles for the converted Linears), materialized
from seed 0 and trained ``STEPS`` SGD steps on one fixed batch. The reference is the same model,
seed and batch without TP, emulated fp8, in this process (no collectives).

Layouts: ``tp2`` (plain TP; the two dp rows run it identically) and ``tp2_fsdp_ag`` (FSDP2 zero 3 over
dp 2 on top, with ``fp8_all_gather``, fp32 parameters). Sequence parallelism is attempted once and
its error recorded: with SP, torchao casts the sequence-sharded activation to float8 *before* the
all-gather (the point of its styles) and gloo has no float8 dtype ("Invalid scalar type"), so SP +
fp8 runs only on NCCL (the GPU check's ``fp8_tp``). Keep this check last in its job: that failed
attempt is the last collective it issues. Returns, per layout, the losses, the worst relative
difference of the step-1 gradients (full tensors), the Float8 Linears and torchao TP-style casts on
every rank and the dtypes FSDP2 all-gathered; and fp8's own step-1 effect (fp32 against fp8).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

STEPS = 4


def _model(device, mesh=None, sp: bool = False, fsdp_mesh=None, fp8_all_gather: bool = False, fp8: bool = True):
    from benchmarks.gpu_check_steps import TINY_MODEL

    from llmtrain.engine.models.init import init_weights
    from llmtrain.engine.models.llama import Transformer
    from llmtrain.engine.parallel.data_parallel import apply_fsdp
    from llmtrain.engine.parallel.float8 import apply_float8
    from llmtrain.engine.parallel.tensor import apply_tensor_parallel
    from llmtrain.recipe.schema import ModelConfig

    with torch.device("meta"):
        model = Transformer(ModelConfig.model_validate(TINY_MODEL))
    converted = apply_float8(model, fp8_all_gather=fp8_all_gather, emulate=True) if fp8 else 0
    if mesh is not None:
        apply_tensor_parallel(model, mesh, sequence_parallel=sp, loss_parallel=False)
    if fsdp_mesh is not None:
        apply_fsdp(model, fsdp_mesh, zero=3, pp_enabled=False, precision="fp32")
    model.to_empty(device=device)
    init_weights(model, 0)
    return model, converted


def _train(model, tokens, fsdp: bool = False, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    from llmtrain.engine.parallel.float8 import precompute_fp8_scales

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], {}
    for step in range(steps):
        if fsdp:
            precompute_fp8_scales([model])
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        if step == 0:
            grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                     for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


def _rel(grads: dict, ref: dict) -> float:
    return max(((grads[k] - g).abs().max() / g.abs().max()).item() for k, g in ref.items())


def tp2(device) -> dict:
    """See the module docstring. Also counts torchao's float8 casts inside its TP styles (> 0: the
    Float8 styles, not the plain ones, handled the inputs) and the dtypes FSDP2's pre-all-gather
    hook produced, and measures fp8's own effect (the fp32 run against the fp8 one) so that the
    tolerance can be seen to sit far below it."""
    import torchao.float8.float8_tensor_parallel as f8tp
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from llmtrain.engine.parallel.float8 import is_float8_linear

    world = dist.get_world_size()
    root = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, 33), generator=gen).to(device)
    ref_model, converted = _model(device)
    ref_losses, ref_grads = _train(ref_model, tokens)
    fp32_losses, fp32_grads = _train(_model(device, fp8=False)[0], tokens, steps=1)  # step 1 is enough to see it
    out = {"ref_losses": ref_losses, "converted": converted,
           "fp8_effect": {"loss": abs(fp32_losses[0] - ref_losses[0]), "grad_rel": _rel(fp32_grads, ref_grads)}}
    casts, gathered = [0], []
    cast, pre_gather = f8tp.hp_tensor_to_float8_dynamic, WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    def counting_cast(*args, **kwargs):
        casts[0] += 1
        return cast(*args, **kwargs)

    def recording_gather(self, mesh):  # FSDP2 checks the hook's signature: torchao's is (self, mesh)
        res = pre_gather(self, mesh)
        gathered.append(str(res[0][0].dtype))
        return res

    f8tp.hp_tensor_to_float8_dynamic, WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = counting_cast, recording_gather
    try:
        for name, kw in (("tp2", {}), ("tp2_fsdp_ag", {"fsdp_mesh": root["dp"], "fp8_all_gather": True})):
            casts[0], gathered[:] = 0, []
            model, _ = _model(device, root["tp"], **kw)
            n_float8 = sum(is_float8_linear(m) for m in model.modules())
            losses, grads = _train(model, tokens, fsdp="fsdp_mesh" in kw)
            local = torch.tensor([_rel(grads, ref_grads), n_float8, casts[0]], dtype=torch.float64)
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
            out[name] = {"losses": losses, "grad_rel": local[0].item(), "float8_linears": int(local[1].item()),
                         "tp_style_casts": int(local[2].item()), "gathered": sorted(set(gathered)),
                         "fp8_gathers": sum("float8" in d for d in gathered)}
    finally:
        f8tp.hp_tensor_to_float8_dynamic, WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = cast, pre_gather
    try:
        model, _ = _model(device, root["tp"], sp=True)
        out["sp"] = {"losses": _train(model, tokens)[0]}
    except Exception as exc:  # noqa: BLE001 - recorded: the test asserts exactly which error
        out["sp"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    dist.barrier()
    return out
