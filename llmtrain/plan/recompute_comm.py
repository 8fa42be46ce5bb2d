"""Which of a block's forward tensor-parallel collectives activation recomputation re-runs
(plan/comm.py's TP counts). Its own file: the rule is read from the engine's checkpointing
(llmtrain/engine/parallel/checkpointing.py, torch's non-reentrant checkpoint) and checked against
it by benchmarks/planner_fidelity.py, apart from the volume arithmetic of comm.py."""

from __future__ import annotations


def recomputed_tp_sites(recompute: str, whole_block: bool = False) -> tuple[int, int]:
    """(gather sites, reduce sites) of a block's forward TP collectives that recomputation re-runs,
    per layer and micro batch (of 2 each: the attention and MLP inputs' gathers, wo's and w2's
    reductions; the engine, llmtrain/engine/parallel/checkpointing.py and torch's non-reentrant
    checkpoint):

    - ``selective`` / ``selective_mm``: both gathers (collective outputs are not saved), no
      reduction: wo's reduced output is cached (a placeholder feeds it) and recomputation stops
      before w2 (its input is the block's last saved tensor);
    - ``full``: both gathers and wo's reduction (its output feeds the MLP), not w2's (the
      checkpoint stops early after w2's input, as flops.py's recomputed FLOPs do);
    - ``full`` under ``planner.full_recompute: whole_block`` (Megatron-LM's checkpoint re-runs the
      whole function): both and both.

    Measured (benchmarks/planner_fidelity.py, tp 2 with and without SP, dense and MoE): before
    this rule the planner re-ran all four under every mode, 7.6-31 % more TP bytes than the
    engine sends."""
    if recompute == "none":
        return 0, 0
    if recompute == "full":
        return 2, 2 if whole_block else 1
    return 2, 0
