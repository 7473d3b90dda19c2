"""The `hp-data` command: parse arguments, call the library, print. No logic lives here."""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import click
from click.core import ParameterSource

from hp_data.blend import (
    EVAL_INTERVAL,
    EVAL_ITERS,
    build_datasets,
    build_report,
    parse_blend,
    split_sample_counts,
)
from hp_data.dataset import IndexedDataset
from hp_data.errors import ArgumentError, HpDataError
from hp_data.format import expand_prefixes
from hp_data.format.validate import dataset_problems
from hp_data.gpt import MAX_SEQ_LENGTH, GPTDatasetConfig
from hp_data.merge import merge_datasets
from hp_data.plan import describe, plan_units, shard_groups
from hp_data.readers import FORMATS, MAX_DOCUMENT_CHARS, discover
from hp_data.redact import redact, redact_data
from hp_data.remote import DEFAULT_TIMEOUT, set_timeout
from hp_data.shards import merge_shards
from hp_data.summary import format_report, show_documents, summarize

# preprocess (tokenizers, multiprocessing) and tokenize are imported by the commands
# that use them: every command pays the start-up of what it imports (merge --shards on N
# machines' output is the one that waits for it).


# The version of every command's --json output; the keys are listed in docs/cli.md.
SCHEMA = 1
_Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


class _Command(click.Command):
    """The library's `ArgumentError` (arguments that contradict each other) is a usage error,
    as click's own are: exit 2, after this command's usage line."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ArgumentError as exc:
            raise click.UsageError(str(exc), ctx) from None


class _Group(click.Group):
    """Turns hp-data's own errors and OS errors into one line on stderr and exit code 1
    (with --json, also the failure's JSON on stdout), and a closed stdout into a quiet exit."""

    command_class = _Command

    def invoke(self, ctx: click.Context) -> Any:
        formatter, warnings.formatwarning = warnings.formatwarning, _one_line_warning
        try:
            with warnings.catch_warnings():
                return super().invoke(ctx)
        except BrokenPipeError:
            # `hp-data inspect --show 100 | head`: the reader has what it wanted. Point
            # stdout at /dev/null so that the exit's flush cannot fail again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        except HpDataError as exc:
            raise _failure(ctx, str(exc)) from None
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            raise _failure(ctx, f"{where}{exc.strerror or exc}") from None
        finally:
            warnings.formatwarning = formatter


def _failure(ctx: click.Context, message: str) -> click.ClickException:
    message = redact(message)  # an OSError's, or a third party's, may quote a URL
    if ctx.meta.get("hp_json"):
        _emit({}, [message])
    return click.ClickException(message)


def _echo(message: str, err: bool = False) -> None:
    """Print a line of hp's: every one but a corpus's own text goes through here, so that
    none shows a credential (`redact`)."""
    click.echo(redact(message), err=err)


def _emit(
    payload: dict[str, Any], problems: Iterable[str] = (), verbatim: Iterable[str] = ()
) -> None:
    """A command's --json output: one object, the same shape on success and failure, with
    every string redacted but those of the `verbatim` keys (a corpus's own text)."""
    problems = list(problems)
    body = {"schema": SCHEMA, "ok": not problems, "problems": problems, **payload}
    kept = {key: body.pop(key) for key in verbatim if key in body}
    click.echo(json.dumps({**redact_data(body), **kept}))


def _json_option(what: str) -> _Decorator:
    """--json, remembered for the error handler (which then prints the failure as JSON)."""

    def remember(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
        ctx.meta["hp_json"] = value
        return value

    return click.option(
        "--json",
        "as_json",
        is_flag=True,
        callback=remember,
        is_eager=True,
        help=f"Print {what} as one JSON object (keys: docs/cli.md).",
    )


def _quiet_option(what: str = "progress bars") -> _Decorator:
    """--quiet: no {what} or notes on stderr. Warnings still print (one line each): they are
    about the result."""

    return click.option("--quiet", is_flag=True, help=f"No {what} or notes; warnings still show.")


def _unit_bytes(units: int | None, unit_mb: float | None) -> int | None:
    if units is not None and unit_mb is not None:
        raise click.UsageError("give --units or --unit-mb, not both")
    return None if unit_mb is None else max(int(unit_mb * (1 << 20)), 1)


def _finite(param: click.Parameter, value: float) -> float:
    """click's FloatRange lets NaN through (every comparison with it is false)."""
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a number", param=param)
    return value


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hp-data")
def main() -> None:
    """Build, check, merge and inspect Megatron-format (.bin/.idx) token datasets."""


def _one_line_warning(message: Warning | str, *args: object, **kwargs: object) -> str:
    """A warning as users of a command read it: no file, line or source of hp's code."""
    return f"Warning: {redact(str(message))}\n"


@main.command()
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
def inspect(
    path: str,
    check: bool,
    as_json: bool,
    quiet: bool,
    show: int,
    tokenizer: str | None,
    allow_download: bool,
    multimodal: bool,
) -> None:
    """Describe the dataset at PATH (a prefix, or its .idx or .bin)."""
    if check:
        problems = dataset_problems(path, multimodal)
        if problems:
            if as_json:
                _emit({"prefix": path}, problems)
            else:
                _echo(f"{len(problems)} problem(s):", err=True)
                for problem in problems:
                    _echo(f"  {problem}", err=True)
            sys.exit(1)
    with IndexedDataset(path, multimodal=multimodal) as dataset:
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


@main.command()
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


# The work-unit options, the same for plan and preprocess (which must agree on the plan).
_units_option = click.option(
    "--units",
    type=click.IntRange(min=1),
    default=None,
    help="Cut the inputs into about this many work units (see hp-data plan).",
)
_unit_mb_option = click.option(
    "--unit-mb",
    type=click.FloatRange(min=0.001, max=1 << 30),
    callback=lambda ctx, param, value: None if value is None else _finite(param, value),
    default=None,
    help="Work-unit size in MB [default: 256, or a quarter of a shard].",
)

_remote_timeout_option = click.option(
    "--remote-timeout",
    type=click.FloatRange(min=0, min_open=True),
    callback=lambda ctx, param, value: _finite(param, value),
    default=DEFAULT_TIMEOUT,
    show_default=True,
    help="Seconds a remote (http(s), s3) request may wait to connect or for its next bytes; "
    "a failed request is tried 3 times, then the run stops naming the object.",
)


def _num_shards_option(text: str) -> Any:
    return click.option(
        "--num-shards",
        type=click.IntRange(min=1, max=99_999),
        default=1,
        show_default=True,
        help=text,
    )


@main.command(name="plan")
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


@main.command(name="preprocess")
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
    from hp_data.pipeline import (
        PreprocessOptions,
        default_workers,
        format_summary,
        megatron_keys,
        preprocess,
    )
    from hp_data.tokenize import resolve_tokenizer

    corpus = corpus + inputs
    if not corpus:
        raise click.UsageError("name the corpus: CORPUS... or --input")
    if (out_prefix is None) == (output_prefix is None):
        raise click.UsageError("give the output as --out or as --output-prefix (Megatron's)")
    if split_sentences:
        raise click.UsageError(
            "--split-sentences: hp-data writes one sequence per document and does not split "
            "sentences; leave it out"
        )
    for name, value in ignored.items():
        if value and not quiet:
            _echo(f"Note: --{name.replace('_', '-')} is Megatron's; hp-data ignores it", err=True)
    if quiet:  # huggingface_hub's download bars too (read when it is first imported)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    files = resolve_tokenizer(tokenizer, tokenizer_type, vocab_file, merge_file, allow_download)

    options = PreprocessOptions(
        json_keys=megatron_keys(json_keys),
        append_eod=append_eod,
        eod_token=eod_token,
        add_bos=add_bos,
        bos_token=bos_token,
        dtype=dtype,
        workers=workers or (1 if ray_address else default_workers()),  # Ray: a task per CPU
        skip_invalid=skip_invalid,
        keep_empty=keep_empty,
        dedup=dedup,
        max_document_chars=max_document_chars or None,
        input_format=input_format,
        hf_split=hf_split,
        chunk_bytes=int(chunk_mb * (1 << 20)),
        show_progress=not quiet,
        unit_bytes=_unit_bytes(units, unit_mb),
        units=units,
        num_shards=num_shards,
        shard_index=shard_index,
        tokenizer_engine=tokenizer_engine,
        verify=verify,
        allow_download=allow_download,
        megatron_names=output_prefix is not None,
        remote_timeout=remote_timeout,
    )
    out_prefix = output_prefix if out_prefix is None else out_prefix
    if ray_address is not None:
        if shard_index is not None:
            raise click.UsageError("--ray runs every shard; leave out --shard-index")
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


@main.command(name="build-index")
@click.option(
    "--data-path",
    multiple=True,
    required=True,
    help="A dataset prefix, or weighted prefixes '0.3 /data/a 0.7 /data/b' "
    "(quoted, or the option repeated).",
)
@click.option(
    "--seq-len",
    "--seq-length",
    "seq_len",
    type=click.IntRange(min=2, max=MAX_SEQ_LENGTH),
    required=True,
    help="Sequence length L (Megatron's --seq-length).",
)
@click.option(
    "--seed",
    type=click.IntRange(0, 2**32 - 1),
    default=1234,
    show_default=True,
    help="Random seed.",
)
@click.option(
    "--num-samples",
    default=None,
    help="Samples for train[,valid[,test]] [default: one epoch of each split; for a weighted "
    "blend, one epoch of the dataset its weight uses up first].",
)
@click.option(
    "--train-samples", type=click.IntRange(min=0), default=None, help="Megatron's sizes: see below."
)
@click.option("--train-iters", type=click.IntRange(min=0), default=None, help="Megatron's.")
@click.option("--global-batch-size", type=click.IntRange(min=1), default=None, help="Megatron's.")
@click.option(
    "--eval-iters",
    type=click.IntRange(min=0),
    default=EVAL_ITERS,
    show_default=True,
    help="Megatron's.",
)
@click.option(
    "--eval-interval",
    type=click.IntRange(min=0),
    default=EVAL_INTERVAL,
    show_default=True,
    help="Megatron's; 0: no validation during training (no valid samples), as in hp-train.",
)
@click.option(
    "--split", default="969,30,1", show_default=True, help="Train, valid and test shares."
)
@click.option(
    "--no-extra-token",
    is_flag=True,
    help="Samples of L tokens instead of L+1 (Megatron's add_extra_token_to_sequence off).",
)
@click.option(
    "--keep-last-partial-validation",
    is_flag=True,
    help="Keep the valid split's last partial sample (padded).",
)
@click.option(
    "--cache-dir",
    "--data-cache-path",
    "cache_dir",
    required=True,
    help="Where the index arrays are written (Megatron's --data-cache-path).",
)
@_json_option("the report")
@_quiet_option("progress")
def build_index(
    data_path: tuple[str, ...],
    seq_len: int,
    seed: int,
    num_samples: str | None,
    train_samples: int | None,
    train_iters: int | None,
    global_batch_size: int | None,
    eval_iters: int,
    eval_interval: int,
    split: str,
    no_extra_token: bool,
    keep_last_partial_validation: bool,
    cache_dir: str,
    as_json: bool,
    quiet: bool,
) -> None:
    """Build (or find in the cache) the GPT and blend indices of every split ahead of a run.

    Sizes as Megatron computes them from --train-samples or --train-iters with
    --global-batch-size: train = train samples (or iters x batch), valid = (train iters //
    eval interval + 1) x eval iters x batch (0 for an eval interval of 0: no validation),
    test = eval iters x batch."""
    spec = " ".join(data_path)
    try:
        parse_blend(spec)
    except HpDataError as exc:  # the library's message names no flag: this one does
        raise HpDataError(f"--data-path: {exc}") from None

    values: list[int] = []
    if num_samples:
        try:
            values = [int(v) for v in num_samples.split(",")]
        except ValueError:
            values = []
        if not 1 <= len(values) <= 3 or min(values) < 0:
            raise click.UsageError(
                f"--num-samples {num_samples!r}: give N or N,NV,NT, each 0 or more"
            )
    context = click.get_current_context()
    given = {  # Megatron's sizes, None where left at their defaults (they size nothing alone)
        name: None if context.get_parameter_source(name) is ParameterSource.DEFAULT else value
        for name, value in [
            ("global_batch_size", global_batch_size),
            ("eval_iters", eval_iters),
            ("eval_interval", eval_interval),
        ]
    }
    counts = split_sample_counts(values, train_samples, train_iters, **given)
    config = GPTDatasetConfig(
        seq_length=seq_len,
        seed=seed,
        split=split,
        add_extra_token=not no_extra_token,
        drop_last_partial_validation_sequence=not keep_last_partial_validation,
        cache_dir=cache_dir,
    )
    report = build_report(build_datasets(spec, config, counts))
    if as_json:
        _emit({"splits": report})
        return
    for name, entry in report.items():
        state = "cached" if entry["cache_hit"] else f"built in {entry['build_seconds']:.3f} s"
        _echo(f"{name}: {entry['samples']:,} samples, {state}")
        for file in entry["files"]:
            _echo(f"  {file}")


if __name__ == "__main__":
    main()
