"""``llmtrain report RUN_DIR``: loss/lr/tokens-per-second curves and a summary of a finished run."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from llmtrain.cli.app import app, report_errors
from llmtrain.safeio import printable


@app.command()
@report_errors
def report(
    run_dir: Path = typer.Argument(..., help="Run directory (runs/<name>/<run id>) holding metrics.jsonl."),
    out: Optional[Path] = typer.Option(None, "--out", help="PNG to write, or a directory for report.png in it "
                                       "(default: RUN_DIR/report.png)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out file that is not a PNG."),
) -> None:
    """Plot a run's loss, learning rate and tokens/s into report.png and print a summary."""
    from llmtrain.analysis.report import report as make_report
    from llmtrain.analysis.report import summary_lines

    summary, png = make_report(run_dir, out, force)
    print(f"run {printable(run_dir)}")
    for line in summary_lines(summary):
        print(f"  {line}")
    print(f"  curves        {png}")
