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

Names containing ``TOKEN``, ``KEY``, ``SECRET`` or ``PASSWORD`` (any case) are secrets: their
values print as ``****`` in ``plan``, ``--dry-run``, ``logs/commands.txt``, and
:class:`Redactor` replaces their values in every line the launcher shows or logs.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Iterable, Mapping

from llmtrain.errors import LLMTrainError, Problem
from llmtrain.recipe.schema import LaunchConfig

DEFAULT_PASSTHROUGH = ("NCCL_*", "CUDA_*", "TORCH_*", "GLOO_*", "HF_*", "WANDB_*", "PYTHONPATH")
SECRET_RE = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED = ("LLMTRAIN_RUN_ID", "LLMTRAIN_RUN_DIR", "LLMTRAIN_NODE_ID", "PYTHONUNBUFFERED")
MASK = "****"
MAX_ENV_FILE = 1 << 20
MIN_REDACT = 4  # shorter secret values are not searched for in output (too many false hits)


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: str
    source: str  # "passthrough", "env_file", "env", "launcher"

    @property
    def secret(self) -> bool:
        return is_secret(self.name)

    def shown(self) -> str:
        return MASK if self.secret else self.value


def is_secret(name: str) -> bool:
    return bool(SECRET_RE.search(name))


def read_env_file(path: str | Path) -> dict[str, str]:
    """Parse ``KEY=VALUE`` lines; errors name ``file:line``."""
    path = Path(path).expanduser()
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise LLMTrainError(f"cannot read env file {path}: {exc.strerror or exc}", "fix launch.env_file",
                            path="launch.env_file") from None
    if len(raw) > MAX_ENV_FILE:
        raise LLMTrainError(f"env file {path} is {len(raw)} bytes", "an env file is a short text file", path=str(path))
    text = raw.decode("utf-8", errors="replace")
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
            problems.append(Problem(f"{path}:{number}", f"expected NAME=VALUE, got {stripped[:40]!r}",
                                    "write one NAME=VALUE per line"))
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
    return out


def policy_env(launch: LaunchConfig, environ: Mapping[str, str] | None = None,
               base_dir: str | Path | None = None) -> list[EnvVar]:
    """The policy's variables for every node (without the per-run launcher variables), sorted by name."""
    environ = os.environ if environ is None else environ
    patterns = list(DEFAULT_PASSTHROUGH if launch.env_passthrough_defaults else ()) + list(launch.env_passthrough)
    out: dict[str, EnvVar] = {}
    for name in sorted(environ):
        if NAME_RE.match(name) and any(fnmatchcase(name, p) for p in patterns) and name not in RESERVED:
            out[name] = EnvVar(name, environ[name], "passthrough")
    if launch.env_file:
        path = Path(launch.env_file)
        if base_dir is not None and not path.expanduser().is_absolute():
            path = Path(base_dir) / path
        for name, value in read_env_file(path).items():
            out[name] = EnvVar(name, value, "env_file")
    for name, value in launch.env.items():
        out[name] = EnvVar(name, value, "env")
    reserved = [name for name in out if name in RESERVED and out[name].source != "passthrough"]
    if reserved:
        raise LLMTrainError(f"{reserved[0]} is set by the launcher for each run", "remove it from launch.env / the env file",
                            path=f"launch.env.{reserved[0]}")
    return [out[name] for name in sorted(out)]


def launcher_env(run_id: str, run_dir: str, node_rank: int, visible_devices: Iterable[int] | None = None) -> list[EnvVar]:
    out = [EnvVar("LLMTRAIN_RUN_ID", run_id, "launcher"), EnvVar("LLMTRAIN_RUN_DIR", run_dir, "launcher"),
           EnvVar("LLMTRAIN_NODE_ID", f"{run_id}.{node_rank}", "launcher"), EnvVar("PYTHONUNBUFFERED", "1", "launcher")]
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


def shell_assignments(env: Iterable[EnvVar], masked: bool = False) -> list[str]:
    """``NAME=<quoted value>`` words for ``env`` (secrets as ``NAME=****`` when ``masked``)."""
    return [f"{v.name}={MASK if masked and v.secret else shlex.quote(v.value)}" for v in env]


class Redactor:
    """Replaces the values of secret variables in text (each line of a multi-line value too)."""

    def __init__(self, env: Iterable[EnvVar]):
        needles: set[str] = set()
        for var in env:
            if var.secret and var.value:
                needles.update(part for part in [var.value, *var.value.splitlines()] if len(part) >= MIN_REDACT)
        self._needles = sorted(needles, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for needle in self._needles:
            if needle in text:
                text = text.replace(needle, MASK)
        return text

    def __bool__(self) -> bool:
        return bool(self._needles)
