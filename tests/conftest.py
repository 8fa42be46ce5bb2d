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


@pytest.fixture(scope="session")
def one_rank_gloo(tmp_path_factory):
    """This process as a 1-rank gloo process group (FileStore), for in-process tests of code that
    needs one (FSDP2 on a 1-rank mesh, the compression reducers); made once, kept for the session."""
    import torch.distributed as dist

    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    return dist.group.WORLD
