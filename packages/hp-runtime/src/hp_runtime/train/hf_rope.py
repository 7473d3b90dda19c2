"""The rotary embedding's fields of an HF config.json as hp writes them (`rope_scaling`, which
transformers 4 reads, and `rope_parameters`, which 5 reads), and each scaling type's fields;
`hf_config.py` reads them back."""

from __future__ import annotations

from typing import Any

from hp_runtime.model import ModelConfig

# An HF rope dict's llama3 fields, and the RopeScaling field each sets.
_HF_SCALING = {
    "factor": "factor",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "original_max_position_embeddings": "original_max_seq_len",
}
# YaRN's: the first two required, the others optional (transformers' defaults where absent).
_HF_YARN = {
    "factor": "factor",
    "original_max_position_embeddings": "original_max_seq_len",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "mscale": "mscale",
    "mscale_all_dim": "mscale_all_dim",
}
HF_SCALINGS = {"llama3": _HF_SCALING, "yarn": _HF_YARN}


def hf_rope(config: ModelConfig) -> dict[str, Any]:
    """The rotary fields of config.json: rope_theta and rope_scaling, which transformers 4
    reads, and rope_parameters, which 5 reads (both as Meta's Llama 3.1 and DeepSeek-V3's
    configs spell them)."""
    scaling = config.rope_scaling
    if scaling is None:
        return {
            "rope_theta": config.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        }
    fields = HF_SCALINGS[scaling.type].items()
    given = {hf: getattr(scaling, hp) for hf, hp in fields if getattr(scaling, hp) is not None}
    rope = {"rope_type": scaling.type, **given}
    return {
        "rope_theta": config.rope_theta,
        "rope_scaling": rope,
        "rope_parameters": {**rope, "rope_theta": config.rope_theta},
    }
