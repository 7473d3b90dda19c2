"""megatron-core's dataset builder, configured the way the parity tests compare against it."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any


class Tokenizer:
    """The attributes megatron-core's GPTDataset reads from a tokenizer."""

    def __init__(self, eod: int = 0, vocab_size: int = 65536) -> None:
        self.vocab_size, self.eod = vocab_size, eod
        self.unique_identifiers = {"class": "Tokenizer", "eod": eod}


def build_megatron(
    sizes: list[int | None],
    seq_length: int,
    seed: int,
    *,
    blend: Any = None,
    blend_per_split: Any = None,
    split: str | None = None,
    cache: str | None = None,
    eod: int = 0,
    **options: Any,
) -> list[Any]:
    """Train, valid and test datasets from megatron-core's BlendedMegatronDatasetBuilder.

    `options` are GPTDatasetConfig fields (add_extra_token_to_sequence, eod_mask_loss, ...);
    no attention masks are built, as hp builds none.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import blended_megatron_dataset_builder, gpt_dataset

    settings = {"reset_position_ids": False, "eod_mask_loss": False, **options}
    config = gpt_dataset.GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        path_to_cache=cache,
        tokenizer=Tokenizer(eod),
        reset_attention_mask=False,
        create_attention_mask=False,
        **settings,
    )
    return blended_megatron_dataset_builder.BlendedMegatronDatasetBuilder(
        gpt_dataset.GPTDataset, sizes, lambda: True, config
    ).build()


def ramp_calculator() -> type:
    """megatron-core's `RampupBatchsizeNumMicroBatchesCalculator`, loaded from its file alone:
    `import megatron.core` pulls in all of megatron-core (tens of seconds), and the file needs
    only the standard library."""
    location = importlib.util.find_spec("megatron").submodule_search_locations[0]
    path = Path(location) / "core" / "num_microbatches_calculator.py"
    spec = importlib.util.spec_from_file_location("_megatron_microbatches", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RampupBatchsizeNumMicroBatchesCalculator
