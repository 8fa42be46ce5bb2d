"""Loading Hugging Face weights into the engine's (sharded) model (``--init-from-hf DIR``).

:func:`load_hf_weights` is what the trainer calls on every rank: it checks the directory from
headers alone (:func:`~llmtrain.engine.hf.files.check_hf_model`; the launcher ran the same
check before torchrun, but a recipe's ``checkpoint.init_from_hf`` may reach the engine
without it) and then streams each rank's own slices (:mod:`.stream`), so no rank ever holds the
whole model. A LoRA model's adapters (``*.lora_a.weight`` / ``*.lora_b.weight``) are not in HF
files: they are skipped and keep their initialization (B = 0: the loaded model is the base). :func:`load_hf_weights_whole` is the previous way (every rank reads every
tensor, then ``set_model_state_dict(full_state_dict=True)`` keeps its shard): kept as the
reference the tests compare against bitwise and the baseline of benchmarks/hf_load_memory.py.
Tied models: the HF file holds one tensor (the embedding); ``output.weight`` is read from it
(:func:`~llmtrain.engine.hf.stream.sources_for`), once when it is the embedding's Parameter, and
again into the last pipeline stage's copy (:mod:`llmtrain.engine.parallel.tied`).
"""

from __future__ import annotations

from pathlib import Path

from llmtrain.engine.hf.files import check_hf_model, read_hf_state
from llmtrain.errors import LLMTrainError
from llmtrain.recipe.schema import ModelConfig

FLAG = "checkpoint.init_from_hf"


def load_hf_weights(parts, directory: str | Path, model_cfg: ModelConfig):
    """Stream HF weights from ``directory`` into the model chunks ``parts.parts`` (any layout);
    returns this rank's :class:`~llmtrain.engine.hf.stream.LoadStats`."""
    from llmtrain.engine.finetune.lora import is_adapter_key
    from llmtrain.engine.hf.stream import stream_into

    model = check_hf_model(directory, model_cfg, FLAG)
    return stream_into(parts.parts, model, model_cfg, skip=is_adapter_key)


def load_hf_weights_whole(parts, directory: str | Path, model_cfg: ModelConfig) -> None:
    """Every rank reads the whole model, then keeps its shards (reference and benchmark baseline)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from llmtrain.engine.finetune.lora import is_adapter_key
    from llmtrain.engine.hf.families import to_ours
    from llmtrain.engine.hf.stream import sources_for

    model = check_hf_model(directory, model_cfg, FLAG)
    raw = read_hf_state(sorted({h.file for h in model.tensors.values()}))
    hf = {name: raw[h.key or name] for name, h in model.tensors.items()}
    tmap = sources_for(model_cfg)
    for part in parts.parts:
        adapters = any(is_adapter_key(k) for k in get_model_state_dict(part))
        current = {k: v for k, v in get_model_state_dict(part).items() if not is_adapter_key(k)}
        missing = [k for k in current if k not in tmap]
        if missing:
            raise LLMTrainError(f"our tensor {missing[0]} has no Hugging Face counterpart", path=FLAG)
        state = {k: to_ours(tmap[k], [hf[n] for n in tmap[k].hf]).to(current[k].dtype) for k in current}
        set_model_state_dict(part, state, options=StateDictOptions(full_state_dict=True, strict=not adapters))
