"""The loader: this rank's micro-batches, from Megatron's pretraining sampler through
DataLoader workers (and a thread that receives them ahead) to the device.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from hp_data.errors import HpDataError
from hp_data.read_ahead import ReadAhead
from hp_data.sampler import PretrainingSampler
from hp_data.torch_adapter import make_dataloader, worker_message

from hp_runtime.train.batch import BatchPlan
from hp_runtime.train.errors import TrainError

Batch = dict[str, torch.Tensor]


class _Prefetch:
    """Pulls micro-batches from a DataLoader on a background thread, so that receiving a batch
    from a worker process (unpickling, mapping its shared memory: milliseconds) overlaps the
    step instead of adding to it. An error in the thread is raised in the caller. `close`
    stops the thread: one left running (collating with the GIL released) when the
    interpreter exits aborts the process ("terminate called without an active exception",
    pytorch#38228)."""

    _END = object()

    def __init__(self, loader: Any, depth: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(loader,), daemon=True)
        self._thread.start()

    def _run(self, loader: Any) -> None:
        try:
            for batch in loader:
                self._queue.put(batch)
                if self._stop.is_set():
                    return
            self._queue.put(self._END)
        except BaseException as exc:  # handed to the consumer
            self._queue.put(exc)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread: it ends after the batch it is making (the queue is drained so
        that its last put returns)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(0.05)

    def __next__(self) -> Batch:
        item = self._queue.get()
        if item is self._END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item


class Loader:
    """This rank's micro-batches from `consumed_samples` on, moved to the device; the time
    spent waiting for them is kept in `waited` (seconds, reset by the caller). `workers`
    DataLoader processes (`data.num_workers`; None: 1 on a multi-core machine, 0 on one
    core). With `background`, batches are received ahead on a thread (`depth` of them). The
    chunks of a URL prefix that the next micro-batches will read are fetched ahead into the
    node's cache (`ReadAhead`), as far ahead as the DataLoader's own prefetch and one step."""

    def __init__(
        self,
        dataset: Any,
        plan: BatchPlan,
        dp_rank: int,
        consumed_samples: int,
        device: torch.device,
        workers: int | None,
        prefetch_factor: int,
        background: bool = True,
    ) -> None:
        self.sampler = PretrainingSampler(
            len(dataset), consumed_samples, plan.micro_batch_size, dp_rank, plan.dp_size
        )
        if workers is None:
            workers = 1 if (os.cpu_count() or 1) > 1 else 0
        self.loader = make_dataloader(
            dataset,
            self.sampler,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            prefetch_factor=prefetch_factor,
        )
        self.device = device
        self.depth = 2 * plan.accumulation if background else 0
        self.waited = 0.0
        self._iterator: Iterator[Batch] | _Prefetch | None = None
        self.read_ahead = ReadAhead(dataset)
        self._ahead = self.depth + max(workers, 1) * prefetch_factor + plan.accumulation
        self._next, self._taken = consumed_samples, 0  # where the next micro-batch starts

    def restart(self, consumed_samples: int) -> None:
        """Start over from `consumed_samples` (validation starts at 0 every time)."""
        self.close()
        self.sampler.load_state_dict({"consumed_samples": consumed_samples})
        self._next, self._taken = consumed_samples, 0

    def close(self) -> None:
        """Let go of the iterator (and stop its thread); `take` starts a new one."""
        if isinstance(self._iterator, _Prefetch):
            self._iterator.close()
        self._iterator = None

    def _coming(self) -> list[int]:
        """The sample ids of this rank's next micro-batches (the sampler's order: global
        micro-batch j starts `j * mbs * dp` samples on; this rank reads its slice)."""
        s = self.sampler
        first = (
            self._next
            + self._taken * s.global_batch_size
            + s.data_parallel_rank * s.micro_batch_size
        )
        return [
            start + i
            for start in range(
                first, first + self._ahead * s.global_batch_size, s.global_batch_size
            )
            for i in range(s.micro_batch_size)
            if start + i < s.total_samples
        ]

    def take(self, count: int) -> list[Batch]:
        self.read_ahead.want(self._coming())
        self._taken += count
        if self._iterator is None:
            self._iterator = _Prefetch(self.loader, self.depth) if self.depth else iter(self.loader)
        out = []
        for _ in range(count):
            start = time.perf_counter()
            try:
                batch = next(self._iterator)
            except StopIteration:
                raise TrainError(
                    "data: the sampler ran out of samples; the dataset is smaller than "
                    "train.steps x train.global_batch_size (less a train.batch_ramp's share)"
                ) from None
            except HpDataError as exc:  # a worker's read (a store gone): one line, no trace
                raise TrainError(worker_message(exc)) from None
            self.waited += time.perf_counter() - start
            out.append(
                {
                    k: v.to(self.device, non_blocking=True)
                    for k, v in batch.items()
                    if isinstance(v, torch.Tensor)
                }
            )
        return out
