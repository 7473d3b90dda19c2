"""Multi-token prediction (`model.mtp`): its inputs and targets against ones written out by
hand, its table's bad values, what a resume may change, and its modules through export
(`--mtp keep|drop`) and init_from. Training against the paper's definition is
`test_deepseek_train.py`'s; every layout against one process `test_mtp_parity.py`'s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hp_runtime.model.loss import IGNORE, mtp_inputs
from hp_runtime.train.config import ConfigError, load_config, to_toml

from tests.helpers.train import hp_train_here

BASE = ["model.preset=deepseek-v3-tiny", "data.type=dummy", "data.seq_length=16",
        "train.steps=2"]  # fmt: skip


def test_each_module_embeds_the_token_k_ahead_and_predicts_the_next():
    """A sample t0..t6 (tokens t0..t5, labels t1..t6), the loss masked at label t4: module 1
    at position i embeds t[i+1] and predicts t[i+2]; module 2 embeds t[i+2] and predicts
    t[i+3]; past the sample nothing is predicted (and module 2 embeds token 0)."""
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    labels = torch.tensor([[11, 12, 13, 14, 15, 16]])
    mask = torch.tensor([[1, 1, 1, 0, 1, 1]])  # label t4 = 14 counts no loss
    ahead, predicted = mtp_inputs(tokens, labels, mask, depth=2)
    assert ahead[0, :, 0].tolist() == [11, 12, 13, 14, 15, 16]
    assert ahead[0, :, 1].tolist() == [12, 13, 14, 15, 16, 0]
    assert predicted[0, :, 0].tolist() == [12, 13, IGNORE, 15, 16, IGNORE]
    assert predicted[0, :, 1].tolist() == [13, IGNORE, 15, 16, IGNORE, IGNORE]


def test_a_modules_input_stays_in_its_positions_document():
    """Documents [0 0 0 1 1 2]: module 1 at position 2 would embed t[3], of document 1: no
    prediction there; at 1 it embeds t[2] (document 0, the document's end) and predicts t[3],
    as the main loss at position 2 does. Module 2 at 1 would embed t[3]: no prediction."""
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    labels = torch.tensor([[11, 12, 13, 14, 15, 16]])
    documents = torch.tensor([[0, 0, 0, 1, 1, 2]])
    _, predicted = mtp_inputs(tokens, labels, torch.ones_like(tokens), 2, documents)
    assert predicted[0, :, 0].tolist() == [12, 13, IGNORE, 15, IGNORE, IGNORE]
    assert predicted[0, :, 1].tolist() == [13, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.mtp.depth=16"], "data.seq_length=16 is not more than model.mtp.depth=16: "
         "prediction module k predicts the token k + 1 ahead within a sample; lower the depth "
         "or lengthen it"),
        (["model.mtp.depth=0"], "model.mtp.depth: must be from 1 to 64, got 0"),
        (["model.mtp.depth=65"], "model.mtp.depth: must be from 1 to 64, got 65"),
        (["model.mtp.loss_weight=-0.1"], "model.mtp.loss_weight: must be at least 0, got -0.1"),
        (["model.mtp.loss_weight=nan"], "model.mtp.loss_weight: expected a number, got nan "
         "(float)"),
        (["model.mtp={loss_weight = 0.1}"], "model.mtp.depth: required; model.mtp needs depth "
         "(the other fields have defaults)"),
    ],
)  # fmt: skip
def test_a_bad_mtp_is_one_line_naming_it(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [*BASE, *overrides])
    assert str(error.value) == message


def test_a_resume_may_lower_the_loss_weight_but_not_change_the_depth():
    """DeepSeek-V3 lowered the weight from 0.3 to 0.1 mid-run: a resume may; a depth is
    another model."""
    from hp_runtime.train.checkpoint_format import CheckpointError
    from hp_runtime.train.compat import check_model

    meta = {"config": to_toml(load_config(None, BASE))}
    check_model("CKPT", meta, load_config(None, [*BASE, "model.mtp.loss_weight=0.1"]).model)
    with pytest.raises(CheckpointError, match=r"model.mtp = \{depth = 2, loss_weight = 0.3\}"):
        check_model("CKPT", meta, load_config(None, [*BASE, "model.mtp.depth=2"]).model)
    with pytest.raises(CheckpointError, match='model.mtp = "none", but CKPT'):
        check_model("CKPT", meta, load_config(None, [*BASE, "model.mtp=none"]).model)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("mtp") / "run"
    done = hp_train_here(*BASE, "checkpoint.interval=2", f"train.run_dir={run}")
    assert done.returncode == 0, done.stderr
    return run / "checkpoints" / "step-0000002"


def _names(directory: Path) -> set[str]:
    from safetensors.torch import load_file

    return set(load_file(directory / "model.safetensors"))


def test_export_keeps_or_drops_the_prediction_modules(checkpoint, tmp_path):
    """keep: DeepSeek-V3's layer after the model's (its own tensors and copies of the
    embedding and head), num_nextn_predict_layers 1, and transformers loads the model (it
    leaves that layer, as it does DeepSeek's); drop: the model alone."""
    transformers = pytest.importorskip("transformers")
    kept, dropped = tmp_path / "keep", tmp_path / "drop"
    for out, mode in ((kept, "keep"), (dropped, "drop")):
        done = hp_train_here("export", checkpoint, "--out", out, "--mtp", mode)
        assert done.returncode == 0, done.stderr
    mtp = {n for n in _names(kept) if n.startswith("model.layers.3.")}
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight",
            "model.layers.3.hnorm.weight", "model.layers.3.shared_head.norm.weight",
            "model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight",
            "model.layers.3.self_attn.kv_b_proj.weight",
            "model.layers.3.mlp.gate.e_score_correction_bias"} <= mtp  # fmt: skip
    assert _names(dropped) == _names(kept) - mtp
    assert json.loads((kept / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert json.loads((dropped / "config.json").read_text())["num_nextn_predict_layers"] == 0
    tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    logits = []
    for out in (kept, dropped):
        with torch.no_grad():
            model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
            logits.append(model(tokens).logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_init_from_reads_the_modules_or_refuses_by_name(checkpoint, tmp_path):
    """The kept export starts an MTP model with its modules; a config of another depth, a
    copy of the embedding that is not the embedding, and a model whose family has no MTP
    layers are refused in one line, before any tensor is copied."""
    from hp_runtime.model import Transformer
    from hp_runtime.train.hf import check_hf_config, init_from_hf, read_model
    from hp_runtime.train.launch import TrainError
    from safetensors.torch import load_file, save_file

    out = tmp_path / "hf"
    done = hp_train_here("export", checkpoint, "--out", out, "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    config, saved = read_model(str(checkpoint))
    model = Transformer(config)
    init_from_hf([model], config, str(out))
    for name, tensor in model.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name
    deeper = load_config(None, [*BASE, "model.mtp.depth=2"]).model
    with pytest.raises(TrainError) as error:
        check_hf_config(deeper, str(out))
    assert str(error.value) == (
        f"model.init_from: {out} has num_nextn_predict_layers=1, the config model.mtp.depth=2; "
        "set model.mtp.depth = 1 (or drop model.mtp)"
    )
    weights = load_file(out / "model.safetensors")
    weights["model.layers.3.embed_tokens.weight"] = (
        weights["model.layers.3.embed_tokens.weight"] + 1
    )
    save_file(weights, out / "model.safetensors")
    with pytest.raises(TrainError) as error:
        init_from_hf([Transformer(config)], config, str(out))
    assert str(error.value) == (
        f"model.init_from: {out} has a model.layers.3.embed_tokens.weight that differs from "
        "model.embed_tokens.weight; hp's multi-token prediction modules share the model's "
        "embedding and head"
    )
    llama = load_config(None, ["model.preset=tiny", "model.mtp={depth = 1}", "data.type=dummy",
                               "data.seq_length=16",
                               "train.steps=1"]).model  # fmt: skip
    from hp_runtime.train.hf import write_hf

    with pytest.raises(TrainError) as error:
        write_hf({}, llama, str(tmp_path / "llama"))
    assert str(error.value) == (
        "model.mtp: hp's Llama has no multi-token prediction layers (DeepSeek-V3's checkpoints "
        "hold them); export with --mtp drop"
    )
