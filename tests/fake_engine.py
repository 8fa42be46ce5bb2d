"""A torch-free stand-in for ``llmtrain.engine.main`` that honours the launcher contract.

Run by torchrun exactly like the engine (``-m fake_engine --recipe R --run-dir D`` with
``PYTHONPATH=<repo>/tests`` and ``LLMTRAIN_ENGINE_MODULE=fake_engine``). Reads ``RANK`` and
``WORLD_SIZE``; every rank prints a few log lines (stdout and stderr); rank 0 prints the
``@@llmtrain`` start/step/end events with a falling loss and writes ``metrics.jsonl``.

Hooks (environment):
  FAKE_ENGINE_STEP_S=0.02       seconds per step
  FAKE_ENGINE_FAIL_RANK=R       rank R writes torchrun's error file (like @record) and exits with
                                code 3 at step FAKE_ENGINE_FAIL_STEP (default 2)
  FAKE_ENGINE_SLEEP=S           after step 1, every rank says "sleeping" and sleeps S seconds per step
  FAKE_ENGINE_IGNORE_TERM=1     ranks ignore SIGTERM (the launcher must SIGKILL them)
  FAKE_ENGINE_GRANDCHILD=1      each rank starts a grandchild in a new session that ignores
                                SIGTERM and sleeps 300 s (orphaned when the rank dies);
                                =polite: the same grandchild, but SIGTERM stops it
  FAKE_ENGINE_MARKER=PATH       each rank creates PATH.<rank> on start (proves a process ran)
  FAKE_ENGINE_HANG_RANK=R       rank R prints "rank R hangs at step N" at step FAKE_ENGINE_HANG_STEP (default 2)
                                and then sleeps silently; the other ranks stop stepping there too (as if
                                blocked in a collective) but print "rank X waits for rank R" every 0.5 s
  FAKE_ENGINE_ENV_DUMP=PATH     each rank writes its whole environment, its network namespace and its cwd
                                as JSON to PATH.<rank>.json
  FAKE_ENGINE_PRINT_ENV=NAME    rank 0 prints "env NAME=<value>" (to test masking of secrets in output)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time

import yaml


def event(kind: str, **fields) -> None:
    sys.stdout.write("@@llmtrain " + json.dumps({"event": kind, **fields}) + "\n")
    sys.stdout.flush()


def record_error(message: str) -> None:
    """Write the error file torchrun reads, as torch's ``@record`` decorator does for the real engine."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as fp:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": f"Traceback (fake)\n{message}\n",
                                                                      "timestamp": str(int(time.time()))}}}, fp)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    env = os.environ.get
    if env("FAKE_ENGINE_MARKER"):
        open(f"{env('FAKE_ENGINE_MARKER')}.{rank}", "w").close()
    if env("FAKE_ENGINE_ENV_DUMP"):
        try:
            netns = os.readlink("/proc/self/ns/net")
        except OSError:
            netns = None
        with open(f"{env('FAKE_ENGINE_ENV_DUMP')}.{rank}.json", "w") as fp:
            json.dump({"env": dict(os.environ), "netns": netns, "cwd": os.getcwd()}, fp)
    if env("FAKE_ENGINE_PRINT_ENV") and rank == 0:
        name = env("FAKE_ENGINE_PRINT_ENV")
        print(f"env {name}={os.environ.get(name, '<unset>')}", flush=True)
    if env("FAKE_ENGINE_IGNORE_TERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(args.recipe) as fp:
        recipe = yaml.safe_load(fp)
    steps = int(recipe["train"]["steps"])
    step_s = float(env("FAKE_ENGINE_STEP_S", "0.02"))
    fail_rank = int(env("FAKE_ENGINE_FAIL_RANK", "-1"))
    fail_step = int(env("FAKE_ENGINE_FAIL_STEP", "2"))
    sleep_s = float(env("FAKE_ENGINE_SLEEP", "0"))
    hang_rank = int(env("FAKE_ENGINE_HANG_RANK", "-1"))
    hang_step = int(env("FAKE_ENGINE_HANG_STEP", "2"))
    print(f"fake engine rank {rank}/{world} starting, run id {env('LLMTRAIN_RUN_ID')}", flush=True)
    print(f"rank {rank} stderr hello", file=sys.stderr, flush=True)
    if env("FAKE_ENGINE_GRANDCHILD") in ("1", "polite"):
        ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if env("FAKE_ENGINE_GRANDCHILD") == "1" else ""
        child = subprocess.Popen(
            [sys.executable, "-c", f"import signal, time; {ignore}time.sleep(300)"],
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"rank {rank} started grandchild {child.pid}", flush=True)
    tokens = 2048
    metrics = open(os.path.join(args.run_dir, "metrics.jsonl"), "a") if rank == 0 else None
    if rank == 0:
        event("start", steps=steps, world_size=world)
    t0 = time.monotonic()
    for step in range(1, steps + 1):
        if rank == fail_rank and step == fail_step:
            print(f"rank {rank} fails on purpose at step {step}", file=sys.stderr, flush=True)
            record_error(f"FakeEngineError: rank {rank} fails on purpose at step {step}")
            return 3
        if hang_rank >= 0 and step == hang_step:
            if rank == hang_rank:
                print(f"rank {rank} hangs at step {step}", flush=True)
                time.sleep(3600)
            while True:
                print(f"rank {rank} waits for rank {hang_rank} at step {step}", flush=True)
                time.sleep(0.5)
        if sleep_s and step == 2:
            print(f"rank {rank} sleeping", flush=True)
        time.sleep(sleep_s if sleep_s and step >= 2 else step_s)
        loss = 6.0 * math.exp(-step / max(steps, 1)) + 0.5
        lr = 1e-3 * min(1.0, step / 5)
        tps = tokens / max(step_s, 1e-3)
        if rank == 0:
            row = {"step": step, "loss": loss, "lr": lr, "grad_norm": 1.0 / step, "tokens_per_s": tps,
                   "tflops_per_gpu": 0.01, "mfu": 0.001, "memory_gib": 0.1, "elapsed_s": time.monotonic() - t0}
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            event("step", step=step, steps=steps, loss=loss, lr=lr, grad_norm=1.0 / step, tokens_per_s=tps, mfu=0.001)
    if rank == 0:
        event("end", step=steps, final_loss=loss, tokens_per_s=tps)
        metrics.close()
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
