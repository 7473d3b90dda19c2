"""hp-train against a plain PyTorch FSDP2 training loop, side by side in one run.

Both train the `small` model on the shipped corpus (preprocessed here), 2 ranks on CPU with
gloo and one thread each, the same global batch, the same number of steps. The plain loop is
written below the way a torchtitan/nanoGPT user would write it: the same Transformer, FSDP2 per
block and at the root, AdamW, clip_grad_norm_, a DataLoader with one worker over the same
GPTDataset. Tokens/s are taken in steady state (after the warm-up steps) from hp-train's
metrics.jsonl and from the loop's own clock. The two alternate `--rounds` times and the medians
are compared: on a shared 2-core machine single runs swing by about 5%.

`--malloc` sets the C library's memory policy of each side: `shipped` (default) as each comes,
hp-train keeping freed memory (`train.cpu_keep_freed_memory = true`) and the plain loop with
glibc's default; `keep` both keeping it (the plain loop calls the same
`launch.keep_freed_memory`): the loops alone, like for like; `system` both with glibc's default.

    uv run python tools/bench/bench_train.py [--steps 30] [--warmup 5] [--rounds 3]

`--parts` times instead, on the same 2 ranks, model and batch, what hp-train's step does that
the plain loop does not, next to the plain loop's own: hp's clipping (float64 norm of the
local shards, one all-reduce) against `clip_grad_norm_`; the local shards' float64 sum of
squares as hp takes it (`clip.sum_of_squares`), as one `_foreach_norm` over whole tensors and
per tensor with `vector_norm`, against a float32 norm; and hp's two small all-reduces (loss
tokens; loss and stop request) against the plain loop's one, with a forward and backward for
scale; min and median of `--rounds`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def plain_loop(args: argparse.Namespace) -> None:
    """One rank of the plain FSDP2 loop (run under torchrun)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from hp_data.registry import DatasetConfig, build_dataset
    from hp_data.sampler import PretrainingSampler
    from hp_data.torch_adapter import make_dataloader
    from hp_runtime.model import Transformer, preset
    from hp_runtime.parallel import init_weights
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    if args.malloc == "keep":
        from hp_runtime.train.launch import keep_freed_memory

        keep_freed_memory()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    config = preset("small", max_seq_len=args.seq)
    with torch.device("meta"):
        model = Transformer(config)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
    dataset = build_dataset(
        DatasetConfig(
            type="megatron",
            seq_length=args.seq,
            path=args.prefix,
            split="1,0,0",
            cache_dir=args.cache,
        ),
        num_samples=args.steps * args.mbs * world,
    )
    sampler = PretrainingSampler(len(dataset), 0, args.mbs, rank, world)
    batches = iter(make_dataloader(dataset, sampler, num_workers=1))
    start = None
    for step in range(1, args.steps + 1):
        if step == args.warmup + 1:
            dist.barrier()
            start = time.perf_counter()
        batch = next(batches)
        logits = model(batch["tokens"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss.detach())  # what a loop logs; hp-train reduces its loss each step
    dist.barrier()
    seconds = time.perf_counter() - start
    if rank == 0:
        tokens = (args.steps - args.warmup) * args.mbs * world * args.seq
        print(json.dumps({"tokens_per_s": tokens / seconds}))
    dist.destroy_process_group()


def step_parts(args: argparse.Namespace) -> None:
    """One rank of `--parts` (run under torchrun): seconds per call, min and median."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from hp_runtime.model import Transformer, preset
    from hp_runtime.parallel import init_weights
    from hp_runtime.parallel.clip import clip_grad_norm, sum_of_squares
    from hp_runtime.parallel.fsdp import apply_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = preset("small", max_seq_len=args.seq)
    with torch.device("meta"):
        model = Transformer(config)
    apply_fsdp(model, init_device_mesh("cpu", (world,)), "cpu")
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    params = list(model.parameters())
    generator = torch.Generator().manual_seed(rank)
    tokens, labels = torch.randint(
        0, config.vocab_size, (2, args.mbs, args.seq), generator=generator
    )

    def forward_backward() -> None:
        model.zero_grad()
        F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten()).backward()

    forward_backward()
    shards = [p.grad.to_local() for p in params]

    def hp_collectives() -> None:
        count = torch.ones(())
        dist.all_reduce(count, async_op=True).wait()
        values = torch.zeros(2)
        dist.all_reduce(values)
        values.tolist()

    parts = {
        "forward and backward": (forward_backward, 2),
        "hp clip (float64 norm)": (lambda: clip_grad_norm(params, 1.0), 20),
        "clip_grad_norm_": (lambda: torch.nn.utils.clip_grad_norm_(params, 1.0), 20),
        "local squares, hp": (lambda: sum_of_squares(shards), 20),
        "float64 foreach, whole": (lambda: torch._foreach_norm(shards, 2, dtype=torch.float64), 20),
        "float64 vector_norm": (
            lambda: [torch.linalg.vector_norm(s, dtype=torch.float64) for s in shards],
            20,
        ),
        "local norm, float32": (lambda: torch._foreach_norm(shards, 2), 20),
        "hp's two all-reduces": (hp_collectives, 50),
        "plain loop's all-reduce": (lambda: dist.all_reduce(torch.zeros(())), 50),
    }
    seconds: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(args.rounds):
        for name, (call, repeats) in parts.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeats):
                call()
            dist.barrier()
            seconds[name].append((time.perf_counter() - start) / repeats)
    if rank == 0:
        for name, values in seconds.items():
            print(
                f"{name:26}{min(values) * 1e3:10.1f} ms{statistics.median(values) * 1e3:10.1f} ms"
            )
    dist.destroy_process_group()


def torchrun(
    *args: str, nproc: int = 2, threads: int = 1, launcher: tuple[str, ...] | None = None
) -> subprocess.CompletedProcess:
    """`nproc` ranks of `threads` threads each (`launcher`: the command that starts torchrun,
    this environment's by default), failing with the ranks' stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    launcher = launcher or (str(BIN / "torchrun"),)
    command = [*launcher, "--standalone", f"--nproc-per-node={nproc}", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode:
        sys.exit(f"failed: {' '.join(command)}\n{done.stderr[-3000:]}")
    return done


def preprocess(work: str) -> str:
    """The shipped corpus as a .bin/.idx dataset under `work`: its prefix."""
    prefix = f"{work}/docstrings"
    subprocess.run(
        [str(BIN / "hp-data"), "preprocess", str(REPO / "examples/docstrings.jsonl"),
         "--out", prefix, "--tokenizer", str(REPO / "examples/tokenizer.json"),
         "--append-eod", "--quiet"],
        check=True, capture_output=True,
    )  # fmt: skip
    return prefix


def run_hp(args: argparse.Namespace, run_dir: str) -> dict[str, float]:
    torchrun(
        "-m", "hp_runtime.train",
        "model.preset=small", f"model.max_seq_len={args.seq}",
        "data.type=megatron", f"data.path={args.prefix}", "data.split=1,0,0",
        f"data.seq_length={args.seq}", f"data.cache_dir={args.cache}",
        "parallel.dp_shard=2", f"train.steps={args.steps}",
        f"train.micro_batch_size={args.mbs}", "train.cpu_threads=1",
        f"train.run_dir={run_dir}", "optim.lr=3e-4", f"metrics.log_interval={args.warmup}",
        "metrics.plot=false", "metrics.tensorboard=false",
        f"train.cpu_keep_freed_memory={str(args.malloc != 'system').lower()}",
    )  # fmt: skip
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if r.get("kind") == "train"]
    first = next(r for r in steps if r["step"] == args.warmup)
    last = steps[-1]
    tokens = (last["step"] - first["step"]) * args.mbs * 2 * args.seq
    steady = [r for r in steps if r["step"] > args.warmup]
    return {
        "tokens_per_s": tokens / (last["elapsed_s"] - first["elapsed_s"]),
        "data_wait_pct": max(r["data_wait_pct"] for r in steady),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5, help="also hp-train's log interval")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--parts", action="store_true", help="time the step's parts instead")
    parser.add_argument("--malloc", choices=["shipped", "keep", "system"], default="shipped")
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-parts", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain:
        plain_loop(args)
        return
    if args.rank_parts:
        step_parts(args)
        return
    if args.parts:
        print(f"per call, min and median of {args.rounds} rounds")
        done = torchrun(__file__, "--rank-parts", f"--seq={args.seq}", f"--mbs={args.mbs}",
                        f"--rounds={args.rounds}")  # fmt: skip
        print(done.stdout, end="")
        return
    with tempfile.TemporaryDirectory() as work:
        args.prefix, args.cache = preprocess(work), f"{work}/cache"
        print(
            f"small model, 2 ranks x 1 thread (CPU, gloo), global batch {2 * args.mbs} x "
            f"{args.seq} tokens, {args.steps} steps, steady state after {args.warmup}, "
            f"malloc {args.malloc}"
        )
        results: dict[str, list[dict[str, float]]] = {"hp": [], "plain": []}
        ratios: list[float] = []  # each round's pair: a drift of the machine moves both
        for _ in range(args.rounds):
            results["hp"].append(run_hp(args, f"{work}/run-{time.monotonic_ns()}"))
            done = torchrun(
                __file__, "--plain", f"--steps={args.steps}", f"--warmup={args.warmup}",
                f"--seq={args.seq}", f"--mbs={args.mbs}", f"--prefix={args.prefix}",
                f"--cache={args.cache}", f"--malloc={args.malloc}",
            )  # fmt: skip
            results["plain"].append(json.loads(done.stdout.strip().splitlines()[-1]))
            hp_s, plain_s = results["hp"][-1]["tokens_per_s"], results["plain"][-1]["tokens_per_s"]
            ratios.append(hp_s / plain_s)
            load = os.getloadavg()[0]
            print(
                f"  round: hp {hp_s:.0f}, plain {plain_s:.0f} tokens/s, ratio {ratios[-1]:.3f} "
                f"(load average {load:.2f})",
                flush=True,
            )
        hp = {
            key: statistics.median(r[key] for r in results["hp"])
            for key in ("tokens_per_s", "data_wait_pct")
        }
        plain = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in results["plain"])}
        print(f"medians of {args.rounds} rounds")
        print(f"{'':24}{'hp-train':>12}{'plain FSDP2':>14}{'ratio':>8}")
        print(
            f"{'tokens/s (steady)':24}{hp['tokens_per_s']:12.0f}{plain['tokens_per_s']:14.0f}"
            f"{hp['tokens_per_s'] / plain['tokens_per_s']:8.3f}"
        )
        print(f"{'data wait, max % of step':24}{hp['data_wait_pct']:12.2f}")
        print(
            f"ratio of each round's pair: min {min(ratios):.3f}, median "
            f"{statistics.median(ratios):.3f}, max {max(ratios):.3f}"
        )


if __name__ == "__main__":
    main()
