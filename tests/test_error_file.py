"""The worker's torchelastic error file (llmtrain/engine/error_file.py): whole or absent, never half
written, so torchrun's agent can always read it. Pure and fast: the handler and torch's own reader
(``ProcessFailure``), with a write interrupted the way a SIGTERM mid-write interrupts it."""

from __future__ import annotations

import json

import pytest
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, ProcessFailure, record

import llmtrain.engine.error_file as error_file
from llmtrain.engine.error_file import AtomicErrorHandler


def _fail():
    raise RuntimeError("boom")


def test_the_error_file_is_torchs_json_and_torchrun_reads_it(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    with pytest.raises(RuntimeError):
        record(_fail, error_handler=AtomicErrorHandler())()
    data = json.loads(path.read_text())
    assert data["message"]["message"] == "RuntimeError: boom"
    assert "_fail" in data["message"]["extraInfo"]["py_callstack"]
    assert ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path)).message["message"] == "RuntimeError: boom"
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]  # no temporary file left


class _Killed(BaseException):
    """Stands for the SIGTERM that ends the worker in the middle of the write."""


def _half_dump(data, fp):
    fp.write(json.dumps(data)[:10])
    raise _Killed


@pytest.mark.parametrize("handler", [ErrorHandler, AtomicErrorHandler])
def test_a_write_cut_short_leaves_no_file_torchrun_cannot_read(tmp_path, monkeypatch, handler):
    """torch's handler truncates the file, then dies: torchrun's reader raises (the agent exits 1 and
    --max-restarts never restarts the group). The atomic handler leaves no file: torchrun reports
    the exit code instead."""
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setattr(json, "dump", _half_dump)  # the module both handlers call
    with pytest.raises(_Killed):
        handler().record_exception(RuntimeError("boom"))
    monkeypatch.undo()
    if handler is ErrorHandler:
        with pytest.raises(json.JSONDecodeError):
            ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(path))
    else:
        assert not path.exists()
        failure = ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(path))
        assert "Signal 15" in failure.message
        assert error_file.json is json
