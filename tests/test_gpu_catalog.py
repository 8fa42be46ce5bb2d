"""The GPU catalog (issue 18 item 3): sources, the docs table, and ``cluster.gpu_power_w``.

All checks are exact (no tolerance) except where a float is multiplied: those use pytest's
default relative 1e-6, far below any planner digit that is printed.
"""

from __future__ import annotations

import io
import subprocess

import pytest
from rich.console import Console

from llmtrain.errors import LLMTrainError
from llmtrain.plan.api import make_plan
from llmtrain.plan.costmodel import estimate
from llmtrain.plan.render import render_plan
from llmtrain.plan.report import plan_to_dict
from llmtrain.recipe.gpus import (
    ASSUMED,
    GPUS,
    POWER_FLOOR,
    SOURCES,
    catalog_markdown,
    cluster_gpu,
)
from tests.helpers_plan import CLI, REPO

RECIPE = """model: {{preset: llama3-8b}}
parallel: {{tp: 1, pp: 1, dp_shard: -1, zero: 3}}
train: {{seq_len: 4096, micro_batch_size: 1, global_batch_size: 16, precision: bf16, activation_checkpointing: selective}}
cluster: {{nodes: 1, gpus_per_node: 8, gpu: {gpu}{power}}}
"""


def _recipe(tmp_path, gpu="h100-sxm", power=None, time_model=None):
    path = tmp_path / f"r-{gpu}-{power}-{time_model}.yaml"
    power = ("" if power is None else f", gpu_power_w: {power}") + ("" if time_model is None else f", time_model: {time_model}")
    path.write_text(RECIPE.format(gpu=gpu, power=power))
    return path


def test_every_entry_has_a_source_and_sane_numbers():
    required = {"h100-sxm", "h100-pcie", "h200", "a100-40g", "a100-80g", "b200", "gb200", "mi300x"}
    assert required <= set(GPUS)
    for key in required:
        g = GPUS[key]
        assert SOURCES[key] and all(url.startswith("https://") for _, url in SOURCES[key]), key
        assert key in ASSUMED, key  # the NIC per GPU is never a datasheet number: each says where it comes from
        assert g.peak_flops_bf16 > 1e14 and g.hbm_bytes_per_s > 1e12 and g.tdp_w >= 300 and g.nvlink_domain >= 2
        assert g.peak_flops_fp8 == 0 or g.peak_flops_fp8 == pytest.approx(2 * g.peak_flops_bf16, rel=0.01), key
    assert GPUS["a100-80g"].peak_flops_fp8 == GPUS["a100-40g"].peak_flops_fp8 == 0  # Ampere: no FP8 tensor cores
    assert GPUS["gb200"].nvlink_domain == 72


def test_existing_entries_keep_their_values():
    """Predictions of existing recipes must not move: the five pre-catalog entries, as before."""
    old = {"h100-sxm": (989e12, 80e9, 900e9, 50e9, 1979e12), "h200": (989e12, 141e9, 900e9, 50e9, 1979e12),
           "a100-80g": (312e12, 80e9, 600e9, 25e9, 0.0), "b200": (2250e12, 180e9, 1800e9, 50e9, 4500e12),
           "cpu": (1e11, 16e9, 10e9, 1e9, 0.0)}
    for key, values in old.items():
        g = GPUS[key]
        assert (g.peak_flops_bf16, g.memory_bytes, g.nvlink_bytes_per_s, g.internode_bytes_per_s, g.peak_flops_fp8) == values


def test_docs_table_is_the_catalog():
    doc = (REPO / "docs" / "planner.md").read_text()
    table = doc.split("<!-- catalog:begin -->\n", 1)[1].split("\n<!-- catalog:end -->", 1)[0]
    assert table == catalog_markdown(), "regenerate with python -c 'from llmtrain.recipe.gpus import catalog_markdown; print(catalog_markdown())'"


@pytest.mark.parametrize("time_model", ["v1", "v2"])
def test_power_cap_scales_compute_linearly_and_keeps_bandwidth(tmp_path, time_model):
    """Rule: peak x cap / TDP (bf16 and fp8), bandwidths unchanged, MFU against the datasheet peak.

    Checked on the plan itself: under v1 the compute term of the step is FLOPs / (peak x
    efficiency), so at 500 of 700 W it is exactly 700/500 times longer; under v2 (the default) the
    GEMMs and attention slow by that ratio and the memory-bound operations (norms, RoPE, SwiGLU, the
    loss: HBM bandwidth) do not, so compute grows by less; communication and the optimizer
    (HBM-bound) are unchanged; MFU = model FLOP/s / 989 TFLOP/s in both."""
    capped = cluster_gpu("h100-sxm", 500)
    base = GPUS["h100-sxm"]
    assert capped.peak_flops_bf16 == pytest.approx(base.peak_flops_bf16 * 500 / 700)
    assert capped.peak_flops_fp8 == pytest.approx(base.peak_flops_fp8 * 500 / 700)
    assert (capped.hbm_bytes_per_s, capped.nvlink_bytes_per_s, capped.internode_bytes_per_s, capped.memory_bytes) == (
        base.hbm_bytes_per_s, base.nvlink_bytes_per_s, base.internode_bytes_per_s, base.memory_bytes)
    assert cluster_gpu("h100-sxm", 700) is base and cluster_gpu("h100-sxm") is base

    costs = []
    for power in (None, 500):
        plan = make_plan(_recipe(tmp_path, power=power, time_model=time_model))
        costs.append(estimate(plan.recipe, plan.validation.dims, plan.validation.batch, plan.placement, hints=False).time)
    full, cap = costs
    d = plan_to_dict(plan)  # the last plan: 500 W
    assert d["time"]["peak_tflops"] == pytest.approx(989 * 500 / 700) and d["time"]["mfu_peak_tflops"] == 989
    out = io.StringIO()
    render_plan(d, Console(file=out, width=400, highlight=False))
    assert "706 TFLOP/s peak, power-capped; MFU against the 989 TFLOP/s datasheet peak" in out.getvalue()
    if time_model == "v1":
        assert cap.breakdown["compute"] == pytest.approx(full.breakdown["compute"] * 700 / 500)
    else:
        assert full.breakdown["compute"] * 1.25 < cap.breakdown["compute"] < full.breakdown["compute"] * 700 / 500
    assert cap.breakdown["optimizer"] == pytest.approx(full.breakdown["optimizer"])
    assert cap.mfu == pytest.approx(full.mfu * full.step_s / cap.step_s)  # same FLOPs, same denominator
    assert cap.step_s > full.step_s


@pytest.mark.parametrize("gpu, power, words", [
    ("h100-sxm", 800, "above the h100-sxm TDP (700 W)"),
    ("a100-80g", 150, f"below {POWER_FLOOR:.0%} of the a100-80g TDP (400 W)"),
    ("cpu", 100, "has no power model"),
])
def test_power_cap_out_of_range_is_refused(tmp_path, gpu, power, words):
    with pytest.raises(LLMTrainError) as exc:
        make_plan(_recipe(tmp_path, gpu, power))
    line = str(exc.value)
    assert "cluster.gpu_power_w" in line and words in line and "\n" not in line.strip()


def test_cli_refuses_a_cap_above_tdp_in_one_line(tmp_path):
    proc = subprocess.run([*CLI, "plan", str(_recipe(tmp_path, "mi300x", 900))], capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    assert len(lines) == 1 and "cluster.gpu_power_w" in lines[0] and "750 W" in lines[0], lines


def _net_recipe(tmp_path, nodes, network=None):
    """Llama 3 8B FSDP over ``nodes`` H100 nodes: its reduce-scatters and all-gathers cross the network."""
    path = tmp_path / f"net-{nodes}-{network}.yaml"
    extra = "" if network is None else f", network_gbps: {network}"
    path.write_text(RECIPE.format(gpu="h100-sxm", power="").replace("nodes: 1,", f"nodes: {nodes},")
                    .replace("gpu: h100-sxm}", f"gpu: h100-sxm{extra}}}"))
    return path


def test_network_gbps_is_each_gpus_equal_share(tmp_path):
    """``cluster.network_gbps`` (the node's NICs together) sets each GPU's inter-node bandwidth to its
    equal share and nothing else; the catalog's figure is what DGX H100's 8 x 400 Gb/s give."""
    base = GPUS["a100-80g"]
    quarter = cluster_gpu("a100-80g", network_gbps=400, gpus_per_node=8)
    assert quarter.internode_bytes_per_s == 400e9 / 8 / 8 == base.internode_bytes_per_s / 4
    assert (quarter.peak_flops_bf16, quarter.nvlink_bytes_per_s, quarter.hbm_bytes_per_s, quarter.memory_bytes) == (
        base.peak_flops_bf16, base.nvlink_bytes_per_s, base.hbm_bytes_per_s, base.memory_bytes)
    assert cluster_gpu("a100-80g", network_gbps=1600, gpus_per_node=8) == base  # DGX A100: 8 x 200 Gb/s
    capped = cluster_gpu("h100-sxm", 500, network_gbps=800, gpus_per_node=8)  # both settings apply
    assert capped.internode_bytes_per_s == 800e9 / 64 and capped.peak_flops_bf16 == pytest.approx(989e12 * 5 / 7)

    def cost(nodes, network=None):
        plan = make_plan(_net_recipe(tmp_path, nodes, network))
        return plan, estimate(plan.recipe, plan.validation.dims, plan.validation.batch, plan.placement, hints=False)

    default, dgx, slow = cost(2), cost(2, 3200), cost(2, 800)
    assert dgx[1].time.step_s == default[1].time.step_s  # 3200 / 8 = the catalog's 400 Gb/s per GPU
    assert slow[1].time.breakdown["dp_comm"] > 2 * default[1].time.breakdown["dp_comm"] > 0
    assert slow[1].time.breakdown["compute"] == default[1].time.breakdown["compute"]
    network = [c for c in slow[1].comms if c.link == "network"]
    # a quarter of the bandwidth: the bytes' term x 4, NCCL's per-step latency unchanged, so just under 4x
    assert network and all(3.5 < c.seconds / d.seconds < 4
                           for c, d in zip(network, [c for c in default[1].comms if c.link == "network"]))
    assert cost(1, 800)[1].time.step_s == cost(1)[1].time.step_s  # one node: nothing crosses the network
    d = plan_to_dict(slow[0])
    assert d["time"]["network_gbps_per_gpu"] == 100
    out = io.StringIO()
    render_plan(d, Console(file=out, width=400, highlight=False))
    assert "network 100 Gb/s per GPU between nodes" in out.getvalue()


def test_network_gbps_must_be_positive(tmp_path):
    with pytest.raises(LLMTrainError) as exc:
        make_plan(_net_recipe(tmp_path, 2, 0))
    line = str(exc.value)
    assert "cluster.network_gbps" in line and "\n" not in line.strip()


def test_pcie_cards_plan_their_in_node_traffic_on_pcie(tmp_path):
    """a100-pcie and l40s (PCIe cards of fine-tuning clusters): each has sources and says what is assumed;
    a100-pcie takes the A100 SXM's measured kernel rates through its die; in-node collectives of both run
    on PCIe Gen4 (commtime's "pci" link), so the same one-node TP 4 layout spends more of its step in TP
    than on a100-80g's NVLink, while a100-pcie's compute is the A100's."""
    from llmtrain.plan.commtime import _intra
    from llmtrain.plan.gemmtime import MAMF, SMS, mamf

    for key in ("a100-pcie", "l40s"):
        assert SOURCES[key] and all(url.startswith("https://") for _, url in SOURCES[key]) and key in ASSUMED
        assert _intra(GPUS[key]) == "pci" and GPUS[key].nvlink_bytes_per_s == 64e9
    assert GPUS["a100-pcie"].rates_key == "a100-80g" and mamf(GPUS["a100-pcie"]) == mamf(GPUS["a100-80g"])
    assert GPUS["l40s"].rates_key == "l40s" and "l40s" not in MAMF and SMS["l40s"] == 142
    assert mamf(GPUS["l40s"]) == 0.75  # no reading: the default fraction (gpus.ASSUMED says so)
    def priced(gpu):  # Llama 3 8B, TP 4 x DP 2 on one node of ``gpu``
        path = tmp_path / f"tp4-{gpu}.yaml"
        path.write_text(RECIPE.format(gpu=gpu, power="").replace("tp: 1,", "tp: 4,").replace("zero: 3", "zero: 1"))
        plan = make_plan(path)
        return estimate(plan.recipe, plan.validation.dims, plan.validation.batch, plan.placement, hints=False).time

    nvlink, pcie, l40s = priced("a100-80g"), priced("a100-pcie"), priced("l40s")
    # same GEMM and attention rates; the memory-bound kernels at 1.935 instead of 2.039 TB/s
    assert nvlink.breakdown["compute"] < pcie.breakdown["compute"] < 1.02 * nvlink.breakdown["compute"]
    assert pcie.breakdown["tp_comm"] > 3 * nvlink.breakdown["tp_comm"] > 0  # 64 GB/s PCIe against 600 GB/s NVLink
    assert l40s.breakdown["tp_comm"] > 3 * nvlink.breakdown["tp_comm"]
