"""After-the-run analysis: read a run directory's ``metrics.jsonl`` and summarize/plot it (no torch)."""
