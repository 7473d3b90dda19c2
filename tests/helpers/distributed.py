"""Run a function on N ranks, each a fresh process with a gloo process group.

Fast start: spawn, one thread per rank, a file store. Any rank's exception comes back with its
traceback; a hung run is killed after `timeout` seconds and reported, never waited on forever.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any


def _entry(
    fn: Callable[..., Any], rank: int, world: int, store: str, args: tuple, results: Any
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        value = fn(rank, world, *args)
        results.put((rank, "ok", value))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0) -> list:
    """`[fn(rank, world, *args) for each rank]`, each in its own process; `fn` must be
    importable (defined at module level) and return picklable values without torch tensors
    (a tensor crosses as shared memory that dies with its process: return numpy)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as directory:
        store = os.path.join(directory, "store")
        processes = [
            context.Process(target=_entry, args=(fn, rank, world, store, args, results))
            for rank in range(world)
        ]
        for process in processes:
            process.start()
        out: dict[int, Any] = {}
        errors = []
        try:
            for _ in range(world):
                # One failing rank makes its peers fail too (connection reset): collect every
                # report, so the root cause is in the message, not just the first to arrive.
                rank, status, value = results.get(timeout=timeout if not errors else 20)
                if status == "ok":
                    out[rank] = value
                else:
                    errors.append(f"rank {rank} failed:\n{value}")
        except queue.Empty:  # a rank hung, or died without a word
            errors.append(f"timed out after {timeout} s; finished ranks: {sorted(out)}")
        finally:
            for process in processes:
                process.join(timeout=5 if not errors else 0.1)
                if process.is_alive():
                    process.kill()
                    process.join()
        if errors:
            raise RuntimeError("\n".join(errors))
        dead = [p.exitcode for p in processes if p.exitcode not in (0, None)]
        if dead:
            raise RuntimeError(f"ranks exited with codes {dead}")
    return [out[rank] for rank in range(world)]
