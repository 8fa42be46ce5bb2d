"""llmtrain: plan, launch and run 5D-parallel LLM training from one YAML recipe.

Layers (imports point one way): ``cli`` -> ``plan`` / ``launch`` -> (processes) -> ``engine``.
``recipe``, ``plan`` and ``launch`` never import torch, so ``llmtrain plan`` answers in
well under a second on a laptop.
"""

__version__ = "0.1.0"
