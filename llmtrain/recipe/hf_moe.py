"""The MoE fields of a Hugging Face ``config.json``, per family, both ways (torch-free; split out of
:mod:`llmtrain.recipe.hf_config`, one concept: how each MoE family writes its experts, top-k and routing)."""

from __future__ import annotations

from llmtrain.recipe.schema import ModelConfig


def moe_config_json(name: str, cfg: ModelConfig) -> dict:
    """The MoE part of family ``name``'s ``config.json`` for ``cfg`` (empty for a dense family)."""
    m, out = cfg.moe, {}
    if name == "mixtral":
        out.update(intermediate_size=cfg.expert_ffn, num_local_experts=m.num_experts, num_experts_per_tok=m.top_k,
                   router_aux_loss_coef=float(m.aux_loss_coef), router_jitter_noise=0.0, output_router_logits=False)
    elif name == "olmoe":  # softmax top-k, renormalized or not; the experts' width is its intermediate_size
        out.update(intermediate_size=cfg.expert_ffn, num_experts=m.num_experts, num_experts_per_tok=m.top_k,
                   norm_topk_prob=bool(m.norm_topk_prob), router_aux_loss_coef=float(m.aux_loss_coef),
                   output_router_logits=False, clip_qkv=None)
    elif name == "granitemoe":  # Mixtral's routing; the experts' width is its intermediate_size
        out.update(intermediate_size=cfg.expert_ffn, num_local_experts=m.num_experts, num_experts_per_tok=m.top_k,
                   router_aux_loss_coef=float(m.aux_loss_coef), output_router_logits=False)
    elif name == "qwen3_moe":
        step = m.sparse_step
        out.update(num_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=cfg.expert_ffn,
                   decoder_sparse_step=step, norm_topk_prob=bool(m.norm_topk_prob),
                   mlp_only_layers=[i for i in range(cfg.layers) if (i + 1) % step == 0 and not cfg.is_moe_layer(i)],
                   router_aux_loss_coef=float(m.aux_loss_coef), output_router_logits=False)
    return out


def moe_fields(mt: str, conf: dict) -> dict | None:
    """Recipe ``model.moe`` of an MoE family's ``config.json`` (types checked by the caller); None for a
    dense family. Every supported family routes with a softmax and balances with the auxiliary loss."""
    routing = {"router": "softmax", "balance": "aux_loss", "shared_experts": 0}
    if mt in ("mixtral", "granitemoe"):  # both renormalize the top-k weights (softmax over the top-k logits)
        return {"num_experts": conf.get("num_local_experts", 8), "top_k": conf.get("num_experts_per_tok", 2),
                "expert_ffn_hidden": conf.get("intermediate_size"), "norm_topk_prob": True,
                "aux_loss_coef": float(conf.get("router_aux_loss_coef", 0.001)), **routing}
    if mt == "olmoe":
        return {"num_experts": conf.get("num_experts", 64), "top_k": conf.get("num_experts_per_tok", 8),
                "expert_ffn_hidden": conf.get("intermediate_size"),
                "norm_topk_prob": bool(conf.get("norm_topk_prob", False)),
                "aux_loss_coef": float(conf.get("router_aux_loss_coef", 0.01)), **routing}
    if mt == "qwen3_moe":
        return {"num_experts": conf.get("num_experts", conf.get("num_local_experts", 128)),
                "top_k": conf.get("num_experts_per_tok", 8), "expert_ffn_hidden": conf.get("moe_intermediate_size", 768),
                "norm_topk_prob": bool(conf.get("norm_topk_prob", False)), "sparse_step": conf.get("decoder_sparse_step", 1),
                "dense_layers": list(conf.get("mlp_only_layers") or []),
                "aux_loss_coef": float(conf.get("router_aux_loss_coef", 0.001)), **routing}
    return None
