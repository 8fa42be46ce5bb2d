"""The environment every node gets: exactly what the policy says, quoted for a POSIX shell.

Sources, lowest precedence first (a later source overrides an earlier one):

1. **passthrough**: variables of the *launching* environment whose names match a pattern
   (fnmatch, case-sensitive): the defaults ``NCCL_* CUDA_* TORCH_* GLOO_* HF_* WANDB_*
   PYTHONPATH`` (unless ``launch.env_passthrough_defaults: false``) plus
   ``launch.env_passthrough``;
2. **env file**: ``launch.env_file``, ``KEY=VALUE`` lines read on the launching machine
   (``#`` comments, optional ``export``, values optionally in single or double quotes);
3. **explicit**: ``launch.env``, verbatim;
4. **launcher**: ``LLMTRAIN_RUN_ID``, ``LLMTRAIN_RUN_DIR``, ``LLMTRAIN_NODE_ID``,
   ``PYTHONUNBUFFERED=1`` and, for a node limited by ``--include host:0,2``,
   ``CUDA_VISIBLE_DEVICES``. These cannot be overridden.

Nothing else of the launching environment travels; the node's own login environment
(``PATH``, ``HOME``, ...) is kept. Values are written as ``env NAME=<shlex.quote(value)>``
into the command line: never fabric's ``env=`` (it builds ``export K=V`` unquoted, so a value
``a;rm -rf ~`` would run) and never sshd's ``SendEnv``/``AcceptEnv`` (silently dropped).

Secrets (:mod:`llmtrain.launch.secrets`): a variable whose name contains ``TOKEN``, ``KEY``,
``SECRET``, ``PASSWORD`` (and a few more, any case) or that came from the env file prints as
``****`` in ``plan``, ``--dry-run``, ``logs/commands.txt``; other values are shown with URL
user-info and token-shaped parts masked; :class:`Redactor` masks secret values (and shapes) in
every line the launcher shows or logs. ``logs/commands.txt``, a file on disk, shows every
``launch.env`` / env file value as ``****`` (``shell_assignments(masked="disk")``).

Values never reach disk: :func:`lock_recipe` is the recipe written to ``recipe.lock.yaml`` (names
and sources only, :mod:`llmtrain.recipe.lock`), and :func:`restore_env` takes the values again
from the caller's environment or the env file when a locked recipe is run again (``resume``,
whole-job retries); a missing one is an error naming it, and a mask is never sent as a value.
The local launcher applies the same policy (:func:`policy_env`, :func:`launcher_env`). Under
``--launcher slurm`` the values read from the env file (:func:`read_from_file`) are read again by
each node (:mod:`llmtrain.launch.envexec`) instead of going through Slurm, which keeps a batch
job's environment on the controller's disk.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Iterable, Mapping

from llmtrain.errors import LLMTrainError, Problem
from llmtrain.launch.secrets import MASK, MIN_REDACT, Masker, mask_text, remember, secret_name
from llmtrain.recipe.lock import secret_free
from llmtrain.recipe.schema import LaunchConfig, Recipe
from llmtrain.safeio import MIB, read_text

DEFAULT_PASSTHROUGH = ("NCCL_*", "CUDA_*", "TORCH_*", "GLOO_*", "HF_*", "WANDB_*", "PYTHONPATH")
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED = ("LLMTRAIN_RUN_ID", "LLMTRAIN_RUN_DIR", "LLMTRAIN_NODE_ID", "LLMTRAIN_LAUNCH_ID", "PYTHONUNBUFFERED")
MAX_ENV_FILE = MIB
__all__ = ["MASK", "MIN_REDACT", "EnvVar", "is_secret", "read_env_file", "policy_env", "launcher_env", "merge",
           "shell_assignments", "Redactor", "lock_recipe", "restore_env", "run_env", "env_file_path", "read_from_file"]


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: str
    source: str  # "passthrough", "env_file", "env", "launcher"

    @property
    def secret(self) -> bool:
        """Shown as ``****`` as a whole: a secret name, or a value from the env file."""
        return is_secret(self.name) or self.source == "env_file"

    def shown(self) -> str:
        return MASK if self.secret else mask_text(self.value)


is_secret = secret_name  # the policy's name for the one rule in llmtrain.launch.secrets


def read_env_file(path: str | Path) -> dict[str, str]:
    """Parse ``KEY=VALUE`` lines of a regular file of at most 1 MiB. Errors name ``file:line`` and,
    where the line has a valid one, the variable's name -- never the line's content (a secret)."""
    path = Path(path).expanduser()
    text = read_text(path, "env file", MAX_ENV_FILE, field="launch.env_file", hint="fix launch.env_file")
    out: dict[str, str] = {}
    problems = []
    for number, line in enumerate(text.split("\n"), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.startswith("export "):
            stripped = stripped[len("export "):].lstrip()
        name, sep, value = stripped.partition("=")
        name = name.strip()
        if not sep or not NAME_RE.match(name):
            problems.append(Problem(f"{path}:{number}", "not a NAME=VALUE line (NAME: letters, digits and _, "
                                    "not starting with a digit)", "write one NAME=VALUE per line"))
            continue
        value = value.strip()
        if value[:1] in ("'", '"'):
            try:
                parts = shlex.split(value, comments=True)
            except ValueError:
                parts = []
            if len(parts) != 1:
                problems.append(Problem(f"{path}:{number}", f"{name}: unbalanced or extra quotes",
                                        "quote the whole value once"))
                continue
            value = parts[0]
        out[name] = value
    if problems:
        raise LLMTrainError(problems)
    remember(out.values())
    return out


def env_file_path(launch: LaunchConfig, base_dir: str | Path | None = None) -> Path | None:
    """``launch.env_file`` as read: ``~`` expanded, relative paths under ``base_dir``."""
    if not launch.env_file:
        return None
    path = Path(launch.env_file).expanduser()
    if base_dir is not None and not path.is_absolute():
        path = Path(base_dir) / path
    return path


def read_from_file(policy: Iterable[EnvVar], launch: LaunchConfig) -> list[EnvVar]:
    """The variables of ``policy`` whose value :func:`policy_env` read from ``launch.env_file``
    itself: source ``env_file`` and not in ``launch.env`` (an env file's name there holds a value
    restored from the caller's environment, which the file no longer has). A node that reads the
    same file gets exactly these (:mod:`llmtrain.launch.envexec`)."""
    return [v for v in policy if v.source == "env_file" and v.name not in launch.env]


def policy_env(launch: LaunchConfig, environ: Mapping[str, str] | None = None,
               base_dir: str | Path | None = None) -> list[EnvVar]:
    """The policy's variables for every node (without the per-run launcher variables), sorted by name."""
    environ = os.environ if environ is None else environ
    patterns = list(DEFAULT_PASSTHROUGH if launch.env_passthrough_defaults else ()) + list(launch.env_passthrough)
    out: dict[str, EnvVar] = {}
    for name in sorted(environ):
        if NAME_RE.match(name) and any(fnmatchcase(name, p) for p in patterns) and name not in RESERVED:
            out[name] = EnvVar(name, environ[name], "passthrough")
    path = env_file_path(launch, base_dir)
    if path is not None:
        for name, value in read_env_file(path).items():
            out[name] = EnvVar(name, value, "env_file")
    for name, value in launch.env.items():  # a value restored for an env file's name stays an env file's value
        out[name] = EnvVar(name, value, "env_file" if launch.env_sources.get(name) == "env_file" else "env")
    reserved = [name for name in out if name in RESERVED and out[name].source != "passthrough"]
    if reserved:
        raise LLMTrainError(f"{reserved[0]} is set by the launcher for each run", "remove it from launch.env / the env file",
                            path=f"launch.env.{reserved[0]}")
    masks = [v.name for v in out.values() if v.source != "passthrough" and v.value == MASK]
    if masks:  # a masked value (e.g. from an old recipe.lock.yaml) is never sent as the value
        raise LLMTrainError(f"the value of {masks[0]} is the mask {MASK}, not the secret", f"set launch.env.{masks[0]} "
                            "to the real value, or export it and leave it out of launch.env", path=f"launch.env.{masks[0]}")
    remember(v.value for v in out.values() if v.secret)
    return [out[name] for name in sorted(out)]


def new_launch_id() -> str:
    """A fresh id for one launcher invocation (``LLMTRAIN_LAUNCH_ID``).

    The run id is not unique enough to find "this launch's processes": a resumed run keeps its
    id, and a copied run directory has the same name as its original (the test suite's clones
    are all called ``run``). A launcher that swept by run id killed another launcher's torchrun
    of a same-named run running at the same time (a SIGTERM, exit 143, seen when two suites ran
    side by side). 64 random bits per launch cannot collide in practice."""
    return secrets.token_hex(8)


def launcher_env(run_id: str, run_dir: str, node_rank: int, visible_devices: Iterable[int] | None = None,
                 launch_id: str | None = None) -> list[EnvVar]:
    out = [EnvVar("LLMTRAIN_RUN_ID", run_id, "launcher"), EnvVar("LLMTRAIN_RUN_DIR", run_dir, "launcher"),
           EnvVar("LLMTRAIN_NODE_ID", f"{run_id}.{node_rank}", "launcher"), EnvVar("PYTHONUNBUFFERED", "1", "launcher")]
    if launch_id is not None:
        out.insert(3, EnvVar("LLMTRAIN_LAUNCH_ID", launch_id, "launcher"))
    if visible_devices is not None:
        out.append(EnvVar("CUDA_VISIBLE_DEVICES", ",".join(map(str, visible_devices)), "launcher"))
    return out


def merge(*groups: Iterable[EnvVar]) -> list[EnvVar]:
    """Later groups win; the result keeps first-seen order."""
    out: dict[str, EnvVar] = {}
    for group in groups:
        for var in group:
            out[var.name] = var
    return list(out.values())


def shell_assignments(env: Iterable[EnvVar], masked: bool | str = False) -> list[str]:
    """``NAME=<quoted value>`` words for ``env``. ``masked=True`` (what a terminal shows): secrets as
    ``NAME=****``, other values with URL user-info and token shapes masked. ``masked="disk"`` (a
    file under the run directory, ``logs/commands.txt``): also every ``launch.env`` value ``****``,
    since no value of launch.env or the env file is ever written to disk."""
    if not masked:
        return [f"{v.name}={shlex.quote(v.value)}" for v in env]
    whole = (lambda v: v.secret or v.source in ("env", "env_file")) if masked == "disk" else (lambda v: v.secret)
    return [f"{v.name}={MASK if whole(v) else shlex.quote(v.shown())}" for v in env]


class Redactor(Masker):
    """Masks, in every line the launcher shows or logs, the values of ``env``'s secret variables
    and of any variable whose value holds a token shape or URL user-info (each line of a
    multi-line value too), plus token shapes and URL user-info wherever they occur."""

    def __init__(self, env: Iterable[EnvVar]):
        super().__init__(v.value for v in env if v.value and (v.secret or v.shown() != v.value))


def run_env(recipe: Recipe, environ: Mapping[str, str] | None = None,
            base_dir: str | Path | None = None) -> tuple[Recipe, list[EnvVar]]:
    """The recipe with its secret values restored (:func:`restore_env`) and its policy variables:
    what every launch path (local, SSH, resume, retries) computes before it starts anything."""
    recipe = restore_env(recipe, environ, base_dir)
    return recipe, policy_env(recipe.launch, environ, base_dir)


# ----------------------------------------------------------------------------- on disk and back


def lock_recipe(recipe: Recipe, policy: Iterable[EnvVar] = (), base_dir: str | Path | None = None) -> Recipe:
    """The recipe as written to ``recipe.lock.yaml``: no ``launch.env`` value, the names and their
    sources in ``launch.env_sources`` (with the env file's names from ``policy``), the env file's
    path made absolute (:mod:`llmtrain.recipe.lock`)."""
    names = [v.name for v in policy if v.source == "env_file"]
    path = env_file_path(recipe.launch, base_dir)
    return secret_free(recipe, names, str(path.absolute()) if path is not None else None)


def restore_env(recipe: Recipe, environ: Mapping[str, str] | None = None,
                base_dir: str | Path | None = None) -> Recipe:
    """A locked recipe with its secret values back, from the caller's environment (``environ``)
    and the env file, before anything starts. ``launch.env_sources`` names them: ``recipe`` ->
    ``environ[NAME]`` (unless ``launch.env`` has a value, e.g. from ``--set``); ``env_file`` ->
    the env file if it still has NAME, else ``environ[NAME]``. A value that is the mask ``****``
    (an old masked lock) counts as missing. Every missing name is one problem naming it."""
    environ = os.environ if environ is None else environ
    launch = recipe.launch
    env = {k: v for k, v in launch.env.items() if v != MASK}
    masked = [k for k, v in launch.env.items() if v == MASK]
    wanted = {**launch.env_sources, **{k: launch.env_sources.get(k, "recipe") for k in masked}}
    if not wanted:
        return recipe
    file_values: dict[str, str] = {}
    path = env_file_path(launch, base_dir)
    tried = file_ok = False
    if path is not None and any(src == "env_file" for src in wanted.values()):
        tried = True
        try:
            file_values, file_ok = read_env_file(path), True
        except LLMTrainError:
            file_values = {}  # gone or unreadable: its names may still come from the environment
    problems = []
    for name, source in sorted(wanted.items()):
        if name in env or (source == "env_file" and name in file_values):
            continue
        if name in environ:
            env[name] = environ[name]
            continue
        where = f"launch.env_file {path}" if source == "env_file" and path is not None else "launch.env"
        problems.append(Problem(f"launch.env.{name}", f"{name} (from {where}) is not stored with the run (secrets never "
                                f"are) and is not set in this environment", f"export {name}=... (or --set launch.env.{name}=...) and run again"))
    if problems:
        raise LLMTrainError(problems)
    update: dict = {"env": env}
    if tried and not file_ok:
        update["env_file"] = None  # every one of its names came from the environment instead
    return recipe.model_copy(update={"launch": launch.model_copy(update=update)})
