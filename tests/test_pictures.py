"""Pictures of a plan: the pipeline timeline (terminal text and PNG) and the rank layout (PNG).

The PNGs are checked for the PNG signature and a plausible size; the terminal timeline for the
bubble (idle cells) where the schedule has one, and for its absence where it should not.
Plain ``llmtrain plan`` must not import matplotlib (it is imported only when a PNG is asked for).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llmtrain.plan.dims import ParallelDims
from llmtrain.plan.pictures import IDLE, layout_png, schedule_png, schedule_text
from llmtrain.cluster.placement import Placement
from llmtrain.plan.schedule import rank_orders, simulate
from tests.helpers_plan import CLI, REPO

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_terminal_timeline_shows_the_1f1b_bubble():
    text = schedule_text(simulate("1f1b", 4, 1, 8))
    lines = text.splitlines()
    assert "bubble 37.5% of compute" in lines[0]
    rows = [line for line in lines if line.startswith("rank")]
    assert len(rows) == 4
    # rank 0 starts with its 4 warm-up forwards; the last rank waits 3 units for micro batch 0
    assert rows[0].startswith("rank  0 F0 F1 F2 F3 ")
    assert rows[3].startswith("rank  3 " + IDLE * 3 + "F0 B0 B0")
    idle = sum(row.count(IDLE) for row in rows)
    assert idle == 4 * (11 * 3 - 8 * 3)  # makespan (m + p - 1)(F + B) minus each rank's 8 x 3 units of work


def test_terminal_timeline_of_interleaved_and_zero_bubble():
    inter = schedule_text(simulate("interleaved-1f1b", 4, 2, 8))
    assert "F0a" in inter and "F0b" in inter and "bubble 18.8%" in inter
    zb = schedule_text(simulate("zero-bubble", 4, 1, 8))
    assert "W0" in zb and "bubble 12.5%" in zb  # a third of 1F1B's 37.5%


def test_orders_have_every_pass_once():
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2)):
        orders = rank_orders(schedule, 4, v, 8)
        for r, order in enumerate(orders):
            ops = [(op.kind, op.mb, op.stage) for op in order]
            assert len(ops) == len(set(ops)) == 2 * 8 * v
            assert all(stage % 4 == r for _, _, stage in ops)


def test_pngs_are_written(tmp_path):
    a = schedule_png(simulate("interleaved-1f1b", 4, 2, 8), tmp_path / "schedule.png")
    b = layout_png(ParallelDims(2, 1, 2, 1, 4), Placement.uniform(2, 8), tmp_path / "layout.png")
    for path in (a, b):
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000


def test_cli_schedule_and_pngs(tmp_path):
    sched, lay = tmp_path / "s.png", tmp_path / "l.png"
    out = subprocess.run([*CLI, "plan", "recipes/llama3-70b.yaml", "--schedule", "--schedule-png", str(sched),
                          "--layout-png", str(lay)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Schedule interleaved-1f1b: pp 4, 32 micro batches" in out.stdout and IDLE in out.stdout
    assert f"wrote {sched}" in out.stderr and f"wrote {lay}" in out.stderr
    assert sched.read_bytes()[:8] == PNG_MAGIC and lay.read_bytes()[:8] == PNG_MAGIC
    bad = subprocess.run([*CLI, "plan", "recipes/llama3-8b.yaml", "--schedule-png", str(tmp_path / "x.png")], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no pipeline schedule to draw" in bad.stderr and "Traceback" not in bad.stderr


PROBE = """
import json, sys
sys.argv = ["llmtrain", *json.loads(sys.argv[1])]
from llmtrain.cli.app import main
try:
    main()
except SystemExit:
    pass
sys.stderr.write("PROBE " + json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "matplotlib"))))
"""


def test_plan_does_not_import_matplotlib_or_torch():
    for args in (["plan", "recipes/llama3-70b.yaml", "--schedule"], ["plan", "recipes/llama3-405b.yaml", "--search",
                                                                      "--top", "1", "--json"]):
        out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
        assert json.loads(out.stderr.rsplit("PROBE ", 1)[1]) == [], out.stderr[-2000:]


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_v_shaped_timeline(name, tmp_path):
    from llmtrain.plan.bubble import bubble_fraction
    from llmtrain.plan.schedule import v_stage_rank

    p, m = 4, 8
    tl = simulate(name, p, 2, m)
    ops = {}
    for s in tl.slots:
        key = (s.op.kind, s.op.mb, s.op.stage)
        assert key not in ops, key
        ops[key] = s
        assert s.rank == v_stage_rank(s.op.stage, p)
    assert {(r, 2 * p - 1 - r) for r in range(p)} == {tuple(sorted({s.op.stage for s in tl.slots if s.rank == r}))
                                                        for r in range(p)}
    assert set(ops) == {(k, mb, st) for k in "FBW" for mb in range(m) for st in range(2 * p)}
    for mb in range(m):
        for st in range(2 * p):
            f, b, w = ops[("F", mb, st)], ops[("B", mb, st)], ops[("W", mb, st)]
            if st > 0:
                assert f.start >= ops[("F", mb, st - 1)].end
            if st < 2 * p - 1:
                assert b.start >= ops[("B", mb, st + 1)].end
            assert b.start >= f.end and w.start >= b.end
    for r in range(p):
        mine = sorted((s for s in tl.slots if s.rank == r), key=lambda s: s.start)
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))
    assert tl.bubble_fraction <= bubble_fraction(name, p, 2, m) + 1e-9
    assert tl.bubble_fraction == pytest.approx((p - 1) / (6 * m))
    text = schedule_text(tl)
    assert text.startswith(f"{name}: pp 4, 8 micro batches") and "(B 1 + W 1)" in text
    path = schedule_png(tl, tmp_path / f"{name}.png")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000
