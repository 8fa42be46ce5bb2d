"""Whole-job retries of an SSH launch after a node is lost (``launch --hosts --max-restarts K``).

torchrun's ``--max-restarts`` restarts the workers of a node whose rank failed; it cannot help
when the node itself is gone (the SSH session dropped, or its heartbeat stopped: exit 255). Then
:func:`llmtrain.launch.backends.sshlaunch.launch_ssh` retries the whole job, up to the same K times:

* every node of the failed attempt was already stopped by the run's teardown;
* with ``launch.exclude_lost_hosts: true`` the lost host is dropped from the hostfile and the
  recipe is **re-validated** for the smaller world (``dp_shard: -1`` shrinks with it; a layout
  that no longer fits stops the retry with the validation errors, exit 2);
* the new attempt runs in the same run directory (the previous attempt's ``logs/`` is kept as
  ``logs.prev-N/``, ``hostfile`` is rewritten), and its workers get ``LLMTRAIN_AUTO_RESUME=1``:
  they continue from the latest committed checkpoint (resharded when the world changed), or
  from the start if none was committed. Checkpoints must therefore be where every node of the
  next attempt reads them (``checkpoint.dir`` on shared storage, or nodes sharing the run dir).

Only a lost node triggers a retry: a failing rank (torchrun's code), a hang (124) or a signal to
the launcher ends the launch as before.
"""

from __future__ import annotations

import dataclasses

from llmtrain.cluster.hostfile import Hostfile
from llmtrain.launch.launchplan import with_env

EXIT_LOST = 255
AUTO_RESUME_ENV = "LLMTRAIN_AUTO_RESUME"


def lost_host(code: int, sshrun) -> str | None:
    """The hostfile name of the node whose loss ended the attempt, or None if it was not a loss."""
    failure = getattr(sshrun, "first_failure", None)
    if code != EXIT_LOST or failure is None:
        return None
    return failure.node.host


def without_host(hostfile: Hostfile, host: str) -> Hostfile:
    return dataclasses.replace(hostfile, hosts=tuple(h for h in hostfile.hosts if h.host != host))


__all__ = ["lost_host", "without_host", "with_env", "EXIT_LOST", "AUTO_RESUME_ENV"]
