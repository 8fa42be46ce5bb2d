"""Parallelization passes, applied by :func:`llmtrain.engine.parallelize.parallelize` in a fixed order."""
