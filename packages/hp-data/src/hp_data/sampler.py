"""Megatron's pretraining batch sampler: sample indices in order, dealt out by data-parallel rank.

`PretrainingSampler` mirrors Megatron-LM's `MegatronPretrainingSampler`
(megatron/training/datasets/data_samplers.py). Samples are taken in index order from
`consumed_samples` on; each run of `micro_batch_size * data_parallel_size` of them is one global
micro-batch, and rank r gets its contiguous slice `[r * micro_batch_size, (r + 1) *
micro_batch_size)`. Shuffling is the dataset's job (GPTDataset's shuffle index), not the
sampler's.

Because the global order is just `consumed_samples, consumed_samples + 1, ...`, it does not
depend on the number of ranks: a run stopped at some `consumed_samples` can resume on a
different `data_parallel_size` and the union of what all ranks consume carries on exactly where
it stopped. That single integer is the sampler's whole resumable state.

Megatron's tail rule, kept as is: with `drop_last=False` the final, incomplete global batch is
still sliced `[r * mbs, (r + 1) * mbs)`, so a rank past its end gets an empty list. Every rank
thus yields the same number of micro-batches and stays in step with the others.

A finished pass (`consumed_samples == total_samples`) is a valid state: it yields nothing and
loads back, so a trainer that checkpoints at the end of its data can resume it on a larger
`total_samples` (more epochs, a bigger dataset) and carry on from the same sample. Megatron
asserts `consumed_samples < total_samples` instead. A count beyond `total_samples` is refused.

No torch here: the sampler is plain Python and works as a DataLoader `batch_sampler`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping


class PretrainingSampler:
    """Yield this rank's sample indices, one list per micro-batch, from `consumed_samples` on.

    `consumed_samples` advances by `micro_batch_size * data_parallel_size` as each micro-batch is
    handed out (as Megatron's trainer counts it), so `state_dict()` taken after receiving a batch
    resumes with the next one. The final partial batch (drop_last=False) advances it only by what
    was left, to `total_samples`. A DataLoader pulls batches ahead of the training step (prefetch),
    so a trainer checkpoints the count of batches it has *trained on*, not this live attribute.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"total_samples={total_samples}: the dataset must hold samples (> 0)")
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size={micro_batch_size}: must be at least 1")
        if data_parallel_size <= 0:
            raise ValueError(f"data_parallel_size={data_parallel_size}: must be at least 1")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(
                f"data_parallel_rank={data_parallel_rank}: must be in "
                f"[0, data_parallel_size={data_parallel_size})"
            )
        self.total_samples = total_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last
        self.consumed_samples = self._check_consumed(consumed_samples)

    @property
    def global_batch_size(self) -> int:
        """Samples consumed per micro-batch step, summed over all data-parallel ranks."""
        return self.micro_batch_size * self.data_parallel_size

    def _check_consumed(self, consumed_samples: int) -> int:
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples={consumed_samples}: must be >= 0")
        if consumed_samples > self.total_samples:
            raise ValueError(
                f"consumed_samples={consumed_samples}: more than total_samples="
                f"{self.total_samples}; resume with a smaller count or more data"
            )
        return consumed_samples

    def __len__(self) -> int:
        """Micro-batches a fresh iteration yields from the current `consumed_samples`."""
        full, tail = divmod(self.total_samples - self.consumed_samples, self.global_batch_size)
        return full + (1 if tail and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        # Arithmetic on the global batch start instead of Megatron's growing list: O(mbs) memory.
        mbs, step = self.micro_batch_size, self.global_batch_size
        offset = self.data_parallel_rank * mbs
        start = self.consumed_samples
        while start + step <= self.total_samples:
            self.consumed_samples = start + step
            yield list(range(start + offset, start + offset + mbs))
            start += step
        left = self.total_samples - start
        if left > 0 and not self.drop_last:
            self.consumed_samples = self.total_samples
            yield list(range(start + min(offset, left), start + min(offset + mbs, left)))

    def state_dict(self) -> dict[str, int]:
        """The one integer needed to resume, on this or any other data-parallel size."""
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume from `state_dict()`; takes effect at the next `iter()`."""
        if "consumed_samples" not in state:
            raise ValueError(
                f"state has keys {sorted(state)}: expected 'consumed_samples' (from state_dict())"
            )
        self.consumed_samples = self._check_consumed(int(state["consumed_samples"]))
