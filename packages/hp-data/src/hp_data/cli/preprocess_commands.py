"""`hp-data plan` and `hp-data preprocess`: the commands over a corpus; the flags parsed
into the pipeline's options (Megatron's flags too), the run called and its report printed."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import click

from hp_data.plan import describe, plan_units, shard_groups
from hp_data.readers.discovery import FORMATS, discover
from hp_data.readers.units import MAX_DOCUMENT_CHARS
from hp_data.remote import set_timeout

# preprocess (tokenizers, multiprocessing) and tokenize are imported by the commands
# that use them: every command pays the start-up of what it imports (merge --shards on N
# machines' output is the one that waits for it).
if TYPE_CHECKING:
    from hp_data.pipeline.options import PreprocessOptions


from hp_data.cli.conventions import (
    _Command,
    _echo,
    _emit,
    _finite,
    _json_option,
    _num_shards_option,
    _quiet_option,
    _remote_timeout_option,
    _unit_bytes,
    _unit_mb_option,
    _units_option,
)


@click.command(name="plan", cls=_Command)
@click.argument("corpus", nargs=-1, required=True)
@_units_option
@_unit_mb_option
@_num_shards_option("Also show which shard of this many takes each unit.")
@click.option("--input-format", type=click.Choice(FORMATS), default=None, help="As for preprocess.")
@_remote_timeout_option
@_json_option("the plan")
@_quiet_option("progress")
def plan_command(
    corpus: tuple[str, ...],
    units: int | None,
    unit_mb: float | None,
    num_shards: int,
    input_format: str | None,
    remote_timeout: float,
    as_json: bool,
    quiet: bool,
) -> None:
    """Show how CORPUS is cut into work units (files, line-aligned byte ranges of JSONL,
    Parquet row groups) and which shard of --num-shards processes each, as preprocess will."""
    set_timeout(remote_timeout)
    found = discover(list(corpus), input_format)
    planned = plan_units(found, _unit_bytes(units, unit_mb), units, num_shards)
    described = describe(planned, shard_groups(planned, num_shards))
    if as_json:
        _emit(described)
        return
    for row in described["units"]:
        where = f" {row['kind']} {row['start']}-{row['end']}" if "start" in row else ""
        _echo(
            f"unit {row['unit']:>5}  shard {row['shard']:>5}  {row['path']}{where}  "
            f"({row['bytes']:,} bytes)"
        )
    _echo(
        f"{len(planned)} unit(s), {described['total_bytes']:,} bytes, {num_shards} shard(s); "
        f"plan {described['fingerprint']}"
    )


@click.command(name="preprocess", cls=_Command)
@click.argument("corpus", nargs=-1)
@click.option(
    "--input",
    "inputs",
    multiple=True,
    help="A corpus file, glob or directory, as Megatron's --input (repeatable; same as CORPUS).",
)
@click.option(
    "--out",
    "out_prefix",
    default=None,
    help="Output prefix: writes OUT.bin/.idx (one key) or OUT_{key}_document.bin/.idx.",
)
@click.option(
    "--output-prefix",
    default=None,
    help="Megatron's output naming: writes OUTPUT_PREFIX_{key}_document.bin/.idx for every "
    "key, what a Megatron --data-path names.",
)
@click.option(
    "--tokenizer",
    "--tokenizer-model",
    "tokenizer",
    default=None,
    help="tokenizer.json, a HF tokenizer directory (tokenizer.json or vocab.json + merges.txt, "
    "and tokenizer_config.json), or a HF hub name found in the local HF cache.",
)
@click.option(
    "--tokenizer-type",
    type=click.Choice(
        [
            "HuggingFaceTokenizer",
            "GPT2BPETokenizer",
            "GPTSentencePieceTokenizer",
            "Llama2Tokenizer",
        ],
        case_sensitive=False,
    ),
    default=None,
    help="Megatron's tokenizer type: HuggingFaceTokenizer (with --tokenizer-model), "
    "GPT2BPETokenizer (with --vocab-file and --merge-file), GPTSentencePieceTokenizer or "
    "Llama2Tokenizer (with --tokenizer-model m.model; needs hp-data[sentencepiece]).",
)
@click.option("--vocab-file", default=None, help="GPT-2 BPE vocab.json (with --merge-file).")
@click.option("--merge-file", default=None, help="GPT-2 BPE merges.txt (with --vocab-file).")
@click.option(
    "--allow-download",
    is_flag=True,
    help="Fetch a hub tokenizer that is not in the local HF cache (tokenizer files only).",
)
@click.option(
    "--tokenizer-engine",
    type=click.Choice(["auto", "hf", "tiktoken"]),
    default="auto",
    show_default=True,
    help="auto: tiktoken where it is proven to give tokenizers' ids (byte-level BPE; also "
    "checked on probe texts and sampled documents), else tokenizers (hf). tiktoken: insist.",
)
@click.option(
    "--verify",
    is_flag=True,
    help="Check the tiktoken engine's ids against tokenizers on every document, not 1 in 1,000.",
)
@click.option(
    "--json-keys",
    multiple=True,
    default=("text",),
    show_default=True,
    help="JSON keys (columns) to tokenize; repeat the option or separate keys by "
    "commas or spaces. Several keys write one output per key.",
)
@click.option(
    "--append-eod", is_flag=True, help="Append the end-of-document token to each document."
)
@click.option(
    "--eod-token",
    default=None,
    help="The end-of-document token [default: tokenizer_config.json's eos_token, "
    "else the first of <|endoftext|>, <|end_of_text|>, </s>, <eos>, <|eos|>].",
)
@click.option(
    "--add-bos", is_flag=True, help="Put the beginning-of-sequence token first in each document."
)
@click.option(
    "--bos-token",
    default=None,
    help="The BOS token [default: tokenizer_config.json's bos_token, else the first of "
    "<|begin_of_text|>, <s>, <bos>, <|startoftext|>, <|bos|>].",
)
@click.option(
    "--dtype",
    type=click.Choice(["uint8", "uint16", "int32", "int64"]),
    default=None,
    help="Token dtype [default: uint16 if the vocabulary fits, else int32].",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Worker processes [default: all cores].",
)
@click.option(
    "--skip-invalid",
    is_flag=True,
    help="Count and skip invalid lines instead of stopping at the first.",
)
@click.option(
    "--keep-empty",
    is_flag=True,
    help="Write documents that tokenize to nothing (as documents with no sequences) "
    "instead of skipping them.",
)
@click.option(
    "--dedup",
    type=click.Choice(["exact"]),
    default=None,
    help="Drop documents whose normalised text was seen before [default: off].",
)
@click.option(
    "--max-document-chars",
    type=click.IntRange(min=0),
    default=MAX_DOCUMENT_CHARS,
    show_default=True,
    help="A longer text is an invalid record (file:line; skipped with --skip-invalid): "
    "tokenizers takes hundreds of bytes of memory a character to encode one. 0: no limit.",
)
@click.option(
    "--input-format",
    type=click.Choice(list(FORMATS)),
    default=None,
    help="Input format [default: from the file name; a directory with state.json is a "
    "saved HF dataset; 'hf' loads a directory with datasets.load_dataset].",
)
@click.option(
    "--split",
    "hf_split",
    default="train",
    show_default=True,
    help="Split of an HF dataset or DatasetDict.",
)
@click.option(
    "--chunk-mb",
    type=click.FloatRange(min=0.01, max=1 << 20),
    callback=lambda ctx, param, value: _finite(param, value),
    default=1.0,
    show_default=True,
    help="Input per work unit, in MB.",
)
@_num_shards_option(
    "Split the run into this many shards (one per machine: a Slurm array, Ray tasks)."
)
@click.option(
    "--shard-index",
    type=click.IntRange(min=0, max=99_998),
    default=None,
    help="Process only this shard, into OUT.shard-0000I-of-0000N; then merge OUT --shards.",
)
@_units_option
@_unit_mb_option
@_remote_timeout_option
@click.option(
    "--ray",
    "ray_address",
    is_flag=False,
    flag_value="local",
    default=None,
    help="Run the shards as tasks on a Ray cluster and merge them: --ray=auto (this machine's "
    "cluster), --ray=ADDRESS, or --ray alone for a local one (needs hp-data[ray]).",
)
@click.option(
    "--ray-schedule-timeout",
    type=click.FloatRange(min=0, min_open=True),
    callback=lambda ctx, param, value: value if value is None else _finite(param, value),
    default=None,
    help="With --ray: stop when none of the run's tasks has been running for this many "
    "seconds (no node with --workers free CPUs) [default: 600].",
)
@_quiet_option()
@_json_option("the summary")
@click.option("--split-sentences", is_flag=True, hidden=True)
@click.option("--partitions", type=int, default=None, hidden=True)
@click.option("--log-interval", type=int, default=None, hidden=True)
@click.option("--keep-sequential-samples", is_flag=True, hidden=True)
@click.option("--keep-newlines", is_flag=True, hidden=True)
@click.option("--lang", default=None, hidden=True)
def preprocess_command(
    corpus: tuple[str, ...],
    inputs: tuple[str, ...],
    out_prefix: str | None,
    output_prefix: str | None,
    tokenizer: str | None,
    tokenizer_type: str | None,
    vocab_file: str | None,
    merge_file: str | None,
    allow_download: bool,
    tokenizer_engine: str,
    verify: bool,
    json_keys: tuple[str, ...],
    append_eod: bool,
    eod_token: str | None,
    add_bos: bool,
    bos_token: str | None,
    dtype: str | None,
    workers: int | None,
    skip_invalid: bool,
    keep_empty: bool,
    dedup: str | None,
    max_document_chars: int,
    input_format: str | None,
    hf_split: str,
    chunk_mb: float,
    num_shards: int,
    shard_index: int | None,
    units: int | None,
    unit_mb: float | None,
    remote_timeout: float,
    ray_address: str | None,
    ray_schedule_timeout: float | None,
    quiet: bool,
    as_json: bool,
    split_sentences: bool,
    **ignored: Any,
) -> None:
    """Tokenize CORPUS (JSONL, .jsonl.gz, .jsonl.zst, Parquet, HF datasets; files, globs or
    directories) into Megatron .bin/.idx datasets, in parallel and resumably.

    Megatron's tools/preprocess_data.py flags work as they are: --input, --output-prefix,
    --tokenizer-type, --tokenizer-model, --vocab-file, --merge-file (docs/preprocess.md)."""
    from hp_data.pipeline.driver import preprocess
    from hp_data.pipeline.summary import format_summary
    from hp_data.tokenize import resolve_tokenizer

    corpus = corpus + inputs
    _check_preprocess_flags(corpus, out_prefix, output_prefix, split_sentences)
    _note_ignored_flags(ignored, quiet)
    if quiet:  # huggingface_hub's download bars too (read when it is first imported)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    files = resolve_tokenizer(tokenizer, tokenizer_type, vocab_file, merge_file, allow_download)
    options = _preprocess_options(click.get_current_context().params)
    out_prefix = output_prefix if out_prefix is None else out_prefix
    if ray_address is not None:
        if shard_index is not None:
            raise click.UsageError("--ray runs every shard; leave out --shard-index")
        _preprocess_on_ray(
            corpus, out_prefix, files, options, ray_address, ray_schedule_timeout, as_json
        )
        return
    if ray_schedule_timeout is not None:
        raise click.UsageError("--ray-schedule-timeout is for --ray; leave it out")
    if num_shards > 1 and shard_index is None:
        raise click.UsageError("--num-shards needs --shard-index (which shard this run is)")
    summary = preprocess(list(corpus), out_prefix, files, options)
    if as_json:
        _emit(summary.as_dict())
    else:
        _echo(format_summary(summary))


def _check_preprocess_flags(
    corpus: tuple[str, ...],
    out_prefix: str | None,
    output_prefix: str | None,
    split_sentences: bool,
) -> None:
    """The usage errors that preprocess's flags give before anything is read."""
    if not corpus:
        raise click.UsageError("name the corpus: CORPUS... or --input")
    if (out_prefix is None) == (output_prefix is None):
        raise click.UsageError("give the output as --out or as --output-prefix (Megatron's)")
    if split_sentences:
        raise click.UsageError(
            "--split-sentences: hp-data writes one sequence per document and does not split "
            "sentences; leave it out"
        )


def _note_ignored_flags(ignored: dict[str, Any], quiet: bool) -> None:
    """A note for each of Megatron's flags given that hp-data takes and ignores."""
    for name, value in ignored.items():
        if value and not quiet:
            _echo(f"Note: --{name.replace('_', '-')} is Megatron's; hp-data ignores it", err=True)


def _preprocess_options(flags: dict[str, Any]) -> PreprocessOptions:
    """preprocess's flags (click's parameters, by name) as the pipeline's options."""
    from hp_data.pipeline.options import PreprocessOptions, default_workers, megatron_keys

    json_keys, workers, ray_address = flags["json_keys"], flags["workers"], flags["ray_address"]
    chunk_mb, units, unit_mb = flags["chunk_mb"], flags["units"], flags["unit_mb"]
    quiet, output_prefix = flags["quiet"], flags["output_prefix"]
    return PreprocessOptions(
        json_keys=megatron_keys(json_keys),
        append_eod=flags["append_eod"],
        eod_token=flags["eod_token"],
        add_bos=flags["add_bos"],
        bos_token=flags["bos_token"],
        dtype=flags["dtype"],
        workers=workers or (1 if ray_address else default_workers()),  # Ray: a task per CPU
        skip_invalid=flags["skip_invalid"],
        keep_empty=flags["keep_empty"],
        dedup=flags["dedup"],
        max_document_chars=flags["max_document_chars"] or None,
        input_format=flags["input_format"],
        hf_split=flags["hf_split"],
        chunk_bytes=int(chunk_mb * (1 << 20)),
        show_progress=not quiet,
        unit_bytes=_unit_bytes(units, unit_mb),
        units=units,
        num_shards=flags["num_shards"],
        shard_index=flags["shard_index"],
        tokenizer_engine=flags["tokenizer_engine"],
        verify=flags["verify"],
        allow_download=flags["allow_download"],
        megatron_names=output_prefix is not None,
        remote_timeout=flags["remote_timeout"],
    )


def _preprocess_on_ray(
    corpus: tuple[str, ...],
    out_prefix: str,
    files: Any,
    options: PreprocessOptions,
    ray_address: str,
    ray_schedule_timeout: float | None,
    as_json: bool,
) -> None:
    """`--ray`: every shard as a Ray task (on_ray.py), and its report printed."""
    from hp_data.on_ray import preprocess_on_ray

    address = None if ray_address == "local" else ray_address
    report = preprocess_on_ray(
        list(corpus), out_prefix, files, options, address, ray_schedule_timeout
    )
    if as_json:
        _emit(report)
    else:
        _echo(
            f"wrote {', '.join(f'{p}.bin/.idx' for p in report['outputs'].values())} from "
            f"{report['tasks']} Ray task(s): {report['documents']:,} documents "
            f"({report['documents_in']:,} in); {report['seconds']:.1f} s"
        )
