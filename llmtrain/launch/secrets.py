"""Masking secrets in everything the launcher shows or writes: by name, by origin, by value, by shape.

A variable of the environment policy (:mod:`llmtrain.launch.envpolicy`) is **secret**, and its
value prints as ``****`` wherever the variable is listed (``plan``, ``--dry-run``,
``logs/commands.txt``), when

* its name contains ``TOKEN``, ``KEY``, ``SECRET``, ``PASSWORD``, ``PASSWD``, ``CREDENTIAL``,
  ``AUTH`` or ``PRIVATE`` (any case), or
* it came from ``launch.env_file`` (the env file is where secrets live: every value in it is one).

Any other value is shown with its secret *parts* masked (:func:`mask_text`): the user-info of
a URL (``postgres://alice:pw@db/x`` -> ``postgres://****@db/x``) and well-known token shapes
(``hf_...``, ``ghp_...``/``gho_...``/``github_pat_...``, ``sk-...``, AWS access key ids
``AKIA...``/``ASIA...``, Slack ``xox?-...``) wherever they occur.

:class:`Masker` applies the same to free text (every line the launcher shows or writes to
``logs/``, error messages): it also replaces the known values of secret variables, each line of
a multi-line value too. Values (and lines) shorter than :data:`MIN_REDACT` characters are not
searched for in free text (too many false hits); they are still masked where the variable is
listed. A value is searched for as written, shell-quoted (``shlex.quote``: its form inside a
command line), JSON-escaped and repr-escaped (a rank that logs a dict).

Pure Python, no torch: ``plan`` and ``launch`` use it.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
from typing import Callable, Iterable

from llmtrain.errors import LLMTrainError, Problem

MASK = "****"
MIN_REDACT = 4  # shorter secret values are not searched for in free text
SECRET_NAME_RE = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|PRIVATE", re.IGNORECASE)

_EDGE = r"(?<![A-Za-z0-9])"
TOKEN_RE = re.compile(
    _EDGE + r"(?:hf_[A-Za-z0-9]{20,}"                      # Hugging Face
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"  # GitHub
    r"|sk-[A-Za-z0-9_-]{20,}"                               # OpenAI / Anthropic style
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}(?![0-9A-Za-z])"            # AWS access key ids
    r"|xox[abposr]-[A-Za-z0-9-]{10,})"                     # Slack
)
# scheme://USERINFO@host: USERINFO runs to the last '@' before the authority ends
URL_USERINFO_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*://)([^/?#\s]+)@")


def secret_name(name: str) -> bool:
    return bool(SECRET_NAME_RE.search(name))


def mask_text(text: str) -> str:
    """``text`` with URL user-info and token-shaped substrings replaced by ``****``."""
    if "://" in text:
        text = URL_USERINFO_RE.sub(lambda m: m.group(1) + MASK + "@", text)
    return TOKEN_RE.sub(MASK, text)


def has_secret_shape(text: str) -> bool:
    return mask_text(text) != text


def needles_of(value: str) -> set[str]:
    """What to search free text for to hide ``value``: the value and its lines (stripped), each
    also shell-quoted, JSON- and repr-escaped, and the user-info of URLs in it; only parts of
    >= MIN_REDACT characters."""
    parts = {value, *(line.strip() for line in value.splitlines())}
    parts |= {m.group(2) for m in URL_USERINFO_RE.finditer(value)}
    out = set()
    for part in parts:
        if len(part) >= MIN_REDACT and part.strip():
            out |= {part, shlex.quote(part), json.dumps(part)[1:-1], repr(part)[1:-1]}
    return out


class Masker:
    """Masks secrets in free text: the given secret values, then token shapes and URL user-info."""

    def __init__(self, values: Iterable[str] = ()):
        needles: set[str] = set()
        for value in values:
            needles |= needles_of(value)
        self._needles = sorted(needles, key=len, reverse=True)

    def add(self, values: Iterable[str]) -> None:
        needles = set(self._needles)
        for value in values:
            needles |= needles_of(value)
        self._needles = sorted(needles, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for needle in self._needles:
            if needle in text:
                text = text.replace(needle, MASK)
        return mask_text(text)

    def __bool__(self) -> bool:  # always: token shapes and URL user-info are masked even without known values
        return True

    @property
    def needles(self) -> tuple[str, ...]:
        return tuple(self._needles)


# Secret values this process has seen (from the env policy), so that an error message can be
# masked where the raising code had no Masker at hand.
_SEEN = Masker()


def remember(values: Iterable[str]) -> None:
    _SEEN.add(values)


def forget_seen() -> None:
    """Drop the remembered values. The CLI runs one command per process, so they live exactly one
    command; a process that runs several commands in turn (the test suite's in-process CLI) calls
    this between them, or a secret value of one command (e.g. ``file``) masks words in the next
    command's messages."""
    _SEEN._needles = []


def mask_seen(text: str) -> str:
    """``text`` masked with every secret value this process has seen, and by shape."""
    return _SEEN(text)


def masked_errors(fn: Callable) -> Callable:
    """Decorator for CLI commands: a :class:`~llmtrain.errors.LLMTrainError` leaves with every
    secret value seen in this process, token shapes and URL user-info masked in its lines."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LLMTrainError as exc:
            problems = [Problem(mask_seen(p.path), mask_seen(p.message), mask_seen(p.hint)) for p in exc.problems]
            raise LLMTrainError(problems) from None

    return wrapper
