"""The shape of a checkpoint's ``metadata.json``, checked before anything uses it.

A checkpoint directory is untrusted input (docs/security.md): it may have been copied from
elsewhere, damaged, or crafted. Every reader of ``metadata.json`` (``llmtrain ckpt list |
inspect | export``, ``llmtrain resume``, the engine's restore and auto-resume) goes through
:func:`load_meta`, which

* reads the file with :func:`llmtrain.safeio.read_regular` (a regular file, at most
  :data:`META_CAP` bytes — a FIFO, ``/dev/zero`` or a directory is refused, nothing hangs);
* parses JSON (deep nesting, bad UTF-8 and non-objects are refused, never a traceback);
* validates it with :class:`CheckpointMeta` (pydantic, strict types, unknown keys refused)
  and reports the first wrong field in one line that names the file:
  ``.../step-4/metadata.json: files.'../x': path leaves the checkpoint directory``;
* refuses file names that could leave the directory: absolute paths, ``..`` or empty
  segments, backslashes, NUL and control characters (``metadata.json`` may not list itself).
  Symlinks are checked on disk by :func:`llmtrain.engine.checkpoint_store.verify`.

Pure Python (pydantic, no torch): ``ckpt list`` and ``resume`` use it before torch is imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llmtrain.errors import LLMTrainError
from llmtrain.safeio import MIB, inside, printable, read_regular

FORMAT = 1
META = "metadata.json"
META_CAP = 64 * MIB  # the recipe + one entry per file: a 10,000-rank checkpoint is ~2 MB
MAX_FILES = 1_000_000
MAX_INT = 2**62
HINT = "the checkpoint is damaged or was not written by llmtrain; use another one (--ckpt step-N)"
DimName = Literal["pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"]


def rel_problem(rel: str) -> str | None:
    """Why the relative file name ``rel`` (from ``metadata.json``) is unsafe, or None."""
    if not rel:
        return "empty file name"
    if len(rel) > 1024:
        return "file name longer than 1024 characters"
    if rel.startswith("/"):
        return "absolute path (must be relative to the checkpoint directory)"
    if "\\" in rel or not rel.isprintable():
        return "backslash or control character in the file name"
    parts = rel.split("/")
    if ".." in parts:
        return "path leaves the checkpoint directory ('..')"
    if any(p in ("", ".") for p in parts):
        return "empty or '.' path segment"
    if rel == META:
        return f"{META} cannot list itself"
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FileEntry(_Strict):
    """One file of the checkpoint as committed."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the file's bytes (lowercase hex).")
    bytes: int = Field(ge=0, le=MAX_INT, description="Size of the file in bytes.")


class SamplerState(_Strict):
    consumed_samples: int = Field(ge=0, le=MAX_INT, description="Global sample position of the data sampler.")


class LoRABase(_Strict):
    """The Hugging Face base of an adapters-only LoRA checkpoint (:mod:`llmtrain.engine.finetune.base`)."""

    path: str = Field(min_length=1, max_length=4096, description="The checkpoint.init_from_hf directory, resolved.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Fingerprint of its files (names, sizes, headers, "
                                                               "sampled data blocks).")
    files: int = Field(ge=1, le=MAX_FILES, description="Files the fingerprint covers.")


class CheckpointMeta(_Strict):
    """``metadata.json`` as :func:`llmtrain.engine.checkpoint_store.commit` writes it. Only
    ``format``, ``step`` and ``files`` are required here (the store's own bookkeeping);
    the fields a resume needs are asked for with ``require=`` (:func:`missing`)."""

    format: int = Field(ge=1, le=FORMAT, description="Layout version of the checkpoint directory.")
    step: int = Field(ge=0, le=MAX_INT, description="Optimizer steps completed when saved.")
    files: dict[str, FileEntry] = Field(max_length=MAX_FILES,
                                        description="Every file of the checkpoint (relative path) and its checksum.")
    tokens_seen: int | None = Field(None, ge=0, le=MAX_INT, description="Tokens trained on.")
    consumed_samples: int | None = Field(None, ge=0, le=MAX_INT, description="Global sample position.")
    sampler: SamplerState | None = Field(None, description="The data sampler's state.")
    world_size: int | None = Field(None, ge=1, le=MAX_INT, description="Ranks that saved it.")
    dims: dict[DimName, int] | None = Field(None, description="ParallelDims degrees it was saved with.")
    grad_accum: int | None = Field(None, ge=1, le=MAX_INT, description="Gradient accumulation steps when saved.")
    recipe: dict[str, Any] | None = Field(None, description="The resolved recipe of the run.")
    versions: dict[str, str] | None = Field(None, description="torch, python, llmtrain versions.")
    created: str | None = Field(None, max_length=64, description="UTC time of the save.")
    lora_base: LoRABase | None = Field(None, description="LoRA with checkpoint.init_from_hf: the base the adapters "
                                                         "were trained on (the checkpoint holds only the adapters).")

    @field_validator("files")
    @classmethod
    def _safe_names(cls, files: dict[str, FileEntry]) -> dict[str, FileEntry]:
        for rel in files:
            why = rel_problem(rel)
            if why is not None:
                raise ValueError(f"{printable(repr(rel), 120)}: {why}")
        return files

    @field_validator("dims")
    @classmethod
    def _positive(cls, dims: dict[str, int] | None) -> dict[str, int] | None:
        for k, v in (dims or {}).items():
            if not 1 <= v <= MAX_INT:
                raise ValueError(f"{k}={v} is not a degree >= 1")
        return dims

    @field_validator("recipe")
    @classmethod
    def _sections(cls, recipe: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in ("model", "parallel", "train", "checkpoint"):
            if recipe is not None and recipe.get(key) is not None and not isinstance(recipe[key], dict):
                raise ValueError(f"recipe.{key} is {type(recipe[key]).__name__}, not a mapping")
        return recipe

    def as_dict(self) -> dict:
        """The document as read (keys that were absent stay absent)."""
        return self.model_dump(mode="json", exclude_unset=True)


RESUME_FIELDS = ("sampler", "consumed_samples", "tokens_seen", "world_size", "dims")


def missing(meta: CheckpointMeta, fields: tuple[str, ...]) -> list[str]:
    return [f for f in fields if getattr(meta, f) is None]


def validation_line(exc: ValidationError) -> str:
    """The first error of ``exc`` as ``dotted.location: message`` (+ how many more)."""
    errors = exc.errors(include_url=False)
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    loc = ".".join(printable(part, 80) for part in first.get("loc", ())) or "(document)"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    msg = str(first.get("msg", "")).removeprefix("Value error, ")
    return f"{loc}: {printable(msg, 200)}{more}"


def parse_meta(raw: bytes, where: str) -> CheckpointMeta:
    """Validate the bytes of a ``metadata.json``; :class:`LLMTrainError` names ``where``."""
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise LLMTrainError(f"{where}: JSON nested too deeply", HINT, path="--ckpt") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise LLMTrainError(f"{where}: not JSON ({printable(exc, 120)})", HINT, path="--ckpt") from None
    if not isinstance(doc, dict):
        raise LLMTrainError(f"{where}: not a JSON object (a {type(doc).__name__})", HINT, path="--ckpt")
    try:
        return CheckpointMeta.model_validate(doc)
    except ValidationError as exc:
        raise LLMTrainError(f"{where}: {validation_line(exc)}", HINT, path="--ckpt") from None
    except RecursionError:
        raise LLMTrainError(f"{where}: nested too deeply", HINT, path="--ckpt") from None


def load_meta(ckpt_dir: str | Path, require: tuple[str, ...] = ()) -> CheckpointMeta:
    """The validated ``metadata.json`` of ``ckpt_dir``; with ``require``, those optional fields
    must be present too (e.g. :data:`RESUME_FIELDS`)."""
    path = Path(ckpt_dir) / META
    where = printable(path)
    if not inside(ckpt_dir, path):
        raise LLMTrainError(f"{where}: resolves outside the checkpoint directory (symlink)", HINT, path="--ckpt")
    try:
        raw = read_regular(path, "checkpoint metadata", META_CAP, field="--ckpt", hint=HINT)
    except LLMTrainError as exc:  # safeio's message already names the file
        raise LLMTrainError(exc.problems[0].message, HINT, path="--ckpt") from None
    meta = parse_meta(raw, where)
    absent = missing(meta, require)
    if absent:
        raise LLMTrainError(f"{where}: no {', '.join(absent)} (needed to resume)", HINT, path="--ckpt")
    return meta
