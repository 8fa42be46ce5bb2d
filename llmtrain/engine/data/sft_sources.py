"""Fine-tuning sources: read chat / instruction / text rows and turn each into ``(tokens, targets)``.

``data.path`` is one file or a directory searched recursively in sorted path order (like
``llmtrain data prepare``); other files in the directory are ignored. Files are opened through
:mod:`llmtrain.safeio` (regular files only; a ``.jsonl`` line is at most ``MAX_JSONL_LINE``, a
``.txt`` at most ``MAX_TXT_BYTES``, the limits of :mod:`llmtrain.engine.data.inputs`).

Each source yields :class:`Encoded` samples: the token ids and, per token, whether it is a loss
target (the label of the token before it). Decisions:

- **chat** (``.jsonl``, rows ``{"messages": [{"role", "content"}, ...]}``): rendered by the
  tokenizer's chat template, masks from :mod:`llmtrain.engine.data.chat_template`. Roles
  system/user/assistant/tool; ``content`` must be a string; other message keys (``name``,
  ``tool_calls`` ...) are passed to the template untouched.
- **instruction** (``.jsonl``, ``data.prompt_field`` / ``data.completion_field``): ``[BOS] prompt
  completion [EOS]``, prompt and completion encoded separately (so the boundary is exact and
  no token straddles it), BOS when the tokenizer adds one (as ``data prepare`` does), EOS when
  it has one. Targets: the completion and the EOS, so the model learns to stop. A tokenizer
  without EOS (``byte``) cannot teach stopping; use a HF tokenizer for instruction tuning.
- **text** (``.jsonl`` field ``data.text_field``, or ``.txt`` = one document): ``[BOS] text
  [EOS]`` exactly as ``data prepare`` writes documents; every token is a target. Empty
  documents are skipped and counted (as ``data prepare`` does).

Errors name ``file:line`` and the fix (one line). Blank lines are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from datetime import datetime

from llmtrain.engine.data.chat_template import ChatTemplate, encode_chat, select_template, special_tokens_of
from llmtrain.engine.data.inputs import MAX_JSONL_LINE, SURROGATE_HINT, _read_txt, lone_surrogate
from llmtrain.errors import LLMTrainError
from llmtrain.safeio import human_bytes, open_regular, printable

FINETUNE_SOURCES = ("chat", "instruction", "text")
SUFFIXES = {"chat": (".jsonl",), "instruction": (".jsonl",), "text": (".jsonl", ".txt")}
ROLES = ("system", "user", "assistant", "tool")
ENCODE_BATCH = 512  # rows per encode_batch call (instruction, text)


@dataclass
class Encoded:
    """One sample: token ids, per-token target flags (``targets[0]`` is never a target), its origin."""

    ids: list[int]
    targets: list[bool]
    where: str


@dataclass
class Skipped:
    """A row that yields no sample (an empty text document)."""

    where: str
    why: str


def source_files(path: str | None, source: str) -> list[Path]:
    """The input files of ``data.path`` for ``source`` (a file, or a directory searched recursively)."""
    suffixes = SUFFIXES[source]
    shown = " or ".join(suffixes)
    if not path:
        raise LLMTrainError(f"data.source is {source} but data.path is not set",
                            f"set data.path to a {shown} file or a directory of them", path="data.path")
    root = Path(path).expanduser()
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.lower().endswith(suffixes))
        if not files:
            raise LLMTrainError(f"{printable(root)}: directory holds no {shown} file", f"put {source} rows in {shown} files",
                                path="data.path")
        return files
    if not root.exists():
        raise LLMTrainError(f"{printable(root)}: no such file or directory", "check data.path", path="data.path")
    if not root.name.lower().endswith(suffixes):
        raise LLMTrainError(f"{printable(root)}: data.source {source} reads {shown} files, not {root.suffix or 'this file'!r}",
                            f"convert it to {shown}, or pick the matching data.source", path="data.path")
    return [root]


def iter_rows(path: Path) -> Iterator[tuple[int, object]]:
    """``(line number, parsed JSON value)`` of every non-blank line of a ``.jsonl`` file."""
    f, _ = open_regular(path, "data file", field=printable(path))
    with f:
        for lineno, line in enumerate(iter(lambda: f.readline(MAX_JSONL_LINE + 1), b""), start=1):
            if len(line) > MAX_JSONL_LINE:
                raise LLMTrainError(f"{printable(path)}:{lineno}: line over the {human_bytes(MAX_JSONL_LINE)} limit",
                                    "write one row per line, each under the limit")
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except RecursionError:
                raise LLMTrainError(f"{printable(path)}:{lineno}: JSON nested too deeply", "write one flat JSON object per line") from None
            except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
                reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
                raise LLMTrainError(f"{printable(path)}:{lineno}: invalid JSON ({reason})", "each line must be one JSON object") from None
            if lone_surrogate(line, value):  # the whole row: a chat template may render any field of a message
                raise LLMTrainError(f"{printable(path)}:{lineno}: a string holds an unpaired surrogate escape "
                                    "(\\ud800-\\udfff), which is not Unicode text", SURROGATE_HINT)
            yield lineno, value


def _string_field(record: object, name: str, where: str, example: str) -> str:
    if not isinstance(record, dict):
        raise LLMTrainError(f"{where}: row is a {type(record).__name__}, not a JSON object", f"each line must be like {example}")
    value = record.get(name)
    if not isinstance(value, str):
        what = "missing" if value is None else f"a {type(value).__name__}, not a string"
        raise LLMTrainError(f"{where}: field {name!r} is {what}", f"each line must be like {example} (or set the data.*_field)")
    return value


def _messages(record: object, where: str) -> list[dict]:
    example = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'
    if not isinstance(record, dict):
        raise LLMTrainError(f"{where}: row is a {type(record).__name__}, not a JSON object", f"each line must be like {example}")
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        what = "missing" if messages is None else ("empty" if messages == [] else f"a {type(messages).__name__}, not a list")
        raise LLMTrainError(f"{where}: 'messages' is {what}", f"each line must be like {example}")
    for k, message in enumerate(messages):
        if not isinstance(message, dict):
            raise LLMTrainError(f"{where}: message {k} is a {type(message).__name__}, not an object", "write messages as {\"role\", \"content\"}")
        role = message.get("role")
        if role not in ROLES:
            raise LLMTrainError(f"{where}: message {k} has role {printable(role, 40)!r}", f"use one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise LLMTrainError(f"{where}: message {k} ({role}) has no string 'content'", "give every message a string content")
    return messages


def _framed(tokenizer, body: list[int]) -> list[int]:
    """``[BOS] body [EOS]`` with the BOS/EOS convention of ``data prepare``."""
    head = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    tail = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    return head + body + tail


def chat_samples(files: list[Path], tokenizer, data_cfg) -> Iterator[Encoded | Skipped]:
    where = printable(getattr(data_cfg, "tokenizer", "data.tokenizer"))
    date = getattr(data_cfg, "chat_date", None)
    now = None if date is None else datetime(date.year, date.month, date.day, 12)
    template = ChatTemplate(select_template(getattr(tokenizer, "chat_template", None), where), special_tokens_of(tokenizer),
                            where, now=now)
    if not hasattr(tokenizer, "_tok"):
        raise LLMTrainError(f"{where}: data.source chat needs a Hugging Face tokenizer with a chat template",
                            "set data.tokenizer to a tokenizer directory (tokenizer.json + tokenizer_config.json)", path="data.tokenizer")
    for path in files:
        for lineno, record in iter_rows(path):
            row = f"{printable(path)}:{lineno}"
            ids, mask = encode_chat(template, tokenizer, _messages(record, row), row)
            mask[0] = False  # the first token has no input before it
            yield Encoded(ids, mask, row)


def _batched(rows: Iterator[tuple[str, tuple[str, ...] | None]], tokenizer, combine) -> Iterator[Encoded | Skipped]:
    """Encode rows (``(where, texts)``; texts None = empty document) in batches, in order."""
    batch: list[tuple[str, tuple[str, ...] | None]] = []

    def flush():
        texts = [t for _, parts in batch if parts is not None for t in parts]
        encoded = iter(tokenizer.encode_batch(texts)) if texts else iter(())
        for where, parts in batch:
            if parts is None:
                yield Skipped(where, "empty")
            else:
                yield combine(where, [next(encoded) for _ in parts])

    for item in rows:
        batch.append(item)
        if len(batch) >= ENCODE_BATCH:
            yield from flush()
            batch = []
    yield from flush()


def instruction_samples(files: list[Path], tokenizer, data_cfg) -> Iterator[Encoded | Skipped]:
    pf, cf = data_cfg.prompt_field, data_cfg.completion_field
    example = f'{{"{pf}": "...", "{cf}": "..."}}'

    def rows():
        for path in files:
            for lineno, record in iter_rows(path):
                where = f"{printable(path)}:{lineno}"
                prompt = _string_field(record, pf, where, example)
                yield where, (prompt, _string_field(record, cf, where, example))

    def combine(where, parts):
        prompt, completion = parts
        ids = _framed(tokenizer, prompt + completion)
        n_prompt = len(ids) - len(completion) - (tokenizer.eos_id is not None)
        return Encoded(ids, [False] * n_prompt + [True] * (len(ids) - n_prompt), where)

    return _batched(rows(), tokenizer, combine)


def text_samples(files: list[Path], tokenizer, data_cfg) -> Iterator[Encoded | Skipped]:
    field = data_cfg.text_field
    example = f'{{"{field}": "..."}}'

    def rows():
        for path in files:
            if path.name.lower().endswith(".txt"):
                for text, _ in _read_txt(path):
                    yield printable(path), ((text,) if text else None)
                continue
            for lineno, record in iter_rows(path):
                where = f"{printable(path)}:{lineno}"
                text = _string_field(record, field, where, example)
                yield where, ((text,) if text else None)

    def combine(where, parts):
        ids = _framed(tokenizer, parts[0])
        return Encoded(ids, [False] + [True] * (len(ids) - 1), where)

    return _batched(rows(), tokenizer, combine)


SOURCES = {"chat": chat_samples, "instruction": instruction_samples, "text": text_samples}


def iter_samples(source: str, files: list[Path], tokenizer, data_cfg) -> Iterator[Encoded | Skipped]:
    """Every row of ``files`` as an :class:`Encoded` sample (or :class:`Skipped`), in file/line order."""
    return SOURCES[source](files, tokenizer, data_cfg)
