"""Write the tiny chat fine-tuning example: a character-level HF tokenizer and ``chat.jsonl``.

    python examples/sft/make_tiny.py            # rewrites examples/sft/tokenizer/ and examples/sft/chat.jsonl

Deterministic (fixed vocabulary, ``random.Random(0)``): running it again gives the same bytes.

- ``tokenizer/``: written by transformers' own ``save_pretrained`` (``tokenizer.json``,
  ``tokenizer_config.json``, ``chat_template.jinja``) around a ``tokenizers`` BPE with no merges,
  i.e. one token per character: ids 0-3 are ``<|endoftext|>`` (pad), ``<|im_start|>``,
  ``<|im_end|>`` (eos: the end of an assistant turn), ``<unk>``; then newline, space and the 94
  printable ASCII characters (vocab 100). The chat template is ChatML without ``{% generation %}``
  blocks, like most Hub templates, so the loss mask comes from prefix rendering.
- ``chat.jsonl``: 200 conversations; the user prompt is 8-24 random letters/digits, every
  fourth row starts with a system message, and the assistant reply is always ``REPLY``. A model
  fine-tuned on it must learn to answer any prompt with that sentence and stop.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHARS = ["\n", " "] + [chr(c) for c in range(33, 127)]
REPLY = "The quick brown fox jumps over the lazy dog."
SYSTEM = "You are a terse assistant."
ROWS = 200
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))


def make_chat(path: Path) -> None:
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for i in range(ROWS):
            prompt = "".join(rng.choice(alphabet) for _ in range(rng.randint(8, 24)))
            messages = [{"role": "system", "content": SYSTEM}] if i % 4 == 0 else []
            messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": REPLY}]
            f.write(json.dumps({"messages": messages}) + "\n")


if __name__ == "__main__":
    make_tokenizer(HERE / "tokenizer")
    make_chat(HERE / "chat.jsonl")
    print(f"wrote {HERE / 'tokenizer'} and {HERE / 'chat.jsonl'} ({ROWS} rows)")
