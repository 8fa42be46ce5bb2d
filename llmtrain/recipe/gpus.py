"""GPU catalog for planning: dense peaks, memory, bandwidths, NVLink domain and power, per GPU.

Every number is per GPU and dense (without 2:4 sparsity: the datasheets quote sparse figures
first, these are half of them). Bandwidths are the totals (both directions) the datasheets
quote, in bytes/s, except the NIC, which is one direction (400 Gb/s = 50 GB/s). Each entry's
sources are in :data:`SOURCES` (title + URL of the vendor's document; where the stored copy
read was a third-party page quoting it, that page is named too). Numbers that no datasheet
gives (the NIC per GPU is a property of the node, not of the GPU) say so in
:data:`ASSUMED`. docs/planner.md's catalog table is :func:`catalog_markdown` (a test keeps the
two equal).

Decisions:
- ``nvlink_bytes_per_s`` is the link the planner uses *inside a node* (comm.py: NVLink's figure
  halved per direction). For h100-pcie, only pairs of cards share an NVLink bridge (600 GB/s);
  groups of more than two talk over PCIe Gen5 x16 (128 GB/s both directions), which is what a
  node-wide group gets, so that is the in-node figure; ``nvlink_domain`` is 2.
- ``nvlink_domain`` is the number of GPUs one NVLink/NVSwitch (or xGMI) fabric connects: 8 on
  HGX/DGX boards and MI300X platforms, 72 on GB200 NVL72. The planner decides NVLink vs network
  per *node* (the hostfile's hosts; comm.py), so an NVL72 rack, whose hosts are 4-GPU trays, is
  planned as one NVLink domain with ``cluster.gpus_per_node: 72`` (a planning setting; the
  launcher's hostfile still lists the trays).
- mi300x: the 896 GB/s Infinity Fabric figure is 7 point-to-point links of 128 GB/s (a full
  mesh, no switch): a collective over all 8 GPUs uses every link, a pair only one.
- Power (``cluster.gpu_power_w``, :func:`cluster_gpu`): the compute peaks scale **linearly** with
  the cap, ``peak x cap / tdp_w``; HBM, NVLink and NIC bandwidths do not change (the cap throttles
  the SM clock, not the memory clock). Linear in power is the conservative end: dynamic power
  grows faster than the clock (``P ~ C V^2 f``, and voltage rises with the clock), so a real part
  loses less than linear near its TDP; the one figure found (a third-party note, SOURCES
  "power-cap"), 10-15 % slower H100 pretraining steps at 600 of 700 W, brackets linear's 14 %.
  No vendor curve was found. Caps below :data:`POWER_FLOOR` x TDP are refused (there the clock
  floors and the rule is not even roughly right), as are caps above the TDP (the board does not
  draw more). MFU stays against the *datasheet* peak (``nominal_peak_flops_bf16``), so a capped
  run shows the throughput it loses as lower MFU, comparable with uncapped runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GPUSpec:
    name: str
    peak_flops_bf16: float  # dense FLOP/s (scaled by cluster.gpu_power_w, see cluster_gpu)
    memory_bytes: float
    nvlink_bytes_per_s: float  # intra-node, per GPU, both directions (h100-pcie: PCIe, see above)
    internode_bytes_per_s: float  # per GPU, one direction (one NIC per GPU)
    peak_flops_fp8: float = 0.0  # dense FP8 tensor-core FLOP/s; 0 = no FP8 tensor cores (train.precision fp8 refused)
    hbm_bytes_per_s: float = 0.0  # memory bandwidth
    nvlink_domain: int = 1  # GPUs on one NVLink/NVSwitch/xGMI fabric
    tdp_w: float = 0.0  # maximum board power (0: no power model, cluster.gpu_power_w refused)
    nominal_peak_flops_bf16: float = 0.0  # the datasheet bf16 peak, for MFU (0: = peak_flops_bf16)
    die: str = ""  # the catalog entry with the same compute chip, whose measured kernel rates apply ("": this one)

    @property
    def rates_key(self) -> str:
        """The name per-GPU kernel constants are keyed by (plan/ops.py, plan/steptime.py): a board
        variant of a chip (other memory, other power) uses its chip's measured rates."""
        return self.die or self.name

    @property
    def mfu_peak(self) -> float:
        return self.nominal_peak_flops_bf16 or self.peak_flops_bf16


GB = 1e9
T = 1e12
NIC_400G = 400e9 / 8
NIC_200G = 200e9 / 8
GPUS: dict[str, GPUSpec] = {
    # order matters to engine/metrics.py, which picks the first key whose prefix is in the CUDA
    # device name: the long-standing entry of each family comes first
    "h100-sxm": GPUSpec("h100-sxm", 989 * T, 80 * GB, 900 * GB, NIC_400G, 1979 * T, 3.35 * T, 8, 700),
    "h200": GPUSpec("h200", 989 * T, 141 * GB, 900 * GB, NIC_400G, 1979 * T, 4.8 * T, 8, 700),
    "a100-80g": GPUSpec("a100-80g", 312 * T, 80 * GB, 600 * GB, NIC_200G, 0.0, 2.039 * T, 8, 400),
    "gb200": GPUSpec("gb200", 2500 * T, 186 * GB, 1800 * GB, NIC_400G, 5000 * T, 8.0 * T, 72, 1200),
    "b200": GPUSpec("b200", 2250 * T, 180 * GB, 1800 * GB, NIC_400G, 4500 * T, 8.0 * T, 8, 1000),
    "h100-pcie": GPUSpec("h100-pcie", 756 * T, 80 * GB, 128 * GB, NIC_200G, 1513 * T, 2.0 * T, 2, 350),
    "a100-40g": GPUSpec("a100-40g", 312 * T, 40 * GB, 600 * GB, NIC_200G, 0.0, 1.555 * T, 8, 400),
    "h100-96g": GPUSpec("h100-96g", 989 * T, 96 * GB, 900 * GB, NIC_400G, 1979 * T, 2.4 * T, 8, 700, die="h100-sxm"),
    "mi300x": GPUSpec("mi300x", 1307.4 * T, 192 * GB, 896 * GB, NIC_400G, 2614.9 * T, 5.3 * T, 8, 750),
    "a100-pcie": GPUSpec("a100-pcie", 312 * T, 80 * GB, 64 * GB, 100e9 / 8, 0.0, 1.935 * T, 2, 300, die="a100-80g"),
    "l40s": GPUSpec("l40s", 362.05 * T, 48 * GB, 64 * GB, 50e9 / 8, 733 * T, 0.864 * T, 1, 350),
    "cpu": GPUSpec("cpu", 1e11, 16 * GB, 10 * GB, 1 * GB, 0.0, 5e10, 1, 0),
}

# Where each number comes from: (title, URL) of the vendor document, then the stored page it was
# read from when that was not the vendor's own copy.
SOURCES: dict[str, list[tuple[str, str]]] = {
    "h100-sxm": [("NVIDIA H100 Tensor Core GPU datasheet (SXM: 1,979 TFLOPS bf16 and 3,958 fp8 with sparsity, "
                  "80 GB, 3.35 TB/s, NVLink 900 GB/s, up to 700 W)",
                  "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"),
                 ("G. Lockwood, H100 notes (dense matrix bf16 989.4, fp8 1,978.9 TFLOPS; 700 W)",
                  "https://glennklockwood.com/garden/processors/h100")],
    "h100-pcie": [("NVIDIA H100 Tensor Core GPU datasheet (PCIe: 1,513 TFLOPS bf16 and 3,026 fp8 with sparsity, "
                   "80 GB HBM2e, 2 TB/s, NVLink bridge 600 GB/s, PCIe Gen5 128 GB/s)",
                   "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"),
                  ("NVIDIA H100 PCIe GPU product brief PB-11133-001_v02 (TDP 350 W, > 2,000 GB/s)",
                   "https://manuals.plus/m/56b0c3ef7d0a1c470c0af8f05a0bd1f29a778007472ba941201fbbb185c9bccd")],
    "h100-96g": [("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Hardware (Meta's Grand Teton H100: "
                  "96 GB HBM2e at 2.4 TB/s, 8 per host on NVLink, 400 Gb/s RDMA per GPU, 500 W default limit, "
                  "700 W TDP; 'peak TFLOPs between SXM and NVL')",
                  "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md")],
    "h200": [("NVIDIA H200 Tensor Core GPU product page / datasheet (SXM: 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s, "
              "up to 700 W; compute as H100 SXM)", "https://www.nvidia.com/en-us/data-center/h200/"),
             ("third-party summary of the same (H100 vs H200 table: 4.8 TB/s, 700 W, 900 GB/s)",
              "https://lzwjava.github.io/nvidia-h200-gpu-specs-en")],
    "a100-80g": [("NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB: 312 TFLOPS bf16 dense, 2,039 GB/s, NVLink 600 GB/s, "
                  "400 W; no FP8)",
                  "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
                 ("G. Lockwood, A100 notes (quoting that datasheet)", "https://glennklockwood.com/garden/processors/A100")],
    "a100-40g": [("NVIDIA A100 Tensor Core GPU datasheet (SXM 40GB: 312 TFLOPS bf16 dense, 1,555 GB/s, NVLink 600 GB/s, "
                  "400 W)",
                  "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
                 ("G. Lockwood, A100 notes", "https://glennklockwood.com/garden/processors/A100")],
    "b200": [("NVIDIA HGX B200 datasheet / product page (per GPU: 4.5 PFLOPS bf16 and 9 fp8 with sparsity, 180 GB, "
              "NVLink 5 1.8 TB/s, HBM 8 TB/s)", "https://www.nvidia.com/en-us/data-center/hgx/"),
             ("G. Lockwood, B200 notes (HGX B200 at 1,000 W: dense bf16 2,250, fp8 4,500 TFLOPS)",
              "https://glennklockwood.com/garden/processors/B200")],
    "gb200": [("NVIDIA GB200 NVL72 product page (72 GPUs: 360 PFLOPS bf16 and 720 fp8 with sparsity, 13.4 TB HBM3e at "
               "576 TB/s, NVLink 130 TB/s)", "https://www.nvidia.com/en-us/data-center/gb200-nvl72/"),
              ("G. Lockwood, B200 notes (the GB200 B200 at 1,200 W: dense bf16 2,500, fp8 5,000 TFLOPS)",
               "https://glennklockwood.com/garden/processors/B200")],
    "mi300x": [("AMD Instinct MI300X accelerator data sheet (1,307.4 TFLOPS bf16 and 2,614.9 fp8 dense, 192 GB HBM3, "
                "5.3 TB/s, Infinity Fabric 896 GB/s, 750 W OAM)",
                "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"),
               ("third-party copy (codesota: 192 GB, 5.3 TB/s, 750 W; its '2,615 TFLOPS fp16 dense' is the with-sparsity fp16 figure)",
                "https://www.codesota.com/hardware/mi300x")],
    "a100-pcie": [("NVIDIA A100 Tensor Core GPU datasheet (80GB PCIe: 312 TFLOPS bf16 dense, 1,935 GB/s, NVLink bridge "
                   "for 2 GPUs 600 GB/s, PCIe Gen4 64 GB/s, 300 W)",
                   "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")],
    "l40s": [("NVIDIA L40S datasheet (362.05 TFLOPS bf16 and 733 fp8 dense, 733 / 1,466 with sparsity; 48 GB GDDR6 "
              "at 864 GB/s; PCIe Gen4 x16 64 GB/s both directions, no NVLink; 350 W)",
              "https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"),
             ("third-party copy of the datasheet's table (L40 / L40S columns)",
              "https://www.mullet.se/product.html?product_id=355414"),
             ("TechPowerUp's L40S entry, read via a reseller page (AD102, SM count 142)",
              "https://m.reach.dog/shop/computizer/products/nvidia-l40s-48gb-gddr6-graphics-card-for-ai-and-graphics-performance"),
             ("Amazon EC2 user guide, EFA on accelerated instances (G6e: up to four network cards, up to 400 Gbps)",
              "https://docs.amazonaws.cn/en_us/AWSEC2/latest/UserGuide/efa-acc-inst-types.html")],
    "power-cap": [("factryze.ai, Power capping (H100 at 600 W: 10-15 % longer pretraining steps; third-party, no data "
                   "published)", "https://factryze.ai/scale-atlas/power/power-capping")],
}

# Numbers no datasheet gives: the NIC per GPU belongs to the node design.
ASSUMED: dict[str, str] = {
    "h100-sxm": "NIC: DGX H100, 8x ConnectX-7 400 Gb/s, one per GPU (kept from the earlier catalog)",
    "h100-96g": "compute: the H100 SXM's peaks and kernel rates (die h100-sxm): the source says only that the peak "
                "lies between SXM and NVL, so the SXM figure is the ceiling; NVLink 900 GB/s as the SXM board; NIC 400 Gb/s per GPU "
                "as the source states",
    "h200": "NIC: HGX H200 reference design, one 400 Gb/s ConnectX-7 per GPU (as DGX H100)",
    "a100-80g": "NIC: DGX A100, 8x ConnectX-6 HDR 200 Gb/s", "a100-40g": "NIC: DGX A100, 8x ConnectX-6 HDR 200 Gb/s",
    "b200": "NIC: DGX B200, 8x ConnectX-7 400 Gb/s",
    "gb200": "memory: 13.4 TB / 72 = 186 GB (the rack figure); NIC: 4x 400 Gb/s per 4-GPU compute tray (typical "
             "build, not in the datasheet)",
    "h100-pcie": "NIC: 200 Gb/s per GPU is a typical PCIe server (one 400 Gb/s NIC per two cards), not a datasheet number",
    "mi300x": "NIC: one 400 Gb/s NIC per GPU as in the HGX-style MI300X platforms (not in the GPU data sheet)",
    "a100-pcie": "compute: the A100 SXM's kernel rates (die a100-80g: the same GA100 chip, here at 300 W, which may "
                 "clock lower under a GEMM stream: not measured); in-node: pairs share an NVLink bridge, groups of more "
                 "than two talk over PCIe Gen4 x16 (64 GB/s both directions), as h100-pcie; NIC: 100 Gb/s per GPU, one "
                 "200 Gb/s HDR NIC per two cards, a typical PCIe server, not a datasheet number",
    "l40s": "no NVLink: every in-node group talks over PCIe Gen4 x16 (nvlink_domain 1); NIC: 50 Gb/s per GPU, the "
            "400 Gb/s of AWS's 8-GPU g6e.48xlarge (SOURCES), the commonest L40S cluster node found; kernel rates: none "
            "measured (MAMF's default fraction, flash attention at fixed fractions), so the plan's times are rougher "
            "than for the measured parts",
    "cpu": "nominal numbers for planning CPU debug runs; the engine measures the real peak with a matmul probe",
}

POWER_FLOOR = 0.5  # cluster.gpu_power_w below this fraction of the TDP is refused (the linear rule is not trusted there)


def power_range(name: str) -> tuple[float, float] | None:
    """(lowest, highest) ``cluster.gpu_power_w`` accepted for ``name``; None: the part has no power model."""
    spec = GPUS.get(name)
    if spec is None or spec.tdp_w <= 0:
        return None
    return POWER_FLOOR * spec.tdp_w, spec.tdp_w


def power_problem(name: str, power_w: float | None) -> str | None:
    """Why ``cluster.gpu_power_w`` is refused for ``cluster.gpu`` = ``name`` (None: accepted)."""
    if power_w is None:
        return None
    span = power_range(name)
    if span is None:
        return f"gpu_power_w is set but cluster.gpu {name} has no power model; remove gpu_power_w"
    lo, hi = span
    if power_w > hi:
        return f"gpu_power_w {power_w:g} W is above the {name} TDP ({hi:g} W); use at most {hi:g}, or leave it out"
    if power_w < lo:
        return (f"gpu_power_w {power_w:g} W is below {POWER_FLOOR:.0%} of the {name} TDP ({hi:g} W), where the "
                f"planner's linear power rule is not trusted; use {lo:g}-{hi:g} W")
    return None


def cluster_gpu(name: str, power_w: float | None = None, network_gbps: float | None = None,
                gpus_per_node: int = 1) -> GPUSpec:
    """The catalog entry for ``cluster.gpu``, with the compute peaks scaled for ``cluster.gpu_power_w``
    (linear in the cap, see the module docstring) and, where ``cluster.network_gbps`` says what the
    nodes have, each GPU's equal share of it as its inter-node bandwidth (:func:`network_share`); the
    name stays, so per-GPU calibration applies."""
    spec = GPUS[name]
    if network_gbps is not None:
        spec = replace(spec, internode_bytes_per_s=network_share(network_gbps, gpus_per_node))
    if power_w is None or spec.tdp_w <= 0 or power_w >= spec.tdp_w:
        return spec
    scale = power_w / spec.tdp_w
    return replace(spec, peak_flops_bf16=spec.peak_flops_bf16 * scale, peak_flops_fp8=spec.peak_flops_fp8 * scale,
                   nominal_peak_flops_bf16=spec.mfu_peak)


def network_share(network_gbps: float, gpus_per_node: int) -> float:
    """One GPU's inter-node bandwidth, bytes/s one direction, for ``cluster.network_gbps`` (the node's
    NICs together, Gb/s one direction) shared by its ``gpus_per_node`` GPUs.

    Decision: an equal share, whatever the NIC count. In every layout the planner prices, each GPU of a
    node runs its own copy of a collective at the same time (the DP or FSDP group of each TP / PP / CP
    coordinate, the pipeline sends of every TP rank), so they contend for the node's NICs, and NCCL
    spreads its rings over all of them: 4 x 100 Gb/s for 8 GPUs prices 50 Gb/s per GPU, as 8 x 50
    would. A collective that only one GPU of a node runs (a 1-GPU-per-node DP group with nothing beside
    it) could use more; no layout of this planner does that.
    """
    return network_gbps * 1e9 / 8 / max(1, gpus_per_node)


def _num(x: float) -> str:
    return f"{x:,.1f}".removesuffix(".0")


def catalog_markdown() -> str:
    """docs/planner.md's catalog table (kept equal by tests/test_gpu_catalog.py)."""
    rows = ["| `cluster.gpu` | bf16 dense TFLOP/s | fp8 dense TFLOP/s | memory GB | HBM TB/s | NVLink GB/s (both ways) "
            "| NIC Gb/s per GPU | NVLink domain | TDP W |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, g in GPUS.items():
        if key == "cpu":
            continue
        fp8 = _num(g.peak_flops_fp8 / T) if g.peak_flops_fp8 else "none"
        rows.append(f"| {key} | {_num(g.peak_flops_bf16 / T)} | {fp8} | {_num(g.memory_bytes / GB)} | "
                    f"{g.hbm_bytes_per_s / T:g} | {_num(g.nvlink_bytes_per_s / GB)} | {_num(g.internode_bytes_per_s * 8 / GB)} "
                    f"| {g.nvlink_domain} | {_num(g.tdp_w)} |")
    return "\n".join(rows)
