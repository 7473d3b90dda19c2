"""Config -> dataset, for every dataset type hp trains on; all share GPTDataset's item contract.

- `dummy`: deterministic random tokens per index (no files), for smoke tests and benchmarks.
- `json_file`: local JSONL file(s) tokenized with a tokenizer.json (by `hp-data preprocess`,
  once, into the cache) and packed into fixed-length samples by GPTDataset.
- `hf_datasets`: the same for a saved HF dataset or a local `load_dataset` directory.
- `megatron`: an existing `.bin`/`.idx` prefix, or a weighted blend of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from hp_data.blend import BlendableDataset, build_split
from hp_data.cache import cache_key, key_lock, resolve_cache_dir
from hp_data.errors import HpDataError
from hp_data.format.commit import recover
from hp_data.gpt import GPTDataset, GPTDatasetConfig, corpus_fingerprint
from hp_data.index import SPLITS, parse_split


@dataclass(frozen=True, kw_only=True)
class DatasetConfig(GPTDatasetConfig):
    """A corpus of one dataset type and the samples cut from it: GPTDataset's own config (how
    samples are shaped, `split` the train,valid,test shares) plus where the tokens come from.
    Which split to build and how many samples are `build_dataset`'s arguments, as they are
    GPTDataset's. Fields a type does not use are ignored. hp-train's `[data]` section is this
    type (its `key_prefix` names its fields in messages)."""

    key_prefix: ClassVar[str] = ""  # how messages name the fields (hp-train's "data.")

    type: str
    path: str | None = None  # prefix or blend spec; JSONL file; HF dataset directory
    tokenizer: str | None = None  # json_file and hf_datasets
    split: str | None = None  # train,valid,test shares of `path`; None: the type's default
    text_key: str = "text"
    vocab_size: int = 32000  # dummy: token ids are drawn below it
    input_format: str | None = None  # hf_datasets: "hf-saved" (default detection) or "hf"
    workers: int | None = None  # json_file, hf_datasets: tokenizer processes (None: all cores)

    def __post_init__(self) -> None:
        if self.split in SPLITS:  # what `split` meant before it was the shares
            raise HpDataError(
                f"split {self.split!r}: DatasetConfig.split is the train,valid,test shares "
                f'(e.g. "969,30,1"); name the split to build as build_dataset(config, '
                f"{self.split!r})"
            )
        super().__post_init__()


class DummyDataset:
    """`num_samples` samples of uniformly random tokens, the same for the same index and seed."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int) -> None:
        self.num_samples, self.seq_length = num_samples, seq_length
        self.vocab_size, self.seed = vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, idx])
        text = rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)
        return {
            "tokens": text[:-1],
            "labels": text[1:],
            "loss_mask": np.ones(self.seq_length, dtype=np.float32),
            "position_ids": np.arange(self.seq_length, dtype=np.int64),
        }


def _split_of(split_name: str) -> int:
    if split_name not in SPLITS:
        raise HpDataError(f"split {split_name!r}: use one of {', '.join(SPLITS)}")
    return SPLITS.index(split_name)


def _require_path(config: DatasetConfig, *, tokenizer: bool = False) -> str:
    if not config.path:
        raise HpDataError(f"dataset type {config.type!r} needs a path")
    if tokenizer and not config.tokenizer:
        raise HpDataError(f"dataset type {config.type!r} needs a tokenizer (tokenizer.json)")
    return config.path


def _tokenized(config: DatasetConfig, input_format: str | None) -> tuple[str, int]:
    """Tokenize `config.path` once into the index cache (under its key's lock); the prefix
    and EOD id."""
    # Imported here: the pipeline (tokenizers, worker pools) is for these two types only.
    from hp_data.pipeline.driver import preprocess
    from hp_data.pipeline.options import PreprocessOptions, default_workers
    from hp_data.pipeline.worker import refuse_reentry
    from hp_data.readers.discovery import discover
    from hp_data.tokenize import TokenizerFiles

    path = _require_path(config, tokenizer=True)
    if not os.path.exists(path):
        raise HpDataError(f"{path}: no such file or directory")
    sources = discover([path], input_format)
    files = TokenizerFiles.locate(config.tokenizer)  # type: ignore[arg-type]
    key = cache_key(
        {
            "inputs": [s.identity for s in sources],
            "tokenizer": files.content_hash(),
            "text_key": config.text_key,
        }
    )
    directory = os.path.join(resolve_cache_dir(config.cache_dir), "tokenized")
    os.makedirs(directory, exist_ok=True)
    prefix = os.path.join(directory, key)
    refuse_reentry()  # before the lock: the parent holds it while its workers start
    with key_lock(prefix):
        recover(prefix)
        if not os.path.exists(prefix + ".idx"):
            preprocess(
                [path],
                prefix,
                config.tokenizer,
                PreprocessOptions(  # type: ignore[arg-type]
                    json_keys=(config.text_key,),
                    keys_option=config.key_prefix + "text_key",
                    append_eod=True,
                    input_format=input_format,
                    show_progress=False,
                    workers=config.workers or default_workers(),
                ),
            )
    tokenizer = files.load()
    return prefix, files.special_id(tokenizer, "eos", None)


def _dummy(source: DataSource, split_name: str, num_samples: int | None) -> DummyDataset:
    count = 10_000 if num_samples is None else num_samples
    config = source.config
    return DummyDataset(count, config.seq_length, config.vocab_size, source.seed(split_name))


def _packed(source: DataSource, split_name: str, num_samples: int | None) -> GPTDataset:
    """A tokenized corpus packed into samples (an HF dataset read as `input_format` says)."""
    config = source.config
    hf = config.type == "hf_datasets"
    prefix, eod = _tokenized(config, config.input_format if hf else None)
    return GPTDataset(prefix, split_name, num_samples, replace(source.shaped, eod_token=eod))


def _megatron(source: DataSource, split_name: str, num_samples: int | None) -> Any:
    spec = _require_path(source.config)
    if not source.has(split_name):
        raise HpDataError(f"split {split_name!r} has a zero share in {source.shares!r}")
    return build_split(spec, source.shaped, split_name, num_samples)


@dataclass(frozen=True)
class DatasetType:
    """What hp-data knows of one dataset type: how to build it, what it needs, how it splits."""

    build: Callable[[DataSource, str, int | None], Any]  # (source, split_name, num_samples)
    needs_path: bool = True
    needs_tokenizer: bool = False  # tokenized by hp-data on first use (into the cache)
    default_shares: str | None = "969,30,1"  # Megatron's; None: no splits (any split is there)


DATASET_REGISTRY: dict[str, DatasetType] = {
    "dummy": DatasetType(_dummy, needs_path=False, default_shares=None),
    # A file trains whole unless shares are given: Megatron's default split is for prefixes.
    "hf_datasets": DatasetType(_packed, needs_tokenizer=True, default_shares="1,0,0"),
    "json_file": DatasetType(_packed, needs_tokenizer=True, default_shares="1,0,0"),
    "megatron": DatasetType(_megatron),
}


def dataset_type(name: str) -> DatasetType:
    """The type called `name`; an unknown one lists the valid ones."""
    try:
        return DATASET_REGISTRY[name]
    except KeyError:
        raise HpDataError(
            f"unknown dataset type {name!r}; choose one of {', '.join(DATASET_REGISTRY)}"
        ) from None


@dataclass(frozen=True)
class DataSource:
    """A data config resolved once (`resolve`): its type's facts and the train,valid,test
    shares settled, so that a trainer reads what to build, which splits have data, each
    split's seed and what identifies the samples from here instead of asking again."""

    config: DatasetConfig  # as given; `shaped` is what GPTDataset reads
    kind: DatasetType
    shares: str | None  # the given shares, else the type's default; None: no splits

    @property
    def shaped(self) -> DatasetConfig:
        """The config as GPTDataset reads it: its shares resolved."""
        return replace(self.config, split=self.shares)

    def has(self, split_name: str) -> bool:
        """Whether `split_name` has a share of the data to draw from."""
        shares = self.shares
        return shares is None or parse_split(shares)[_split_of(split_name)] > 0

    def seed(self, split_name: str) -> int:
        """The seed `split_name`'s samples are drawn with: a type without splits draws each
        split from a seed of its own (its validation samples are not its training samples)."""
        if self.kind.default_shares is None:
            return self.config.seed + _split_of(split_name)
        return self.config.seed

    def build(self, split_name: str = "train", num_samples: int | None = None) -> Any:
        """`num_samples` samples (None: one epoch; dummy: 10,000) of `split_name`."""
        _split_of(split_name)
        return self.kind.build(self, split_name, num_samples)

    def identity(self, dataset: Any, split_name: str) -> dict[str, Any]:
        """What identifies the samples of `dataset` (`split_name` built from here), whatever
        their number: each corpus's identity (dtype, sequence lengths' hash, .bin size), blend
        weights, seed, length, split. A resume compares it; the index cache key (which also
        covers the sample count) is kept under `index_key` for reference."""
        out: dict[str, Any] = {
            "type": self.config.type,
            "seq_length": self.config.seq_length,
            "seed": self.seed(split_name),
            "split": split_name,
            "split_shares": self.shares,
            "vocab_size": self.config.vocab_size,
        }
        parts = dataset.datasets if isinstance(dataset, BlendableDataset) else [dataset]
        corpora = [corpus_fingerprint(p.dataset) for p in parts if isinstance(p, GPTDataset)]
        if corpora:
            out["corpora"] = corpora
        if isinstance(dataset, BlendableDataset):
            out["weights"] = list(dataset.weights)
        if isinstance(dataset, GPTDataset | BlendableDataset):
            out["index_key"] = dataset.cache_report["key"]
        return out

    def document_end(self, dataset: Any) -> int | None:
        """The token id that ends a document in `dataset`'s samples: the EOD id its
        GPTDatasets read (the tokenizer's, for the types hp-data tokenizes), else the config's
        `eod_token`; None where none is known."""
        parts = dataset.datasets if isinstance(dataset, BlendableDataset) else [dataset]
        for part in parts:
            if isinstance(part, GPTDataset) and part.config.eod_token is not None:
                return part.config.eod_token
        return self.config.eod_token


def resolve(config: DatasetConfig) -> DataSource:
    """`config`'s type looked up (an unknown one lists the valid ones) and its shares settled."""
    kind = dataset_type(config.type)
    shares = None if kind.default_shares is None else config.split or kind.default_shares
    return DataSource(config, kind, shares)


def same_samples(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether two runs' identities (split -> `DataSource.identity`) describe the same
    samples: the index keys may differ, as they also cover the sample count, which a longer
    run changes."""

    def strip(identities: dict[str, Any]) -> dict[str, Any]:
        return {
            split: {k: v for k, v in d.items() if k != "index_key"}
            for split, d in identities.items()
        }

    return strip(saved) == strip(current)


def build_dataset(
    config: DatasetConfig, split_name: str = "train", num_samples: int | None = None
) -> Any:
    """`num_samples` samples (None: one epoch; dummy: 10,000) of `split_name` of the dataset
    `config` describes; an unknown type lists the valid ones."""
    return resolve(config).build(split_name, num_samples)
