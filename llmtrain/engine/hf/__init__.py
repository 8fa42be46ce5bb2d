"""Hugging Face interop, one module per concept.

* :mod:`.families` -- config.json <-> recipe model, and the tensor map (our names <-> HF names,
  RoPE row order, stacked experts) per family;
* :mod:`.files` -- an HF model directory on disk (untrusted: checked), reading/writing safetensors;
* :mod:`.checkpoint_read` -- full model tensors of a DCP checkpoint in one process;
* :mod:`.index` -- what an HF directory holds, from safetensors headers alone (launch-time checks);
* :mod:`.stream` -- each rank reads only its own slices (under :mod:`.load`);
* :mod:`.load` -- HF weights into the engine's sharded model (``--init-from-hf``);
* :mod:`.export` -- a checkpoint to sharded safetensors by parallel workers (``ckpt export --hf``),
  with :mod:`.tokenizer_files`.
"""

from llmtrain.engine.hf.checkpoint_read import expected_model_shapes, read_checkpoint_model
from llmtrain.engine.hf.config_json import config_problems, hf_config, model_from_hf_config
from llmtrain.engine.hf.families import (
    FAMILIES, LAYER_NAMES, TOP_NAMES, Source, family_problems, from_hf_state, half_to_interleaved,
    interleaved_to_half, require_dense, require_hf_compatible, tensor_map, to_hf, to_hf_state, to_ours,
)
from llmtrain.engine.hf.files import CONFIG, CONFIG_CAP, WEIGHTS, HFModel, check_hf_dir, check_hf_model, read_hf_state, save_hf
from llmtrain.engine.hf.load import load_hf_weights, load_hf_weights_whole
from llmtrain.engine.hf.export import export_hf, plan_export

__all__ = [
    "CONFIG", "CONFIG_CAP", "FAMILIES", "LAYER_NAMES", "TOP_NAMES", "WEIGHTS", "Source", "check_hf_dir", "config_problems",
    "expected_model_shapes", "family_problems", "from_hf_state", "half_to_interleaved", "hf_config", "interleaved_to_half",
    "load_hf_weights", "model_from_hf_config", "read_checkpoint_model", "read_hf_state", "require_dense", "require_hf_compatible", "save_hf", "tensor_map",
    "to_hf", "to_hf_state", "to_ours", "HFModel", "check_hf_model", "load_hf_weights_whole", "export_hf", "plan_export",
]
