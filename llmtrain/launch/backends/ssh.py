"""SSH with fabric, made strict: the only module of llmtrain that imports fabric.

Decisions (each one closes a hole measured with fabric 3.2 / paramiko, see docs/launch.md):

* **Host keys are checked.** fabric installs paramiko's ``AutoAddPolicy`` and loads no
  known_hosts. Here every client (and every ProxyJump client) loads
  ``/etc/ssh/ssh_known_hosts``, ``~/.ssh/known_hosts`` and the hostfile's ``known_hosts``, and
  an unknown key raises :class:`SSHError` with its fingerprint and the command that adds it;
  a changed key names the file holding the old one. Trust-on-first-use exists only behind
  ``accept_new`` (``--accept-new-host-keys``), which prints a warning with the fingerprint and
  appends the key to the hostfile's known_hosts (else ``~/.ssh/known_hosts``).
* **Timeouts:** TCP connect (``connect_timeout``) and SSH banner + authentication
  (``banner_timeout``) are explicit, so a dead host or a port that accepts TCP but never speaks
  SSH fails in seconds, not minutes.
* **No fabric ``run(env=...)``** (it is injectable); the caller quotes the environment into the
  command (:mod:`llmtrain.launch.envpolicy`). **No stdin** is forwarded.
* **Long-running commands** use a paramiko channel on the fabric connection directly, with a
  pty (so a launcher that dies, even by SIGKILL, hangs the session up and the node helper stops
  the run), read by one thread per node. Not ``Connection.run``: invoke keeps every byte of
  output in memory (``Result.stdout``), which a multi-day run cannot afford.
* Every failure becomes one sentence naming the host plus a fix (:func:`describe`); paramiko's
  own tracebacks on stderr are silenced.
* **ProxyCommand** (ssh config) runs only here, when connecting: as OpenSSH runs it,
  ``/bin/sh -c 'exec COMMAND'``, as the socket of that hop; it is stopped with the connection.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import logging
import os
import secrets
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import paramiko
from fabric import Config, Connection
from invoke.exceptions import CommandTimedOut
from paramiko.ssh_exception import NoValidConnectionsError

from llmtrain.launch.sshconfig import SSHTarget
from llmtrain.safeio import printable

_log = logging.getLogger("paramiko")
_log.addHandler(logging.NullHandler())
_log.propagate = False  # paramiko logs tracebacks for failures we report as one sentence

KEEPALIVE_S = 5
PROXY_EXIT_WAIT_S = 1.0  # how long a failed connection waits for its ProxyCommand to exit (_proxy_exit)


class SSHError(Exception):
    """One SSH failure, as a sentence about ``target`` plus a fix."""

    def __init__(self, target: SSHTarget, message: str, hint: str, kind: str = "other"):
        super().__init__(f"{target.label}: {message}")
        self.target, self.message, self.hint, self.kind = target, message, hint, kind


class UnknownHostKey(paramiko.SSHException):
    def __init__(self, hostname: str, key: Any):
        super().__init__(f"host key of {hostname} not in known_hosts")
        self.hostname, self.key = hostname, key


def fingerprint(key: Any) -> str:
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key_type(key)} SHA256:{digest}"


def key_type(key: Any) -> str:
    name = key.get_name()
    return {"ssh-ed25519": "ED25519", "ssh-rsa": "RSA", "ssh-dss": "DSA"}.get(
        name, "ECDSA" if name.startswith("ecdsa") else name)


class _Reject(paramiko.MissingHostKeyPolicy):
    def missing_host_key(self, client, hostname, key):
        raise UnknownHostKey(hostname, key)


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """Trust on first use: accept, record and warn (changed keys are still refused by paramiko)."""

    _lock = threading.Lock()

    def __init__(self, path: str, warn: Callable[[str], None]):
        self.path, self.warn = path, warn

    def missing_host_key(self, client, hostname, key):
        client.get_host_keys().add(hostname, key.get_name(), key)
        with self._lock:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as fp:
                fp.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        self.warn(f"warning: trusting the host key of {hostname} on first use ({fingerprint(key)}); "
                  f"added to {self.path}. Verify it out of band.")


@dataclass
class SSHOptions:
    known_hosts: list[str] = field(default_factory=list)
    accept_new: bool = False
    accept_new_file: str | None = None  # where trust-on-first-use writes (default ~/.ssh/known_hosts)
    connect_timeout: float = 10.0
    banner_timeout: float = 10.0
    warn: Callable[[str], None] = print


def _client_setup(conn: Connection, opts: SSHOptions) -> None:
    client = conn.client
    for path in opts.known_hosts:
        try:
            client.load_system_host_keys(path)
        except OSError:
            pass
    if opts.accept_new:
        client.set_missing_host_key_policy(
            _AcceptNew(opts.accept_new_file or os.path.expanduser("~/.ssh/known_hosts"), opts.warn))
    else:
        client.set_missing_host_key_policy(_Reject())


def _connection(target: SSHTarget, opts: SSHOptions) -> Connection:
    gateway = _connection(target.proxy_jump, opts) if target.proxy_jump is not None else None
    kwargs: dict[str, Any] = {"banner_timeout": opts.banner_timeout, "auth_timeout": opts.banner_timeout,
                              "channel_timeout": opts.banner_timeout}
    if target.identity_files:
        kwargs["key_filename"] = list(target.identity_files)
    if target.identities_only:
        kwargs["look_for_keys"] = False
        kwargs["allow_agent"] = False
    conn = Connection(host=target.hostname, user=target.user, port=target.port, gateway=gateway,
                      config=Config(ssh_config=paramiko.SSHConfig(), lazy=True),
                      connect_timeout=max(1, round(opts.connect_timeout)), connect_kwargs=kwargs)
    _client_setup(conn, opts)
    conn._llmtrain_target = target  # for error messages about the hop that failed
    conn._llmtrain_proxy = None  # the ProxyCommand process, started by connect()
    return conn


class _ProxyCommand(paramiko.ProxyCommand):
    """paramiko's ProxyCommand, run as OpenSSH runs it (``/bin/sh -c 'exec COMMAND'``; paramiko
    shlex-splits it and runs no shell) and in its own session, so a Ctrl-C on the terminal
    reaches the launcher (which then stops the run over this very connection), not the proxy."""

    def __init__(self, command: str):  # noqa: D107 - paramiko's __init__ starts the process itself
        self.cmd = ["/bin/sh", "-c", f"exec {command}"]
        self.process = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, bufsize=0, start_new_session=True)
        self.timeout = None

    def close(self) -> None:  # paramiko's raises ProcessLookupError for a proxy that already exited
        if self.process.poll() is None:
            try:
                os.kill(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def _start_proxy(conn: Connection) -> None:
    """Start the hop's ProxyCommand (if any) as the socket its connect() uses."""
    command = conn._llmtrain_target.proxy_command
    if command and conn._llmtrain_proxy is None:
        conn._llmtrain_proxy = _ProxyCommand(command)
        conn.connect_kwargs["sock"] = conn._llmtrain_proxy


def connect(target: SSHTarget, opts: SSHOptions) -> Connection:
    """An open, host-key-checked connection to ``target`` (through its ProxyJump hosts), or SSHError."""
    conn = _connection(target, opts)
    hop, hop_conn, t0 = target, conn, time.monotonic()
    try:
        gateway = conn.gateway
        chain = []
        while isinstance(gateway, Connection):
            chain.append(gateway)
            gateway = gateway.gateway
        for gw in reversed(chain):  # open the outermost jump host first, so its errors name it
            hop, hop_conn = gw._llmtrain_target, gw
            _start_proxy(gw)
            gw.open()
        hop, hop_conn = target, conn
        _start_proxy(conn)
        conn.open()
        conn.transport.set_keepalive(KEEPALIVE_S)
    except Exception as exc:  # noqa: BLE001 - every failure becomes one sentence
        proxy = getattr(hop_conn, "_llmtrain_proxy", None)
        proxy_exit = _proxy_exit(proxy.process) if proxy is not None else None
        close(conn)
        raise describe(hop, exc, opts, time.monotonic() - t0, proxy_exit) from None
    return conn


def _proxy_exit(process, wait_s: float = PROXY_EXIT_WAIT_S) -> int | None:
    """The ProxyCommand's exit code if it ended or ends within ``wait_s`` (a proxy that failed closes
    its stdout, which paramiko sees, a moment before the kernel reports its exit: polling at once
    raced that and named the failure "did not connect" instead of its exit code); None if it runs on."""
    try:
        return process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        return None


def close(conn: Connection | None) -> None:
    while isinstance(conn, Connection):
        try:
            conn.close()
        except Exception:  # noqa: BLE001 - closing a broken connection
            pass
        proxy = getattr(conn, "_llmtrain_proxy", None)
        if proxy is not None:  # a ProxyCommand whose connection never opened is not closed by paramiko
            try:
                if proxy.process.poll() is None:
                    proxy.close()
                proxy.process.wait(timeout=2)
            except Exception:  # noqa: BLE001 - it is gone already
                pass
        conn = conn.gateway


def alive(conn: Connection) -> bool:
    transport = conn.client.get_transport()
    return transport is not None and transport.is_active()


def _owner_of(name: str, files: list[str]) -> str | None:
    for path in files:
        try:
            keys = paramiko.HostKeys(path)
        except (OSError, paramiko.SSHException):
            continue
        if keys.lookup(name):
            return path
    return None


def describe(target: SSHTarget, exc: BaseException, opts: SSHOptions, elapsed: float = 0.0,
             proxy_exit: int | None = None) -> SSHError:
    """Turn an exception from connecting to ``target`` into one sentence and a fix
    (``proxy_exit``: the exit code of the hop's ProxyCommand when it had already ended)."""
    where, port = target.hostname, target.port
    name = target.known_hosts_name
    if isinstance(exc, UnknownHostKey):
        file = opts.accept_new_file or "~/.ssh/known_hosts"
        return SSHError(target, f"host key is not in known_hosts ({fingerprint(exc.key)})",
                        f"check that fingerprint with the host's admin, then add it: ssh-keyscan -p {port} -t "
                        f"{exc.key.get_name()} {where} >> {file} (or pass --accept-new-host-keys to trust it on "
                        f"first use)", "unknown_host_key")
    if isinstance(exc, paramiko.BadHostKeyException):
        file = _owner_of(name, opts.known_hosts) or "~/.ssh/known_hosts"
        return SSHError(target, f"host key CHANGED: the host offers {fingerprint(exc.key)}, {file} has "
                                f"{fingerprint(exc.expected_key)}; someone may be intercepting the connection",
                        f"if the host was reinstalled, verify the new key, then remove the old one: "
                        f"ssh-keygen -R {shlex.quote(name)} -f {file}", "changed_host_key")
    if isinstance(exc, paramiko.ProxyCommandFailure) or (
            target.proxy_command and isinstance(exc, (paramiko.SSHException, EOFError, OSError))
            and not isinstance(exc, (paramiko.AuthenticationException, paramiko.BadHostKeyException))):
        why = (f"exited with code {proxy_exit}{' (command not found)' if proxy_exit == 127 else ''}"
               if proxy_exit is not None else f"did not connect ({printable(exc, 120) or type(exc).__name__})")
        return SSHError(target, f"ProxyCommand `{printable(target.proxy_command or '', 120)}` {why}",
                        "check ProxyCommand in the ssh config (run it by hand: it must relay to the host's sshd)", "proxy")
    if isinstance(exc, NoValidConnectionsError):
        return SSHError(target, f"connection refused at {where}:{port} (nothing listens there)",
                        "check that sshd runs on the host and the port (hostfile `port:` / ssh config Port)", "refused")
    if isinstance(exc, paramiko.AuthenticationException):
        tried = ", ".join(target.identity_files) or "default keys and agent"
        return SSHError(target, f"{target.user}@{where} refused our key ({tried})",
                        f"add the public key to ~{target.user}/.ssh/authorized_keys on the host, or set "
                        f"identity_file in the hostfile / IdentityFile in ~/.ssh/config", "auth")
    handshake = ("banner", "no existing session", "negotiation")
    if isinstance(exc, (paramiko.SSHException, EOFError)) and any(w in str(exc).lower() for w in handshake):
        # paramiko reports a silent server as a banner error or, racing its own timers, as
        # "No existing session": tell them apart from a server that hung up by the time taken
        if elapsed >= 0.9 * opts.banner_timeout:
            return SSHError(target, f"{where}:{port} accepted TCP but sent no SSH banner within "
                                    f"{opts.banner_timeout:g} s",
                            "check that this port is the SSH server's (not another service, a proxy or a firewall)",
                            "banner")
        return SSHError(target, f"{where}:{port} closed the connection during the SSH handshake",
                        "check the host's sshd (its logs; MaxStartups, AllowUsers, TCP wrappers)", "handshake")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return SSHError(target, f"no answer from {where}:{port} within {opts.connect_timeout:g} s",
                        "check the address, the network and firewalls, or raise launch.connect_timeout_s", "timeout")
    if isinstance(exc, socket.gaierror):
        return SSHError(target, f"cannot resolve the host name {where!r}",
                        "check the name, or give it a HostName in ~/.ssh/config", "dns")
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return SSHError(target, f"no route to {where}", "check the address and the network", "unreachable")
    if isinstance(exc, paramiko.ChannelException):
        return SSHError(target, f"the jump host could not open a connection to {where}:{port} ({exc})",
                        "check HostName/Port as seen from the jump host", "proxy")
    text = str(exc) or type(exc).__name__
    return SSHError(target, f"SSH failed: {text[:200]}", "check the host's sshd and the hostfile entry")


# ----------------------------------------------------------------------------- commands


def run_capture(conn: Connection, command: str, timeout: float) -> tuple[int, str, str]:
    """Run a short command (no pty, no stdin): ``(exit code, stdout, stderr)``; timeouts raise TimeoutError."""
    try:
        result = conn.run(command, hide=True, warn=True, in_stream=False, pty=False, timeout=timeout)
    except CommandTimedOut:
        raise TimeoutError(f"command did not finish within {timeout:g} s") from None
    return result.exited, result.stdout, result.stderr


def upload(conn: Connection, data: bytes, remote_path: str, timeout: float = 30.0) -> None:
    """Write ``data`` to ``remote_path`` atomically (temp file + rename, same directory).

    Through an exec channel, not SFTP (some clusters disable the sftp subsystem). The rename
    matters when the "remote" file is the local file itself (a shared filesystem that was not
    declared): writing it in place would truncate what is being read.
    """
    tmp = f"{remote_path}.tmp-{secrets.token_hex(4)}"
    directory = os.path.dirname(remote_path) or "."
    cmd = (f"mkdir -p {shlex.quote(directory)} && cat > {shlex.quote(tmp)} && "
           f"mv -f {shlex.quote(tmp)} {shlex.quote(remote_path)}")
    chan = conn.transport.open_session(timeout=timeout)
    try:
        chan.settimeout(timeout)
        chan.exec_command(cmd)
        chan.sendall(data)
        chan.shutdown_write()
        err = b""
        while True:
            chunk = chan.recv_stderr(4096)
            if not chunk:
                break
            err += chunk
        code = chan.recv_exit_status()
    except socket.timeout:
        raise TimeoutError(f"copying to {remote_path} did not finish within {timeout:g} s") from None
    finally:
        chan.close()
    if code != 0:
        raise OSError(f"cannot write {remote_path}: {err.decode(errors='replace').strip()[:200] or f'exit {code}'}")


class Stream:
    """A long-running command under a pty; bytes go to ``on_data``, the end to ``on_end``.

    ``on_end(exit_code, error)``: ``exit_code`` is the remote status (-1 when the session was
    closed without one: connection lost, or the remote side killed), ``error`` a short text
    when reading failed.
    """

    def __init__(self, conn: Connection, command: str, on_data: Callable[[bytes], None],
                 on_end: Callable[[int, str | None], None], open_timeout: float = 10.0):
        self.conn, self.command = conn, command
        self.on_data, self.on_end = on_data, on_end
        self.chan = conn.transport.open_session(timeout=open_timeout)
        self.chan.get_pty(term="dumb", width=1000, height=50)
        self.thread = threading.Thread(target=self._read, daemon=True, name=f"ssh-{conn.host}")

    def start(self) -> None:
        self.chan.exec_command(self.command)
        self.thread.start()

    def _read(self) -> None:
        error = None
        try:
            while True:
                data = self.chan.recv(65536)
                if not data:
                    break
                self.on_data(data)
            code = self.chan.recv_exit_status()
        except Exception as exc:  # noqa: BLE001 - a broken transport ends the stream
            code, error = -1, f"{type(exc).__name__}: {exc}"
        if code == -1 and error is None and not alive(self.conn):
            error = "connection lost"
        self.on_end(code, error)

    def interrupt(self) -> bool:
        """Type Ctrl-C into the pty: the kernel sends SIGINT to the remote foreground process group at
        once (the node helper and torchrun), no new process needed. False if the channel is gone."""
        try:
            self.chan.send(b"\x03")
            return True
        except Exception:  # noqa: BLE001 - a closed channel or transport
            return False

    def close(self) -> None:
        try:
            self.chan.close()
        except Exception:  # noqa: BLE001
            pass
