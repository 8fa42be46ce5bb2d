"""Loading Hugging Face weights into the engine's (sharded) model."""

from __future__ import annotations

from pathlib import Path
from llmtrain.errors import LLMTrainError
from llmtrain.recipe.schema import ModelConfig

from llmtrain.engine.hf.families import config_problems, from_hf_state, require_dense
from llmtrain.engine.hf.files import check_hf_dir, read_hf_state


def load_hf_weights(parts, directory: str | Path, model_cfg: ModelConfig) -> None:
    """Load HF Llama weights from ``directory`` into the model chunks ``parts.parts`` (any layout)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    require_dense(model_cfg)
    conf, files = check_hf_dir(directory, "checkpoint.init_from_hf")
    problems = config_problems(conf, model_cfg, "checkpoint.init_from_hf")
    if problems:
        raise LLMTrainError(problems)
    state = from_hf_state(read_hf_state(files), model_cfg)
    options = StateDictOptions(full_state_dict=True)
    for part in parts.parts:
        current = get_model_state_dict(part)
        missing = sorted(k for k in current if k not in state)
        if missing:
            raise LLMTrainError(f"{directory}: no weights for {', '.join(missing[:3])}"
                                + (f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""),
                                "the safetensors do not hold the whole model", path="checkpoint.init_from_hf")
        for k, full in ((k, state[k]) for k in current):
            if tuple(full.shape) != tuple(current[k].shape):
                raise LLMTrainError(f"{k}: Hugging Face shape {tuple(full.shape)}, model {tuple(current[k].shape)}",
                                    "the weights do not match the recipe's model", path="checkpoint.init_from_hf")
        set_model_state_dict(part, {k: state[k].to(current[k].dtype) for k in current}, options=options)

