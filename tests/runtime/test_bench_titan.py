"""tools/bench/bench_titan.py's weight mapping: torchtitan's llama3 model, built by the script
for an hp shape and given hp's initial weights (hp's HF names, then torchtitan's own adapter
and fused-qkv merge), computes hp's logits and gradients. torchtitan is a dev-only reference,
not in the lock: this runs where it is installed and is skipped elsewhere (CI), e.g.

    uv run --with torchtitan==0.3.0 pytest tests/runtime/test_bench_titan.py
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("torchtitan")

REPO = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "bench_titan", REPO / "tools" / "bench" / "bench_titan.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("tied", [False, True])
def test_torchtitan_computes_hps_logits_from_hps_weights(tied):
    from hp_runtime.model import Transformer, preset
    from hp_runtime.parallel import init_weights

    bench = _bench()
    config = replace(preset("tiny", max_seq_len=64), tie_embeddings=tied)
    hp = Transformer(config)
    init_weights(hp, seed=3)
    titan_config = bench.titan_model(config)
    titan = titan_config.build()
    bench.hp_weights_into_titan(titan, config, titan_config, seed=3)
    if tied:
        assert titan.lm_head.weight is titan.tok_embeddings.weight

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, 65), generator=generator)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    ours, theirs = hp(inputs), titan(inputs)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)

    def grad_norm(model: torch.nn.Module, logits: torch.Tensor) -> float:
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        squares = sum(p.grad.double().square().sum() for p in model.parameters())
        return float(squares.sqrt())

    assert grad_norm(titan, theirs) == pytest.approx(grad_norm(hp, ours), rel=1e-6)
