"""Peak activation + loss memory of one forward/backward: unchunked vs chunked cross-entropy.

    python benchmarks/loss_memory.py          # debug-dense at vocab 32K, seq 2048, micro batch 4 (8192 tokens), fp32
    python benchmarks/loss_memory.py --tiny   # vocab 512, seq 128 (CI smoke test)

The debug recipe's model (``debug-dense``: 4 layers, hidden 128) with ``model.vocab_size=32768`` and
``train.seq_len=2048`` at its micro batch of 4, fp32, on ONE process (tp 1: every rank of a TP
group would hold 1/tp of the vocabulary-sized tensors). Three modes, each one forward and
backward of the engine's own code:

* **before** — what ``engine/step.py`` did before the chunked loss: ``logits = model(tokens)``,
  ``F.cross_entropy(logits.float())``, the logits kept alive until the end of backward;
* **unchunked** — today's logits path (``StepLoss()`` without a head, ``accumulation_step``): the
  same loss, but the logits are dropped before backward;
* **chunked** — the trainer's loss (``StepLoss.for_parts``: ``return_hidden`` + the chunked,
  gradients-in-forward cross-entropy of engine/parallel/loss.py, 1024-token chunks at this vocab).

Method: every measurement is a fresh process (``--worker MODE``: no allocator state inherited),
the modes interleaved ``--reps`` times (median reported). In the process: model, optimizer-free
parameters and the batch are built, then the kernel's RSS high-water mark is reset
(``echo 5 > /proc/self/clear_refs``) and one forward + backward runs; **peak − before** is
VmHWM after it minus VmRSS before it: activations, the loss's tensors and the parameter gradients
(~33 MiB here, the same in every mode). Tensors of this size are mmap-ed by glibc and returned at
free, so RSS follows the live tensor bytes. The planner's prediction of the same quantity
(``plan/activations.py``: saved activations + the loss terms + gradients) is printed beside it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

MIB = 2**20
MODES = ("before", "unchunked", "chunked")
FULL = dict(vocab=32768, seq=2048, micro=4)
TINY = dict(vocab=512, seq=128, micro=1)


def status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return -1


def worker(mode: str, vocab: int, seq: int, micro: int) -> dict:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(common.ROOT))
    from llmtrain.engine.models.llama import Transformer
    from llmtrain.engine.parallelize import ModelParts
    from llmtrain.engine.step import StepLoss, accumulation_step
    from llmtrain.recipe.load import load_recipe

    torch.set_num_threads(1)
    recipe = load_recipe(common.ROOT / "recipes/debug.yaml", [f"model.vocab_size={vocab}", f"train.seq_len={seq}",
                                                              f"model.max_seq_len={seq}", "parallel.tp=1"])
    torch.manual_seed(0)
    model = Transformer(recipe.model)
    for p in model.parameters():
        p.data.normal_(std=0.02)
    tokens = torch.randint(0, vocab, (micro, seq))
    labels = torch.randint(0, vocab, (micro, seq))
    parts = ModelParts([model], [0], 1)
    gc.collect()
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if mode == "before":
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        loss.backward()
        del logits
    else:
        loss_fn = StepLoss.for_parts(parts) if mode == "chunked" else StepLoss()
        loss = accumulation_step(parts, [(tokens, labels)], torch.device("cpu"), False, False,
                                 contextlib.nullcontext(), loss_fn)
    peak = status("VmHWM")
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    return {"mode": mode, "before": before, "peak": peak, "delta": peak - before, "grads": grads,
            "loss": float(loss)}


def predicted(vocab: int, seq: int, micro: int, chunked: bool) -> int:
    """The planner's activation + loss bytes of the same step (one process, fp32, on CPU)."""
    sys.path.insert(0, str(common.ROOT))
    from llmtrain.plan import activations as act
    from llmtrain.recipe.load import load_recipe

    m = load_recipe(common.ROOT / "recipes/debug.yaml", [f"model.vocab_size={vocab}", f"model.max_seq_len={seq}"]).model
    x = act.ActShape(b=micro, s=seq, h=m.hidden, heads=m.heads, kv_heads=m.kv_heads, ffn=m.ffn_hidden, vocab=vocab,
                     e=4, fused_norm=False, chunked_loss=chunked)
    saved = m.layers * act.layer_bytes(x, False, "none") + sum(act.stage_terms(x).values()) \
        + sum(act.first_stage_terms(x).values()) + sum(act.last_stage_terms(x).values())
    return saved + act.logits_bytes(x) + act.loss_backward_bytes(x)


TITLE = "Loss memory: chunked vs unchunked cross-entropy (debug model, vocab 32K, seq 2048)"


def render(shape: dict, runs: dict, reps: int) -> tuple[list[dict], str, str]:
    """Rows, Markdown table and notes of the measured ``runs`` (median over the interleaved reps)."""
    rows = []
    base = common.median([r["delta"] for r in runs["before"]])
    planner = {"before": predicted(**shape, chunked=False), "chunked": predicted(**shape, chunked=True)}
    for mode in MODES:
        delta = common.median([r["delta"] for r in runs[mode]])
        grads = runs[mode][0]["grads"]
        rows.append({"mode": mode, "peak_minus_before_mib": delta / MIB, "ratio": base / delta,
                     "predicted_mib": (planner[mode] + grads) / MIB if mode in planner else None,
                     "grads_mib": grads / MIB, "loss": runs[mode][0]["loss"],
                     "runs_mib": ", ".join(f"{r['delta'] / MIB:.0f}" for r in runs[mode])})
    table = common.md_table(rows, [("mode", "mode"), ("peak_minus_before_mib", "**peak − before MiB** (median)"),
                                   ("ratio", "before / mode"), ("predicted_mib", "planner MiB"),
                                   ("grads_mib", "of which param grads MiB"), ("runs_mib", "each run MiB"),
                                   ("loss", "loss")])
    tokens = shape["micro"] * shape["seq"]
    notes = (f"debug-dense (4 layers, hidden 128) at vocab {shape['vocab']}, seq {shape['seq']}, micro batch "
             f"{shape['micro']} ({tokens} tokens), fp32, one process; peak RSS of one forward + backward minus the RSS "
             f"before it (high-water mark reset; a fresh process per run, {reps} interleaved runs per mode). The "
             f"unchunked loss holds [tokens, vocab] fp32 logits ({tokens * shape['vocab'] * 4 / MIB:.0f} MiB), their "
             "log-probabilities and, in backward, both gradients (\"unchunked\" only drops the logits before "
             "backward); the chunked one never more than one 1024-token chunk's logits (128 MiB) plus its fp32 dL/dh "
             "and dL/dW. The same loss in every mode checks that all three computed the same thing. \"planner MiB\": "
             "plan/activations.py's saved activations + loss terms of the same step (chunked: the default model; "
             "before: ``ActShape.chunked_loss=False``) + the parameter gradients.")
    return rows, table, notes


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        mode, vocab, seq, micro = sys.argv[2], *map(int, sys.argv[3:6])
        print(json.dumps(worker(mode, vocab, seq, micro)))
        return
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    shape = TINY if args.tiny else FULL
    reps = 1 if args.tiny else args.reps
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(reps):  # interleaved: before, unchunked, chunked, before, ...
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--worker", mode, str(shape["vocab"]), str(shape["seq"]),
                                  str(shape["micro"])], capture_output=True, text=True, timeout=600, check=True)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows, table, notes = render(shape, runs, reps)
    common.publish(args, "loss_memory", TITLE, {"shape": shape, "runs": runs, "rows": rows}, table, notes)


if __name__ == "__main__":
    main()
