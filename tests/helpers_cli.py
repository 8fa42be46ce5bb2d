"""The CLI in this process (launch stubbed out, or as is) and its error lines (shared by tests)."""

from __future__ import annotations

from unittest import mock


def invoke_stubbed(args: list[str], target: str) -> tuple[int, str, list]:
    """``llmtrain ARGS`` in this process with ``target`` (e.g. ``llmtrain.launch.backends.local.launch_local``)
    replaced by a stub that records its call ``(args, kwargs)`` and returns 0.
    Returns ``(exit code, output, calls)``; an unexpected exception is re-raised."""
    from typer.testing import CliRunner

    from llmtrain.cli import ckpt as _ckpt  # noqa: F401  (registers the commands)
    from llmtrain.cli import launch as _launch  # noqa: F401
    from llmtrain.cli import resume as _resume  # noqa: F401
    from llmtrain.cli.app import app

    calls: list = []
    with mock.patch(target, lambda *a, **k: calls.append((a, k)) or 0):
        result = CliRunner().invoke(app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output, calls


def errors_of(output: str) -> list[str]:
    """The ``error:`` lines of ``output`` (which must hold no traceback)."""
    if "Traceback" in output:
        raise AssertionError(output[-3000:])
    return [line for line in output.splitlines() if line.startswith("error:")]


def cli_in_process(args: list[str]) -> tuple[int, str, str]:
    """``llmtrain ARGS`` in this process, nothing stubbed (the eval tests, whose jobs need the torch
    already imported here): (exit code, stdout, stderr); an unexpected exception is re-raised."""
    from typer.testing import CliRunner

    from llmtrain.cli import app as app_module
    from llmtrain.cli import ckpt, data  # noqa: F401  (register their commands)
    from llmtrain.cli import eval as _eval  # noqa: F401

    result = CliRunner().invoke(app_module.app, args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr
