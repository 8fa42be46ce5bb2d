"""The description of a cluster: which machines, how many ranks each, and where each rank lands.

A floor below both ``llmtrain.plan`` (which validates a layout for these nodes) and
``llmtrain.launch`` (which starts processes on them): ``hostfile`` (the hostfile forms),
``filters`` (``--include`` / ``--exclude``) and ``placement`` (rank -> node, local rank).
Pure Python, no torch and no SSH: it imports only ``llmtrain.errors``, ``llmtrain.safeio``
and the YAML helpers of ``llmtrain.recipe.load``.
"""
