"""Hostfiles: DeepSpeed and YAML forms, errors naming ``file:LINE``, and ``plan --hosts``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from llmtrain.errors import LLMTrainError
from llmtrain.cluster.hostfile import Hostfile, load_hostfile, parse_hostfile
from llmtrain.plan.api import make_plan
from tests.helpers_plan import CLI, HOSTFILES, REPO, find


def write(tmp_path: Path, text: str, name: str = "hosts") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(tmp_path: Path, text: str, name: str = "hosts"):
    path = write(tmp_path, text, name)
    with pytest.raises(LLMTrainError) as info:
        load_hostfile(path)
    return path, info.value.problems


# -- DeepSpeed form ------------------------------------------------------------------------------

def test_deepspeed_form_with_comments_and_blank_lines(tmp_path):
    text = "# cluster\n\nworker-1 slots=8\n   \nworker-2 slots=4   # the small one\n# end\n10.0.0.3 slots=2\n"
    hf = load_hostfile(write(tmp_path, text))
    assert [(h.host, h.slots) for h in hf.hosts] == [("worker-1", 8), ("worker-2", 4), ("10.0.0.3", 2)]
    assert hf.world_size == 14 and hf.known_hosts is None
    assert [(n.host, n.slots) for n in hf.placement.nodes] == [("worker-1", 8), ("worker-2", 4), ("10.0.0.3", 2)]
    assert hf.placement.first_ranks == [0, 8, 12]


def test_shipped_hostfiles_parse():
    assert load_hostfile(HOSTFILES / "two-nodes").world_size == 16
    assert [h.host for h in load_hostfile(HOSTFILES / "localhost").hosts] == ["localhost"]
    example = load_hostfile(HOSTFILES / "example.yaml")
    assert example.known_hosts == "~/.ssh/cluster_known_hosts"
    assert [(h.host, h.slots, h.user, h.port) for h in example.hosts] == [("worker-1", 8, "ubuntu", 22),
                                                                         ("worker-2", 8, "ubuntu", 22)]


def test_localhost_default():
    hf = Hostfile.localhost(4)
    assert hf.world_size == 4 and hf.hosts[0].host == "localhost"


@pytest.mark.parametrize("line, fragment", [
    ("worker-1 slots=0", "slots=0 is not a whole number in 1..1024"),
    ("worker-1 slots=-2", "slots=-2 is not a whole number in 1..1024"),
    ("worker-1 slots=eight", "slots=eight is not a whole number"),
    ("worker-1 slots=2000", "slots=2000 is not a whole number in 1..1024"),
    ("worker-1 slots=\u00b2", "is not a whole number"),  # a Unicode digit that int() rejects
    ("worker-1 slots=8.0", "slots=8.0 is not a whole number"),
])
def test_bad_slots(tmp_path, line, fragment):
    path, errs = problems(tmp_path, f"worker-0 slots=8\n{line}\n")
    assert find(errs, f"{path}:2", fragment).hint == "e.g. slots=8"


@pytest.mark.parametrize("line", ["worker-1", "worker-1 8", "worker-1 slots=8 gpus=8", "worker-1 slots=8 slots=8"])
def test_missing_or_extra_fields(tmp_path, line):
    path, errs = problems(tmp_path, f"# x\n{line}\n")
    p = find(errs, f"{path}:2", "expected `HOSTNAME slots=N`")
    assert p.hint == "e.g. `worker-1 slots=8`"


@pytest.mark.parametrize("host", ["-worker", "work/er", "[bold]", "user@host", "a" * 300])
def test_bad_hostname(tmp_path, host):
    path, errs = problems(tmp_path, f"{host} slots=8\n")
    p = find(errs, f"{path}:1", "is not a valid hostname")
    assert p.hint == "write `HOSTNAME slots=N`"


def test_all_bad_lines_reported_together(tmp_path):
    path, errs = problems(tmp_path, "a slots=1\nb slots=0\n\nc\n-d slots=1\n")
    assert [p.path for p in errs] == [f"{path}:2", f"{path}:4", f"{path}:5"]


def test_duplicate_host(tmp_path):
    path, errs = problems(tmp_path, "a slots=1\n\nb slots=2\na slots=3\n")
    p = find(errs, f"{path}:4", "host a listed twice (first on line 1)")
    assert "once" in p.hint


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_empty_hostfile(tmp_path, text):
    path, errs = problems(tmp_path, text)
    assert find(errs, f"{path}:1", "no hosts listed").hint == "add lines like `worker-1 slots=8`"


def test_missing_hostfile(tmp_path):
    with pytest.raises(LLMTrainError) as info:
        load_hostfile(tmp_path / "nope")
    p = info.value.problems[0]
    assert p.path == str(tmp_path / "nope") and "hostfile not found" in p.message and "--hosts" in p.hint


def test_non_utf8_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_bytes(b"a slots=1\nb\xff slots=2\n")
    with pytest.raises(LLMTrainError) as info:
        load_hostfile(path)
    find(info.value.problems, f"{path}:2", "not UTF-8 text (byte 11)")


# -- YAML form ---------------------------------------------------------------------------------------

YAML_HOSTS = """\
known_hosts: /etc/ssh/cluster_known_hosts
hosts:
  - {host: gpu-a, slots: 8, user: ubuntu, port: 2222, identity_file: ~/.ssh/id_ed25519}
  - host: gpu-b
    slots: 4
"""


@pytest.mark.parametrize("name", ["hosts.yaml", "hosts.yml", "hostfile"])
def test_yaml_form_by_extension_or_first_line(tmp_path, name):
    hf = load_hostfile(write(tmp_path, YAML_HOSTS, name))
    assert hf.known_hosts == "/etc/ssh/cluster_known_hosts"
    a, b = hf.hosts
    assert (a.host, a.slots, a.user, a.port, a.identity_file) == ("gpu-a", 8, "ubuntu", 2222, "~/.ssh/id_ed25519")
    assert (b.host, b.slots, b.user, b.port) == ("gpu-b", 4, None, None)


def test_yaml_form_detected_by_hosts_first_line():
    hf = parse_hostfile("# comment\nhosts:\n  - {host: a, slots: 2}\n")
    assert hf.world_size == 2


def test_yaml_unknown_key_with_its_line(tmp_path):
    text = "hosts:\n  - host: a\n    slots: 2\n    gpus: 8\nextra: 1\n"
    path, errs = problems(tmp_path, text, "h.yaml")
    p = find(errs, f"{path}:4", "hosts[0].gpus: unknown key")
    assert p.hint == "valid keys: host, slots, max_slots, user, port, identity_file, addr, python, workdir"
    p = find(errs, f"{path}:5", "extra: unknown key")
    assert p.hint == "valid keys: hosts, known_hosts, ssh_config, python, workdir"


@pytest.mark.parametrize("entry, fragment", [
    ("{host: a, slots: 0}", "hosts[0].slots"),
    ('{host: a, slots: "8"}', "hosts[0].slots"),
    ("{host: a}", "hosts[0].slots"),
    ("{host: 'a b', slots: 1}", "hosts[0].host"),
    ("{host: a, slots: 1, port: 70000}", "hosts[0].port"),
])
def test_yaml_field_errors_name_the_line(tmp_path, entry, fragment):
    path, errs = problems(tmp_path, f"hosts:\n  - {entry}\n", "h.yaml")
    p = find(errs, f"{path}:2", fragment)
    assert p.hint == "see hostfiles/example.yaml"


def test_yaml_syntax_error_with_line(tmp_path):
    path, errs = problems(tmp_path, "hosts:\n  - {host: a, slots: 2}\n  - {host: b, slots: 2\n", "h.yaml")
    p = errs[0]
    assert p.path == f"{path}:4" and "invalid YAML" in p.message and p.hint == "fix the YAML syntax"


@pytest.mark.parametrize("text, line", [("- a\n- b\n", 1), ("# c\n\nplain\n", 3)])
def test_yaml_not_a_mapping(tmp_path, text, line):
    path, errs = problems(tmp_path, text, "h.yaml")
    assert find(errs, f"{path}:{line}", "expected a mapping with a `hosts:` list").hint == "see hostfiles/example.yaml"


def test_yaml_empty_file(tmp_path):
    path, errs = problems(tmp_path, "", "h.yaml")
    assert errs[0].path == f"{path}:1" and errs[0].hint


def test_yaml_duplicate_host_same_port(tmp_path):
    text = "hosts:\n  - {host: a, slots: 1}\n  - {host: a, slots: 1, port: 2222}\n  - {host: a, slots: 1, port: 22}\n"
    path, errs = problems(tmp_path, text, "h.yaml")
    assert [p.path for p in errs] == [f"{path}:4"] and "first on line 2" in errs[0].message


# -- plan --hosts ------------------------------------------------------------------------------------------

def test_plan_takes_world_size_and_names_from_hostfile(tmp_path):
    hosts = write(tmp_path, "alpha slots=2\nbeta slots=2\n")
    plan = make_plan(REPO / "recipes" / "debug.yaml", hosts=hosts)
    assert plan.valid and plan.placement.world_size == 4
    assert [n.host for n in plan.placement.nodes] == ["alpha", "beta"]
    with pytest.raises(LLMTrainError, match="--hosts and --nodes"):
        make_plan(REPO / "recipes" / "debug.yaml", hosts=hosts, nodes=1)


def test_plan_cli_with_hosts(tmp_path):
    hosts = write(tmp_path, "hosts:\n  - {host: alpha, slots: 2}\n  - {host: beta, slots: 2}\n", "h.yaml")
    out = subprocess.run([*CLI, "plan", "recipes/debug.yaml", "--hosts", str(hosts), "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["world_size"] == 4
    assert [(n["host"], n["ranks"]) for n in data["layout"]["nodes"]] == [("alpha", [0, 1]), ("beta", [2, 3])]
    text = subprocess.run([*CLI, "plan", "recipes/debug.yaml", "--hosts", str(hosts)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "alpha" in text.stdout and "beta" in text.stdout


def test_plan_cli_bad_hostfile_names_line(tmp_path):
    hosts = write(tmp_path, "alpha slots=2\nbeta slots=x\n")
    out = subprocess.run([*CLI, "plan", "recipes/debug.yaml", "--hosts", str(hosts)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"error: {hosts}:2: slots=x is not a whole number" in out.stderr


def test_ipv6_host_shown_in_layout(tmp_path):
    """Bracketed IPv6 hosts look like rich markup; the table must still show them."""
    from tests.helpers_plan import render_text
    from llmtrain.plan.report import plan_to_dict

    hosts = write(tmp_path, "[fe80::1] slots=2\n[a] slots=2\n")
    data = plan_to_dict(make_plan(REPO / "recipes" / "debug.yaml", hosts=hosts))
    text = render_text(data)
    assert "[fe80::1]" in text and "[a]" in text
