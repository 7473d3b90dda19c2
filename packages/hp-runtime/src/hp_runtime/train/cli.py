"""`hp-train`: train from a TOML config with dotted overrides; plot, export, verify, replay.

    hp-train --config cfg.toml train.steps=50 optim.lr=3e-4 parallel.dp_shard=2
    torchrun --nproc-per-node 2 -m hp_runtime.train --config cfg.toml parallel.dp_shard=2
    hp-train plot RUN_DIR
    hp-train export RUN_DIR/checkpoints/step-0001000 --out hf-model [--dtype bfloat16]
    torchrun --nproc-per-node 8 -m hp_runtime.train verify --config cfg.toml
    hp-train replay RUN_DIR --step 1234 [--dump DIR] [parallel.dp_shard=1 ...]
    hp-train mix-report RUN_DIR [--json]   (or --config cfg.toml [KEY=VALUE ...])
    hp-train eval RUN_DIR/checkpoints/step-0001000 --tasks hellaswag,arc_easy [--limit N]

Bad input ends the run with one line on stderr and a non-zero exit: 2 for the configuration,
1 for everything else (data, layout, a non-finite loss). Only one rank prints it.

Each command imports what it runs in its body: `hp-train --help` loads click and nothing of
torch, and `plot` no model.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

T = TypeVar("T")


def _fail(message: str, code: int, rank: int) -> None:
    from hp_data.redact import redact  # a URL's credentials (data.path) are never printed

    if rank == 0:
        click.echo(f"hp-train: error: {redact(message)}", err=True)
    sys.exit(code)


@click.command(
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Every key is listed in docs/training.md. Subcommands: hp-train plot RUN_DIR; "
    "hp-train export CHECKPOINT --out DIR; hp-train verify --config FILE; "
    "hp-train replay RUN_DIR --step N; hp-train mix-report RUN_DIR | --config FILE [--json]; "
    "hp-train eval CHECKPOINT --tasks NAMES.",
)
@click.option("--config", "config_path", type=str, default=None, help="The run's TOML file.")
@click.argument("overrides", nargs=-1)
def train_command(config_path: str | None, overrides: tuple[str, ...]) -> None:
    """Train a model: --config FILE plus SECTION.KEY=VALUE overrides."""
    from hp_runtime.train.config import load_config
    from hp_runtime.train.errors import ConfigError

    rank = int(os.environ.get("RANK", "0"))  # torchrun's; the process group comes later
    try:
        config = load_config(config_path, list(overrides))
    except ConfigError as exc:  # before torch loads: a bad config is refused at once
        _fail(str(exc), 2, rank)
    from hp_runtime.train.loop import train

    _job(config, lambda runtime: train(config, runtime))


def _job(config: Any, body: Callable[[Any], T]) -> T:
    """`body(runtime)` on this rank's process group, inside the error boundary: a failure
    that is not a bug reaches the user as one line. One found alike on every rank is reported
    by rank 0; one a rank found alone (and `agree`d on, so its peers raise PeerFailed) by that
    rank."""
    from hp_data.errors import HpDataError

    from hp_runtime.train.errors import ConfigError, PeerFailed, TrainError
    from hp_runtime.train.launch import start, stop

    t = config.train
    try:
        runtime = start(t.device, t.cpu_threads, t.collective_timeout_s, t.cpu_keep_freed_memory)
    except TrainError as exc:
        _fail(str(exc), 1, int(os.environ.get("RANK", "0")))
    try:
        return body(runtime)
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
    raise AssertionError("unreachable")  # every branch above returns or exits


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
@click.option(
    "--mtp",
    type=click.Choice(["keep", "drop"]),
    default="keep",
    show_default=True,
    help="A model.mtp model's prediction modules: written (DeepSeek-V3's layers after the "
    "model's) or left out (the model alone, for evaluation and inference).",
)
def export_command(checkpoint: str, out: str, dtype: str, max_shard_size: str, mtp: str) -> None:
    """Write CHECKPOINT (RUN_DIR/checkpoints/step-N) as an HF directory (Llama, Qwen3,
    Mixtral, Qwen3-MoE, Dots1, GLM-4-MoE or DeepSeek-V3: the family that is exactly its
    model)."""
    from hp_runtime.train.errors import TrainError
    from hp_runtime.train.export_output import leftovers
    from hp_runtime.train.hf import export_checkpoint

    try:
        files = export_checkpoint(checkpoint, out, dtype, _size(max_shard_size), mtp)
    except (TrainError, ValueError) as exc:
        _fail(str(exc), 1, 0)
    click.echo(f"wrote {out}: config.json, {', '.join(files)}")
    for name in leftovers(out):
        click.echo(f"hp-train: note: {name} beside {out} is from an interrupted export; remove it")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=str, default=None, help="The run's TOML file.")
@click.option("--steps", type=click.IntRange(1, 100), default=3, show_default=True)
@click.option(
    "--tolerance",
    type=click.FloatRange(0, 1, min_open=True),
    default=1e-4,
    show_default=True,
    help="Largest relative difference of loss, gradient norm or parameters allowed.",
)
@click.option("--keep", is_flag=True, help="Keep both runs under RUN_DIR/verify-*.")
@click.argument("overrides", nargs=-1)
def verify_command(
    config_path: str | None, steps: int, tolerance: float, keep: bool, overrides: tuple[str, ...]
) -> None:
    """Train the config's layout, shrunk, against one process; exit 1 if they differ. Launch
    it as the run: torchrun --nproc-per-node N -m hp_runtime.train verify --config FILE."""
    from hp_runtime.train.config import load_config
    from hp_runtime.train.errors import ConfigError

    rank = int(os.environ.get("RANK", "0"))
    try:  # verify sets train.steps itself: the run's own length is not needed here
        config = load_config(config_path, [*overrides, f"train.steps={steps}"])
    except ConfigError as exc:
        _fail(str(exc), 2, rank)
    from hp_runtime.train.verify import verify

    same = _job(config, lambda rt: verify(config_path, list(overrides), rt, steps, tolerance, keep))
    sys.exit(0 if same else 1)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dir", type=str)
@click.option("--step", "step", type=int, required=True, help="The step to replay up to.")
@click.option("--dump", type=str, default=None, help="Write step N's per-sample losses here.")
@click.option("--keep", is_flag=True, help="Keep the replay's run under RUN_DIR/replay-*.")
@click.argument("overrides", nargs=-1)
def replay_command(
    run_dir: str, step: int, dump: str | None, keep: bool, overrides: tuple[str, ...]
) -> None:
    """Replay RUN_DIR's steps up to N from the checkpoint before N, on the layout the
    overrides give, beside the logged losses and gradient norms."""
    from hp_runtime.train.config import load_config
    from hp_runtime.train.errors import ConfigError

    rank = int(os.environ.get("RANK", "0"))
    config_path = os.path.join(run_dir, "config.toml")
    try:
        config = load_config(config_path, list(overrides)) if os.path.isfile(config_path) else None
    except ConfigError as exc:
        _fail(str(exc), 2, rank)
    if config is None:
        _fail(f"{run_dir}: no config.toml here: give a hp-train run directory", 1, rank)
    from hp_runtime.train.replay import replay

    _job(config, lambda runtime: replay(run_dir, step, list(overrides), runtime, dump, keep))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("run_dir", type=str)
@click.option("--step", "step", type=int, required=True, help="The step whose samples to list.")
@click.option("--json", "as_json", is_flag=True, help="The stable JSON (docs/debugging.md).")
@click.option("--losses", is_flag=True, help="Each sample's loss: replays the step (one process).")
def blame_command(run_dir: str, step: int, as_json: bool, losses: bool) -> None:
    """Every sample step N of RUN_DIR trained on: its corpus, documents and token ranges, and
    the raw input line each document came from."""
    import json

    from hp_data.errors import HpDataError

    from hp_runtime.train.blame import blame, run_config, sample_losses, table
    from hp_runtime.train.errors import ConfigError, TrainError

    try:
        config = run_config(run_dir)
    except ConfigError as exc:
        _fail(str(exc), 2, 0)
    except TrainError as exc:
        _fail(str(exc), 1, 0)
    found = _job(config, lambda rt: sample_losses(run_dir, step, rt)) if losses else None
    try:
        report = blame(run_dir, step, found)
    except (TrainError, HpDataError) as exc:
        _fail(str(exc), 1, 0)
    click.echo(json.dumps(report, indent=1) if as_json else table(report))


def _listed(text: str | None) -> tuple[str, ...]:
    """A comma-separated option's items."""
    return tuple(p.strip() for p in (text or "").split(",") if p.strip())


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("checkpoint", type=str)
@click.option("--tasks", required=True, help="lm-eval tasks or groups, or task YAML files: a,b,c.")
@click.option("--limit", type=click.IntRange(1), default=None, help="The first N documents a task.")
@click.option("--include", default=None, help="Directories of your own task YAMLs: d1,d2.")
@click.option("--tokenizer", default=None, help="Default: the run's eval.tokenizer or data's.")
@click.option("--batch-size", type=click.IntRange(1, 4096), default=None, help="Per dp rank.")
@click.option("--bootstrap-iters", type=click.IntRange(0), default=100000, show_default=True)
@click.option("--output", default=None, help="Also write lm-eval's results JSON here.")
@click.option("--json", "as_json", is_flag=True, help="Print lm-eval's results JSON.")
@click.argument("overrides", nargs=-1)
def eval_command(
    checkpoint: str,
    tasks: str,
    limit: int | None,
    include: str | None,
    tokenizer: str | None,
    batch_size: int | None,
    bootstrap_iters: int,
    output: str | None,
    as_json: bool,
    overrides: tuple[str, ...],
) -> None:
    """Run lm-eval tasks on CHECKPOINT (a directory or a checkpoint.dir URL) on the layout the
    overrides give (parallel.tp=2 ...); launch it as a run: torchrun --nproc-per-node N -m
    hp_runtime.train eval CHECKPOINT --tasks hellaswag."""
    from hp_data.errors import HpDataError

    from hp_runtime.train.config.paths import check_eval_paths
    from hp_runtime.train.errors import ConfigError, TrainError
    from hp_runtime.train.eval_checkpoint import (
        check_output,
        evaluate_checkpoint,
        stored_config,
        write_results,
    )

    rank = int(os.environ.get("RANK", "0"))
    names, directories = _listed(tasks), _listed(include)
    if not names:
        _fail("--tasks: give lm-eval task names or task YAML files, comma-separated", 2, rank)
    asked = {  # as overrides: a TOML list (JSON's form of one) and string, and numbers
        "eval.tasks": json.dumps(names),
        "eval.include": json.dumps(directories) if include is not None else None,
        "eval.limit": limit,
        "eval.tokenizer": tokenizer and json.dumps(tokenizer),
        "eval.batch_size": batch_size,
    }
    given = [f"{k}={v}" for k, v in asked.items() if v is not None]
    try:
        check_eval_paths(names, directories, tokenizer, prefix="--")
        if output is not None:
            check_output(output)
        config = stored_config(checkpoint, [*overrides, *given])
    except ConfigError as exc:
        _fail(str(exc), 2, rank)
    except (TrainError, HpDataError) as exc:
        _fail(str(exc), 1, rank)
    results = _job(
        config, lambda rt: evaluate_checkpoint(checkpoint, config, rt, "--tasks", bootstrap_iters)
    )
    if rank != 0:
        return
    if output is not None:
        try:
            write_results(results, output)
        except TrainError as exc:
            _fail(str(exc), 1, 0)
    if as_json:
        from lm_eval.utils import handle_non_serializable

        click.echo(json.dumps(results, indent=2, default=handle_non_serializable))
    else:
        from lm_eval.utils import make_table

        click.echo(make_table(results))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=str, default=None, help="The run's TOML file.")
@click.option("--world", type=int, required=True, help="The ranks the run will have.")
@click.option("--gpu", type=str, default=None, help="For a time estimate: h100-80gb, ...")
@click.option("--json", "as_json", is_flag=True, help="The plan as JSON (docs/parallelism.md).")
@click.argument("overrides", nargs=-1)
def plan_command(
    config_path: str | None, world: int, gpu: str | None, as_json: bool, overrides: tuple[str, ...]
) -> None:
    """Each kind of rank's memory (params, grads, optimizer, activations, peak), the traffic
    a step sends, and with --gpu a roofline step time: built from the real sharding code over
    a fake process group of --world ranks, on this CPU."""
    import json

    from hp_runtime.train.config import load_config
    from hp_runtime.train.errors import ConfigError, TrainError

    try:
        config = load_config(config_path, [*overrides, "train.steps=1"])  # a step is planned
        from hp_runtime.train.plan import plan, table

        report = plan(config, world, gpu)
    except ConfigError as exc:
        _fail(str(exc), 2, 0)
    except (TrainError, ValueError) as exc:
        _fail(str(exc), 1, 0)
    click.echo(json.dumps(report, indent=1) if as_json else table(report))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=str, default=None, help="The run's TOML file.")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON (docs/training.md).")
@click.argument("args", nargs=-1)
def mix_report_command(config_path: str | None, as_json: bool, args: tuple[str, ...]) -> None:
    """Per data phase and corpus: samples, tokens, epochs, repeats, where each corpus wraps
    around; of a run directory (what the run recorded) or read from a config alone (no
    ranks, no training)."""
    import json

    from hp_data.errors import HpDataError
    from hp_data.phase_report import report_table

    from hp_runtime.train.data import mixture_report
    from hp_runtime.train.errors import ConfigError, TrainError
    from hp_runtime.train.mixrecord import report

    run_dir = args[0] if args and "=" not in args[0] else None
    try:
        found = report(config_path, run_dir, list(args[1:] if run_dir else args))
        found = found if isinstance(found, dict) else mixture_report(found)
    except ConfigError as exc:
        _fail(str(exc), 2, 0)
    except (TrainError, HpDataError) as exc:
        _fail(str(exc), 1, 0)
    except OSError as exc:
        _fail(f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}", 1, 0)
    click.echo(json.dumps(found, indent=2) if as_json else report_table(found))


SUBCOMMANDS = {
    "plot": plot_command,
    "export": export_command,
    "verify": verify_command,
    "replay": replay_command,
    "mix-report": mix_report_command,
    "blame": blame_command,
    "plan": plan_command,
    "eval": eval_command,
}


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:
        SUBCOMMANDS[args[0]].main(args[1:], prog_name=f"hp-train {args[0]}")
    else:
        train_command.main(args, prog_name="hp-train")
