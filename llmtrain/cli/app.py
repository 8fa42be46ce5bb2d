"""The ``llmtrain`` typer app. Project errors print one line per problem and exit 2; Ctrl-C
outside a launcher's own teardown prints ``interrupted`` and exits 130.

``LLMTRAIN_DEBUG=1`` re-raises instead, to show the traceback. Commands register themselves
from one module per command group; heavy imports happen inside the commands so that
``llmtrain plan`` stays fast and never imports torch.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable

import typer

from llmtrain.errors import EXIT_USER_ERROR, LLMTrainError

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan, launch and run 5D-parallel LLM training from one YAML recipe.")


def report_errors(fn: Callable) -> Callable:
    """Turn :class:`LLMTrainError` into one stderr line per problem and exit code 2, and a
    ``KeyboardInterrupt`` into ``interrupted`` and exit code 130 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LLMTrainError as exc:
            if os.environ.get("LLMTRAIN_DEBUG") == "1":
                raise
            for line in exc.lines():  # control characters escaped; the first 50, then a count
                print(f"error: {line}", file=sys.stderr)
            raise typer.Exit(EXIT_USER_ERROR) from None
        except KeyboardInterrupt:  # Ctrl-C outside a launcher's own handling (loading, preflight): one line
            if os.environ.get("LLMTRAIN_DEBUG") == "1":
                raise
            print("interrupted", file=sys.stderr)
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper


@app.callback()
def _group() -> None:
    """Always a group of commands, even when ``main`` registers only ``plan``."""


def main() -> None:
    from llmtrain.cli import plan as _plan  # noqa: F401  (registers commands)

    if sys.argv[1:2] == ["plan"]:  # the planner answers cold in < 0.5 s: skip the other commands' imports (~25 ms)
        app()
        return
    from llmtrain.cli import launch as _launch  # noqa: F401
    from llmtrain.cli import report as _report  # noqa: F401
    from llmtrain.cli import data as _data  # noqa: F401
    from llmtrain.cli import hosts as _hosts  # noqa: F401
    from llmtrain.cli import resume as _resume  # noqa: F401
    from llmtrain.cli import ckpt as _ckpt  # noqa: F401
    from llmtrain.cli import eval as _eval  # noqa: F401

    app()


if __name__ == "__main__":
    # Under `python -m llmtrain.cli.app` this file runs as __main__, a second copy of the module,
    # while the command modules register on `llmtrain.cli.app.app`: run that module's main.
    from llmtrain.cli.app import main as _main

    _main()
