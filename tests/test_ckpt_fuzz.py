"""Fuzz: hostile and damaged checkpoint directories through ``ckpt list``, ``ckpt inspect``, ``ckpt export`` and ``resume``.

One real run (module fixture: :func:`tests.ckpt_craft.make_run`, 1 CPU rank, tiny model,
checkpoints step-1 and step-2). Every example is a hard-linked copy of it with 1-3 mutations
(hypothesis, derandomized so CI is reproducible; :data:`EXAMPLES` directories):

* ``metadata.json`` shapes: any field (nested ones too) set to arbitrary JSON (huge and
  negative ints, NaN, control characters, lists, deep objects), fields deleted or added, the
  whole document replaced by other JSON, random bytes or a truncation;
* file lists: entries with absolute, ``..``, empty-segment, control-character, over-long names;
* symlinks: a listed file, the ``rng`` directory, ``metadata.json``, the step directory or
  ``latest`` linked to an identical copy outside, a directory, ``/dev/zero``, a dangling path,
  itself (a loop), or a copy inside; FIFOs and directories where files belong;
* pickled payloads: ``.metadata`` or ``rng/rank-0.pt`` replaced by code-running pickles
  (:func:`tests.ckpt_craft.payloads`, a torch-saved object), or the real index with a storage
  entry moved (outside, unlisted, another file), byte ranges or sizes changed, a bytes entry
  whose data is a code-running torch pickle, ``planner_data`` changed, its pickle truncated;
* truncations and appended bytes of any listed file; unlisted files (DCP-read names and inert
  ones); ``latest`` holding garbage;
* then, half the time, ``metadata.json`` resealed (checksums rewritten to match), as an
  attacker controlling the directory would.

Each directory goes through the four commands in this process (typer's CliRunner; ``resume``
stops before torchrun: the local launch is a stub that records the checkpoint it was given).
Asserted for every run: exit code 0 or 2, no exception and no ``Traceback``, no marker file
created by any payload, every ``error:`` line names a path inside the directory, and a checkpoint
holding a hostile change (code, a path out, an unlisted file DCP reads) is never the one that
``inspect`` passes, ``export`` writes or ``resume`` launches. A few fixed directories also go
through the real CLI in subprocesses. The counts are printed (``pytest -s``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from llmtrain.cli.app import app
from llmtrain.cli import ckpt as _ckpt  # noqa: F401  (registers the commands)
from llmtrain.cli import resume as _resume  # noqa: F401
from llmtrain.engine.checkpoint_meta import rel_problem
from tests import ckpt_craft as cc

EXAMPLES = 520
FUZZ = dict(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
LISTED = [".metadata", "__0_0.distcp", "rng/rank-0.pt"]
FIELDS = ["format", "step", "files", "tokens_seen", "consumed_samples", "sampler", "world_size", "dims", "grad_accum",
          "recipe", "versions", "created"]
NESTED = [("files", ".metadata", "bytes"), ("files", "__0_0.distcp", "sha256"), ("files", "rng/rank-0.pt"),
          ("sampler", "consumed_samples"), ("dims", "tp"), ("dims", "bogus"), ("recipe", "model"),
          ("recipe", "model", "layers"), ("recipe", "model", "hidden"), ("recipe", "model", "moe", "num_experts"),
          ("recipe", "model", "vocab_size"), ("recipe", "model", "preset"), ("recipe", "parallel", "zero"),
          ("versions", "torch"), ("files", "__0_0.distcp")]
NAMES = ["/etc/passwd", "../x", "../../step-1/__0_0.distcp", "rng/../../x", "", ".", "a//b", "./x", "x/..",
         "metadata.json", "\x1b[2Jx", "x\x00y", "a\\b", "..", "C:\\x", "rng/rank-0.pt/..", "x" * 2000, "é.distcp",
         "sub/ok.distcp", "../../../outside/secret"]
UNLISTED = ["__0.metadata", "__5_0.distcp", "rng/rank-7.pt", "x.pt", "notes.txt", ".hidden", "sub/dir/file"]
LINK_TARGETS = [*LISTED, "metadata.json", "rng", "STEP", "latest"]
LINK_DESTS = ["outside_copy", "outside_dir", "/dev/zero", "/dev/null", "dangling", "loop", "inside_copy"]
INDEX_HOW = ["relpath", "offset", "length", "bytes_entry", "planner", "size", "no_chunks", "transform",
             "drop_storage", "not_metadata", "truncate"]
PAYLOAD_KINDS = ["os.mkdir", "Path.touch", "exec", "PosixPath.touch", "torch_obj"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)
steps = st.sampled_from([2, 2, 1])
mutation = st.one_of(
    st.tuples(st.just("set"), steps, st.sampled_from([(f,) for f in FIELDS] + NESTED), json_values),
    st.tuples(st.just("del"), steps, st.sampled_from([(f,) for f in FIELDS] + NESTED)),
    st.tuples(st.just("extra"), steps, st.text(min_size=1, max_size=10), json_values),
    st.tuples(st.just("doc"), steps, st.sampled_from(["json", "bytes", "truncate"]), json_values, st.binary(max_size=64),
              st.integers(0, 4000)),
    st.tuples(st.just("name"), steps, st.sampled_from(NAMES) | st.text(max_size=30), st.booleans()),
    st.tuples(st.just("link"), steps, st.sampled_from(LINK_TARGETS), st.sampled_from(LINK_DESTS)),
    st.tuples(st.just("special"), steps, st.sampled_from([*LISTED, "metadata.json", "latest"]),
              st.sampled_from(["fifo", "dir", "empty"])),
    st.tuples(st.just("payload"), steps, st.sampled_from([".metadata", "rng/rank-0.pt"]), st.sampled_from(PAYLOAD_KINDS)),
    st.tuples(st.just("index"), steps, st.sampled_from(INDEX_HOW),
              st.sampled_from(["../../../outside.distcp", "/tmp/outside.distcp", "rng/rank-0.pt", "__7_0.distcp",
                               "metadata.json", ".metadata", "__0_0.distcp"]),
              st.integers(-5, 2**40)),
    st.tuples(st.just("truncate"), steps, st.sampled_from(LISTED), st.floats(0, 1), st.binary(max_size=32)),
    st.tuples(st.just("unlisted"), steps, st.sampled_from(UNLISTED)),
    st.tuples(st.just("latest"), st.sampled_from(["step-1", "step-9", "../step-2", "", "step-2\nstep-1", "\x00\xff",
                                                  "step-" + "9" * 40])),
)
scenario = st.tuples(st.lists(mutation, min_size=1, max_size=3), st.booleans())


# -- applying mutations ---------------------------------------------------------------------------

def set_path(doc, path: tuple, value, delete: bool = False):
    if not isinstance(doc, dict):
        return doc
    node = doc
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    if delete:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value
    return doc


def edit_meta(ckpt: Path, fn) -> None:
    if not (ckpt / "metadata.json").is_file():  # a FIFO or a link to a device: reading it would block
        return
    try:
        doc = json.loads((ckpt / "metadata.json").read_bytes())
    except (OSError, ValueError):
        return
    cc.write_meta(ckpt, json.dumps(fn(doc)))


def edit_index(ckpt: Path, how: str, name: str, number: int, marker: str) -> bool:
    """Change the real index; returns whether the change is hostile (must never be used)."""
    if not (ckpt / ".metadata").is_file():
        return False
    try:
        index = cc.real_index(ckpt)
    except Exception:  # noqa: BLE001  (an earlier mutation replaced it)
        return False
    infos = list(index.storage_data.values())
    entries = list(index.state_dict_metadata.values())
    if how == "relpath":
        infos[number % len(infos)].relative_path = name
    elif how == "offset":
        infos[number % len(infos)].offset = number
    elif how == "length":
        infos[number % len(infos)].length = number
    elif how == "bytes_entry":
        cc.index_with_bytes_entry(ckpt, marker)
        return True
    elif how == "planner":
        key = next(iter(index.planner_data))
        index.planner_data[key] = ("model", number) if number % 2 else (name,)
    elif how == "size":
        entries[number % len(entries)].size = __import__("torch").Size([number % (2**40) + 1, 3])
    elif how == "no_chunks":
        entries[number % len(entries)].chunks = []
    elif how == "transform":
        infos[0].transform_descriptors = ["zstd"]
    elif how == "drop_storage":
        index.storage_data.pop(next(iter(index.storage_data)))
    if how == "not_metadata":
        data = pickle.dumps({"state_dict_metadata": {}, "n": number})
    elif how == "truncate":
        raw = (ckpt / ".metadata").read_bytes()
        data = raw[: number % max(len(raw), 1)]
    else:
        data = pickle.dumps(index)
    cc.replace(ckpt / ".metadata", data)
    return how == "relpath" and name != "__0_0.distcp"


def make_link(ckpt: Path, root: Path, target: str, dest: str, outside: Path) -> bool:
    """Make ``target`` a symlink to ``dest``; returns whether it now leads out of the checkpoint."""
    path = root / "latest" if target == "latest" else ckpt if target == "STEP" else ckpt / target
    if not (path.exists() or path.is_symlink()):
        return False
    copy = outside / f"copy-{len(os.listdir(outside))}"
    if dest == "inside_copy":
        if not path.is_file() or path.is_symlink() or target in ("latest", "STEP"):
            return False
        inside = ckpt / f"inside-{copy.name}"
        shutil.copy2(path, inside)
        cc.relink(path, inside.name if "/" not in target else f"../{inside.name}")
        return False
    if dest == "outside_copy":
        try:
            if path.is_dir():
                shutil.copytree(path, copy, symlinks=True)
            else:
                shutil.copy2(path, copy) if path.is_file() else copy.write_bytes(b"")
        except (OSError, shutil.Error):  # a FIFO from an earlier mutation
            copy.mkdir(exist_ok=True)
        cc.relink(path, copy)
    elif dest == "outside_dir":
        copy.mkdir()
        cc.relink(path, copy)
    elif dest == "dangling":
        cc.relink(path, outside / "nothing-here")
    elif dest == "loop":
        cc.relink(path, path.name)
    else:
        cc.relink(path, dest)
    return True


@contextlib.contextmanager
def time_limit(seconds: int):
    """Fail (instead of hanging the suite) if a command blocks, e.g. on a FIFO."""
    def expired(signum, frame):
        raise AssertionError(f"a command blocked for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def apply(run: Path, muts, reseal: bool, outside: Path, marker: str) -> tuple[set, Counter]:
    """Apply the mutations; returns (hostile step directories, kinds applied)."""
    root = run / "checkpoints"
    hostile, kinds, touched = set(), Counter(), set()
    for m in muts:
        kind = m[0]
        kinds[kind] += 1
        if kind == "latest":
            cc.replace(root / "latest", m[1].encode("utf-8", "surrogatepass"))
            continue
        ckpt = root / f"step-{m[1]}"
        if not ckpt.is_dir():
            continue
        touched.add(ckpt)
        if kind == "set":
            edit_meta(ckpt, lambda d: set_path(d, m[2], m[3]))
        elif kind == "del":
            edit_meta(ckpt, lambda d: set_path(d, m[2], None, delete=True))
        elif kind == "extra":
            edit_meta(ckpt, lambda d: set_path(d, (m[2],), m[3]) if m[2] not in d else d)
        elif kind == "doc":
            raw = (ckpt / "metadata.json").read_bytes() if (ckpt / "metadata.json").is_file() else b""
            data = {"json": json.dumps(m[3]).encode(), "bytes": m[4], "truncate": raw[: m[5] % max(len(raw), 1)]}[m[2]]
            cc.write_meta(ckpt, data)
        elif kind == "name":
            entry = {"bytes": 6, "sha256": "0" * 64}
            if m[3]:
                (outside / "secret").write_bytes(b"secret")
                entry = {"bytes": 6, "sha256": __import__("hashlib").sha256(b"secret").hexdigest()}
            edit_meta(ckpt, lambda d: set_path(d, ("files", m[2]), entry))
            if rel_problem(m[2]) is not None:
                hostile.add(ckpt)
        elif kind == "link":
            if make_link(ckpt, root, m[2], m[3], outside) and m[2] != "latest":
                hostile.add(ckpt)
        elif kind == "special":
            path = root / "latest" if m[2] == "latest" else ckpt / m[2]
            if path.exists() or path.is_symlink():
                path.unlink() if not path.is_dir() or path.is_symlink() else shutil.rmtree(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            {"fifo": os.mkfifo, "dir": os.mkdir, "empty": lambda p: Path(p).write_bytes(b"")}[m[3]](path)
        elif kind == "payload":
            data = (cc.torch_saved({"torch": cc.MkdirMarker(marker)}) if m[3] == "torch_obj"
                    else cc.payloads(marker)[m[3]])
            cc.replace(ckpt / m[2], data)
            hostile.add(ckpt)
        elif kind == "index":
            if edit_index(ckpt, m[2], m[3], m[4], marker):
                hostile.add(ckpt)
        elif kind == "truncate":
            f = ckpt / m[2]
            if f.is_file():
                raw = f.read_bytes()
                cc.replace(f, raw[: int(len(raw) * m[3])] + m[4])
        elif kind == "unlisted":
            f = ckpt / m[2]
            if not (f.exists() or f.is_symlink()):
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_bytes(b"unlisted")
                if m[2] not in ("notes.txt", ".hidden", "sub/dir/file"):
                    hostile.add(ckpt)
    if reseal:
        for ckpt in touched:
            if not (ckpt / "metadata.json").is_file() or (ckpt / "metadata.json").is_symlink():
                continue  # resealing would replace the link (an attacker would edit its target)
            try:
                cc.reseal(ckpt)
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass  # metadata.json is not a document with a files mapping any more
    return hostile, kinds


# -- running the commands ---------------------------------------------------------------------------

def run_all(run: Path, out: Path) -> list[tuple[str, int, str, list]]:
    launches: list = []
    runner = CliRunner()
    results = []
    with mock.patch("llmtrain.launch.backends.local.relaunch_local", lambda *a, **k: launches.append(k) or 0):
        for name, args in (("list", ["ckpt", "list", str(run)]), ("inspect", ["ckpt", "inspect", str(run)]),
                           ("export", ["ckpt", "export", str(run), "--hf", str(out)]),
                           ("resume", ["resume", "--run", str(run), "--set", "train.steps=3"])):
            launches.clear()
            r = runner.invoke(app, args)
            if r.exception is not None and not isinstance(r.exception, SystemExit):
                raise AssertionError(f"{name} raised {type(r.exception).__name__}: {r.exception}\n{r.output[-3000:]}")
            results.append((name, r.exit_code, r.output, list(launches)))
    return results


def used_checkpoint(name: str, output: str, launches: list) -> str | None:
    """The checkpoint a successful command used (inspect: passed; export: wrote; resume: launched)."""
    if name == "resume":
        return launches[0]["extra_env"]["LLMTRAIN_RESUME"] if launches else None
    prefix = {"inspect": "checkpoint ", "export": "exported "}.get(name)
    for line in output.splitlines():
        if prefix and line.startswith(prefix):
            return line[len(prefix):].split(" ")[0]
    return None


def check_results(results, run: Path, hostile: set, markers: Path, stats: Counter) -> None:
    for name, code, output, launches in results:
        assert code in (0, 2), f"{name}: exit {code}\n{output[-3000:]}"
        assert "Traceback" not in output, f"{name}:\n{output[-3000:]}"
        assert not os.listdir(markers), f"{name}: a payload ran: {os.listdir(markers)}"
        stats[f"{name} exit {code}"] += 1
        if code == 2:
            errors = [line for line in output.splitlines() if line.startswith("error:")]
            assert errors, f"{name}: exit 2 without an error line\n{output[-3000:]}"
            for line in errors:
                assert str(run) in line, f"{name}: refusal does not name a file in the checkpoint: {line}"
            stats["refusals"] += 1
        else:
            used = used_checkpoint(name, output, launches)
            bad = {p for h in hostile for p in (str(h), os.path.realpath(h))}  # realpath: no error on a loop
            if used is not None:
                assert not {used, os.path.realpath(used)} & bad, f"{name} used the hostile {used}\n{output[-3000:]}"


@pytest.fixture(scope="module")
def base(crafted_run) -> Path:
    return crafted_run  # the session's real tiny run (tests/conftest.py), read-only: cases clone it


def test_fuzz_checkpoint_directories(base, tmp_path_factory, capsys):
    work_root = tmp_path_factory.mktemp("fuzzwork")
    markers = work_root / "markers"
    markers.mkdir()
    stats: Counter = Counter()

    @settings(**FUZZ)
    @given(scenario)
    def case(sc) -> None:
        muts, reseal = sc
        work = Path(tempfile.mkdtemp(dir=work_root))
        try:
            run = cc.clone_run(base, work / "run")
            outside = work / "outside"
            outside.mkdir()
            hostile, kinds = apply(run, muts, reseal, outside, str(markers / "pwned"))
            with time_limit(120):
                results = run_all(run, work / "hf")
            check_results(results, run, hostile, markers, stats)
            stats["directories"] += 1
            stats["hostile directories"] += bool(hostile)
            stats["resealed"] += reseal
            stats.update({f"mutation {k}": v for k, v in kinds.items()})
        finally:
            shutil.rmtree(work, ignore_errors=True)

    case()
    summary = dict(sorted(stats.items()))
    with capsys.disabled():
        print(f"\nckpt fuzz: {stats['directories']} directories x 4 commands = {4 * stats['directories']} runs; "
              f"refusals (exit 2, each naming a file) {stats['refusals']}; tracebacks 0; markers created "
              f"{len(os.listdir(markers))}\nckpt fuzz counts: {json.dumps(summary)}")
    assert stats["directories"] >= 500 and not os.listdir(markers)
    assert stats["hostile directories"] >= 100 and stats["refusals"] >= 500, summary


FIXED = {
    "index payload, resealed": [("payload", 2, ".metadata", "PosixPath.touch"), ("payload", 1, ".metadata", "exec")],
    "garbage metadata.json, shard linked out": [("doc", 2, "bytes", None, b"\x00\xffgarbage", 0),
                                               ("link", 1, "__0_0.distcp", "outside_copy")],
}


@pytest.mark.parametrize("label", list(FIXED))
def test_fixed_hostile_directories_through_the_real_cli(base, tmp_path, label):
    markers = tmp_path / "markers"
    markers.mkdir()
    run = cc.clone_run(base, tmp_path / "run")
    outside = tmp_path / "outside"
    outside.mkdir()
    hostile, _ = apply(run, FIXED[label], True, outside, str(markers / "pwned"))
    assert hostile
    results = []
    for name, args in (("list", ["ckpt", "list", str(run)]), ("inspect", ["ckpt", "inspect", str(run)]),
                       ("export", ["ckpt", "export", str(run), "--hf", str(tmp_path / "hf")]),
                       ("resume", ["resume", "--run", str(run), "--set", "train.steps=3"])):
        proc = cc.cli(args)
        results.append((name, proc.returncode, proc.stdout + proc.stderr, []))
    check_results(results, run, hostile, markers, Counter())
    assert [code for _, code, _, _ in results][1:] == [2, 2, 2], results  # both checkpoints are refused
