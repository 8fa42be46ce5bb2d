"""Faults under Slurm: restarts inside the job, a lost node excluded, a requeued job resuming.

``--max-restarts K`` (``launch.max_restarts``) with ``--launcher slurm`` renders a **retry
loop over srun steps** (:func:`steps_loop`) instead of the single ``exec srun``: each attempt is
one step of all (surviving) nodes; a failed step is followed by the next one, up to K times,
with ``LLMTRAIN_AUTO_RESUME=1`` so the ranks continue from the latest complete checkpoint (or
from the start when none was committed). Inside an allocation the same loop runs on the submit
host (``RUN_DIR/slurm/steps.sh``, one ``srun --jobid`` step per attempt).

Decisions:

* **The loop lives in the batch script, not in the watching llmtrain.** The job must survive
  its submitter: a closed laptop, a login node reboot, or a requeue long after ``llmtrain``
  exited must still retry and finish. The watcher only streams, and on the first failed rank
  cancels the *step* (``scancel JOBID.STEP``) at once instead of the job, so the loop's next
  step starts within seconds (it still cancels the whole job on Ctrl-C/SIGTERM).
* **Restarts are whole steps; torchrun runs with ``--max-restarts 0`` under Slurm.** torchrun's
  own restarts restart one node's worker group; with a static rendezvous over several nodes
  the other nodes must fail and restart in lockstep, and a dead node never comes back. A new
  step restarts every node together with a fresh rendezvous, and can leave a node out.
* **A node lost mid-run is found by its heartbeat**, not at a timeout: every node's
  ``node.sh`` touches ``logs/slurm/alive-<node rank>`` each second; a file older than
  ``launch.watchdog.heartbeat_timeout_s`` (default 30 s) makes the loop cancel the step (and so
  does the watching llmtrain, which also covers runs without the loop). Without it the step
  ends when a collective times out (gloo/NCCL: minutes) or when Slurm marks the node down
  (``SlurmdTimeout``, 300 s by default); measured on the test cluster with SlurmdTimeout=30:
  ~40 s before, ~4-5 s with a 3 s heartbeat timeout.
* **A lost node** (``launch.exclude_lost_hosts``): a node whose heartbeat stopped is lost; every
  other node of the last step is probed with a one-task step (``srun --overlap -N1 -w NODE
  true``, retried for 30 s while the failed step is still completing); a node that cannot
  run one is lost too. Lost nodes are excluded (``--nodelist`` of the survivors; with
  ``--no-kill`` Slurm keeps the job when it marks that node down). The layout is re-validated
  for the survivors **at submission** by the planner, exactly as the SSH backend re-validates
  (``dp_shard: -1`` shrinks): for every node count the K restarts can reach, a valid layout
  gets its own node script ``slurm/node-M.sh``, an invalid one its first validation error in
  the loop, which then stops with exit 2 and that line. (The job cannot run the planner
  itself without assuming llmtrain on the batch node; doing it up front costs milliseconds.)
* **Requeue** (``--requeue``): ``#SBATCH --requeue``; a job Slurm requeued (preemption, a node
  failure, ``scontrol requeue``) starts its script again with ``SLURM_RESTART_COUNT`` > 0, and the
  loop then sets ``LLMTRAIN_AUTO_RESUME=1`` from the first step on. Without ``--requeue`` the
  script says ``--no-requeue``: a site's ``JobRequeue=1`` default must not rerun a job the
  user did not ask to rerun.
* Every step is started with ``--overlap``: after a node is lost, the failed step stays
  "completing" in slurmctld until Slurm gives up on that node (``SlurmdTimeout``), and holds
  the survivors' CPUs in its books although its processes there are gone; without
  ``--overlap`` the next step waits for it ("Requested nodes are busy"). Steps of one run
  never run at the same time (the loop starts one when the previous srun has returned).
* The loop's own lines go to the job's output (``logs/slurm/job.out``) as ``llmtrain: ...``;
  ``llmtrain: step N on M node(s): HOSTS`` tells the watcher which host runs which node rank.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from typing import Callable, Mapping

from llmtrain.launch.jobretry import AUTO_RESUME_ENV
from llmtrain.launch.launchplan import LaunchPlan, RetryPolicy, build_plan

STEP_LINE_RE = re.compile(r"\bllmtrain: step (\d+) on (\d+) node\(s\): (.+?)\s*$")
PROBE_TIMEOUT_S = 30


def slurm_plan(recipe, labels: list[tuple[str, int]], run_id: str, run_dir: str, module: str,
               environ: Mapping[str, str]) -> LaunchPlan:
    """The launch plan under Slurm: torchrun with ``--max-restarts 0`` (restarts are whole srun
    steps, :mod:`llmtrain.launch.backends.slurm_retry`), the recipe's retry policy kept in ``plan.retry``."""
    launch = recipe.launch
    inner = recipe.model_copy(update={"launch": launch.model_copy(update={"max_restarts": 0})})
    plan = build_plan("slurm", inner, labels, run_id, run_dir, module, "$MASTER_ADDR", environ)
    return dataclasses.replace(plan, retry=RetryPolicy(launch.max_restarts, launch.exclude_lost_hosts, launch.grace_s))


def shrunk_plans(recipe, plan: LaunchPlan, per_node: int, module: str, environ: Mapping[str, str],
                 label: str = "node {i} of the allocation") -> tuple[dict[int, LaunchPlan], dict[int, str]]:
    """For each node count a retry without lost nodes can reach: the plan (the recipe re-validated
    by the planner for that many nodes, as the SSH backend re-validates), or the first error."""
    plans, invalid = {}, {}
    for m in shrink_counts(len(plan.nodes), plan.retry.max_restarts, plan.retry.exclude_lost_hosts):
        from llmtrain.launch.backends.slurm import slurm_hostfile
        from llmtrain.plan.api import plan_recipe

        result = plan_recipe(recipe, slurm_hostfile(m, per_node))
        if not result.valid:
            invalid[m] = result.validation.errors[0].line()
            continue
        plans[m] = slurm_plan(recipe, [(label.format(i=i), per_node) for i in range(m)], plan.run_id, plan.run_dir,
                              module, environ)
    return plans, invalid


def node_script_name(nodes: int, full: int) -> str:
    return "node.sh" if nodes == full else f"node-{nodes}.sh"


def shrink_counts(full: int, max_restarts: int, exclude_lost: bool) -> list[int]:
    """Node counts below ``full`` a retry can reach (one node lost per restart at most)."""
    if not exclude_lost or max_restarts == 0:
        return []
    return list(range(full - 1, max(0, full - max_restarts - 1), -1))


def steps_loop(run_dir: str, full: int, max_restarts: int, exclude_lost: bool, srun: list[str], nodes_expr: str,
               invalid: dict[int, str], heartbeat_timeout_s: float = 0, job_expr: str = '"$SLURM_JOB_ID"',
               quote: Callable[[str], str] = shlex.quote) -> list[str]:
    """The bash lines of the retry loop. ``srun``: the step's fixed words before ``--nodes``
    (``srun --kill-on-bad-exit=1``, plus ``--jobid``/``--job-name`` inside an allocation);
    ``nodes_expr``: a shell expression giving the job's nodes in order; ``invalid``: node
    count -> the validation error that count meets (no script exists for it);
    ``heartbeat_timeout_s`` > 0: a node whose heartbeat file is older ends the step (:func:`_watchdog`)."""
    out = run_dir.replace("%", "%%") + "/logs/slurm/node-%n.out"  # srun file names: %n is the step's node id
    counts = [full, *shrink_counts(full, max_restarts, exclude_lost)]
    case = [f"        {m}) script={quote(f'{run_dir}/slurm/{node_script_name(m, full)}')} ;;"
            for m in counts if m not in invalid]
    case += [f"        {m}) echo {quote(f'llmtrain: the layout does not fit the {m} surviving node(s): {invalid[m]}')}; "
             "exit 2 ;;" for m in counts if m in invalid]
    case.append('        *) echo "llmtrain: no layout was validated for $# node(s)"; exit 2 ;;')
    step_name = next((w.split("=", 1)[1] for w in srun if w.startswith("--job-name=")), "")
    alive = quote(f"{run_dir}/logs/slurm") + "/alive-"
    lines = [f"# restarts inside this job (launch.max_restarts={max_restarts}): one srun step per attempt, each "
             "resuming from the latest complete checkpoint",
             f"MAX_RESTARTS={max_restarts}", f"nodes=\"$({nodes_expr} | tr '\\n' ' ')\"", "restart=0",
             'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then',
             f"    export {AUTO_RESUME_ENV}=1",
             '    echo "llmtrain: Slurm requeued this job (SLURM_RESTART_COUNT=$SLURM_RESTART_COUNT): the ranks resume '
             'from the latest checkpoint"',
             "fi",
             "while :; do",
             "    set -- $nodes",
             "    case $# in", *case, "    esac",
             '    MASTER_ADDR="$1"',
             "    export MASTER_ADDR",
             f"    rm -f {alive}*",
             '    echo "llmtrain: step $restart on $# node(s): $*"',
             f"    {' '.join(srun)} --overlap --nodes=$# --ntasks=$# --ntasks-per-node=1 --nodelist=\"$(echo $* | tr ' ' ,)\" "
             f"--open-mode=append --output={quote(out)} /bin/sh \"$script\" &",
             "    srun_pid=$!",
             '    lost=""',
             *_watchdog(alive, heartbeat_timeout_s, job_expr, step_name),
             '    wait "$srun_pid"',
             "    rc=$?",
             '    if [ "$rc" -eq 0 ]; then exit 0; fi',
             '    if [ "$restart" -ge "$MAX_RESTARTS" ]; then',
             '        echo "llmtrain: step $restart failed (exit $rc); no restart left (max restarts $MAX_RESTARTS)"',
             '        exit "$rc"',
             "    fi",
             "    restart=$((restart + 1))"]
    if exclude_lost:
        probe = [w for w in srun if not w.startswith(("--job-name", "--kill-on-bad-exit"))]
        lines += ['    alive=""',
                  "    for host in $nodes; do",
                  '        case " $lost " in *" $host "*)',
                  '            echo "llmtrain: node $host is lost (no heartbeat): excluded (launch.exclude_lost_hosts)"',
                  "            continue ;; esac",
                  f"        deadline=$(($(date +%s) + {PROBE_TIMEOUT_S})); ok=0",
                  '        while [ "$(date +%s)" -lt "$deadline" ]; do  # the failed step may still be completing: retry',
                  f"            if timeout $((deadline - $(date +%s))) {' '.join(probe)} --job-name=llmtrain-probe --overlap "
                  '--nodes=1 --ntasks=1 --nodelist="$host" --output=/dev/null --error=/dev/null true 2>/dev/null; then',
                  "                ok=1; break",
                  "            fi",
                  "            sleep 1",
                  "        done",
                  '        if [ "$ok" = 1 ]; then',
                  '            alive="$alive $host"',
                  "        else",
                  f'            echo "llmtrain: node $host is lost (it cannot run a step within {PROBE_TIMEOUT_S} s): '
                  'excluded (launch.exclude_lost_hosts)"',
                  "        fi",
                  "    done",
                  "    nodes=\"$(echo $alive)\"",
                  '    if [ -z "$nodes" ]; then echo "llmtrain: every node is lost"; exit "$rc"; fi']
    lines += ['    echo "llmtrain: step failed (exit $rc): restart $restart of $MAX_RESTARTS in this job; the ranks '
              'resume from the latest checkpoint"',
              f"    export {AUTO_RESUME_ENV}=1",
              "done"]
    return lines


def _watchdog(alive: str, timeout_s: float, job_expr: str, step_name: str) -> list[str]:
    """While the step runs: every second, a node whose heartbeat (``node.sh`` touches
    ``alive-<node rank>`` every second) is older than ``timeout_s`` is lost, and the step is
    cancelled now -- not when a collective times out (gloo/NCCL: minutes) or Slurm marks the
    node down (``SlurmdTimeout``, 300 s by default). A node that has not beaten yet is starting."""
    if timeout_s <= 0:
        return ["    while kill -0 \"$srun_pid\" 2>/dev/null; do sleep 1; done"]
    return ["    while kill -0 \"$srun_pid\" 2>/dev/null; do",
            "        sleep 1",
            "        now=$(date +%s)",
            "        for i in $(seq 0 $(($# - 1))); do",
            f"            beat=$(stat -c %Y {alive}$i 2>/dev/null) || continue",
            f"            if [ $((now - beat)) -gt {int(timeout_s)} ]; then",
            "                host=$(eval echo \\${$((i + 1))})",
            '                lost="$lost $host"',
            f'                echo "llmtrain: node $host has sent no heartbeat for {int(timeout_s)} s: lost; '
            'cancelling the step"',
            f"                squeue -h -s -j {job_expr} -o '%i %j' | awk -v n={shlex.quote(step_name)} '$2 == n {{print $1}}' "
            "| xargs -r scancel",
            '                kill -9 "$srun_pid" 2>/dev/null  # srun would wait KillWait+2 s for the dead node\'s stepd',
            f"                rm -f {alive}*",
            "                break",
            "            fi",
            "        done",
            "    done"]


__all__ = ["slurm_plan", "shrunk_plans", "STEP_LINE_RE", "node_script_name", "shrink_counts", "steps_loop"]
