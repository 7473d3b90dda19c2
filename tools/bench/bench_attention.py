"""Document-masked attention: the dense mask against the mask-free kernels, side by side.

    uv run python tools/bench/bench_attention.py [--lengths 2048 8192] [--documents 40]
    uv run python tools/bench/bench_attention.py --device cuda --dtype bfloat16  # adds flex

Forward and backward of `hp_runtime.model.attention.attend` alone (GQA: `--heads` query heads
on `--kv-heads`), on samples packed with about `--documents` documents of random lengths, the
first continuing from the previous sample. Each kernel at each length runs in a fresh process
after a warm-up step (on CUDA that step compiles `flex`); the table gives the fastest of the
next `--steps` steps (on a shared machine the fastest is the steadiest figure) and their peak
memory above what the process held before them (torch and the inputs): on CPU the resident
peak, reset by Linux's `/proc/self/clear_refs` (the counter `ru_maxrss` reads), on CUDA
`max_memory_allocated`. `sdpa` is the dense (s x s) mask; `causal` (no document masking, one
causal SDPA call) the floor. Before timing, every kernel's output and q, k, v gradients are
checked against `sdpa`'s at the smallest length.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time


def kernels(device: str) -> list[str]:
    return ["sdpa", "segments", "causal"] + (["flex"] if device == "cuda" else [])


def packed_positions(batch: int, length: int, documents: int, seed: int):
    """(batch, length) position ids of about `documents` documents a sample, lengths drawn
    uniformly around length / documents, the first document continuing from before."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        ids, first = [], int(torch.randint(1, 2 * length // documents, (), generator=generator))
        while len(ids) < length:
            size = int(torch.randint(1, 2 * length // documents, (), generator=generator))
            ids += range(first, first + size)
            first = 0
        rows.append(ids[:length])
    return torch.tensor(rows)


def inputs(args: argparse.Namespace, length: int, kernel: str):
    import torch
    from hp_runtime.model.attention import Layout, document_ids

    generator = torch.Generator().manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    def draw(heads: int, grad: bool = True) -> torch.Tensor:
        x = torch.randn(args.batch, heads, length, args.head_dim, generator=generator)
        return x.to(device, dtype).requires_grad_(grad)

    q, k, v, grad = draw(args.heads), draw(args.kv_heads), draw(args.kv_heads), draw(args.heads)
    documents = document_ids(packed_positions(args.batch, length, args.documents, 1)).to(device)
    layout = Layout(mode=kernel, documents=None if kernel == "causal" else documents)
    return q, k, v, grad.detach(), layout


def step(q, k, v, grad, layout) -> None:
    from hp_runtime.model.attention import attend

    attend(q, k, v, layout).backward(grad)
    q.grad = k.grad = v.grad = None


def memory_mb(field: str) -> float:
    """VmRSS (resident now) or VmHWM (peak since the last reset) of this process, in MB."""
    with open("/proc/self/status") as stream:
        status = stream.read()
    return int(re.search(rf"{field}:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]


def measure(args: argparse.Namespace) -> None:
    """One kernel at one length, in this (fresh) process: prints a JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    q, k, v, grad, layout = inputs(args, args.length, args.kernel)
    step(q, k, v, grad, layout)  # warm-up: one-time allocations (and compiles) stay out
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # the peak starts again from the memory held now
        before = memory_mb("VmRSS")
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step(q, k, v, grad, layout)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else memory_mb("VmHWM")
    print(json.dumps({"ms": 1000 * min(times), "peak_mb": peak - before}))


def check(args: argparse.Namespace, length: int) -> None:
    """Every kernel agrees with the dense mask (outputs and q, k, v gradients)."""
    import torch
    from hp_runtime.model.attention import attend

    tolerance = 1e-5 if args.dtype == "float32" else 2e-2
    results = {}
    for kernel in kernels(args.device):
        if kernel == "causal":
            continue
        q, k, v, grad, layout = inputs(args, length, kernel)
        out = attend(q, k, v, layout)
        out.backward(grad)
        results[kernel] = [out.detach(), q.grad, k.grad, v.grad]
    for kernel, result in results.items():
        for got, want in zip(result, results["sdpa"], strict=True):
            torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance, msg=kernel)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--documents", type=int, default=40)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--kernel", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kernel is not None:
        measure(args)
        return
    check(args, min(args.lengths))
    names = ("documents", "batch", "heads", "kv_heads", "head_dim", "steps", "threads")
    shared = [f"--{n.replace('_', '-')}={getattr(args, n)}" for n in (*names, "device", "dtype")]
    new = "flex" if args.device == "cuda" else "segments"
    print(
        f"attend forward+backward, {args.dtype} on {args.device} ({args.threads} thread(s)), "
        f"batch {args.batch}, {args.heads} q heads / {args.kv_heads} kv heads x {args.head_dim}, "
        f"~{args.documents} documents a sample; fastest of {args.steps} steps; peak memory "
        f"above the inputs. sdpa = the dense mask"
    )
    columns = kernels(args.device)
    print(
        f"{'s':>6} | "
        + " ".join(f"{k + ' ms':>11}" for k in columns)
        + f" {'sdpa/' + new:>13} | "
        + " ".join(f"{k + ' MB':>11}" for k in columns)
        + f" {'sdpa/' + new:>13}"
    )
    for length in args.lengths:
        row = {}
        for kernel in columns:
            command = [sys.executable, __file__, f"--kernel={kernel}", f"--length={length}"]
            done = subprocess.run([*command, *shared], capture_output=True, text=True, check=True)
            row[kernel] = json.loads(done.stdout.strip().splitlines()[-1])
        times = " ".join(f"{row[k]['ms']:>11.1f}" for k in columns)
        memory = " ".join(f"{row[k]['peak_mb']:>11.0f}" for k in columns)
        time_ratio = row["sdpa"]["ms"] / row[new]["ms"]
        memory_ratio = row["sdpa"]["peak_mb"] / max(row[new]["peak_mb"], 1.0)
        print(
            f"{length:>6} | {times} {time_ratio:>13.1f} | {memory} {memory_ratio:>13.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
