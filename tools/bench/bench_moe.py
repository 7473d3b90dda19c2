"""One MoE training step at ep 1 and ep 2 beside the dense model of the same active size.

Three layouts on the same 2 gloo ranks of one thread each, in one torchrun launch: the dense
model whose SwiGLU is as wide as a token's active experts (`ffn_hidden = top_k x
expert_ffn_hidden + shared`, the same dim, layers and heads; FSDP over the 2 ranks), the MoE
model at ep 1 (dp_shard 2: every rank holds a shard of every expert) and at ep 2 (dp_shard 2,
ep 2: each rank holds half the experts whole and the tokens travel to them by all_to_all).
A step is hp-train's without the data loader and the metrics: assembled by `assemble()`,
`Stepper.train_step` (forward, the chunked loss, backward; `Balance.start_step` and
`finish_step` inside it), `finish_gradients` (clipping), AdamW's step, `Balance.update_bias`
and zero_grad, on random tokens (a fresh batch per step, each rank its own).

The layouts take turns: each round runs every layout for `--steps` steps (after `--warmup`
steps each, before the first round), the order rotated each round, and each round's step
time is the median of the slowest rank's; the table gives the medians over rounds and the
ratio to the dense model within each round (a drift of the shared machine moves all three).
Memory per rank: "state" is what a rank holds between steps (its parameter shards and
AdamW's state, counted from the tensors), "step peak" the peak resident set of a step above
the one before it (activations, gradients, FSDP's gathered weights, the dispatched rows;
VmHWM reset before each step, glibc's mmap threshold at 64 KiB as in `bench_cp.py`), both
the largest over ranks. Last, the expert kernels alone at the step's
shape on every rank at once: `grouped_expert_ffn` (what the step runs on CPU where
`torch._grouped_mm` does) against the loop `expert_ffn`, forward and forward + backward, for
all the experts (ep 1) and for one rank's half with the rows it receives (ep 2).

    uv run python tools/bench/bench_moe.py [--rounds 3] [--steps 5] [--warmup 2]
        [--kernel auto|loop]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_cp import _status  # a /proc/self/status field in MiB
from bench_train import torchrun  # 2 ranks of one thread, failing with the ranks' stderr

LAYOUTS = ("dense-active", "moe ep 1", "moe ep 2")


def configs(args: argparse.Namespace) -> dict[str, tuple[object, object]]:
    """(ModelConfig, ParallelDims) of each layout: the `small` shape with `--layers` layers."""
    from hp_runtime.model import preset
    from hp_runtime.model.config import MoEConfig
    from hp_runtime.parallel import ParallelDims

    moe = MoEConfig(
        experts=args.experts,
        top_k=args.top_k,
        expert_ffn_hidden=args.expert_hidden,
        shared_experts=args.shared,
    )
    active = moe.top_k * moe.expert_ffn_hidden + moe.shared_hidden
    shape = {"n_layers": args.layers, "vocab_size": args.vocab, "max_seq_len": args.seq}
    dense = preset("small", ffn_hidden=active, **shape)
    routed = preset("small", ffn_hidden=active, moe=moe, **shape)
    return {
        "dense-active": (dense, ParallelDims(dp_shard=2)),
        "moe ep 1": (routed, ParallelDims(dp_shard=2)),
        "moe ep 2": (routed, ParallelDims(dp_shard=2, ep=2)),
    }


def _use_loop(modules: list) -> None:
    """`--kernel loop`: every MoE layer computes its experts with the loop `expert_ffn` (under
    expert parallelism, the kernel the dispatch wraps)."""
    from hp_runtime.model.moe import Experts, expert_ffn
    from hp_runtime.parallel.ep import ExpertDispatch

    for module in (m for part in modules for m in part.modules()):
        if isinstance(module, Experts):
            if isinstance(module.kernel, ExpertDispatch):
                module.kernel.kernel = expert_ffn
            else:
                module.kernel = expert_ffn


def _forward(kernel, operands: list) -> None:
    import torch

    with torch.no_grad():
        kernel(*operands)


def _backward(kernel, operands: list) -> None:
    kernel(*operands).sum().backward()


def _kernels(args: argparse.Namespace, dim: int) -> dict[str, float]:
    """Seconds per call of the grouped kernel and the loop, forward and forward + backward, on
    tokens routed uniformly at random (as a fresh router routes them), slowest rank."""
    import torch
    import torch.distributed as dist
    from hp_runtime.model.moe import expert_ffn, grouped_expert_ffn

    rows = args.mbs * args.seq * args.top_k  # a rank's routed rows; at ep 2 it receives as many
    generator = torch.Generator().manual_seed(dist.get_rank())
    timings = {}
    for label, experts in (("ep 1", args.experts), ("ep 2", args.experts // 2)):
        slots = torch.randint(0, experts, (rows,), generator=generator)
        counts = torch.bincount(slots, minlength=experts)
        x = torch.randn(rows, dim, generator=generator).requires_grad_()
        hidden = args.expert_hidden
        operands = [x, counts] + [
            (torch.randn(experts, a, b, generator=generator) / b**0.5).requires_grad_()
            for a, b in ((hidden, dim), (dim, hidden), (hidden, dim))
        ]
        for name, kernel in (("grouped", grouped_expert_ffn), ("loop", expert_ffn)):
            for part, call in (("forward", _forward), ("forward + backward", _backward)):
                seconds = []
                for _ in range(args.rounds):
                    dist.barrier()
                    start = time.perf_counter()
                    for _ in range(10):
                        call(kernel, operands)
                    elapsed = torch.tensor((time.perf_counter() - start) / 10)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    seconds.append(float(elapsed))
                timings[f"{label}|{name}|{part}"] = statistics.median(seconds)
    return timings


def _state_mib(parameters: list, optimizer) -> float:
    """MiB of this rank's parameter shards and of the optimizer's state tensors."""
    import torch

    tensors = list(parameters)
    for opt in optimizer.all:
        tensors += [v for state in opt.state.values() for v in state.values()]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.nbytes for t in local if isinstance(t, torch.Tensor)) / 2**20


def worker(args: argparse.Namespace) -> None:
    """Both ranks (run under torchrun): rank 0 writes the figures to `--out`."""
    import torch
    import torch.distributed as dist
    from hp_runtime.model.loss import CHUNK_TOKENS
    from hp_runtime.model.moe import grouped_mm_runs
    from hp_runtime.parallel import assemble
    from hp_runtime.train.config import OptimConfig
    from hp_runtime.train.optim import build_optimizer
    from hp_runtime.train.step import Stepper, TokenLoss

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    device = torch.device("cpu")
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())

    def batch(vocab: int) -> dict[str, torch.Tensor]:
        text = torch.randint(0, vocab, (args.mbs, args.seq + 1), generator=generator)
        ones = torch.ones(args.mbs, args.seq)
        return {"tokens": text[:, :-1], "labels": text[:, 1:], "loss_mask": ones}

    def largest(*values: float) -> list[float]:
        """The largest of each value over the ranks (one all-reduce)."""
        reduced = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        return reduced.tolist()

    runs, state = {}, {}  # state: MiB a rank holds between steps
    for name, (config, dims) in configs(args).items():
        assembly = assemble(config, dims, device, seed=0)
        if args.kernel == "loop":
            _use_loop(assembly.modules)
        stepper = Stepper(assembly, TokenLoss(device), 1, None, False, False, None, CHUNK_TOKENS)
        optimizer = build_optimizer(assembly.modules, OptimConfig(), config.tie_embeddings, device)

        def step(stepper=stepper, assembly=assembly, optimizer=optimizer, vocab=config.vocab_size):
            stepper.train_step([batch(vocab)], 1)
            assembly.finish_gradients(1.0)
            optimizer.step()
            stepper.balance.update_bias()
            optimizer.zero_grad(set_to_none=True)

        for _ in range(args.warmup):
            step()
        runs[name] = step
        (state[name],) = largest(_state_mib(assembly.parameters, optimizer))
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds):
        figures = {}
        for name in LAYOUTS[r % 3 :] + LAYOUTS[: r % 3]:
            seconds, peaks = [], []
            for _ in range(args.steps):
                dist.barrier()
                with open("/proc/self/clear_refs", "w") as stream:
                    stream.write("5")  # VmHWM := VmRSS
                before = _status("VmRSS")
                start = time.perf_counter()
                runs[name]()
                elapsed, peak = largest(time.perf_counter() - start, _status("VmHWM") - before)
                seconds.append(elapsed)
                peaks.append(peak)
            figures[name] = {"step_s": statistics.median(seconds), "peak_mib": max(peaks)}
        figures["load"] = {"average": os.getloadavg()[0]}
        rounds.append(figures)
    kernels = _kernels(args, configs(args)["moe ep 1"][0].dim)
    if dist.get_rank() == 0:
        summary = {
            "rounds": rounds,
            "state_mib": state,
            "kernels": kernels,
            "grouped_runs": grouped_mm_runs(device, torch.float32),
        }
        Path(args.out).write_text(json.dumps(summary))
    dist.destroy_process_group()


def report(args: argparse.Namespace, summary: dict, layouts: dict) -> None:
    rounds = summary["rounds"]
    dense, routed = layouts["dense-active"][0], layouts["moe ep 1"][0]
    tokens = 2 * args.mbs * args.seq  # a step's global batch
    for i, figures in enumerate(rounds, 1):
        steps = ", ".join(f"{name} {figures[name]['step_s'] * 1e3:.0f}" for name in LAYOUTS)
        print(f"  round {i}: {steps} ms/step (load average {figures['load']['average']:.2f})")
    print(f"medians of {len(rounds)} rounds of {args.steps} steps; memory: the largest rank")
    print(
        f"{'':14}{'ms/step':>9}{'tokens/s':>10}{'vs dense':>9}{'GFLOP/s/rank':>13}"
        f"{'state MiB':>10}{'step peak MiB':>15}"
    )
    for name in LAYOUTS:
        config = layouts[name][0]
        step_s = statistics.median(r[name]["step_s"] for r in rounds)
        ratio = statistics.median(r[name]["step_s"] / r["dense-active"]["step_s"] for r in rounds)
        flops = config.flops_per_token(args.seq) * tokens / step_s / 2 / 1e9
        peak = max(r[name]["peak_mib"] for r in rounds)
        print(
            f"{name:14}{step_s * 1e3:9.0f}{tokens / step_s:10.0f}{ratio:9.2f}{flops:13.2f}"
            f"{summary['state_mib'][name]:10.0f}{peak:15.0f}"
        )
    total, active = routed.num_params() / 1e6, routed.num_params(active=True) / 1e6
    router = args.layers * dense.dim * args.experts / 1e6
    print(
        f"parameters: dense {dense.num_params() / 1e6:.2f} M; MoE {total:.2f} M total, "
        f"{active:.2f} M active (the router's {router:.3f} M above the dense model)"
    )
    kernel = "grouped_expert_ffn" if summary["grouped_runs"] else "the loop expert_ffn"
    if args.kernel == "loop":
        kernel = "the loop expert_ffn (--kernel loop)"
    print(f"the step's expert kernel: {kernel}")
    rows = args.mbs * args.seq * args.top_k
    print(f"expert kernels, {rows} rows x dim {dense.dim}, hidden {args.expert_hidden}, ms/call:")
    print(f"{'':32}{'grouped':>9}{'loop':>9}{'loop / grouped':>16}")
    timings = summary["kernels"]
    for label, experts in (("ep 1", args.experts), ("ep 2", args.experts // 2)):
        for part in ("forward", "forward + backward"):
            grouped, loop = (timings[f"{label}|{k}|{part}"] for k in ("grouped", "loop"))
            print(
                f"{f'{experts} experts, {part}':32}{grouped * 1e3:9.2f}{loop * 1e3:9.2f}"
                f"{loop / grouped:16.2f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="measured steps a layout a round")
    parser.add_argument("--warmup", type=int, default=2, help="steps a layout before round 1")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-hidden", type=int, default=256, help="expert_ffn_hidden")
    parser.add_argument("--shared", type=int, default=0, help="shared_experts")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--mbs", type=int, default=4, help="micro-batch a rank")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument(
        "--kernel", choices=("auto", "loop"), default="auto", help="the MoE step's expert kernel"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("rounds", "steps", "layers", "seq", "mbs"):
        if getattr(args, name) < 1:
            sys.exit(f"bench_moe: --{name}={getattr(args, name)} must be at least 1")
    if args.warmup < 0:
        sys.exit(f"bench_moe: --warmup={args.warmup} must be at least 0")
    try:  # the shapes checked here, in one line, before any rank starts
        layouts = configs(args)
        for config, dims in layouts.values():
            dims.validate(2, config)
    except ValueError as exc:
        sys.exit(f"bench_moe: {exc}")
    if args.worker:
        worker(args)
        return
    dense = layouts["dense-active"][0]
    print(
        f"dim {dense.dim}, {args.layers} layers, {dense.n_heads} heads, vocabulary {args.vocab}; "
        f"{args.experts} experts, top-{args.top_k}, expert_ffn_hidden {args.expert_hidden}, "
        f"shared {args.shared}; dense ffn_hidden {dense.ffn_hidden}; 2 ranks x 1 thread (CPU, "
        f"gloo), {args.mbs} x {args.seq} tokens a rank; load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    # Freed tensors leave the resident set at once (see the docstring), in the ranks.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    passed = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "worker"]
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "summary.json")
        passed = [a for a in passed if not a.startswith("--out=")] + [f"--out={out}"]
        torchrun(__file__, "--worker", *passed)
        summary = json.loads(Path(out).read_text())
    report(args, summary, layouts)


if __name__ == "__main__":
    main()
