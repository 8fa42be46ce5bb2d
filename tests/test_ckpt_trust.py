"""Checkpoints are untrusted input: reading one never runs code and never leaves its directory.

One real run (module fixture, :func:`tests.ckpt_craft.make_run`: 1 CPU rank, a tiny model, 2
steps, checkpoints step-1 and step-2); each test damages or crafts a hard-linked copy of it.

* Code execution: ``.metadata`` replaced by pickles whose ``__reduce__`` creates a marker
  (``os.mkdir``, ``Path.touch``, ``exec``, ``pathlib.PosixPath.touch`` spelled by hand), an
  index with a non-tensor (bytes) entry whose data is a torch-saved code-running object (DCP
  would ``torch.load(weights_only=False)`` it), a crafted ``rng/rank-0.pt`` — each resealed
  (``metadata.json`` checksums rewritten to match, as an attacker would). Controls: a plain
  ``pickle.loads`` of each payload and torch's stock ``FileSystemReader.read_metadata`` *do*
  create the marker; through llmtrain (``ckpt inspect/export``, ``resume``, in a subprocess
  where it matters) the marker is never created and the refusal is one ``error:`` line, exit
  2, no traceback, naming the file.
* Staying inside: absolute and ``..`` names in ``metadata.json``, a listed shard that is a
  symlink to an identical copy outside (checksums match: only the path check refuses it), a
  step directory and a ``latest`` pointer linking out of the checkpoint root, an index whose
  storage names a file outside, an unlisted shard or the RNG file.
* Shape: a malformed ``metadata.json`` is one line, exit 2, for ``ckpt list``, ``ckpt
  inspect``, ``resume``; FIFOs and devices are refused without blocking; unlisted files that
  DCP would read (``__0.metadata``, ``*.distcp``) are refused, an inert unlisted file is not.
* ``resume --ckpt latest`` falls back past every such checkpoint; one real resume (the engine's
  :class:`~llmtrain.engine.safe_reader.SafeReader` path) continues from step-1 and finishes.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from llmtrain.cli import ckpt as _ckpt  # noqa: F401  (registers the commands)
from llmtrain.cli import resume as _resume  # noqa: F401
from llmtrain.engine import checkpoint_store as store
from llmtrain.engine.dcp_index import IndexUnpickler
from llmtrain.engine.safe_reader import load_rng
from llmtrain.errors import LLMTrainError
from tests import ckpt_craft as cc
from tests.helpers_cli import errors_of, invoke_stubbed


@pytest.fixture(scope="module")
def base(crafted_run) -> Path:
    return crafted_run  # the session's real tiny run (tests/conftest.py), read-only: cases clone it


@pytest.fixture
def run(base, tmp_path) -> Path:
    return cc.clone_run(base, tmp_path / "run")


def step(run: Path, n: int) -> Path:
    return run / "checkpoints" / f"step-{n}"


def invoke(args: list[str]) -> tuple[int, str, list]:
    """``llmtrain ARGS`` in this process (``resume`` stops before torchrun: the launch is a stub
    that records what it was asked to start). Returns ``(exit code, output, launches)``."""
    code, output, calls = invoke_stubbed(args, "llmtrain.launch.backends.local.relaunch_local")
    return code, output, [k for _, k in calls]


def refused(code: int, output: str, names: str) -> str:
    """Exit 2 with exactly one error line that names ``names``; returns that line."""
    errors = errors_of(output)
    assert code == 2 and len(errors) == 1 and names in errors[0], output[-3000:]
    return errors[0]


def test_payloads_are_live_and_the_allow_list_refuses_them(tmp_path):
    for name, payload in cc.payloads(str(tmp_path / "m")).items():
        marker = tmp_path / f"control-{name.replace('.', '_')}"
        live = cc.payloads(str(marker))[name]
        pickle.loads(live)  # control: plainly unpickled, the payload runs
        assert cc.marker_made(marker), name
        marker2 = tmp_path / f"ours-{name.replace('.', '_')}"
        with pytest.raises(pickle.UnpicklingError, match="refused global"):
            IndexUnpickler(__import__("io").BytesIO(cc.payloads(str(marker2))[name])).load()
        assert not cc.marker_made(marker2), name
    with pytest.raises(pickle.UnpicklingError):  # and torch's own weights_only load refuses objects
        torch.load(__import__("io").BytesIO(cc.torch_saved(cc.MkdirMarker(str(tmp_path / "t")))), weights_only=True)
    assert not cc.marker_made(tmp_path / "t")


def test_stock_dcp_reader_runs_a_crafted_index_llmtrain_refuses_it(run, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "marker"
    ckpt = step(run, 2)
    cc.replace(ckpt / ".metadata", cc.payloads(str(marker))["os.mkdir"])
    cc.reseal(ckpt)
    try:  # control: torch 2.13's FileSystemReader unpickles .metadata with plain pickle
        FileSystemReader(str(ckpt)).read_metadata()
    except Exception:  # noqa: BLE001  (what it returns is not Metadata; the code already ran)
        pass
    assert cc.marker_made(marker)
    os.rmdir(marker)
    for payload in cc.payloads(str(marker)).values():
        cc.replace(ckpt / ".metadata", payload)
        cc.reseal(ckpt)
        refused(*invoke(["ckpt", "inspect", str(run)])[:2], names=f"{ckpt}/.metadata")
        refused(*invoke(["ckpt", "export", str(run), "--ckpt", "step-2", "--hf", str(tmp_path / "hf")])[:2],
                names=f"{ckpt}/.metadata")
        code, out, launches = invoke(["resume", "--run", str(run), "--set", "train.steps=3"])
        assert code == 0 and launches[0]["extra_env"]["LLMTRAIN_RESUME"] == str(step(run, 1)), out
        assert "falling back" in out and f"{ckpt}/.metadata" in out
        assert not cc.marker_made(marker)


def test_crafted_index_through_the_real_cli(run, tmp_path):
    marker = tmp_path / "marker"
    ckpt = step(run, 2)
    cc.replace(ckpt / ".metadata", cc.payloads(str(marker))["exec"])
    cc.reseal(ckpt)
    for args in (["ckpt", "inspect", str(run)], ["ckpt", "export", str(run), "--ckpt", "step-2", "--hf", str(tmp_path / "hf")],
                 ["resume", "--run", str(run), "--ckpt", "step-2", "--set", "train.steps=3"]):
        proc = cc.cli(args)
        line = refused(proc.returncode, proc.stdout + proc.stderr, names=f"{ckpt}/.metadata")
        assert "refused global" in line
    assert not cc.marker_made(marker) and not (tmp_path / "hf").exists()


def test_bytes_entry_and_crafted_rng_are_refused(run, tmp_path):
    marker = tmp_path / "marker"
    ckpt = step(run, 2)
    cc.index_with_bytes_entry(ckpt, str(marker))
    proc = cc.cli(["ckpt", "export", str(run), "--ckpt", "step-2", "--hf", str(tmp_path / "hf")])
    line = refused(proc.returncode, proc.stdout + proc.stderr, names=f"{ckpt}/.metadata")
    assert "not a tensor" in line
    one = step(run, 1)
    cc.replace(one / "rng" / "rank-0.pt", cc.torch_saved({"torch": cc.MkdirMarker(str(marker))}))
    cc.reseal(one)
    meta = store.read_meta(one)
    with pytest.raises(LLMTrainError, match="rank-0.pt: not an RNG state"):
        load_rng(one, "rng/rank-0.pt", {k: v for k, v in meta["files"].items()})
    refused(*invoke(["ckpt", "inspect", str(run), "--ckpt", "step-1"])[:2], names=f"{one}/rng/rank-0.pt")
    code, out, _ = invoke(["resume", "--run", str(run), "--set", "train.steps=3"])
    assert code == 2 and "no intact checkpoint" in out and f"{one}/rng/rank-0.pt" in out, out
    assert not cc.marker_made(marker)


def test_metadata_json_names_must_stay_inside(run, tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("secret")
    ckpt = step(run, 2)
    good = cc.read_meta(ckpt)
    for name in ("/etc/passwd", str(outside), "../step-1/__0_0.distcp", "rng/../../../x", "a//b", "./.metadata"):
        meta = json.loads(json.dumps(good))
        meta["files"][name] = {"bytes": 6, "sha256": "0" * 64}
        cc.write_meta(ckpt, meta)
        line = refused(*invoke(["ckpt", "inspect", str(run)])[:2], names=f"{ckpt}/metadata.json")
        assert f"files: {name!r}: " in line, line
        code, out, launches = invoke(["resume", "--run", str(run), "--set", "train.steps=3"])
        assert code == 0 and launches[0]["extra_env"]["LLMTRAIN_RESUME"].endswith("step-1"), out
    proc = cc.cli(["ckpt", "inspect", str(run), "--ckpt", "step-2"])
    refused(proc.returncode, proc.stderr, names=f"{ckpt}/metadata.json")


def test_symlinks_out_of_the_checkpoint_are_corruption(run, tmp_path):
    ckpt = step(run, 2)
    copy = tmp_path / "elsewhere"
    shutil.copytree(ckpt, copy)
    cc.relink(ckpt / "__0_0.distcp", copy / "__0_0.distcp")  # same bytes: only the path check can refuse it
    assert store.verify(ckpt) == [f"{ckpt}/__0_0.distcp: resolves outside the checkpoint directory "
                                  "(symlink or path out of it)"]
    refused(*invoke(["ckpt", "inspect", str(run)])[:2], names=f"{ckpt}/__0_0.distcp")
    refused(*invoke(["ckpt", "export", str(run), "--ckpt", "step-2", "--hf", str(tmp_path / "hf")])[:2],
            names=f"{ckpt}/__0_0.distcp")
    cc.relink(ckpt / "__0_0.distcp", "rng/../__0_0.copy")  # a link inside the checkpoint is fine
    os.link(copy / "__0_0.distcp", ckpt / "__0_0.copy")
    assert store.verify(ckpt) == []
    root = run / "checkpoints"
    cc.relink(root / "step-3", copy)  # a step directory linking out of the root
    cc.replace(root / "latest", "step-3\n")
    assert "outside the checkpoint root" in store.verify(root / "step-3", root)[0]
    code, out, launches = invoke(["resume", "--run", str(run), "--set", "train.steps=4"])
    assert code == 0 and launches[0]["extra_env"]["LLMTRAIN_RESUME"] == str(ckpt), out
    assert "step-3 is damaged" in out and "outside the checkpoint root" in out
    cc.relink(root / "latest", tmp_path / "pointer")  # latest itself linking out
    (tmp_path / "pointer").write_text("step-1\n")
    assert store.check_latest(root) == (None, f"{root}/latest: resolves outside the checkpoint root (symlink)")
    line = refused(*invoke(["ckpt", "inspect", str(run)])[:2], names=f"{root}/latest")
    assert "would use step-2" in line
    code, out, launches = invoke(["ckpt", "list", str(run)])
    assert code == 2 and "step-3" in out and "invalid" in out and len(errors_of(out)) == 2, out


def test_index_must_name_listed_shards_only(run, tmp_path):
    ckpt = step(run, 2)
    (tmp_path / "outside.distcp").write_bytes((ckpt / "__0_0.distcp").read_bytes())
    for target in ("../../../outside.distcp", str(tmp_path / "outside.distcp"), "rng/rank-0.pt", "__7_0.distcp",
                   "metadata.json"):
        cc.index_pointing_at(ckpt, target)
        line = refused(*invoke(["ckpt", "export", str(run), "--ckpt", "step-2", "--hf", str(tmp_path / "hf")])[:2],
                       names=f"{ckpt}/.metadata")
        assert "not a *.distcp file listed in metadata.json" in line
    assert not (tmp_path / "hf").exists()


def test_unlisted_files_dcp_would_read_and_the_index_itself(run):
    ckpt = step(run, 2)
    os.link(ckpt / ".metadata", ckpt / "__0.metadata")  # DCP's per-rank fallback index
    (ckpt / "__3_0.distcp").write_bytes(b"x")
    (ckpt / "notes.txt").write_text("inert: nothing reads it")
    assert store.verify(ckpt) == [f"{ckpt}/__0.metadata: not listed in metadata.json (a file DCP or resume would read)",
                                  f"{ckpt}/__3_0.distcp: not listed in metadata.json (a file DCP or resume would read)"]
    for f in ("__0.metadata", "__3_0.distcp"):
        (ckpt / f).unlink()
    assert store.verify(ckpt) == []
    code, out, _ = invoke(["ckpt", "inspect", str(run)])
    assert code == 0 and "notes.txt" in out and "(not in metadata.json)" in out
    meta = cc.read_meta(ckpt)
    del meta["files"][".metadata"]
    cc.write_meta(ckpt, meta)
    assert store.verify(ckpt) == [f"{ckpt}/.metadata: not listed in metadata.json (DCP's index must be covered by "
                                  "the integrity check)", f"{ckpt}/.metadata: not listed in metadata.json (a file DCP "
                                  "or resume would read)"]


@pytest.mark.parametrize("doc", ["[]", '{"files": 3}', '{"format": 1, "step": "2", "files": {}}', "{", "\xff\xfe",
                                 '{"format": 1, "step": 2, "files": {}, "bogus": 1}', "[" * 100000])
def test_malformed_metadata_json_is_one_line(run, doc):
    ckpt = step(run, 2)
    cc.write_meta(ckpt, doc.encode("latin-1"))
    for args in (["ckpt", "list", str(run)], ["ckpt", "inspect", str(run)],
                 ["ckpt", "inspect", str(run), "--json"],
                 ["resume", "--run", str(run), "--ckpt", "step-2", "--set", "train.steps=3"]):
        refused(*invoke(args)[:2], names=f"{ckpt}/metadata.json")
    code, out, launches = invoke(["resume", "--run", str(run), "--set", "train.steps=3"])
    assert code == 0 and launches[0]["extra_env"]["LLMTRAIN_RESUME"].endswith("step-1"), out


def test_malformed_metadata_json_through_the_real_cli(run):
    ckpt = step(run, 2)
    meta = cc.read_meta(ckpt)
    meta["files"]["rng/rank-0.pt"]["bytes"] = -1
    cc.write_meta(ckpt, meta)
    for args in (["ckpt", "list", str(run)], ["ckpt", "inspect", str(run), "--ckpt", "step-2"],
                 ["resume", "--run", str(run), "--ckpt", "step-2", "--set", "train.steps=3"]):
        proc = cc.cli(args)
        line = refused(proc.returncode, proc.stderr, names=f"{ckpt}/metadata.json")
        assert "files.rng/rank-0.pt.bytes" in line, line


def test_fifos_and_devices_are_refused_without_blocking(run):
    ckpt = step(run, 2)
    (ckpt / ".metadata").unlink()
    os.mkfifo(ckpt / ".metadata")  # opening it for reading would block forever
    problems = store.verify(ckpt)
    assert len(problems) == 1 and problems[0].startswith(f"{ckpt}/.metadata: ") and "FIFO" in problems[0], problems
    root = run / "checkpoints"
    (root / "latest").unlink()
    os.mkfifo(root / "latest")
    name, problem = store.check_latest(root)
    assert name is None and "FIFO" in problem and f"{root}/latest" in problem
    (step(run, 1) / "metadata.json").unlink()
    os.symlink("/dev/zero", step(run, 1) / "metadata.json")
    code, out, _ = invoke(["ckpt", "list", str(run)])
    assert code == 2 and f"{step(run, 1)}/metadata.json: resolves outside" in out, out
    code, out, _ = invoke(["resume", "--run", str(run), "--set", "train.steps=3"])
    assert code == 2 and "no intact checkpoint" in out and "FIFO" in out, out


def test_real_resume_falls_back_past_a_crafted_latest(run, tmp_path):
    """The engine path end to end: step-2's shard links out of the run (same bytes) and its index
    is a payload; ``resume --ckpt latest`` warns, continues from step-1 through SafeReader, and
    commits a new step-2 (exit 0); the marker is never created."""
    marker = tmp_path / "marker"
    ckpt = step(run, 2)
    shutil.copy2(ckpt / "__0_0.distcp", tmp_path / "shard")
    cc.relink(ckpt / "__0_0.distcp", tmp_path / "shard")
    cc.replace(ckpt / ".metadata", cc.payloads(str(marker))["Path.touch"])
    cc.reseal(ckpt)
    proc = cc.cli(["resume", "--run", str(run)])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out and "falling back" in out and f"{ckpt}/__0_0.distcp" in out
    assert "resumed from" in out and "step-1 at step 1" in out
    assert store.verify(step(run, 2)) == [] and not cc.marker_made(marker)


def test_init_from_hf_directory_is_read_like_a_checkpoint(base, tmp_path):
    """``--init-from-hf DIR`` is untrusted too: regular files only, inside DIR, config.json capped
    and typed (the weights are safetensors: no code)."""
    from llmtrain.engine.hf import check_hf_dir, config_problems
    from llmtrain.recipe.schema import ModelConfig

    hf = tmp_path / "hf"
    code, out, _ = invoke(["ckpt", "export", str(base), "--hf", str(hf)])
    assert code == 0, out
    conf, files = check_hf_dir(hf)
    cfg = ModelConfig.model_validate(store.read_meta(step(base, 2))["recipe"]["model"])
    assert config_problems(conf, cfg) == [] and [f.name for f in files] == ["model.safetensors"]
    bad = dict(conf, num_hidden_layers="1", rope_theta=[1])
    lines = [p.line() for p in config_problems(bad, cfg)]
    assert any("num_hidden_layers='1' is not a positive integer" in line for line in lines), lines
    shutil.move(hf / "model.safetensors", tmp_path / "weights")
    os.symlink(tmp_path / "weights", hf / "model.safetensors")
    with pytest.raises(LLMTrainError, match=r"model.safetensors: resolves outside .*\(symlink\)"):
        check_hf_dir(hf)
    (hf / "model.safetensors").unlink()
    shutil.move(tmp_path / "weights", hf / "model.safetensors")
    (hf / "config.json").unlink()
    os.mkfifo(hf / "config.json")  # opening it for reading would block forever
    with pytest.raises(LLMTrainError, match="FIFO"):
        check_hf_dir(hf)


def test_export_never_writes_into_a_used_directory_without_force(run, tmp_path):
    """Issue 12 item 8: `ckpt export --hf OUT` refuses a non-empty OUT before reading anything;
    --force writes the three export files and leaves the directory's other files alone."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    code, output, _ = invoke(["ckpt", "export", str(run), "--hf", str(out)])
    line = refused(code, output, names=str(out))
    assert "not empty" in line and "--force" in line
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    code, output, _ = invoke(["ckpt", "export", str(run), "--hf", str(out), "--force"])
    assert code == 0, output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "notes.txt"]
    assert (out / "notes.txt").read_text() == "precious"
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, output, _ = invoke(["ckpt", "export", str(run), "--hf", str(afile)])
    refused(code, output, names=str(afile))
    assert afile.read_text() == "x"
