"""One multi-rank job of a test worker, started by torchrun's own machinery with the ranks forked.

``python tests/dist_launch.py NPROC tests/X_worker.py ARGS...`` is ``torchrun --standalone
--nproc-per-node NPROC tests/X_worker.py ARGS...`` with one difference: this process imports the
worker module (torch, the engine, DCP) once and the elastic agent forks the ranks from it
(``start_method="fork"``), instead of each rank importing them again; each rank then runs the
worker's ``main()`` with ``sys.argv`` as torchrun would give it. The agent, the c10d rendezvous on
a free localhost port, the rank environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...) and the
failure handling are the same ``torch.distributed.launcher.api.elastic_launch`` that
``torch.distributed.run`` calls.

Why: importing torch 2.13's distributed stack and the engine costs ~4.5 s of CPU per rank on the
test machines, so a 16-rank job on 2 cores spent 37 of its 68 s importing (measured, eighth
session: the same 16-rank 5D case took 30 s this way). Nothing is initialised before the fork (no
process group, no tensor op, one intra-op thread: ``OMP_NUM_THREADS=1``), so a forked rank starts
in the state a fresh one reaches after its imports; the 5D matrix's 4-rank job gave bitwise the
same losses and weights both ways. The launcher's own tests (tests/test_launch_*.py,
tests/test_main_job.py, the checkpoint/resume tests) keep starting real ``torchrun`` processes.
"""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.distributed.launcher.api import LaunchConfig, elastic_launch  # noqa: E402


def load_worker(path: str):
    spec = importlib.util.spec_from_file_location(f"_dist_worker_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # the imports happen here, once, before the fork
    return module


def rank_main(path: str, args: list[str]) -> None:
    sys.argv = [path, *args]
    WORKER.main()


def main() -> None:
    global WORKER
    nproc, path, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    WORKER = load_worker(path)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, start_method="fork")
    elastic_launch(config, rank_main)(path, args)


WORKER = None  # the loaded worker module (set in main() before the fork; the forked ranks inherit it)

if __name__ == "__main__":
    main()
