"""Where and how to reach each host: hostfile entries resolved through ``~/.ssh/config``.

A hostfile name may be an alias from an OpenSSH client config (``~/.ssh/config``, or the
hostfile's ``ssh_config:``), read with paramiko's ``SSHConfig`` (``Host`` patterns, ``Match``;
paramiko does not implement ``Include``). Honoured: ``HostName``, ``Port``, ``User``,
``IdentityFile``, ``IdentitiesOnly``, ``ProxyJump`` (chains ``a,b`` too: the launcher connects
to ``a``, through it to ``b``, through that to the host) and ``ProxyCommand`` (run as OpenSSH
does, ``/bin/sh -c 'exec COMMAND'``, with ``%h``/``%p``/``%r`` expanded; a host with both
``ProxyJump`` and ``ProxyCommand`` is refused: OpenSSH would use whichever it read first, and
paramiko cannot tell which that was). Settings written in the hostfile itself (``user``,
``port``, ``identity_file``) win over the config, because they are the more specific statement.

Relative ``ssh_config`` / ``known_hosts`` paths in a hostfile are relative to the hostfile. The
config is read through :mod:`llmtrain.safeio` (a regular file, at most 1 MiB, UTF-8); a line
paramiko cannot parse is reported by number, without its text.

**A dry run executes nothing** (``launch --dry-run``, :func:`resolve_targets` with
``dry_run=True``): a ``Match`` line with an ``exec`` condition is replaced, before paramiko sees
the text, by a block that matches no host, so its command never runs (paramiko would run it
inside ``lookup()``), and a note says which line was not evaluated. ProxyCommands only ever run
when connecting (:mod:`llmtrain.launch.backends.ssh`); a dry run says which host would use one.

**Identity files** (:func:`identity_problems`, checked before any connection) are local
configuration: a missing file, a directory, an unreadable file, a public key or anything that
is not a private key is an error naming where it was set (the hostfile's ``identity_file`` of
a host, or ``IdentityFile`` in the ssh config), never reported later as the host refusing our
key. As in OpenSSH, an ``IdentityFile`` of the ssh config that does not exist is skipped (a
``Host *`` default listing keys some users lack is common) unless the host has
``IdentitiesOnly yes`` and none of its identity files exists.
"""

from __future__ import annotations

import getpass
import io
import os
import re
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from llmtrain.errors import LLMTrainError, Problem
from llmtrain.cluster.hostfile import HostEntry, Hostfile
from llmtrain.safeio import KIB, MIB, open_regular, printable, read_regular, read_text

DEFAULT_SSH_CONFIG = "~/.ssh/config"
MAX_JUMPS = 8
MAX_CONFIG_BYTES = 1 * MIB
MAX_KEY_BYTES = 64 * KIB  # an RSA-16384 private key is ~13 KiB
MAX_KNOWN_HOSTS_BYTES = 64 * MIB
SETTING_RE = re.compile(r"^\s*(\w+)(?:\s*=\s*|\s+)(.+)$")  # paramiko's SSHConfig.SETTINGS_REGEX, per line
EXEC_RE = re.compile(r"(?:^|\s)!?exec(?:\s|$)", re.IGNORECASE)
NEVER_MATCHES = "Host !*"  # a block paramiko applies to no host ("!*" negates every name)


@dataclass(frozen=True)
class SSHTarget:
    """One SSH destination, fully resolved."""

    alias: str  # the name in the hostfile (or in a ProxyJump list)
    hostname: str
    port: int = 22
    user: str = ""
    identity_files: tuple[str, ...] = ()
    identities_only: bool = False
    proxy_jump: SSHTarget | None = None
    proxy_command: str | None = None  # ssh config ProxyCommand, %-tokens expanded (run only when connecting)
    identity_sources: tuple[tuple[str, bool], ...] = ()  # per identity file: (where it was set, from the ssh config?)

    @property
    def address(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}" if self.user else f"{self.hostname}:{self.port}"

    @property
    def label(self) -> str:
        """``alias (user@hostname:port)``, or just the address when the alias is the hostname."""
        return self.address if self.alias == self.hostname else f"{self.alias} ({self.address})"

    @property
    def known_hosts_name(self) -> str:
        """How OpenSSH and paramiko name this host in known_hosts."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    @property
    def route(self) -> str:
        hops, jump = [], self.proxy_jump
        while jump is not None:
            hops.append(jump.alias)
            jump = jump.proxy_jump
        via = " via " + " -> ".join(reversed(hops)) if hops else ""
        outer = self._outermost()
        if outer.proxy_command:
            via += f" via ProxyCommand `{printable(outer.proxy_command, 120)}`"
        return via

    @property
    def short_route(self) -> str:
        """:attr:`route` without the ProxyCommand's text (for table cells)."""
        via = self.route.split(" via ProxyCommand `", 1)[0]
        return via + (" via ProxyCommand" if self._outermost().proxy_command else "")

    def _outermost(self) -> SSHTarget:
        hop = self
        while hop.proxy_jump is not None:
            hop = hop.proxy_jump
        return hop

    def chain(self) -> list[SSHTarget]:
        """This target and its ProxyJump hops, outermost hop first."""
        out, hop = [], self
        while hop is not None:
            out.append(hop)
            hop = hop.proxy_jump
        return out[::-1]


def resolve_path(path: str | None, hostfile: Hostfile) -> str | None:
    if not path:
        return None
    expanded = Path(os.path.expanduser(path))
    if not expanded.is_absolute() and hostfile.source not in ("<localhost>", "hostfile"):
        expanded = Path(hostfile.source).resolve().parent / expanded
    return str(expanded)


def load_ssh_config(path: str | None, dry_run: bool = False, notes: list[str] | None = None) -> Any:
    """paramiko ``SSHConfig`` from ``path`` (default ``~/.ssh/config``; missing default = empty).

    ``dry_run``: ``Match ... exec`` blocks are neutralised before parsing (their command is never
    run) and each one gets a sentence in ``notes``."""
    from paramiko import SSHConfig

    explicit = path is not None
    file = Path(os.path.expanduser(path or DEFAULT_SSH_CONFIG))
    shown = printable(file)
    if not explicit and not file.exists():
        return _tagged(SSHConfig(), shown)
    text = read_text(file, "ssh config", MAX_CONFIG_BYTES, field="ssh_config" if explicit else "",
                     hint="fix ssh_config: in the hostfile" if explicit else "fix or move ~/.ssh/config")
    lines = text.split("\n")
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if "\0" in line or (stripped and not stripped.startswith("#") and not SETTING_RE.match(stripped)):
            # paramiko's message would quote the line: a wrong `ssh_config:` could be any file
            raise LLMTrainError("cannot parse this line (expected `Keyword value`; is it an ssh config?)",
                                "fix its syntax (man ssh_config)", path=f"{shown}:{number}")
    if dry_run:
        for number, line in enumerate(lines):
            m = SETTING_RE.match(line.strip())
            if m and m.group(1).lower() == "match" and EXEC_RE.search(m.group(2)):
                lines[number] = NEVER_MATCHES
                if notes is not None:
                    notes.append(f"ssh config {shown}:{number + 1}: `Match {printable(m.group(2).strip(), 120)}` was not "
                                 "evaluated (a dry run runs no command): its settings are not applied here; a real "
                                 "launch runs that command and applies them where it succeeds")
    try:
        config = SSHConfig.from_text("\n".join(lines))
    except Exception as exc:  # noqa: BLE001 - paramiko's ConfigParseError (Match/Host syntax)
        reason = ("a Host line's names cannot be split (an unbalanced quote?)" if str(exc).startswith("Unparsable")
                  else printable(exc, 120))
        raise LLMTrainError(f"cannot parse ssh config {shown}: {reason}", "fix its syntax (man ssh_config)",
                            path=shown) from None
    return _tagged(config, shown)


def _tagged(config: Any, shown: str) -> Any:
    config.llmtrain_source = shown  # where IdentityFile & co. came from, for messages
    return config


def _split_dest(text: str) -> tuple[str | None, str, int | None]:
    """``user@host:port`` -> parts (ProxyJump syntax)."""
    user, _, rest = text.rpartition("@")
    host, port = rest, None
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port = int(tail[1:]) if tail.startswith(":") and tail[1:].isdigit() else None
    elif rest.count(":") == 1:
        host, _, p = rest.partition(":")
        port = int(p) if p.isdigit() else None
    return user or None, host, port


def resolve_target(name: str, config: Any, user: str | None = None, port: int | None = None,
                   identity_file: str | None = None, depth: int = 0, identity_field: str = "") -> SSHTarget:
    if depth > MAX_JUMPS:
        raise LLMTrainError(f"ProxyJump chain for {name} is longer than {MAX_JUMPS} hops (a loop?)",
                            "check ProxyJump in the ssh config", path=name)
    found = config.lookup(name)
    source = getattr(config, "llmtrain_source", DEFAULT_SSH_CONFIG)
    hostname = found.get("hostname", name)
    for key, value in (("HostName", hostname), ("User", found.get("user") or "")):
        if not value.isprintable() or any(ch.isspace() for ch in value):  # it is echoed in every message
            raise LLMTrainError(f"the ssh config gives {name} the {key} {printable(value, 80)!r}",
                                f"fix {key} in the ssh config", path=source)
    try:
        resolved_port = port or int(found.get("port", 22))
    except ValueError:
        raise LLMTrainError(f"ssh config gives {name} the port {printable(found.get('port'), 40)!r}", "use a number",
                            path=name) from None
    resolved_user = user or found.get("user") or getpass.getuser()
    if identity_file:
        identities = (os.path.expanduser(identity_file),)
        sources: tuple[tuple[str, bool], ...] = ((identity_field or f"identity_file of {name}", False),)
    else:
        identities = tuple(os.path.expanduser(p) for p in found.get("identityfile", []))
        sources = tuple((f"{source}: IdentityFile for {name}", True) for _ in identities)
    jump = None
    proxy = found.get("proxyjump")
    command = found.get("proxycommand") or None  # paramiko stores `ProxyCommand none` as None
    if proxy and proxy.lower() != "none":
        if command:
            raise LLMTrainError(f"the ssh config gives {name} both ProxyJump and ProxyCommand",
                                "keep one of them for this host (OpenSSH uses whichever comes first)", path=source)
        for hop in [h.strip() for h in proxy.split(",") if h.strip()]:
            hop_user, hop_host, hop_port = _split_dest(hop)
            target = resolve_target(hop_host, config, hop_user, hop_port, depth=depth + 1)
            jump = _with_jump(target, jump)
    return SSHTarget(name, hostname, resolved_port, resolved_user, identities,
                     str(found.get("identitiesonly", "no")).lower() == "yes", jump, command, sources)


def _with_jump(target: SSHTarget, jump: SSHTarget | None) -> SSHTarget:
    """``target`` reached through ``jump`` (kept if the target has its own ProxyJump or ProxyCommand)."""
    if jump is None or target.proxy_jump is not None or target.proxy_command:
        return target
    return SSHTarget(target.alias, target.hostname, target.port, target.user, target.identity_files,
                     target.identities_only, jump, None, target.identity_sources)


def resolve_targets(hostfile: Hostfile, dry_run: bool = False, notes: list[str] | None = None,
                    check_identities: bool = False) -> list[SSHTarget]:
    """One :class:`SSHTarget` per hostfile entry, in hostfile order.

    ``dry_run``: run nothing (see the module docstring); ``notes`` receives what a dry run wants
    to say (Match exec lines not evaluated, ProxyCommands a real launch would run).
    ``check_identities``: raise for bad identity files (:func:`identity_problems`)."""
    config = load_ssh_config(resolve_path(hostfile.ssh_config, hostfile), dry_run, notes)
    with _exec_stdin_empty():
        targets = [target_for(entry, config, hostfile) for entry in hostfile.hosts]
    if notes is not None:
        notes.extend(proxy_notes(targets))
    if check_identities:
        problems = identity_problems(targets)
        if problems:
            raise LLMTrainError(problems)
    return targets


@contextmanager
def _exec_stdin_empty() -> Iterator[None]:
    """paramiko runs ``Match exec`` with invoke, which forwards ``sys.stdin`` to the command;
    OpenSSH gives it /dev/null. An empty stdin for the lookups (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved, sys.stdin = sys.stdin, io.StringIO()
    try:
        yield
    finally:
        sys.stdin = saved


def target_for(entry: HostEntry, config: Any, hostfile: Hostfile | None = None) -> SSHTarget:
    identity = os.path.expanduser(entry.identity_file) if entry.identity_file else None
    where = f"{printable(hostfile.source)}: " if hostfile is not None else ""
    return resolve_target(entry.host, config, entry.user, entry.port, identity,
                          identity_field=f"{where}identity_file of host {entry.host}")


def proxy_notes(targets: list[SSHTarget]) -> list[str]:
    """One sentence per host a real launch would reach through a ProxyCommand."""
    out = []
    for target in targets:
        for hop in target.chain():
            if hop.proxy_command:
                through = "" if hop is target else f" (for its ProxyJump hop {hop.alias})"
                out.append(f"{target.alias}: a real launch would connect through ProxyCommand "
                           f"`{printable(hop.proxy_command, 200)}`{through}; a dry run does not run it")
    return out


def identity_problems(targets: list[SSHTarget]) -> list[Problem]:
    """Bad identity files of ``targets`` and their ProxyJump hops, each named by where it was set."""
    problems: list[Problem] = []
    seen: set[SSHTarget] = set()
    for hop in (h for t in targets for h in t.chain()):
        if hop in seen:
            continue
        seen.add(hop)
        sources = hop.identity_sources or tuple((f"identity file of {hop.alias}", False) for _ in hop.identity_files)
        present, missing = 0, []
        for path, (field, from_config) in zip(hop.identity_files, sources):
            if from_config and not os.path.lexists(path):
                missing.append(path)  # OpenSSH skips these too
                continue
            problem = identity_problem(path, field, from_config)
            if problem is None:
                present += 1
            elif problem not in problems:
                problems.append(problem)
        if missing and not present and hop.identities_only:
            problems.append(Problem(sources[0][0], "none of the identity files exists "
                                    f"({', '.join(printable(m, 120) for m in missing)}) and IdentitiesOnly is yes",
                                    "fix IdentityFile in the ssh config"))
    return problems


def identity_problem(path: str, field: str, from_config: bool = False) -> Problem | None:
    """None when ``path`` is a readable private key file; else the problem, at ``field``."""
    fix = "fix IdentityFile in the ssh config" if from_config else "fix identity_file for this host in the hostfile"
    shown = printable(path, 160)
    try:
        data = read_regular(path, "identity file", MAX_KEY_BYTES, field=field, hint=fix)
    except LLMTrainError as exc:
        return exc.problems[0]
    head = data.lstrip()[:64]
    if head.startswith((b"ssh-", b"ecdsa-sha2-", b"sk-ssh-", b"sk-ecdsa-")):
        return Problem(field, f"identity file {shown} is a public key", "give the private key file (the one without .pub)")
    if head.startswith(b"PuTTY-User-Key-File"):
        return Problem(field, f"identity file {shown} is a PuTTY key",
                       f"convert it: puttygen {shown} -O private-openssh -o KEYFILE, and use KEYFILE")
    if not (head.startswith(b"-----BEGIN ") and b"PRIVATE KEY-----" in head):
        return Problem(field, f"identity file {shown} is not a private key (no `-----BEGIN ... PRIVATE KEY-----`)",
                       fix)
    return None


def known_hosts_files(hostfile: Hostfile) -> tuple[list[str], str | None]:
    """(files to read, the hostfile's own known_hosts or None): system, user, then the hostfile's."""
    files = [f for f in ("/etc/ssh/ssh_known_hosts", os.path.expanduser("~/.ssh/known_hosts")) if os.path.isfile(f)]
    extra = resolve_path(hostfile.known_hosts, hostfile)
    if extra is not None and not os.path.lexists(extra):
        raise LLMTrainError(f"known_hosts file {printable(extra)} not found", "fix known_hosts: in the hostfile",
                            path="known_hosts")
    if extra:
        fp, _ = open_regular(extra, "known_hosts file", MAX_KNOWN_HOSTS_BYTES, field="known_hosts",
                             hint="fix known_hosts: in the hostfile")  # a FIFO would hang paramiko's reader
        fp.close()
        files.append(extra)
    return files, extra
