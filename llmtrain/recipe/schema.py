"""The recipe schema (pydantic v2): one YAML file describes model, layout, batch, data, run.

Key names are a public interface. Every model forbids unknown keys and is strict about types
(YAML ``true`` is not an int, ``"8"`` is not a number) so that a typo is an error, not a
silently ignored setting. Every field has a description: it doubles as ``--help`` text and as
the JSON Schema written by ``llmtrain schema`` for editor completion.

Cross-field rules (divisibility, batch math, world size) live in
:mod:`llmtrain.plan.validate`, which reports all problems at once; this module only checks
what a single field can know (types, ranges, allowed values) and merges model presets.
"""

from __future__ import annotations

import datetime
from typing import Literal

from pydantic import Field, field_validator, model_validator

from llmtrain.recipe.gpus import GPUS
from llmtrain.recipe.model import MODEL_FIELDS, ModelConfig, MoEConfig, RopeScaling  # noqa: F401 (re-exported)
from llmtrain.recipe.presets import PRESETS  # noqa: F401 (re-exported)
from llmtrain.recipe.schema_base import BIG, NAME_PATTERN, Strict  # noqa: F401 (re-exported)
from llmtrain.recipe.schema_launch import LaunchConfig, WatchdogConfig  # noqa: F401 (re-exported)
from llmtrain.recipe.schema_plan import PlannerConfig

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev")
V_SHAPED_SCHEDULES = ("zbv", "dualpipev")  # two stages per rank, placed (r, 2 pp - 1 - r)
# backward split into an input-gradient pass and a later weight-gradient pass (torch's I and W actions)
SPLIT_BACKWARD_SCHEDULES = ("zero-bubble", "zbv", "dualpipev")


def bf16_compute(precision: str) -> bool:
    """Whether ``train.precision`` computes in bf16: bf16, and fp8 (bf16 plus torchao Float8 linear
    layers, engine/parallel/float8.py) -- everything but fp32."""
    return precision in ("bf16", "fp8")


class ParallelConfig(Strict):
    """The 5D layout. World size = pp x dp_replicate x dp_shard x cp x tp; ep borrows ranks from dp_shard x cp."""

    tp: int = Field(1, ge=1, le=BIG, description="Tensor-parallel degree (innermost mesh dim, inside one node).")
    pp: int = Field(1, ge=1, le=BIG, description="Pipeline-parallel degree (outermost mesh dim).")
    cp: int = Field(1, ge=1, le=BIG, description="Context-parallel degree (sequence split across ranks).")
    ep: int = Field(1, ge=1, le=BIG, description="Expert-parallel degree; must divide dp_shard x cp (EP borrows those ranks).")
    dp_replicate: int = Field(1, ge=1, le=BIG, description="Data-parallel replicas (DDP; the outer HSDP dim).")
    dp_shard: int = Field(-1, ge=-1, le=BIG, description="Data-parallel sharding degree (FSDP); -1 = whatever is left of the world size.")
    zero: Literal[0, 1, 2, 3] = Field(
        3, description="0 = DDP, 1 = optimizer states sharded, 2 = + gradients sharded, 3 = + parameters (FSDP full shard)."
    )
    sequence_parallel: bool = Field(True, description="With tp > 1, also shard norms/dropout activations along the sequence.")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv", "dualpipev"] = Field(
        "1f1b", description="Pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zero-bubble, zbv, dualpipev."
    )
    pp_virtual_stages: int = Field(
        1, ge=1, le=BIG, description="Model chunks per pipeline rank (>= 2 for interleaved-1f1b and zero-bubble; 2 for zbv/dualpipev, the default there when left out)."
    )
    pp_layers_per_stage: list[int] | None = Field(
        None, description="Explicit uneven split: transformer layers of each stage (pp x pp_virtual_stages entries, summing to model.layers)."
    )
    cp_method: Literal["ring", "ulysses", "allgather"] = Field(
        "ring", description="Context-parallel attention: ring (P2P K/V, zigzag balanced), ulysses (all-to-all heads), allgather (K/V gathered, zigzag balanced). Every method takes masks (packed rows, sliding windows) and soft-capping; the ring runs each block masked, and in a windowed layer only the chunk pairs inside the window."
    )
    dp_bucket_mb: float = Field(
        25.0, gt=0, le=65536,
        description="zero 0/1: gradients are reduced in buckets of about this many MiB, each started during the "
                    "backward as soon as its gradients are final (overlapped with the rest of the backward).")
    fsdp_reduce_each_microbatch: bool = Field(
        False, description="zero 2/3 with gradient accumulation (no PP): reduce-scatter the gradients after every micro "
                           "batch (sharded gradients only: saves an unsharded fp32 gradient of the rank, at grad_accum "
                           "times the reduce-scatter traffic) instead of once after the last one.")
    reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="dtype of every gradient reduction (FSDP reduce-scatter, the DP all-reduce, expert "
                            "gradients): fp32, or bf16 (half the bytes, ~3 significant digits per sum).")
    grad_compression: Literal["none", "powersgd", "topk"] = Field(
        "none", description="zero 0/1: compress the data-parallel gradient averaging (engine/parallel/compression.py): "
                            "powersgd (rank-powersgd_rank factors per matrix, warm start) or topk (each rank sends its "
                            "topk_ratio largest entries); run at the step's end, not overlapped with backward.")
    powersgd_rank: int = Field(
        4, ge=1, le=4096, description="grad_compression powersgd: approximation rank per gradient matrix (sends "
                                      "(rows + cols) x rank numbers instead of rows x cols).")
    topk_ratio: float = Field(
        0.01, gt=0, le=1, description="grad_compression topk: fraction of the gradient's entries each rank sends "
                                      "(values + int32 indices: 8 bytes per entry).")
    async_tp: bool = Field(
        False, description="tp > 1 with sequence_parallel on CUDA under train.compile: torch's symmetric-memory "
                           "micro-pipelined TP (async TP, engine/parallel/async_tp.py): the compiler splits the "
                           "all-gather before each column-parallel matmul and the reduce-scatter after each "
                           "row-parallel one into chunks overlapped with the matmul. Refused on CPU.")
    fp8_all_gather: bool = Field(
        False, description="train.precision fp8 with zero 2/3: FSDP2 all-gathers the FP8-converted weights in float8 "
                           "(1 byte per element instead of bf16's 2; torchao enable_fsdp_float8_all_gather, scales "
                           "in one all-reduce per step; engine/parallel/float8.py).")
    compression_error_feedback: bool = Field(
        True, description="grad_compression: add what compression left out to the next step's gradient (error "
                          "feedback; without it PowerSGD and top-k converge worse). Saved in checkpoints; a resume "
                          "in another layout or compression setting starts it afresh (one printed line).")
    powersgd_start_step: int | None = Field(
        None, ge=0, le=BIG, description="grad_compression powersgd: the first this many steps all-reduce the whole "
                                        "gradient (torch's start_powerSGD_iter); PowerSGD, its error feedback and warm "
                                        "start begin after them. Default: torch's advice, max(train.schedule."
                                        "warmup_steps, ceil(10 % of train.steps)) (docs/benchmarks.md \"Gradient "
                                        "compression\"); 0 compresses from the first step.")

    @field_validator("dp_shard")
    @classmethod
    def _not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("dp_shard is 0; use a degree >= 1, or -1 for whatever is left of the world size")
        return value

    @model_validator(mode="after")
    def _v_shaped_default(self) -> ParallelConfig:
        """A V-shaped schedule (zbv, dualpipev) with pp > 1 and ``pp_virtual_stages`` left out gets 2, its
        only valid value. Only when left out (``model_fields_set``): an explicit other value stays, and
        plan/validate.py reports it. Looped schedules (interleaved-1f1b, zero-bubble) accept any v >= 2,
        so they keep asking for an explicit choice."""
        if self.pp > 1 and self.pp_schedule in V_SHAPED_SCHEDULES and "pp_virtual_stages" not in self.model_fields_set:
            self.pp_virtual_stages = 2
        return self


class OptimizerConfig(Strict):
    """AdamW settings (no weight decay on norms, biases and embeddings)."""

    lr: float = Field(3e-4, gt=0, le=10, description="Peak learning rate.")
    betas: list[float] = Field([0.9, 0.95], min_length=2, max_length=2, description="Adam beta1, beta2.")
    weight_decay: float = Field(0.1, ge=0, le=10, description="Decoupled weight decay (matrices only).")
    eps: float = Field(1e-8, gt=0, le=1, description="Adam epsilon.")
    states: Literal["fp32", "bf16", "8bit"] = Field(
        "fp32", description="AdamW moment storage (engine/quant_optim.py): fp32 (8 bytes per parameter), bf16 (4; "
                            "torchao's AdamW kernel, rounded to nearest) or 8bit (torchao AdamW8bit: ~2 bytes, block-wise "
                            "quantized, tensors of >= 4096 elements that are a multiple of 256; smaller ones stay fp32).")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: list[float]) -> list[float]:
        if not all(0 <= b < 1 for b in value):
            raise ValueError(f"betas {value} must each be in [0, 1), e.g. [0.9, 0.95]")
        return value


class ScheduleConfig(Strict):
    """Learning-rate schedule: linear warmup, then decay to min_lr_ratio x lr."""

    warmup_steps: int = Field(0, ge=0, le=BIG, description="Linear warmup steps from 0 to lr.")
    decay: Literal["cosine", "linear", "wsd", "constant"] = Field(
        "cosine", description="Decay after warmup: cosine, linear, wsd (warmup-stable-decay), constant."
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final lr as a fraction of the peak lr.")
    wsd_decay_fraction: float = Field(0.2, gt=0, le=1, description="For wsd: fraction of steps spent in the final decay.")


class GuardConfig(Strict):
    """Loss-spike and NaN guard (docs/checkpoint.md): skip bad updates, roll back after a run of them."""

    enabled: bool = Field(True, description="Judge every step; a NaN/inf loss or gradient norm, or a spike, skips the update.")
    spike_factor: float = Field(
        0.0, ge=0, le=1e6, description="A loss above this x the running median of accepted losses is a spike (0 = only NaN/inf)."
    )
    window: int = Field(50, ge=1, le=100_000, description="Accepted losses in the running median.")
    min_history: int = Field(10, ge=1, le=100_000, description="Accepted losses needed before spikes are judged.")
    max_bad_steps: int = Field(
        3, ge=0, le=100_000, description="Bad steps in a row that trigger a rollback to the latest checkpoint (0 = never)."
    )
    max_rollbacks: int = Field(3, ge=0, le=1000, description="Rollbacks per run before it stops with an error.")


LORA_TARGETS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3")


class LoRAConfig(Strict):
    """Low-rank adapters (Hu et al. 2021): ``W x + (alpha / rank) * B A dropout(x)`` on the target projections."""

    rank: int = Field(8, ge=1, le=65536, description="Rank r of each adapter (A is r x in, B is out x r).")
    alpha: float = Field(16.0, gt=0, le=1e6, description="Scale numerator: the update is multiplied by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input (0 = off).")
    targets: Literal["all-linear"] | list[Literal["wq", "wk", "wv", "wo", "w1", "w2", "w3"]] = Field(
        "all-linear", description="Projections that get adapters: a list of wq wk wv wo (attention) w1 w2 w3 (MLP), "
                                  "or all-linear (all seven; never the output head or the embeddings).")
    experts: bool = Field(
        False, description="Also adapt the routed experts of MoE layers: every expert gets its own adapter on each "
                           "MLP target (w1 w2 w3) in targets; the router and shared experts stay frozen. Off: MLP "
                           "targets adapt the dense MLPs only.")

    @field_validator("targets")
    @classmethod
    def _unique_targets(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("targets is empty; list projections (wq wk wv wo w1 w2 w3) or use all-linear")
            if len(set(v)) != len(v):
                raise ValueError(f"targets lists a projection twice: {v}")
        return v

    @property
    def target_names(self) -> tuple[str, ...]:
        """The target projections in canonical order."""
        return LORA_TARGETS if self.targets == "all-linear" else tuple(t for t in LORA_TARGETS if t in self.targets)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class TrainConfig(Strict):
    """Batch, steps, precision and optimizer."""

    seq_len: int = Field(2048, ge=1, le=BIG, description="Tokens per training sequence.")
    global_batch_size: int | None = Field(
        None, ge=1, le=BIG, description="Sequences per optimizer step = micro_batch_size x grad_accum x dp (default: micro_batch_size x dp)."
    )
    micro_batch_size: int = Field(1, ge=1, le=BIG, description="Sequences per forward/backward pass on one data-parallel rank.")
    steps: int = Field(100, ge=1, le=BIG, description="Optimizer steps to train.")
    precision: Literal["fp32", "bf16", "fp8"] = Field(
        "bf16", description="fp32, or bf16 params/compute with fp32 reductions and master weights; fp8 (CUDA with FP8 "
                            "tensor cores only): bf16 plus torchao Float8 linear layers (tensorwise scaling).")
    activation_checkpointing: Literal["none", "selective", "selective_mm", "full"] = Field(
        "none", description="Recompute activations in backward: none, selective (attention/matmul outputs saved), "
                            "selective_mm (as selective, and the outputs of every second matmul of a block -- wk, w3, and "
                            "wo without TP -- are recomputed instead of saved: torchtitan's op policy; less memory than "
                            "selective, about one extra forward matmul in three), full (per block)."
    )
    compile: bool = Field(False, description="torch.compile each transformer block.")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed for weights, data and dropout; identical on every rank.")
    grad_clip: float = Field(1.0, ge=0, le=1e6, description="Clip the global gradient norm to this value (0 = off).")
    log_interval: int = Field(1, ge=1, le=BIG, description="Steps between metric lines.")
    eval_interval: int = Field(
        0, ge=0, le=BIG, description="Evaluate on data.eval_path every N steps and at the end (0 = off); rows go to metrics.jsonl."
    )
    eval_batches: int = Field(
        8, ge=1, le=BIG, description="Windows per evaluation = eval_batches x global batch size (the first ones of data.eval_path)."
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="AdamW settings.")
    lora: LoRAConfig | None = Field(
        None, description="Train low-rank adapters on a frozen base instead of every weight (docs/finetune.md).")
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig, description="Learning-rate schedule.")
    guard: GuardConfig = Field(default_factory=GuardConfig, description="Loss-spike and NaN guard.")


class DataConfig(Strict):
    """Training data."""

    source: Literal["synthetic", "memmap", "chat", "instruction", "text"] = Field(
        "synthetic",
        description="synthetic (seeded Markov-chain tokens with a known entropy floor), memmap (from `llmtrain data prepare`), "
                    "or fine-tuning samples read from data.path: chat (jsonl rows {messages: [{role, content}]}, loss on "
                    "assistant replies), instruction (jsonl prompt/completion, loss on the completion), text (jsonl text or "
                    ".txt, loss on every token) (docs/finetune.md).",
    )
    path: str | None = Field(
        None, min_length=1,
        description="memmap: a directory written by `llmtrain data prepare`; chat/instruction/text: a .jsonl file "
                    "(text also .txt) or a directory of them.")
    packing: bool = Field(
        False, description="chat/instruction/text: pack several samples into each train.seq_len row (attention and RoPE "
                           "positions restart per sample; with parallel.cp > 1 under every cp_method); false pads "
                           "every sample to its own row.")
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="chat/instruction/text samples longer than train.seq_len + 1 tokens: truncate them or "
                                "drop them (counted and reported either way).")
    prompt_field: str = Field("prompt", min_length=1, max_length=256, description="instruction: the prompt field of each row.")
    completion_field: str = Field("completion", min_length=1, max_length=256,
                                  description="instruction: the completion field of each row.")
    chat_date: datetime.date | None = Field(
        None, strict=False,  # YAML gives a date, recipe.lock.yaml and --set JSON a "YYYY-MM-DD" string
        description="chat: the date (YYYY-MM-DD) a template's strftime_now renders (Llama 3.x puts it in the system "
                    "header); `llmtrain launch` fills in the launch date, so ranks and resumes render the same text.")
    text_field: str = Field("text", min_length=1, max_length=256, description="text (.jsonl): the text field of each row.")
    tokenizer: str = Field("byte", min_length=1, description="byte, PATH/tokenizer.json, a Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json), or bpe:VOCAB (informational for memmap data).")
    eval_path: str | None = Field(
        None, min_length=1,
        description="Held-out data for train.eval_interval: a .txt, a .jsonl (field text) or a `data prepare` directory "
                    "(docs/eval.md); with data.source chat, instruction or text, a file like data.path, read the same "
                    "way (loss on the same targets).",
    )


class CheckpointConfig(Strict):
    """Distributed checkpoints."""

    dir: str | None = Field(None, min_length=1, description="Checkpoint directory (default: RUN_DIR/checkpoints).")
    interval: int = Field(0, ge=0, le=BIG, description="Save every N steps (0 = only at the end).")
    keep: int = Field(3, ge=1, le=BIG, description="Newest checkpoints kept.")
    async_: bool = Field(True, alias="async", description="Write checkpoints in the background while training continues.")
    init_from_hf: str | None = Field(
        None, min_length=1,
        description="Start a new run from Hugging Face Llama weights in this directory (config.json + *.safetensors, "
                    "e.g. from `llmtrain ckpt export --hf`); ignored when resuming. The model section must match.")


class ClusterConfig(Strict):
    """The cluster to plan for when no hostfile is given."""

    nodes: int = Field(1, ge=1, le=BIG, description="Nodes.")
    gpus_per_node: int = Field(8, ge=1, le=1024, description="GPUs (ranks) per node.")
    gpu: Literal["h100-sxm", "h200", "a100-80g", "gb200", "b200", "h100-pcie", "a100-40g", "h100-96g", "mi300x", "a100-pcie", "l40s", "cpu"] = Field(
        "h100-sxm", description=f"GPU kind from the catalog (recipe/gpus.py, docs/planner.md): {', '.join(GPUS)}."
    )
    gpu_power_w: float | None = Field(
        None, gt=0, le=10000,
        description="Board power cap in watts for power-capped parts (nvidia-smi -pl): the planner scales the compute "
                    "peaks linearly, peak x cap / TDP (bandwidths unchanged; MFU stays against the datasheet peak); "
                    "from 50 % of the TDP up to the TDP (default: uncapped).")
    network_gbps: float | None = Field(
        None, gt=0, le=1e6,
        description="The nodes' inter-node network: every NIC of a node that training uses together, Gb/s one "
                    "direction (8 x 400 = 3200 on DGX H100, 8 x 200 = 1600 on DGX A100, 4 x 100 = 400 on a node "
                    "with four 100 Gb/s links). Each GPU gets an equal share (network_gbps / GPUs per node; "
                    "recipe/gpus.py network_share). Default: the catalog's NIC per GPU (docs/planner.md 5.1), "
                    "one per GPU as on DGX / HGX nodes.")
    gpu_variability: float = Field(
        0.0174, ge=0, le=0.1,
        description="Relative standard deviation of the sustained compute rate across the cluster's GPUs (time model "
                    "v2): a step runs at its slowest GPU's pace, so on n GPUs compute takes 1 / (1 - c_n x this) as long, "
                    "c_n the expected largest of n normal draws (+2.6 % on 8 GPUs, +5.6 % on 512). Default: a 5 % "
                    "spread within 8-GPU nodes (docs/planner.md 9, plan/stragglers.py); 0: every GPU at the catalog's "
                    "measured rates.")
    time_model: Literal["v1", "v2"] = Field(
        "v2", description="Planner step-time model: v1 prices FLOPs at peak x one efficiency per GPU and collectives "
                          "on one link; v2 prices each GEMM by shape (roofline, wave quantization, measured matmul "
                          "ceiling), flash attention, memory-bound ops at HBM bandwidth, and collectives with NCCL's "
                          "alpha-beta model over NVLink and all NICs of a node (docs/planner.md, Time model v2). "
                          "Bytes and FLOPs are the same under both.")

    @field_validator("gpu_power_w")
    @classmethod
    def _power_in_range(cls, value: float | None, info) -> float | None:
        from llmtrain.recipe.gpus import power_problem  # noqa: PLC0415

        why = power_problem(info.data.get("gpu", "h100-sxm"), value)
        if why:
            raise ValueError(why)
        return value


class Recipe(Strict):
    """One training run: model, 5D layout, batch, data, checkpointing and target cluster."""

    name: str | None = Field(None, pattern=NAME_PATTERN, description="Run name (default: the recipe file's stem); runs go to runs/<name>/.")
    model: ModelConfig = Field(description="Model architecture.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="5D parallel layout.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training settings.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training data.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpointing.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Cluster for planning without a hostfile.")
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description="Multi-node launch over SSH: paths, environment, timeouts.")
    planner: PlannerConfig = Field(default_factory=PlannerConfig, description="Planner-only assumptions about another stack (plan only; the engine ignores them).")
