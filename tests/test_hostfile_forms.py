"""Host selection as DeepSpeed documents it: OpenMPI's ``max_slots``, merged ``--include`` /
``--exclude`` repeats, empty filters, and loopback/case duplicates in a hostfile."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llmtrain.errors import LLMTrainError
from llmtrain.cluster.filters import parse_filter, select_hosts
from llmtrain.cluster.hostfile import load_hostfile, parse_hostfile

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-c", "from llmtrain.cli.app import main; main()"]


def errors(text: str, source: str = "hosts") -> list[str]:
    with pytest.raises(LLMTrainError) as info:
        parse_hostfile(text, source)
    return [p.line() for p in info.value.problems]


# -- OpenMPI's max_slots ---------------------------------------------------------------------------

def test_openmpi_max_slots_is_accepted_recorded_and_ignored():
    hf = parse_hostfile("worker-0 slots=4 max_slots=8\nworker-1 max_slots=2 slots=2  # either order\nworker-2 slots=1\n")
    assert [(h.host, h.slots, h.max_slots) for h in hf.hosts] == [("worker-0", 4, 8), ("worker-1", 2, 2),
                                                                  ("worker-2", 1, None)]
    assert hf.world_size == 7  # slots, not max_slots, decide the ranks
    yaml_form = parse_hostfile("hosts:\n  - {host: a, slots: 2, max_slots: 4}\n")
    assert yaml_form.hosts[0].max_slots == 4


@pytest.mark.parametrize("line, fragment", [
    ("w slots=4 max_slots=2", "hosts:2: max_slots=2 is not a whole number >= slots (4)"),
    ("w slots=4 max_slots=x", "hosts:2: max_slots=x is not a whole number >= slots (4)"),
    ("w slots=4 max_slots=-8", "hosts:2: max_slots=-8 is not a whole number"),
    ("w slots=4 max_slots=", "hosts:2: max_slots= is not a whole number"),
    ("w max_slots=8", "hosts:2: expected `HOSTNAME slots=N` (optionally `max_slots=M`)"),
    ("w slots=4 max_slots=8 max_slots=8", "hosts:2: expected `HOSTNAME slots=N`"),
    ("w slots=4 min_slots=1", "hosts:2: expected `HOSTNAME slots=N`"),
])
def test_bad_max_slots_name_the_line(line, fragment):
    (line_text,) = errors(f"ok slots=1\n{line}\n")
    assert fragment in line_text


def test_yaml_max_slots_below_slots_names_the_line():
    (line,) = errors("hosts:\n  - {host: a, slots: 2}\n  - {host: b, slots: 8, max_slots: 4}\n", "h.yaml")
    assert line.startswith("h.yaml:3: hosts[1]: Value error, max_slots (4) is below slots (8)")


# -- duplicates ------------------------------------------------------------------------------------

@pytest.mark.parametrize("first, second", [("LOCALHOST", "localhost"), ("127.0.0.1", "localhost"),
                                           ("localhost", "[::1]"), ("Worker-1", "worker-1")])
def test_same_host_under_two_names_is_a_duplicate_naming_both_lines(first, second):
    (line,) = errors(f"{first} slots=1\n# between\n{second} slots=2\n")
    assert line == (f"hosts:3: host {second} listed twice (first on line 1 as {first}); "
                    "list each host once with its total slots")


def test_loopback_on_other_ports_is_not_a_duplicate():
    hf = parse_hostfile("hosts:\n  - {host: localhost, slots: 1, port: 2201}\n  - {host: 127.0.0.1, slots: 1, port: 2202}\n")
    assert [h.port for h in hf.hosts] == [2201, 2202]
    (line,) = errors("hosts:\n  - {host: localhost, slots: 1}\n  - {host: 127.0.0.1, slots: 1, port: 22}\n", "h.yaml")
    assert line.startswith("h.yaml:3: host 127.0.0.1 listed twice (first on line 2 as localhost)")


# -- --include / --exclude -------------------------------------------------------------------------

HOSTS = parse_hostfile("worker-0 slots=4\nworker-1 slots=4\n")


@pytest.mark.parametrize("text, expected", [
    ("worker-0:0,1@worker-0:1", {"worker-0": (0, 1)}),      # DeepSpeed's launcher test: merged, collapsed
    ("worker-0@worker-0", {"worker-0": None}),              # named twice: once
    ("worker-0@worker-0:1", {"worker-0": None}),            # all slots wins over some
    ("worker-0:1@worker-0", {"worker-0": None}),
    ("worker-0:2,2,0", {"worker-0": (0, 2)}),               # repeated indices collapse, sorted
    ("worker-1:3@worker-0@worker-1:0", {"worker-1": (0, 3), "worker-0": None}),
])
def test_repeated_hosts_merge_and_repeated_slots_collapse(text, expected):
    assert parse_filter(text, "--include") == expected


def test_merged_filters_select_like_deepspeed():
    sel = select_hosts(HOSTS, include="worker-0:0,1@worker-0:1")
    assert [(h.host, h.slots) for h in sel.hostfile.hosts] == [("worker-0", 2)]
    assert sel.visible_devices == {"worker-0": (0, 1)}
    sel = select_hosts(HOSTS, include="worker-0@worker-0")
    assert [(h.host, h.slots) for h in sel.hostfile.hosts] == [("worker-0", 4)] and sel.visible_devices == {}
    sel = select_hosts(HOSTS, exclude="worker-1:0@worker-1:3,0")
    assert [(h.host, h.slots) for h in sel.hostfile.hosts] == [("worker-0", 4), ("worker-1", 2)]
    assert sel.visible_devices == {"worker-1": (1, 2)}
    sel = select_hosts(HOSTS, exclude="worker-1:1@worker-1")
    assert [h.host for h in sel.hostfile.hosts] == ["worker-0"]


@pytest.mark.parametrize("flag", ["--include", "--exclude"])
@pytest.mark.parametrize("value", ["", "  "])
def test_empty_filter_is_one_error_naming_the_flag(flag, value):
    kwargs = {"include": value} if flag == "--include" else {"exclude": value}
    with pytest.raises(LLMTrainError) as info:
        select_hosts(HOSTS, **kwargs)
    (problem,) = info.value.problems
    assert problem.path == flag and "empty" in problem.message


def test_cli_empty_include_is_one_line_and_exit_2(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-0 slots=2\nworker-1 slots=2\n")
    result = subprocess.run([*CLI, "launch", str(REPO / "recipes" / "debug.yaml"), "--hosts", str(hosts),
                             "--include", "", "--dry-run"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == ["error: --include: no host named (the value is empty); "
                                          "name hosts (host1@host2:0,2), or drop --include"]
    # and without --hosts it is not silently ignored either
    result = subprocess.run([*CLI, "launch", str(REPO / "recipes" / "debug.yaml"), "--exclude", ""], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "error: --exclude: --exclude needs --hosts; pass a hostfile, or drop the flag"]


def test_forms_round_trip_through_load_hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("localhost slots=2 max_slots=2\n")
    assert load_hostfile(path).hosts[0].max_slots == 2
