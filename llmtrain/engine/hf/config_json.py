"""config.json <-> recipe model lives with the recipe, torch-free: :mod:`llmtrain.recipe.hf_config`.
Re-exported here so the engine's importers read as before."""

from llmtrain.recipe.hf_config import (  # noqa: F401
    BOOL_KEYS, FLOAT_KEYS, HINT, INT_KEYS, NOT_SUPPORTED, OPTIONAL, ROPE_TYPES, _type_problems, config_problems, hf_config, model_from_hf_config, unsupported_problems,
)
