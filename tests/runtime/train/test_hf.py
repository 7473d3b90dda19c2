"""Hugging Face Llama in and out, checked against transformers' own model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.train import FAST, hp_train

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 256,
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_hidden": 172,
    "max_seq_len": 64,
}
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))


def _hf_llama(directory, tied: bool) -> np.ndarray:
    """A random HF Llama saved to `directory`; its logits on TOKENS."""
    torch.manual_seed(11)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    for param in model.parameters():  # norms start at 1: make them count too
        torch.nn.init.normal_(param, std=0.2 if param.ndim == 1 else 0.05)
    model.save_pretrained(directory)
    with torch.no_grad():
        return model(TOKENS).logits.numpy()


def _hp_logits(rank: int, world: int, directory: str, tied: bool) -> np.ndarray:
    from hp_runtime.model import ModelConfig
    from hp_runtime.parallel import ParallelDims, assemble
    from hp_runtime.train.hf import init_from_hf

    config = ModelConfig(**SHAPE, tie_embeddings=tied)
    assembly = assemble(config, ParallelDims(tp=world), torch.device("cpu"), seed=0)
    init_from_hf(assembly.modules, config, directory)
    with torch.no_grad():
        return assembly.model(TOKENS).numpy()


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_init_from_an_hf_llama_gives_its_logits(tmp_path, tied):
    reference = _hf_llama(tmp_path, tied)
    single = run_ranks(_hp_logits, 1, str(tmp_path), tied)[0]
    np.testing.assert_allclose(single, reference, atol=1e-4, rtol=0)
    for logits in run_ranks(_hp_logits, 2, str(tmp_path), tied):  # tensor parallel
        np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)


def _checkpoint_logits(directory: str) -> np.ndarray:
    import tomllib

    import torch.distributed.checkpoint as dcp
    from hp_runtime.model import Transformer
    from hp_runtime.train.checkpoint import read_meta
    from hp_runtime.train.config import build_config

    config = build_config(tomllib.loads(read_meta(directory)["config"])).model
    model = Transformer(config)
    state = {name: torch.empty_like(p) for name, p in model.named_parameters()}
    dcp.load({"model": state}, checkpoint_id=directory, no_dist=True)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    with torch.no_grad():
        return model(TOKENS).numpy()


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True])  # init_from covers both; tied drops lm_head here
def test_exported_checkpoint_loads_in_transformers(tmp_path, tied):
    run = tmp_path / "run"
    done = hp_train(
        *FAST, "data.type=dummy", "data.seq_length=24", "model.max_seq_len=64",
        f"model.tie_embeddings={str(tied).lower()}", "train.steps=3",
        "checkpoint.interval=3", f"train.run_dir={run}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    checkpoint = run / "checkpoints" / "step-0000003"
    out = tmp_path / "hf"
    done = hp_train("export", checkpoint, "--out", out, "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    model = transformers.LlamaForCausalLM.from_pretrained(out)
    names = {name for name, _ in model.named_parameters()}
    assert "model.layers.1.self_attn.q_proj.weight" in names
    with torch.no_grad():
        hf = model(TOKENS).logits.numpy()
    np.testing.assert_allclose(hf, _checkpoint_logits(str(checkpoint)), atol=1e-4, rtol=0)


def test_export_errors_are_one_line(tmp_path):
    done = hp_train("export", tmp_path / "nothing", "--out", tmp_path / "hf")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"hp-train: error: {tmp_path / 'nothing' / 'meta.json'}: missing; "
        f"{tmp_path / 'nothing'} is not a hp-train checkpoint"
    ]
    assert not (tmp_path / "hf").exists()
    size = hp_train("export", tmp_path, "--out", tmp_path / "hf", "--max-shard-size", "5 GBs")
    assert size.returncode == 1
    assert size.stderr.splitlines() == [
        "hp-train: error: --max-shard-size '5 GBs': give a positive size such as 5GB or 500MiB"
    ]


@pytest.mark.slow
def test_a_run_starts_from_an_hf_directory(tmp_path):
    _hf_llama(tmp_path / "hf", tied=False)
    shape = [f"model.{k}={v}" for k, v in SHAPE.items()]
    run = tmp_path / "run"
    done = hp_train(
        *FAST, *shape, "data.type=dummy", "data.seq_length=24", "train.steps=2",
        f"model.init_from={tmp_path / 'hf'}", f"train.run_dir={run}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"initialised from {tmp_path / 'hf'}" in done.stdout
    wrong = hp_train(
        *FAST, *shape, "model.dim=32", "model.ffn_hidden=86", "data.type=dummy",
        "data.seq_length=24", "train.steps=2", f"model.init_from={tmp_path / 'hf'}",
        f"train.run_dir={tmp_path / 'wrong'}",
    )  # fmt: skip
    assert wrong.returncode == 1
    assert "has dim=64, the config model.dim=32; set model.dim = 64" in wrong.stderr
