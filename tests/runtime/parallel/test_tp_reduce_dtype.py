"""`parallel.tp_reduce_dtype = "float32"` under bf16: the row-wise partial sums are reduced in
fp32 and rounded once, so a TP 2 model computes closer to one fp32 process than with bf16
partial sums (each rank's partial rounded, then the sum rounded again).

Measured on the logits of a whole forward pass (131k values, so the error norms are stable).
Loss curves over 20 steps were tried first, as the issue suggests: at TP 2 the difference
between the two reductions is smaller than the step-to-step noise of bf16 training, and the
order flipped between seeds, so that comparison could not fail for the right reason.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.distributed import run_ranks
from tests.helpers.train import train_ranks


def _logits(rank: int, world: int, reduce_dtype: str | None, seed: int) -> np.ndarray:
    import torch
    from hp_runtime.model import preset
    from hp_runtime.parallel import ParallelDims, ParallelOptions, assemble

    config = preset(
        "tiny", vocab_size=512, dim=256, ffn_hidden=688, n_heads=8, n_kv_heads=4, n_layers=4
    )
    dims = ParallelDims(tp=world)
    options = ParallelOptions(tp_reduce_dtype=reduce_dtype)
    assembly = assemble(config, dims, torch.device("cpu"), seed=seed, options=options)
    tokens = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=world > 1):
        return assembly.model(tokens).float().numpy().copy()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1])  # 2 and 3 were tried too, same order
def test_fp32_reduction_is_closer_to_one_fp32_process(seed):
    reference = run_ranks(_logits, 1, None, seed)[0]

    def error(reduce_dtype: str) -> float:
        logits = run_ranks(_logits, 2, reduce_dtype, seed)[0]
        return float(np.linalg.norm(logits - reference) / np.linalg.norm(reference))

    fp32, bf16 = error("float32"), error("bfloat16")
    assert 0 < fp32 < bf16, (fp32, bf16)


@pytest.mark.slow
def test_training_with_fp32_reduction_follows_the_fp32_curve():
    overrides = [
        "data.type=dummy",
        "model.vocab_size=512",
        "data.seq_length=64",
        "train.steps=20",
        "train.micro_batch_size=4",
        "optim.lr=1e-3",
        "optim.warmup_steps=0",
    ]
    reference = np.array(train_ranks(1, overrides)[0]["losses"])
    tp = train_ranks(
        2,
        [
            *overrides,
            "parallel.tp=2",
            "train.mixed_precision=bf16",
            "parallel.tp_reduce_dtype=float32",
        ],
    )
    for rank in tp:
        np.testing.assert_allclose(rank["losses"], reference, rtol=2e-3)
        assert rank["losses"] != list(reference)  # it really ran in bf16
