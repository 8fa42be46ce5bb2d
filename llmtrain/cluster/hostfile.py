"""Hostfiles: which machines a run uses and how many ranks (slots) each gets.

Two forms are accepted:

* DeepSpeed form, one host per line, ``#`` comments; OpenMPI's ``max_slots=M`` is accepted
  (a whole number >= ``slots``, recorded and otherwise ignored: llmtrain starts ``slots`` ranks)::

      worker-1 slots=8
      worker-2 slots=8   # trailing comments are fine
      worker-3 slots=8 max_slots=8

* YAML form (``.yaml``/``.yml``, or any file whose first content is one of its top-level keys)::

      known_hosts: ~/.ssh/cluster_known_hosts   # optional, for strict host-key checking
      ssh_config: ~/.ssh/config                 # optional (this is the default)
      python: /opt/venv/bin/python              # optional, absolute; default: launch.python
      workdir: /home/ubuntu/llmtrain            # optional, absolute; default: launch.workdir
      hosts:
        - {host: worker-1, slots: 8, user: ubuntu, port: 22, identity_file: ~/.ssh/id_ed25519}
        - {host: worker-2, slots: 8, addr: 10.0.0.2, python: /usr/bin/python3}

Errors name the file and line. Without a hostfile, llmtrain runs on ``localhost``.

A host listed twice is an error naming both lines; names are compared case-insensitively and
``localhost``, ``127.0.0.1`` and ``::1`` are one host (with the same SSH port).

What errors echo (``--hosts /etc/shadow`` must not print a password hash): a hostfile is read
through :mod:`llmtrain.safeio` (a regular file, at most 1 MiB); a file that is not UTF-8 or
holds NUL bytes is refused without echoing anything. A DeepSpeed-form file echoes a short,
escaped token of a bad line only when the file looks like a hostfile (some line has a
``slots=`` field); otherwise one error names the file and its first line and says what was
expected, without the line's text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from llmtrain.errors import LLMTrainError, Problem
from llmtrain.cluster.placement import Node, Placement
from llmtrain.recipe.load import SafeLineLoader, first_content_line, yaml_error_position
from llmtrain.safeio import printable, read_regular

HOST_RE = re.compile(r"^(?:[A-Za-z0-9_](?:[A-Za-z0-9._-]{0,252})|\[[0-9A-Fa-f:.]+\])$")
ADDR_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,253}$")
ABS_PATH_RE = re.compile(r"^/[^\x00\n]{0,4095}$")
USER_RE = re.compile(r"^[^\s\x00-\x1f\x7f]{1,256}$")  # it is echoed in messages: no control characters
MAX_SLOTS = 1024
YAML_KEYS = ("hosts:", "known_hosts:", "ssh_config:", "python:", "workdir:")  # a first line like these: YAML form
MAX_BYTES = 1 << 20
MAX_MAX_SLOTS = 1 << 20  # OpenMPI's max_slots: recorded only; a sanity bound
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
ECHO_CHARS = 40  # the most of a bad line's token an error shows (escaped)


class HostEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    host: str = Field(pattern=HOST_RE.pattern, description="Hostname, IP, or ~/.ssh/config alias.")
    slots: int = Field(ge=1, le=MAX_SLOTS, description="Ranks (GPUs) to start on this host.")
    max_slots: int | None = Field(None, ge=1, le=MAX_MAX_SLOTS,
                                  description="OpenMPI's upper bound (>= slots); recorded, not used: "
                                              "llmtrain starts `slots` ranks.")
    user: str | None = Field(None, pattern=USER_RE.pattern, description="SSH user (default: ssh config or current user).")
    port: int | None = Field(None, ge=1, le=65535, description="SSH port (default: ssh config or 22).")
    identity_file: str | None = Field(None, min_length=1, description="Private key file.")
    addr: str | None = Field(None, pattern=ADDR_RE.pattern,
                             description="Address the other nodes reach this host at (rendezvous, --local-addr); "
                                         "default: its SSH HostName.")
    python: str | None = Field(None, pattern=ABS_PATH_RE.pattern,
                               description="Absolute path of the Python that runs torchrun on this host.")
    workdir: str | None = Field(None, pattern=ABS_PATH_RE.pattern,
                                description="Absolute working directory on this host.")

    @model_validator(mode="after")
    def _max_slots_at_least_slots(self) -> HostEntry:
        if self.max_slots is not None and self.max_slots < self.slots:
            raise ValueError(f"max_slots ({self.max_slots}) is below slots ({self.slots})")
        return self


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
    raw = read_regular(path, "hostfile", MAX_BYTES,
                       hint="check the --hosts path (examples are in hostfiles/); a hostfile is a short text file")
    shown = str(path)  # the CLI escapes control characters in every problem it prints
    if b"\0" in raw:  # a binary file (a key, an archive): never echo any of it
        line = raw[: raw.index(b"\0")].count(b"\n") + 1
        raise LLMTrainError("is a binary file, not a hostfile", "pass a text hostfile (`worker-1 slots=8` lines or YAML)",
                            path=f"{shown}:{line}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise LLMTrainError(f"not UTF-8 text (byte {exc.start})", "save it as UTF-8", path=f"{shown}:{line}") from None
    return parse_hostfile(text, shown, yaml_form=path.suffix in (".yaml", ".yml"))


def same_host_key(entry: HostEntry) -> str:
    """What makes two entries the same machine: the name (case-insensitive; every loopback name
    is ``localhost``) and the SSH port."""
    name = entry.host.lower()
    return f"{'localhost' if name in LOOPBACK_NAMES else name}:{entry.port or 22}"


def parse_hostfile(text: str, source: str = "hostfile", yaml_form: bool | None = None) -> Hostfile:
    if yaml_form is None or not yaml_form:
        first = next((ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")), "")
        yaml_form = bool(yaml_form) or first.startswith(YAML_KEYS)
    hostfile, lines = _parse_yaml(text, source) if yaml_form else _parse_deepspeed(text, source)
    seen: dict[str, tuple[int, str]] = {}
    problems = []
    for i, h in enumerate(hostfile.hosts):
        key = same_host_key(h)
        if key in seen:
            line, name = seen[key]
            also = "" if name == h.host else f" as {name}"
            problems.append(Problem(f"{source}:{lines[i]}", f"host {h.host} listed twice (first on line {line}{also})",
                                    "list each host once with its total slots"))
        else:
            seen[key] = (lines[i], h.host)
    if problems:
        raise LLMTrainError(problems)
    return hostfile


def _token(text: str) -> str:
    """A bad field as an error shows it: escaped, at most ECHO_CHARS characters, quoted."""
    return repr(printable(text, ECHO_CHARS))


def _parse_deepspeed(text: str, source: str) -> tuple[Hostfile, list[int]]:
    rows = [(n, ln.split("#", 1)[0].strip()) for n, ln in enumerate(text.split("\n"), start=1)]  # editors' numbering
    rows = [(n, content) for n, content in rows if content]
    if rows and not any(f.startswith(("slots=", "max_slots=")) for _, c in rows for f in c.split()[1:]):
        # nothing here looks like a hostfile (a key, /etc/shadow, a recipe): say what was expected
        # once, and echo none of it
        raise LLMTrainError(f"expected `HOSTNAME slots=N` lines; no line of this file has a slots= field "
                            f"(is it a hostfile?)", "e.g. `worker-1 slots=8`", path=f"{source}:{rows[0][0]}")
    hosts, lines, problems = [], [], []
    for number, content in rows:
        parts = content.split()
        where = f"{source}:{number}"
        if not HOST_RE.match(parts[0]):
            problems.append(Problem(where, f"{_token(parts[0])} is not a valid hostname", "write `HOSTNAME slots=N`"))
            continue
        fields: dict[str, str] = {}
        for part in parts[1:]:
            key, eq, value = part.partition("=")
            if not eq or key not in ("slots", "max_slots") or key in fields:
                fields = {}
                break
            fields[key] = value
        if "slots" not in fields:
            problems.append(Problem(where, f"expected `HOSTNAME slots=N` (optionally `max_slots=M`) after "
                                           f"{_token(parts[0])}", "e.g. `worker-1 slots=8`"))
            continue
        value = fields["slots"]
        if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= MAX_SLOTS:
            problems.append(Problem(where, f"slots={printable(value, 20)} is not a whole number in 1..{MAX_SLOTS}",
                                    "e.g. slots=8"))
            continue
        top = fields.get("max_slots")
        if top is not None and (not (top.isascii() and top.isdigit()) or not int(value) <= int(top) <= MAX_MAX_SLOTS):
            problems.append(Problem(where, f"max_slots={printable(top, 20)} is not a whole number >= slots ({value})",
                                    f"e.g. slots={value} max_slots={value}, or drop max_slots (it is not used)"))
            continue
        hosts.append(HostEntry(host=parts[0], slots=int(value), max_slots=None if top is None else int(top)))
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
                    else "host, slots, max_slots, user, port, identity_file, addr, python, workdir")
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
