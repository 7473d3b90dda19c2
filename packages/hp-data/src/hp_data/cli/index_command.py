"""`hp-data build-index`: the GPT and blend indices of every split built ahead of a run,
with Megatron's sizes parsed from its flags."""

from __future__ import annotations

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
from hp_data.cli.conventions import _Command, _echo, _emit, _json_option, _quiet_option
from hp_data.errors import HpDataError
from hp_data.gpt import MAX_SEQ_LENGTH, GPTDatasetConfig


@click.command(name="build-index", cls=_Command)
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

    values = _num_samples_flag(num_samples)
    given = _megatron_sizes_given(global_batch_size, eval_iters, eval_interval)
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
    _echo_index_report(report)


def _num_samples_flag(num_samples: str | None) -> list[int]:
    """`--num-samples N[,NV[,NT]]` as numbers; none when it is not given."""
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
    return values


def _megatron_sizes_given(
    global_batch_size: int | None, eval_iters: int, eval_interval: int
) -> dict[str, int | None]:
    """Megatron's sizes, None where left at their defaults (they size nothing alone)."""
    context = click.get_current_context()
    return {
        name: None if context.get_parameter_source(name) is ParameterSource.DEFAULT else value
        for name, value in [
            ("global_batch_size", global_batch_size),
            ("eval_iters", eval_iters),
            ("eval_interval", eval_interval),
        ]
    }


def _echo_index_report(report: dict[str, Any]) -> None:
    """build-index's report, a line a split and a line each of its files."""
    for name, entry in report.items():
        state = "cached" if entry["cache_hit"] else f"built in {entry['build_seconds']:.3f} s"
        _echo(f"{name}: {entry['samples']:,} samples, {state}")
        for file in entry["files"]:
            _echo(f"  {file}")
