"""What ``ckpt export --hf`` does differently for a LoRA checkpoint: where the base comes from,
which checkpoint tensors to expect, and merging per tensor.

The export itself stays :func:`llmtrain.engine.hf.export.export_hf` (sharded, parallel workers,
each reading only its shards' tensors, never the whole model at once); with a
:class:`LoRAExport` each worker builds every base tensor of its shard from

* the checkpoint (a run without ``checkpoint.init_from_hf``: it saved the frozen base), or
* the HF base directory (adapters-only checkpoints; its fingerprint was checked first by the
  caller, :func:`llmtrain.engine.finetune.base.check_base`), read by HF name with safetensors
  and converted to ours (:func:`~llmtrain.engine.hf.families.to_ours`: q/k rows permuted),

and, with ``merge`` (``--hf``), adds ``scale * B @ A`` of the tensor's adapters (fp64 sum) before
converting to HF names and order. ``merge=False`` writes the base alone (the base that
``--peft`` writes next to the adapters when the run has no HF base, :mod:`.peft_export`).

:func:`export_lora` is the whole ``ckpt export --hf/--peft`` of a LoRA checkpoint (the CLI only
parses and prints): fingerprint check of an adapters-only checkpoint's base, merged export,
PEFT export (+ ``base/`` when the run has no HF base).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llmtrain.errors import LLMTrainError
from llmtrain.safeio import printable


@dataclass(frozen=True)
class LoRAExport:
    """How a worker makes the base tensors of a LoRA checkpoint (picklable: sent to workers)."""

    scale: float
    merge: bool = True
    hf_files: dict[str, tuple[str, str]] = field(default_factory=dict)  # HF name -> (file, name in it); empty:
    # the base from the checkpoint

    @property
    def base_in_checkpoint(self) -> bool:
        return not self.hf_files


def hf_files_of(directory: str | Path, cfg) -> dict[str, str]:
    """HF tensor name -> (safetensors file, the tensor's name in it) of a checked base directory."""
    from llmtrain.engine.hf.files import check_hf_model

    model = check_hf_model(directory, cfg, "checkpoint.init_from_hf")
    return {name: (str(h.file), h.key or name) for name, h in model.tensors.items()}


def lora_entries(index, cfg, lora_cfg, spec: LoRAExport, ckpt: Path) -> dict[str, tuple[int, ...]]:
    """Check the index's ``model.*`` tensors are exactly a LoRA checkpoint of ``cfg`` (adapters,
    plus the base when the spec reads it from the checkpoint); return the base's shapes by DCP key."""
    from llmtrain.engine.finetune.lora import adapter_shapes
    from llmtrain.engine.hf.checkpoint_read import expected_model_shapes, shape_mismatch

    have = {k: tuple(v.size) for k, v in index.state_dict_metadata.items() if k.startswith("model.")}
    base = expected_model_shapes(cfg)
    want = {f"model.{k}": v for k, v in adapter_shapes(cfg, lora_cfg).items()}
    if spec.base_in_checkpoint:
        want.update(base)
    what = shape_mismatch(have, want)
    if what is not None:
        raise LLMTrainError(f"{printable(ckpt / '.metadata')}: tensors do not match metadata.json's recipe.model and "
                            f"train.lora ({what})",
                            "the checkpoint is damaged or crafted; use another one (--ckpt step-N)", path="--ckpt")
    return base


def checkpoint_keys(entries, spec: LoRAExport) -> set[str]:
    """DCP keys a worker loads from the checkpoint for ``entries`` (export plan entries)."""
    from llmtrain.engine.finetune.lora import adapter_keys

    keys = {e.key for e in entries} if spec.base_in_checkpoint else set()
    if spec.merge:
        for e in entries:
            keys.update(adapter_keys(e.key))
    return keys


class HFTensorReader:
    """Reads whole HF tensors by name from the base's files, keeping each file open once (a context manager)."""

    def __init__(self, files: dict[str, str]):
        from contextlib import ExitStack

        self.files, self.stack, self.open = files, ExitStack(), {}

    def get(self, name: str):
        from safetensors import safe_open

        path, key = self.files[name]  # the file, and the tensor's name in it (hf_files_of)
        if path not in self.open:
            self.open[path] = self.stack.enter_context(safe_open(path, framework="pt"))
        return self.open[path].get_tensor(key)

    def __enter__(self) -> "HFTensorReader":
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()


def base_tensor(entry, state: dict, spec: LoRAExport, reader: HFTensorReader | None):
    """Our full base tensor of ``entry`` (an export plan entry), merged with its adapters when
    ``spec.merge``. ``state``: what was loaded from the checkpoint (keys without ``model.``);
    ``reader``: the HF base's files (adapters-only checkpoints)."""
    from llmtrain.engine.finetune.lora import adapter_keys, merge_one
    from llmtrain.engine.hf.families import to_ours

    name = entry.key.removeprefix("model.")
    ours = state.pop(name) if spec.base_in_checkpoint else to_ours(entry.src, [reader.get(n) for n in entry.src.hf])
    a_key, b_key = adapter_keys(name)
    if spec.merge and a_key in state:
        ours = merge_one(ours, state.pop(a_key), state.pop(b_key), spec.scale)
    return ours


# -- the ``ckpt export`` of a LoRA checkpoint (called by llmtrain.cli.ckpt) ------------------------

def checkpoint_lora(path: Path, meta: dict):
    """The :class:`LoRAConfig` of ``metadata.json``'s ``recipe.train.lora`` (None: not a LoRA run)."""
    from pydantic import ValidationError

    from llmtrain.engine.checkpoint_meta import validation_line
    from llmtrain.recipe.schema import LoRAConfig

    train = (meta.get("recipe") or {}).get("train")
    lora = train.get("lora") if isinstance(train, dict) else None
    if lora is None:
        return None
    try:
        return LoRAConfig.model_validate(lora)
    except ValidationError as exc:
        raise LLMTrainError(f"{printable(path / 'metadata.json')}: recipe.train.lora.{validation_line(exc)}",
                            "the checkpoint's recipe is damaged", path="--ckpt") from None


def export_lora(path, meta, files, cfg, lora_cfg, hf, peft, base, dtype, max_bytes, workers, tokenizer):
    """``--hf`` (merged) and/or ``--peft`` (adapters) of a LoRA checkpoint; ``[(dir, files written)]``.
    An adapters-only checkpoint (``lora_base`` in its metadata) reads the base from its
    ``checkpoint.init_from_hf`` directory (or ``--base``) after checking its fingerprint."""
    from llmtrain.engine.finetune.base import check_base
    from llmtrain.engine.finetune.peft_export import export_peft
    from llmtrain.recipe.hf_dir import check_hf_dir
    from llmtrain.recipe.hf_gemma import is_multimodal
    from llmtrain.engine.hf.export import export_hf

    recorded = meta.get("lora_base")
    base_dir = None
    if base is not None and recorded is None:
        raise LLMTrainError(f"{printable(path)} holds its LoRA run's base weights (no checkpoint.init_from_hf)",
                            "drop --base", path="--base")
    if recorded is not None:
        base_dir = base or ((meta.get("recipe") or {}).get("checkpoint") or {}).get("init_from_hf")
        if not isinstance(base_dir, (str, Path)):
            base_dir = None
        check_base(base_dir, recorded, path, flag="--base" if base else "checkpoint.init_from_hf")
    hf_files = hf_files_of(base_dir, cfg) if base_dir is not None else {}
    outputs = []
    if hf is not None:
        spec = LoRAExport(scale=lora_cfg.scale, merge=True, hf_files=hf_files)
        outputs.append((hf, export_hf(path, files, cfg, hf, dtype, max_bytes, workers or None, tokenizer,
                                      lora=(lora_cfg, spec))))
    if peft is not None:
        if base_dir is None:  # the base lives only in the checkpoint: write it next to the adapters
            base_out = peft / "base"
            spec = LoRAExport(scale=lora_cfg.scale, merge=False)
            outputs.append((base_out, export_hf(path, files, cfg, base_out, dtype, max_bytes, workers or None,
                                                tokenizer, lora=(lora_cfg, spec))))
            base_name = str(base_out.resolve())
        else:
            base_name = str(Path(base_dir).resolve())
        multimodal = base_dir is not None and is_multimodal(check_hf_dir(Path(base_dir), "checkpoint.init_from_hf")[0])
        outputs.append((peft, export_peft(path, files, cfg, lora_cfg, peft, base_name, dtype, multimodal)))
    return outputs
