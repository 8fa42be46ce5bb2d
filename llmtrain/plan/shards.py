"""What one rank holds: its pipeline stages, their layers, and the local shape of every parameter.

This is the inventory the memory model (:mod:`llmtrain.plan.memory`) prices. It follows the
engine exactly (``llmtrain/engine/models/llama.py``, ``moe.py``, ``parallel/tensor.py``,
``parallel/data_parallel.py``, ``parallel/zero1.py``):

- **Pipeline stages.** ``pp x pp_virtual_stages`` stages, each a run of consecutive layers
  (``parallel.pp_layers_per_stage`` or an even split). Looped schedules (gpipe, 1f1b,
  interleaved-1f1b, zero-bubble) put stages ``r, r + pp, r + 2 pp, ...`` on pipeline rank
  ``r``; V-shaped ones (zbv, dualpipev) put stages ``r`` and ``2 pp - 1 - r`` on it (torch's
  ``generate_rank_to_stage_mapping(style="v")``). Stage 0 holds ``tok_embeddings``, the last
  stage ``norm`` and ``output`` (the engine sets the others to None). With tied embeddings and
  pp > 1 the last stage's ``output.weight`` is a copy of the embedding with its own gradient
  and AdamW state (``engine/parallel/tied.py``), so it is counted there like an untied output
  layer, also on rank 0 of a V-shaped schedule, which then holds both; only a stage that is
  first and last (pp = 1) holds the one shared Parameter.
- **Tensor parallelism** (Megatron layout): ``wq/wk/wv`` and ``w1/w3`` split their output rows
  over ``tp``, ``wo`` and ``w2`` their input columns; the embedding and the output layer split
  the vocabulary (its gradient too: DTensor's embedding backward returns it replicated, and the
  engine brings it back to the weight's rows, engine/parallel/tensor.py
  ``keep_embedding_grad_sharded``); norms are replicated. MoE blocks are expert-TP
  (``engine/parallel/expert.py``): routed experts split F (``w1/w3`` [E, F/tp, H], ``w2``
  [E, H, F/tp]) and shared experts like the dense MLP; only the router is replicated.
- **Expert parallelism** (``engine/parallel/expert.py``): the stacked expert weights
  ``[E, ...]`` are DTensors sharded on dim 0 over ``ep`` (``E / ep`` experts per rank) and
  data-parallel over ``edp = dp_shard x cp / ep`` (their own FSDP unit on the edp mesh, or
  their own ZeRO-1 optimizer over dp_replicate x edp); router and shared experts stay dense.
- **Data-parallel sharding** (FSDP2's shards, ZeRO-1's owners) of these shapes:
  :mod:`llmtrain.plan.dp_shards`.
- **LoRA** (``train.lora``, ``engine/finetune/lora.py``): every base parameter is frozen
  (``trainable=False``: stored and sharded like any parameter, but no gradient and no AdamW
  state); each target projection ``t`` of every block with base weight ``[out, in]`` gets
  ``<t>.lora_a.weight [rank, in]`` and ``<t>.lora_b.weight [out, rank]`` (no bias). Under TP they
  follow their base: column-wise bases (wq wk wv w1 w3) keep ``lora_a`` replicated and shard
  ``lora_b`` on dim 0; row-wise bases (wo w2) shard ``lora_a`` on dim 1 and keep ``lora_b``
  replicated. FSDP2 shards them on dim 0 like every parameter (:func:`lora_params`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import prod

from llmtrain.recipe.schema import ModelConfig

V_SHAPED = ("zbv", "dualpipev")
ATTENTION_TARGETS = ("wq", "wk", "wv", "wo")
# ``train.lora.experts``: the routed experts' adapters ride in the LoRA key as pseudo-targets e1 / e2 / e3
# (the experts' w1 / w2 / w3), so every consumer that filters targets by name sees them apart
EXPERT_KEYS = {"w1": "e1", "w2": "e2", "w3": "e3"}
EXPERT_NAMES = tuple(EXPERT_KEYS.values())


@dataclass(frozen=True, eq=False)  # identity hash: cheap keys for the per-stage caches below
class ParamShape:
    name: str
    shape: tuple[int, ...]  # local shape after TP and EP
    kind: str  # "matmul" (2-D weight used by a matmul), "norm", "embedding", "expert" (EP-sharded)
    trainable: bool = True  # False: a frozen LoRA base weight (no gradient, no optimizer state)
    hidden_dim: int | None = None  # stacked experts: the dim of H, FSDP's alternative to an uneven dim 0
    numel: int = field(init=False, repr=False)
    rows_rest: tuple[int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", prod(self.shape))
        object.__setattr__(self, "rows_rest", (self.shape[0], prod(self.shape[1:])))


class Stages(tuple):
    """Layer indices per stage (a tuple of tuples) whose hash is computed once: cache keys."""

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = tuple.__hash__(self)
        return h


# ---- pipeline stages ------------------------------------------------------------------------
def stage_layers(layers: int, pp: int, virtual: int, split: list[int] | None = None) -> tuple[tuple[int, ...], ...]:
    """Global layer indices of each pipeline stage (``pp x virtual`` stages; one stage if pp = 1)."""
    return _stage_layers(layers, pp, virtual, tuple(split) if split is not None else None)


@lru_cache(maxsize=1024)
def _stage_layers(layers: int, pp: int, virtual: int, split: tuple[int, ...] | None) -> tuple[tuple[int, ...], ...]:
    stages = pp * virtual if pp > 1 else 1
    if pp > 1 and split is not None and len(split) == stages:
        counts = list(split)
    else:
        base, extra = divmod(layers, stages)
        counts = [base + (1 if i < extra else 0) for i in range(stages)]
    out, start = [], 0
    for c in counts:
        out.append(tuple(range(start, start + c)))
        start += c
    return Stages(out)


def rank_stages(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """Stage indices held by pipeline rank ``pp_rank``, in execution (chunk) order."""
    if pp <= 1:
        return [0]
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(virtual)]


# ---- parameter inventory ------------------------------------------------------------------------
# (rank, target names) of ``train.lora``, or None: the part of the recipe the inventory depends on
LoRAKey = tuple[int, tuple[str, ...]] | None


def lora_key(lora) -> LoRAKey:
    """The hashable inventory key of a :class:`~llmtrain.recipe.schema.LoRAConfig` (None: no LoRA):
    (rank, target names, then ``e1 e2 e3`` for the MLP targets adapted in the routed experts)."""
    if lora is None:
        return None
    names = tuple(lora.target_names)
    if lora.experts:
        names += tuple(EXPERT_KEYS[t] for t in names if t in EXPERT_KEYS)
    return (lora.rank, names)


def block_targets(targets: tuple[str, ...], moe: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A key's targets for one block: (its own projections' -- an MoE block's attention, a dense block's
    attention and MLP --, its routed experts' as ``w1 w2 w3``: an MoE block's with ``train.lora.experts``)."""
    if not moe:
        return tuple(t for t in targets if t not in EXPERT_NAMES), ()
    return (tuple(t for t in targets if t in ATTENTION_TARGETS),
            tuple(w for w, e in EXPERT_KEYS.items() if e in targets))


def expert_lora_params(m: ModelConfig, layer: int, tp: int, ep: int, lora: LoRAKey) -> list[ParamShape]:
    """The routed experts' stacked adapters of MoE block ``layer`` on one TP/EP rank
    (engine/finetune/lora_experts.py): ``lora_a.<t>`` ``[E/ep, r, in]`` then ``lora_b.<t>``
    ``[E/ep, out, r]``; EP splits the experts, expert-TP F (``B`` of w1/w3, ``A`` of w2)."""
    if lora is None or not m.is_moe_layer(layer):
        return []
    rank, targets = lora
    names = block_targets(targets, True)[1]
    e, h, ft = m.moe.num_experts // ep, m.hidden, m.expert_ffn // tp
    kind = "expert" if ep > 1 else "matmul"
    shapes = {"w1": ((e, rank, h), (e, ft, rank)), "w3": ((e, rank, h), (e, ft, rank)), "w2": ((e, rank, ft), (e, h, rank))}
    p = f"layers.{layer}.moe.experts."
    return [ParamShape(f"{p}lora_a.{t}", shapes[t][0], kind) for t in names] + \
        [ParamShape(f"{p}lora_b.{t}", shapes[t][1], kind) for t in names]


def expert_lora_tp(m: ModelConfig, dims, lora: LoRAKey, low_precision_params: bool) -> tuple[int, int, int]:
    """The factors of one MoE block's expert adapters that are replicated over TP (``A`` of w1 / w3, ``B`` of
    w2, each ``[E/ep, r, H]`` or ``[E/ep, H, r]``): their gradients are summed over TP in every backward
    (ExpertTPRegion.replicated), in the parameters' dtype (bf16 under FSDP's bf16 policy, else fp32).
    (count, elements each, bytes each); no count without TP."""
    if lora is None or dims.tp == 1 or not m.is_moe:
        return (0, 0, 4)
    rank, targets = lora
    return (sum(t in targets for t in EXPERT_NAMES), m.moe.num_experts // dims.ep * rank * m.hidden,
            2 if low_precision_params else 4)


def lora_params(m: ModelConfig, layer: int, tp: int, lora: LoRAKey) -> list[ParamShape]:
    """Adapter shapes of block ``layer`` on one TP rank: ``lora_a [rank, in]`` and ``lora_b [out, rank]``
    per target, split over TP like their base weight (see the module docstring)."""
    if lora is None:
        return []
    rank, targets = lora
    bases = _lora_bases(m)
    out = []
    for t in block_targets(targets, m.is_moe_layer(layer))[0]:
        module, rows, cols, column_wise = bases[t]
        a, b = ((rank, cols), (rows // tp, rank)) if column_wise else ((rank, cols // tp), (rows, rank))
        name = f"layers.{layer}.{module}.{t}."
        out += [ParamShape(name + "lora_a.weight", a, "matmul"), ParamShape(name + "lora_b.weight", b, "matmul")]
    return out


def layer_targets(m: ModelConfig, layer: int, targets: tuple[str, ...]) -> tuple[str, ...]:
    """The targets block ``layer`` has adapters on: an MoE block's attention and its routed experts' (``e1
    e2 e3`` with ``train.lora.experts``; the router and shared experts stay frozen, engine/finetune/lora.py),
    a dense block's attention and MLP."""
    own, experts = block_targets(targets, m.is_moe_layer(layer))
    return own + tuple(EXPERT_KEYS[w] for w in experts)


def _lora_bases(m: ModelConfig) -> dict[str, tuple[str, int, int, bool]]:
    """Per LoRA target: (module, out rows, in cols, column-wise under TP) of its base weight."""
    h, hd, f = m.hidden, m.head_dim, m.ffn_hidden
    return {"wq": ("attention", m.heads * hd, h, True), "wk": ("attention", m.kv_heads * hd, h, True),
            "wv": ("attention", m.kv_heads * hd, h, True), "wo": ("attention", h, m.heads * hd, False),
            "w1": ("feed_forward", f, h, True), "w2": ("feed_forward", h, f, False), "w3": ("feed_forward", f, h, True)}


def lora_replicated_numel(m: ModelConfig, layers, tp: int, lora: LoRAKey) -> int:
    """Adapter elements of ``layers`` that are replicated over TP (a column-wise base's ``lora_a``
    ``[rank, in]``, a row-wise base's ``lora_b`` ``[out, rank]``: :func:`lora_params`): their gradients
    come out Partial over the TP group and DTensor all-reduces them once per step (measured:
    planner_fidelity's LoRA TP cases). 0 without TP."""
    if lora is None or tp == 1:
        return 0
    rank, targets = lora
    bases = _lora_bases(m)
    return sum(rank * (cols if column_wise else rows) for layer in layers  # the experts': expert_lora_tp
               for _, rows, cols, column_wise in map(bases.get, block_targets(targets, m.is_moe_layer(layer))[0]))


def _frozen(params: list[ParamShape]) -> list[ParamShape]:
    return [ParamShape(p.name, p.shape, p.kind, False, p.hidden_dim) for p in params]


def block_params(m: ModelConfig, layer: int, tp: int, ep: int, lora: LoRAKey = None) -> list[ParamShape]:
    """Local parameter shapes of transformer block ``layer`` on one TP/EP rank (engine order); with
    ``lora`` the base weights are frozen and the adapters follow them."""
    if lora is not None:
        return _frozen(block_params(m, layer, tp, ep)) + lora_params(m, layer, tp, lora) + \
            expert_lora_params(m, layer, tp, ep, lora)
    h, hd = m.hidden, m.head_dim
    p = f"layers.{layer}."
    out = [
        ParamShape(p + "attention.wq.weight", (m.heads * hd // tp, h), "matmul"),
        ParamShape(p + "attention.wk.weight", (m.kv_heads * hd // tp, h), "matmul"),
        ParamShape(p + "attention.wv.weight", (m.kv_heads * hd // tp, h), "matmul"),
        ParamShape(p + "attention.wo.weight", (h, m.heads * hd // tp), "matmul"),
    ]
    if m.pre_norms:  # every family but OLMo 2
        out += [ParamShape(p + "attention_norm.weight", (h,), "norm"), ParamShape(p + "ffn_norm.weight", (h,), "norm")]
    if m.post_norms:  # Gemma: on the attention's and the MLP's outputs
        out += [ParamShape(p + "attention_post_norm.weight", (h,), "norm"),
                ParamShape(p + "ffn_post_norm.weight", (h,), "norm")]
    if m.qkv_bias:  # split with their column-parallel weights
        out += [ParamShape(p + "attention.wq.bias", (m.heads * hd // tp,), "norm"),
                ParamShape(p + "attention.wk.bias", (m.kv_heads * hd // tp,), "norm"),
                ParamShape(p + "attention.wv.bias", (m.kv_heads * hd // tp,), "norm")]
    if m.qk_norm and m.qk_norm_width == "all":  # OLMo 2: all heads' weights, split with the heads (Shard(0))
        out += [ParamShape(p + "attention.q_norm.weight", (m.heads * hd // tp,), "norm"),
                ParamShape(p + "attention.k_norm.weight", (m.kv_heads * hd // tp,), "norm")]
    elif m.qk_norm:  # one head's weights, replicated on the TP ranks
        out += [ParamShape(p + "attention.q_norm.weight", (hd,), "norm"),
                ParamShape(p + "attention.k_norm.weight", (hd,), "norm")]
    if is_moe_layer(m, layer):
        e, f = m.moe.num_experts, m.expert_ffn
        local_e = e // ep
        kind = "expert" if ep > 1 else "matmul"
        ft = f // tp  # expert-TP
        out += [
            ParamShape(p + "moe.router.weight", (e, h), "matmul"),
            ParamShape(p + "moe.experts.w1", (local_e, ft, h), kind, hidden_dim=2),
            ParamShape(p + "moe.experts.w3", (local_e, ft, h), kind, hidden_dim=2),
            ParamShape(p + "moe.experts.w2", (local_e, h, ft), kind, hidden_dim=1),
        ]
        if m.moe.shared_experts:
            s = m.moe.shared_experts * f // tp
            out += [ParamShape(p + "moe.shared.w1.weight", (s, h), "matmul"),
                    ParamShape(p + "moe.shared.w3.weight", (s, h), "matmul"),
                    ParamShape(p + "moe.shared.w2.weight", (h, s), "matmul")]
    else:
        f = m.ffn_hidden
        out += [ParamShape(p + "feed_forward.w1.weight", (f // tp, h), "matmul"),
                ParamShape(p + "feed_forward.w3.weight", (f // tp, h), "matmul"),
                ParamShape(p + "feed_forward.w2.weight", (h, f // tp), "matmul")]
    return out


def is_moe_layer(m: ModelConfig, layer: int) -> bool:
    return m.is_moe_layer(layer)


def stage_params(m: ModelConfig, layers: list[int], first: bool, last: bool, tp: int, ep: int,
                 lora: LoRAKey = None) -> list[ParamShape]:
    """Every parameter of one pipeline stage (embedding on the first, norm + output on the last)."""
    if lora is not None:
        outer = _frozen(stage_params(m, [], first, last, tp, ep))
        blocks = [q for layer in layers for q in block_params(m, layer, tp, ep, lora)]
        return [q for q in outer if q.name == "tok_embeddings.weight"] + blocks + \
            [q for q in outer if q.name != "tok_embeddings.weight"]
    out: list[ParamShape] = []
    if first:
        # the engine keeps the gradient in the weight's layout (engine/parallel/tensor.py
        # keep_embedding_grad_sharded: DTensor's embedding backward returns it Replicate)
        out.append(ParamShape("tok_embeddings.weight", (m.vocab_size // tp, m.hidden), "embedding"))
    for layer in layers:
        out += block_params(m, layer, tp, ep)
    if last:
        out.append(ParamShape("norm.weight", (m.hidden,), "norm"))
        if not (m.tie_embeddings and first):  # tied, pp = 1: one parameter; pp > 1: the copy counts
            out.append(ParamShape("output.weight", (m.vocab_size // tp, m.hidden), "matmul"))
    return out


def rank_params(m: ModelConfig, stages: list[list[int]], held: list[int], tp: int, ep: int,
                lora: LoRAKey = None) -> list[ParamShape]:
    out: list[ParamShape] = []
    n = len(stages)
    for s in held:
        out += stage_params(m, stages[s], s == 0, s == n - 1, tp, ep, lora)
    return out


# ---- cached per-rank inventory (the search evaluates thousands of layouts) -------------------------
@dataclass(frozen=True)
class Inventory:
    params: tuple[ParamShape, ...]
    layers: tuple[int, ...]
    moe_layers: int
    largest_block: int  # parameters of the largest transformer block (one FSDP unit)
    root: int  # embedding, final norm, output
    dense_numel: int
    expert_numel: int
    first: bool
    last: bool
    matmul_numel: int  # weights a matmul uses (autocast casts these to bf16)
    chunk_layers: tuple[int, ...]  # per held stage: transformer blocks
    chunk_moe: tuple[int, ...]  # per held stage: of which MoE blocks
    trainable_numel: int = -1  # parameters with gradients (LoRA: the adapters); -1 = all of them
    largest_trainable_block: int = -1  # trainable parameters of the largest block; -1 = largest_block
    trainable_expert_numel: int = 0  # of trainable_numel, EP-sharded ones (LoRA on the experts under EP)

    @property
    def trainable(self) -> int:
        return self.dense_numel + self.expert_numel if self.trainable_numel < 0 else self.trainable_numel

    @property
    def trainable_block(self) -> int:
        return self.largest_block if self.largest_trainable_block < 0 else self.largest_trainable_block


_CACHE: dict[tuple, Inventory] = {}


_MODEL_KEYS: dict[int, tuple[ModelConfig, tuple]] = {}


def _model_key(m: ModelConfig) -> tuple:
    hit = _MODEL_KEYS.get(id(m))
    if hit is not None and hit[0] is m:  # recipe variants share their (unchanged) model object
        return hit[1]
    moe = m.moe
    key = (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn_hidden, m.vocab_size, m.tie_embeddings, moe.num_experts,
           moe.top_k, moe.shared_experts, m.expert_ffn, moe.first_dense_layers, m.head_dim, m.qkv_bias, m.qk_norm,
           moe.sparse_step, tuple(moe.dense_layers), m.post_norms, m.pre_norms, m.qk_norm_width)
    if len(_MODEL_KEYS) > 256:
        _MODEL_KEYS.clear()
    _MODEL_KEYS[id(m)] = (m, key)
    return key


_TEMPLATES: dict[tuple, tuple[ParamShape, ...]] = {}


def _block_template(m: ModelConfig, moe: bool, tp: int, ep: int, lora: LoRAKey = None) -> tuple[ParamShape, ...]:
    """One block's parameters (shared objects: every block of a kind has the same shapes)."""
    key = (_model_key(m), moe, tp, ep, lora)
    out = _TEMPLATES.get(key)
    if out is None:
        kind = [i for i in range(m.layers) if m.is_moe_layer(i) == moe]
        layer = kind[0] if kind else 0
        out = _TEMPLATES[key] = tuple(block_params(m, layer, tp, ep, lora))
    return out


def inventory(m: ModelConfig, stages, held: list[int], tp: int, ep: int, lora: LoRAKey = None) -> Inventory:
    """What one pipeline rank holds, cached. The parameter tuple reuses one shape object per
    parameter of a block kind (only sizes matter to the memory model; names are in
    :func:`rank_params`)."""
    stages = stages if isinstance(stages, Stages) else Stages(tuple(s) for s in stages)
    key = (_model_key(m), stages, tuple(held), tp, ep, lora)
    inv = _CACHE.get(key)
    if inv is None:
        moe_set = {i for i in range(m.layers) if m.is_moe_layer(i)}
        dense = _block_template(m, False, tp, ep, lora)
        moe = _block_template(m, True, tp, ep, lora) if m.is_moe else ()
        params: list[ParamShape] = []
        n_last = len(stages) - 1
        for s in held:
            outer = stage_params(m, [], s == 0, s == n_last, tp, ep, lora)  # embedding / final norm / output
            params += [q for q in outer if q.name == "tok_embeddings.weight"]
            for layer in stages[s]:
                params += moe if layer in moe_set else dense
            params += [q for q in outer if q.name != "tok_embeddings.weight"]
        layers = tuple(layer for s in held for layer in stages[s])
        n_moe = sum(1 for layer in layers if layer in moe_set)
        block = max(([sum(q.numel for q in dense)] if len(layers) > n_moe else [])
                    + ([sum(q.numel for q in moe)] if n_moe else []), default=0)
        total = sum(q.numel for q in params)
        inv = Inventory(tuple(params), layers, n_moe, block,
                        total - sum(q.numel for q in dense) * (len(layers) - n_moe) - sum(q.numel for q in moe) * n_moe,
                        sum(q.numel for q in params if q.kind != "expert"),
                        sum(q.numel for q in params if q.kind == "expert"), 0 in held, n_last in held,
                        sum(q.numel for q in params if q.kind in ("matmul", "expert")),
                        tuple(len(stages[s]) for s in held),
                        tuple(sum(1 for layer in stages[s] if layer in moe_set) for s in held),
                        sum(q.numel for q in params if q.trainable),
                        max(([sum(q.numel for q in dense if q.trainable)] if len(layers) > n_moe else [])
                            + ([sum(q.numel for q in moe if q.trainable)] if n_moe else []), default=0),
                        sum(q.numel for q in params if q.trainable and q.kind == "expert"))
        if len(_CACHE) > 20000:
            _CACHE.clear()
        _CACHE[key] = inv
    return inv
