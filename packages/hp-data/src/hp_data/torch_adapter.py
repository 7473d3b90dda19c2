"""Optional torch adapter: hp items as tensors, batched for a training step.

hp datasets return `dict[str, numpy.ndarray]` items: `tokens`, `labels`, `position_ids` (int64
[L]), `loss_mask` (float32 [L]) and optionally `cu_seqlens` (int32 [k+1], document boundaries
inside the sample, from 0 to L). This module turns them into tensors and batches, and is the
only place hp_data touches torch; torch is imported inside functions so that
`import hp_data.torch_adapter` (and the rest of hp_data) still works on a machine without it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader, Dataset

    from hp_data.sampler import PretrainingSampler

VARLEN_FIELD = "cu_seqlens"


class ItemDataset(Protocol):
    """Anything indexable that returns hp items (an hp dataset, a list of dicts, ...)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Mapping[str, np.ndarray]: ...


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ModuleNotFoundError(
            "hp_data.torch_adapter needs torch: install it (pip install torch) to build tensors"
        ) from exc
    return torch


def _to_tensor(value: Any) -> torch.Tensor:
    """Share the numpy buffer when torch can; copy a read-only or non-contiguous array (a
    memory-mapped file) so that a write through the tensor cannot reach the file."""
    torch = _torch()
    if isinstance(value, torch.Tensor):
        return value
    array = np.asarray(value)
    if not (array.flags.writeable and array.flags.c_contiguous):
        array = np.array(array, order="C")
    return torch.from_numpy(array)


@functools.cache
def _dataset_class() -> type:
    # Built on first use so that defining it does not import torch.
    torch = _torch()

    class TorchDataset(torch.utils.data.Dataset):
        """A map-style torch Dataset over an hp item dataset."""

        def __init__(self, dataset: ItemDataset) -> None:
            self.dataset = dataset

        def __len__(self) -> int:
            return len(self.dataset)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            return {key: _to_tensor(value) for key, value in self.dataset[index].items()}

        def __reduce__(self) -> tuple[Any, tuple[ItemDataset]]:
            # A class local to a function pickles by rebuilding, for spawn-started workers.
            return as_torch_dataset, (self.dataset,)

    return TorchDataset


def as_torch_dataset(dataset: ItemDataset) -> Dataset:
    """Wrap `dataset` as a `torch.utils.data.Dataset` whose items hold tensors, not arrays."""
    return _dataset_class()(dataset)


def collate(batch: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Stack fixed-length fields to [B, L]; pack `cu_seqlens` for flash-attention's varlen API.

    The packed `cu_seqlens` (int32) indexes the batch flattened to B*L tokens: sample i's
    boundaries are shifted by i*L and the repeated boundary at each join is dropped, so it runs
    0 .. B*L. `max_seqlen` comes with it as a Python int, because flash-attention takes it as a
    host int and computing it here, on the CPU, spares a device sync in the training step.
    """
    torch = _torch()
    if not batch:
        raise ValueError(
            "collate got an empty micro-batch: this rank has no share of the final partial "
            "global batch; use drop_last=True in the sampler"
        )
    keys = set(batch[0])
    for i, item in enumerate(batch):
        if set(item) != keys:
            raise ValueError(f"batch item {i} has fields {sorted(item)}, item 0 {sorted(keys)}")
    out: dict[str, Any] = {
        key: torch.stack([_to_tensor(item[key]) for item in batch])
        for key in batch[0]
        if key != VARLEN_FIELD
    }
    if VARLEN_FIELD not in keys:
        return out
    sequences = [value for value in out.values() if value.ndim == 2]
    if not sequences:
        raise ValueError("cu_seqlens needs a fixed-length field (tokens) to know the length L")
    length = sequences[0].shape[1]  # per-sample scalars such as a blend's dataset_id are 1-D
    parts = []
    for i, item in enumerate(batch):
        cu = _to_tensor(item[VARLEN_FIELD]).to(torch.int64)
        if cu.ndim != 1 or len(cu) < 2 or cu[0] != 0 or cu[-1] != length:
            raise ValueError(
                f"batch item {i}: cu_seqlens {cu.tolist()} must run from 0 to L={length}"
            )
        parts.append(cu[1:] + i * length if i else cu)
    packed = torch.cat(parts)
    out[VARLEN_FIELD] = packed.to(torch.int32)
    out["max_seqlen"] = int((packed[1:] - packed[:-1]).max())
    return out


def worker_message(exc: BaseException) -> str:
    """The message of an error raised in a DataLoader worker. torch raises it again in the
    main process with the worker's traceback as its text ("Caught X in DataLoader worker
    process N.\nOriginal Traceback ..."); hp's messages are one line: the traceback's last,
    without the class name. Any other error's message as it is."""
    text = str(exc).strip()
    if not (text.startswith("Caught ") and "\nOriginal Traceback" in text):
        return text
    name, _, message = text.splitlines()[-1].partition(": ")
    return message if name.split(".")[-1] == type(exc).__name__ else text.splitlines()[-1]


def make_dataloader(
    dataset: ItemDataset,
    sampler: PretrainingSampler,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
) -> DataLoader:
    """A DataLoader that draws this rank's micro-batches from `sampler`, as Megatron builds it.

    A plain hp dataset is wrapped with `as_torch_dataset` first. Workers persist across
    iterations (as in Megatron) so that resuming does not pay for starting them again;
    `prefetch_factor` is how many micro-batches each keeps ready (torch's default: 2).
    """
    torch = _torch()
    if not isinstance(dataset, torch.utils.data.Dataset):
        dataset = as_torch_dataset(dataset)
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
    )
