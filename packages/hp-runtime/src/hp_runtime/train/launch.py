"""Where a run executes: one process, or a rank under torchrun; CUDA + NCCL when a GPU is there,
else CPU + gloo with a set number of threads per rank.

A single process still gets a (one-rank) process group, so the trainer has one code path. Set-up
failures are agreed on by every rank (`agree`) so that one rank's bad input stops them all
instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import datetime
import os
import signal
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hp_runtime.train.errors import PeerFailed, TrainError


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def env_rank() -> int:
    """This process's rank from torchrun's environment (0 alone), before any process group."""
    return int(os.environ.get("RANK", "0"))


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the memory a CPU step frees, for the next step to reuse.

    By default it maps each large block (a step's logits, activations and gradients) afresh
    and unmaps it when freed, and returns the top of the heap to the system, so every step
    faults all those pages in again, zeroed: on the 2-core benchmark about a fifth of a
    step's time (docs/benchmarks.md). With no mappings (M_MMAP_MAX 0) and no trimming, the
    process keeps its peak instead and reuses it. torch's own CPU launcher
    (`torch.backends.xeon.run_cpu`) gets the same by preloading jemalloc or tcmalloc. Values
    do not change. False (nothing done) where the C library is not glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def start(
    device: str, cpu_threads: int, timeout_s: float = 600.0, keep_memory: bool = True
) -> Runtime:
    """Initialise the process group and pick the device (`auto`: CUDA if available); on CPU
    with `keep_memory` (`train.cpu_keep_freed_memory`), `keep_freed_memory`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = env_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        # NCCL's flight recorder: what the hang watchdog dumps of the collectives in flight
        os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
        if not torch.cuda.is_available():
            raise TrainError("train.device = 'cuda' but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        where, backend = torch.device("cuda", local_rank), "nccl"
    else:  # set, not assumed: ranks on one machine share its cores
        torch.set_num_threads(cpu_threads or max(1, (os.cpu_count() or 1) // local_world))
        if keep_memory:
            keep_freed_memory()
        where, backend = torch.device("cpu"), "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:  # torchrun (or a launcher that speaks its protocol)
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world,
                timeout=timeout,
                device_id=where if use_cuda else None,
            )
        else:  # one process, no launcher: an in-memory store
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, local_world, where)


def stop() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def agree(failure: BaseException | None, runtime: Runtime) -> None:
    """Every rank calls this after a piece of work that may fail on some ranks only. If any failed,
    all raise: the lowest failing rank its own error, the others `PeerFailed`."""
    flag = torch.tensor(
        [runtime.rank if failure is not None else runtime.world_size], device=runtime.device
    )
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    first = int(flag.item())
    if first == runtime.world_size:
        return
    if failure is not None and first == runtime.rank:
        failure.everywhere = False  # raised here alone: this rank reports it
        raise failure
    raise PeerFailed(f"rank {first} failed")


def lowest_message(message: str | None, runtime: Runtime) -> str | None:
    """The message of the lowest rank that has one, on every rank (None if no rank has): a
    failure one rank alone found is named by every rank's report, not as 'another rank'."""
    messages: list[str | None] = [None] * runtime.world_size
    dist.all_gather_object(messages, message)
    return next((m for m in messages if m is not None), None)


class StopSignals:
    """SIGTERM and SIGINT (a cluster's preemption, Ctrl-C) ask the run to stop after the step
    in progress; a second SIGINT stops at once. Installed for the run, restored after."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def fresh_directory(parent: str, prefix: str, runtime: Runtime) -> str:
    """A new directory under `parent`, made by rank 0 under a fresh name (nothing of the
    user's is reused) and named to every rank: where `verify` and `replay` train."""
    name: list[str | None] = [None]
    if runtime.is_main:
        os.makedirs(parent, exist_ok=True)
        name = [tempfile.mkdtemp(prefix=prefix, dir=parent)]
    if runtime.world_size > 1:
        dist.broadcast_object_list(name, src=0)
    return name[0]  # type: ignore[return-value]
