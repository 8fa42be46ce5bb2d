"""``llmtrain launch`` on localhost: real torchrun, real processes, the torch-free fake engine.

The CLI runs in a subprocess (as a user runs it) with ``LLMTRAIN_ENGINE_MODULE=fake_engine``
and ``PYTHONPATH=tests/``, so torchrun starts ``tests/fake_engine.py`` as the ranks (no
``tests/__init__.py`` needed). The teardown checks scan ``/proc/*/environ`` for the run's
``LLMTRAIN_RUN_ID``: no process of the run may survive the launcher.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from llmtrain.launch.events import RunStats, format_event, parse_event
from llmtrain.launch.backends.local import ProcessTree, marked_pids
from llmtrain.launch.rundir import latest_run
from llmtrain.launch.stream import Display, LineSplitter, WorkerLogTailer, parse_failures, split_tee_prefix
from llmtrain.recipe.load import load_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "debug.yaml"
CLI = [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]
TWO_RANKS = ["--set", "cluster.gpus_per_node=2", "--set", "parallel.zero=0", "--set", "train.steps=12"]
GRACE_S = 5.0  # launch_local's default grace period


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_ENGINE_", "LLMTRAIN_"))}
    env.update(PYTHONPATH=str(REPO / "tests"), LLMTRAIN_ENGINE_MODULE="fake_engine", **extra)
    return env


def launch(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "launch", str(RECIPE), *TWO_RANKS, "--runs", str(tmp_path / "runs"), *args],
                          cwd=tmp_path, env=cli_env(**env), capture_output=True, text=True, timeout=120)


def run_processes(run_id: str) -> list[int]:
    """Every live process whose environment carries this run's id (independent of the launcher's code)."""
    needle, found = f"LLMTRAIN_RUN_ID={run_id}".encode(), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fp:
                if needle in fp.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


# ----------------------------------------------------------------------------- end to end


def test_launch_success_streams_prefixed_lines_and_fills_run_dir(tmp_path):
    result = launch(tmp_path)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    run = latest_run(tmp_path / "runs", "debug")
    assert run is not None and run.parent == tmp_path / "runs" / "debug"
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", run.name)
    lock = load_recipe(run / "recipe.lock.yaml")
    assert (lock.train.steps, lock.cluster.gpus_per_node, lock.model.layers) == (12, 2, 4)  # preset expanded
    assert (run / "hostfile").read_text() == "localhost slots=2\n"
    for rank in (0, 1):
        log = (run / "logs" / f"rank-{rank}.log").read_text()
        assert f"fake engine rank {rank}/2 starting, run id {run.name}" in log
        assert f"rank {rank} stderr hello" in log and f"rank {rank} done" in log
        assert f"[localhost:{rank}] fake engine rank {rank}/2 starting, run id {run.name}\n" in out
        assert f"[localhost:{rank}] rank {rank} done\n" in out
    assert '@@llmtrain {"event": "end"' in (run / "logs" / "rank-0.log").read_text()
    assert "@@llmtrain" not in out  # events drive the progress display, they are not echoed
    assert "progress: step 12/12" in out
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 12
    # whole lines only: every rank line is exactly one line the fake engine printed
    rank_lines = [ln for ln in out.splitlines() if ln.startswith("[localhost:")]
    pattern = re.compile(r"\[localhost:[01]\] (fake engine rank \d/2 starting, run id \S+|rank \d (stderr hello|done))")
    assert rank_lines and all(pattern.fullmatch(ln) for ln in rank_lines), rank_lines
    summary = out[out.index("== run finished: exit code 0"):]
    assert "steps 12/12, final loss" in summary and "tokens/s" in summary and f"run dir: {run}" in summary
    assert run_processes(run.name) == []


def test_failing_rank_fails_the_launch_and_is_named(tmp_path):
    result = launch(tmp_path, FAKE_ENGINE_FAIL_RANK="1", FAKE_ENGINE_STEP_S="0.3")
    out = result.stdout
    assert result.returncode not in (0, 2), out + result.stderr  # torchrun's code (1), not a usage error
    assert f"== run failed: exit code {result.returncode}" in out
    named = out[out.index("rank 1 failed (exit code 3)"):]
    assert "rank-1.log" in named.splitlines()[0]
    assert "| rank 1 fails on purpose at step 2" in named
    assert "error: FakeEngineError: rank 1 fails on purpose at step 2" in named  # from torchrun's error file
    assert "rank 0 was stopped by SIGTERM after the failure" in named or "rank 0" not in named
    run = latest_run(tmp_path / "runs")
    assert "rank 1 fails on purpose" in (run / "logs" / "rank-1.log").read_text()
    assert "ChildFailedError" in (run / "logs" / "launcher.log").read_text()
    assert run_processes(run.name) == []


def _start_and_wait_sleeping(tmp_path: Path, **env: str):
    proc = subprocess.Popen([*CLI, "launch", str(RECIPE), *TWO_RANKS, "--runs", str(tmp_path / "runs")],
                            cwd=tmp_path, env=cli_env(FAKE_ENGINE_SLEEP="60", **env), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    want = ["[localhost:0] rank 0 sleeping", "[localhost:1] rank 1 sleeping"]
    if env.get("FAKE_ENGINE_GRANDCHILD"):
        want += ["[localhost:0] rank 0 started grandchild", "[localhost:1] rank 1 started grandchild"]
    deadline = time.monotonic() + 90
    while not all(any(line.startswith(w) for line in lines) for w in want):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("ranks never reached their sleep:\n" + "".join(lines))
        time.sleep(0.05)
    run_id = next(m.group(1) for line in lines if (m := re.match(r"run dir \S+/(\S+): 2 ranks", line)))
    time.sleep(0.6)  # > 2 process-tree scans (every 0.25 s), so the grandchildren are on record
    return proc, reader, lines, run_id


@pytest.mark.parametrize("sig, code, stubborn", [(signal.SIGTERM, 143, True), (signal.SIGINT, 130, False)],
                         ids=["sigterm-stubborn-ranks-and-orphans", "sigint"])
def test_signal_tears_down_the_whole_process_tree(tmp_path, sig, code, stubborn):
    extra = {"FAKE_ENGINE_IGNORE_TERM": "1", "FAKE_ENGINE_GRANDCHILD": "1"} if stubborn else {}
    proc, reader, lines, run_id = _start_and_wait_sleeping(tmp_path, **extra)
    assert len(run_processes(run_id)) >= (5 if stubborn else 3)  # torchrun + 2 ranks (+ 2 grandchildren)
    t0 = time.monotonic()
    os.kill(proc.pid, sig)
    try:
        rc = proc.wait(timeout=GRACE_S + 15)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    elapsed = time.monotonic() - t0
    reader.join(5)
    out = "".join(lines)
    assert rc == code, out
    # bound: grace period, then SIGKILL and reaping; the margin absorbs a loaded 2-core CI machine
    assert elapsed < GRACE_S + 5, f"launcher took {elapsed:.1f} s to stop"
    assert f"{sig.name} received: stopping the run" in out
    assert f"== run stopped by {sig.name}: exit code {code}" in out
    if stubborn:
        assert "SIGKILL to" in out
    assert run_processes(run_id) == [], out


def test_invalid_recipe_exits_2_before_anything_starts(tmp_path):
    marker = tmp_path / "engine-ran"
    result = subprocess.run([*CLI, "launch", str(RECIPE), "--set", "parallel.tp=3", "--runs", str(tmp_path / "runs")],
                            cwd=tmp_path, env=cli_env(FAKE_ENGINE_MARKER=str(marker)), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = result.stderr.strip().splitlines()
    assert errors and all(line.startswith("error: ") for line in errors), result.stderr
    assert any("tp (3)" in line for line in errors)
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()
    assert not list(tmp_path.glob("engine-ran*"))


def test_hosts_goes_to_the_ssh_launcher(tmp_path):
    # multi-node launch is tested against real sshd hosts in test_launch_ssh.py; here: the flag is wired
    (tmp_path / "hosts").write_text("a slots=2\nb slots=2\n")
    result = subprocess.run([*CLI, "launch", str(RECIPE), "--hosts", str(tmp_path / "hosts"), "--dry-run", "--runs",
                             str(tmp_path / "runs")], cwd=tmp_path, env=cli_env(HOME=str(tmp_path)),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^# node 1: \S+@b:22, ranks 2-3$", result.stdout, re.M) and "--node-rank 1" in result.stdout
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- pieces


def test_process_tree_keeps_orphaned_grandchildren_in_new_sessions():
    code = ("import subprocess, sys, time\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True, stdout=subprocess.DEVNULL)\n"
            "print(c.pid, flush=True)\n"
            "sys.stdin.readline()\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    grandchild = int(parent.stdout.readline())
    try:
        tree = ProcessTree(parent.pid)
        tree.scan()
        assert {parent.pid, grandchild} <= set(tree.known)
        parent.communicate("\n", timeout=10)  # the parent exits: the grandchild is re-parented
        tree.scan()
        assert tree.alive() == {grandchild}
    finally:
        os.kill(grandchild, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while grandchild in tree.alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert grandchild not in tree.alive()


def test_marked_pids_matches_the_exact_launch_id():
    env = dict(os.environ, LLMTRAIN_LAUNCH_ID="0123456789abcdef", LLMTRAIN_RUN_ID="run")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        time.sleep(0.2)
        assert child.pid in marked_pids("0123456789abcdef")
        assert child.pid not in marked_pids("0123456789abcde") and child.pid not in marked_pids("run")
    finally:
        child.kill()
        child.wait()


def test_same_named_runs_side_by_side_do_not_stop_each_other(tmp_path):
    """Two launches of run directories with the same name (a copied run, as the suite's
    ``clone_run`` makes them; or two resumes) at the same time: the first to finish sweeps its
    own processes only. Before launches had their own id, the sweep went by run id and SIGTERMed
    the other launch's torchrun (exit 143 after it had trained and saved)."""
    runs = []
    for side in ("a", "b"):
        (tmp_path / side).mkdir()
        result = launch(tmp_path / side)
        assert result.returncode == 0, result.stdout + result.stderr
        src = latest_run(tmp_path / side / "runs", "debug")
        runs.append(src.rename(src.parent / "run"))  # both run ids are now "run"
    code = ("import sys; from llmtrain.launch.backends.local import relaunch_local; from llmtrain.recipe.load import load_recipe; "
            "sys.exit(relaunch_local(sys.argv[1], load_recipe(sys.argv[1] + '/recipe.lock.yaml')))")
    slow = subprocess.Popen([sys.executable, "-c", code, str(runs[1])], cwd=tmp_path, text=True,
                            env=cli_env(FAKE_ENGINE_SLEEP="1.2"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline, log = time.monotonic() + 120, runs[1] / "logs" / "rank-1.log"
        while time.monotonic() < deadline:  # both slow ranks are past step 1: ~13 s of sleeping steps left
            if log.exists() and "sleeping" in log.read_text(errors="replace"):
                break
            time.sleep(0.1)
        fast = subprocess.run([sys.executable, "-c", code, str(runs[0])], cwd=tmp_path, env=cli_env(),
                              capture_output=True, text=True, timeout=120)
        assert fast.returncode == 0, fast.stdout + fast.stderr
        assert slow.poll() is None, "the slow run ended while the fast one finished"
        out, _ = slow.communicate(timeout=120)
    finally:
        if slow.poll() is None:
            slow.kill()
    assert slow.returncode == 0, out[-3000:]
    assert "run finished: exit code 0" in out


def test_line_splitter_keeps_partial_lines_until_complete():
    s = LineSplitter(max_line=8)
    assert s.feed(b"ab") == []
    assert s.feed(b"c\r\nde") == ["abc"]
    assert s.feed(b"f\n\n") == ["def", ""]
    assert s.feed("ü".encode()[:1]) == [] and s.feed("ü".encode()[1:] + b"\n") == ["ü"]
    assert s.feed(b"0123456789") == ["01234567"]  # an endless line is cut, not held forever
    assert s.flush() == ["89"] and s.flush() == []


def test_worker_log_tailer_reads_whole_lines_with_ranks(tmp_path):
    d0 = tmp_path / "rdzv_x" / "attempt_0" / "0"
    d1 = tmp_path / "rdzv_x" / "attempt_0" / "1"
    d0.mkdir(parents=True)
    d1.mkdir(parents=True)
    tailer = WorkerLogTailer(tmp_path, nproc_per_node=2, node_rank=1)
    (d0 / "stdout.log").write_text("hello wor")
    (d1 / "stderr.log").write_text("boom\npart")
    assert tailer.poll() == [(3, "stderr", "boom")]
    with open(d0 / "stdout.log", "a") as fp:
        fp.write("ld\nnext")
    assert tailer.poll() == [(2, "stdout", "hello world")]
    assert sorted(tailer.poll(final=True)) == [(2, "stdout", "next"), (3, "stderr", "part")]


def test_events_parse_and_junk_is_an_ordinary_line():
    line = format_event("step", step=3, steps=10, loss=2.5, lr=1e-3, tokens_per_s=100.0)
    assert parse_event(line) == {"event": "step", "step": 3, "steps": 10, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 100.0}
    for junk in ["@@llmtrain {bad json", "@@llmtrain [1, 2]", '@@llmtrain {"step": 1}', '@@llmtrain {"event": 1}',
                 '@@llmtrain', 'x @@llmtrain {"event": "step"}', "@@llmtrain " + "[" * 100000]:
        assert parse_event(junk) is None
    stats = RunStats()
    for event in [{"event": "start", "steps": 10, "world_size": 2}, {"event": "step", "step": 4, "loss": "nan?"},
                  {"event": "step", "step": 5, "loss": 2.0, "tokens_per_s": 10.0},
                  {"event": "end", "step": 10, "final_loss": 1.5}]:
        stats.update(event)
    assert (stats.steps, stats.world_size, stats.step, stats.loss, stats.final_loss, stats.ended) == (10, 2, 10, 2.0, 1.5, True)
    assert stats.tokens_per_s == 10.0


def test_tee_prefix_and_torchrun_failure_report_parsing():
    assert split_tee_prefix("[default12]:hello [x]") == (12, "hello [x]")
    assert split_tee_prefix("plain [default0]: text") == (None, "plain [default0]: text")
    report = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
fake_engine FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-29_08:16:40
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 4499)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_08:16:40
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 3 (pid: 4500)
  error_file: /tmp/e.json
  traceback : Traceback (most recent call last):
    rank      : 7 (local_rank: 7)
============================================================"""
    failures = parse_failures(report.splitlines())
    assert [(f.rank, f.exitcode, f.error_file) for f in failures] == [(1, "3", "/tmp/e.json"), (0, "-15", None)]
    assert parse_failures(["nothing to see"]) == []


def test_display_without_terminal_prints_plain_progress_lines():
    buf = io.StringIO()
    display = Display(Console(file=buf, force_terminal=False, width=200), label="t")
    display.start()
    stats = RunStats()
    stats.update({"event": "start", "steps": 40, "world_size": 2})
    for step in range(1, 41):
        stats.update({"event": "step", "step": step, "steps": 40, "loss": 1.0 / step, "tokens_per_s": 1000.0})
        display.progress(stats)
    display.line("[localhost:0] a [bold]markup-looking[/bold] line")
    display.stop()
    lines = buf.getvalue().splitlines()
    progress = [ln for ln in lines if ln.startswith("progress:")]
    assert progress[0].startswith("progress: step 1/40  loss 1.0000") and progress[-1].startswith("progress: step 40/40")
    assert len(progress) == 21  # the first step, then every 5 % of the steps, not every step
    assert lines[-1] == "[localhost:0] a [bold]markup-looking[/bold] line"


def test_api_validates_recipe_objects_and_builds_torchrun_command(tmp_path, monkeypatch):
    from llmtrain.errors import LLMTrainError
    from llmtrain.launch.backends.local import launch_env, launch_local, resolve_recipe, torchrun_command
    from llmtrain.launch.rundir import RunDir

    recipe = load_recipe(RECIPE)
    with pytest.raises(LLMTrainError) as info:
        launch_local(recipe, ["parallel.tp=3"], runs_root=tmp_path / "runs")
    assert any(p.path == "train.seq_len" and "tp (3)" in p.message for p in info.value.problems)
    assert not (tmp_path / "runs").exists()
    assert resolve_recipe(recipe, ["train.steps=7"]).train.steps == 7
    monkeypatch.setenv("LLMTRAIN_ENGINE_MODULE", "not a module; rm -rf /")
    with pytest.raises(LLMTrainError, match="is not a Python module name"):
        launch_local(recipe, runs_root=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()

    run = RunDir(tmp_path / "r", "debug", "20260101-000000-abcd")
    cmd = torchrun_command(run, 4, "llmtrain.engine.main")
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "--redirects", "3",
                       "--log-dir", str(tmp_path / "r" / "logs" / "torchrun"), "-m", "llmtrain.engine.main",
                       "--recipe", str(tmp_path / "r" / "recipe.lock.yaml"), "--run-dir", str(tmp_path / "r")]
    env = launch_env(run, 4, base={"OMP_NUM_THREADS": "3", "PATH": "/bin"})
    assert env["OMP_NUM_THREADS"] == "3" and env["PYTHONUNBUFFERED"] == "1" and env["PATH"] == "/bin"
    assert env["LLMTRAIN_RUN_ID"] == "20260101-000000-abcd" and env["LLMTRAIN_RUN_DIR"] == str(tmp_path / "r")
    assert int(launch_env(run, 10**6, base={})["OMP_NUM_THREADS"]) == 1


def test_launch_and_report_layers_never_import_torch():
    code = ("import sys, llmtrain.launch.backends.local, llmtrain.launch.rundir, llmtrain.cli.launch, llmtrain.cli.report, "
            "llmtrain.analysis.report; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
