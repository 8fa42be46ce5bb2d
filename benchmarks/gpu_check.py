"""The prepared GPU check (issue 19): every CUDA-only path, MFU, planner accuracy, speed vs HF.

    python benchmarks/gpu_check.py                     # on one H100/H200: <= 8 min, no network
    python benchmarks/gpu_check.py --device cpu --tiny # every step at toy size on CPU (CI smoke)
    python benchmarks/gpu_check.py --steps a,b --budget-s 200   # rerun what the budget left out
    python benchmarks/gpu_check.py --publish FIRST.json [RERUN.json ...]   # results + docs, merged
    PYTHONPATH=.gpu_carry/site python3 benchmarks/gpu_check.py   # on the device machine (docs/benchmarks.md)

Writes ``benchmarks/results/gpu_check.json`` (``--tiny``: in $TMPDIR/llmtrain-bench/; ``--out DIR``: there)
after EVERY step, so a run stopped from outside still leaves what it measured: the device,
driver / CUDA / torch versions, ``measured`` (true once a speed row ran on CUDA), each step's
``status`` (ok / error / skipped / running / pending), ``seconds`` and numbers, and a ``speed``
summary (per configuration ``tokens_per_s``, ``mfu``, ``peak_mem_gib``, ``planned_step_s``,
``planned_peak_gib``, ``vs_hf``). The steps and their tolerances: benchmarks/gpu_check_steps/.

How it stays inside the window (decisions):

- One worker process runs the steps in order (``--worker``): torch, CUDA and the 1-rank process
  group (``cpu:gloo,cuda:nccl``, so the CPU reference runs in the same group) start once, not
  once per step. This parent never touches CUDA; it watches the worker.
- Independent steps: an exception is recorded and the next step runs. A step that hangs past
  its cap (4x its estimate, at least 60 s), a worker that dies (segfault, CUDA context lost:
  the worker checks the device after each failing step and exits if it is broken) is recorded
  as that step's error, and a fresh worker continues with the next step.
- One wall-clock budget (``--budget-s``, default 480 s = 8 min, measured from this process's
  start): a step whose estimate exceeds what is left is skipped with that reason, and at the
  budget the worker is stopped and the step in flight recorded as stopped by the budget.
- torch 2.11 (the device image) runs the same code: steps test for features (``torch._grouped_mm``,
  torchao importable, sm89 for fp8), not versions, and record what is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]  # gpu_check_steps, and llmtrain from the source tree (no pip install)


def use_carry() -> str | None:
    """The device image has no pydantic: take .gpu_carry/site (benchmarks/gpu_carry.sh) when
    pydantic is missing and the folder was built for this python; the worker inherits it."""
    import importlib.util

    site, marker = ROOT / ".gpu_carry" / "site", ROOT / ".gpu_carry" / "python-version"
    if importlib.util.find_spec("pydantic") is not None or not site.is_dir():
        return None
    built = marker.read_text().strip() if marker.is_file() else "?"
    if built != f"{sys.version_info[0]}.{sys.version_info[1]}":
        return f"not used: built for python {built}, this is {sys.version_info[0]}.{sys.version_info[1]}"
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return str(site)


CARRY = use_carry()

from gpu_check_record import DEFAULT_OUT, publish, read_json, summarize, write_json

# torch's device name -> llmtrain/recipe/gpus.py key (first match wins: the specific names first)
NAME_TO_GPU = (("H200", "h200"), ("H100 PCIE", "h100-pcie"), ("H100", "h100-sxm"), ("A100-SXM4-40GB", "a100-40g"),
               ("A100", "a100-80g"), ("GB200", "gb200"), ("B200", "b200"))
GRACE_S = 10.0  # after the budget: a step gets this long to finish before the worker is killed


# ---- the worker ---------------------------------------------------------------------------------
def gpu_key_and_peak(device) -> tuple[str, float]:
    import torch

    from llmtrain.recipe.gpus import GPUS

    if device.type != "cuda":
        return "cpu", GPUS["cpu"].peak_flops_bf16
    name = torch.cuda.get_device_name(device).upper()
    for needle, key in NAME_TO_GPU:
        if needle in name:
            return key, GPUS[key].peak_flops_bf16
    return "h100-sxm", GPUS["h100-sxm"].peak_flops_bf16  # unknown CUDA GPU: plan and MFU as an H100


def init_group(device, scratch: Path) -> None:
    """The 1-rank default group through a FileStore in the scratch folder: no TCP port to collide
    with other jobs on the host (each worker its own file)."""
    import datetime

    import torch.distributed as dist

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    store = f"file://{scratch / f'pg-{os.getpid()}'}"
    timeout = datetime.timedelta(seconds=300)
    if device.type == "cuda":
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=store, rank=0, world_size=1, timeout=timeout,
                                device_id=device)
    else:
        dist.init_process_group("gloo", init_method=store, rank=0, world_size=1, timeout=timeout)


def device_broken(device) -> str | None:
    import torch

    if device.type != "cuda":
        return None
    try:
        torch.ones(8, device=device).sum().item()
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001 - any failure here means the context is gone
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def run_worker(args) -> int:
    import gc
    import traceback

    import torch
    from gpu_check_steps import CheckFailed, Ctx, Skip, load_all

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_group(device, Path(args.scratch))
    key, peak = gpu_key_and_peak(device)
    ctx = Ctx(device=device, tiny=args.tiny, scratch=Path(args.scratch), gpu_key=key, peak_flops=peak)
    by_name = {s.name: s for s in load_all()}
    out = Path(args.out)
    for name in args.steps.split(","):
        st = by_name[name]
        record = read_json(out)
        entry = record["steps"][name]
        left = args.deadline - time.time()
        if os.environ.get("LLMTRAIN_GPU_CHECK_CRASH") == name:  # tests/test_gpu_check.py: a worker that dies
            entry.update(status="running", started=time.time(), est_s=st.est_s)  # (before the CUDA test: any step)
            write_json(out, record)
            os._exit(9)
        if st.cuda_only and device.type != "cuda":
            entry.update(status="skipped", reason="needs CUDA", seconds=0.0)
        elif left <= 0 or (not args.tiny and left < st.est_s):
            entry.update(status="skipped", reason=f"budget: {max(left, 0):.0f} s left, the step needs ~{st.est_s:.0f} s",
                         seconds=0.0)
        else:
            entry.update(status="running", started=time.time(), est_s=st.est_s)
            write_json(out, record)
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                entry.update(status="ok", result=st.fn(ctx))
            except Skip as exc:
                entry.update(status="skipped", reason=str(exc))
            except CheckFailed as exc:
                entry.update(status="error", error=f"check failed: {exc}")
            except Exception as exc:  # noqa: BLE001 - one failing step must not hide the others
                entry.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:1500]}",
                             traceback=traceback.format_exc(limit=-4)[-3000:])
            entry["seconds"] = round(time.perf_counter() - t0, 3)
            entry["cpu_s"] = round(time.process_time() - c0, 3)  # this process's CPU time: a loaded host inflates seconds only
            entry.pop("started", None)
            if name == "env_nccl" and entry["status"] == "ok":
                res = entry["result"]
                record.update(device=res.get("device_name", "cpu"), driver=res.get("driver"),
                              versions=res["versions"], cuda=res["versions"].get("cuda"),
                              torch=res["versions"].get("torch"))
        summarize(record)
        write_json(out, record)
        line = entry.get("error") or entry.get("reason") or ""
        print(f"[gpu_check] {name}: {entry['status']} in {entry.get('seconds', 0):.1f} s {line[:300]}", flush=True)
        gc.collect()
        if device.type == "cuda":
            broken = device_broken(device) if entry["status"] == "error" else None
            if broken:
                print(f"[gpu_check] CUDA context broken after {name} ({broken}): a new worker continues", flush=True)
                os._exit(3)
            torch.cuda.empty_cache()
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


# ---- the parent ---------------------------------------------------------------------------------
def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


def new_record(args, names: list[str], device_type: str) -> dict:
    import platform

    return {"name": "gpu_check", "command": " ".join(["python", "benchmarks/gpu_check.py", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tiny": args.tiny, "budget_s": args.budget_s,
            "device_type": device_type, "device": None, "driver": None, "cuda": None, "torch": None,
            "python": platform.python_version(), "carry": CARRY, "versions": {}, "measured": False, "wall_s": None,
            "steps": {n: {"status": "pending"} for n in names}, "speed": []}


def supervise(args, names: list[str], out: Path, t_start: float) -> None:
    """Run workers until every step has a final status (see the module docstring)."""
    from gpu_check_steps import load_all

    est = {s.name: s.est_s for s in load_all()}
    deadline = t_start + args.budget_s
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        while True:
            record = read_json(out)
            pending = [n for n in names if record["steps"][n]["status"] == "pending"]
            if not pending:
                return
            if time.time() >= deadline:
                for n in pending:
                    record["steps"][n].update(status="skipped", reason="budget: none left", seconds=0.0)
                write_json(out, record)
                return
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--device", args.device_type,
                   "--out", str(out), "--deadline", str(deadline), "--steps", ",".join(pending), "--scratch", str(scratch)]
            if args.tiny:
                cmd.append("--tiny")
            log = scratch / f"worker-{len(os.listdir(scratch))}.log"
            with open(log, "w") as err:
                proc = subprocess.Popen(cmd, stderr=err, cwd=ROOT)
                why = watch(proc, out, deadline, est, args.tiny)
            tail = log.read_text(errors="replace")[-1500:]
            sys.stderr.write(log.read_text(errors="replace")[-6000:])
            record = read_json(out)
            for n, s in record["steps"].items():
                if s["status"] == "running":
                    s.update(status="error", seconds=round(time.time() - s.pop("started", time.time()), 3),
                             error=f"{why or f'worker exited with {proc.returncode}'}; stderr tail: {tail[-600:]}")
            summarize(record)
            write_json(out, record)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def watch(proc: subprocess.Popen, out: Path, deadline: float, est: dict, tiny: bool) -> str | None:
    """Wait for the worker; kill it at the budget or when a step runs past its cap."""
    while proc.poll() is None:
        time.sleep(0.5)
        now = time.time()
        try:
            running = [(n, s) for n, s in read_json(out)["steps"].items() if s["status"] == "running"]
        except (OSError, ValueError):
            running = []
        why = None
        if now > deadline + GRACE_S:
            why = "stopped: the wall-clock budget ran out during this step"
        elif running:
            name, s = running[0]
            cap = 120.0 if tiny else max(60.0, 4 * est.get(name, 60.0))
            if now - s.get("started", now) > cap:
                why = f"timeout: the step ran past its cap of {cap:.0f} s"
        if why:
            proc.kill()
            proc.wait()
            return why
    return None


def rerun_plan(record: dict, est: dict) -> dict:
    """What the budget left out (skipped by estimate, or stopped at the budget) and the second
    command that runs just those: its ``--budget-s`` is their estimates + a worker start + 30 s."""
    from gpu_check_steps import WORKER_START_S

    names = [n for n, s in record["steps"].items()
             if (s["status"] == "skipped" and str(s.get("reason", "")).startswith("budget"))
             or (s["status"] == "error" and str(s.get("error", "")).startswith("stopped: the wall-clock budget"))]
    need = sum(est.get(n, 60.0) for n in names)
    budget = int(-(-(need + WORKER_START_S + 30) // 10) * 10)
    cmd = (f"python3 benchmarks/gpu_check.py --steps {','.join(names)} --budget-s {budget} --out $OUT"
           if names else None)
    return {"steps": names, "est_s": round(need, 1), "budget_s": budget, "command": cmd}


def main() -> int:
    t_start = time.time()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--tiny", action="store_true", help="toy sizes (the CI smoke test)")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget of the whole check (default 480)")
    p.add_argument("--out", type=Path, default=None,
                   help="directory of gpu_check.json (default benchmarks/results; --tiny: $TMPDIR/llmtrain-bench)")
    p.add_argument("--steps", default=None, help="comma-separated subset of the steps (default all, in order)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--scratch", default=None, help=argparse.SUPPRESS)
    p.add_argument("--publish", type=Path, nargs="+", default=None, metavar="JSON",
                   help="write the gpu_check.json(s) brought back from the device (a first run, then its --steps "
                        "reruns: merged) to benchmarks/results and docs/benchmarks.md")
    args = p.parse_args()
    if args.publish:
        return publish(args.publish)
    if args.worker:
        return run_worker(args)
    from gpu_check_steps import load_all

    names = [s.name for s in load_all()]
    if args.steps:
        unknown = sorted(set(args.steps.split(",")) - set(names))
        if unknown:
            print(f"error: --steps: unknown step(s) {', '.join(unknown)}; the steps are: {', '.join(names)}", file=sys.stderr)
            return 2
        names = [n for n in names if n in args.steps.split(",")]
    if args.budget_s <= 0:
        print(f"error: --budget-s {args.budget_s}: use a positive number of seconds", file=sys.stderr)
        return 2
    has_cuda = cuda_available() if args.device != "cpu" else False  # no torch import in this process on CPU
    if args.device == "cuda" and not has_cuda:
        print("error: --device cuda: no CUDA device visible to torch here", file=sys.stderr)
        return 2
    args.device_type = "cuda" if args.device in ("auto", "cuda") and has_cuda else "cpu"
    out = args.out / "gpu_check.json" if args.out else (
        DEFAULT_OUT if not args.tiny else Path(os.environ.get("TMPDIR", "/tmp")) / "llmtrain-bench" / "gpu_check.json")
    if args.device_type == "cpu" and not args.tiny:
        record = new_record(args, names, "cpu")
        record["reason"] = "no CUDA device: nothing measured (run with --device cpu --tiny for the smoke test)"
        for n in names:
            record["steps"][n].update(status="skipped", reason="no CUDA device")
        if out == DEFAULT_OUT:  # benchmarks/results holds device runs only
            out = Path(os.environ.get("TMPDIR", "/tmp")) / "llmtrain-bench" / "gpu_check.json"
        write_json(out, record)
        print(f"{record['reason']}; wrote {out}")
        return 0
    write_json(out, new_record(args, names, args.device_type))
    supervise(args, names, out, t_start)
    record = read_json(out)
    record["wall_s"] = round(time.time() - t_start, 1)
    record["rerun"] = rerun_plan(record, {st.name: st.est_s for st in load_all()})
    write_json(out, record)
    counts = {k: sum(s["status"] == k for s in record["steps"].values()) for k in ("ok", "error", "skipped")}
    for row in record["speed"]:
        print("[gpu_check] speed " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in row.items()))
    print(f"[gpu_check] {counts['ok']} ok, {counts['error']} error, {counts['skipped']} skipped; "
          f"wall {record['wall_s']:.1f} s of a {args.budget_s:.0f} s budget; wrote {out}")
    if record["rerun"]["command"]:
        print(f"[gpu_check] left out by the budget (~{record['rerun']['est_s']:.0f} s): {record['rerun']['command']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
