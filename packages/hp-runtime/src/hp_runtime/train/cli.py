"""`hp-train`: train from a TOML config with dotted overrides, or plot a run.

    hp-train --config cfg.toml train.steps=50 optim.lr=3e-4 parallel.dp_shard=2
    torchrun --nproc-per-node 2 -m hp_runtime.train --config cfg.toml parallel.dp_shard=2
    hp-train plot RUN_DIR
    hp-train export RUN_DIR/checkpoints/step-0001000 --out hf-model [--dtype bfloat16]

Bad input ends the run with one line on stderr and a non-zero exit: 2 for the configuration,
1 for everything else (data, layout, a non-finite loss). Only one rank prints it.

Each command imports what it runs in its body: `hp-train --help` loads click and nothing of
torch, and `plot` no model.
"""

from __future__ import annotations

import os
import sys

import click


def _fail(message: str, code: int, rank: int) -> None:
    from hp_data.redact import redact  # a URL's credentials (data.path) are never printed

    if rank == 0:
        click.echo(f"hp-train: error: {redact(message)}", err=True)
    sys.exit(code)


@click.command(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Every key is listed in docs/training.md. Subcommands: hp-train plot RUN_DIR; "
    "hp-train export CHECKPOINT --out DIR.",
)
@click.option("--config", "config_path", type=str, default=None, help="The run's TOML file.")
@click.argument("overrides", nargs=-1)
def train_command(config_path: str | None, overrides: tuple[str, ...]) -> None:
    """Train a model: --config FILE plus SECTION.KEY=VALUE overrides."""
    from hp_data.errors import HpDataError

    from hp_runtime.train.config import load_config
    from hp_runtime.train.errors import ConfigError, PeerFailed, TrainError

    rank = int(os.environ.get("RANK", "0"))  # torchrun's; the process group comes later
    try:
        config = load_config(config_path, list(overrides))
    except ConfigError as exc:  # before torch loads: a bad config is refused at once
        _fail(str(exc), 2, rank)
    from hp_runtime.train.launch import start, stop
    from hp_runtime.train.loop import train

    try:
        runtime = start(config.train.device, config.train.cpu_threads)
    except TrainError as exc:
        _fail(str(exc), 1, rank)
    # The error boundary: a failure that is not a bug reaches the user as one line. One found
    # alike on every rank is reported by rank 0; one a rank found alone (and `agree`d on, so
    # its peers raise PeerFailed) by that rank.
    try:
        train(config, runtime)
    except PeerFailed:
        sys.exit(1)
    except ConfigError as exc:  # found alike on every rank once the world size is known
        _fail(str(exc), 2, runtime.rank)
    except (TrainError, HpDataError) as exc:
        _fail(str(exc), 1, runtime.rank if getattr(exc, "everywhere", False) else 0)
    except OSError as exc:  # the run's own files: a full disk, a directory made read-only
        where = f"{exc.filename}: " if exc.filename else ""
        _fail(f"{where}{exc.strerror or exc}", 1, 0)
    except KeyboardInterrupt:  # a second Ctrl-C: stop at once, as promised, without a trace
        _fail("interrupted; the last committed checkpoint is kept", 130, runtime.rank)
    finally:
        stop()


@click.command()
@click.argument("run_dir", type=str)
@click.option("--out", type=str, default=None, help="The PNG's path (default RUN_DIR/metrics.png).")
def plot_command(run_dir: str, out: str | None) -> None:
    """Draw loss, learning rate, tokens/s and grad norm of RUN_DIR into a PNG."""
    from hp_runtime.train.errors import TrainError
    from hp_runtime.train.plot import plot_run

    try:
        click.echo(plot_run(run_dir, out))
    except TrainError as exc:
        _fail(str(exc), 1, 0)


def _size(text: str) -> int:
    """`--max-shard-size`: bytes, or a number with KB/MB/GB (or KiB/MiB/GiB)."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    upper = text.strip().upper()
    number, factor = upper, 1
    for unit, scale in units.items():
        if upper.endswith(unit):
            number, factor = upper[: -len(unit)], scale
            break
    try:
        size = int(float(number) * factor)
    except (ValueError, OverflowError):
        size = 0
    if size <= 0:
        raise ValueError(f"--max-shard-size {text!r}: give a positive size such as 5GB or 500MiB")
    return size


@click.command()
@click.argument("checkpoint", type=str)
@click.option(
    "--out",
    required=True,
    type=str,
    help="The HF directory to write: new, empty, or a previous export (never anything else).",
)
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float16", "float32"]),
    default="bfloat16",
    show_default=True,
)
@click.option("--max-shard-size", default="5GB", show_default=True, help="Per safetensors file.")
def export_command(checkpoint: str, out: str, dtype: str, max_shard_size: str) -> None:
    """Write CHECKPOINT (RUN_DIR/checkpoints/step-N) as an HF directory (Llama, Qwen3,
    Mixtral, Qwen3-MoE, Dots1 or GLM-4-MoE: the family that is exactly its model)."""
    from hp_runtime.train.errors import TrainError
    from hp_runtime.train.exportdir import leftovers
    from hp_runtime.train.hf import export_checkpoint

    try:
        files = export_checkpoint(checkpoint, out, dtype, _size(max_shard_size))
    except (TrainError, ValueError) as exc:
        _fail(str(exc), 1, 0)
    click.echo(f"wrote {out}: config.json, {', '.join(files)}")
    for name in leftovers(out):
        click.echo(f"hp-train: note: {name} beside {out} is from an interrupted export; remove it")


SUBCOMMANDS = {"plot": plot_command, "export": export_command}


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        SUBCOMMANDS[args[0]].main(args[1:], prog_name=f"hp-train {args[0]}")
    else:
        train_command.main(args, prog_name="hp-train")
