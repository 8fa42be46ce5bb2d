"""Engine stand-in for the secret tests: checks what every rank sees, then (optionally) trains.

Run by torchrun in place of ``llmtrain.engine.main`` (``LLMTRAIN_ENGINE_MODULE=tests.secret_probe``,
with the repository on ``PYTHONPATH``). ``SECRET_PROBE`` names a JSON file **outside the run
directory**::

    {"expect": {NAME: sha256(value), ...}, "out": DIR, "phase": "launch", "print": false, "engine": true}

Each rank compares its environment with the expected SHA-256 digests (so no value is written
anywhere by the probe) and writes ``DIR/<phase>-rank-<RANK>.json``: ``{NAME: "ok" | "missing" |
"mask" | "wrong"}`` ("mask": the value arrived as ``****``). With ``print``, rank 0 also prints
every expected variable's value to stdout and stderr (to test the launcher's masking of live
output and its log files). With ``engine`` the real engine then runs with the same argv;
without, rank 0 prints a start and an end event and the rank exits 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path


def verdict(expect: dict[str, str]) -> dict[str, str]:
    out = {}
    for name, digest in expect.items():
        value = os.environ.get(name)
        if value is None:
            out[name] = "missing"
        elif value == "****":
            out[name] = "mask"
        else:
            out[name] = "ok" if hashlib.sha256(value.encode()).hexdigest() == digest else "wrong"
    return out


def main() -> int:
    spec = json.loads(Path(os.environ["SECRET_PROBE"]).read_text())
    rank = os.environ.get("RANK", "?")
    result = verdict(spec["expect"])
    Path(spec["out"], f"{spec.get('phase', 'run')}-rank-{rank}.json").write_text(json.dumps(result))
    if spec.get("print") and rank == "0":
        for name in spec["expect"]:
            value = os.environ.get(name, "<unset>")
            sys.stdout.write(f"probe {name}={value}\n")
            sys.stderr.write(f"probe stderr {name}: {value}\n")
        sys.stdout.flush()
        sys.stderr.flush()
    if spec.get("engine", True):
        from llmtrain.engine.main import main as engine_main

        return engine_main()
    if rank == "0":
        sys.stdout.write('@@llmtrain {"event": "start", "steps": 1, "world_size": 1}\n')
        sys.stdout.write('@@llmtrain {"event": "end", "step": 1, "final_loss": 1.0}\n')
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
