"""What an HF directory holds, from headers alone, lives with the recipe (torch-free):
:mod:`llmtrain.recipe.hf_index`. Re-exported here so the engine's importers read as before."""

from llmtrain.recipe.hf_index import (  # noqa: F401
    DTYPE_BYTES, FLOAT_DTYPES, HEADER_CAP, HINT, IGNORED_RE, INDEX, INDEX_CAP, SHARD_RE, TensorHeader, _plain_name, _problem, hf_tensors, missing_shards, model_problems, read_header, read_weight_map,
)
