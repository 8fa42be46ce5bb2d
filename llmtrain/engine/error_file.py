"""The worker's torchelastic error file, written atomically.

torch's ``@record`` (``torch.distributed.elastic.multiprocessing.errors``) catches the exception that
ends a worker and writes ``$TORCHELASTIC_ERROR_FILE`` with ``open(file, "w")`` then ``json.dump``; the
launcher's failure summary quotes it (llmtrain/launch/summary.py). That write is not atomic, and
torchrun reads the file of every failed worker while it tears the group down: when one rank dies
(SIGKILL, OOM), a peer blocked in a collective raises at once, ``@record`` starts writing, and the
agent's SIGTERM to the group can end that peer between the truncation and the write. torchrun then
finds an empty file, and ``ProcessFailure`` (torch 2.13, ``multiprocessing/api.py``) re-raises the
``JSONDecodeError``: the agent itself exits 1, so ``--max-restarts`` never restarts the group
(seen once in CI: tests/test_checkpoint_resume.py ``test_max_restarts_resumes_on_its_own``).

:class:`AtomicErrorHandler` writes the same JSON to a temporary file beside it and renames it into
place (``os.replace``), so the agent sees either no file (it then reports the exit code or signal)
or a whole one. Everything else is torch's handler.
"""

from __future__ import annotations

import json
import os
import time
import traceback

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler


class AtomicErrorHandler(ErrorHandler):
    """torch's ``ErrorHandler`` with :meth:`record_exception` writing through a rename (module docstring)."""

    def record_exception(self, e: BaseException) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        data = {"message": {"message": f"{type(e).__name__}: {e}",
                            "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}}}
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fp:
            json.dump(data, fp)
        os.replace(tmp, path)
