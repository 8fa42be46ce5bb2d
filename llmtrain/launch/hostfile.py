"""Hostfiles: which machines a run uses and how many ranks (slots) each gets.

Two forms are accepted:

* DeepSpeed form, one host per line, ``#`` comments::

      worker-1 slots=8
      worker-2 slots=8   # trailing comments are fine

* YAML form (``.yaml``/``.yml``, or any file whose first content is one of its top-level keys)::

      known_hosts: ~/.ssh/cluster_known_hosts   # optional, for strict host-key checking
      ssh_config: ~/.ssh/config                 # optional (this is the default)
      python: /opt/venv/bin/python              # optional, absolute; default: launch.python
      workdir: /home/ubuntu/llmtrain            # optional, absolute; default: launch.workdir
      hosts:
        - {host: worker-1, slots: 8, user: ubuntu, port: 22, identity_file: ~/.ssh/id_ed25519}
        - {host: worker-2, slots: 8, addr: 10.0.0.2, python: /usr/bin/python3}

Errors name the file and line. Without a hostfile, llmtrain runs on ``localhost``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmtrain.errors import LLMTrainError, Problem
from llmtrain.plan.placement import Node, Placement
from llmtrain.recipe.load import SafeLineLoader, first_content_line, yaml_error_position

HOST_RE = re.compile(r"^(?:[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,252})|\[[0-9A-Fa-f:.]+\])$")
ADDR_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,253}$")
ABS_PATH_RE = re.compile(r"^/[^\x00\n]{0,4095}$")
MAX_SLOTS = 1024
YAML_KEYS = ("hosts:", "known_hosts:", "ssh_config:", "python:", "workdir:")  # a first line like these: YAML form
MAX_BYTES = 1 << 20


class HostEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    host: str = Field(pattern=HOST_RE.pattern, description="Hostname, IP, or ~/.ssh/config alias.")
    slots: int = Field(ge=1, le=MAX_SLOTS, description="Ranks (GPUs) to start on this host.")
    user: str | None = Field(None, min_length=1, description="SSH user (default: ssh config or current user).")
    port: int | None = Field(None, ge=1, le=65535, description="SSH port (default: ssh config or 22).")
    identity_file: str | None = Field(None, min_length=1, description="Private key file.")
    addr: str | None = Field(None, pattern=ADDR_RE.pattern,
                             description="Address the other nodes reach this host at (rendezvous, --local-addr); "
                                         "default: its SSH HostName.")
    python: str | None = Field(None, pattern=ABS_PATH_RE.pattern,
                               description="Absolute path of the Python that runs torchrun on this host.")
    workdir: str | None = Field(None, pattern=ABS_PATH_RE.pattern,
                                description="Absolute working directory on this host.")


class HostfileYAML(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    hosts: list[HostEntry] = Field(min_length=1, description="Hosts in rank order.")
    known_hosts: str | None = Field(None, min_length=1, description="Extra known_hosts file for host-key checking.")
    ssh_config: str | None = Field(None, min_length=1, description="SSH config file for host aliases (default ~/.ssh/config).")
    python: str | None = Field(None, pattern=ABS_PATH_RE.pattern,
                               description="Absolute path of the Python on every host (a host's own `python` wins).")
    workdir: str | None = Field(None, pattern=ABS_PATH_RE.pattern,
                                description="Absolute working directory on every host (a host's own `workdir` wins).")


@dataclass(frozen=True)
class Hostfile:
    hosts: tuple[HostEntry, ...]
    known_hosts: str | None = None
    source: str = "<localhost>"
    ssh_config: str | None = None
    python: str | None = None
    workdir: str | None = None

    @property
    def placement(self) -> Placement:
        return Placement(tuple(Node(h.host, h.slots) for h in self.hosts))

    @property
    def world_size(self) -> int:
        return sum(h.slots for h in self.hosts)

    @classmethod
    def localhost(cls, slots: int) -> Hostfile:
        return cls((HostEntry(host="localhost", slots=slots),))


def load_hostfile(path: str | Path) -> Hostfile:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise LLMTrainError(f"hostfile not found: {path}", "check the --hosts path (examples are in hostfiles/)",
                            path=str(path)) from None
    except OSError as exc:
        raise LLMTrainError(f"cannot read hostfile {path}: {exc.strerror or exc}", "pass a readable file",
                            path=str(path)) from None
    if len(raw) > MAX_BYTES:
        raise LLMTrainError(f"hostfile {path} is {len(raw)} bytes", "a hostfile is a short text file (< 1 MiB)",
                            path=str(path))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise LLMTrainError(f"not UTF-8 text (byte {exc.start})", "save it as UTF-8", path=f"{path}:{line}") from None
    return parse_hostfile(text, str(path), yaml_form=path.suffix in (".yaml", ".yml"))


def parse_hostfile(text: str, source: str = "hostfile", yaml_form: bool | None = None) -> Hostfile:
    if yaml_form is None or not yaml_form:
        first = next((ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")), "")
        yaml_form = bool(yaml_form) or first.startswith(YAML_KEYS)
    hostfile, lines = _parse_yaml(text, source) if yaml_form else _parse_deepspeed(text, source)
    seen: dict[str, int] = {}
    problems = []
    for i, h in enumerate(hostfile.hosts):
        key = f"{h.host}:{h.port or 22}"
        if key in seen:
            problems.append(Problem(f"{source}:{lines[i]}", f"host {h.host} listed twice (first on line {seen[key]})",
                                    "list each host once with its total slots"))
        else:
            seen[key] = lines[i]
    if problems:
        raise LLMTrainError(problems)
    return hostfile


def _parse_deepspeed(text: str, source: str) -> tuple[Hostfile, list[int]]:
    hosts, lines, problems = [], [], []
    for number, line in enumerate(text.split("\n"), start=1):  # "\n" only: line numbers as editors count them
        content = line.split("#", 1)[0].strip()
        if not content:
            continue
        parts = content.split()
        where = f"{source}:{number}"
        if not HOST_RE.match(parts[0]):
            problems.append(Problem(where, f"{parts[0][:40]!r} is not a valid hostname", "write `HOSTNAME slots=N`"))
            continue
        slots = [p for p in parts[1:] if p.startswith("slots=")]
        if len(parts) != 2 or len(slots) != 1:
            problems.append(Problem(where, f"expected `HOSTNAME slots=N`, got {content[:60]!r}", "e.g. `worker-1 slots=8`"))
            continue
        value = slots[0].removeprefix("slots=")
        if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= MAX_SLOTS:
            problems.append(Problem(where, f"slots={value[:20]} is not a whole number in 1..{MAX_SLOTS}", "e.g. slots=8"))
            continue
        hosts.append(HostEntry(host=parts[0], slots=int(value)))
        lines.append(number)
    if problems:
        raise LLMTrainError(problems)
    if not hosts:
        raise LLMTrainError("no hosts listed", "add lines like `worker-1 slots=8`", path=f"{source}:1")
    return Hostfile(tuple(hosts), None, source), lines


def _parse_yaml(text: str, source: str) -> tuple[Hostfile, list[int]]:
    try:
        node = yaml.compose(text)
        data = yaml.load(text, Loader=SafeLineLoader)
    except yaml.YAMLError as exc:
        line, column = yaml_error_position(exc, text)
        problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or "invalid YAML"
        where = f" (column {column})" if column else ""
        raise LLMTrainError(f"invalid YAML{where}: {problem}", "fix the YAML syntax", path=f"{source}:{line}") from None
    except (RecursionError, ValueError, OverflowError, TypeError):
        raise LLMTrainError("cannot parse YAML", "write a `hosts:` list", path=f"{source}:1") from None
    if not isinstance(data, dict):
        raise LLMTrainError("expected a mapping with a `hosts:` list", "see hostfiles/example.yaml",
                            path=f"{source}:{first_content_line(text)}")
    try:
        parsed = HostfileYAML.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = list(err["loc"])
            line = _line_of(node, loc)
            dotted = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
            message = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            keys = ("hosts, known_hosts, ssh_config, python, workdir" if len(loc) == 1
                    else "host, slots, user, port, identity_file, addr, python, workdir")
            problems.append(Problem(f"{source}:{line}" if line else source, f"{dotted}: {message}",
                                    f"valid keys: {keys}" if err["type"] == "extra_forbidden"
                                    else "see hostfiles/example.yaml"))
        raise LLMTrainError(problems) from None
    lines = [_line_of(node, ["hosts", i]) or 1 for i in range(len(parsed.hosts))]
    return Hostfile(tuple(parsed.hosts), parsed.known_hosts, source, parsed.ssh_config, parsed.python,
                    parsed.workdir), lines


def _line_of(node: Any, loc: list[Any]) -> int | None:
    """1-based line of the YAML node at ``loc`` (or of its closest existing parent)."""
    line = None
    for part in loc:
        if node is None:
            break
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if getattr(k, "value", None) == part), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            node = None
    if node is not None:
        line = node.start_mark.line + 1
    return line
