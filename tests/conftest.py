"""Suite-wide fixtures."""

from pathlib import Path

import pytest

from llmtrain.launch.secrets import forget_seen


@pytest.fixture(autouse=True)
def _fresh_secret_memory():
    """Each test starts with no remembered secret values. The CLI remembers every secret value of
    its environment policy for the rest of the process (one command in real use); tests that run
    commands in this process would otherwise mask another test's words: a fuzzed secret ``file``
    turned "not a safetensors file" into "not a safetensors ****" in a later test."""
    forget_seen()
    yield


@pytest.fixture(scope="session")
def crafted_run(tmp_path_factory) -> Path:
    """One real committed tiny run (tests/ckpt_craft.py: 1 CPU rank, 2 steps, checkpoints step-1
    and step-2), made once per session for every test that needs one (checkpoint trust, the fuzz,
    resume under Slurm): READ-ONLY -- a test that changes a run works on ``ckpt_craft.clone_run``."""
    from tests import ckpt_craft

    return ckpt_craft.make_run(tmp_path_factory.mktemp("crafted"))
