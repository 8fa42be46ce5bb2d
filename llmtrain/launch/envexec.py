"""Put the env file's variables into a command's environment on the node itself, then become it.

    python -m llmtrain.launch.envexec --env-file /shared/cluster.env --only HF_TOKEN,DB_URL -- \\
        /usr/bin/python3 -m torch.distributed.run ...

Why it exists: under ``--launcher slurm`` a variable reaches a batch job through sbatch's
environment, and slurmctld keeps every batch job's environment on the controller's disk
(``StateSaveLocation/hash.N/job.ID/environment``, kept until the job record is purged,
``MinJobAge`` after its end). So the values of ``launch.env_file`` never go through Slurm: the
job carries no value of them, and each node's ``node.sh`` runs its torchrun through this entry
point, which reads the same file at the same path when the task starts (docs/launch.md, Slurm).

Decisions:

* **The same parser and limits as the launcher** (:func:`llmtrain.launch.envpolicy.read_env_file`:
  a regular file of at most 1 MiB, ``NAME=VALUE`` lines, quotes, ``export``): one parser, so a
  value arrives byte for byte as the launcher read it. Nothing in the file is executed, no shell
  runs: the command is started with :func:`os.execvpe` and the values are set in a dict.
* **Exactly the names of ``--only``** are set: the launcher lists the names whose final value came
  from the file (a ``launch.env`` entry of the same name wins and travels through Slurm; other
  lines of the file are not for the ranks). A listed name the file lacks is an error: this node
  reads another file than the launching machine did (not shared storage), and silently starting
  ranks without the variable would fail later and further away.
* **Errors are one line on stderr and exit 2**, never a traceback: ``llmtrain: launch.env_file:
  ... on node HOST; ...`` naming the field and the fix (the file must be readable at the same path
  on every node, like the run directory). srun's ``--kill-on-bad-exit`` then ends the step, and
  the watching launcher shows the line as the node's output. Values are never printed.
* **Torch-free and small**: it imports only the env policy (pydantic via the recipe schema), so a
  node's torchrun starts about 0.2 s later, once per step (measured on a quiet 2-core machine:
  ``time python -m llmtrain.launch.envexec --env-file F --only A -- true``, 0.19-0.21 s; a bare
  ``python -c pass`` 0.03 s).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Mapping, Sequence

EXIT_USAGE = 2
EXIT_NOT_FOUND = 127
SHARED_HINT = ("put the env file on storage every node mounts at the same path (like the run directory), "
               "or fix launch.env_file")


def _node() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def file_environment(path: str, names: Sequence[str], environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with ``names`` set from the env file at ``path``; an LLMTrainError otherwise."""
    from llmtrain.errors import LLMTrainError, Problem
    from llmtrain.launch.envpolicy import NAME_RE, read_env_file

    bad = [n for n in names if not NAME_RE.match(n)]
    if bad:
        raise LLMTrainError(f"--only: {bad[0][:60]!r} is not a variable name", "pass NAME,NAME,... (letters, digits, _)",
                            path="llmtrain.launch.envexec")
    try:
        values = read_env_file(path)
    except LLMTrainError as exc:
        raise LLMTrainError([Problem("launch.env_file", f"{p.message} on node {_node()}", SHARED_HINT)
                             if p.path == "launch.env_file" else Problem("launch.env_file", f"{p.path}: {p.message} "
                             f"on node {_node()}", p.hint) for p in exc.problems]) from None
    missing = [n for n in names if n not in values]
    if missing:
        raise LLMTrainError(f"the env file {path} on node {_node()} has no {', '.join(missing)} (the launching "
                            "machine's had): the nodes read another file than the launcher did", SHARED_HINT,
                            path="launch.env_file")
    return {**environ, **{n: values[n] for n in names}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmtrain.launch.envexec",
                                     description="run CMD with the named variables of an env file set")
    parser.add_argument("--env-file", required=True, help="the env file (launch.env_file), read on this node")
    parser.add_argument("--only", default="", help="comma-separated names to set from it")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("llmtrain: envexec: no command after --", file=sys.stderr)
        return EXIT_USAGE
    from llmtrain.errors import LLMTrainError

    names = [n for n in args.only.split(",") if n]
    try:
        env = file_environment(args.env_file, names, os.environ)
    except LLMTrainError as exc:
        for line in exc.lines():
            print(f"llmtrain: {line}", file=sys.stderr)
        return EXIT_USAGE
    sys.stdout.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print(f"llmtrain: envexec: cannot run {command[0][:200]}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    return 0  # not reached: execvpe replaced this process


if __name__ == "__main__":
    sys.exit(main())
