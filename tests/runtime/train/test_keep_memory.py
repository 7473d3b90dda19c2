"""`train.cpu_keep_freed_memory`: on CPU the memory a step frees is reused by the next, not
faulted in again (counted by the kernel: the process's minor page faults), and the losses
are the same bits either way."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers.distributed import run_ranks
from tests.helpers.train import FAST

FAULTS = """
import resource, sys, torch
from hp_runtime.train import load_config
from hp_runtime.train.cli import _job
keep = "true" if sys.argv[1] == "keep" else "false"
config = load_config(None, [  # through the key, as hp-train starts a job
    "data.type=dummy", "data.seq_length=16", "train.steps=1", "train.device=cpu",
    "train.cpu_threads=1",
    f"train.cpu_keep_freed_memory={keep}",
])
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a step's large tensor (the logits): made, written, then freed; over glibc's
    torch.empty(64 * 2**20 // 4).fill_(1.0)  # largest mmap threshold (32 MiB), so mapped afresh
def body(runtime):
    for _ in range(8):  # the heap settles into the steps' pattern
        step()
    windows = []  # the fewest faults of five windows of five steps: one stray re-fault (a
    for _ in range(5):  # thread of the process group allocating between steps) is not the policy
        before = faults()
        for _ in range(5):
            step()
        windows.append(faults() - before)
    return min(windows)
print(_job(config, body))
"""


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_freed_memory_is_reused_not_faulted_in_again():
    pages = 5 * 64 * 2**20 // 4096  # a window's five steps' pages
    # the C library's default maps them afresh, in every window
    assert _faults("system") >= 0.5 * pages
    assert _faults("keep") < 0.05 * pages


def _losses(rank: int, world: int, overrides: list[str]) -> tuple[list, list]:
    import io

    from hp_runtime.train import load_config, train
    from hp_runtime.train.launch import start

    config = load_config(None, overrides)
    runtime = start("cpu", 1, keep_memory=config.train.cpu_keep_freed_memory)
    result = train(config, runtime, stream=io.StringIO())
    return [result.losses[s] for s in sorted(result.losses)], list(result.grad_norms.values())


def test_the_losses_are_the_same_bits_either_way(tmp_path):
    base = [*FAST, "data.type=dummy", "data.seq_length=32", "train.steps=3",
            "train.micro_batch_size=2", "train.global_batch_size=4"]  # fmt: skip
    runs = {}
    for keep in ("true", "false"):  # new processes: the policy is the process's
        overrides = [
            *base,
            f"train.run_dir={tmp_path / keep}",
            f"train.cpu_keep_freed_memory={keep}",
        ]
        runs[keep] = run_ranks(_losses, 1, overrides, fresh=True)[0]
    assert runs["true"] == runs["false"]
