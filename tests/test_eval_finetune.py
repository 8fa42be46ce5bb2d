"""The periodic eval of a fine-tuning run (``data.source`` chat / instruction / text with
``data.eval_path``): the held-out file is read as the training data is (template, masks), one
sample per row, and the loss is the token-weighted mean over the target tokens (docs/eval.md).

One process (a 1-rank group): the chat example trained 2 steps with an eval at step 2; the row's
loss is recomputed here from the final weights, the rows ``build_sft_data`` makes of the same file
(unpacked) and ``F.cross_entropy`` over their targets, within 1e-6 relative (fp32: the same
forward, a different summation order). The multi-rank layouts are in tests/test_eval_layouts.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers_cli import cli_in_process as cli

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples/sft/tiny-chat.yaml"
CHAT = ROOT / "examples/sft/chat.jsonl"
SETS = ["train.steps=2", "train.eval_interval=2", "train.eval_batches=1", f"data.eval_path={CHAT}",
        "cluster.gpus_per_node=1", "checkpoint.async=false"]


def test_chat_eval_is_the_token_weighted_loss_over_the_replies(tmp_path):
    """... and ``llmtrain eval RUN --data FILE.jsonl`` of that run's checkpoint reads the file as the
    run reads its data: the same number for the same samples (the 8 held-out lines here)."""
    from llmtrain.engine.data.sft import build_sft_data
    from llmtrain.engine.eval_main import single_process_group
    from llmtrain.engine.trainer import train
    from llmtrain.recipe.load import load_recipe

    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(CHAT.read_text().splitlines(keepends=True)[:8]))
    recipe = load_recipe(RECIPE, SETS[:3] + [f"data.eval_path={heldout}"] + SETS[4:])
    run = tmp_path / "run"
    with single_process_group() as device:
        res = train(recipe, device, run_dir=str(run), verbose=False)
        model = res.parts.parts[0]
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if "eval_loss" in r]
        assert [r["step"] for r in evals] == [2]
        gbs = recipe.train.global_batch_size
        data = build_sft_data(recipe.data.model_copy(update={"path": str(heldout), "packing": False}),
                              recipe.train.seq_len, recipe.model.vocab_size)
        samples = [data.sample(i) for i in range(gbs)]
        inputs = torch.from_numpy(np.stack([s["inputs"] for s in samples]))
        labels = torch.from_numpy(np.stack([s["labels"] for s in samples]))
        hidden, model.return_hidden = getattr(model, "return_hidden", False), False
        model.eval()
        with torch.no_grad():
            logits = model(inputs.to(device)).float()
        model.return_hidden = hidden
        targets = int((labels != -100).sum())
        want = F.cross_entropy(logits.flatten(0, 1), labels.to(device).flatten(), ignore_index=-100,
                               reduction="sum").item() / targets
        del res
    got = evals[0]
    print(f"eval row {got['eval_loss']:.9f}  recomputed {want:.9f}  ({targets} targets in {gbs} rows)")
    assert got["eval_windows"] == gbs and got["eval_tokens"] == targets
    assert targets < gbs * recipe.train.seq_len / 2  # replies only: most tokens (prompts, padding) are not targets
    assert abs(got["eval_loss"] - want) <= 1e-6 * want
    assert 0 < got["eval_loss"] < 10
    code, out, err = cli(["eval", str(run), "--data", str(heldout), "--json"])
    assert code == 0, err
    cli_result = json.loads(out.strip().splitlines()[-1])
    print(f"llmtrain eval RUN {cli_result['loss']:.9f}")
    assert cli_result["windows"] == gbs and cli_result["tokens"] == targets
    assert abs(cli_result["loss"] - got["eval_loss"]) <= 1e-6 * want
    code, _, err = cli(["eval", str(run), "--data", str(tmp_path / "nothing.jsonl")])
    assert code == 2 and err.strip().startswith("error: --data: ") and "data.path" not in err, err


def test_bad_eval_data_is_one_error_naming_data_eval_path(tmp_path):
    from llmtrain.engine.data.sft import build_eval_sft_data
    from llmtrain.errors import LLMTrainError
    from llmtrain.recipe.load import load_recipe

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "not a chat row"}\n')
    recipe = load_recipe(RECIPE, SETS[:-3] + [f"data.eval_path={bad}"])
    with pytest.raises(LLMTrainError) as exc:
        build_eval_sft_data(recipe)
    assert all(p.path in ("data.eval_path", f"{bad}:1") or str(bad) in p.line() for p in exc.value.problems), \
        [p.line() for p in exc.value.problems]
    assert not any(p.path == "data.path" for p in exc.value.problems)


def test_missing_eval_file_is_refused_before_anything_starts(tmp_path):
    """The launcher's data check builds the held-out rows too: a missing data.eval_path is one line
    naming that key (not data.path) and exit 2, before any rank starts."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "llmtrain.cli.app", "launch", str(RECIPE), "--runs", str(tmp_path / "runs"),
                           "--set", "train.eval_interval=2", "--set", f"data.eval_path={tmp_path / 'missing.jsonl'}"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("error: data.eval_path: ") and "missing.jsonl" in lines[0] and "data.path" not in lines[0]
    assert not (tmp_path / "runs").exists()
