"""`hp-data inspect` and `hp-data merge`: the commands over written datasets."""

from __future__ import annotations

import sys

import click

from hp_data.cli.conventions import _Command, _echo, _emit, _json_option, _quiet_option
from hp_data.dataset import IndexedDataset, dataset_problems
from hp_data.format import expand_prefixes
from hp_data.merge import merge_datasets
from hp_data.object_store import StoreOptions
from hp_data.shards import merge_shards
from hp_data.summary import format_report, show_documents, summarize


@click.command(cls=_Command)
@click.argument("path")
@click.option("--check", is_flag=True, help="Verify every invariant; exit 1 listing what is wrong.")
@_json_option("the report")
@_quiet_option("progress")
@click.option(
    "--show",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Decode the first N documents, with the tokenizer the dataset records or --tokenizer.",
)
@click.option(
    "--tokenizer",
    help="For --show instead of the recorded one: a tokenizer.json, HF directory or hub name.",
)
@click.option(
    "--allow-download",
    is_flag=True,
    help="For --show: fetch a hub tokenizer that is not in the local HF cache (tokenizer "
    "files only), as preprocess does.",
)
@click.option("--multimodal", is_flag=True, help="The index carries sequence modes.")
@click.option(
    "--cache-dir",
    help="For a URL prefix: the node cache its .idx and chunks are read through (default: "
    "the shared temporary one; hp-train's data.cache_dir reuses what this one holds).",
)
def inspect(
    path: str,
    check: bool,
    as_json: bool,
    quiet: bool,
    show: int,
    tokenizer: str | None,
    allow_download: bool,
    multimodal: bool,
    cache_dir: str | None,
) -> None:
    """Describe the dataset at PATH (a prefix, its .idx or .bin, or a URL prefix)."""
    store = StoreOptions(cache_dir=cache_dir)
    if check:
        problems = dataset_problems(path, multimodal, store)
        if problems:
            if as_json:
                _emit({"prefix": path}, problems)
            else:
                _echo(f"{len(problems)} problem(s):", err=True)
                for problem in problems:
                    _echo(f"  {problem}", err=True)
            sys.exit(1)
    with IndexedDataset(path, multimodal=multimodal, store=store) as dataset:
        report = summarize(dataset)
        if show:
            report["shown"] = show_documents(dataset, show, tokenizer, allow_download)
    if as_json:
        _emit(report, verbatim=["shown"])
        return
    _echo(format_report(report))
    if check:
        _echo("check: ok, every invariant holds")
    for shown in report.get("shown", []):
        _echo(f"--- document {shown['document']} ---")
        click.echo(shown["text"])  # the corpus's own text, not a message: shown as it is


@click.command(cls=_Command)
@click.argument("out_prefix")
@click.argument("inputs", nargs=-1)
@click.option(
    "--shards",
    is_flag=True,
    help="Merge the finished shards of a preprocess run split with --num-shards into "
    "OUT_PREFIX (byte-identical to a one-machine run).",
)
@_quiet_option()
@_json_option("what was merged")
def merge(
    out_prefix: str, inputs: tuple[str, ...], shards: bool, quiet: bool, as_json: bool
) -> None:
    """Concatenate datasets INPUTS (prefixes, globs or directories) into OUT_PREFIX, in order;
    or, with --shards, the shards of OUT_PREFIX."""
    if shards:
        if inputs:
            raise click.UsageError("--shards takes no INPUTS: it finds OUT_PREFIX.shard-*")
        merged = merge_shards(out_prefix, show_progress=not quiet)
        if as_json:
            _emit(merged)
            return
        _echo(
            f"merged {merged['shards']} shard(s) into "
            + ", ".join(f"{p}.bin/.idx" for p in merged["outputs"].values())
            + f": {merged['documents']:,} documents"
            + (
                f" ({merged['duplicates_across_shards']:,} duplicates across shards dropped)"
                if merged["duplicates_across_shards"]
                else ""
            )
        )
        return
    if not inputs:
        raise click.UsageError("give the INPUTS to merge, or --shards")
    prefixes = expand_prefixes(inputs)
    merge_datasets(out_prefix, prefixes, show_progress=not quiet)
    with IndexedDataset(out_prefix, validate=False) as merged:
        if as_json:
            _emit(
                {
                    "output": merged.path_prefix,
                    "inputs": prefixes,
                    "documents": merged.num_documents,
                    "tokens": merged.num_tokens,
                    "dtype": str(merged.dtype),
                }
            )
            return
        _echo(
            f"merged {len(prefixes)} dataset(s) into {merged.path_prefix}: "
            f"{merged.num_documents:,} documents, {merged.num_tokens:,} tokens, {merged.dtype}"
        )
