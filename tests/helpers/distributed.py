"""Run a function on N ranks of a gloo process group, in warm processes reused across tests.

A rank imports torch and `torch.distributed.tensor` once (~3.5 s); a test body then costs what
it computes. The pool grows to the largest world asked for; a call on N ranks uses its first N
processes, each joining a fresh process group (a new file store) that is destroyed afterwards,
so no group or device mesh outlives its body. Between bodies a process is put back as a fresh
one would start: environment, working directory, signal handlers, thread count, warning
filters and the torch, numpy and `random` generators as they were when it started. A rank
still holding a destroyed group's gloo threads after its body (`_LEAKED_LOOPS`) is replaced
by a fresh process.

A rank that raises, hangs or dies fails its test with every rank's report and tears the pool
down (the next call starts a new one); `fresh=True` runs on new processes and closes them.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import glob
import multiprocessing
import multiprocessing.util  # registers the exit handler that waits on children (below)
import os
import queue
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

_SIGNALS = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]


class _Fresh:
    """What a body may change in its process, as the process had it before any body ran."""

    def __init__(self) -> None:
        import numpy as np
        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.handlers = {s: signal.getsignal(s) for s in _SIGNALS}
        self.filters = list(warnings.filters)
        self.generators = (torch.get_rng_state(), np.random.get_state(), random.getstate())
        self.dtype = torch.get_default_dtype()
        self.matmul = torch.get_float32_matmul_precision()

    def restore(self) -> None:
        import numpy as np
        import torch
        import torch.distributed.tensor._random as dtensor_random
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        for signum, handler in self.handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
        warnings.filters[:] = self.filters
        torch_state, numpy_state, random_state = self.generators
        torch.set_rng_state(torch_state)
        np.random.set_state(numpy_state)
        random.setstate(random_state)
        torch.set_default_dtype(self.dtype)
        torch.set_float32_matmul_precision(self.matmul)
        torch.set_num_threads(1)
        dtensor_random._rng_tracker = None  # DTensor's seed tracker, made on a body's mesh
        # DTensor's sharding propagation caches output specs by input specs, whose meshes
        # compare equal by shape and names alone: a later body's equal mesh would get back
        # an earlier body's, with its process groups (destroyed since).
        _clear_sharding_prop_cache()
        if "torch._dynamo" in sys.modules:  # compiled code and its recompile budget
            torch._dynamo.reset()


# A destroyed gloo group's transport thread lives while anything still references the group,
# and it wakes every 10 ms. Midway through one run of the suite, a warm rank held 268 such
# threads and the suite's processes held 838 in all; gloo's loop threads took 10-19% of the
# machine's perf samples. After each body a rank collects its garbage (the groups in cycles),
# and a rank still holding more than this many threads retires after reporting; the pool then
# starts a fresh process in its place.
_LEAKED_LOOPS = 12


def _transport_loops() -> int:
    """This process's gloo transport threads."""
    count = 0
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/comm"):
        try:
            with open(path) as comm:
                count += comm.read().strip() == "gloo_tcp_loop"
        except OSError:  # the thread ended meanwhile
            continue
    return count


def _end(process: Any, timeout: float) -> None:
    """Wait up to `timeout` seconds for `process` to exit, then kill it."""
    process.join(timeout=timeout)
    if process.is_alive():
        process.kill()
        process.join()


def _next(tasks: Any, parent: int) -> Any:
    """The next task; None to stop, also once the parent is gone (a killed test run leaves
    no rank behind)."""
    while os.getppid() == parent:
        try:
            return tasks.get(timeout=2)
        except queue.Empty:
            continue
    return None


def _worker(tasks: Any, results: Any, stacks: str) -> None:
    """One warm rank: run each task `(fn, rank, world, store, args)` in a process group of
    its own, report it (with whether the rank retires: `_LEAKED_LOOPS`), and put the process
    back as it was. SIGUSR1 writes every thread's stack to `stacks` (what a call that timed out
    reports)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    dump = open(stacks, "w")  # noqa: SIM115 (the process's own, to its end)
    import torch
    import torch.distributed as dist
    import torch.distributed.tensor  # the import a warm rank exists to pay once

    torch.set_num_threads(1)
    fresh = _Fresh()
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    faulthandler.enable(file=dump, all_threads=True)  # a crash (SIGSEGV) leaves its stacks too
    parent = os.getppid()
    while (task := _next(tasks, parent)) is not None:
        fn, rank, world, store, args = task
        try:
            dist.init_process_group(
                "gloo", init_method=f"file://{store}", rank=rank, world_size=world
            )
            # gloo's full-mesh connect can return on one rank while a peer is still reading
            # its handshake: a body without collectives would then destroy the group under
            # the peer ("Connection closed by peer"). A barrier holds every rank until all
            # are connected.
            dist.barrier()
            report = (rank, "ok", fn(rank, world, *args))
        except BaseException:
            report = (rank, "error", traceback.format_exc())
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
            gc.collect()  # the groups a body left in reference cycles, with their threads
            fresh.restore()
            faulthandler.unregister(signal.SIGUSR1)  # restored to the default just above:
            faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)  # install anew
            faulthandler.disable()  # (enable alone is a no-op while it thinks it is on)
            faulthandler.enable(file=dump, all_threads=True)  # and the crash handlers
        except BaseException:
            report = (rank, "error", traceback.format_exc())
        retire = _transport_loops() > _LEAKED_LOOPS
        results.put((*report, retire))
        if retire:
            return


class _Pool:
    """Warm ranks 0..N-1 sharing one result queue; `run` uses the first `world` of them."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("spawn")
        self.results = self.context.Queue()
        self.ranks: list[tuple[Any, Any]] = []  # (process, its task queue)
        self.stacks = tempfile.mkdtemp(prefix="warm-ranks-")  # rank i's stack dumps: i.txt

    def _start(self, rank: int) -> tuple[Any, Any]:
        tasks = self.context.Queue()
        stacks = os.path.join(self.stacks, f"{rank}.txt")
        process = self.context.Process(target=_worker, args=(tasks, self.results, stacks))
        process.start()
        return process, tasks

    def _grow(self, world: int) -> None:
        while len(self.ranks) < world:
            self.ranks.append(self._start(len(self.ranks)))

    def _replace(self, rank: int) -> None:
        """A fresh process for a rank that retired after reporting."""
        _end(self.ranks[rank][0], timeout=30)
        self.ranks[rank] = self._start(rank)

    def run(self, fn: Callable[..., Any], world: int, args: tuple, timeout: float) -> list:
        """Each rank's return value; RuntimeError with every rank's report if any failed."""
        self._grow(world)
        out: dict[int, Any] = {}
        errors: list[str] = []
        retired: list[int] = []
        with tempfile.TemporaryDirectory() as directory:
            store = os.path.join(directory, "store")
            for rank, (_, tasks) in enumerate(self.ranks[:world]):
                tasks.put((fn, rank, world, store, args))
            deadline = time.monotonic() + timeout
            while len(out) + len(errors) < world:
                # One failing rank makes its peers fail too (connection reset): collect every
                # report, so the root cause is in the message, not just the first to arrive.
                try:
                    rank, status, value, retire = self.results.get(timeout=1)
                except queue.Empty:
                    dead = [
                        f"rank {rank} died (exit code {process.exitcode})"
                        for rank, (process, _) in enumerate(self.ranks[:world])
                        if not process.is_alive() and rank not in retired
                    ]
                    if dead or time.monotonic() > deadline:
                        errors += dead or [f"timed out after {timeout} s"]
                        errors.append(f"finished ranks: {sorted(out)}")
                        errors += self._crashed(world, set(out))
                        errors += self._stacks(world, set(out))
                        break
                    continue
                if retire:
                    retired.append(rank)
                if status == "ok":
                    out[rank] = value
                else:
                    errors.append(f"rank {rank} failed:\n{value}")
                    deadline = min(deadline, time.monotonic() + 20)
        if errors:
            raise RuntimeError("\n".join(errors))
        for rank in retired:
            self._replace(rank)
        return [out[rank] for rank in range(world)]

    def _stacks(self, world: int, finished: set[int]) -> list[str]:
        """The stacks of the unfinished live ranks (where a hang is), each thread's."""
        waiting = [
            rank
            for rank, (process, _) in enumerate(self.ranks[:world])
            if rank not in finished and process.is_alive()
        ]
        for rank in waiting:
            os.kill(self.ranks[rank][0].pid, signal.SIGUSR1)
        time.sleep(1)
        reports = []
        for rank in waiting:
            with open(os.path.join(self.stacks, f"{rank}.txt")) as dump:
                reports.append(f"rank {rank}'s stacks:\n{dump.read()[-6000:]}")
        return reports

    def _crashed(self, world: int, finished: set[int]) -> list[str]:
        """What faulthandler wrote of the ranks that died (a crash's stacks)."""
        reports = []
        for rank, (process, _) in enumerate(self.ranks[:world]):
            if rank not in finished and not process.is_alive():
                with open(os.path.join(self.stacks, f"{rank}.txt")) as dump:
                    reports.append(f"rank {rank} died; its stacks:\n{dump.read()[-6000:]}")
        return reports

    def close(self, kill: bool = False) -> None:
        """Stop every rank: asked to, or with `kill` at once (a failed call's ranks may be
        stuck in a body or a collective)."""
        for process, tasks in self.ranks:
            if process.is_alive() and not kill:
                tasks.put(None)
        for process, _ in self.ranks:
            _end(process, timeout=0 if kill else 5)
        self.ranks = []
        shutil.rmtree(self.stacks, ignore_errors=True)


_pool: _Pool | None = None


def _close_pool(kill: bool = False) -> None:
    global _pool
    if _pool is not None:
        _pool.close(kill)
        _pool = None


# Registered after multiprocessing's own exit handler, so run before it waits on the ranks.
atexit.register(_close_pool)


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 300.0, fresh: bool = False
) -> list:
    """`[fn(rank, world, *args) for each rank]`, each rank in its own process; `fn` must be
    importable (defined at module level) and return picklable values without torch tensors
    (a tensor crosses as shared memory that dies with its process: return numpy). `fresh`:
    processes of its own, for a body that must start from a new interpreter."""
    global _pool
    pool = _Pool() if fresh or _pool is None else _pool
    if not fresh:
        _pool = pool
    try:
        values = pool.run(fn, world, args, timeout)
    except BaseException:  # a failed, hung or interrupted call: no rank's state is trusted
        pool.close(kill=True)
        if pool is _pool:
            _pool = None
        raise
    if fresh:
        pool.close()
    return values
