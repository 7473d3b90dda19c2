"""Run hp-train from tests: in spawned ranks through the library, or as users launch it (the
installed `hp-train` script, `torchrun`)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers.distributed import run_ranks

BIN = Path(sys.executable).parent
HP_TRAIN = str(BIN / "hp-train")
TORCHRUN = str(BIN / "torchrun")

# A few fast steps of the tiny model; tests add data and layout.
FAST = [
    "model.preset=tiny",
    "train.cpu_threads=1",
    "data.num_workers=0",
    "metrics.log_interval=1",
    "metrics.tensorboard=false",
    "metrics.plot=false",
]


def corpus_overrides(corpus: Path, tokenizer: Path, cache: Path) -> list[str]:
    """The shipped corpus, tokenized once into `cache` by the json_file type."""
    return [
        "data.type=json_file",
        f"data.path={corpus}",
        f"data.tokenizer={tokenizer}",
        f"data.cache_dir={cache}",
        "model.vocab_size=8192",
    ]


def corpus_samples(overrides: list[str], count: int, **fields: Any) -> Any:
    """The `count` training samples of the corpus that `corpus_overrides` in `overrides` name,
    built by hp-data's registry with `fields` (seq_length, eod_mask_loss, split, ...): what a
    test reads to check that its run exercises what it claims."""
    from hp_data.registry import DatasetConfig, build_dataset

    values = dict(item.split("=", 1) for item in overrides)
    config = DatasetConfig(
        type="json_file",
        path=values["data.path"],
        tokenizer=values["data.tokenizer"],
        cache_dir=values["data.cache_dir"],
        **fields,
    )
    return build_dataset(config, num_samples=count)


def _train_rank(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    from hp_runtime.train import load_config, train
    from hp_runtime.train.launch import start

    config = load_config(None, overrides)
    runtime = start(config.train.device, config.train.cpu_threads)
    log = io.StringIO()
    result = train(config, runtime, stream=log)
    return {
        "losses": [result.losses[s] for s in sorted(result.losses)],
        "grad_norms": [result.grad_norms[s] for s in sorted(result.grad_norms)],
        "val_losses": dict(result.val_losses),
        "skipped": list(result.skipped),
        "log": log.getvalue(),
    }


def train_ranks(world: int, overrides: list[str], timeout: float = 300.0) -> list[dict[str, Any]]:
    """`hp_runtime.train.train` on `world` spawned gloo ranks; each rank's result."""
    return run_ranks(_train_rank, world, [*FAST, *overrides], timeout=timeout)


def hp_train(
    *args: str, cwd: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [HP_TRAIN, *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=timeout
    )


def torchrun(
    nproc: int,
    *args: str,
    cwd: Path | None = None,
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N -m hp_runtime.train ARGS` (with `env` added to
    this process's environment); on a timeout the launcher and every rank are killed (they
    share a new session) before raising."""
    command = [
        TORCHRUN,
        f"--nproc-per-node={nproc}",
        "--standalone",
        "-m",
        "hp_runtime.train",
        *map(str, args),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=env,
        start_new_session=True,
    ) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            signal_tree(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def workers(pid: int) -> list[int]:
    """Every descendant of `pid` (torchrun starts its ranks in sessions of their own, so a
    signal to the launcher's process group does not reach them)."""
    found, queue = [], [pid]
    while queue:
        children = subprocess.run(
            ["pgrep", "-P", str(queue.pop())], capture_output=True, text=True
        ).stdout.split()
        found += map(int, children)
        queue += map(int, children)
    return found


def signal_tree(pid: int, sig: int, launcher: bool = True) -> None:
    """Send `sig` to the descendants of `pid` (as a cluster signals every process of a
    job), and to `pid` itself when `launcher`."""
    for target in [*workers(pid), *([pid] if launcher else [])]:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(target, sig)


def records(run_dir: Path, kind: str = "train") -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def hp_train_here(*args: str) -> subprocess.CompletedProcess:
    """`hp-train ARGS` through its real entry point, in this process (one rank, no launcher):
    ~20x cheaper than a subprocess, for the many hostile cases. Exit code and output as a
    subprocess would give them."""
    from hp_runtime.train.cli import main

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([*map(str, args)])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["hp-train", *args], code, out.getvalue(), err.getvalue())


class Payload:
    """What a crafted checkpoint would hold: unpickling it creates the file `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_in_optimizer(checkpoint: Path, marker: Path, work: Path) -> str:
    """Rewrite `checkpoint` (hp-train's, on disk) with plain DCP so that one of the
    optimizer's pickled hyperparameters (an `lr`) is a `Payload`; its `meta.json` loses the
    checksums plain DCP cannot keep. The item's key."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(work / "whole.pt"))
    state = torch.load(work / "whole.pt", weights_only=False)  # the test's own file
    lr = next(k for k in state["optim"] if k.startswith("param_groups.") and k.endswith(".lr"))
    state["optim"][lr] = Payload(marker)
    for file in checkpoint.glob("*.distcp"):
        file.unlink()
    dcp.save(state, storage_writer=FileSystemWriter(str(checkpoint)), no_dist=True)
    meta = json.loads((checkpoint / "meta.json").read_text())
    for key in ("xxh3", "dcp_metadata_xxh3"):  # nothing to check plain DCP's files against
        meta.pop(key)
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    return lr
