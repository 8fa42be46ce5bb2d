"""Hugging Face interop, one module per concept.

* :mod:`.families` -- config.json <-> recipe model, and the tensor map (our names <-> HF names,
  RoPE row order, stacked experts) per family;
* :mod:`.files` -- an HF model directory on disk (untrusted: checked), reading/writing safetensors;
* :mod:`.checkpoint_read` -- full model tensors of a DCP checkpoint in one process;
* :mod:`.load` -- HF weights into the engine's sharded model (``--init-from-hf``).
"""

from llmtrain.engine.hf.checkpoint_read import expected_model_shapes, read_checkpoint_model
from llmtrain.engine.hf.families import (
    LAYER_NAMES, TOP_NAMES, Source, config_problems, from_hf_state, half_to_interleaved, hf_config,
    interleaved_to_half, require_dense, tensor_map, to_hf, to_hf_state, to_ours,
)
from llmtrain.engine.hf.files import CONFIG, CONFIG_CAP, WEIGHTS, check_hf_dir, read_hf_state, save_hf
from llmtrain.engine.hf.load import load_hf_weights

__all__ = [
    "CONFIG", "CONFIG_CAP", "LAYER_NAMES", "TOP_NAMES", "WEIGHTS", "Source", "check_hf_dir", "config_problems",
    "expected_model_shapes", "from_hf_state", "half_to_interleaved", "hf_config", "interleaved_to_half",
    "load_hf_weights", "read_checkpoint_model", "read_hf_state", "require_dense", "save_hf", "tensor_map",
    "to_hf", "to_hf_state", "to_ours",
]
