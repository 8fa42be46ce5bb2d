"""The recipe as it is written to disk: ``recipe.lock.yaml`` and each checkpoint's ``metadata.json``.

Values of ``launch.env`` and of ``launch.env_file`` are secrets by the trust model
(docs/security.md): they live in memory only. On disk the recipe keeps their **names and where
each came from**, never a value::

    launch:
      env: {}                                  # values are never written
      env_file: /home/me/cluster.env           # the path (not a secret) is kept, made absolute
      env_sources: {WANDB_API_KEY: recipe, DB_URL: env_file}

``recipe`` means the value was in the recipe's ``launch.env`` (or a ``--set launch.env.X=``);
``env_file`` that it came from ``launch.env_file``. The dump is an ordinary recipe, so the engine
ranks (``--recipe RUN_DIR/recipe.lock.yaml``) and ``llmtrain resume`` load it unchanged;
:func:`llmtrain.launch.envpolicy.restore_env` takes the values again from the caller's
environment (``recipe``) or the env file (``env_file``, else the environment) before a resume
starts anything, and names any that is missing.

Pure Python (no torch): the launcher and the engine both use it.
"""

from __future__ import annotations

from typing import Any, Iterable

from llmtrain.recipe.load import dump_recipe
from llmtrain.recipe.schema import Recipe


def env_sources(recipe: Recipe, env_file_names: Iterable[str] = ()) -> dict[str, str]:
    """NAME -> "recipe" | "env_file" for every variable of ``launch.env`` / the env file, sorted."""
    launch = recipe.launch
    out: dict[str, str] = dict(launch.env_sources)
    for name in env_file_names:
        out.setdefault(name, "env_file")
    for name in launch.env:
        out[name] = launch.env_sources.get(name, "recipe")  # a value restored on resume keeps its origin
    return dict(sorted(out.items()))


def secret_free(recipe: Recipe, env_file_names: Iterable[str] = (), env_file: str | None = None) -> Recipe:
    """``recipe`` without any ``launch.env`` value; ``launch.env_sources`` names them (and the env
    file's ``env_file_names``). ``env_file``: the path to record instead of ``launch.env_file``."""
    launch = recipe.launch
    update: dict[str, Any] = {"env": {}, "env_sources": env_sources(recipe, env_file_names)}
    if env_file is not None:
        update["env_file"] = env_file
    return recipe.model_copy(update={"launch": launch.model_copy(update=update)})


def lock_text(recipe: Recipe) -> str:
    """``recipe.lock.yaml``'s text: :func:`~llmtrain.recipe.load.dump_recipe` of the secret-free recipe."""
    return dump_recipe(secret_free(recipe))


def secret_free_dict(recipe: Recipe) -> dict[str, Any]:
    """The recipe for ``metadata.json`` and other JSON records: no ``launch.env`` value."""
    return secret_free(recipe).model_dump(mode="json", by_alias=True)
