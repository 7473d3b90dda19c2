"""The memory `train.cpu_keep_freed_memory` costs: resident memory over steps whose shapes
vary, with freed memory kept and with the C library's default, side by side.

Each side is a new process (the policy is the process's). A step allocates four large tensors
(at most 480 MiB together) and some small ones, then frees them; the sequence length changes
every 50 steps (as `[[data.phases]]` do) and the batch is drawn from 2, 4 and 8 (a ramp,
validation). VmRSS is read every 100 steps.

    uv run python tools/bench/bench_keep_memory.py [--steps 600]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

STEPS = """
import random, sys, torch
from hp_runtime.train.launch import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
rng = random.Random(0)
seqs, readings = [64, 128, 512, 256], []
for step in range(int(sys.argv[2])):
    seq, batch = seqs[(step // 50) % 4], rng.choice([2, 4, 8])
    alive = [torch.empty(batch * seq * k * 256).fill_(1.0) for k in (64, 8, 32, 16)]
    small = [torch.empty(rng.randint(1, 4096)) for _ in range(50)]
    del alive, small
    if step % 100 == 99:
        readings.append(rss_mib())
print(" ".join(map(str, readings)))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    for mode in ("keep", "system"):
        done = subprocess.run(
            [sys.executable, "-c", STEPS, mode, str(args.steps)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        print(f"{mode:>6}: VmRSS MiB every 100 steps: {done.stdout.strip()}")


if __name__ == "__main__":
    main()
