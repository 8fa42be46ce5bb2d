"""Stragglers (time model v2): a synchronous step runs at the pace of its slowest GPU.

GPUs of one kind do not run at one rate. Silicon, power management and cooling spread the
sustained compute rate of identical parts: S. Bekman (ml-engineering, compute/accelerator/README.md,
"Not all accelerators are created equal", read at 744d01e) has seen "5% and higher differences
on an 8-gpu node" in the matmul rate; Sinha et al., "Not All GPUs Are Created Equal" (SC'22,
arXiv:2208.11035) measured an 8 % average performance variation (22 % at most) across the GPUs
of five clusters of one SKU, with outliers up to 1.5x slower than the median GPU. The kernel rates
v2 prices (``gemmtime.MAMF``, the flash kernels' figures) are one GPU's readings, taken here as the
median GPU's; every rank of a training step waits for the slowest at its next collective (the data-
parallel reduction at least once a step, TP and PP far more often), so the step's compute runs at
the slowest rate among the job's GPUs.

Model: per-GPU rates are normal with relative standard deviation ``sd``
(``cluster.gpu_variability``); the slowest of ``n`` runs ``c_n x sd`` below the median, ``c_n``
the expected largest of ``n`` standard normal draws (Blom's approximation,
``Phi^-1((n - 0.375) / (n + 0.25))``, within 0.03 of the exact value from n = 2 up); compute takes
``1 / (1 - c_n sd)`` as long. The default ``sd`` is Bekman's node read as the expected range of 8
draws: ``0.05 / (2 c_8) = 0.0175`` (Sinha et al.'s 8 % across whole clusters is the same order).
Outliers (a GPU 1.5x slow) are not modelled: operators drain them. What it gives: 8 GPUs +2.6 %,
64 +4.2 %, 512 +5.6 %, 16,384 +7.4 % compute time. One GPU: none.
"""

from __future__ import annotations

from functools import lru_cache
from statistics import NormalDist

NODE_SPREAD = 0.05  # Bekman: the fastest and slowest of an 8-GPU node's matmul rates, relative ("5% and higher")
NODE_GPUS = 8


@lru_cache(maxsize=256)
def expected_max_normal(n: int) -> float:
    """``E[max]`` of ``n`` standard normal draws (Blom 1958: ``Phi^-1((n - 3/8) / (n + 1/4))``); 0 for n <= 1."""
    if n <= 1:
        return 0.0
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


DEFAULT_SD = round(NODE_SPREAD / (2 * expected_max_normal(NODE_GPUS)), 4)  # 0.0175


def straggler_factor(gpus: int, sd: float) -> float:
    """How much longer a step's compute takes on ``gpus`` GPUs whose rates spread by ``sd`` than
    on the median GPU: ``1 / (1 - c_gpus x sd)`` (capped at 2x: ``sd`` is validated far below that)."""
    slow = expected_max_normal(max(1, gpus)) * max(0.0, sd)
    return 1.0 / max(0.5, 1.0 - slow)
