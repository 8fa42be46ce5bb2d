"""``llmtrain data prepare``: tokenize text into the memmap format that ``data.source: memmap`` reads.

    llmtrain data prepare corpus/ extra.jsonl --out data/prepared --tokenizer bpe:8000
    llmtrain data prepare book.txt --out data/book --tokenizer byte
    llmtrain data prepare shards/*.parquet --out data/web --tokenizer path/to/tokenizer.json
    llmtrain data prepare saved_ds/ --split train --text-field content --out data/web \\
        --tokenizer models/Llama-3.1-8B --workers 8

The library call is :func:`llmtrain.engine.data.prepare.prepare`; it is imported inside the
command so that other commands (``llmtrain plan``) never pay for numpy/tokenizers. See
docs/data.md for inputs, tokenizers and how document boundaries are marked.
"""

from __future__ import annotations

from pathlib import Path

import typer

from llmtrain.cli.app import app, report_errors

data_app = typer.Typer(no_args_is_help=True, help="Prepare training data (tokenize text into a memory-mapped token file).")
app.add_typer(data_app, name="data")


@data_app.command("prepare")
@report_errors
def prepare_cmd(
    inputs: list[Path] = typer.Argument(..., help=".txt (one document each), .jsonl, .parquet, and (with the datasets "
                                        "extra) .arrow, .json(.gz) files, save_to_disk directories, or directories of them."),
    out: Path = typer.Option(..., "--out", help="Output directory: tokens.bin, index.npy, meta.json and the tokenizer."),
    tokenizer: str = typer.Option("byte", "--tokenizer", help="byte, a Hugging Face tokenizer directory, "
                                  "PATH/tokenizer.json, or bpe:VOCAB (trained on the inputs)."),
    text_field: str = typer.Option("text", "--text-field", help="JSON field / column holding each document's text."),
    split: str = typer.Option(None, "--split", help="Split to read from DatasetDict.save_to_disk directories "
                              "(needed when one holds several splits)."),
    workers: int = typer.Option(1, "--workers", min=1, max=1024, help="Encoding processes; the output is the same for any N."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar on stderr (only on a terminal)."),
    force: bool = typer.Option(False, "--force", help="Replace an earlier preparation in --out (all its files "
                               "together); a directory holding other files is refused even then."),
) -> None:
    """Tokenize INPUT... into --out DIR for `data: {source: memmap, path: DIR}`."""
    from llmtrain.engine.data.prepare import prepare

    meta = prepare(inputs, out, tokenizer, progress=progress, force=force, text_field=text_field, split=split,
                   workers=workers)
    docs = f"{meta['n_docs']:,} document" + ("" if meta["n_docs"] == 1 else "s")
    print(f"prepared {meta['n_tokens']:,} tokens in {docs} "
          f"({meta['dtype']}, vocab {meta['vocab_size']:,}) -> {out}")
