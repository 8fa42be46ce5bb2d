"""Tokenizers behind one small interface: ``byte``, a HF tokenizer (directory or ``tokenizer.json``), or a trained ``bpe:VOCAB``.

Every tokenizer offers ``encode(str) -> list[int]``, ``encode_batch(list[str])``,
``decode(list[int]) -> str``, ``vocab_size``, ``eos_id`` / ``bos_id`` (``None`` when it has
none), ``add_bos`` (whether a document starts with ``bos_id``) and ``save(dir)``.
:func:`load_tokenizer` turns a spec string into one::

    load_tokenizer("byte")                       # ids are the UTF-8 bytes, vocab 256, no EOS
    load_tokenizer("path/to/hf-model")           # a HF tokenizer directory (tokenizer.json + tokenizer_config.json)
    load_tokenizer("path/to/tokenizer.json")     # any Hugging Face tokenizers file
    load_tokenizer("data/prepared")              # a directory a tokenizer was saved to
    load_tokenizer("bpe:8000", train_texts=it)   # train byte-level BPE on an iterable of texts

Design decisions:

- **byte** is implemented directly (no HF): id = byte value, so any UTF-8 text round-trips
  exactly and the vocabulary is exactly 256. It has **no EOS id** (all 256 ids are bytes);
  document boundaries of prepared data live in ``index.npy`` instead. ``save`` writes
  ``tokenizer.llmtrain.json`` (not ``tokenizer.json``, which other tools would read as a HF file).
- **bpe:VOCAB** is GPT-2-style byte-level BPE (HF ``tokenizers``): ``ByteLevel`` pre-tokenizer
  (no prefix space) and decoder, the full 256-symbol byte alphabet as initial alphabet, and
  ``<|endoftext|>`` as the only special token (id 0, the EOS). No normalizer, so
  ``decode(encode(text)) == text`` for any text. VOCAB counts the special token and the 256
  byte symbols, so it must be >= 257.
- **HF tokenizers** are run by the ``tokenizers`` library only (never transformers, never code
  from the directory). Text is encoded with ``add_special_tokens=False``: no BOS/post-processor
  template inside documents; the data pipeline marks document boundaries itself (see
  docs/data.md). A ``tokenizer_config.json`` beside ``tokenizer.json`` (read by
  :mod:`llmtrain.engine.data.tokenizer_config`) names the EOS and BOS; without one the EOS is
  the first known end-of-text token in the vocabulary (``EOS_CANDIDATES``) and there is no BOS.
  ``add_bos`` is ``add_bos_token`` of the config when it says so, else whether the
  ``tokenizer.json`` post-processor puts the BOS first (Llama 3's ``TemplateProcessing``), i.e.
  what transformers does with ``add_special_tokens=True``. ``split_special_tokens: true`` is
  honoured (special-token strings in text are then encoded as plain text). Decoding keeps
  special tokens, so a literal special-token string in a text survives a round trip.
- ``tokenizers`` is imported lazily so that ``byte`` works (and the CLI starts) without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Protocol

from llmtrain.errors import LLMTrainError
from llmtrain.engine.data.tokenizer_config import CONFIG_FILE, HFConfig, read_hf_config, write_hf_config
from llmtrain.safeio import MIB, printable, read_text

EOS_TOKEN = "<|endoftext|>"
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
BYTE_FILE = "tokenizer.llmtrain.json"
HF_FILE = "tokenizer.json"
MAX_TOKENIZER_BYTES = 256 * MIB
SPEC_HINT = "use byte, a Hugging Face tokenizer directory (with tokenizer.json), PATH/tokenizer.json or bpe:VOCAB (e.g. bpe:8000)"


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    spec: str
    vocab_size: int
    eos_id: int | None
    bos_id: int | None
    add_bos: bool

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save(self, directory: Path) -> Path: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids: vocab 256, no EOS, exact round trip of any text."""

    spec = "byte"
    vocab_size = 256
    eos_id: int | None = None
    bos_id: int | None = None
    add_bos = False

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # errors="replace": a window cut mid-character still decodes (as U+FFFD) instead of raising.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> Path:
        path = Path(directory) / BYTE_FILE
        path.write_text(json.dumps({"type": "byte", "vocab_size": 256, "eos_id": None}) + "\n")
        return path

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` (plus its ``tokenizer_config.json``, if any) behind the common interface."""

    def __init__(self, tok, spec: str, config: HFConfig | None = None, source: str = ""):
        self._tok = tok
        self.spec = spec
        self.config = config
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        where = source or spec
        if config is not None and config.split_special_tokens:
            tok.encode_special_tokens = True
        if config is not None and config.eos_token is not None:
            self.eos_id = self._token_id(config.eos_token, "eos_token", where)
        else:
            self.eos_id = next((tok.token_to_id(t) for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        self.bos_id = None
        if config is not None and config.bos_token is not None:
            self.bos_id = self._token_id(config.bos_token, "bos_token", where)
        self.pad_id = None
        if config is not None and config.pad_token is not None:
            self.pad_id = self._token_id(config.pad_token, "pad_token", where)
        if self.bos_id is None:
            self.add_bos = False
        elif config.add_bos_token is not None:
            self.add_bos = config.add_bos_token
        else:  # what transformers does with add_special_tokens=True: the post-processor's template
            self.add_bos = tok.encode("", add_special_tokens=True).ids[:1] == [self.bos_id]

    def _token_id(self, token: str, name: str, where: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise LLMTrainError(f"{printable(where)}: {name} {printable(token, 60)!r} of {CONFIG_FILE} is not in the vocabulary",
                                f"fix {name} in {CONFIG_FILE} (or remove it) to match tokenizer.json")
        return int(token_id)

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """The Jinja chat template(s) of the directory: stored for fine-tuning, never rendered here."""
        return None if self.config is None else self.config.chat_template

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: Path) -> Path:
        """Write ``tokenizer.json`` and, when the tokenizer came with one, ``tokenizer_config.json``
        (chat template inside) and ``special_tokens_map.json``: the files a HF export copies."""
        path = Path(directory) / HF_FILE
        self._tok.save(str(path))
        if self.config is not None:
            write_hf_config(self.config, Path(directory))
        return path

    def __getstate__(self) -> dict:
        # Pickled (for --workers) as the JSON pipeline + config: rebuilt by __init__, so runtime
        # flags (split_special_tokens) are set again in the worker exactly as here.
        return {"json": self._tok.to_str(), "spec": self.spec, "config": self.config}

    def __setstate__(self, state: dict) -> None:
        tk = _import_tokenizers()
        self.__init__(tk.Tokenizer.from_str(state["json"]), state["spec"], state["config"])

    def __repr__(self) -> str:
        return (f"HFTokenizer(spec={self.spec!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
                f"bos_id={self.bos_id}, add_bos={self.add_bos})")


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise LLMTrainError("the 'tokenizers' package is not installed", "pip install tokenizers, or use --tokenizer byte") from None
    return tokenizers


def parse_bpe_vocab(spec: str) -> int:
    """The VOCAB of ``bpe:VOCAB``, validated (>= 257: 256 byte symbols + EOS)."""
    text = spec.split(":", 1)[1]
    try:
        vocab = int(text)
    except ValueError:
        raise LLMTrainError(f"tokenizer {spec!r}: vocabulary size {text!r} is not an integer", SPEC_HINT) from None
    if not 257 <= vocab <= 1 << 24:
        raise LLMTrainError(f"tokenizer {spec!r}: vocabulary size {vocab} out of range",
                            "use 257 <= VOCAB <= 16777216 (256 byte symbols + <|endoftext|> are always included)")
    return vocab


def train_bpe(texts: Iterable[str], vocab_size: int, spec: str | None = None) -> HFTokenizer:
    """Train a byte-level BPE on ``texts`` (any iterable of strings, consumed once)."""
    tk = _import_tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return HFTokenizer(tok, spec or f"bpe:{vocab_size}")


def _load_hf_file(path: Path, spec: str) -> HFTokenizer:
    """``path`` (a tokenizer.json); a ``tokenizer.json`` also brings the ``tokenizer_config.json`` beside it."""
    tk = _import_tokenizers()
    # Read through safeio (regular file, capped) and parse from the string: from_file would
    # block on a FIFO and read a device without end. Large real tokenizers are ~10-35 MB.
    text = read_text(path, "tokenizer file", MAX_TOKENIZER_BYTES, field=printable(path),
                     hint="pass the tokenizer.json of a Hugging Face tokenizer")
    try:
        tok = tk.Tokenizer.from_str(text)
    except Exception as exc:  # the Rust side raises a plain Exception with a serde message
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise LLMTrainError(f"{printable(path)}: not a valid Hugging Face tokenizer file ({printable(first, 120)})",
                            "pass the tokenizer.json of a Hugging Face tokenizer") from None
    # Only a file named tokenizer.json is one of a HF directory's files; its config names the EOS.
    config = read_hf_config(path.parent) if path.name == HF_FILE else None
    return HFTokenizer(tok, spec, config, source=str(path.parent / CONFIG_FILE) if config else str(path))


def load_tokenizer(spec: str, train_texts: Iterable[str] | None = None) -> Tokenizer:
    """Build the tokenizer named by ``spec``.

    ``spec`` is ``byte``, ``bpe:VOCAB`` (needs ``train_texts``), a ``.json`` tokenizer file, or a
    directory holding ``tokenizer.json`` (a HF tokenizer directory, with its
    ``tokenizer_config.json`` when present) or ``tokenizer.llmtrain.json`` (byte) as written by
    :meth:`save` / ``llmtrain data prepare``.
    """
    spec = str(spec).strip()
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        vocab = parse_bpe_vocab(spec)
        if train_texts is None:
            raise LLMTrainError(f"tokenizer {spec!r} must be trained first",
                                "run `llmtrain data prepare ... --tokenizer bpe:VOCAB`, then use the tokenizer.json it writes")
        return train_bpe(train_texts, vocab, spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / HF_FILE).is_file():
            return _load_hf_file(path / HF_FILE, str(path / HF_FILE))
        if (path / BYTE_FILE).is_file():
            return ByteTokenizer()
        extra = ""
        if (path / "tokenizer.model").exists() or (path / "vocab.json").exists():
            extra = ("; it holds only a 'slow' tokenizer: convert it once with transformers, "
                     "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)")
        raise LLMTrainError(f"tokenizer directory {printable(path)} holds neither {HF_FILE} nor {BYTE_FILE}{extra}", SPEC_HINT)
    if path.suffix == ".json":
        if not path.exists():
            raise LLMTrainError(f"tokenizer file {printable(path)} does not exist", SPEC_HINT)
        if path.name == BYTE_FILE:
            return ByteTokenizer()
        return _load_hf_file(path, spec)
    raise LLMTrainError(f"unknown tokenizer {spec!r}", SPEC_HINT)
