"""The parts of a Hugging Face tokenizer directory beside ``tokenizer.json``, read as untrusted data.

A directory written by ``transformers``' ``save_pretrained`` holds ``tokenizer.json`` (the
``tokenizers`` pipeline, loaded elsewhere), ``tokenizer_config.json`` (special-token names,
``add_bos_token``/``add_eos_token``, ``split_special_tokens``, ...), sometimes
``special_tokens_map.json`` (older transformers) and the chat template, either inside
``tokenizer_config.json["chat_template"]`` (transformers < 4.43 and many Hub repos) or in
``chat_template.jinja`` (transformers >= 4.43 / 5.x write it there). :func:`read_hf_config`
reads these into an :class:`HFConfig`; :func:`write_hf_config` writes them back.

Design decisions:

- **Untrusted, never executed.** Every file is read through :mod:`llmtrain.safeio` (regular
  file, size cap) and parsed with ``json.loads`` (a nesting bomb is a one-line error, not a
  ``RecursionError``). The chat template is a Jinja *string* kept for the fine-tuning work; it
  is never rendered here. ``auto_map`` (which points transformers at Python files of the
  directory, run with ``trust_remote_code``) is dropped when the config is written back: we do
  not copy those files, and a prepared data directory must never carry code.
- **Special tokens** may be a string, ``null`` or an ``AddedToken`` object
  (``{"content": "<s>", ...}``, as older transformers wrote them); anything else is an error
  naming the field. ``tokenizer_config.json`` wins over ``special_tokens_map.json``.
- **One place for the chat template when written back**: ``tokenizer_config.json`` (the file
  every exporter copies, and transformers 4.x and 5.x both read it from there); a separate
  ``chat_template.jinja`` is not written, so there are never two templates that disagree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from llmtrain.errors import LLMTrainError
from llmtrain.safeio import MIB, printable, read_json_object, read_text

CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
TEMPLATE_FILE = "chat_template.jinja"
MAX_CONFIG_BYTES = 64 * MIB  # Llama 3's is ~50 KB; added_tokens_decoder of huge vocabularies grows it
MAX_TEMPLATE_BYTES = 16 * MIB
SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
DROPPED_KEYS = ("auto_map",)
HINT = "pass a tokenizer directory written by transformers' save_pretrained"


@dataclass
class HFConfig:
    """What llmtrain uses from a tokenizer directory (``raw`` keeps the whole config to write back)."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    add_bos_token: bool | None = None  # None: not said; then the post-processor decides (see HFTokenizer)
    add_eos_token: bool | None = None
    split_special_tokens: bool = False
    chat_template: str | dict[str, str] | None = None
    raw: dict = field(default_factory=dict)


def _load_json(path: Path, what: str, cap: int) -> dict:
    return read_json_object(path, what, cap, hint=HINT)


def _token(value, path: Path, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise LLMTrainError(f"{printable(path)}: {name} is a {type(value).__name__}, not a token string",
                        f'write "{name}": "<token>" or null')


def _flag(raw: dict, key: str, path: Path) -> bool | None:
    value = raw.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise LLMTrainError(f"{printable(path)}: {key} is {printable(value, 40)!s}, not true/false", f"write \"{key}\": true or false")


def _template(value, path: Path) -> str | dict[str, str] | None:
    """A template string, or the named-template list form ``[{"name": ..., "template": ...}]``."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise LLMTrainError(f"{printable(path)}: chat_template is neither a string nor a list of {{name, template}}",
                        "fix or remove chat_template")


def read_hf_config(directory: Path) -> HFConfig | None:
    """The tokenizer config of ``directory``, or ``None`` when it has no ``tokenizer_config.json``."""
    directory = Path(directory)
    path = directory / CONFIG_FILE
    if not path.exists() and not path.is_symlink():
        return None
    raw = _load_json(path, "tokenizer config", MAX_CONFIG_BYTES)
    special = {}
    map_path = directory / SPECIAL_MAP_FILE
    if map_path.exists() or map_path.is_symlink():
        special = _load_json(map_path, "special tokens map", MAX_CONFIG_BYTES)
    tokens = {}
    for name in SPECIAL_NAMES:
        if name in raw:
            tokens[name] = _token(raw[name], path, name)
        else:
            tokens[name] = _token(special.get(name), map_path, name)
    template = _template(raw.get("chat_template"), path)
    jinja = directory / TEMPLATE_FILE
    if template is None and (jinja.exists() or jinja.is_symlink()):
        template = read_text(jinja, "chat template", MAX_TEMPLATE_BYTES, field=printable(jinja), hint=HINT)
    split = _flag(raw, "split_special_tokens", path)
    return HFConfig(**tokens, add_bos_token=_flag(raw, "add_bos_token", path),
                    add_eos_token=_flag(raw, "add_eos_token", path), split_special_tokens=bool(split),
                    chat_template=template, raw=raw)


def write_hf_config(config: HFConfig, directory: Path) -> list[Path]:
    """Write ``tokenizer_config.json`` (chat template inside) and ``special_tokens_map.json``."""
    directory = Path(directory)
    raw = {k: v for k, v in config.raw.items() if k not in DROPPED_KEYS}
    for name in SPECIAL_NAMES:
        raw[name] = getattr(config, name)
    if config.chat_template is None:
        raw.pop("chat_template", None)
    elif isinstance(config.chat_template, str):
        raw["chat_template"] = config.chat_template
    else:
        raw["chat_template"] = [{"name": k, "template": v} for k, v in config.chat_template.items()]
    path = directory / CONFIG_FILE
    path.write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    special = {name: getattr(config, name) for name in SPECIAL_NAMES if getattr(config, name) is not None}
    map_path = directory / SPECIAL_MAP_FILE
    map_path.write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return [path, map_path]
