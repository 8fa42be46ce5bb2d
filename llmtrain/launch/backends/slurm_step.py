"""One srun step inside an allocation, watched: :class:`StepRun` (see :mod:`llmtrain.launch.backends.slurm_alloc`).

With ``--max-restarts K`` the watched process is the retry loop (``bash RUN/slurm/steps.sh``,
:mod:`llmtrain.launch.backends.slurm_retry`) running one srun step per attempt; a failed rank cancels
the step only (the loop restarts it), Ctrl-C/SIGTERM stops the loop first, then the step.

It streams exactly as the batch path's :class:`~llmtrain.launch.backends.slurm_watch.SlurmRun` (the same node
files in the run directory, the same routers and early stop on the first failed rank); only
the end (srun's exit, not squeue) and the stop (the step, never the user's allocation) differ.
"""

from __future__ import annotations

import signal
import subprocess
import time

from llmtrain.launch.backends import slurmctl
from llmtrain.launch.backends.slurm_watch import SlurmRun
from llmtrain.launch.backends.slurm_alloc import Allocation, step_id


class StepRun(SlurmRun):
    """One srun step of an allocation: streamed as a batch job is; its end is srun's exit."""

    job_log = "srun.out"

    def __init__(self, run, plan, alloc: Allocation, proc: subprocess.Popen, hosts: list[str], console, environ,
                 heartbeat_timeout_s: float = 0):
        super().__init__(run, plan, alloc.job_id, console, environ, heartbeat_timeout_s)
        self.alloc, self.proc, self.step_name = alloc, proc, f"llmtrain-{run.run_id}"
        self.hosts = hosts
        for router, host in zip(self.routers, hosts):
            router.host = host

    def _watch(self) -> int:
        self.display.start()
        while self.proc.poll() is None:
            if self.signals:
                return self._cancel(self.signals[0])
            self._pump()
            self._check_heartbeats()
            if self.failed and not self.stopped_for_failure:
                self._stop_for_failure()
            time.sleep(0.1)
        time.sleep(0.2)  # the nodes' last writes (shared storage) before the final read
        self._pump(final=True)
        self._failure_after_end()
        rc = self.proc.returncode
        code = 128 - rc if rc < 0 else rc
        if code and (self.failed or self.stopped_for_failure or (self.step_loop and code >= 128)):
            code = self._failure_code(code)  # srun's 143: kill-on-bad-exit's SIGTERM hid the failing task's code
        deadline = time.monotonic() + 10
        while self._live() and time.monotonic() < deadline:
            time.sleep(0.1)  # the step's processes are gone once squeue -s no longer lists it
        self._summary(code, "step ended" if code else "step completed")
        return code

    def _what(self) -> str:
        return f"srun step {self.step_name} of job {self.job_id}"

    def _stop_words(self) -> str:
        return f"stopping the {self._what()}"

    def _live(self) -> bool:
        return self.proc.poll() is None or step_id(self.alloc, self.step_name, self.environ) is not None

    def _stop_now(self) -> str:
        if self.step_loop and self.proc.poll() is None:  # the retry loop (bash) first: it must start no next step
            try:
                self.proc.terminate()
                self.proc.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        step = step_id(self.alloc, self.step_name, self.environ)
        problem = slurmctl.cancel(step, self.environ) if step else "not listed by squeue -s"
        if problem and self.proc.poll() is None:  # srun's own abort: two SIGINTs within one second
            for _ in range(2):
                try:
                    self.proc.send_signal(signal.SIGINT)
                except ProcessLookupError:
                    break
                time.sleep(0.3)
            return f"scancel of the step failed ({problem}): sent srun two SIGINTs"
        return ""



__all__ = ["StepRun"]
