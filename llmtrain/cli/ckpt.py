"""``llmtrain ckpt``: list, inspect and verify a run's checkpoints; export one to Hugging Face.

Examples::

    llmtrain ckpt list runs/debug/<run id>                     # step, state, latest, layout, size, created
    llmtrain ckpt inspect runs/debug/<run id> --ckpt step-20   # metadata, files, sha256 integrity
    llmtrain ckpt inspect runs/debug/<run id>/checkpoints --json
    llmtrain ckpt export runs/debug/<run id> --hf out/hf       # safetensors shards + config.json
    llmtrain ckpt export runs/debug/<run id> --hf out/hf --dtype bf16 --max-shard-size 2GB --workers 4
    llmtrain ckpt export runs/sft/<run id> --peft out/adapter --hf out/merged  # a LoRA run

``RUN_DIR`` is a run directory (its ``recipe.lock.yaml`` names ``checkpoint.dir``, default
``RUN_DIR/checkpoints``), a checkpoint root (holding ``latest`` / ``step-N/``), or one
``step-N/`` directory. Decisions:

* Checkpoint directories are untrusted (docs/security.md): every command validates
  ``metadata.json``'s shape (:mod:`llmtrain.engine.checkpoint_meta`) and reports a wrong one
  in one line that names the file, exit 2 — ``list`` prints the table first, marking such a
  checkpoint ``invalid``. Nothing is read through a symlink that leaves the checkpoint.
* ``inspect`` runs the check ``resume`` runs (:func:`check_all`: files inside the checkpoint,
  regular, size and sha256 against ``metadata.json``, no unlisted file DCP would read, DCP's
  ``.metadata`` through the allow-list unpickler, the RNG states with
  ``torch.load(weights_only=True)``) and exits 2 when the inspected checkpoint is damaged,
  naming each bad file. ``--ckpt latest`` inspects the one ``latest`` points to (not a
  fallback: the point is to see it), and says which intact one ``resume`` would fall back to;
  a damaged ``latest`` pointer itself is an error.
* ``export --hf`` writes the family's HF directory (:mod:`llmtrain.engine.hf.export`: sharded
  safetensors written by parallel workers, each reading from the checkpoint only its shards'
  tensors, from any saved layout; config.json, generation_config.json, tokenizer files). It verifies the checkpoint first, like
  ``resume``: ``latest`` falls back to the newest intact one with a warning; the index's model
  tensors must be exactly those of ``metadata.json``'s ``recipe.model``.
* LoRA runs (``recipe.train.lora``): ``--hf`` merges the adapters into the base; ``--peft`` writes
  a PEFT adapter directory (:mod:`llmtrain.engine.finetune.peft_export`; a run without
  ``checkpoint.init_from_hf`` also gets its base there, as ``base/``). An adapters-only
  checkpoint reads its base from ``checkpoint.init_from_hf`` (or ``--base DIR``) after checking
  the fingerprint it recorded; a changed base is refused in one line. ``--peft`` on a run
  without LoRA is refused.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import typer

from llmtrain.cli.app import app, report_errors
from llmtrain.errors import LLMTrainError, Problem
from llmtrain.safeio import inside, printable

ckpt_app = typer.Typer(no_args_is_help=True, help="List, inspect (verify) and export checkpoints (Hugging Face).")
app.add_typer(ckpt_app, name="ckpt")

DIR_RE = re.compile(r"^step-(\d+)(\.tmp)?$")
RUN_HELP = "Run directory, checkpoint root (with latest / step-N/) or one step-N/ directory."
CKPT_HELP = "Checkpoint: latest | step-N | PATH."


def checkpoint_root(run_dir: Path) -> tuple[Path, Path | None]:
    """``(root, the step directory RUN_DIR itself names or None)``."""
    from llmtrain.engine.checkpoint_store import LATEST, META

    d = Path(run_dir)
    if not d.is_dir():
        raise LLMTrainError(f"{d}: no such directory", "pass a run directory or a checkpoint directory", path="RUN_DIR")
    lock = d / "recipe.lock.yaml"
    if lock.is_file():
        return lock_checkpoint_dir(lock) or d / "checkpoints", None
    if (d / "checkpoints").is_dir():
        return d / "checkpoints", None
    if (d / META).is_file() or DIR_RE.match(d.name):
        return d.parent, d
    if (d / LATEST).is_file() or any(DIR_RE.match(p.name) for p in d.iterdir()):
        return d, None
    raise LLMTrainError(f"{d}: neither a run directory nor a checkpoint directory (no recipe.lock.yaml, "
                        "checkpoints/, latest or step-N/)", "pass RUN_DIR made by `llmtrain launch`", path="RUN_DIR")


def lock_checkpoint_dir(lock: Path) -> Path | None:
    """``checkpoint.dir`` of a run's ``recipe.lock.yaml`` (None: the default), read capped."""
    import yaml

    from llmtrain.safeio import MIB, read_regular

    try:
        doc = yaml.safe_load(read_regular(lock, "recipe lock file", 16 * MIB, field="RUN_DIR"))
    except (yaml.YAMLError, ValueError, RecursionError):
        return None
    conf = doc.get("checkpoint") if isinstance(doc, dict) else None
    value = conf.get("dir") if isinstance(conf, dict) else None
    return Path(value) if isinstance(value, str) and value else None


def pick(root: Path, spec: str, named: Path | None) -> Path:
    """The directory ``spec`` names (no verification). ``latest`` is the one the pointer names;
    a damaged pointer is an error that says which checkpoint ``resume`` would use instead."""
    from llmtrain.engine.checkpoint_store import STEP_RE, check_latest, committed

    if spec == "latest":
        if named is not None:
            return named
        pointed, problem = check_latest(root)
        if problem is not None:
            fallback = next((p.name for p in reversed(committed(root)) if not verify(p, root)), None)
            raise LLMTrainError(problem, f"`resume --ckpt latest` would use {fallback} instead" if fallback
                                else "no intact checkpoint to fall back to", path="--ckpt")
        if pointed is not None and (root / pointed).is_dir():
            return root / pointed
        found = committed(root)
        if not found:
            raise LLMTrainError(f"no committed checkpoint under {printable(root)}", "train with checkpoint.interval > 0",
                                path="--ckpt")
        return found[-1]
    path = root / spec if STEP_RE.match(spec) else Path(spec)
    if not path.is_dir():
        raise LLMTrainError(f"{printable(path)}: no such checkpoint directory", "see `llmtrain ckpt list RUN_DIR`",
                            path="--ckpt")
    return path


def verify(path: Path, root: Path | None) -> list[str]:
    """Every problem of a checkpoint, DCP's index included (what ``resume`` checks)."""
    return check_all(path, root)[1]


def check_all(path: Path, root: Path | None) -> tuple[object, list[str]]:
    from llmtrain.engine.checkpoint_verify import check, index_problems

    meta, problems = check(path, root if root is not None and path.parent == root else None)
    if meta is not None and not problems:
        problems = index_problems(path, meta)
    return meta, problems


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def layout(dims: dict | None) -> str:
    if not dims:
        return "?"
    return " ".join(f"{k}{v}" for k, v in dims.items() if v != 1) or "1 process"


def lsize(path: Path) -> int | None:
    """Size of the entry itself (a symlink is not followed out of the checkpoint)."""
    try:
        return os.lstat(path).st_size
    except OSError:
        return None


def disk_bytes(path: Path) -> int:
    from llmtrain.engine.checkpoint_verify import walk_files

    return sum(lsize(path / rel) or 0 for rel in walk_files(path))


def read_meta(path: Path) -> tuple[dict | None, str | None]:
    """``(validated metadata.json, None)``, ``(None, None)`` when there is none (not committed), or
    ``(None, problem)`` when it is not a valid one."""
    from llmtrain.engine.checkpoint_meta import META, load_meta
    from llmtrain.engine.checkpoint_verify import message_of

    if not os.path.lexists(path / META):
        return None, None
    try:
        return load_meta(path).as_dict(), None
    except LLMTrainError as exc:
        return None, message_of(exc, printable(path / META))


def list_rows(root: Path) -> tuple[list[dict], list[str]]:
    """Rows of ``ckpt list`` and the problems found (a malformed ``metadata.json``, a bad ``latest``)."""
    from llmtrain.engine.checkpoint_store import check_latest

    latest, latest_problem = check_latest(root)
    rows, problems = [], [latest_problem] if latest_problem else []
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        m = DIR_RE.match(p.name)
        if not m or not p.is_dir():
            continue
        outside = not inside(root, p)
        meta, problem = (None, None) if m.group(2) else read_meta(p) if not outside else (
            None, f"{printable(p)}: resolves outside the checkpoint root (symlink)")
        if problem:
            problems.append(problem)
        state = "tmp" if m.group(2) else "committed" if meta else "invalid" if problem else "incomplete"
        meta = meta or {}
        rows.append({"name": p.name, "step": int(m.group(1)), "state": state, "latest": p.name == latest,
                     "dims": meta.get("dims"), "layout": layout(meta.get("dims")),
                     "world_size": meta.get("world_size"), "bytes": 0 if outside else disk_bytes(p),
                     "created": meta.get("created"), "path": str(p)})
    return sorted(rows, key=lambda r: (r["step"], r["state"] == "tmp")), problems


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


@ckpt_app.command("list")
@report_errors
def list_cmd(run_dir: Path = typer.Argument(..., help=RUN_HELP),
             as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """Table of the run's checkpoints: step, committed/tmp, latest, layout, world size, size, created."""
    root, _ = checkpoint_root(run_dir)
    rows, problems = list_rows(root)
    if as_json:
        typer.echo(json.dumps({"root": str(root), "checkpoints": rows, "problems": problems}, indent=1))
    elif not rows:
        typer.echo(f"no checkpoints under {printable(root)}")
    else:
        head = ["step", "state", "latest", "layout", "world", "size", "created", "name"]
        body = [[str(r["step"]), r["state"], "*" if r["latest"] else "", r["layout"], str(r["world_size"] or "?"),
                 human(r["bytes"]), printable(r["created"] or "?", 40), r["name"]] for r in rows]
        typer.echo(f"{printable(root)}\n" + table([head, *body]))
    if problems:  # shown after the table: the intact checkpoints are still listed
        raise LLMTrainError([Problem("RUN_DIR", p, "see `llmtrain ckpt inspect RUN_DIR --ckpt step-N`")
                             for p in problems])


def model_summary(model: dict) -> str:
    moe = model.get("moe") if isinstance(model.get("moe"), dict) else {}
    experts = moe.get("num_experts", 1) or 1
    experts = experts if type(experts) is int else 1
    g = lambda k: printable(model.get(k), 40)  # noqa: E731  (untrusted values, echoed)
    text = (f"{g('preset') if model.get('preset') else 'custom'}: layers {g('layers')}, hidden {g('hidden')}, "
            f"heads {g('heads')}/{g('kv_heads')} kv, ffn {g('ffn_hidden')}, vocab {g('vocab_size')}")
    try:
        from llmtrain.plan.params import count_params
        from llmtrain.recipe.schema import ModelConfig

        text += f", {count_params(ModelConfig.model_validate(model)).total / 1e6:.2f}M params"
    except Exception:  # noqa: BLE001  (a summary, never a reason to fail inspect)
        pass
    return text + (f", MoE {experts} experts" if experts > 1 else ", dense")


def lora_summary(recipe: dict, base: dict | None) -> dict | None:
    """A LoRA checkpoint's adapters (``recipe.train.lora``) and where its frozen base is: in the
    checkpoint, or (``lora_base``: adapters only) the Hugging Face directory it was trained on, whose
    fingerprint ``resume``, ``eval`` and ``ckpt export`` check. None: not a LoRA run. Values are echoed
    from an untrusted file, so each goes through :func:`printable`; a damaged ``train.lora`` is shown as
    such, never a reason to fail inspect (the integrity check reports the file)."""
    train = recipe.get("train") if isinstance(recipe.get("train"), dict) else {}
    lora = train.get("lora")
    if lora is None:
        return None
    try:
        from llmtrain.recipe.schema import LoRAConfig

        cfg = LoRAConfig.model_validate(lora)
        targets = cfg.targets if isinstance(cfg.targets, str) else " ".join(cfg.targets)
        out = {"rank": cfg.rank, "alpha": cfg.alpha, "targets": targets, "dropout": cfg.dropout}
    except Exception:  # noqa: BLE001  (a summary, never a reason to fail inspect)
        out = {"damaged": printable(lora, 200)}
    out["base"] = ({"path": base.get("path"), "sha256": base.get("sha256"), "files": base.get("files")}
                   if isinstance(base, dict) else "in this checkpoint")
    return out


def inspect_report(path: Path, root: Path) -> dict:
    from llmtrain.engine.checkpoint_store import committed
    from llmtrain.engine.checkpoint_verify import walk_files

    checked, problems = check_all(path, root)
    meta = checked.as_dict() if checked is not None else {}
    files = []
    listed = meta.get("files") or {}
    outside = path.parent == root and not inside(root, path)  # do not even list what lies out of it
    for rel in sorted(set(listed) | set(() if outside else walk_files(path))):
        f = path / rel
        regular = os.path.isfile(f) and not os.path.islink(f)
        files.append({"file": rel, "bytes": lsize(f) if regular or os.path.islink(f) else None,
                      "expected_bytes": (listed.get(rel) or {}).get("bytes"), "listed": rel in listed,
                      "symlink": os.path.islink(f)})
    fallback = None
    if problems:
        fallback = next((p.name for p in reversed(committed(root)) if p != path and not verify(p, root)), None)
    recipe = meta.get("recipe") or {}
    return {"path": str(path), "step": meta.get("step"), "tokens_seen": meta.get("tokens_seen"),
            "consumed_samples": meta.get("consumed_samples"), "world_size": meta.get("world_size"),
            "dims": meta.get("dims"), "layout": layout(meta.get("dims")),
            "zero": (recipe.get("parallel") or {}).get("zero"), "grad_accum": meta.get("grad_accum"),
            "versions": meta.get("versions"), "created": meta.get("created"),
            "model": model_summary(recipe.get("model") or {}) if recipe.get("model") else None,
            "lora": lora_summary(recipe, meta.get("lora_base")),
            "files": files, "bytes": sum(f["bytes"] or 0 for f in files),
            "integrity": "ok" if not problems else "damaged", "problems": problems, "intact_fallback": fallback}


def print_report(r: dict) -> None:
    typer.echo(f"checkpoint {printable(r['path'])}")
    if r["step"] is not None:
        typer.echo(f"  step {r['step']}, {r['tokens_seen']} tokens, {r['consumed_samples']} samples consumed")
        typer.echo(f"  layout {r['layout']} zero{printable(r['zero'], 20)} on {r['world_size']} ranks "
                   f"(grad_accum {r['grad_accum']})")
        v = r["versions"] or {}
        typer.echo(f"  saved {printable(r['created'])} with torch {printable(v.get('torch'), 40)}, python "
                   f"{printable(v.get('python'), 40)}, llmtrain {printable(v.get('llmtrain'), 40)}")
    if r["model"]:
        typer.echo(f"  model {r['model']}")
    lora = r.get("lora")
    if lora:
        head = (f"LoRA (recipe.train.lora unreadable: {lora['damaged']})" if "damaged" in lora else
                f"LoRA rank {lora['rank']}, alpha {lora['alpha']:g} on {printable(lora['targets'], 80)}")
        base = lora["base"]
        where = ("the frozen base is in this checkpoint" if isinstance(base, str) else
                 f"adapters only: the frozen base is the Hugging Face directory {printable(base['path'], 300)} "
                 f"(fingerprint {printable(base['sha256'], 64)[:12]}..., {base['files']} files; resume, eval and ckpt "
                 "export check it, or take --base)")
        typer.echo(f"  {head}; {where}")
    if r["files"]:
        typer.echo(f"  files ({human(r['bytes'])}):")
        typer.echo(table([[f"    {printable(f['file'])}", human(f["bytes"]) if f["bytes"] is not None else "missing",
                           ("symlink " if f["symlink"] else "")
                           + ("" if f["listed"] or f["file"] == "metadata.json" else "(not in metadata.json)")]
                          for f in r["files"]]))
    if r["integrity"] == "ok":
        typer.echo(f"  integrity ok: {sum(f['listed'] for f in r['files'])} files match metadata.json (size, sha256)")
        return
    typer.echo("  integrity DAMAGED:")
    for p in r["problems"]:
        typer.echo(f"    {printable(p, 1000)}")
    if r["intact_fallback"]:
        typer.echo(f"  `resume --ckpt latest` would fall back to {r['intact_fallback']}")


@ckpt_app.command("inspect")
@report_errors
def inspect_cmd(run_dir: Path = typer.Argument(..., help=RUN_HELP),
                ckpt: str = typer.Option("latest", "--ckpt", help=CKPT_HELP),
                as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Metadata, per-file sizes and integrity (sha256) of one checkpoint; exit 2 if it is damaged."""
    root, named = checkpoint_root(run_dir)
    path = pick(root, ckpt, named)
    report = inspect_report(path, root)
    if as_json:
        typer.echo(json.dumps(report, indent=1))
    else:
        print_report(report)
    if report["problems"]:
        raise LLMTrainError(f"checkpoint {printable(path)} is damaged: " + "; ".join(report["problems"]),
                            "use another checkpoint (--ckpt step-N); `resume --ckpt latest` skips damaged ones",
                            path="--ckpt")


# registers `ckpt export` (its own module: the export path is a concept of its own)
from llmtrain.cli import ckpt_export as _ckpt_export  # noqa: F401
