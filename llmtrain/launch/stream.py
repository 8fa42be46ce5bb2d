"""Whole-line streaming of a run's output: torchrun's pipes, the workers' log files, the screen.

Where lines come from (local launch):

* **Workers** (the engine ranks) write to files: torchrun runs with ``--redirects 3 --log-dir
  RUN_DIR/logs/torchrun``, so each worker's stdout and stderr go straight into
  ``logs/torchrun/<rdzv id>/attempt_<k>/<local rank>/{stdout,stderr}.log``.
  :class:`WorkerLogTailer` follows those files and hands out *whole lines only*: bytes after
  the last newline wait until the line is complete (or the run is over), so a line is never
  split or mixed with another rank's, however the worker writes it.

  Why not ``--tee 3`` (torchrun prefixes ``[default0]:`` and prints every worker's lines on
  its own stdout)? Measured with torch 2.13: torchrun's tailer reads each file with
  ``readline()`` and prints whatever it got, so a partial line becomes
  ``[default0]:partial[default1]:other rank's line`` on the console. With
  ``PYTHONUNBUFFERED=1`` ``print()`` and tracebacks reach the file in several writes, so
  partial lines are routine. Tailing the files ourselves keeps whole lines, keeps the rank
  from the file's path, and still shows them within ~0.1 s. (:func:`split_tee_prefix` parses
  the ``[defaultN]:`` form for runners that only have torchrun's stdout, e.g. over SSH.)
* **torchrun itself** (rendezvous messages, the failure report) writes to its stdout/stderr
  pipes; :class:`PipeReader` reads both with a selector and splits them into whole lines.

Where lines go (:class:`LineRouter`): each rank's lines are appended to
``logs/rank-<R>.log`` and shown as ``[localhost:R] text``; torchrun's lines go to
``logs/launcher.log`` and are shown as ``[localhost] text``. Progress events (``@@llmtrain
{json}`` on rank 0's stdout, :mod:`llmtrain.launch.events`) are logged but not shown as text:
they drive the one progress bar of :class:`Display` instead.

After Ctrl-C (:meth:`Display.mute`, called by the launchers on SIGINT) the streamed lines
still go to every log file, but no longer to the screen: torchrun and its workers answer a
stop with pages of ``KeyboardInterrupt`` / ``SignalException`` tracebacks, and a user who
pressed Ctrl-C wants the prompt back with one line saying what was stopped
(:func:`interrupted_line`). The launcher's own messages (``Display.line``) are still shown.
"""

from __future__ import annotations

import os
import re
import selectors
import time
from collections import deque
from pathlib import Path
from typing import IO, Iterable

from rich.console import Console
from rich.text import Text

from llmtrain.launch.events import RunStats, parse_event

MAX_LINE_BYTES = 1 << 20  # a "line" longer than this is emitted in pieces rather than held forever
TAIL_LINES = 20
WORKER_FILE_RE = re.compile(r"attempt_(\d+)/(\d+)/(stdout|stderr)\.log$")
TEE_PREFIX_RE = re.compile(r"^\[(?P<role>[A-Za-z_][\w.-]*?)(?P<rank>\d+)\]:")


class LineSplitter:
    """Bytes in, whole decoded lines out (without the trailing newline or ``\\r``)."""

    def __init__(self, max_line: int = MAX_LINE_BYTES):
        self._buf = bytearray()
        self._max = max_line

    def feed(self, data: bytes) -> list[str]:
        self._buf += data
        *whole, rest = self._buf.split(b"\n")
        self._buf = bytearray(rest)
        lines = [_decode(line) for line in whole]
        while len(self._buf) > self._max:
            lines.append(_decode(self._buf[: self._max]))
            del self._buf[: self._max]
        return lines

    def flush(self) -> list[str]:
        """The unterminated rest as a last line (at end of stream)."""
        rest, self._buf = bytes(self._buf), bytearray()
        return [_decode(rest)] if rest else []


def _decode(raw: bytes | bytearray) -> str:
    return bytes(raw).decode("utf-8", errors="replace").rstrip("\r")


def split_tee_prefix(line: str) -> tuple[int | None, str]:
    """``"[default3]:text"`` -> ``(3, "text")``; a line without torchrun's tee prefix -> ``(None, line)``."""
    match = TEE_PREFIX_RE.match(line)
    if not match:
        return None, line
    return int(match.group("rank")), line[match.end():]


class PipeReader:
    """Reads several pipes (name -> binary file) without blocking and yields whole lines."""

    def __init__(self, pipes: dict[str, IO[bytes]]):
        self._sel = selectors.DefaultSelector()
        self._splitters: dict[str, LineSplitter] = {}
        for name, pipe in pipes.items():
            if pipe is None:
                continue
            os.set_blocking(pipe.fileno(), False)
            self._sel.register(pipe, selectors.EVENT_READ, name)
            self._splitters[name] = LineSplitter()

    @property
    def open(self) -> bool:
        return bool(self._sel.get_map())

    def poll(self, timeout: float) -> list[tuple[str, str]]:
        """Wait up to ``timeout`` s for data; return ``(pipe name, line)`` pairs read so far."""
        if not self.open:
            time.sleep(timeout)
            return []
        out: list[tuple[str, str]] = []
        for key, _ in self._sel.select(timeout):
            name = key.data
            try:
                data = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                out += [(name, line) for line in self._splitters[name].feed(data)]
            else:  # EOF
                self._sel.unregister(key.fileobj)
                out += [(name, line) for line in self._splitters[name].flush()]
        return out

    def close(self) -> list[tuple[str, str]]:
        out = []
        for key in list(self._sel.get_map().values()):
            self._sel.unregister(key.fileobj)
        for name, splitter in self._splitters.items():
            out += [(name, line) for line in splitter.flush()]
        self._sel.close()
        return out


class FileTail:
    """Whole new lines of a file another process (or machine, on shared storage) appends to."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.splitter = LineSplitter()

    def read(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as fp:
                fp.seek(self.offset)
                data = fp.read()
        except OSError:
            data = b""
        self.offset += len(data)
        lines = self.splitter.feed(data) if data else []
        return lines + (self.splitter.flush() if final else [])


class WorkerLogTailer:
    """Follows torchrun's per-worker ``stdout.log``/``stderr.log`` files under ``--log-dir``.

    Global rank = ``node_rank * nproc_per_node + local rank`` (the directory name). Files of
    later attempts (``--max-restarts``) are followed too, under the same rank.
    """

    def __init__(self, log_dir: Path, nproc_per_node: int, node_rank: int = 0, rescan_s: float = 1.0):
        self.log_dir = Path(log_dir)
        self.nproc = nproc_per_node
        self.node_rank = node_rank
        self.rescan_s = rescan_s
        self._tails: dict[Path, tuple[int, str, FileTail]] = {}
        self._last_scan = 0.0

    def _scan(self) -> None:
        self._last_scan = time.monotonic()
        for path in sorted(self.log_dir.glob("*/attempt_*/*/std*.log")):
            match = WORKER_FILE_RE.search(path.as_posix())
            if match and path not in self._tails:
                rank = self.node_rank * self.nproc + int(match.group(2))
                self._tails[path] = (rank, match.group(3), FileTail(path))

    def poll(self, final: bool = False) -> list[tuple[int, str, str]]:
        """New whole lines as ``(rank, "stdout"|"stderr", line)``; ``final`` also flushes partial lines."""
        if final or len(self._tails) < 2 * self.nproc or time.monotonic() - self._last_scan > self.rescan_s:
            self._scan()
        out = []
        for rank, stream, tail in self._tails.values():
            out += [(rank, stream, line) for line in tail.read(final)]
        return out


class Display:
    """The launching terminal: ordinary lines scroll above ONE progress bar fed by step events.

    On a terminal, a rich ``Progress`` shows step/steps, ETA, loss and tokens/s. When the
    console is not a terminal (CI logs, a pipe), there is no live bar: a plain ``progress:``
    line is printed every ~5 % of the steps (and at least every 10 s), so logs stay readable.
    """

    def __init__(self, console: Console | None = None, label: str = "train"):
        self.console = console or Console(highlight=False, soft_wrap=True)
        self.live = self.console.is_terminal
        self.label = label
        self._progress = None
        self._task = None
        self._t0: float | None = None
        self._last_print = 0.0
        self._last_step = -1
        self.muted = False  # after Ctrl-C: streamed lines go to the logs only
        self.hidden = 0  # streamed lines not shown since mute()

    def start(self) -> None:
        if not self.live:
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                  TextColumn("{task.fields[info]}"), console=self.console)
        self._task = self._progress.add_task(self.label, total=None, info="waiting for the engine")
        self._progress.start()

    def line(self, text: str) -> None:
        target = self._progress.console if self._progress is not None else self.console
        # from_ansi: a worker's colored log line keeps its colors on a terminal and loses the
        # escape codes elsewhere, instead of printing them raw into a CI log
        target.print(Text.from_ansi(text), highlight=False, soft_wrap=True, markup=False, emoji=False)

    def stream_line(self, text: str) -> None:
        """A line of the run's output (a rank's, torchrun's, a node helper's): shown unless muted."""
        if self.muted:
            self.hidden += 1
            return
        self.line(text)

    def mute(self) -> None:
        """From now on streamed lines and progress are not shown (they are still logged)."""
        self.muted = True
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def progress(self, stats: RunStats) -> None:
        if self.muted:
            return
        if self._t0 is None and stats.step > 0:
            self._t0 = time.monotonic()
        info = _progress_info(stats)
        if self._progress is not None:
            self._progress.update(self._task, completed=stats.step, total=stats.steps, info=info)
            return
        now = time.monotonic()
        every = max(1, (stats.steps or 20) // 20)
        due = stats.step != self._last_step and (stats.step % every == 0 or stats.step == stats.steps
                                                  or now - self._last_print > 10)
        if due and stats.step > 0:
            self._last_print, self._last_step = now, stats.step
            total = f"/{stats.steps}" if stats.steps else ""
            self.line(f"progress: step {stats.step}{total}  {info}".rstrip())

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _progress_info(stats: RunStats) -> str:
    parts = []
    if stats.loss is not None:
        parts.append(f"loss {stats.loss:.4f}")
    if stats.lr is not None:
        parts.append(f"lr {stats.lr:.2e}")
    if stats.tokens_per_s is not None:
        parts.append(f"{stats.tokens_per_s:,.0f} tok/s")
    return "  ".join(parts)


class LineRouter:
    """Sends every line to its log file and to the display; feeds rank 0's events to the stats."""

    def __init__(self, logs: Path, display: Display, stats: RunStats, host: str = "localhost",
                 launcher_log: str = "launcher.log"):
        self.logs = Path(logs)
        self.display = display
        self.stats = stats
        self.host = host
        self.launcher_log = launcher_log  # the SSH launcher has one router per node: node-<i>.log
        self._files: dict[str, IO[str]] = {}
        self.rank_tails: dict[int, deque[str]] = {}
        self.launcher_lines: deque[str] = deque(maxlen=2000)

    def create_logs(self, ranks: int | Iterable[int]) -> None:
        """Create the launcher log and every ``rank-R.log`` up front, so the layout does not depend on who printed."""
        ranks = range(ranks) if isinstance(ranks, int) else ranks
        for name in [self.launcher_log] + [f"rank-{rank}.log" for rank in ranks]:
            self._file(name)

    def _file(self, name: str) -> IO[str]:
        fp = self._files.get(name)
        if fp is None:
            fp = self._files[name] = open(self.logs / name, "a", encoding="utf-8", errors="replace")
        return fp

    def rank_line(self, rank: int, stream: str, text: str) -> None:
        self._file(f"rank-{rank}.log").write(text + "\n")
        event = parse_event(text) if rank == 0 and stream == "stdout" else None
        if event is not None:
            self.stats.update(event)
            self.display.progress(self.stats)
            return
        self.rank_tails.setdefault(rank, deque(maxlen=TAIL_LINES)).append(text)
        self.display.stream_line(f"[{self.host}:{rank}] {text}")

    def launcher_line(self, text: str) -> None:
        self._file(self.launcher_log).write(text + "\n")
        self.launcher_lines.append(text)
        self.display.stream_line(f"[{self.host}] {text}")

    def flush(self) -> None:
        for fp in self._files.values():
            fp.flush()

    def close(self) -> None:
        for fp in self._files.values():
            fp.close()
        self._files.clear()


# the run's summary (torchrun's failure report, the Ctrl-C line) lives in its own module; re-exported
from llmtrain.launch.summary import (Failure, error_file_message, failure_lines, interrupted_line,  # noqa: E402,F401
                                     parse_failures, signal_name, stats_summary)
