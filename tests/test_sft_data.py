"""Fine-tuning data: chat templates and loss masks, instruction/text sources, truncation, packing, step target counts.

Real parts: tokenizer directories written by transformers' own ``save_pretrained`` (a byte-level
BPE really trained with ``tokenizers``, and the committed examples/sft tokenizer), jsonl/txt files
on disk, and transformers' ``apply_chat_template`` as the reference for ids and assistant masks.
Everything is compared exactly (integers): there is no tolerance anywhere in this file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmtrain.engine.data import build_data, check_finetune_data, load_tokenizer
from llmtrain.engine.data.chat_template import ChatTemplate
from llmtrain.errors import LLMTrainError
from llmtrain.recipe.load import load_recipe_text
from llmtrain.recipe.schema import DataConfig

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "sft"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]

# ChatML with {% generation %} blocks, BOS from the special-tokens map, a namespace, loop controls,
# tojson and raise_exception: the transformers features a Hub template uses.
GEN_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{% if m['role'] == 'assistant' %}{% set ns.n = ns.n + 1 %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% elif m['role'] == 'tool' %}{{ '<|im_start|>tool\\n' + (m['content'] | tojson) + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there, how are you?"}, {"role": "assistant", "content": "Fine, thanks! And you?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
     {"role": "assistant", "content": "six, in words: s-i-x"}],
    [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "Let me check."},
     {"role": "tool", "content": "{\"temp\": \"21°C\"}"}, {"role": "assistant", "content": "It is 21 °C — nice."}],
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows), encoding="utf-8")
    return path


def save_tokenizer(out: Path, template, bos: str | None = "<s>") -> Path:
    """A byte-level BPE (vocab 320) trained on real text, saved by transformers with ``template``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [json.__doc__ or "", Path(json.__file__).read_text()[:20000]] + [m["content"] for c in CONVERSATIONS for m in c]
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = template
    fast.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def gen_tok(tmp_path_factory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("gen_tok"), GEN_TEMPLATE)


def chat_cfg(path, tokenizer, **kw) -> DataConfig:
    return DataConfig(source="chat", path=str(path), tokenizer=str(tokenizer), **kw)


def targets_of(dataset, row: int) -> list[int]:
    s = dataset.sample(row)
    return s["labels"][s["labels"] != -100].tolist()


# ---------------------------------------------------------------------------------------------
# chat templates and masks


def test_generation_template_ids_and_mask_equal_transformers(gen_tok, tmp_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(gen_tok))
    data = build_data(chat_cfg(write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS]), gen_tok),
                      256, 512, 0)
    for row, conv in enumerate(CONVERSATIONS):
        ref = hf.apply_chat_template(conv, return_assistant_tokens_mask=True, return_dict=True)
        a, b = data.offsets[row], data.offsets[row + 1]
        assert data.tokens[a:b].tolist() == ref["input_ids"]
        mask = data.targets[a:b].tolist()
        assert mask == [bool(x) for x in ref["assistant_masks"]]
        assert sum(mask) > 0 and ref["input_ids"][0] == hf.convert_tokens_to_ids("<s>")  # bos_token came from the map
        # unpacked row: labels = next token where the next token is in the mask
        s = data.sample(row)
        want = [t if m else -100 for t, m in zip(ref["input_ids"][1:], ref["assistant_masks"][1:])]
        assert s["labels"][:len(want)].tolist() == want and (s["labels"][len(want):] == -100).all()
        assert s["inputs"][:len(want)].tolist() == ref["input_ids"][:-1]


@pytest.mark.parametrize("kind", ["example", "bpe"])
def test_prefix_masks_cover_exactly_replies_and_end_of_turn(tmp_path, kind):
    """ChatML without generation blocks (the committed example's character tokenizer, and the same
    template on a trained BPE whose tokens span several characters): ids equal transformers'
    ``apply_chat_template``; the mask, checked by hand, is exactly each reply + ``<|im_end|>``."""
    from transformers import AutoTokenizer

    tok_dir = EXAMPLE / "tokenizer"
    if kind == "bpe":
        tok_dir = save_tokenizer(tmp_path / "tok", (EXAMPLE / "tokenizer" / "chat_template.jinja").read_text(), bos=None)
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    tok = load_tokenizer(str(tok_dir))
    data = build_data(chat_cfg(write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS]), tok_dir),
                      256, 512, 0)
    for row, conv in enumerate(CONVERSATIONS):
        a, b = data.offsets[row], data.offsets[row + 1]
        ids, mask = data.tokens[a:b].tolist(), data.targets[a:b].tolist()
        assert ids == hf.apply_chat_template(conv, return_dict=False)
        assert kind == "example" or len(ids) < len(hf.apply_chat_template(conv, tokenize=False)) * 0.7  # multi-char tokens
        runs, cur = [], []  # maximal runs of masked tokens
        for t, m in zip(ids, mask):
            if m:
                cur.append(t)
            elif cur:
                runs, cur = runs + [cur], []
        runs += [cur] if cur else []
        assert runs == [tok.encode(m["content"] + "<|im_end|>") for m in conv if m["role"] == "assistant"]
        header = tok.encode("<|im_start|>assistant\n")
        for r_start in [j for j in range(1, len(ids)) if mask[j] and not mask[j - 1]]:
            assert ids[r_start - len(header):r_start] == header


def test_named_templates_use_default(tmp_path):
    out = save_tokenizer(tmp_path / "tok", None)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "{{ raise_exception('not me') }}"},
                            {"name": "default", "template": GEN_TEMPLATE}]
    cfg_path.write_text(json.dumps(cfg))
    data = build_data(chat_cfg(write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}]), out), 256, 512, 0)
    assert data.summary.samples == 1 and data.summary.target_tokens > 0
    cfg["chat_template"] = [{"name": "other", "template": GEN_TEMPLATE}]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(LLMTrainError, match="none named 'default'"):
        build_data(chat_cfg(tmp_path / "c.jsonl", out), 256, 512, 0)


@pytest.mark.parametrize("hostile", [
    "{% include '/etc/hostname' %}",
    "{% import 'SECRET' as s %}",
    "{{ cycler.__init__.__globals__.os.popen('cat SECRET').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ (messages | first).update({'role': 'x'}) }}{{ messages.append(1) }}",
    "{% set ns = namespace(__init__=1) %}",
    "{{ raise_exception(lipsum.__globals__['os'].listdir('/')) }}",
    "{{ 'x' * 10 ** 10 }}",
    "{{ ['x'] * 100000000 }}",
])
def test_hostile_template_cannot_read_files_or_run_code(tmp_path, hostile):
    secret = tmp_path / "SECRET"
    secret.write_text("top-secret-value")
    hostile = hostile.replace("SECRET", str(secret))
    out = save_tokenizer(tmp_path / "tok", hostile)
    rows = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(LLMTrainError) as info:
        build_data(chat_cfg(rows, out), 256, 512, 0)
    text = str(info.value)
    assert "top-secret-value" not in text and "\n" not in text
    assert f"{rows}:1" in text or "chat template" in text


def test_template_raise_exception_and_syntax_errors_are_one_line():
    t = ChatTemplate("{% if messages | length > 2 %}{{ raise_exception('too long: ' ~ messages | length) }}{% endif %}x")
    assert t.render(CONVERSATIONS[0])[0] == "x"
    with pytest.raises(LLMTrainError, match="row 7: chat template failed: too long: 5"):
        t.render(CONVERSATIONS[1], row="row 7")
    with pytest.raises(LLMTrainError, match="chat template line 1"):
        ChatTemplate("{% for x in %}")


# ---------------------------------------------------------------------------------------------
# bad data: one line naming file:line


BAD_CHAT = [
    ('"just a string"', "not a JSON object"),
    ({"text": "no messages"}, "'messages' is missing"),
    ({"messages": "hi"}, "not a list"),
    ({"messages": []}, "'messages' is empty"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
    ({"messages": [{"role": "user", "content": 3}]}, "no string 'content'"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "renders no assistant reply"),
    ("{not json", "invalid JSON"),
    # valid JSON, not Unicode: the tokenizer raised a TypeError traceback (unseeded fuzz, thirty-fourth session)
    ('{"messages": [{"role": "user", "content": "a \\udc00"}, {"role": "assistant", "content": "b"}]}',
     "unpaired surrogate escape"),
]


@pytest.mark.parametrize("bad,why", BAD_CHAT)
@pytest.mark.parametrize("tokenizer", ["gen", "example"])
def test_bad_chat_rows_name_file_and_line(gen_tok, tmp_path, bad, why, tokenizer):
    tok = gen_tok if tokenizer == "gen" else EXAMPLE / "tokenizer"
    rows = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}, "", bad])
    with pytest.raises(LLMTrainError) as info:
        build_data(chat_cfg(rows, tok), 256, 512, 0)
    assert len(info.value.lines()) == 1 and f"{rows}:3" in str(info.value) and why in str(info.value)


@pytest.mark.parametrize("source,row,why", [
    ("instruction", {"prompt": "p"}, "field 'completion' is missing"),
    ("instruction", {"prompt": 1, "completion": "c"}, "field 'prompt' is a int"),
    ("text", {"body": "x"}, "field 'text' is missing"),
    ("text", [1, 2], "not a JSON object"),
    ("instruction", '{"prompt": "p \\ud800", "completion": "c"}', "unpaired surrogate escape"),
])
def test_bad_instruction_and_text_rows_name_file_and_line(tmp_path, source, row, why):
    good = {"prompt": "a", "completion": "b", "text": "c"}
    rows = write_jsonl(tmp_path / "d.jsonl", [good, row])
    with pytest.raises(LLMTrainError) as info:
        build_data(DataConfig(source=source, path=str(rows), tokenizer=str(EXAMPLE / "tokenizer")), 64, 512, 0)
    assert f"{rows}:2" in str(info.value) and why in str(info.value)


def test_tokenizer_and_path_errors(tmp_path):
    rows = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(LLMTrainError, match="no chat template"):
        build_data(chat_cfg(rows, "byte"), 64, 512, 0)
    with pytest.raises(LLMTrainError, match="larger than the model's vocab_size 50") as info:
        build_data(chat_cfg(rows, EXAMPLE / "tokenizer"), 64, 50, 0)
    assert info.value.problems[0].path == "model.vocab_size"
    with pytest.raises(LLMTrainError, match="data.path is not set"):
        build_data(DataConfig(source="text"), 64, 512, 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LLMTrainError, match="holds no .jsonl"):
        build_data(chat_cfg(tmp_path / "empty", EXAMPLE / "tokenizer"), 64, 512, 0)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(LLMTrainError, match="reads .jsonl or .txt files"):
        build_data(DataConfig(source="text", path=str(tmp_path / "x.csv")), 64, 512, 0)


# ---------------------------------------------------------------------------------------------
# instruction and text sources


def test_instruction_masks_completion_and_eos(tmp_path):
    tok = load_tokenizer(str(EXAMPLE / "tokenizer"))  # eos <|im_end|>, no bos
    rows = write_jsonl(tmp_path / "i.jsonl", [{"q": "What is up?", "a": " The sky."}, {"q": "x", "a": ""}])
    cfg = DataConfig(source="instruction", path=str(rows), tokenizer=str(EXAMPLE / "tokenizer"), prompt_field="q", completion_field="a")
    data = build_data(cfg, 64, 512, 0)
    p, c = tok.encode("What is up?"), tok.encode(" The sky.")
    s = data.sample(0)
    assert s["inputs"][:len(p) + len(c)].tolist() == p + c
    assert targets_of(data, 0) == c + [tok.eos_id]
    assert s["labels"][:len(p) - 1].tolist() == [-100] * (len(p) - 1)  # no loss on the prompt
    assert targets_of(data, 1) == [tok.eos_id]  # empty completion: still learns to stop
    assert data.summary.samples == 2 and data.summary.target_tokens == len(c) + 2
    byte = build_data(cfg.model_copy(update={"tokenizer": "byte"}), 64, 512, 0)  # no eos: the empty completion has no target
    assert byte.summary.samples == 1 and byte.summary.dropped_no_targets == 1
    assert targets_of(byte, 0) == list(b" The sky.")


def test_text_jsonl_and_txt_follow_prepare_convention(tmp_path):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    write_jsonl(d / "b.jsonl", [{"text": "hello world"}, {"text": ""}, {"text": "second"}])
    (d / "sub" / "a.txt").write_text("a txt document\n")
    (d / "notes.md").write_text("ignored")
    tok = load_tokenizer(str(EXAMPLE / "tokenizer"))
    data = build_data(DataConfig(source="text", path=str(d), tokenizer=str(EXAMPLE / "tokenizer")), 64, 512, 0)
    docs = ["hello world", "second", "a txt document\n"]  # sorted paths: b.jsonl before sub/a.txt
    assert data.summary.rows_read == 4 and data.summary.dropped_empty == 1 and data.summary.files == 2
    assert "b.jsonl:2 (empty)" in data.summary.first_dropped[0]
    for row, doc in enumerate(docs):
        ids = tok.encode(doc) + [tok.eos_id]
        s = data.sample(row)
        assert s["inputs"][:len(ids) - 1].tolist() == ids[:-1] and targets_of(data, row) == ids[1:]  # every token a label
        assert (s["inputs"][len(ids) - 1:] == 0).all()  # padded with pad id <|endoftext|> = 0


# ---------------------------------------------------------------------------------------------
# over-long samples


def test_overlong_truncate_and_drop_counts(tmp_path):
    long_prompt = {"messages": [{"role": "user", "content": "x" * 200}, {"role": "assistant", "content": "ok"}]}
    long_reply = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "y" * 200}]}
    short = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "ok"}]}
    rows = write_jsonl(tmp_path / "c.jsonl", [short, long_prompt, long_reply, short])
    tok = EXAMPLE / "tokenizer"
    cut = build_data(chat_cfg(rows, tok, overlong="truncate"), 64, 512, 0)
    s = cut.summary
    assert (s.rows_read, s.samples, s.truncated, s.dropped_no_targets, s.dropped_overlong) == (4, 3, 1, 1, 0)
    assert s.first_dropped == [f"{rows}:2 (no target tokens left after truncation)"]
    assert cut.offsets[2] - cut.offsets[1] == 65  # seq_len + 1 tokens kept
    y = load_tokenizer(str(tok)).encode("y")
    assert targets_of(cut, 1) == y * len(targets_of(cut, 1)) and len(targets_of(cut, 1)) > 10  # only reply characters survive
    drop = build_data(chat_cfg(rows, tok, overlong="drop"), 64, 512, 0).summary
    assert (drop.samples, drop.truncated, drop.dropped_overlong, drop.dropped) == (2, 0, 2, 2)
    assert "2 dropped: 2 over-long" in drop.line() and drop.as_dict()["dropped"] == 2
    with pytest.raises(LLMTrainError, match="no chat sample left"):
        build_data(chat_cfg(rows, tok), 4, 512, 0)


def test_check_finetune_data_builds_like_the_engine():
    text = f"""model: {{preset: debug-dense}}
train: {{seq_len: 256}}
data: {{source: chat, path: {EXAMPLE / 'chat.jsonl'}, tokenizer: {EXAMPLE / 'tokenizer'}, packing: true}}
"""
    recipe = load_recipe_text(text, default_name="t")
    summary = check_finetune_data(recipe)
    engine = build_data(recipe.data, 256, recipe.model.vocab_size, 0)
    assert summary.as_dict() == engine.summary.as_dict()
    assert (summary.rows_read, summary.samples, summary.rows) == (200, 200, engine.length) and engine.length < 200
    assert summary.line().startswith("chat: 200 rows from ") and "packed into" in summary.line()
    assert check_finetune_data(load_recipe_text("model: {preset: debug-dense}", default_name="t")) is None


def test_template_that_renders_prefixes_differently_is_refused():
    """Without generation blocks a reply is located by prefix rendering; a template whose earlier
    turns change when a message is appended cannot be masked reliably and must be refused."""
    from llmtrain.engine.data.chat_template import encode_chat

    tok = load_tokenizer(str(EXAMPLE / "tokenizer"))
    t = ChatTemplate("{% for m in messages %}{{ m['content'] }}{% if loop.last %}<|im_end|>{% endif %}{% endfor %}")
    with pytest.raises(LLMTrainError, match=r"f.jsonl:4: the chat template renders conversation prefixes inconsistently"):
        encode_chat(t, tok, CONVERSATIONS[1], "f.jsonl:4")


def test_strftime_now_renders_the_recipe_date(tmp_path):
    """data.chat_date fixes what strftime_now renders (Llama 3.x's 'Today Date'), on every rank and resume."""
    from datetime import datetime

    from llmtrain.engine.data.chat_template import ChatTemplate

    source = '{{ strftime_now("%d %b %Y") }}|{% for m in messages %}{{ m.content }}{% endfor %}'
    fixed = ChatTemplate(source, now=datetime(2024, 7, 26, 12))
    assert fixed.render([{"role": "user", "content": "x"}])[0] == "26 Jul 2024|x"
    assert ChatTemplate(source).render([{"role": "user", "content": "x"}])[0].startswith(datetime.now().strftime("%d %b"))
