"""BlendableDataset and the builder of train/valid/test datasets from a `--data-path` spec.

Reproduces megatron-core 0.16's `BlendedMegatronDatasetBuilder` for weighted blends: each
corpus is split the same way, dataset k of a split of N samples is asked for
`ceil(ceil(N * w_k) * 1.005)` samples (the 0.5% surplus), the blend holds
`sum_k ceil(N * w_k)` samples, and sample i comes from the dataset with the largest error
(`hp_data.index.build_blending_indices`).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from hp_data.cache import load_or_build
from hp_data.errors import ArgumentError, HpDataError
from hp_data.format.commit import recover
from hp_data.format.header import prefix_of
from hp_data.gpt import GPTDataset, GPTDatasetConfig, epoch_samples
from hp_data.index import BLENDING_DTYPES, SPLITS, build_blending_indices, parse_split
from hp_data.object_store import exists, is_url
from hp_data.read_ahead import distinct

SURPLUS = 0.005  # megatron-core's mid_level_dataset_surplus

BlendSpec = str | Sequence[str] | Sequence[tuple[float, str]]


def parse_blend(spec: BlendSpec) -> tuple[list[str], list[float] | None]:
    """Prefixes and weights (None when unweighted) from `"0.3 /a 0.7 /b"`, `["0.3", "/a",
    "0.7", "/b"]`, `[(0.3, "/a"), (0.7, "/b")]`, or a single prefix."""
    if isinstance(spec, str):
        items: list[Any] = spec.split()
    else:
        items = list(spec)
    if items and all(isinstance(i, tuple | list) and len(i) == 2 for i in items):
        items = [x for pair in items for x in pair]
    if not items:
        raise HpDataError("empty blend: give a prefix, or weights and prefixes")
    if len(items) == 1:
        return [str(items[0])], None
    if len(items) % 2:
        raise HpDataError(
            f"blend {' '.join(map(str, items))!r}: expected weight/prefix pairs, "
            f"e.g. '0.3 /data/a 0.7 /data/b'"
        )
    weights, prefixes = [], []
    for weight, prefix in zip(items[::2], items[1::2], strict=True):
        try:
            value = float(weight)
        except (TypeError, ValueError):
            raise HpDataError(
                f"blend: {weight!r} is not a weight; write 'WEIGHT PREFIX' pairs"
            ) from None
        if not value > 0 or not math.isfinite(value):
            raise HpDataError(f"blend: weight {weight!r} of {prefix} must be positive")
        weights.append(value)
        prefixes.append(str(prefix))
    if not math.isfinite(sum(weights)):
        raise HpDataError("blend: the weights' sum overflows; scale them down")
    return prefixes, weights


def normalize(weights: Sequence[float]) -> list[float]:
    """Weights divided by their sum in float64, exactly as megatron-core normalises them."""
    array = np.array(weights, dtype=np.float64)
    return (array / array.sum()).tolist()


def sizes_per_dataset(weights: Sequence[float], size: int, surplus: float = 0.0) -> list[int]:
    """`ceil(ceil(size * w) * (1 + surplus))` for each normalised weight."""
    return [math.ceil(math.ceil(size * w) * (1 + surplus)) for w in weights]


def _blend_problem(arrays: dict[str, np.ndarray], size: int, count: int) -> str | None:
    """Why cached blending indices cannot be these (None when they can)."""
    index, sample = arrays["dataset_index"], arrays["dataset_sample_index"]
    found = {name: array.dtype.name for name, array in arrays.items()}
    if found != BLENDING_DTYPES:
        return f"dtypes {found}, expected {BLENDING_DTYPES}"
    if index.shape != (size,) or sample.shape != (size,):
        return f"{size} samples expected, found {index.shape} and {sample.shape}"
    if size and not 0 <= int(index.min()) <= int(index.max()) < count:
        return f"dataset numbers outside 0..{count - 1}"
    return None


def blend_counts(dataset_index: np.ndarray, count: int) -> np.ndarray:
    """int64 [count]: the samples each dataset gives in `dataset_index`. By chunks: bincount
    widens int16 ids to int64, 8 bytes a sample for the whole blend."""
    counts = np.zeros(count, dtype=np.int64)
    for first in range(0, len(dataset_index), 1 << 20):
        counts += np.bincount(dataset_index[first : first + (1 << 20)], minlength=count)
    return counts


class BlendableDataset:
    """Samples from several datasets mixed by weight with the largest-error rule.

    An item is the chosen dataset's item plus `dataset_id`. A dataset asked for more samples
    than it has is an error naming it (megatron-core's behaviour); `allow_wrap=True` wraps its
    sample ids around instead, with a warning.
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[float],
        size: int,
        split_name: str,
        cache_dir: str | None = None,
        allow_wrap: bool = False,
    ) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise HpDataError("a blend needs one weight per dataset, and at least one dataset")
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.size = size
        self.split_name = split_name
        description = {
            "datasets": [getattr(d, "cache_report", {}).get("key", repr(d)) for d in datasets],
            "weights": self.weights,
            "size": size,
            "split": split_name,
            "dtypes": BLENDING_DTYPES,  # megatron's; in the key as for GPTDataset's arrays
        }
        arrays, self.cache_report = load_or_build(
            cache_dir,
            description,
            "BlendedDataset",
            split_name,
            ("dataset_index", "dataset_sample_index"),
            lambda: dict(
                zip(
                    ("dataset_index", "dataset_sample_index"),
                    build_blending_indices(self.weights, size),
                    strict=True,
                )
            ),
            lambda arrays: _blend_problem(arrays, size, len(datasets)),
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        counts = blend_counts(self.dataset_index, len(datasets))
        self._wrap = np.array([len(d) for d in datasets], dtype=np.int64)
        for k, (count, dataset) in enumerate(zip(counts, datasets, strict=True)):
            if count <= len(dataset):
                continue
            name = getattr(getattr(dataset, "dataset", None), "path_prefix", f"dataset {k}")
            if not allow_wrap:
                raise HpDataError(
                    f"the {split_name} blend asks {name} for {count} samples but it has "
                    f"{len(dataset)}; raise its num_samples (or the surplus), or pass "
                    f"allow_wrap=True to reuse its samples"
                )
            warnings.warn(
                f"the {split_name} blend wraps around {name}: {count} samples from {len(dataset)}",
                stacklevel=2,
            )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def locate(self, idx: int) -> tuple[int, int]:
        """Which dataset sample `idx` comes from, and which of its samples."""
        k = int(self.dataset_index[idx])
        return k, int(self.dataset_sample_index[idx]) % int(self._wrap[k])

    def part_of(self, idx: int) -> tuple[Any, int]:
        """The dataset sample `idx` is drawn from and its index there (provenance walks a
        composite dataset down to its GPTDataset with it)."""
        k, sample = self.locate(idx)
        return self.datasets[k], sample

    def __getitem__(self, idx: int) -> dict[str, Any]:
        k, sample = self.locate(idx)
        return {"dataset_id": k, **self.datasets[k][sample]}

    def chunks_for(self, sample_ids: Sequence[int]) -> list[tuple[Any, int]]:
        """The remote chunks samples `sample_ids` read (`GPTDataset.chunks_for`), in order."""
        ids = np.asarray(sample_ids, dtype=np.int64)
        which = self.dataset_index[ids].astype(np.int64)
        inner = self.dataset_sample_index[ids].astype(np.int64) % self._wrap[which]
        return distinct(
            pair
            for k, sample in zip(which.tolist(), inner.tolist(), strict=True)
            for pair in getattr(self.datasets[k], "chunks_for", lambda ids: [])([sample])
        )


# Megatron-LM's --eval-iters and --eval-interval defaults.
EVAL_ITERS, EVAL_INTERVAL = 100, 1000


def megatron_sample_counts(
    train_samples: int | None,
    train_iters: int | None,
    global_batch_size: int,
    eval_iters: int = EVAL_ITERS,
    eval_interval: int = EVAL_INTERVAL,
) -> list[int]:
    """Train, valid and test sample counts as Megatron-LM's training.py computes them
    (`get_train_valid_test_num_samples`, without batch-size ramp-up); an `eval_interval` of
    0 means no evaluation during training (no valid samples). hp-data build-index and
    hp-train both size their splits with it."""
    if train_samples is not None:
        train_iters = train_samples // global_batch_size
    else:
        train_samples = (train_iters or 0) * global_batch_size
    evaluations = ((train_iters or 0) // eval_interval + 1) * eval_iters if eval_interval else 0
    return [train_samples, evaluations * global_batch_size, eval_iters * global_batch_size]


def split_sample_counts(
    num_samples: Sequence[int | None] = (),
    train_samples: int | None = None,
    train_iters: int | None = None,
    global_batch_size: int | None = None,
    eval_iters: int | None = None,
    eval_interval: int | None = None,
) -> list[int | None]:
    """Train, valid and test sample counts for `build_datasets` (None: one epoch), given
    as `num_samples` (up to three) or as Megatron's sizes: `train_samples` or `train_iters`
    with `global_batch_size` (`megatron_sample_counts`; `eval_iters` and `eval_interval`
    default to Megatron's). What `hp-data build-index` sizes with; messages name its flags.

    Both ways at once, or a batch or eval size with no train size to go with it, is an
    `ArgumentError`: one would be silently ignored."""
    counts = [*num_samples, None, None, None][:3]
    if train_samples is None and train_iters is None:
        for name, value in (
            ("global_batch_size", global_batch_size),
            ("eval_iters", eval_iters),
            ("eval_interval", eval_interval),
        ):
            if value is not None:
                raise ArgumentError(
                    f"--{name.replace('_', '-')} sizes the splits only with --train-iters or "
                    "--train-samples; give one of them, or leave it out"
                )
        return counts
    if num_samples or (train_samples is not None and train_iters is not None):
        raise ArgumentError("give one of --num-samples, --train-samples, --train-iters")
    if global_batch_size is None:
        raise ArgumentError("--train-samples and --train-iters need --global-batch-size")
    counts[:] = megatron_sample_counts(
        train_samples,
        train_iters,
        global_batch_size,
        EVAL_ITERS if eval_iters is None else eval_iters,
        EVAL_INTERVAL if eval_interval is None else eval_interval,
    )
    return counts


def build_datasets(
    data_path: BlendSpec | None,
    config: GPTDatasetConfig,
    num_samples: Sequence[int | None] = (None, None, None),
    blend_per_split: Sequence[BlendSpec | None] | None = None,
    allow_wrap: bool = False,
) -> list[GPTDataset | BlendableDataset | None]:
    """Train, valid and test datasets (None for a zero share), as megatron-core builds them.

    `data_path` is one prefix or a weighted blend, split by `config.split`; or give
    `blend_per_split` (one spec per split, each used whole). Unweighted blends of several
    prefixes are not supported: give weights.
    """
    if len(num_samples) > len(SPLITS):
        raise HpDataError(
            f"{len(num_samples)} sample counts given; give up to three: train, valid, test"
        )
    for split_name, size in zip(SPLITS, num_samples, strict=False):
        if size is not None and size < 0:
            raise HpDataError(f"{split_name} sample count {size} is negative")
    num_samples = list(num_samples) + [None] * (3 - len(num_samples))
    if blend_per_split is not None:
        if len(blend_per_split) != len(SPLITS):
            raise HpDataError(
                f"blend_per_split has {len(blend_per_split)} entries; give three (train, "
                "valid, test), None for a split without data"
            )
        out: list[GPTDataset | BlendableDataset | None] = []
        for split_name, spec, size in zip(SPLITS, blend_per_split, num_samples, strict=True):
            if spec is None:
                out.append(None)
                continue
            shares = ["0", "0", "0"]
            shares[SPLITS.index(split_name)] = "1"
            whole = replace(config, split=",".join(shares))
            out.append(build_split(spec, whole, split_name, size, allow_wrap))
        return out
    if data_path is None:
        raise HpDataError("give data_path or blend_per_split")
    shares = parse_split(config.split)
    return [
        build_split(data_path, config, split_name, size, allow_wrap) if share > 0 else None
        for split_name, share, size in zip(SPLITS, shares, num_samples, strict=True)
    ]


def build_split(
    spec: BlendSpec,
    config: GPTDatasetConfig,
    split_name: str,
    size: int | None,
    allow_wrap: bool = False,
) -> GPTDataset | BlendableDataset:
    """One split of `spec`: a GPTDataset for a single prefix, else a weighted blend."""
    prefixes, weights = parse_blend(spec)
    prefixes = [prefix_of(prefix) for prefix in prefixes]  # a .bin/.idx path names its prefix
    for prefix in prefixes:
        if is_url(prefix):  # asked of the store; recovery is of local commits only
            if not exists(prefix):
                raise HpDataError(f"{prefix}.idx: no such dataset")
            continue
        recover(prefix)
        if not os.path.exists(prefix + ".idx"):
            raise HpDataError(f"{prefix}.idx: no such dataset")
    if len(prefixes) == 1 and weights is None:
        return GPTDataset(prefixes[0], split_name, size, config)
    if weights is None:
        raise HpDataError("a blend of several prefixes needs weights: '0.3 /a 0.7 /b'")
    normalized = normalize(weights)
    if size is None:
        # One epoch of the dataset that its weight exhausts first: the largest blend that
        # repeats no dataset (megatron-core asks for a count instead).
        size = min(
            int(epoch_samples(prefix, split_name, config) / weight)
            for prefix, weight in zip(prefixes, normalized, strict=True)
            if weight > 0
        )
    targets = sizes_per_dataset(normalized, size)
    buffered = sizes_per_dataset(normalized, size, SURPLUS)
    datasets = [
        GPTDataset(prefix, split_name, count, config)
        for prefix, count in zip(prefixes, buffered, strict=True)
    ]
    return BlendableDataset(
        datasets, normalized, sum(targets), split_name, config.cache_dir, allow_wrap
    )


def build_report(datasets: Sequence[GPTDataset | BlendableDataset | None]) -> dict[str, Any]:
    """Per split: samples, the cache files behind it, and the seconds spent building indices
    (0 when everything came from the cache)."""
    report: dict[str, Any] = {}
    for split_name, dataset in zip(SPLITS, datasets, strict=True):
        if dataset is None:
            continue
        parts = [dataset, *getattr(dataset, "datasets", [])]
        reports = [part.cache_report for part in parts]
        report[split_name] = {
            "samples": len(dataset),
            "files": [f for r in reports for f in r["files"]],
            "build_seconds": round(sum(r["built_seconds"] or 0.0 for r in reports), 4),
            "cache_hit": all(r["built_seconds"] is None for r in reports),
        }
    return report
