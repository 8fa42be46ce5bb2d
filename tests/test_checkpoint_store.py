"""The checkpoint directory protocol without torch.distributed: commit, latest, verify, fallback, keep."""

from __future__ import annotations

import json

import pytest

from llmtrain.engine import checkpoint_store as store
from llmtrain.errors import LLMTrainError


def write_tmp(root, step: int, payload: bytes = b"x" * 1000):
    tmp = store.tmp_dir(root, step)
    (tmp / "rng").mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(payload)
    (tmp / ".metadata").write_bytes(b"index")
    (tmp / "rng" / "rank-0.pt").write_bytes(b"rng")
    return tmp


def make(root, *steps: int):
    for s in steps:
        write_tmp(root, s)
        store.commit(root, s, {"consumed_samples": 8 * s})


def test_commit_writes_checksums_renames_and_moves_latest(tmp_path):
    make(tmp_path, 2)
    final = tmp_path / "step-2"
    assert final.is_dir() and not store.tmp_dir(tmp_path, 2).exists()
    assert (tmp_path / "latest").read_text() == "step-2\n" and not (tmp_path / "latest.tmp").exists()
    meta = json.loads((final / "metadata.json").read_text())
    assert meta["step"] == 2 and meta["consumed_samples"] == 16 and meta["format"] == store.FORMAT
    assert set(meta["files"]) == {"__0_0.distcp", ".metadata", "rng/rank-0.pt"}
    assert meta["files"]["__0_0.distcp"]["bytes"] == 1000
    assert store.verify(final) == []


def test_uncommitted_directories_are_never_picked(tmp_path):
    make(tmp_path, 2)
    write_tmp(tmp_path, 4)  # a save interrupted before its commit
    (tmp_path / "step-6").mkdir()  # a directory without metadata.json
    assert [p.name for p in store.committed(tmp_path)] == ["step-2"]
    path, meta, warnings = store.resolve(tmp_path, "latest")
    assert path.name == "step-2" and meta["step"] == 2 and warnings == []
    with pytest.raises(LLMTrainError, match="step-6.*no metadata.json"):
        store.resolve(tmp_path, "step-6")
    store.remove_stale_tmp(tmp_path)
    assert not store.tmp_dir(tmp_path, 4).exists()


def test_truncated_shard_is_named_and_latest_falls_back(tmp_path):
    make(tmp_path, 2, 4)
    shard = tmp_path / "step-4" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:10])
    path, meta, warnings = store.resolve(tmp_path, "latest")
    assert path.name == "step-2" and meta["step"] == 2
    assert len(warnings) == 1 and "step-4" in warnings[0] and "__0_0.distcp: 10 bytes, expected 1000" in warnings[0]
    with pytest.raises(LLMTrainError, match="__0_0.distcp: 10 bytes"):
        store.resolve(tmp_path, "step-4")


def test_corrupted_or_missing_file_is_named(tmp_path):
    make(tmp_path, 2, 4)
    (tmp_path / "step-4" / "__0_0.distcp").write_bytes(b"y" * 1000)  # same size, other bytes
    (tmp_path / "step-2" / "rng" / "rank-0.pt").unlink()
    assert "sha256 mismatch" in store.verify(tmp_path / "step-4")[0]
    assert store.verify(tmp_path / "step-2") == [f"{tmp_path / 'step-2' / 'rng' / 'rank-0.pt'}: missing"]
    with pytest.raises(LLMTrainError, match="no intact checkpoint"):
        store.resolve(tmp_path, "latest")


def test_explicit_path_and_empty_root(tmp_path):
    make(tmp_path / "a", 2)
    path, meta, _ = store.resolve(tmp_path / "elsewhere", str(tmp_path / "a" / "step-2"))
    assert meta["step"] == 2 and path == tmp_path / "a" / "step-2"
    with pytest.raises(LLMTrainError, match="no complete checkpoint"):
        store.resolve(tmp_path / "empty", "latest")


def test_keep_prunes_oldest_and_latest_pointer_preferred(tmp_path):
    make(tmp_path, 2, 4, 6, 8)
    store.prune(tmp_path, 2)
    assert [p.name for p in store.committed(tmp_path)] == ["step-6", "step-8"]
    (tmp_path / "latest").write_text("step-6\n")  # e.g. step-8 committed by a run resumed elsewhere
    assert store.resolve(tmp_path, "latest")[0].name == "step-6"


def test_recommit_of_same_step_replaces_it(tmp_path):
    make(tmp_path, 2)
    write_tmp(tmp_path, 2, payload=b"z" * 5)
    store.commit(tmp_path, 2, {})
    assert json.loads((tmp_path / "step-2" / "metadata.json").read_text())["files"]["__0_0.distcp"]["bytes"] == 5


def test_loaded_adamw_step_goes_where_torch_keeps_it():
    """A loaded AdamW ``step`` (DCP fills a CPU scalar) moves to the parameter's device as fp32
    when the group is fused or capturable, as torch.optim.Optimizer.load_state_dict does, and
    stays put otherwise. On a GPU the fused kernel refused the CPU step after a resume (the GPU
    check's dcp_async_resume, H100); here the meta device stands in for CUDA."""
    import torch

    from llmtrain.engine.checkpoint_state import step_where_torch_keeps_it

    p = torch.empty(3, device="meta")
    for flags, device in (({"fused": True}, "meta"), ({"capturable": True}, "meta"),
                          ({"fused": False, "capturable": False}, "cpu"), ({}, "cpu")):
        st = {"step": torch.tensor(5.0, dtype=torch.float64), "exp_avg": torch.zeros(3)}
        step_where_torch_keeps_it(st, flags, p)
        assert st["step"].device.type == device, flags
        assert st["step"].dtype == (torch.float32 if device == "meta" else torch.float64)
