"""PEFT's form of the routed experts' adapters (``train.lora.experts``) for ``ckpt export --peft``.

transformers 5 keeps an MoE layer's experts as two stacked parameters, ``experts.gate_up_proj``
``[E, 2F, H]`` (every expert's gate rows, then its up rows) and ``experts.down_proj`` ``[E, H, F]``
(Mixtral, Qwen3-MoE, OLMoE and GraniteMoE alike; GraniteMoE under ``block_sparse_moe``, the others
under ``mlp``). PEFT (0.21) adapts them with ``target_parameters`` (``lora.ParamWrapper``):

* **Factors**: ``lora_A`` ``[E r, in]`` (expert ``e``'s rows ``e r .. e r + r``) and ``lora_B``
  ``[out, r E]`` (column ``j E + e`` is expert ``e``'s column ``j``): PEFT reshapes them to
  ``[E, r, in]`` and ``[out, r, E]`` and applies ``B_e A_e`` to expert ``e``'s ``[out, in]`` weight.
  Ours are ``[E, r, in]`` and ``[E, out, r]``: a reshape and a permutation, no arithmetic.
* **gate_up_proj** holds w1 and w3: their adapters (rank r each) become one of rank ``n r`` (n of
  them adapted): ``A`` the two stacked per expert, ``B`` block-diagonal (w1's ``B`` in the gate rows
  and its r columns, w3's in the up rows and the next r), as the Phi-3 fused export does; its
  ``rank_pattern`` / ``alpha_pattern`` entry is ``n r`` / ``n alpha`` so PEFT's scale stays alpha / r.
* **Names**: two parameters of one module are two nested wrappers; PEFT wraps them in the module's
  parameter order, gate_up_proj first, so with both adapted gate_up_proj's factors are
  ``...experts.base_layer.lora_A.weight`` and down_proj's ``...experts.lora_A.weight``.
* Only for MoE models without dense layers: PEFT 0.21 also turns MLP ``target_modules`` of an MoE model
  into its experts' parameters, so the dense layers' MLP adapters could not be expressed beside them
  (:mod:`.peft_export` refuses those runs and points at the merged ``--hf`` export).

Checked against PEFT on transformers' own tiny bases (tests/test_lora_peft.py).
"""

from __future__ import annotations

GATE_UP, DOWN = "gate_up_proj", "down_proj"
RUNTIME_MOE = {"granitemoe": "block_sparse_moe"}  # the MoE layer's MLP module in transformers 5 (else "mlp")


def expert_parameters(lora_cfg) -> list[str]:
    """``target_parameters`` (suffixes PEFT matches against each parameter's full name)."""
    t = set(lora_cfg.target_names)
    return ([f"experts.{DOWN}"] if "w2" in t else []) + ([f"experts.{GATE_UP}"] if t & {"w1", "w3"} else [])


def gate_up_count(lora_cfg) -> int:
    """How many of w1 / w3 the fused gate_up_proj adapter holds."""
    return len(set(lora_cfg.target_names) & {"w1", "w3"})


def expert_tensors(adapters: dict, cfg, family: str, where: str, prefix: str) -> dict:
    """Our experts' adapters (``layers.N.moe.experts.lora_a.w1`` ...; keys without ``model.``) -> PEFT's
    tensors (see the module docstring)."""
    import torch

    module = RUNTIME_MOE.get(family, "mlp")
    layers: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for key, t in adapters.items():
        parts = key.split(".")  # layers N moe experts lora_a|lora_b w1|w2|w3
        layers.setdefault(parts[1], {}).setdefault(parts[5], {})[parts[4]] = t.detach()
    out = {}
    for layer, members in sorted(layers.items()):
        stem = f"{prefix}{where}layers.{layer}.{module}.experts"
        present = [n for n in ("w1", "w3") if n in members]
        gate_up_stem = f"{stem}.base_layer" if present and "w2" in members else stem
        if present:
            first = members[present[0]]["lora_a"]
            e, r, f = first.shape[0], first.shape[1], cfg.expert_ffn
            a = torch.cat([members[n]["lora_a"] for n in present], dim=1)  # [E, n r, H]
            b = torch.zeros(e, 2 * f, len(present) * r, dtype=first.dtype)
            for j, n in enumerate(present):
                rows = slice(0, f) if n == "w1" else slice(f, 2 * f)
                b[:, rows, j * r:(j + 1) * r] = members[n]["lora_b"]
            out.update(_factors(gate_up_stem, a, b))
        if "w2" in members:
            out.update(_factors(stem, members["w2"]["lora_a"], members["w2"]["lora_b"]))
    return out


def _factors(stem: str, a, b) -> dict:
    """``A [E, r, in]``, ``B [E, out, r]`` -> PEFT's ``lora_A [E r, in]``, ``lora_B [out, r E]``."""
    e, r, n_in = a.shape
    return {f"{stem}.lora_A.weight": a.reshape(e * r, n_in).contiguous(),
            f"{stem}.lora_B.weight": b.permute(1, 2, 0).reshape(b.shape[1], r * e).contiguous()}
