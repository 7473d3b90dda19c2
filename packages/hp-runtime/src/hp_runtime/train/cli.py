"""`hp-train`: train from a TOML config with dotted overrides, or plot a run.

    hp-train --config cfg.toml train.steps=50 optim.lr=3e-4 parallel.dp_shard=2
    torchrun --nproc-per-node 2 -m hp_runtime.train --config cfg.toml parallel.dp_shard=2
    hp-train plot RUN_DIR

Bad input ends the run with one line on stderr and a non-zero exit: 2 for the configuration,
1 for everything else (data, layout, a non-finite loss). Only one rank prints it.
"""

from __future__ import annotations

import sys

import click

from hp_runtime.train.config import ConfigError, load_config
from hp_runtime.train.launch import PeerFailed, TrainError, env_rank, start, stop


def _fail(message: str, code: int, rank: int) -> None:
    if rank == 0:
        click.echo(f"hp-train: error: {message}", err=True)
    sys.exit(code)


@click.command(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Every key is listed in docs/training.md. Subcommand: hp-train plot RUN_DIR.",
)
@click.option("--config", "config_path", type=str, default=None, help="The run's TOML file.")
@click.argument("overrides", nargs=-1)
def train_command(config_path: str | None, overrides: tuple[str, ...]) -> None:
    """Train a model: --config FILE plus SECTION.KEY=VALUE overrides."""
    from hp_data.errors import HpDataError

    from hp_runtime.train.loop import train

    rank = env_rank()
    try:
        config = load_config(config_path, list(overrides))
    except ConfigError as exc:
        _fail(str(exc), 2, rank)
    try:
        runtime = start(config.train.device, config.train.cpu_threads)
    except TrainError as exc:
        _fail(str(exc), 1, rank)
    try:
        train(config, runtime)
    except PeerFailed:
        sys.exit(1)
    except ConfigError as exc:  # found alike on every rank once the world size is known
        _fail(str(exc), 2, runtime.rank)
    except (TrainError, HpDataError) as exc:
        _fail(str(exc), 1, 0)
    finally:
        stop()


@click.command()
@click.argument("run_dir", type=str)
@click.option("--out", type=str, default=None, help="The PNG's path (default RUN_DIR/metrics.png).")
def plot_command(run_dir: str, out: str | None) -> None:
    """Draw loss, learning rate, tokens/s and grad norm of RUN_DIR into a PNG."""
    from hp_runtime.train.plot import plot_run

    try:
        click.echo(plot_run(run_dir, out))
    except TrainError as exc:
        _fail(str(exc), 1, 0)


SUBCOMMANDS = {"plot": plot_command}


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        SUBCOMMANDS[args[0]].main(args[1:], prog_name=f"hp-train {args[0]}")
    else:
        train_command.main(args, prog_name="hp-train")
