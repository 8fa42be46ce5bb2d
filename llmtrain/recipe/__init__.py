"""The recipe: one pydantic model (``schema``), model presets, the GPU catalog, YAML loading."""

from llmtrain.recipe.load import load_recipe, load_recipe_text
from llmtrain.recipe.schema import Recipe

__all__ = ["Recipe", "load_recipe", "load_recipe_text"]
