"""Fuzz: fine-tuning data files (chat, instruction, text JSONL) built as the engine and the launcher build them.

Hypothesis, derandomized (:data:`EXAMPLES` files). Each file is 1-4 lines after one good row of its source:
mostly valid rows of the file's source with arbitrary Unicode text (chat conversations of 1-3 turns, instruction pairs, text
documents), the same rows with one value replaced by any JSON (wrong types, nesting, unknown roles,
OpenAI-style content lists), and raw lines (random bytes, a BOM, CR endings, NUL, ``1e999``, JSON
arrays, unpaired and paired surrogate escapes). Through :func:`llmtrain.engine.data.build_data`
with the committed examples/sft tokenizer, packed or not, at sequence lengths 16-256.

Asserted for every file: it builds, or it raises :class:`LLMTrainError` in one line that names the
file (no other exception: an unpaired surrogate escape used to reach the tokenizer and raise a
``TypeError``, thirty-fourth session). Both outcomes must occur often, so the test cannot pass by
rejecting everything or by never meeting a bad row.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmtrain.engine.data import build_data
from llmtrain.errors import LLMTrainError
from llmtrain.recipe.schema import DataConfig

EXAMPLES = 300
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "sft"
GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]})

text = st.text(max_size=40)  # any Unicode scalar values (no lone surrogates: those come as escapes below)
any_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | text
    | st.sampled_from(["user", "assistant", "system", "tool", "", "developer"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["role", "content", "type", "text", "name", "messages", "prompt", "completion"]), inner, max_size=3),
    max_leaves=8)


@st.composite
def chat_row(draw) -> dict:
    turns = [{"role": "user", "content": draw(text)}, {"role": "assistant", "content": draw(text)}]
    if draw(st.booleans()):
        turns.insert(0, {"role": "system", "content": draw(text)})
    return {"messages": turns * draw(st.integers(1, 2))}


@st.composite
def mutated(draw, row: dict) -> object:
    """``row`` with one value (a whole message, a role, a content, a field) replaced by any JSON."""
    kind = draw(st.sampled_from(["field", "message", "role", "content"]))
    if kind == "field" or "messages" not in row:
        return {**row, draw(st.sampled_from([*row, "extra"])): draw(any_json)}
    messages = list(row["messages"])
    k = draw(st.integers(0, len(messages) - 1))
    if kind == "message":
        messages[k] = draw(any_json)
    else:
        messages[k] = {**messages[k], kind: draw(any_json)}
    return {**row, "messages": messages}


VALID = {"chat": chat_row(), "instruction": st.fixed_dictionaries({"prompt": text, "completion": text}),
         "text": st.fixed_dictionaries({"text": text})}
FIRST = {"chat": GOOD, "instruction": json.dumps({"prompt": "a", "completion": "b"}), "text": json.dumps({"text": "ok"})}
raw_lines = st.binary(max_size=24) | st.sampled_from([
    b"\xef\xbb\xbf" + GOOD.encode(), GOOD.encode() + b"\r", b"\x00", b"[]", b"1e999", b"{}",
    b'{"messages": [{"role": "user", "content": "a \\ud800"}, {"role": "assistant", "content": "b"}]}',
    b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}, {"role": "assistant", "content": "b"}]}',
    b'{"prompt": "p \\udfff", "completion": "c"}', b'{"text": "cut \\ud83d"}'])


def lines(source: str):
    """1-4 lines: mostly valid rows of ``source``, some with one value replaced, some raw."""
    valid = VALID[source].map(lambda r: json.dumps(r, ensure_ascii=False).encode())
    bad = VALID[source].flatmap(mutated).map(lambda r: json.dumps(r, ensure_ascii=False).encode())
    return st.lists(st.one_of(valid, valid, valid, valid, bad, raw_lines), min_size=1, max_size=4)


def test_fuzz_fine_tuning_data_files(tmp_path):
    outcomes: Counter = Counter()
    path = tmp_path / "rows.jsonl"

    source_and_lines = st.sampled_from(sorted(VALID)).flatmap(lambda s: st.tuples(st.just(s), lines(s)))

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(source_and_lines, st.booleans(), st.sampled_from([16, 64, 256]))
    def case(source_body, packing, seq_len):
        source, body = source_body
        path.write_bytes(b"\n".join([FIRST[source].encode(), *body]) + b"\n")
        cfg = DataConfig(source=source, path=str(path), tokenizer=str(EXAMPLE / "tokenizer"), packing=packing)
        try:
            build_data(cfg, seq_len, 512, 0)
        except LLMTrainError as exc:
            message = str(exc)
            assert "\n" not in message and path.name in message, message
            outcomes["refused"] += 1
            return
        outcomes["built"] += 1

    case()
    print(f"\ndata fuzz: {dict(outcomes)}")
    assert outcomes["built"] >= 40 and outcomes["refused"] >= 40, outcomes
