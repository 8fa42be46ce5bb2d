"""The frozen base of a LoRA run that starts from ``checkpoint.init_from_hf``: its fingerprint.

Such a run's checkpoints hold only the adapters and their AdamW state
(:mod:`llmtrain.engine.checkpoint_state`): the base is read again from the Hugging Face
directory on resume and on export, so the checkpoint records which base it was trained on
(``metadata.json`` ``lora_base``: the directory, a fingerprint and the file count) and every
later use checks it first (:func:`check_base`): adapters trained on one base and applied to
another would run without error and be silently wrong.

The fingerprint (:func:`fingerprint`) is a sha256 over, per file of the directory that a load
reads (``config.json``, the safetensors index when there is one, every weight file): its name,
its size, the sha256 of its safetensors header (names, dtypes, shapes, offsets) and of three
64 KiB blocks of its tensor data (start, middle, end). Hashing every byte would cost minutes
for a 70B base at every resume and export; headers alone would not tell two checkpoints of the
same architecture apart (their headers are identical), the sampled data blocks do. A change
that keeps every size and the sampled bytes (an edit of one weight in the middle of a file) is
not detected: this is a guard against the wrong or a re-downloaded base, not a checksum.
Pure Python (no torch): the directory is untrusted and read through the same checks as a load
(:func:`llmtrain.engine.hf.files.check_hf_dir`), every read capped.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from llmtrain.errors import LLMTrainError
from llmtrain.safeio import open_regular, printable

FLAG = "checkpoint.init_from_hf"
BLOCK = 64 * 1024
HEADER_CAP = 100 * 1000 * 1000  # safetensors' own header limit


def adapters_only(recipe) -> bool:
    """Whether this run's checkpoints leave the base out (LoRA with ``checkpoint.init_from_hf``)."""
    return recipe.train.lora is not None and recipe.checkpoint.init_from_hf is not None


def _file_line(path: Path, safetensors: bool, flag: str) -> str:
    fobj, size = open_regular(path, "model file", field=flag)
    with fobj:
        if not safetensors:
            data = fobj.read(16 * 2**20 + 1)  # config.json / the index: small, hashed whole (capped)
            return f"{path.name} {size} {hashlib.sha256(data).hexdigest()}"
        head = fobj.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or n > HEADER_CAP or 8 + n > size:
            raise LLMTrainError(f"{printable(path)}: not a safetensors file (header of {n} bytes, file of {size})",
                                "re-download the base model", path=flag)
        header = hashlib.sha256(head + fobj.read(n)).hexdigest()
        start, end = 8 + n, size
        blocks = hashlib.sha256()
        for at in sorted({start, max(start, (start + end) // 2 - BLOCK // 2), max(start, end - BLOCK)}):
            fobj.seek(at)
            blocks.update(fobj.read(BLOCK))
    return f"{path.name} {size} {header} {blocks.hexdigest()}"


def fingerprint(directory: str | Path, flag: str = FLAG) -> dict:
    """``{"path", "sha256", "files"}`` of the HF model directory (see the module docstring)."""
    from llmtrain.engine.hf.files import CONFIG, check_hf_dir
    from llmtrain.engine.hf.index import INDEX

    d = Path(directory)
    _, weights = check_hf_dir(d, flag)
    lines = [_file_line(d / CONFIG, False, flag)]
    if os.path.lexists(d / INDEX):
        lines.append(_file_line(d / INDEX, False, flag))
    lines += [_file_line(f, True, flag) for f in sorted(weights)]
    digest = hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()
    return {"path": str(d.resolve()), "sha256": digest, "files": len(lines)}


def check_base(directory: str | Path | None, recorded: dict | None, ckpt: str | Path, flag: str = FLAG) -> None:
    """Refuse, in one line, to use the adapters of checkpoint ``ckpt`` with a base other than the
    one they were trained on (``recorded``: its ``metadata.json`` ``lora_base``)."""
    shown = printable(ckpt)
    if recorded is None:
        raise LLMTrainError(f"{shown} holds the LoRA run's base weights (saved without {flag}), but {flag} is set",
                            f"resume or export it without {flag}", path=flag)
    if directory is None:
        raise LLMTrainError(f"{shown} holds only LoRA adapters; their base model was {printable(recorded['path'])}",
                            f"set {flag} to that directory", path=flag)
    now = fingerprint(directory, flag)
    if now["sha256"] != recorded["sha256"]:
        raise LLMTrainError(f"{printable(directory)} is not the base model the adapters in {shown} were trained on "
                            f"(fingerprint {now['sha256'][:12]}, recorded {recorded['sha256'][:12]} of "
                            f"{printable(recorded['path'])})",
                            "restore the original base weights, or point checkpoint.init_from_hf at them", path=flag)
