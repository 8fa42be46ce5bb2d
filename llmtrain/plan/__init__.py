"""Planning: ParallelDims (rank layout), validation, batch math, reports. Never imports torch."""
