"""Peak memory of one training step with the whole micro-batch's logits against the chunked loss.

    uv run python tools/bench/bench_loss_memory.py [--seq 8192] [--vocab 128256] [--chunk 1024]

A `small`-width model (dim 256, `--layers` blocks, fp32 on CPU) takes one sample of `--seq`
tokens through forward and backward twice: `before` computes today's loss, the logits of the
whole sample upcast to fp32 and `F.cross_entropy` on them; `after` hands the labels to the
model, whose head runs `--chunk` tokens at a time (`hp_runtime.model.loss`). Each variant runs
in a fresh subprocess, so one's peak cannot hide the other's; the peak is the process's
resident high-water mark (`resource.getrusage`), printed with the mark before the first step
(model, inputs, imports), the second step's time, and the ratio of the peaks.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

VARIANTS = ("before", "after")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One variant in this process: the high-water marks before and after, the step time."""
    import torch
    import torch.nn.functional as F
    from hp_runtime.model import Transformer, preset
    from hp_runtime.model.loss import IGNORE

    torch.set_num_threads(args.threads)
    config = preset("small", vocab_size=args.vocab, n_layers=args.layers, max_seq_len=args.seq)
    model = Transformer(config)
    data = torch.randint(
        0, args.vocab, (1, args.seq + 1), generator=torch.Generator().manual_seed(0)
    )
    tokens, labels = data[:, :-1], data[:, 1:]

    def step() -> None:
        model.zero_grad(set_to_none=True)
        if args.variant == "before":
            logits = model(tokens)
            loss = F.cross_entropy(
                logits.float().flatten(0, -2),
                labels.flatten(),
                reduction="sum",
                ignore_index=IGNORE,
            )
        else:
            loss = model(tokens, labels=labels, loss_chunk_tokens=args.chunk).sum()
        loss.backward()

    start = _peak_mib()
    step()
    peak = _peak_mib()
    began = time.perf_counter()
    step()
    return {"start_mib": start, "peak_mib": peak, "step_s": time.perf_counter() - began}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per chunk (after)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # a child
    args = parser.parse_args()
    if args.variant is not None:
        print(json.dumps(measure(args)))
        return

    passed = [
        f"--{name}={getattr(args, name)}" for name in ("seq", "vocab", "layers", "chunk", "threads")
    ]
    results = {}
    for variant in VARIANTS:
        child = subprocess.run(
            [sys.executable, __file__, *passed, f"--variant={variant}"],
            capture_output=True,
            text=True,
            check=True,
        )
        results[variant] = json.loads(child.stdout.splitlines()[-1])
    logits_gib = args.seq * args.vocab * 4 / 2**30
    print(
        f"one step (forward + backward), 1 x {args.seq} tokens, vocabulary {args.vocab:,}, "
        f"dim 256, {args.layers} layers, fp32 on CPU, {args.threads} threads; "
        f"the sample's fp32 logits: {logits_gib:.2f} GiB"
    )
    print(f"{'variant':<28} {'before step':>12} {'peak':>10} {'step':>8}")
    names = {"before": "before (whole logits)", "after": f"after (chunks of {args.chunk})"}
    for variant, value in results.items():
        print(
            f"{names[variant]:<28} {value['start_mib']:>8.0f} MiB {value['peak_mib']:>6.0f} MiB "
            f"{value['step_s']:>6.2f} s"
        )
    before, after = results["before"], results["after"]
    grown = [value["peak_mib"] - value["start_mib"] for value in (before, after)]
    print(
        f"peak ratio before/after: {before['peak_mib'] / after['peak_mib']:.2f}x "
        f"(the step's own growth: {grown[0]:.0f} MiB vs {grown[1]:.0f} MiB, "
        f"{grown[0] / max(grown[1], 1.0):.1f}x)"
    )


if __name__ == "__main__":
    main()
