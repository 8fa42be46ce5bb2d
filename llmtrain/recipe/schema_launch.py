"""The recipe's ``launch`` section: how `llmtrain launch --hosts` reaches the nodes and what it sets there.

Split from :mod:`llmtrain.recipe.schema` (one concept per file): paths, environment policy,
rendezvous, restarts and timeouts of the multi-node launchers. The values here are untrusted
input like the rest of the recipe: names and patterns are checked before anything runs, and a
variable's value is never written to disk (launch.env_sources, llmtrain/launch/envpolicy.py).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from llmtrain.recipe.schema_base import BIG, Strict

ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,255}$"
ENV_GLOB_PATTERN = r"^[A-Za-z0-9_*?\[\]!]{1,256}$"
ABS_PATH_PATTERN = r"^/[^\x00\n]{0,4095}$"


class WatchdogConfig(Strict):
    """Hang detection of the SSH launcher: a job that stops making progress is stopped and reported."""

    hang_timeout_s: float = Field(
        900, ge=0, le=BIG, description="Declare a hang when no step event arrives for this long after the first one (0 = off)."
    )
    startup_timeout_s: float = Field(
        1800, ge=0, le=BIG, description="Longest wait for the first step event (imports, rendezvous, model build; 0 = off)."
    )
    heartbeat_timeout_s: float = Field(
        30, ge=0, le=BIG, description="Declare a node lost when its heartbeat is this old (0 = off): SSH, the node helper's channel (beats every 2 s); "
        "Slurm, its logs/slurm/alive-N file (touched every 1 s; on NFS keep it above the attribute cache time)."
    )


class LaunchConfig(Strict):
    """Multi-node launch over SSH (`llmtrain launch --hosts`); the hostfile's per-host settings win over these."""

    python: str | None = Field(
        None, pattern=ABS_PATH_PATTERN, description="Absolute path of the Python on every node (default: the launching machine's)."
    )
    workdir: str | None = Field(
        None, pattern=ABS_PATH_PATTERN, description="Absolute working directory on every node (default: the launching machine's)."
    )
    shared_fs: bool = Field(
        False, description="The run directory is on a filesystem every node shares: do not copy recipe.lock.yaml to the nodes."
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Environment variables set on every node, verbatim (names with TOKEN/KEY/SECRET/PASSWORD are masked)."
    )
    env_sources: dict[str, Literal["recipe", "env_file"]] = Field(
        default_factory=dict, description="Written into recipe.lock.yaml instead of the launch.env / env_file values (never "
        "stored): NAME -> recipe | env_file. A recipe-sourced name without a launch.env value is taken from the "
        "launching environment (llmtrain resume); missing there: an error."
    )
    env_passthrough: list[str] = Field(
        default_factory=list, description="Extra name patterns (fnmatch: NCCL_*, MY_VAR) copied from the launching environment."
    )
    env_passthrough_defaults: bool = Field(
        True, description="Also pass NCCL_*, CUDA_*, TORCH_*, GLOO_*, HF_*, WANDB_*, PYTHONPATH from the launching environment."
    )
    env_file: str | None = Field(
        None, min_length=1, description="File of KEY=VALUE lines (read on the launching machine) set on every node; launch.env wins."
    )
    rendezvous: Literal["static", "c10d"] = Field(
        "static", description="static: node ranks follow the hostfile (--node-rank); c10d: torch sorts nodes by address (checked)."
    )
    rdzv_port: int = Field(29500, ge=1, le=65535, description="Rendezvous (TCPStore) port on the first host.")
    max_restarts: int = Field(
        0, ge=0, le=1000, description="torchrun --max-restarts per node; over SSH also whole-job retries after a lost node."
    )
    exclude_lost_hosts: bool = Field(
        False, description="On a whole-job retry, drop the lost host and re-validate the recipe for the smaller world."
    )
    grace_s: float = Field(
        3.0, ge=0, le=600, description="Seconds between SIGTERM and SIGKILL when the run is stopped (keep < 5 for a 5 s teardown)."
    )
    connect_timeout_s: float = Field(10, gt=0, le=600, description="SSH TCP connect timeout per host.")
    banner_timeout_s: float = Field(10, gt=0, le=600, description="Wait this long for a host's SSH banner and authentication.")
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig, description="Hang detection.")

    @field_validator("env", "env_sources")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        bad = [name for name in value if not re.match(ENV_NAME_PATTERN, name)]
        if bad:
            raise ValueError(f"{bad[0][:60]!r} is not an environment variable name; use letters, digits and _")
        return value

    @field_validator("env_passthrough")
    @classmethod
    def _patterns(cls, value: list[str]) -> list[str]:
        bad = [p for p in value if not re.match(ENV_GLOB_PATTERN, p)]
        if bad:
            raise ValueError(f"{bad[0][:60]!r} is not a name pattern; use letters, digits, _ and * ? wildcards")
        return value
