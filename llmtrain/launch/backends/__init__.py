"""Backends: each starts, watches and stops what one :class:`~llmtrain.launch.launchplan.LaunchPlan`
describes, and never re-derives a command, a variable or a path.

* ``local`` -- every rank on this machine under one torchrun (the embedded default);
* ``ssh`` / ``sshlaunch`` / ``sshrun`` -- one torchrun per hostfile node over SSH (``ssh`` is the
  only fabric importer);
* Slurm (``llmtrain.launch.backends.slurm*``) -- one sbatch job, or one srun step inside an allocation.

The shared pieces sit one floor up in :mod:`llmtrain.launch`: the plan (``launchplan``, with the
SSH builder ``commands``), ``envpolicy``, ``rundir``, ``preflight``, log streaming (``stream``,
``events``, ``summary``), teardown (``proctree``, the node helper ``remote``) and ``watchdog``.
"""
