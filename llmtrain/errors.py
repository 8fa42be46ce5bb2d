"""Project error types: every user mistake becomes one of these, never a traceback.

A :class:`Problem` is one finding (an error or a warning) with the dotted recipe path (or
``file:line`` for hostfiles), a message carrying the numbers involved, and a hint saying how
to fix it. :class:`LLMTrainError` carries one or more problems; the CLI prints one line per
problem and exits with :data:`EXIT_USER_ERROR` (``LLMTRAIN_DEBUG=1`` shows the traceback).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

EXIT_USER_ERROR = 2
MAX_SHOWN = 50  # an input with thousands of problems prints this many, then a count


@dataclass(frozen=True)
class Problem:
    """One validation finding: where (``path``), what (``message``), how to fix (``hint``)."""

    path: str
    message: str
    hint: str = ""

    def line(self) -> str:
        text = f"{self.path}: {self.message}" if self.path else self.message
        return f"{text}; {self.hint}" if self.hint else text

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


class LLMTrainError(Exception):
    """A user-facing error: one or more problems, each printed as one line."""

    def __init__(self, problems: list[Problem] | Problem | str, hint: str = "", path: str = ""):
        if isinstance(problems, str):
            problems = [Problem(path, problems, hint)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems: list[Problem] = list(problems)
        super().__init__("\n".join(self.lines()))

    def lines(self, limit: int = MAX_SHOWN) -> list[str]:
        """One printable line per problem (control characters escaped), the first ``limit`` of
        them and then ``... and N more problems``; ``self.problems`` keeps all of them."""
        shown = [escape_controls(p.line()) for p in self.problems[:limit]]
        if len(self.problems) > limit:
            shown.append(f"... and {len(self.problems) - limit} more problems (fix these first)")
        return shown


def escape_controls(text: str) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``): a path or a host name with an
    escape sequence or a newline must not rewrite the terminal or fake a second line. The one
    rule for every echo; :func:`llmtrain.safeio.printable` adds a length cut."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
