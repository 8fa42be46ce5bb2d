"""Where and how to reach each host: hostfile entries resolved through ``~/.ssh/config``.

A hostfile name may be an alias from an OpenSSH client config (``~/.ssh/config``, or the
hostfile's ``ssh_config:``), read with paramiko's ``SSHConfig`` (``Host`` patterns, ``Match``,
``Include``). Honoured: ``HostName``, ``Port``, ``User``, ``IdentityFile``, ``IdentitiesOnly``,
``ProxyJump`` (chains ``a,b`` too: the launcher connects to ``a``, through it to ``b``, through
that to the host). Settings written in the hostfile itself (``user``, ``port``,
``identity_file``) win over the config, because they are the more specific statement.

Relative ``ssh_config`` / ``known_hosts`` paths in a hostfile are relative to the hostfile.
"""

from __future__ import annotations

import getpass
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmtrain.errors import LLMTrainError
from llmtrain.launch.hostfile import HostEntry, Hostfile

DEFAULT_SSH_CONFIG = "~/.ssh/config"
MAX_JUMPS = 8


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
        return " via " + " -> ".join(reversed(hops)) if hops else ""


def resolve_path(path: str | None, hostfile: Hostfile) -> str | None:
    if not path:
        return None
    expanded = Path(os.path.expanduser(path))
    if not expanded.is_absolute() and hostfile.source not in ("<localhost>", "hostfile"):
        expanded = Path(hostfile.source).resolve().parent / expanded
    return str(expanded)


def load_ssh_config(path: str | None) -> Any:
    """paramiko ``SSHConfig`` from ``path`` (default ``~/.ssh/config``; missing default = empty)."""
    from paramiko import SSHConfig

    explicit = path is not None
    file = Path(os.path.expanduser(path or DEFAULT_SSH_CONFIG))
    if not file.exists():
        if explicit:
            raise LLMTrainError(f"ssh config {file} not found", "fix ssh_config: in the hostfile", path="ssh_config")
        return SSHConfig()
    try:
        return SSHConfig.from_path(str(file))
    except (OSError, ValueError, KeyError) as exc:  # paramiko raises ConfigParseError (a subclass of Exception)
        raise LLMTrainError(f"cannot read ssh config {file}: {exc}", "fix its syntax", path=str(file)) from None
    except Exception as exc:  # noqa: BLE001 - paramiko's ConfigParseError, token expansion errors
        raise LLMTrainError(f"cannot read ssh config {file}: {exc}", "fix its syntax", path=str(file)) from None


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
                   identity_file: str | None = None, depth: int = 0) -> SSHTarget:
    if depth > MAX_JUMPS:
        raise LLMTrainError(f"ProxyJump chain for {name} is longer than {MAX_JUMPS} hops (a loop?)",
                            "check ProxyJump in the ssh config", path=name)
    found = config.lookup(name)
    hostname = found.get("hostname", name)
    try:
        resolved_port = port or int(found.get("port", 22))
    except ValueError:
        raise LLMTrainError(f"ssh config gives {name} the port {found.get('port')!r}", "use a number",
                            path=name) from None
    resolved_user = user or found.get("user") or getpass.getuser()
    identities = [identity_file] if identity_file else list(found.get("identityfile", []))
    identities = tuple(os.path.expanduser(p) for p in identities)
    jump = None
    proxy = found.get("proxyjump")
    if proxy and proxy.lower() != "none":
        jump = None
        for hop in [h.strip() for h in proxy.split(",") if h.strip()]:
            hop_user, hop_host, hop_port = _split_dest(hop)
            target = resolve_target(hop_host, config, hop_user, hop_port, depth=depth + 1)
            jump = _with_jump(target, jump)
    return SSHTarget(name, hostname, resolved_port, resolved_user, identities,
                     str(found.get("identitiesonly", "no")).lower() == "yes", jump)


def _with_jump(target: SSHTarget, jump: SSHTarget | None) -> SSHTarget:
    """``target`` reached through ``jump`` (kept if the target has its own ProxyJump)."""
    if jump is None or target.proxy_jump is not None:
        return target
    return SSHTarget(target.alias, target.hostname, target.port, target.user, target.identity_files,
                     target.identities_only, jump)


def resolve_targets(hostfile: Hostfile) -> list[SSHTarget]:
    """One :class:`SSHTarget` per hostfile entry, in hostfile order."""
    config = load_ssh_config(resolve_path(hostfile.ssh_config, hostfile))
    return [target_for(entry, config) for entry in hostfile.hosts]


def target_for(entry: HostEntry, config: Any) -> SSHTarget:
    identity = os.path.expanduser(entry.identity_file) if entry.identity_file else None
    return resolve_target(entry.host, config, entry.user, entry.port, identity)


def known_hosts_files(hostfile: Hostfile) -> tuple[list[str], str | None]:
    """(files to read, the hostfile's own known_hosts or None): system, user, then the hostfile's."""
    files = [f for f in ("/etc/ssh/ssh_known_hosts", os.path.expanduser("~/.ssh/known_hosts")) if os.path.isfile(f)]
    extra = resolve_path(hostfile.known_hosts, hostfile)
    if extra is not None and not os.path.isfile(extra):
        raise LLMTrainError(f"known_hosts file {extra} not found", "fix known_hosts: in the hostfile", path="known_hosts")
    if extra:
        files.append(extra)
    return files, extra
