"""One multi-rank job of a test worker, started by torchrun's own machinery with the ranks forked.

``python tests/dist_launch.py NPROC tests/X_worker.py ARGS...`` is ``torchrun --standalone
--nproc-per-node NPROC tests/X_worker.py ARGS...`` with one difference: the worker module (torch,
the engine, DCP) is imported once, in a forkserver, and every rank is forked from it
(``start_method="forkserver"`` with the worker preloaded), instead of each rank importing it
again; each rank then runs the worker's ``main()`` with ``sys.argv`` as torchrun would give it.
The agent, the c10d rendezvous on a free localhost port, the rank environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``...) and the failure handling are the same
``torch.distributed.launcher.api.elastic_launch`` that ``torch.distributed.run`` calls.

Why: importing torch 2.13's distributed stack and the engine costs ~4.5 s of CPU per rank on the
test machines, so a 16-rank job on 2 cores spent 37 of its 68 s importing (measured, eighth
session: the same 16-rank 5D case took 30 s with one import). Nothing is initialised in the
forkserver (no process group, no tensor op, one intra-op thread: ``OMP_NUM_THREADS=1``), so a
forked rank starts in the state a fresh one reaches after its imports.

Why a forkserver and not ``fork`` from this process (the eighth session's design): by the time the
agent starts the ranks it runs other threads (the c10d store it hosts, the rendezvous keep-alive
timer), and a child forked while one of them holds a lock can never take that lock. CI saw it once
(eleventh session): in a 16-rank job one forked rank never published its gloo address and the
other 15 timed out after 600 s. The forkserver is a fresh single-threaded interpreter (started by
exec, not fork), so no lock can be held by another thread when it forks.

The launcher's own tests (tests/test_launch_*.py, tests/test_main_job.py, the checkpoint/resume
tests) keep starting real ``torchrun`` processes.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing
import multiprocessing.forkserver
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def worker_module(path: str) -> str:
    """``tests/X_worker.py`` -> ``tests.X_worker`` (importable by name, so the forkserver can preload it)."""
    rel = Path(path).resolve().relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts)


def rank_main(module: str, path: str, args: list[str]) -> None:
    sys.argv = [path, *args]
    # The ~300,000 objects of the preloaded imports live as long as the rank: frozen, no collection
    # walks them again. Each gc.collect() of a worker (one per case, to free the last case's groups
    # and stages) walked them in 0.15 s alone and 0.3-0.37 s with 4 ranks on 2 cores (rank 0 of
    # tests/test_eval_layouts.py's job: 14 calls, 5.1 of its 57.5 s; thirty-fourth session). The
    # saving, a few per cent of a job, is inside this machine's run-to-run noise (the same 4-rank
    # parity job took 101-155 s either way).
    gc.freeze()
    importlib.import_module(module).main()  # already imported: the forkserver preloaded it


def main() -> None:
    nproc, path, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    module = worker_module(path)
    # "__main__" (this file) too, so the forked ranks find rank_main without importing it again.
    multiprocessing.set_forkserver_preload(["__main__", module])
    multiprocessing.forkserver.ensure_running()  # its imports overlap the agent's start-up
    # torch only now: the forkserver's imports (torch, the engine, DCP: ~2.4 s) and the agent's
    # (torch's launcher: ~1.6 s) run side by side; imported at the top, this module's import came
    # first and the two ran one after the other (~1.5 s more per job, measured twenty-eighth session)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          start_method="forkserver")
    elastic_launch(config, rank_main)(module, path, args)


if __name__ == "__main__":
    main()
