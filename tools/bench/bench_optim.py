"""A training step with Muon against AdamW, on the same 2 gloo ranks under FSDP, side by side,
and where Muon's optimizer step goes: its Newton-Schulz iterations, its gathers to the owning
ranks and its scatters back.

One torchrun launch of 2 ranks of one thread each; the model is the `small` preset (FSDP over
the 2 ranks, `--tp 2` for FSDP 1 x TP 2 instead). A step is hp-train's without the data
loader and the metrics: `Stepper.train_step` (forward, the chunked loss, backward),
`finish_gradients` (clipping) and the optimizer's step, on random tokens. The optimizers
take turns, each round running both for `--steps` steps (the order rotated each round); each
step's time is the slowest rank's, the table gives medians over the steps of all rounds, and
the ratio Muon / AdamW within each round (its median). Muon's parts are timed on each rank
around the calls (`muon.orthogonalise`, `_Exchange.gather` and `scatter`, which wait for
the owners: time a rank spends waiting for another's iteration counts as gather or scatter).

    uv run python tools/bench/bench_optim.py [--rounds 3] [--steps 5] [--warmup 2]
        [--ns-dtype bfloat16|float32] [--tp 1|2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench_train import torchrun  # 2 ranks of one thread, failing with the ranks' stderr

OPTIMIZERS = ("adamw", "muon")


def _timed(table: dict[str, float], key: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table[key] += time.perf_counter() - start

    return wrapper


def worker(args: argparse.Namespace) -> None:
    """Both ranks (run under torchrun): rank 0 writes the figures to `--out`."""
    import torch
    import torch.distributed as dist
    from hp_runtime.model import preset
    from hp_runtime.model.loss import CHUNK_TOKENS
    from hp_runtime.parallel import ParallelDims, assemble
    from hp_runtime.train import muon
    from hp_runtime.train.config import OptimConfig
    from hp_runtime.train.config.schema import Muon
    from hp_runtime.train.optim import build_optimizer
    from hp_runtime.train.step import Stepper, TokenLoss

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    device = torch.device("cpu")
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    parts: dict[str, float] = defaultdict(float)  # seconds in Muon's parts, this rank
    muon.orthogonalise = _timed(parts, "newton-schulz", muon.orthogonalise)
    muon._Exchange.gather = _timed(parts, "gather", muon._Exchange.gather)
    muon._Exchange.scatter = _timed(parts, "scatter", muon._Exchange.scatter)
    config = preset("small", max_seq_len=args.seq)
    dims = ParallelDims(dp_shard=2 // args.tp, tp=args.tp)

    def slowest(*values: float) -> list[float]:
        reduced = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        return reduced.tolist()

    runs = {}
    for name in OPTIMIZERS:
        assembly = assemble(config, dims, device, seed=0)
        stepper = Stepper(assembly, TokenLoss(device), 1, None, False, False, None, CHUNK_TOKENS)
        settings = Muon(lr=0.02, ns_dtype=args.ns_dtype)
        optim = OptimConfig(name=name, muon=settings if name == "muon" else None)
        optimizer = build_optimizer(assembly.modules, optim, config.tie_embeddings, device)

        def step(stepper=stepper, assembly=assembly, optimizer=optimizer) -> tuple[float, float]:
            text = torch.randint(
                0, config.vocab_size, (args.mbs, args.seq + 1), generator=generator
            )
            batch = {"tokens": text[:, :-1], "labels": text[:, 1:],
                     "loss_mask": torch.ones(args.mbs, args.seq)}  # fmt: skip
            dist.barrier()
            start = time.perf_counter()
            stepper.train_step([batch], 1)
            assembly.finish_gradients(1.0)
            middle = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            end = time.perf_counter()
            return end - start, end - middle

        for _ in range(args.warmup):
            step()
        runs[name] = step
    figures: dict[str, dict[str, list[float]]] = {n: defaultdict(list) for n in OPTIMIZERS}
    ratios = []
    for r in range(args.rounds):
        medians = {}
        for name in OPTIMIZERS[r % 2 :] + OPTIMIZERS[: r % 2]:
            steps = []
            for _ in range(args.steps):
                parts.clear()
                step_times = runs[name]()
                total, opt = slowest(*step_times)
                steps.append(total)
                figures[name]["step"].append(total)
                figures[name]["optimizer step"].append(opt)
                if name == "muon":
                    for key in ("newton-schulz", "gather", "scatter"):
                        figures[name][key].append(slowest(parts[key])[0])
            medians[name] = statistics.median(steps)
        ratios.append(medians["muon"] / medians["adamw"])
    if dist.get_rank() == 0:
        out = {n: {k: statistics.median(v) for k, v in f.items()} for n, f in figures.items()}
        out["ratio"] = statistics.median(ratios)
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--mbs", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2))
    parser.add_argument("--ns-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "figures.json"
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k not in ("worker", "out")]  # fmt: skip
        torchrun(__file__, "--worker", f"--out={out}", *flags)
        figures = json.loads(out.read_text())
    layout = "FSDP 2" if args.tp == 1 else "TP 2"
    print(
        f"small preset, {layout}, 2 ranks x 1 thread, seq {args.seq}, mbs {args.mbs}, "
        f"Newton-Schulz in {args.ns_dtype}; medians of {args.rounds} x {args.steps} steps"
    )
    print("optimizer | step (s) | optimizer step (s) | newton-schulz | gather | scatter "
          "(s, and the share of the optimizer step / of the step)")  # fmt: skip
    for name in OPTIMIZERS:
        f = figures[name]
        row = [f"{f['step']:.3f}", f"{f['optimizer step']:.3f}"]
        for key in ("newton-schulz", "gather", "scatter"):
            if key not in f:
                row.append("-")
                continue
            shares = f"{f[key] / f['optimizer step']:.0%} / {f[key] / f['step']:.1%}"
            row.append(f"{f[key]:.3f} ({shares})")
        print(f"{name} | " + " | ".join(row))
    print(f"step ratio muon / adamw: {figures['ratio']:.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
