"""The plan as a stable JSON object (``plan --json``) and as rich text for the terminal.

JSON schema (``schema_version`` 1), top level: ``valid``, ``errors`` and ``warnings`` (each
``{path, message, hint}``), ``recipe``, ``world_size``, ``model`` (architecture and
``params_total``/``params_active``, ``trainable_params``: all parameters, or with ``train.lora``
the adapters, and ``lora``: ``{rank, alpha, scale, dropout, targets}`` or null), ``parallel`` (degrees, ``dp``, ``edp``, ``zero`` and the
data-parallel mode), ``batch`` (``dp``, ``micro_batch_size``, ``grad_accum``, ``microbatches``,
``global_batch_size``, ``seq_len``, ``tokens_per_step``), ``pipeline`` (``bubble_fraction``),
``layout`` (``mesh_dims``, ``mesh_shape``, ``nodes`` with each node's ranks and coordinate
ranges, ``rank_coords`` for every rank in ``mesh_dims`` order, ``groups`` per dimension, and
``ep`` when EP > 1), and the cost model (docs/planner.md): ``memory`` (``peak_gib`` of the worst
rank, ``breakdown_gib``, ``per_rank`` per pipeline rank (with its ``trainable_params``, TP/PP-local
before data-parallel sharding), ``trainable_params_per_rank`` (their largest), ``fits``, ``hints``), ``flops``, ``comm``
(per dimension and collective, with its link), ``bubble_fraction`` and ``time`` (``step_s``,
``tokens_per_s_per_gpu``, ``tflops_per_gpu``, ``mfu``, ``breakdown_s``). ``batch``, ``pipeline``,
``layout`` and the cost keys are null when the layout is invalid.
With ``--hosts``, ``launch`` holds the environment every node gets (``env``: ``{name, value, source,
secret}``, secret values as ``****``, URL user-info and token shapes masked inside other values;
``launcher_env``: the per-run variables the launcher adds).
"""

from __future__ import annotations

from itertools import product
from typing import Any

from llmtrain.plan.api import Plan
from llmtrain.plan.bubble import bubble_fraction
from llmtrain.plan.cost_json import cost_to_dict
from llmtrain.plan.costmodel import estimate
from llmtrain.plan.dims import MESH_DIMS, ParallelDims
from llmtrain.plan.params import count_params, trainable_params
from llmtrain.cluster.placement import Placement

SCHEMA_VERSION = 1
DETAIL_RANKS = 64  # print every rank's coordinates up to this world size


def dp_mode(plan: Plan) -> str:
    p, dims = plan.recipe.parallel, plan.validation.dims
    if dims is None or dims.dp == 1:
        return "none (dp = 1)"
    names = {0: "DDP", 1: "ZeRO-1 (optimizer states sharded)", 2: "ZeRO-2 (+ gradients sharded)",
             3: "ZeRO-3 / FSDP (+ parameters sharded)"}
    mode = names[p.zero]
    if p.zero > 0 and dims.dp_replicate > 1 and dims.dp_shard > 1:
        mode = f"HSDP: replicate {dims.dp_replicate} x {mode.split(' (')[0]} over {dims.dp_shard}"
    return mode


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    r, v = plan.recipe, plan.validation
    m, p = r.model, r.parallel
    params = count_params(m)
    dims = v.dims
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "valid": v.valid,
        "errors": [e.to_dict() for e in v.errors],
        "warnings": [w.to_dict() for w in v.warnings],
        "recipe": r.name,
        "world_size": plan.placement.world_size,
        "model": {
            "preset": m.preset, "layers": m.layers, "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads,
            "ffn_hidden": m.ffn_hidden, "vocab_size": m.vocab_size, "moe": m.moe.model_dump() if m.is_moe else None,
            "params_total": params.total, "params_active": params.active,
            "trainable_params": trainable_params(m, r.train.lora), "lora": lora_dict(r.train.lora),
        },
        "parallel": {
            **{name: (dims.degree(name) if dims else getattr(p, name)) for name in (*MESH_DIMS, "ep")},
            "dp": dims.dp if dims else None, "edp": dims.edp if dims else None,
            "zero": p.zero, "dp_mode": dp_mode(plan), "reshard_after_forward": p.zero == 3 and p.pp == 1,
            "sequence_parallel": p.sequence_parallel and p.tp > 1, "pp_schedule": p.pp_schedule if p.pp > 1 else None,
            "pp_virtual_stages": p.pp_virtual_stages, "cp_method": p.cp_method if p.cp > 1 else None,
        },
        "batch": v.batch.to_dict() if v.batch else None,
        "pipeline": None,
        "layout": None,
    }
    if v.batch is not None:
        out["pipeline"] = {"bubble_fraction": bubble_fraction(p.pp_schedule, p.pp, p.pp_virtual_stages, v.batch.microbatches)}
    if dims is not None:
        out["layout"] = layout_dict(dims, plan.placement)
    out.update(cost_dict(plan))
    if plan.hostfile is not None:
        out["launch"] = launch_dict(plan)
    return out


def lora_dict(lora) -> dict[str, Any] | None:
    if lora is None:
        return None
    return {"rank": lora.rank, "alpha": lora.alpha, "scale": lora.scale, "dropout": lora.dropout,
            "targets": list(lora.target_names), "experts": lora.experts}


def cost_dict(plan: Plan) -> dict[str, Any]:
    """The cost model's keys (``memory``, ``flops``, ``comm``, ``bubble_fraction``, ``time``; all
    null when the layout is invalid). See docs/planner.md for the model and docs/plan-json.md."""
    v = plan.validation
    if v.dims is None or v.batch is None:
        return {"memory": None, "flops": None, "comm": None, "bubble_fraction": None, "time": None, "recommendations": []}
    cost = estimate(plan.recipe, v.dims, v.batch, plan.placement)
    from llmtrain.plan.hier import hsdp_hint  # noqa: PLC0415

    hint = hsdp_hint(plan.recipe, plan.placement, cost, v.dims)  # plan/hier.py: in-node HSDP for FSDP across nodes
    notes = [hint] if hint else []
    if plan.recipe.model.attention_softcap is not None and plan.recipe.planner.attention_kernel == "engine":
        notes.append({"kind": "softcap_kernel", "set": {},
                      "message": "model.attention_softcap runs the engine's own attention kernel, unfused "
                                 "(engine/models/softcap.py: every score through memory, no causal skipping), and "
                                 "this plan prices it so; a stack with a fused soft-capping kernel (FlashAttention "
                                 "2's softcap): --set planner.attention_kernel fa2"})
    return {**cost_to_dict(cost, v.dims), "recommendations": notes}


def launch_dict(plan: Plan) -> dict[str, Any]:
    """With --hosts: what every node's environment gets from the env policy (secrets masked)."""
    from llmtrain.errors import LLMTrainError
    from llmtrain.launch.envpolicy import RESERVED, policy_env

    launch = plan.recipe.launch
    out: dict[str, Any] = {"rendezvous": launch.rendezvous, "rdzv_port": launch.rdzv_port, "env": None,
                           "env_error": None, "launcher_env": list(RESERVED)}
    try:
        env = policy_env(launch)
    except LLMTrainError as exc:
        out["env_error"] = exc.problems[0].line()
        return out
    # "secret": the value is (partly) masked: a secret name, an env file value, URL user-info, a token shape
    out["env"] = [{"name": v.name, "value": v.shown(), "source": v.source, "secret": v.secret or v.shown() != v.value}
                  for v in env]
    return out


def layout_dict(dims: ParallelDims, placement: Placement) -> dict[str, Any]:
    # Row-major over the mesh shape (tp fastest) is exactly dims.coords(rank) for rank 0, 1, ...;
    # itertools.product builds it ~10x faster, which matters at 16,384+ ranks.
    rank_coords = [list(c) for c in product(*(range(size) for size in dims.mesh_shape))]
    nodes = []
    for index, (node, first) in enumerate(zip(placement.nodes, placement.first_ranks)):
        columns = list(zip(*rank_coords[first:first + node.slots]))
        nodes.append({
            "node": index, "host": node.host, "slots": node.slots, "ranks": [first, first + node.slots - 1],
            "coords_range": {name: [min(col), max(col)] for name, col in zip(MESH_DIMS, columns)},
        })
    groups = {}
    for name in MESH_DIMS:
        first_group = dims.group(0, name)
        groups[name] = {"size": dims.degree(name), "count": dims.world_size // dims.degree(name), "first": first_group,
                        "crosses_nodes": placement.spans_nodes(first_group)}
    ep = None
    if dims.ep > 1:
        ep = {"size": dims.ep, "borrowed_from": "dp_shard x cp", "dp_shard_x_cp": dims.dp_shard * dims.cp,
              "expert_dp": dims.edp, "first_ep_group": dims.ep_group(0), "first_expert_dp_group": dims.edp_group(0),
              "explanation": ep_explanation(dims)}
    return {"mesh_dims": list(MESH_DIMS), "mesh_shape": list(dims.mesh_shape), "nodes": nodes,
            "rank_coords": rank_coords, "groups": groups, "ep": ep}


def ep_explanation(dims: ParallelDims) -> str:
    return (f"EP {dims.ep} borrows ranks, it does not multiply them: the dp_shard x cp = {dims.dp_shard} x {dims.cp} = "
            f"{dims.dp_shard * dims.cp} ranks of each (pp, dp_replicate, tp) slice form {dims.edp} expert-parallel groups "
            f"of {dims.ep} consecutive ranks; experts are split over each group, and each expert's weights are "
            f"data-parallel over the {dims.edp} ranks holding it (read: 'EP {dims.ep} x expert-DP {dims.edp}'). "
            f"Attention and dense weights stay data-parallel over all dp = {dims.dp} ranks.")
