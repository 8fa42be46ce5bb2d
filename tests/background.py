"""A launcher CLI started in the background with its output lines collected as they come (the
SSH and Slurm launch tests watch for lines, then kill a rank or signal the launcher)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

CLI = [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]


class Background:
    def __init__(self, env: dict[str, str], cwd: Path, *args: str):
        self.proc = subprocess.Popen([*CLI, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def wait_for(self, *wanted: str, timeout: float = 90) -> None:
        """Until every ``wanted`` text has appeared in some line; the test fails (launcher killed)
        if the launcher exits or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while not all(any(w in line for line in self.lines) for w in wanted):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"never saw {wanted}:\n" + "".join(self.lines))
            time.sleep(0.05)

    @property
    def run_id(self) -> str:
        return next(m.group(1) for line in self.lines if (m := re.match(r"run dir \S+/(\S+): \d+ ranks", line)))

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
