"""hp-train with optim.name = "muon" on one process against a plain loop written here:
`torch.optim.Muon` on the hidden matrices and `torch.optim.AdamW` on the rest, each group's
rate following the warmup, on the same samples and initial weights; and which parameter goes
to which optimizer, listed for a dense and a MoE preset."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers.train import FAST, train_ranks

STEPS, MICRO, GLOBAL, SEQ, LR, WARMUP = 20, 2, 4, 16, 3e-3, 3
CASES = {  # name: optim.muon, optim.weight_decay (AdamW's)
    "no-decay": ({"lr": 0.02, "weight_decay": 0.0}, 0.0),
    "decay": ({"lr": 0.02, "weight_decay": 0.1, "nesterov": False, "ns_steps": 4}, 0.1),
    "match-rms": ({"lr": LR, "weight_decay": 0.1, "adjust_lr": "match_rms_adamw"}, 0.1),
    "float32": ({"lr": 0.02, "weight_decay": 0.1, "ns_dtype": "float32"}, 0.1),
}


def _inline(table: dict[str, Any]) -> str:
    text = {k: f'"{v}"' if isinstance(v, str) else str(v).lower() for k, v in table.items()}
    return "{" + ", ".join(f"{k} = {v}" for k, v in text.items()) + "}"


def _overrides(case: str, run_dir: Any) -> list[str]:
    muon, decay = CASES[case]
    return [
        "data.type=dummy", f"data.seq_length={SEQ}", "data.split=90,10,0",
        "model.tie_embeddings=false",
        f"train.steps={STEPS}", f"train.micro_batch_size={MICRO}",
        f"train.global_batch_size={GLOBAL}", "train.max_norm=1.0",
        "optim.name=muon", f"optim.muon={_inline(muon)}", f"optim.lr={LR}",
        f"optim.warmup_steps={WARMUP}", "optim.decay_style=constant",
        f"optim.weight_decay={decay}", f"train.run_dir={run_dir}",
    ]  # fmt: skip


def _clip(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ with the squares summed in float64, as hp sums them
    (docs/parallelism.md, Clipping): the norm then in float32 and the scale from it as torch
    makes it. (torch's own float32 norm moves a scale by a float32 step now and then, which
    bfloat16's iteration turns into a different update.)"""
    norms = torch._foreach_norm([p.grad for p in params], 2, dtype=torch.float64)
    norm = torch.stack(norms).square().sum().sqrt().float()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(scale)
    return norm


def _float32_iteration(grad, coefficients, steps, eps):
    a, b, c = coefficients
    x = grad.to(dtype=torch.float32, copy=True)
    x = x.T if grad.size(0) > grad.size(1) else x
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def _reference(case: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[float]]:
    """The run as a plain loop: torch's Muon on every 2-D weight but the embedding and the
    head (the paper's hidden matrices), torch's AdamW on those (the head decayed) and the
    norms."""
    from hp_data.registry import DatasetConfig, build_dataset
    from hp_runtime.model import Transformer, preset
    from hp_runtime.parallel.init import init_weights

    muon, decay = CASES[case]
    if muon.get("ns_dtype") == "float32":  # torch's iteration, its first line in float32
        monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", _float32_iteration)
    config = preset("tiny", tie_embeddings=False)
    model = Transformer(config)
    init_weights(model, seed=0)  # train.seed's initial weights
    named = dict(model.named_parameters())
    hidden = [p for n, p in named.items() if p.ndim == 2 and n.startswith("layers.")]
    assert len(hidden) == 7 * config.n_layers
    opt_muon = torch.optim.Muon(
        hidden,
        lr=muon["lr"],
        weight_decay=muon["weight_decay"],
        nesterov=muon.get("nesterov", True),
        ns_steps=muon.get("ns_steps", 5),
        adjust_lr_fn=muon.get("adjust_lr"),
    )
    opt_adamw = torch.optim.AdamW(
        [
            {"params": [named["output.weight"]], "weight_decay": decay},
            {"params": [p for n, p in named.items() if p.ndim == 1], "weight_decay": 0.0},
            {"params": [named["tok_embeddings.weight"]], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,  # hp's, on CPU too (its rounding differs from foreach's)
    )
    samples = build_dataset(
        DatasetConfig(type="dummy", seq_length=SEQ, vocab_size=config.vocab_size, split="90,10,0"),
        "train",
        STEPS * GLOBAL,
    )
    out: dict[str, list[float]] = {"losses": [], "grad_norms": []}
    for step in range(STEPS):
        for opt, peak in ((opt_muon, muon["lr"]), (opt_adamw, LR)):
            for group in opt.param_groups:  # docs/training.md: `lr * step / warmup_steps`
                group["lr"] = peak * (step + 1) / WARMUP if step < WARMUP else peak
        loss_sum = 0.0
        for j in range(GLOBAL // MICRO):
            rows = [samples[i] for i in range(step * GLOBAL + j * MICRO, (step + 1) * GLOBAL)]
            rows = rows[:MICRO]
            inputs = torch.tensor(np.stack([r["tokens"] for r in rows]))
            labels = torch.tensor(np.stack([r["labels"] for r in rows]))
            loss = model(inputs, labels=labels).sum() / (GLOBAL * SEQ)
            loss.backward()
            loss_sum += float(loss.detach())
        norm = _clip(list(model.parameters()), 1.0)
        opt_muon.step()
        opt_adamw.step()
        opt_muon.zero_grad()
        opt_adamw.zero_grad()
        out["losses"].append(loss_sum)
        out["grad_norms"].append(float(norm))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_process_equals_torch_muon_with_adamw(case, tmp_path, monkeypatch):
    """torch's Muon as it is (its iteration in bfloat16), and with `ns_dtype = "float32"`
    its iteration in float32: within 1e-5 over 20 steps. (The gradients and rates are the
    same bits as the loop's: bfloat16 would turn a float32 step of difference into 1e-3.)"""
    got = train_ranks(1, _overrides(case, tmp_path / "run"))[0]
    want = _reference(case, monkeypatch)
    assert np.ptp(want["losses"]) > 0.05  # the updates move the loss (random tokens: no lower)
    for key in ("losses", "grad_norms"):
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-5)


def test_the_split_between_muon_and_adamw():
    """The rule written out: for a dense model and a MoE one with latent attention, shared
    experts and an MTP module, each parameter (layer indices dropped) and its optimizer."""
    from hp_runtime.model import Transformer, preset
    from hp_runtime.parallel import canonical_name
    from hp_runtime.train.config import OptimConfig
    from hp_runtime.train.config.schema import Muon
    from hp_runtime.train.optim import build_optimizer

    def split(name: str) -> dict[str, str]:
        model = Transformer(preset(name))
        optim = OptimConfig(name="muon", muon=Muon())
        optimizers = build_optimizer([model], optim, False, torch.device("cpu"))
        (adamw, muon) = optimizers.optimizers[0]
        which = {p: "muon" for group in muon.param_groups for p in group["params"]}
        which |= {p: "adamw" for group in adamw.param_groups for p in group["params"]}
        names = {canonical_name(n): p for n, p in model.named_parameters()}
        assert len(which) == len(names)  # each in one optimizer
        return {
            ".".join(s for s in n.split(".") if not s.isdigit()): which[p] for n, p in names.items()
        }

    adamw = ("tok_embeddings.weight", "output.weight", "norm.weight",
             "layers.attention_norm.weight", "layers.ffn_norm.weight")  # fmt: skip
    assert split("tiny") == {
        **{n: "adamw" for n in adamw},
        **{f"layers.attention.{w}.weight": "muon" for w in ("wq", "wk", "wv", "wo")},
        **{f"layers.feed_forward.{w}.weight": "muon" for w in ("w1", "w2", "w3")},
    }
    moe = split("deepseek-v3-tiny")
    muon = {n for n, o in moe.items() if o == "muon"}
    assert muon == {
        *(f"layers.attention.{w}.weight" for w in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")),
        *(f"layers.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")),
        *(f"layers.feed_forward.experts.{w}" for w in ("w1", "w2", "w3")),  # expert by expert
        *(f"layers.feed_forward.shared.{w}.weight" for w in ("w1", "w2", "w3")),
        "layers.eh_proj.weight",  # MTP's projection
    }
    assert {n for n, o in moe.items() if o == "adamw"} == {
        *adamw, "layers.attention.q_norm.weight", "layers.attention.kv_norm.weight",
        "layers.feed_forward.router.gate.weight", "layers.enorm.weight", "layers.hnorm.weight",
        "layers.head_norm.weight",
    }  # fmt: skip


@pytest.mark.parametrize(
    "settings",
    [{}, {"nesterov": False, "ns_steps": 3, "weight_decay": 0.0},
     {"adjust_lr": "match_rms_adamw", "momentum": 0.9}, {"adjust_lr": "spectral_unclamped"}],
)  # fmt: skip
def test_the_step_is_torchs_to_the_bit(settings):
    """hp's Muon on whole matrices (and a stack of experts, matrix by matrix) against
    torch.optim.Muon, five steps on the same gradients: the same bits."""
    from hp_runtime.train.config.schema import Muon as Settings
    from hp_runtime.train.muon import Muon

    generator = torch.Generator().manual_seed(11)
    shapes = [(12, 5), (5, 12), (7, 7), (3, 6, 4)]
    start = [torch.randn(s, generator=generator) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(m.clone()) for t in start for m in (t if t.ndim == 3 else [t])]
    hp = Muon(ours, Settings(lr=0.03, **settings))
    torch_muon = torch.optim.Muon(
        theirs,
        lr=0.03,
        **{{"adjust_lr": "adjust_lr_fn"}.get(k, k): v for k, v in settings.items()},
    )
    for _ in range(5):
        grads = [torch.randn(s, generator=generator) for s in shapes]
        for p, g in zip(ours, grads, strict=True):
            p.grad = g.clone()
        flat = [m for g in grads for m in (g if g.ndim == 3 else [g])]
        for p, g in zip(theirs, flat, strict=True):
            p.grad = g.clone()
        hp.step()
        torch_muon.step()
        got = [m for p in ours for m in (p if p.ndim == 3 else [p])]
        assert all(torch.equal(a, b) for a, b in zip(got, theirs, strict=True))


def test_a_resume_that_changes_muon_is_refused_but_its_rate_may_change(tmp_path):
    from tests.helpers.train import hp_train_here

    run = tmp_path / "run"  # tied: AdamW has no matrix to decay (an empty group, once lost)
    base = [*FAST, "data.type=dummy", "data.seq_length=16", "train.micro_batch_size=2",
            "model.tie_embeddings=true", "optim.name=muon", f"train.run_dir={run}",
            "checkpoint.interval=2"]  # fmt: skip
    assert hp_train_here(*base, "train.steps=2").returncode == 0
    step2 = run / "checkpoints" / "step-0000002"
    for change, message in [
        (
            "optim.muon.momentum=0.9",
            f"optim.muon.momentum = 0.9, but {step2} was trained with 0.95",
        ),
        ("optim.muon={ns_dtype = 'float32'}", "optim.muon.ns_dtype = 'float32', but"),
        ("optim.name=adamw", "optim.name = 'adamw', but"),
    ]:
        done = hp_train_here(*base, "train.steps=4", change)
        assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
        assert message in done.stderr and "set it back to resume" in done.stderr
    done = hp_train_here(*base, "train.steps=4", "optim.muon.lr=0.05")
    assert done.returncode == 0 and "resumed from" in done.stdout, done.stderr


@pytest.mark.parametrize(
    ("override", "message"),
    [("optim.muon.ns_steps=0", "optim.muon.ns_steps: must be from 1 to 99, got 0"),
     ("optim.muon.lr=-1", "optim.muon.lr"),
     ("optim.muon.ns_dtype='float16'", "optim.muon.ns_dtype: expected one of"),
     ("optim.muon.nesterov=1", "optim.muon.nesterov"),
     ("optim.muon.adjust_lr='rms'", "optim.muon.adjust_lr: expected one of")],
)  # fmt: skip
def test_a_bad_muon_value_is_one_line_from_hp_train(override, message):
    from tests.helpers.train import hp_train_here

    done = hp_train_here(*FAST, "data.type=dummy", "data.seq_length=16", "train.steps=1",
                         "optim.name=muon", override)  # fmt: skip
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"hp-train: {message}") or message in done.stderr, done.stderr


def test_a_pipeline_stage_without_the_head_resumes(tmp_path):
    """Stage 0 holds no head and no router: AdamW has no matrix to decay there."""
    from tests.helpers.train import train_ranks

    base = ["data.type=dummy", "data.seq_length=16", "train.micro_batch_size=2",
            "parallel.pp=2", "train.global_batch_size=4", "optim.name=muon",
            f"train.run_dir={tmp_path / 'run'}",
            "checkpoint.interval=2"]  # fmt: skip
    train_ranks(2, [*base, "train.steps=2"])
    resumed = train_ranks(2, [*base, "train.steps=3"])
    assert "resumed from" in resumed[0]["log"]


def test_a_shards_place_reads_and_writes_its_elements():
    """A shard's place (slices, and index tensors where a split is strided) picks exactly the
    elements a loop over its indices picks, in any mix, on a stack of matrices too."""
    import itertools

    from hp_runtime.train.muon import _grid, _length

    full = torch.arange(4 * 6 * 8.0).view(4, 6, 8)
    choices = [torch.tensor([0, 2]), slice(1, 3)], [torch.tensor([5, 1, 3]), slice(2, 6)], [
        torch.tensor([7, 0]), slice(0, 8)]  # fmt: skip
    for piece in itertools.product(*choices):
        lists = [list(range(n))[ix] if isinstance(ix, slice) else ix.tolist()
                 for ix, n in zip(piece, full.shape, strict=True)]  # fmt: skip
        shape = [_length(ix, n) for ix, n in zip(piece, full.shape, strict=True)]
        want = torch.tensor([full[i, j, k].item() for i, j, k in itertools.product(*lists)])
        assert torch.equal(full[_grid(list(piece))].reshape(-1), want), piece
        written = torch.zeros_like(full)
        written[_grid(list(piece))] = want.view(shape)
        assert torch.equal(written[_grid(list(piece))].reshape(-1), want)
        assert int((written != 0).sum()) == int((want != 0).sum())  # nothing else written
