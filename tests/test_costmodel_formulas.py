"""The planner's cost model against published worked examples (pure formulas, no engine): the ZeRO
paper's (arXiv:1910.02054) Figure 1 model-state numbers; Korthikanti et al.'s (arXiv:2205.05198)
activation formula on their GPT-3 / MT-NLG configurations; Megatron / ZB bubble formulas and the
pure-Python schedule simulation that must reproduce them; the bucketed DP exposure. Split out of
tests/test_costmodel.py (which checks the plan and the real engine) by concept."""

from __future__ import annotations

import pytest

from llmtrain.plan import activations as act
from llmtrain.plan.bubble import bubble_fraction
from llmtrain.plan.memory import zero_paper_model_state_bytes
from llmtrain.plan.schedule import simulate

GB = 1e9


@pytest.mark.parametrize("stage, published_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure1(stage, published_gb):
    """ZeRO Figure 1: 7.5B parameters, N_d = 64, K = 12 (mixed-precision Adam)."""
    got = zero_paper_model_state_bytes(7.5e9, 64, stage) / GB
    assert got == pytest.approx(published_gb, abs=0.05)


def test_korthikanti_attention_term_and_5x_claim():
    """Sec. 4: 5as/h = 80 for GPT-3 175B and 64 for MT-NLG 530B (s = 2048); sequence parallelism +
    selective recomputation cut activations ~5x against tensor parallelism alone (t = 8)."""
    s, b = 2048, 1
    for a, h, term in ((96, 12288, 80), (128, 20480, 64)):
        full = act.korthikanti_layer_bytes(s, b, h, a)
        assert full == pytest.approx(s * b * h * (34 + term))
    h, a, t = 20480, 128, 8  # MT-NLG 530B, Table 3: t = 8
    tp_only = act.korthikanti_layer_bytes(s, b, h, a, t)
    sp_selective = act.korthikanti_layer_bytes(s, b, h, a, t, sp=True, recompute="selective")
    assert tp_only == pytest.approx(s * b * h * (10 + 24 / 8 + 64 / 8))
    assert sp_selective == pytest.approx(s * b * h * 34 / 8)
    assert 4.8 < tp_only / sp_selective < 5.1
    assert act.korthikanti_layer_bytes(s, b, h, a, t, recompute="full") == 2 * s * b * h
    # GPT-3 175B, t = 8, SP + selective: 2048 x 12288 x 34 / 8 bytes = 102 MiB per layer (hand computed)
    assert act.korthikanti_layer_bytes(2048, 1, 12288, 96, 8, True, "selective") / 2**20 == pytest.approx(102.0)


@pytest.mark.parametrize("schedule, pp, v, m, expected", [
    ("gpipe", 4, 1, 8, 3 / 8), ("1f1b", 8, 1, 64, 7 / 64),  # (p - 1) / m
    ("interleaved-1f1b", 8, 2, 64, 7 / 128), ("interleaved-1f1b", 4, 4, 16, 3 / 64),  # (p - 1) / (v m)
    ("zero-bubble", 4, 2, 8, 3 / 48),  # (p - 1) / (3 v m)
])
def test_bubble_formulas_and_simulated_schedules(schedule, pp, v, m, expected):
    assert bubble_fraction(schedule, pp, v, m) == pytest.approx(expected)
    assert simulate(schedule, pp, v, m).bubble_fraction == pytest.approx(expected)


def test_zero_bubble_h1_is_a_third_of_1f1b():
    for p, m in ((4, 8), (8, 16), (8, 64)):
        zb = simulate("zero-bubble", p, 1, m).bubble_fraction
        assert zb == pytest.approx(simulate("1f1b", p, 1, m).bubble_fraction / 3)
    assert bubble_fraction("dualpipev", 16, 2, 120) == pytest.approx(15 / 360)  # (p - 1) / (3 m)


@pytest.mark.parametrize("schedule, pp, v, m", [
    ("interleaved-1f1b", 4, 2, 8), ("interleaved-1f1b", 4, 3, 16), ("zero-bubble", 4, 2, 8), ("zero-bubble", 2, 2, 8),
    ("zbv", 4, 2, 8), ("dualpipev", 3, 2, 12), ("1f1b", 4, 1, 8),
])
def test_gradient_ready_is_the_simulated_schedule(schedule, pp, v, m):
    """The DP buckets' readiness per chunk (plan/schedule.py gradient_ready) equals the simulated
    timeline exactly: the end of each stage's last B (W when split) before the rank's last op, in
    single-chunk backwards (2 units)."""
    from llmtrain.plan.schedule import V_SHAPED, gradient_ready

    tl = simulate(schedule, pp, v, m)
    split = schedule in ("zero-bubble", *V_SHAPED)
    for r in range(pp):
        mine = [s for s in tl.slots if s.rank == r]
        end = max(s.end for s in mine)
        leads = sorted(((end - max(s.end for s in mine if s.op.stage == st and s.op.kind == ("W" if split else "B"))) / 2
                        for st in {s.op.stage for s in mine}), reverse=True)
        assert [lead for lead, _ in gradient_ready(schedule, pp, r, v)] == pytest.approx(leads), (schedule, r)


def test_bucketed_dp_exposure_without_and_with_pipeline_chunks():
    """One chunk: ``max(last bucket, seconds - t_b)`` (the formula before PP overlap). Two hooked
    chunks (interleaved, pp 4): the first chunk's share hides behind the 4 backwards after it, so
    only what the last chunk's share exceeds its last backward is exposed; zero-bubble's unhooked
    chunks (pp rank 1) start only after their last weight pass: the last one's whole share and what
    the first one's outlasts the 2 backwards after it are exposed. Hand-computed, exact."""
    from llmtrain.plan.comm import Comm
    from llmtrain.plan.schedule import gradient_ready
    from llmtrain.plan.steptime import bucketed_exposed

    def comm(ready):
        c = Comm("dp", "all-reduce", 2, 100e6, 1, "network", 1.0, "step-overlap", bucket_bytes=1e6)
        c.ready = ready
        return c

    assert bucketed_exposed(comm(gradient_ready(None, 1, 0, 1)), 0.4) == pytest.approx(0.6)
    assert bucketed_exposed(comm(gradient_ready(None, 1, 0, 1)), 2.0) == pytest.approx(0.01)  # the last bucket
    # interleaved pp 4, 2 chunks, t_b 0.4: b = 0.2 per chunk; chunk 1 (0.5 s) starts 1.0 s before the end
    # and is done 0.5 s before it; chunk 0 starts 0.2 s before the end: exposed 0.5 - 0.2 = 0.3
    assert bucketed_exposed(comm(gradient_ready("interleaved-1f1b", 4, 1, 2)), 0.4) == pytest.approx(0.3)
    # zero-bubble, pp rank 1, no hooks: chunk 1's 0.5 s start 2 backwards (0.4 s) before the end and
    # end 0.1 s after it; chunk 0's 0.5 s follow: exposed 0.6
    assert bucketed_exposed(comm(gradient_ready("zero-bubble", 4, 1, 2)), 0.4) == pytest.approx(0.6)


@pytest.mark.parametrize("schedule, pp, v, m", [
    ("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("1f1b", 8, 1, 32), ("interleaved-1f1b", 4, 2, 8),
    ("interleaved-1f1b", 4, 3, 16), ("zero-bubble", 4, 2, 8), ("zero-bubble", 4, 1, 8),
])
def test_cooldown_lead_is_the_simulated_schedule(schedule, pp, v, m):
    """How long before the pipeline's end each rank's last op ends (plan/schedule.py cooldown_lead),
    in single-chunk backwards (2 units), equals the simulated timeline exactly: 1F1B and interleaved
    ranks finish one backward apart, zero-bubble's together (F = B = W). (V-shaped schedules get no
    credit: which rank ends last in their greedy simulation depends on the micro-batch count.)"""
    from llmtrain.plan.schedule import cooldown_lead

    tl = simulate(schedule, pp, v, m)
    ends = [max(s.end for s in tl.slots if s.rank == r) for r in range(pp)]
    assert [cooldown_lead(schedule, pp, r) for r in range(pp)] == pytest.approx([(max(ends) - e) / 2 for e in ends])


def test_end_of_step_reduction_hides_behind_the_earlier_stages_cooldown():
    """Two 1F1B ranks, 0.3 s backward per micro batch each, gradients all-reduced after the schedule
    (phase step): rank 0 has 0.1 s, rank 1 (the output layer's large gradient) 0.5 s. Rank 1 ends
    one backward (0.3 s) before rank 0, so the step waits max(0.1, 0.5 - 0.3) = 0.2 s for them, not
    0.5; ZeRO-1's parameter broadcast after the optimizer step gets no credit; zero-bubble ranks end
    together (0.5 s). Hand-computed, exact."""
    from llmtrain.plan.comm import Comm
    from llmtrain.plan.steptime import RankWork, step_time
    from llmtrain.recipe.gpus import GPUS

    def ranks(after_step: bool = False) -> list[RankWork]:
        out = []
        for seconds in (0.1, 0.5):
            c = Comm("dp", "broadcast" if after_step else "all-reduce", 2, 1e6, 1, "network", seconds, "step")
            c.after_step = after_step
            out.append(RankWork(0.0, 0.0, [c], fwd_s=0.15, bwd_s=0.3))
        return out

    def dp(schedule: str, after_step: bool = False) -> float:
        st = step_time(ranks(after_step), GPUS["h100-sxm"], 4, 0.25, schedule, 1, 2, 1.0, 1.0, pp=2)
        return st.breakdown["dp_comm"]

    assert dp("1f1b") == pytest.approx(0.2)
    assert dp("interleaved-1f1b") == pytest.approx(0.2)  # one chunk per rank here
    assert dp("zero-bubble") == pytest.approx(0.5)
    assert dp("1f1b", after_step=True) == pytest.approx(0.5)
