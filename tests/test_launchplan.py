"""One launch plan for every backend (pure: nothing is started, no host is touched).

The local, SSH and Slurm plans come from one assembler and print through one renderer; the local
backend runs exactly the plan's command with exactly the plan's variables (what
``test_launch_local.py`` runs for real), and a plan never holds a secret anywhere but in memory.
"""

from __future__ import annotations

import shlex
import sys

from llmtrain.cluster.hostfile import parse_hostfile
from llmtrain.launch.backends.local import launch_env, torchrun_command
from llmtrain.launch.commands import build_spec
from llmtrain.launch.launchplan import build_plan, describe, local_plan, node_command
from llmtrain.launch.rundir import RunDir
from llmtrain.launch.sshconfig import SSHTarget
from llmtrain.recipe.load import load_recipe_text

RUN_ID = "20260101-000000-abcd"


def recipe(launch: str = "{}"):
    return load_recipe_text(f"model: {{preset: debug-dense}}\nname: t\nlaunch: {launch}\n")


def test_local_plan_is_what_the_local_backend_runs(tmp_path):
    run = RunDir(tmp_path / "r", "t", RUN_ID)
    base = {"PATH": "/bin", "OMP_NUM_THREADS": ""}
    plan = local_plan(recipe("{max_restarts: 2, env: {A: 'x y'}}"), 4, RUN_ID, str(run.path), "m", environ=base,
                      extra_env={"LLMTRAIN_RESUME": "/ck"}, cwd="/w")
    (node,) = plan.nodes
    assert list(node.command) == torchrun_command(run, 4, "m", max_restarts=2)
    assert node.log_dir == f"{run.path}/logs/torchrun" and node.workdir == "/w" and node.output_log is None
    env = {v.name: v.value for v in node.env}
    want = launch_env(run, 4, base={}, max_restarts=2, policy=plan.policy, launch_id=plan.launch_id)
    assert env == {**want, "LLMTRAIN_RESUME": "/ck"}  # the plan holds only additions: base stays os.environ
    assert env["A"] == "x y" and env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # trap 5, with restarts
    assert node_command(node).startswith("cd /w && exec env A='x y' LLMTRAIN_RUN_ID=")


def test_one_renderer_for_local_ssh_and_slurm():
    r = recipe("{env: {HF_TOKEN: hf-secret-value}}")
    hostfile = parse_hostfile("a slots=2\nb slots=2\n")
    ssh = build_spec(r, hostfile, [SSHTarget("a", "10.0.0.1"), SSHTarget("b", "10.0.0.2")], RUN_ID, "/runs", "m",
                     environ={}, python="/p", cwd="/w")
    slurm = build_plan("slurm", r, [("node 0 of the job", 2), ("node 1 of the job", 2)], RUN_ID, f"/runs/t/{RUN_ID}",
                       "m", "$MASTER_ADDR", environ={}, cwd="/w")
    local = local_plan(r, 4, RUN_ID, f"/runs/t/{RUN_ID}", "m", environ={}, cwd="/w")
    heads = [describe(p)[0] for p in (local, ssh, slurm)]
    assert heads == [f"run t/{RUN_ID}: 1 node(s), world size 4, rendezvous standalone (this machine), max restarts 0",
                     f"run t/{RUN_ID}: 2 node(s), world size 4, rendezvous static at 10.0.0.1:29500, max restarts 0",
                     f"run t/{RUN_ID}: 2 node(s), world size 4, rendezvous static at $MASTER_ADDR:29500, max restarts 0"]
    assert describe(slurm)[3] == f"# node 1: node 1 of the job, ranks 2-3; torchrun output in /runs/t/{RUN_ID}/logs/slurm/node-1.out"
    for plan in (local, ssh, slurm):
        shown = "\n".join(describe(plan))
        assert "hf-secret-value" not in shown and "HF_TOKEN=****" in shown
        assert len(describe(plan)) == 1 + 2 * len(plan.nodes)  # the run, then two lines per node
    # the same torchrun line, only the rendezvous and the node's address differ
    ssh1, slurm1 = ssh.nodes[1].argv, slurm.nodes[1].argv
    assert ssh1[ssh1.index("--nnodes"):ssh1.index("--rdzv-endpoint")] == slurm1[slurm1.index("--nnodes"):slurm1.index("--rdzv-endpoint")]
    assert "--local-addr" in ssh1 and "--local-addr" not in slurm1
    # Slurm's words keep $MASTER_ADDR for the node's shell; SSH quotes every word as it always did
    assert '"$MASTER_ADDR":29500' in describe(slurm)[2] and shlex.split(describe(ssh)[2].split(" && exec ")[1])[0] == "env"
    assert ssh.nodes[1].command[:4] == ("/p", "-m", "llmtrain.launch.remote", "run") and slurm.nodes[1].wrapper == ()
    assert local.nodes[0].python == sys.executable
