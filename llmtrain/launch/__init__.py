"""Launching, as one plan and several backends. Never imports torch or the engine.

* ``launchplan`` -- the launch plan (pure data: per node the exact command, environment,
  working directory, run directory, log paths; rendezvous; retry policy), its builders for a
  local run and for nodes known by position (Slurm), and the one ``--dry-run`` renderer;
  ``commands`` -- the plan of an SSH launch, from a hostfile;
* shared pieces: ``envpolicy`` + ``secrets`` (what the nodes' environment holds, masked),
  ``rundir``, ``preflight``, ``sshconfig``, streaming (``stream``, ``events``, ``summary``),
  teardown (``proctree``; ``remote``, the node helper), ``watchdog``, ``jobretry``;
* ``backends/`` -- ``local``, ``ssh`` (+ ``sshlaunch``, ``sshrun``), ``slurm`` (+ ``slurm_script``,
  ``slurm_retry``, ``slurm_alloc``, ``slurm_step``, ``slurm_preflight``, ``slurmctl``): they start,
  watch and stop what the plan describes.

The cluster itself (hostfile, ``--include``/``--exclude``, placement) is described one floor
down, in :mod:`llmtrain.cluster`, which ``plan`` reads as well.
"""
