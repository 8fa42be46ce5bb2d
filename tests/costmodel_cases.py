"""The engine-measured cases of tests/test_costmodel.py (the planner against what a real torchrun job
keeps): one recipe each, on recipes/debug.yaml with ``COMMON``. Split out of tests/test_costmodel.py
(one concept: the case table; the tests that run it stay there)."""

from __future__ import annotations

COMMON = ["train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=null", "parallel.dp_shard=-1",
          "train.precision=fp32", "parallel.tp=1", "parallel.zero=0"]
MOE = ["model.preset=debug-moe"]
LORA = ["train.lora.rank=4"]
GEMMA = ["model.norm_offset=true", "model.post_norms=true", "model.embed_scale=true", "model.mlp_activation=gelu_tanh",
         "model.qk_norm=true",
         "model.sliding_window=16", "model.full_attention_layers=[1]", "model.local_rope_theta=100",
         "model.attention_scale=0.2", "train.seq_len=128"]
CASES = {
    "ddp": ["parallel.zero=0"],
    "zero1": ["parallel.zero=1"],
    "zero2": ["parallel.zero=2"],
    "zero3": ["parallel.zero=3"],
    "hsdp": ["parallel.zero=3", "parallel.dp_replicate=2"],
    "tp2": ["parallel.tp=2", "parallel.sequence_parallel=false"],
    "tp2_sp_selective": ["parallel.tp=2", "train.activation_checkpointing=selective"],
    # selective keeps wo's reduced output, not its partial sum, and nothing of w2 (engine/parallel/checkpointing.py)
    "tp2_selective": ["parallel.tp=2", "parallel.sequence_parallel=false", "train.activation_checkpointing=selective"],
    "zero1_selective": ["parallel.zero=1", "train.activation_checkpointing=selective"],
    # torchtitan's op policy: selective less wk's, w3's and (without TP) wo's outputs; under TP wo
    # keeps selective's rule (reduced output saved); MoE blocks lose only wk's and wo's; LoRA keeps
    # the adapters' outputs
    "zero1_selective_mm": ["parallel.zero=1", "train.activation_checkpointing=selective_mm"],
    "tp2_sp_selective_mm": ["parallel.tp=2", "train.activation_checkpointing=selective_mm"],
    "moe_zero1_selective_mm": MOE + ["parallel.zero=1", "train.activation_checkpointing=selective_mm"],
    "lora_ddp_selective_mm": LORA + ["train.activation_checkpointing=selective_mm"],
    "tp2_fsdp2": ["parallel.tp=2", "parallel.zero=3"],
    "zero3_full": ["parallel.zero=3", "train.activation_checkpointing=full"],
    "moe_ep2_zero1": MOE + ["parallel.zero=1", "parallel.ep=2"],
    "moe_tp2_zero3": MOE + ["parallel.zero=3", "parallel.tp=2"],  # expert-TP (experts F / tp) under FSDP, SP
    # fewer local experts than FSDP ranks: the stacked experts are split on H, evenly (data_parallel.expert_placement),
    # in the block's unit (no EP: 2 experts over 4 ranks) and in the experts' own unit (ep 2: 1 expert over edp 2)
    "moe_e2_zero3": MOE + ["model.moe.num_experts=2", "parallel.zero=3"],
    "moe_e2_ep2_zero2": MOE + ["model.moe.num_experts=2", "parallel.ep=2", "parallel.zero=2"],
    "cp2_ring": ["parallel.cp=2", "parallel.cp_method=ring"],
    "cp2_allgather": ["parallel.cp=2", "parallel.cp_method=allgather"],  # kernel blocks: no [s, S] mask held
    # Ulysses exchanges GQA's K/V with their kv_heads (4 over cp 2) and causal SDPA keeps them so (plan/gqa.py)
    "cp2_ulysses": ["parallel.cp=2", "parallel.cp_method=ulysses"],
    # a sliding window shorter than the sequence: one additive [S, S] band per micro batch, shared by the layers
    # (models/llama.py attention_bias); under Ulysses over the whole sequence
    "window_zero1": ["model.sliding_window=16", "train.seq_len=256", "parallel.zero=1"],
    "window_cp2_ulysses": ["model.sliding_window=16", "train.seq_len=256", "parallel.cp=2", "parallel.cp_method=ulysses"],
    # Ulysses' whole rows of its heads run a windowed layer's score boxes: selective keeps each call's rows
    "window_cp2_ulysses_selective": ["model.sliding_window=16", "train.seq_len=256", "parallel.cp=2",
                                     "parallel.cp_method=ulysses", "train.activation_checkpointing=selective"],
    # under all-gather: the rank's [s, S] rows of the band (models/masks.py), one masked call over the gathered K/V
    # repeated to the query heads (engine/parallel/context.py)
    "window_cp2_allgather": ["model.sliding_window=16", "train.seq_len=256", "parallel.cp=2",
                             "parallel.cp_method=allgather"],
    # Gemma 3's switches (engine/models/norm.py OffsetRMSNorm keeps input + rstd on every device; two post norms
    # per block; GeGLU keeps what SwiGLU keeps) with sliding and full layers
    "qk_norm_zero1": ["model.qk_norm=true", "parallel.zero=1"],  # Qwen3's per-head norms (composite on CPU)
    "qk_norm_tp2_sp": ["model.qk_norm=true", "parallel.tp=2"],  # per head of the TP shard, the whole sequence
    "gemma_zero1": GEMMA + ["parallel.zero=1"],
    "gemma_tp2_sp": GEMMA + ["parallel.tp=2"],
    "gemma_tp2_selective": GEMMA + ["parallel.tp=2", "train.activation_checkpointing=selective"],
    # Gemma 2's soft-capped attention (models/softcap.py keeps q, k, v, out and an fp32 log-sum-exp; one custom op
    # whose outputs selective saves as SDPA's: before, its products were cached, 1.66x the plan)
    "softcap_tp2_selective": GEMMA + ["model.attention_softcap=50", "model.logit_softcap=30", "parallel.tp=2",
                                      "train.activation_checkpointing=selective"],
    # all-gather CP: Gemma 3's windowed layers masked, its full layer the zigzag kernel blocks; Gemma 2's soft-cap in
    # every layer (a causal mask of the rank's rows beside the band), with selective's saved kernel outputs
    "gemma_cp2_allgather": GEMMA + ["parallel.cp=2", "parallel.cp_method=allgather", "parallel.zero=1"],
    "softcap_cp2_allgather_selective": GEMMA + ["model.attention_softcap=50", "model.logit_softcap=30", "parallel.cp=2",
                                                "parallel.cp_method=allgather", "train.activation_checkpointing=selective"],
    # ring CP with masks (forty-first session): the rank's rows of each mask, keys in ring order; the ring's own saved
    # tensors (each block masked on a view); Gemma 2's soft-capped blocks under selective (the op's outputs kept)
    "window_cp2_ring": ["model.sliding_window=16", "train.seq_len=256", "parallel.cp=2", "parallel.cp_method=ring"],
    # cp 4: only the chunk pairs inside the window run, so selective keeps fewer kernel outputs, rank by rank
    "window_cp4_ring_selective": ["model.sliding_window=16", "train.seq_len=256", "parallel.cp=4", "parallel.cp_method=ring",
                                  "train.activation_checkpointing=selective"],
    "softcap_cp2_ring_selective": GEMMA + ["model.attention_softcap=50", "model.logit_softcap=30", "parallel.cp=2",
                                           "parallel.cp_method=ring", "train.activation_checkpointing=selective"],
    # OLMo 2's block: post norms only (wq/wk/wv and w1/w3 keep the residual stream itself), q/k norms over all heads
    "olmo_zero1": ["model.pre_norms=false", "model.post_norms=true", "model.qk_norm=true", "model.qk_norm_width=all",
                   "parallel.zero=1"],
    "olmo_tp2": ["model.pre_norms=false", "model.post_norms=true", "model.qk_norm=true", "model.qk_norm_width=all",
                 "parallel.tp=2", "parallel.sequence_parallel=false", "parallel.zero=1"],  # q/k norms split with heads
    # and under SP: the post norms on wo's / w2's reduce-scattered outputs, their weights' gradients summed over TP
    "olmo_tp2_sp": ["model.pre_norms=false", "model.post_norms=true", "model.qk_norm=true", "model.qk_norm_width=all",
                    "parallel.tp=2", "parallel.zero=1"],
    # Granite's muP scalars (embedding, branch and logit multipliers, attention scale): scalar products save nothing
    "granite_tp2": ["model.embed_multiplier=12.0", "model.residual_multiplier=0.22", "model.logit_divisor=8.0",
                    "model.attention_scale=0.015625", "parallel.tp=2"],
    # RoPE's rotations (plan/rope_activations.py): partial rotary (8 of 16 features), a NoPE layer (SmolLM3)
    "rope_partial_nope_zero1": ["model.rotary_dim=8", "model.nope_layers=[3]", "parallel.zero=1"],
    "pp2_interleaved_zero3": ["parallel.pp=2", "parallel.zero=3", "parallel.pp_schedule=interleaved-1f1b",
                              "parallel.pp_virtual_stages=2", "train.global_batch_size=8"],
    # LoRA (engine/finetune/lora.py): frozen base (parameters only), adapters with gradients and AdamW
    "lora_ddp": LORA,
    "lora_ddp_w1": LORA + ["train.lora.targets=[w1]"],  # block 0's attention saves nothing
    "lora_zero1": LORA + ["parallel.zero=1"],
    "lora_zero2": LORA + ["parallel.zero=2"],
    "lora_zero3_qv": LORA + ["train.lora.targets=[wq,wv]", "parallel.zero=3"],
    "lora_zero3_full_wo_w2": LORA + ["train.lora.targets=[wo,w2]", "parallel.zero=3",
                                     "train.activation_checkpointing=full"],
    "lora_tp2_zero1": LORA + ["parallel.tp=2", "parallel.zero=1", "parallel.sequence_parallel=false"],
    "lora_tp2_sp_selective": LORA + ["parallel.tp=2", "train.activation_checkpointing=selective"],
    "lora_ddp_dropout": LORA + ["train.lora.dropout=0.1"],  # per-adapter dropped inputs and masks
    "lora_tp2_dropout_wo_w2": LORA + ["train.lora.dropout=0.1", "train.lora.targets=[wo,w2]", "parallel.tp=2"],
    "pp2_zero2_lora": LORA + ["parallel.pp=2", "parallel.zero=2", "train.global_batch_size=8"],
    # LoRA on an MoE model: adapters on the attention and the dense layer's MLP; routers, routed and shared experts
    # frozen (no gradient or optimizer state), their inputs kept only where a gradient needs them
    "lora_moe_zero1": MOE + LORA + ["parallel.zero=1"],
    "lora_moe_ep2_attn": MOE + LORA + ["train.lora.targets=[wq,wk,wv,wo]", "parallel.ep=2", "parallel.zero=1"],
    # every layer MoE (block 0 too: its input needs no gradient), and with selective recomputation
    "lora_moe_all_zero3": MOE + LORA + ["model.moe.first_dense_layers=0", "train.lora.targets=[wq,wv]", "parallel.zero=3"],
    "lora_moe_selective": MOE + LORA + ["parallel.zero=1", "train.activation_checkpointing=selective"],
    # under autocast: block 0 (MoE) keeps no bf16 copy of a frozen weight whose input needs no gradient
    "lora_moe_all_amp": MOE + LORA + ["model.moe.first_dense_layers=0", "train.lora.targets=[wo]",
                                      "train.precision=bf16"],
    # train.lora.experts: the routed experts' stacked adapters (state split by EP and expert-TP; A x per routed
    # slot, the dispatched tokens and w2's input kept; selective: the adapters' matmul outputs)
    "lora_experts_zero1": MOE + LORA + ["train.lora.experts=true", "parallel.zero=1"],
    "lora_experts_ep2_tp2_zero3": MOE + LORA + ["train.lora.experts=true", "parallel.ep=2", "parallel.tp=2",
                                                "parallel.zero=3"],
    "lora_experts_selective": MOE + LORA + ["train.lora.experts=true", "train.lora.targets=[wq,w2,w3]",
                                            "parallel.zero=2", "train.activation_checkpointing=selective"],
    # 2 experts over 4 FSDP ranks: the base weights split on H evenly, their adapters on dim 0 unevenly (padded)
    "lora_experts_e2_zero3": MOE + LORA + ["train.lora.experts=true", "model.moe.num_experts=2", "parallel.zero=3"],
    # tied embeddings under PP (engine/parallel/tied.py): the last stage holds a copy of the embedding
    # (parameter, gradient, AdamW state); V-shaped: rank 0 holds both; TP: each gradient in its weight's rows
    "pp2_zbv_tied_zero1": ["model.tie_embeddings=true", "parallel.pp=2", "parallel.pp_schedule=zbv",
                           "parallel.pp_virtual_stages=2", "parallel.zero=1", "train.global_batch_size=16"],
    "pp2_tp2_tied": ["model.tie_embeddings=true", "parallel.pp=2", "parallel.tp=2", "train.global_batch_size=8"],
    # split backward: a micro batch's activations live until its weight pass (plan/inflight.py)
    "pp2_zero_bubble": ["parallel.pp=2", "parallel.pp_schedule=zero-bubble", "parallel.pp_virtual_stages=2",
                        "train.global_batch_size=16"],
    # selective recomputation under PP: the policy's cache (counted beside what the hooks see, costmodel_worker.py
    # SavedPeak.recompute_caches) per micro batch in flight; with TP + SP wo's reduced output is cached, not its partial sum
    "pp2_1f1b_selective": ["parallel.pp=2", "parallel.pp_schedule=1f1b", "train.activation_checkpointing=selective",
                           "train.global_batch_size=8"],
    "pp2_tp2_interleaved_selective": ["parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule=interleaved-1f1b",
                                      "parallel.pp_virtual_stages=2", "train.activation_checkpointing=selective",
                                      "train.global_batch_size=8"],
    "pp2_interleaved_selective_mm": ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual_stages=2",
                                     "train.activation_checkpointing=selective_mm", "train.global_batch_size=16"],
    "pp2_zero_bubble_full": ["parallel.pp=2", "parallel.pp_schedule=zero-bubble", "parallel.pp_virtual_stages=2",
                             "train.activation_checkpointing=full", "train.global_batch_size=16"],
    "pp2_dualpipev": ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2",
                      "train.global_batch_size=16"],
    "pp2_dualpipev_full": ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "parallel.pp_virtual_stages=2",
                           "train.activation_checkpointing=full", "train.global_batch_size=16"],
    "pp2_cp2_1f1b": ["parallel.pp=2", "parallel.cp=2", "parallel.pp_schedule=1f1b", "train.global_batch_size=8"],
    "pp2_moe_ep2_1f1b": MOE + ["parallel.pp=2", "parallel.ep=2", "parallel.pp_schedule=1f1b", "train.global_batch_size=8"],
    "pp2_zero3_lora_selective": LORA + ["parallel.pp=2", "parallel.zero=3", "parallel.pp_schedule=1f1b",
                                        "train.activation_checkpointing=selective", "train.global_batch_size=8"],
    # full recomputation under PP: each chunk keeps its blocks' inputs per micro batch in flight
    "pp2_interleaved_full": ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual_stages=2",
                             "train.activation_checkpointing=full", "train.global_batch_size=16"],
    # quantized AdamW moments (engine/quant_optim.py): 8bit quantizes by the LOCAL shard's size (FSDP x TP
    # shards some weights below 4096 elements: those stay fp32), bf16 on ZeRO-1's whole owned tensors
    "tp2_fsdp2_8bit": ["parallel.tp=2", "parallel.zero=3", "train.optimizer.states=8bit"],
    "zero1_bf16": ["parallel.zero=1", "train.optimizer.states=bf16"],
    # bf16 under autocast (zero 0/1: fp32 parameters): the residual stream is bf16 from the embedding
    # on (engine/models/llama.py), so block inputs and norms are 2 bytes and q/k/v (w1/w3, the
    # router and the experts) share one saved bf16 input instead of a cast each
    "ddp_amp": ["train.precision=bf16"],
    "zero1_amp_selective": ["parallel.zero=1", "train.precision=bf16", "train.activation_checkpointing=selective"],
    "tp2_sp_amp": ["parallel.tp=2", "train.precision=bf16"],
    "moe_zero1_amp": MOE + ["parallel.zero=1", "train.precision=bf16"],
    "lora_ddp_amp": LORA + ["train.precision=bf16"],
    # block 0 keeps a frozen weight's autocast copy only where its input needs a gradient: with the only adapter on
    # w2 none of its base projections does (plan/rankmem.py lora_uncast_numel)
    "lora_ddp_amp_w2": LORA + ["train.precision=bf16", "train.lora.targets=[w2]"],
}
