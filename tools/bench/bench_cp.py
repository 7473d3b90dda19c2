"""Context parallelism: activation memory per rank and step time at cp 1, 2 and 4, side by side.

One fixed long sequence (default: 8,192 tokens, micro-batch 1) through the `small` model's
shape (vocabulary 8,192 by default), one optimizer-free training step as hp-train runs it
(`Stepper.train_step`: the micro-batch sharded into this rank's rows, forward, the chunked
loss, backward; then `finish_gradients`), on `cp` ranks of gloo with one thread each, each
layout launched by torchrun in processes of its own. With `--documents D` the sample packs D
documents and attention is masked to them (`data.document_masking`).

Activation memory is the peak resident set of the step above the resident set before it
(Linux's VmHWM, reset through /proc/self/clear_refs before each step; gradients and FSDP's
gathered parameters included; glibc's mmap threshold fixed at 64 KiB, so that freed tensors
leave the resident set), the largest over the ranks and the measured steps. Step time
is the median over the measured steps of the slowest rank. On a 2-core machine cp 4 runs four
ranks on two cores: its step time says what the collectives and the split cost, not what cp
gains on four devices.

    uv run python tools/bench/bench_cp.py [--seq 8192] [--vocab 8192] [--steps 3]
        [--documents 40] [--cps 1,2,4] [--attention auto,sdpa]

`--attention` runs each `model.attention` mode's layouts (`auto`: segments on CPU, flex on
CUDA, no mask over the sequence; `sdpa`: a dense mask per layer) one after the other.
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


def _status(field: str) -> float:
    """A /proc/self/status field in MiB."""
    with open("/proc/self/status") as stream:
        for line in stream:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


EOD = 0  # the end-of-document id of the bench's samples


def _batch(args: argparse.Namespace, vocab: int) -> dict:
    """The one sample every layout trains on: random tokens, and with `--documents` D, D
    packed documents of random lengths, each but the last ending in an EOD token."""
    import torch

    generator = torch.Generator().manual_seed(0)
    text = torch.randint(EOD + 1, vocab, (1, args.seq + 1), generator=generator)
    positions = torch.arange(args.seq)
    if args.documents > 1:
        starts = torch.randperm(args.seq - 1, generator=generator)[: args.documents - 1] + 1
        for start in starts.sort().values.tolist():
            positions[start:] = torch.arange(args.seq - start)
            text[0, start - 1] = EOD
    return {
        "tokens": text[:, :-1],
        "labels": text[:, 1:],
        "loss_mask": torch.ones(1, args.seq),
        "position_ids": positions.unsqueeze(0),
    }


def worker(args: argparse.Namespace) -> None:
    """One rank of one layout (run under torchrun): writes the rank-0 summary to `--out`."""
    import torch
    import torch.distributed as dist
    from hp_runtime.model import preset
    from hp_runtime.model.loss import CHUNK_TOKENS
    from hp_runtime.parallel import ParallelDims, assemble
    from hp_runtime.train.step import Stepper, TokenLoss

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    device = torch.device("cpu")
    config = preset("small", vocab_size=args.vocab, max_seq_len=args.seq, attention=args.attention)
    loss_fn = TokenLoss(device)
    assembly = assemble(config, ParallelDims(cp=world), device, seed=0)
    document_end = EOD if args.documents > 1 else None  # data.document_masking on
    stepper = Stepper(assembly, loss_fn, 1, None, False, False, document_end, CHUNK_TOKENS)
    batch = _batch(args, config.vocab_size)
    peaks, seconds = [], []
    for step in range(args.warmup + args.steps):
        for module in assembly.modules:
            module.zero_grad(set_to_none=True)
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as stream:
            stream.write("5")  # VmHWM := VmRSS
        before = _status("VmRSS")
        start = time.perf_counter()
        stepper.train_step([dict(batch)], 1)
        assembly.finish_gradients(1.0)
        elapsed = torch.tensor([time.perf_counter() - start, _status("VmHWM") - before])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= args.warmup:
            seconds.append(float(elapsed[0]))
            peaks.append(float(elapsed[1]))
    if dist.get_rank() == 0:
        summary = {"cp": world, "peak_mib": max(peaks), "step_s": statistics.median(seconds)}
        Path(args.out).write_text(json.dumps(summary))
    dist.destroy_process_group()


def run_layout(args: argparse.Namespace, attention: str, cp: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "summary.json")
        command = [
            str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={cp}", __file__,
            "--worker", f"--out={out}", f"--seq={args.seq}", f"--vocab={args.vocab}",
            f"--steps={args.steps}", f"--warmup={args.warmup}", f"--documents={args.documents}",
            f"--attention={attention}",
        ]  # fmt: skip
        # A fixed mmap threshold: glibc then returns every freed tensor's pages at once (by
        # default it keeps them for reuse once freed, and a step's peak above the resident set
        # before it would miss what the previous step left resident).
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
        if done.returncode:
            sys.exit(f"failed: {' '.join(command)}\n{done.stderr[-8000:]}")
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--documents", type=int, default=0, help="packed documents a sample")
    parser.add_argument("--cps", default="1,2,4")
    parser.add_argument(
        "--attention", default="auto,sdpa", help="model.attention modes, one table each"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    cps = [int(c) for c in args.cps.split(",")]
    documents = f"{args.documents} documents" if args.documents > 1 else "one document"
    print(
        f"small shape, vocabulary {args.vocab}, one sample of {args.seq} tokens ({documents}), "
        f"{args.steps} measured steps after {args.warmup}"
    )
    print(
        f"{'attention':>9} {'cp':>3} {'peak / rank':>12} {'vs cp 1':>8} {'step':>9} {'vs cp 1':>8}"
    )
    for attention in args.attention.split(","):
        base = None
        for cp in cps:
            row = run_layout(args, attention, cp)
            base = base or row
            print(
                f"{attention:>9} {cp:>3} {row['peak_mib']:>8.0f} MiB "
                f"{row['peak_mib'] / base['peak_mib']:>7.2f}x "
                f"{row['step_s']:>7.2f} s {row['step_s'] / base['step_s']:>7.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
