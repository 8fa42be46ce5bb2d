"""The run's tokenizer files, copied into an HF export, and the bos/eos ids they define.

Where the tokenizer comes from (the checkpoint's ``recipe.data``): ``data.tokenizer`` when it
is a path — a ``tokenizer.json`` file, or a directory holding ``tokenizer.json`` /
``tokenizer_config.json`` / ``special_tokens_map.json`` (an HF model directory, or a data
directory from ``llmtrain data prepare``) — else the prepared data directory ``data.path``
(``data prepare`` saves the tokenizer it used there). ``byte`` and ``bpe:N`` name no file;
a ``byte`` tokenizer (``tokenizer.llmtrain.json``) has no HF form and is not copied.

Tokenizer files are data (untrusted, docs/security.md): regular files only, ``tokenizer.json``
at most 256 MiB and the small JSON files 16 MiB, copied byte for byte (never parsed beyond
finding the special tokens). A path that no longer exists (the run came from another
machine) is a warning on stderr, not an error: the weights are still worth exporting.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from llmtrain.errors import LLMTrainError
from llmtrain.safeio import MIB, printable, read_regular

FILES = {"tokenizer.json": 256 * MIB, "tokenizer_config.json": 16 * MIB, "special_tokens_map.json": 16 * MIB}
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<bos>", "[BOS]")


def tokenizer_sources(spec: str | None, data_path: str | None) -> list[Path]:
    """The files to copy (possibly none)."""
    for cand in (spec, data_path):
        if not cand or cand == "byte" or cand.startswith("bpe:"):
            continue
        p = Path(cand).expanduser()
        if p.is_file() and p.name.endswith(".json") and p.name != "tokenizer.llmtrain.json":
            return [p]
        if p.is_dir():
            found = [p / n for n in FILES if (p / n).exists()]
            if found:
                return found
    return []


def copy_tokenizer(source: tuple[str | None, str | None], out: Path) -> list[Path]:
    """Copy the run's tokenizer files into ``out``; returns the files written."""
    spec, data_path = source
    files = tokenizer_sources(spec, data_path)
    if not files and spec and spec != "byte" and not spec.startswith("bpe:") and not Path(spec).exists():
        print(f"warning: data.tokenizer {printable(spec)} not found; no tokenizer files exported", file=sys.stderr)
    written = []
    for f in files:
        name = "tokenizer.json" if f.name not in FILES else f.name
        data = read_regular(f, "tokenizer file", FILES[name], field="data.tokenizer")
        (out / name).write_bytes(data)
        written.append(out / name)
    return written


def _token(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def special_ids(out: Path) -> dict[str, int | None]:
    """``{"bos_token_id", "eos_token_id"}`` of the exported tokenizer (None when it has none):
    the tokens ``tokenizer_config.json`` names, else the usual candidates, looked up in
    ``tokenizer.json``'s added tokens and vocabulary."""
    from llmtrain.engine.data.tokenizer import EOS_CANDIDATES

    try:
        tok = json.loads(read_regular(out / "tokenizer.json", "tokenizer file", FILES["tokenizer.json"]))
    except (LLMTrainError, ValueError, RecursionError):
        return {}
    ids: dict[str, int] = {}
    if isinstance(tok, dict):
        vocab = (tok.get("model") or {}).get("vocab") if isinstance(tok.get("model"), dict) else None
        if isinstance(vocab, dict):
            ids.update({k: v for k, v in vocab.items() if isinstance(k, str) and type(v) is int})
        for added in tok.get("added_tokens") or []:
            if isinstance(added, dict) and isinstance(added.get("content"), str) and type(added.get("id")) is int:
                ids[added["content"]] = added["id"]
    conf = {}
    if (out / "tokenizer_config.json").exists():
        try:
            conf = json.loads(read_regular(out / "tokenizer_config.json", "tokenizer file", FILES["tokenizer_config.json"]))
        except (LLMTrainError, ValueError, RecursionError):
            conf = {}
    conf = conf if isinstance(conf, dict) else {}

    def find(key: str, candidates: tuple[str, ...]) -> int | None:
        named = _token(conf.get(key))
        for t in ((named,) if named else candidates):
            if t in ids:
                return ids[t]
        return None

    return {"bos_token_id": find("bos_token", BOS_CANDIDATES), "eos_token_id": find("eos_token", EOS_CANDIDATES)}
