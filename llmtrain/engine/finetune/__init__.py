"""Fine-tuning with low-rank adapters: the adapters (:mod:`.lora`), the frozen base of a run
(:mod:`.base`: fingerprint of ``checkpoint.init_from_hf``), and exports (:mod:`.peft_export`)."""

from llmtrain.engine.finetune.lora import LoRALinear, apply_lora, is_adapter_key, merge_lora

__all__ = ["LoRALinear", "apply_lora", "is_adapter_key", "merge_lora"]
