"""GPTDataset: Megatron's GPT samples over an IndexedDataset, from cached index arrays.

For the same corpus, split, seed, sequence length and sample count, sample `i` is the same
token window as megatron-core 0.16's `GPTDataset[i]` (tested element for element). Items are
numpy arrays; `hp_data.torch_adapter` turns them into tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from hp_data.cache import load_or_build
from hp_data.dataset import IndexedDataset
from hp_data.errors import HpDataError
from hp_data.format.header import drop_pages
from hp_data.index import (
    SPLITS,
    IndexBuildError,
    build_gpt_indices,
    parse_split,
    plan_gpt_indices,
    split_ranges,
)
from hp_data.object_store import DEFAULT_CACHE_GB, DEFAULT_CHUNK_MB, StoreOptions
from hp_data.remote import DEFAULT_TIMEOUT

PAD_TOKEN = -1  # megatron-core's _PAD_TOKEN_ID: never a real id, zeroed in the item
MAX_SEQ_LENGTH = 2**31 - 2  # a sample of L + 1 tokens still counts in int32


@dataclass(frozen=True)
class GPTDatasetConfig:
    """What shapes the samples. The first five fields enter the cache key."""

    seq_length: int
    seed: int = 1234
    split: str = "969,30,1"
    add_extra_token: bool = True
    drop_last_partial_validation_sequence: bool = True
    eod_token: int | None = None
    pad_token: int = PAD_TOKEN
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    return_cu_seqlens: bool = False
    cache_dir: str | None = None
    # A URL prefix's node-local cache (hp_data.object_store): chunk size, bound, timeout.
    remote_chunk_mb: float = DEFAULT_CHUNK_MB
    remote_cache_gb: float = DEFAULT_CACHE_GB
    remote_timeout_s: float = DEFAULT_TIMEOUT

    def __post_init__(self) -> None:
        # Refused here, by name, rather than deep inside numpy (a seed numpy's RandomState
        # rejects) or numba (a length beyond int64).
        if not 1 <= self.seq_length <= MAX_SEQ_LENGTH:
            raise IndexBuildError(
                f"seq_length {self.seq_length}: give a length from 1 to {MAX_SEQ_LENGTH:,}"
            )
        if not 0 <= self.seed < 2**32:
            raise IndexBuildError(f"seed {self.seed}: give a seed from 0 to 2**32 - 1")
        if self.split is not None:  # a subclass's None: shares resolved later
            parse_split(self.split)


def corpus_fingerprint(dataset: IndexedDataset) -> dict[str, Any]:
    """What identifies the corpus layout: a regenerated corpus gets new indices."""
    return {
        "dtype": str(dataset.dtype),
        "sequences": len(dataset),
        "sequence_lengths_xxh3": _hash_array(dataset.sequence_lengths),
        "bin_bytes": dataset.bin_bytes,  # never a stat: the .bin may be behind a URL
    }


def _hash_array(array: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(memoryview(np.ascontiguousarray(array)).cast("B"))


def _split_plan(
    dataset: IndexedDataset, split_name: str, num_samples: int | None, config: GPTDatasetConfig
) -> tuple[tuple[int, int], bool, Any]:
    """The sequences `[begin, end)` of `split_name`, whether its last partial sample is dropped,
    and the plan (sizes, epochs, dtypes) of its indices."""
    span = split_ranges(len(dataset), parse_split(config.split))[SPLITS.index(split_name)]
    if span is None:
        raise HpDataError(f"split {split_name!r} has a zero share in {config.split!r}")
    drop_last = split_name != "valid" or config.drop_last_partial_validation_sequence
    try:
        plan = plan_gpt_indices(
            dataset.sequence_lengths,
            range(span[0], span[1]),
            config.seq_length,
            num_samples,
            config.add_extra_token,
            drop_last,
        )
    except IndexBuildError as exc:
        raise HpDataError(f"{dataset.path_prefix}: {split_name} split: {exc}") from None
    return span, drop_last, plan


def epoch_samples(prefix: str, split_name: str, config: GPTDatasetConfig) -> int:
    """Samples in one epoch of `split_name` of the dataset at `prefix`: the length of a
    GPTDataset built with `num_samples=None`, without building its indices."""
    with IndexedDataset(prefix, validate=False, store=StoreOptions.of(config)) as dataset:
        return _split_plan(dataset, split_name, None, config)[2].num_samples


def _check_request(split_name: str, config: GPTDatasetConfig) -> None:
    """Refuse a split or a config that no GPTDataset can be built for."""
    if split_name not in SPLITS:
        raise HpDataError(f"split {split_name!r}: use one of {', '.join(SPLITS)}")
    if config.seq_length < 2:
        raise HpDataError(f"seq_length must be at least 2, got {config.seq_length}")
    if config.eod_token is None and (config.eod_mask_loss or config.reset_position_ids):
        raise HpDataError("eod_mask_loss and reset_position_ids need the EOD token id")


def _index_problem(arrays: dict[str, np.ndarray], plan: Any, span: tuple[int, int]) -> str | None:
    """What is wrong with a split's cached index arrays (`plan`'s dtypes, the sequences
    `span`), if anything: relations between the arrays, from their shapes and ends: cheap on
    any size."""
    document, sample, shuffle = (
        arrays[n] for n in ("document_index", "sample_index", "shuffle_index")
    )
    found = {name: array.dtype.name for name, array in arrays.items()}
    if found != plan.dtypes:
        return f"dtypes {found}, expected {plan.dtypes}"
    documents = span[1] - span[0]
    if document.ndim != 1 or (len(document) % documents if documents else len(document)):
        return f"document_index of {len(document)} is not whole epochs of {documents}"
    if sample.ndim != 2 or sample.shape[1] != 2 or shuffle.shape != (len(sample) - 1,):
        return f"sample_index {sample.shape} and shuffle_index {shuffle.shape} disagree"
    ends = [(sample[-1, 0], (0, len(document) + 1))]
    ends += [(d, span) for d in document[[0, -1]]] if len(document) else []
    ends += [(i, (0, len(shuffle))) for i in shuffle[[0, -1]]] if len(shuffle) else []
    if not all(low <= int(value) < high for value, (low, high) in ends):
        return "an index value out of range"
    return None


class GPTDataset:
    """Fixed-length samples of `config.seq_length` tokens drawn from one split of a corpus.

    `num_samples=None` gives one epoch (megatron's `num_samples=None`). Index arrays come from
    `config.cache_dir` (built once under a lock, loaded memory-mapped).
    """

    def __init__(
        self,
        dataset: IndexedDataset | str,
        split_name: str,
        num_samples: int | None,
        config: GPTDatasetConfig,
    ) -> None:
        _check_request(split_name, config)
        opened = not isinstance(dataset, IndexedDataset)
        store = StoreOptions.of(config)
        self.dataset = IndexedDataset(dataset, store=store) if opened else dataset
        self.split_name = split_name
        self.config = config
        self.num_samples = num_samples
        span, drop_last, plan = _split_plan(self.dataset, split_name, num_samples, config)
        self.split_range = span  # the sequences [begin, end) this split draws from
        documents = range(span[0], span[1])
        description = {
            "corpus": corpus_fingerprint(self.dataset),
            "split": split_name,
            "split_range": list(span),
            "seed": config.seed,
            "seq_length": config.seq_length,
            "num_samples": num_samples,
            "add_extra_token": config.add_extra_token,
            "drop_last_partial_sequence": drop_last,
            # The arrays' dtypes are in the key: a set saved in other dtypes (an older hp's
            # int64) is rebuilt, not loaded at twice the memory.
            "dtypes": plan.dtypes,
        }
        if opened:
            # Checking it on open walked the whole index (all of it resident now); the key
            # read the lengths. Give the pages back before building: a build needs only
            # the lengths, and a cache hit nothing.
            drop_pages(self.dataset.sequence_lengths)

        def build() -> dict[str, np.ndarray]:
            try:
                document, sample, shuffle = build_gpt_indices(
                    self.dataset.sequence_lengths,
                    documents,
                    config.seq_length,
                    num_samples,
                    config.seed,
                    config.add_extra_token,
                    drop_last,
                    plan,
                )
            except IndexBuildError as exc:
                raise HpDataError(
                    f"{self.dataset.path_prefix}: {split_name} split: {exc}"
                ) from None
            return {"document_index": document, "sample_index": sample, "shuffle_index": shuffle}

        arrays, self.cache_report = load_or_build(
            config.cache_dir,
            description,
            "GPTDataset",
            split_name,
            ("document_index", "sample_index", "shuffle_index"),
            build,
            lambda arrays: _index_problem(arrays, plan, span),
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        self._extra = int(config.add_extra_token)
        # Plain-ndarray views of the maps: scalar reads skip the memmap subclass machinery.
        self._documents_view = self.document_index.view(np.ndarray)
        self._samples_view = self.sample_index.view(np.ndarray)
        self._shuffle_view = self.shuffle_index.view(np.ndarray)

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def sample_tokens(self, idx: int) -> tuple[np.ndarray, np.ndarray]:
        """The `seq_length + extra` token ids (int64, padded) of sample `idx`, and where each
        document part ends inside them."""
        length = self.config.seq_length + self._extra
        out = np.empty(length, dtype=np.int64)
        ends = []
        filled = 0
        for sequence, offset, count in self.sample_parts(idx):
            part = self.dataset.get(sequence, offset, count)
            out[filled : filled + len(part)] = part
            filled += len(part)
            ends.append(filled)
        out[filled:] = self.config.pad_token
        return out, np.array(ends, dtype=np.int64)

    def sample_parts(self, idx: int) -> Iterator[tuple[int, int, int]]:
        """The (sequence, first token, token count) of each part sample `idx` is cut from,
        in order: the walk over the shuffle, sample and document indices that
        `sample_tokens` reads, `chunks_for` fetches ahead and provenance's `sample_pieces`
        maps back to documents."""
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        row = self._shuffle_view.item(idx)
        first, first_offset = self._samples_view.item(row, 0), self._samples_view.item(row, 1)
        last, last_offset = self._samples_view.item(row + 1, 0), self._samples_view.item(row + 1, 1)
        lengths, documents = self.dataset.sequence_lengths, self._documents_view
        for position in range(first, last + 1):
            sequence = documents.item(position)
            offset = first_offset if position == first else 0
            if position == last:
                count = last_offset + self._extra - offset
            else:
                count = lengths.item(sequence) - offset
            yield sequence, offset, count

    def chunks_for(self, sample_ids: Iterable[int]) -> list[tuple[Any, int]]:
        """The (corpus, chunk) pairs of a URL prefix's cache that samples `sample_ids` read,
        in reading order, each once (none for a local prefix): what `ReadAhead` fetches."""
        remote = self.dataset.remote
        if remote is None:
            return []
        pointers, itemsize = self.dataset.sequence_pointers, self.dataset.dtype.itemsize
        seen: dict[int, None] = {}
        for idx in sample_ids:
            for sequence, offset, count in self.sample_parts(int(idx)):
                start = pointers.item(sequence) + offset * itemsize
                seen.update(dict.fromkeys(remote.chunks(start, start + count * itemsize)))
        return [(remote, chunk) for chunk in seen]

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        text, ends = self.sample_tokens(int(idx))
        config = self.config
        if self._extra:
            tokens, labels = text[:-1].copy(), text[1:].copy()
        else:
            tokens, labels = text, np.roll(text, -1)
            labels[-1] = config.pad_token
        length = len(tokens)
        loss_mask = np.ones(length, dtype=np.float32)
        position_ids = np.arange(length, dtype=np.int64)
        if config.eod_token is not None and (config.eod_mask_loss or config.reset_position_ids):
            eods = np.flatnonzero(tokens == config.eod_token)
            if config.eod_mask_loss:
                loss_mask[eods] = 0.0
            if config.reset_position_ids and len(eods):
                # Positions restart after every EOD: subtract the start of the current document.
                starts = np.zeros(length, dtype=np.int64)
                starts[eods[eods + 1 < length] + 1] = eods[eods + 1 < length] + 1
                position_ids -= np.maximum.accumulate(starts)
        if not self._extra or ends[-1] < len(text):  # else no label or token is the pad
            loss_mask[labels == config.pad_token] = 0.0
            tokens[tokens == config.pad_token] = 0
            labels[labels == config.pad_token] = 0
        item = {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": loss_mask,
            "position_ids": position_ids,
        }
        if config.return_cu_seqlens:
            inside = ends[ends < length]
            item["cu_seqlens"] = np.unique(np.concatenate(([0], inside, [length]))).astype(np.int32)
        return item

    def get_batch(self, indices: Any) -> dict[str, np.ndarray]:
        """Items `indices` stacked to [B, L] (cu_seqlens, if asked, as a list).

        API: the batch of a numpy user's own loop (README, docs/datasets.md); hp-train batches
        through torch's DataLoader (`hp_data.torch_adapter`) instead."""
        items = [self[int(i)] for i in indices]
        if not items:  # an empty batch has the item's shapes, with no rows
            length = self.config.seq_length
            batch = {key: np.empty((0, length), np.int64) for key in ("tokens", "labels")}
            batch["loss_mask"] = np.empty((0, length), np.float32)
            batch["position_ids"] = np.empty((0, length), np.int64)
            if self.config.return_cu_seqlens:
                batch["cu_seqlens"] = []  # type: ignore[assignment]
            return batch
        batch = {
            key: np.stack([item[key] for item in items])
            for key in ("tokens", "labels", "loss_mask", "position_ids")
        }
        if self.config.return_cu_seqlens:
            batch["cu_seqlens"] = [item["cu_seqlens"] for item in items]  # type: ignore[assignment]
        return batch
