"""The engine: everything that runs inside one training rank (torch only).

Started by ``torchrun`` on every node, the engine builds the named DeviceMesh from the
recipe's parallel layout, the model (:mod:`llmtrain.engine.models`), applies the parallel
strategies, and runs the training loop with checkpointing.

Import rule: the engine imports ``torch`` and :mod:`llmtrain.recipe`, and never ``typer``,
``fabric`` or rich-CLI code, so that a worker process starts with the smallest possible
import set and the CLI/launcher layers stay torch-free (see ``/work/shared/DESIGN.md`` §2).
"""
