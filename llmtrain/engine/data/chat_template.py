"""Chat templates: render ``{messages: [...]}`` rows the way transformers' ``apply_chat_template`` does, plus loss masks.

A chat template is a Jinja string from the tokenizer directory (untrusted data, see DESIGN §4).
:class:`ChatTemplate` compiles and renders it with the semantics of transformers 5.x
(``transformers/utils/chat_template_utils.py`` and ``PreTrainedTokenizerBase.apply_chat_template``),
re-implemented here so that the data pipeline needs neither transformers nor code from the
directory:

- a ``jinja2.sandbox.ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``,
  the ``loopcontrols`` extension and a ``{% generation %}...{% endgeneration %}`` tag; no loader,
  so ``{% include %}`` / ``{% import %}`` cannot reach a file, and the sandbox refuses
  underscore attributes (``__class__``, ``__globals__``) and every mutating method. A template
  can therefore neither read files nor run code; it can only produce a string (tested with a
  hostile template). Beyond transformers, ``seq * n`` and ``a ** b`` are capped (memory bombs);
  a template can still loop for long (the sandbox caps ``range`` at 100k items, not nesting);
- globals ``raise_exception(msg)`` (a template error, reported as one line naming the row),
  ``strftime_now(fmt)``, ``dict`` and ``namespace`` (which refuses underscore names), and a
  ``tojson`` filter without HTML escaping (``ensure_ascii=False``, ``indent``, ``separators``,
  ``sort_keys``), as transformers defines them;
- variables ``messages``, ``tools=None``, ``documents=None``, ``add_generation_prompt`` and the
  tokenizer's named special tokens that are set (``bos_token``, ``eos_token``, ``unk_token``,
  ``sep_token``, ``pad_token``, ``cls_token``, ``mask_token``: transformers' ``special_tokens_map``);
- messages are normalized as transformers does: keys whose value is ``null`` are dropped, and a
  reasoning text given as ``reasoning_content`` / ``thinking`` / ``reasoning`` is offered under
  ``thinking`` and ``reasoning_content`` too;
- a template dict (named templates) uses ``"default"`` (no tools are passed, so never ``tool_use``).

Token ids are the tokenizer's encoding of the rendered string **without adding special tokens**
(the template writes BOS and turn markers itself), exactly as transformers does.

Loss masks (:func:`encode_chat`), a token is a target when it overlaps a span of characters:

- the template has ``{% generation %}`` blocks: the spans are the characters those blocks
  rendered, and a token is marked when its character offsets overlap one (transformers'
  ``return_assistant_tokens_mask`` rule, one ordered pass over spans and tokens);
- otherwise, per assistant message ``k``: the characters that ``render(messages[:k+1])`` adds to
  ``render(messages[:k], add_generation_prompt=True)``, i.e. the reply's content and the
  template's end-of-turn marker; trailing whitespace of that difference (the newline the
  template puts *between* turns, after ``<|im_end|>``) is not a target, because at inference the
  model stops at the end-of-turn token and never generates it. Each prefix must render as a
  prefix of the whole conversation (true for ChatML, Llama 3, Mistral ...); a template that
  renders earlier turns differently (e.g. strips reasoning of old turns) is refused with a hint
  to add ``{% generation %}`` blocks, never masked by guesswork. Cost: 2 renders per assistant
  message plus one, once per row when the dataset is built.
"""

from __future__ import annotations

import json
import re
from contextvars import ContextVar
from datetime import datetime

from llmtrain.errors import LLMTrainError
from llmtrain.safeio import printable

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
MAX_REPEAT = 1 << 24  # items a template's `seq * n` may produce
MAX_EXPONENT = 4096  # a template's `a ** b`: no huge integers
TEMPLATE_HINT = "fix the chat template of the tokenizer (tokenizer_config.json or chat_template.jinja)"

# (rendered pieces so far, spans) of the render in progress; None when spans are not tracked.
_TRACKING: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("llmtrain_chat_spans", default=None)


def _environment(now=None):
    """The sandboxed Jinja environment (built once per template; jinja2 imported lazily).

    ``now``: the datetime ``strftime_now`` renders (templates such as Llama 3.x's put today's
    date into the system header). The recipe's ``data.chat_date`` fixes it (``llmtrain launch``
    writes the launch date there, into recipe.lock.yaml), so that every rank, a resume and a
    rebuild render the same text; None falls back to the clock, like transformers."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationSpans(Extension):
        """``{% generation %}BODY{% endgeneration %}`` renders BODY and records its character span.

        The start offset is the length of everything the template has yielded so far, which is
        exact for blocks at the template's top level (loops and ifs included), as in transformers."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_record", []), [], [], body).set_lineno(lineno)

        def _record(self, caller):
            text = caller()
            state = _TRACKING.get()
            if state is not None:
                pieces, spans = state
                start = sum(len(p) for p in pieces)
                spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return (now or datetime.now()).strftime(fmt)

    class SafeDict:
        """``dict(...)`` for templates, without exposing the ``dict`` type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class SafeNamespace(jinja2.utils.Namespace):
        """``namespace(...)`` that refuses underscore names (no route to CPython internals)."""

        def __init__(*args, **kwargs):
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                SafeNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            SafeNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set the namespace attribute {name!r}")

    class Sandbox(ImmutableSandboxedEnvironment):
        """Transformers' sandbox plus a size cap on ``*`` / ``**`` (``'x' * 10**10`` would exhaust memory)."""

        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
                raise jinja2.exceptions.SecurityError(f"exponent {right} is over the {MAX_EXPONENT} limit of a chat template")
            if operator == "*":
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT:
                    raise jinja2.exceptions.SecurityError(f"repeating a sequence {n} times is over the {MAX_REPEAT} item limit")
            return super().call_binop(context, operator, left, right)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationSpans, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=SafeDict(), namespace=SafeNamespace)
    return env


def select_template(template: str | dict[str, str] | None, where: str) -> str:
    """The template string to use: the string itself, or the ``"default"`` of a named set."""
    if isinstance(template, dict):
        if "default" not in template:
            raise LLMTrainError(f"{where}: the tokenizer has named chat templates {sorted(template)} but none named 'default'",
                                "name the chat template to train with 'default' in tokenizer_config.json")
        template = template["default"]
    if not isinstance(template, str) or not template.strip():
        raise LLMTrainError(f"{where}: the tokenizer has no chat template (needed by data.source chat)",
                            "use a tokenizer directory whose tokenizer_config.json (or chat_template.jinja) has a "
                            "chat_template, or use data.source instruction", path="data.tokenizer")
    return template


def special_tokens_of(tokenizer) -> dict[str, str]:
    """The named special tokens a template sees (transformers' ``special_tokens_map``; set ones only)."""
    config = getattr(tokenizer, "config", None)
    if config is None:
        return {}
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = getattr(config, name, None)
        if value is None:  # sep/cls/mask are not HFConfig fields: read them from the raw config
            raw = config.raw.get(name)
            value = raw.get("content") if isinstance(raw, dict) else raw
        if isinstance(value, str):
            out[name] = value
    return out


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: null-valued keys dropped, reasoning aliased."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """A compiled, sandboxed chat template; :meth:`render` returns the text and the generation spans."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, where: str = "chat template",
                 now=None):
        import jinja2

        self.source = source
        self.where = where
        self.special_tokens = dict(special_tokens or {})
        self.has_generation = bool(GENERATION_TAG.search(source))
        try:
            self._template = _environment(now).from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise LLMTrainError(f"{where}: chat template line {exc.lineno}: {printable(exc.message, 160)}", TEMPLATE_HINT) from None
        except Exception as exc:  # noqa: BLE001 - any compile failure of an untrusted template is one line
            raise LLMTrainError(f"{where}: chat template does not compile ({printable(exc, 160)})", TEMPLATE_HINT) from None

    def render(self, messages: list[dict], add_generation_prompt: bool = False, row: str = "") -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: the rendered conversation and the character spans of its generation blocks."""
        pieces: list[str] = []
        spans: list[tuple[int, int]] = []
        variables = {**self.special_tokens, "messages": normalize_messages(messages), "tools": None, "documents": None,
                     "add_generation_prompt": bool(add_generation_prompt)}
        token = _TRACKING.set((pieces, spans))
        try:
            for piece in self._template.generate(**variables):
                pieces.append(piece)
        except Exception as exc:  # noqa: BLE001 - raise_exception, SecurityError, UndefinedError, TypeError ...
            kind = "refused" if type(exc).__name__ == "SecurityError" else "failed"
            raise LLMTrainError(f"{row or self.where}: chat template {kind}: {printable(exc, 160)}",
                                "fix the row's messages, or the chat template") from None
        finally:
            _TRACKING.reset(token)
        return "".join(pieces), spans


def mark_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Tokens whose character offsets overlap a span (one ordered pass, as transformers does)."""
    mask = [False] * len(offsets)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[t] = True
    return mask


def _assistant_spans(template: ChatTemplate, messages: list[dict], full: str, row: str) -> list[tuple[int, int]]:
    """Prefix rendering: per assistant message, the characters its turn adds after the generation prompt."""
    spans = []
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, _ = template.render(messages[:k], add_generation_prompt=True, row=row)
        after, _ = template.render(messages[:k + 1], row=row)
        if not (after.startswith(before) and full.startswith(after)):
            raise LLMTrainError(f"{row}: the chat template renders conversation prefixes inconsistently (message {k}), "
                                "so the assistant reply cannot be located",
                                "add {% generation %}...{% endgeneration %} around the assistant replies in the template")
        end = len(before) + len(after[len(before):].rstrip())
        if end > len(before):
            spans.append((len(before), end))
    return spans


def encode_chat(template: ChatTemplate, tokenizer, messages: list[dict], row: str) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, per token, whether it is a loss target."""
    full, spans = template.render(messages, row=row)
    if not template.has_generation:
        spans = _assistant_spans(template, messages, full, row)
    ids, offsets = encode_with_offsets(tokenizer, full)
    mask = mark_spans(offsets, spans)
    if not any(mask):
        where = "{% generation %} blocks" if template.has_generation else "assistant messages"
        raise LLMTrainError(f"{row}: the chat template renders no assistant reply (no tokens in {where})",
                            "every chat row needs at least one non-empty assistant message")
    return ids, mask


def encode_with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """``(ids, character offsets)`` of ``text`` without added special tokens (HF tokenizers only).

    Reads the ``tokenizers.Tokenizer`` inside :class:`~llmtrain.engine.data.tokenizer.HFTokenizer`
    (``_tok``): the same call ``HFTokenizer.encode`` makes, with the offsets it drops."""
    encoding = tokenizer._tok.encode(text, add_special_tokens=False)
    return list(encoding.ids), list(encoding.offsets)
