"""Every cross-field rule of a recipe, checked in one place, all problems reported together.

Each rule adds a :class:`~llmtrain.errors.Problem` with the dotted recipe path, the numbers
involved, and the fix (the valid values when the set is small). Legal but poor choices are
warnings. The result carries the resolved :class:`ParallelDims` and :class:`BatchMath` when the
layout itself is consistent, so ``plan`` can still show them next to unrelated errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd

from llmtrain.errors import Problem
from llmtrain.plan.batch import BatchMath
from llmtrain.plan.bubble import bubble_fraction
from llmtrain.plan.comm import powersgd_start
from llmtrain.plan.dims import ParallelDims
from llmtrain.plan.divisors import choices as _choices
from llmtrain.plan.divisors import divisors  # noqa: F401 (re-exported: plan/hier.py, plan/search.py)
from llmtrain.plan.validate_model import check_model
from llmtrain.cluster.placement import Placement
from llmtrain.recipe.schema import SPLIT_BACKWARD_SCHEDULES, Recipe

INTERLEAVED = ("interleaved-1f1b", "zero-bubble")
V_SHAPED = ("zbv", "dualpipev")
# recomputation that caches op outputs for one recomputed forward (torch's selective checkpoint)
SELECTIVE = ("selective", "selective_mm")
BUBBLE_WARN = 0.2


@dataclass
class Validation:
    dims: ParallelDims | None = None
    batch: BatchMath | None = None
    errors: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.errors


def validate(recipe: Recipe, placement: Placement) -> Validation:
    out = Validation()
    err, warn = out.errors.append, out.warnings.append
    p, m, t = recipe.parallel, recipe.model, recipe.train
    world = placement.world_size
    min_slots = placement.distinct_slots[0]

    # -- world size and dp_shard inference -------------------------------------------------
    fixed = p.pp * p.dp_replicate * p.cp * p.tp
    dp_shard = p.dp_shard
    if p.dp_shard == -1:
        if world % fixed:
            err(Problem("parallel", f"pp x dp_replicate x cp x tp = {p.pp}x{p.dp_replicate}x{p.cp}x{p.tp} = {fixed} "
                        f"does not divide the world size {world}",
                        f"choose degrees whose product divides {world}, or change the number of GPUs"))
            dp_shard = None
        else:
            dp_shard = world // fixed
    elif fixed * p.dp_shard != world:
        err(Problem("parallel", f"pp x dp_replicate x dp_shard x cp x tp = {fixed * p.dp_shard} but the world size is {world}",
                    "set parallel.dp_shard: -1 to infer it, or make the product equal the GPUs "
                    "(hostfile slots or cluster.nodes x cluster.gpus_per_node)"))
        dp_shard = None

    # -- expert parallelism ------------------------------------------------------------------
    if p.ep > 1 and not m.is_moe:
        err(Problem("parallel.ep", f"ep is {p.ep} but the model is dense (model.moe.num_experts = {m.moe.num_experts})",
                    "set parallel.ep: 1, or use an MoE model"))
    if dp_shard is not None and (dp_shard * p.cp) % p.ep:
        err(Problem("parallel.ep", f"ep ({p.ep}) does not divide dp_shard x cp = {dp_shard}x{p.cp} = {dp_shard * p.cp} "
                    "(EP borrows those ranks)", f"use ep in {_choices(divisors(dp_shard * p.cp))}"))
    if m.is_moe and m.moe.num_experts % p.ep:
        err(Problem("model.moe.num_experts", f"num_experts ({m.moe.num_experts}) not divisible by ep ({p.ep})",
                    f"use parallel.ep in {_choices(divisors(m.moe.num_experts))}"))
    _check_moe_fields(recipe, err)

    # -- tensor parallelism --------------------------------------------------------------------
    tp_sizes = [("model.heads", m.heads), ("model.kv_heads", m.kv_heads), ("model.ffn_hidden", m.ffn_hidden),
                ("model.vocab_size", m.vocab_size)]
    if m.is_moe:
        tp_sizes.append(("model.moe.expert_ffn_hidden", m.expert_ffn))
    common = 0
    for _, value in tp_sizes:
        common = gcd(common, value)
    for path, value in tp_sizes:
        if value % p.tp:
            err(Problem("parallel.tp", f"{path.split('.')[-1]} ({value}) not divisible by tp ({p.tp})",
                        f"use tp in {_choices(divisors(common, min_slots))}"))
    if p.tp > min_slots:
        err(Problem("parallel.tp", f"tp ({p.tp}) exceeds the GPUs per node ({min_slots}); a TP group must stay "
                    "inside one node's NVLink domain (it communicates every layer)",
                    f"use tp <= {min_slots} and move the rest to pp or dp"))
    elif p.tp > 1 and any(s % p.tp for s in placement.distinct_slots):
        warn(Problem("parallel.tp", f"tp ({p.tp}) does not divide every node's slots "
                     f"({list(placement.distinct_slots)}): some TP groups cross nodes",
                     "use a tp that divides the slots of every node"))

    # -- model shape and what the model's features allow (plan/validate_model.py) -----------------
    check_model(recipe, err, warn)

    # -- held-out evaluation during training (llmtrain.engine.evaluate) ------------------------
    if t.eval_interval:
        if not recipe.data.eval_path:
            err(Problem("data.eval_path", f"train.eval_interval is {t.eval_interval} but data.eval_path is not set",
                        "set data.eval_path to held-out text, or train.eval_interval=0"))
        # every layout evaluates (pp: a forward-only pass over the training chunks, engine/eval_pipeline.py;
        # cp: windows sharded like training's); the held-out windows use train.seq_len, so the seq_len
        # rules below cover them too

    # -- context parallelism and sequence splits ----------------------------------------------
    if p.cp > 1:
        zigzag = p.cp_method in ("ring", "allgather")  # 2 cp chunks: rank r holds r, 2cp-1-r (engine/parallel/context.py)
        need = 2 * p.cp if zigzag else p.cp
        if t.seq_len % need:
            why = f"2 x cp for load-balanced {p.cp_method} attention" if zigzag else "cp"
            err(Problem("train.seq_len", f"seq_len ({t.seq_len}) not divisible by {why} = {need}",
                        f"use a seq_len that is a multiple of {need}"))
        # Ulysses re-shards q, k, v from sequence to heads: K/V heads that do not split over cp are repeated to
        # the query heads first (engine/parallel/context.py), so only the query heads must split over tp x cp
        # (kv_heads: TP's rule)
        if p.cp_method == "ulysses" and m.heads % (p.tp * p.cp):
            err(Problem("parallel.cp", f"ulysses needs heads ({m.heads}) divisible by tp x cp = {p.tp * p.cp}",
                        "use cp_method ring or allgather, or tp and cp whose product divides heads"))
    if p.tp > 1 and p.sequence_parallel and (t.seq_len // max(1, p.cp)) % p.tp:
        err(Problem("train.seq_len", f"sequence parallel splits the per-CP-rank sequence ({t.seq_len // p.cp}) over tp ({p.tp}), "
                    "which does not divide it", f"use a seq_len that is a multiple of cp x tp = {p.cp * p.tp}, or sequence_parallel: false"))

    # -- pipeline ------------------------------------------------------------------------------
    v = p.pp_virtual_stages
    if p.pp > 1:
        if p.pp_schedule in INTERLEAVED and v < 2:
            err(Problem("parallel.pp_virtual_stages", f"{p.pp_schedule} needs >= 2 stages per rank, got {v}",
                        "set pp_virtual_stages: 2 (or more)"))
        if p.pp_schedule in V_SHAPED and v != 2:
            err(Problem("parallel.pp_virtual_stages", f"{p.pp_schedule} is V-shaped: exactly 2 stages per rank, got {v}",
                        "set pp_virtual_stages: 2"))
        if p.pp_schedule in SPLIT_BACKWARD_SCHEDULES and t.activation_checkpointing in SELECTIVE:
            # torch's selective checkpoint replays its cached outputs into one recomputed forward; the
            # weight pass is a second backward of the block, which recomputes again and finds the cache
            # consumed ("Trying to backward an extra time": measured on zero-bubble, zbv and dualpipev)
            err(Problem("train.activation_checkpointing", f"{t.activation_checkpointing} recomputation cannot run under "
                        f"{p.pp_schedule}, whose split backward recomputes each block twice (input, then weight "
                        "gradients) and torch's selective checkpoint allows one",
                        "use activation_checkpointing none or full, or pp_schedule 1f1b / interleaved-1f1b"))
        if p.pp_schedule in ("gpipe", "1f1b") and v != 1:
            err(Problem("parallel.pp_virtual_stages", f"{p.pp_schedule} runs one stage per rank, got {v}",
                        "set pp_virtual_stages: 1, or pp_schedule: interleaved-1f1b"))
    elif v != 1:
        warn(Problem("parallel.pp_virtual_stages", f"{v} virtual stages have no effect with pp = 1", "remove it"))
    stages = p.pp * v
    # Tied embeddings with pp > 1 need no rule: the last stage holds a copy of the embedding whose
    # gradient is summed with the first stage's (engine/parallel/tied.py; planned in plan/shards.py).
    if p.pp_layers_per_stage is not None:
        split = p.pp_layers_per_stage
        if len(split) != stages or sum(split) != m.layers or any(x < 0 for x in split):
            err(Problem("parallel.pp_layers_per_stage", f"{split} must have pp x pp_virtual_stages = {stages} "
                        f"non-negative entries summing to model.layers ({m.layers})",
                        f"e.g. {_even_split(m.layers, stages)}"))
    elif m.layers % stages:
        err(Problem("model.layers", f"layers ({m.layers}) not divisible by pp x pp_virtual_stages = {p.pp}x{v} = {stages}",
                    f"use pp x virtual stages in {_choices(divisors(m.layers))}, or give parallel.pp_layers_per_stage, "
                    f"e.g. {_even_split(m.layers, stages)}"))

    # -- data and fine-tuning (before the layout is accepted: an error here means no layout) ------
    _check_data(recipe, err)
    _check_lora(recipe, err, warn)
    _check_precision_features(recipe, err, warn)

    # -- batch math ------------------------------------------------------------------------------
    if dp_shard is not None:
        dims = ParallelDims(p.pp, p.dp_replicate, dp_shard, p.cp, p.tp, p.ep)
        dp = dims.dp
        gbs = t.global_batch_size or t.micro_batch_size * dp
        per_pass = t.micro_batch_size * dp
        if gbs % per_pass:
            ok = [mb for mb in divisors(gbs // dp) if (gbs // dp) % mb == 0] if gbs % dp == 0 else []
            hint = (f"use micro_batch_size in {_choices(ok)}" if ok else
                    f"use a global_batch_size that is a multiple of micro_batch_size x dp = {per_pass}")
            err(Problem("train.global_batch_size", f"global_batch_size ({gbs}) is not micro_batch_size x grad_accum x dp "
                        f"(micro_batch_size {t.micro_batch_size} x dp {dp} = {per_pass} does not divide it)", hint))
        else:
            out.batch = BatchMath(dp, t.micro_batch_size, gbs // per_pass, gbs, t.seq_len)
            _check_microbatches(recipe, out.batch, err, warn)
        if p.zero > 0 and dp == 1:
            warn(Problem("parallel.zero", f"zero {p.zero} shards over data parallelism, but dp is 1", "set zero: 0"))
        # bf16 reduction is real in every mode (torch 2.13 FSDP2 keeps reduce_dtype=bf16 with fp32
        # parameters: it is clamped to None only when equal to param_dtype; zero 0/1 and EP cast
        # their buckets): nothing to refuse, only a no-op to point out
        if p.reduce_dtype == "bf16" and dp * p.cp == 1:
            warn(Problem("parallel.reduce_dtype", "reduce_dtype bf16 has no effect: no gradient is reduced (dp x cp is 1)",
                         "remove it"))
        _check_compression(recipe, dp * p.cp, err, warn)
        if p.zero == 3 and p.pp > 1:
            warn(Problem("parallel.zero", "with pp > 1 parameters are not resharded after forward (memory as zero 2), "
                         "under every schedule: the zero-bubble ones need the unsharded weights for their weight-gradient pass",
                         "nothing to do; set zero: 2 to make it explicit"))
        if not out.errors:
            out.dims = dims

    if recipe.train.schedule.warmup_steps > t.steps:
        warn(Problem("train.schedule.warmup_steps", f"warmup ({recipe.train.schedule.warmup_steps}) is longer than the run ({t.steps} steps)",
                     "shorten the warmup"))
    return out


FINETUNE_SOURCES = ("chat", "instruction", "text")


def _check_compression(recipe: Recipe, dpcp: int, err, warn) -> None:
    """``parallel.grad_compression`` (engine/parallel/compression.py) needs the whole local gradient
    on every rank at the step's end: zero 0/1 only (FSDP reduce-scatters inside its own backward
    hooks, so there is no full gradient to compress). TP, PP, EP and CP work: every DP rank holds
    the same local shards, compressed over its DP (expert-DP) group."""
    p = recipe.parallel
    if p.powersgd_start_step and p.grad_compression != "powersgd":
        warn(Problem("parallel.powersgd_start_step", f"powersgd_start_step {p.powersgd_start_step} has no effect "
                     f"with grad_compression {p.grad_compression} (PowerSGD's warm-up)", "remove it"))
    elif p.grad_compression == "powersgd" and powersgd_start(recipe) >= recipe.train.steps:
        warn(Problem("parallel.powersgd_start_step", f"powersgd_start_step {powersgd_start(recipe)} >= train.steps "
                     f"{recipe.train.steps}: every step all-reduces the whole gradient, nothing is compressed",
                     "lower it (torch advises ~10 % of the steps)"))
    if p.grad_compression == "none":
        return
    if p.zero >= 2:
        err(Problem("parallel.grad_compression", f"grad_compression {p.grad_compression} needs zero 0 or 1: FSDP (zero "
                    f"{p.zero}) reduce-scatters the gradients inside its backward, so no rank holds a whole gradient "
                    "to compress", "set parallel.zero: 0 or 1, or grad_compression: none"))
    if p.reduce_dtype == "bf16":
        err(Problem("parallel.reduce_dtype", f"reduce_dtype bf16 does not apply with grad_compression {p.grad_compression} "
                    "(its messages are fp32)", "remove reduce_dtype, or set grad_compression: none"))
    if dpcp == 1:
        warn(Problem("parallel.grad_compression", f"grad_compression {p.grad_compression} has no effect: no gradient is "
                     "reduced (dp x cp is 1)", "remove it"))


def _check_data(recipe: Recipe, err) -> None:
    """Data-source rules: a path where one is read, a chat template where one is needed, packing
    only where rows are built from samples."""
    d = recipe.data
    if d.source == "memmap" and not d.path:
        err(Problem("data.path", "source memmap needs a path", "set data.path to a directory written by `llmtrain data prepare`"))
    if d.source in FINETUNE_SOURCES and not d.path:
        err(Problem("data.path", f"source {d.source} reads samples from data.path, which is not set",
                    "set data.path to a .jsonl file" + (" or .txt" if d.source == "text" else "") + " (or a directory of them)"))
    if d.source == "chat" and (d.tokenizer == "byte" or d.tokenizer.startswith("bpe:")):
        err(Problem("data.tokenizer", f"source chat needs a chat template, which tokenizer {d.tokenizer!r} does not have "
                    "(it comes from a Hugging Face tokenizer directory's tokenizer_config.json or chat_template.jinja)",
                    "set data.tokenizer to a Hugging Face tokenizer directory, or use source instruction"))
    if d.packing and d.source not in FINETUNE_SOURCES:
        err(Problem("data.packing", f"packing needs samples to pack, but source {d.source} already yields full "
                    "train.seq_len rows", "set data.packing: false, or use source chat, instruction or text"))
    # Context parallelism splits each row's sequence over cp ranks; every method takes the packed rows'
    # per-sample mask: Ulysses' attention holds whole rows (of its heads), all-gather and ring take this
    # rank's rows of the mask (engine/models/masks.py; the ring a view per block, context_ring.py).


def _check_lora(recipe: Recipe, err, warn) -> None:
    """LoRA adapters exist for the attention projections and the dense MLPs (llmtrain/engine/finetune/lora.py),
    and with ``lora.experts`` for the routed experts (per-expert stacked adapters, finetune/lora_experts.py);
    routers and shared experts stay frozen. Without ``experts`` MLP targets leave an MoE model's experts
    frozen, as PEFT's all-linear does (transformers' experts are 3D parameters, not Linear modules)."""
    lora, m = recipe.train.lora, recipe.model
    if lora is None:
        return
    mlp = [t for t in lora.target_names if t in ("w1", "w2", "w3")]
    if lora.experts:
        if not m.is_moe:
            err(Problem("train.lora.experts", "experts is true, but the model is dense (no routed experts)",
                        "remove train.lora.experts"))
        elif not mlp:
            err(Problem("train.lora.experts", f"experts is true, but targets {list(lora.target_names)} list no MLP "
                        "projection to adapt in the experts", "add w1, w2 and/or w3 to train.lora.targets"))
        if lora.dropout > 0:
            err(Problem("train.lora.dropout", f"dropout {lora.dropout:g} with experts: the routed experts' adapters have "
                        "no dropout (PEFT's expert adapters neither)", "set train.lora.dropout: 0"))
        return
    if not m.is_moe or not mlp:
        return
    moe_layers = sum(1 for i in range(m.layers) if m.is_moe_layer(i))
    if moe_layers == m.layers and len(mlp) == len(lora.target_names):
        err(Problem("train.lora.targets", f"targets {list(lora.target_names)} are MLP projections, and every layer of this "
                    "MoE model has routed experts, which get no adapters without train.lora.experts: nothing would train",
                    "set train.lora.experts: true, or add attention targets (wq, wk, wv, wo)"))
        return
    warn(Problem("train.lora.targets", f"{'/'.join(mlp)} adapt the {m.layers - moe_layers} dense MLP layer(s) only: the "
                 f"{moe_layers} MoE layers' routers and routed experts stay frozen", "set train.lora.experts: true to "
                 "adapt the routed experts too, or list only attention targets (wq, wk, wv, wo) to say so"))


def _check_moe_fields(recipe: Recipe, err) -> None:
    moe = recipe.model.moe
    if not recipe.model.is_moe:
        for name in sorted(moe.model_fields_set - {"num_experts"}):
            err(Problem(f"model.moe.{name}", "set, but the model is dense (num_experts <= 1)",
                        "remove it, or set model.moe.num_experts > 1"))
        return
    if moe.top_k > moe.num_experts:
        err(Problem("model.moe.top_k", f"top_k ({moe.top_k}) exceeds num_experts ({moe.num_experts})",
                    f"use top_k <= {moe.num_experts}"))
    if moe.first_dense_layers >= recipe.model.layers:
        err(Problem("model.moe.first_dense_layers", f"first_dense_layers ({moe.first_dense_layers}) leaves no MoE layer "
                    f"of {recipe.model.layers}", f"use first_dense_layers < {recipe.model.layers}"))


def _check_microbatches(recipe: Recipe, batch: BatchMath, err, warn) -> None:
    p = recipe.parallel
    if p.pp == 1:
        return
    mb = batch.microbatches
    need = 2 * p.pp if p.pp_schedule == "dualpipev" else p.pp
    if mb < need:
        err(Problem("train.global_batch_size", f"{mb} microbatches per step but {p.pp_schedule} with pp {p.pp} needs >= {need} "
                    f"(microbatches = global_batch_size / (micro_batch_size x dp))",
                    f"raise global_batch_size to >= {need * batch.micro_batch_size * batch.dp} or lower micro_batch_size"))
    elif p.pp_schedule in INTERLEAVED and mb % p.pp:
        err(Problem("train.global_batch_size", f"{p.pp_schedule} needs microbatches ({mb}) divisible by pp ({p.pp})",
                    f"use global_batch_size = k x {p.pp * batch.micro_batch_size * batch.dp}"))
    else:
        bubble = bubble_fraction(p.pp_schedule, p.pp, p.pp_virtual_stages, mb)
        if bubble > BUBBLE_WARN:
            # the third way out depends on the schedule; the V schedules (zbv, dualpipev) hold a fixed
            # two stages per rank, so only more micro batches help them
            third = ""
            if p.pp_schedule in ("gpipe", "1f1b"):
                third = ", or use an interleaved schedule"
            elif p.pp_schedule in INTERLEAVED:
                third = f", or raise parallel.pp_virtual_stages (now {p.pp_virtual_stages})"
            warn(Problem("parallel.pp", f"pipeline bubble is {bubble:.0%} of the step ({mb} microbatches for pp {p.pp}, {p.pp_schedule})",
                         f"raise global_batch_size (more microbatches) or lower micro_batch_size{third}"))


def _even_split(layers: int, stages: int) -> list[int]:
    base, extra = divmod(layers, stages)
    return [base + (1 if i < extra else 0) for i in range(min(stages, 16))]  # a hint: never build 2**48 entries


def _check_precision_features(recipe: Recipe, err, warn) -> None:
    """FP8 training (and its FP8 all-gather) and async TP need CUDA hardware; the CPU engine has neither FP8
    matmuls nor symmetric memory (issue 17). Every missing condition is named at once. fp8 with
    ``parallel.tp > 1`` is accepted: the engine converts the Linears before TP and shards them with
    torchao's Float8 TP styles (engine/parallel/float8.py)."""
    from llmtrain.recipe.gpus import GPUS

    t, p, gpu = recipe.train, recipe.parallel, recipe.cluster.gpu
    spec = GPUS.get(gpu)
    if t.precision == "fp8" and (gpu == "cpu" or spec is None or spec.peak_flops_fp8 <= 0):
        why = "the CPU engine has no FP8 matmuls" if gpu == "cpu" else f"cluster.gpu {gpu} has no FP8 tensor cores"
        err(Problem("train.precision", f"fp8 needs CUDA GPUs with FP8 tensor cores: {why}",
                    "use train.precision bf16, or cluster.gpu h100-sxm / h200 / b200"))
    if p.async_tp:  # engine/parallel/async_tp.py: inductor's micro-pipeline pass over SP's collectives
        need = [why for bad, why in ((gpu == "cpu", ("CUDA GPUs (its fused all-gather/reduce-scatter matmuls are CUDA "
                                                      "symmetric-memory kernels)")),
                                     (not t.compile, "train.compile: true (the overlap is a torch.compile pass)"),
                                     (p.tp < 2, "parallel.tp >= 2"),
                                     (p.tp >= 2 and not p.sequence_parallel,
                                      ("parallel.sequence_parallel: true (it overlaps SP's all-gather / reduce-scatter; "
                                       "plain TP's all-reduce has no async form)"))) if bad]
        if need:
            err(Problem("parallel.async_tp", f"async TP (symmetric-memory micro-pipelined TP) needs {'; '.join(need)}",
                        "set parallel.async_tp false"))
    if p.fp8_all_gather:
        need = [why for bad, why in ((t.precision != "fp8", (f"train.precision fp8 (it is {t.precision}): only "
                                                             "Float8-converted weights are gathered in FP8")),
                                     (p.zero < 2, (f"parallel.zero 2 or 3 (it is {p.zero}): only FSDP2 all-gathers "
                                                   "parameters"))) if bad]
        if need:
            err(Problem("parallel.fp8_all_gather", f"fp8_all_gather needs {'; '.join(need)}",
                        "set parallel.fp8_all_gather false"))
