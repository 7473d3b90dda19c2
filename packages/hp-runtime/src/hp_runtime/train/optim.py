"""The optimizer: AdamW (torch's fused kernel on CUDA and CPU, foreach elsewhere), SGD, or Muon
with AdamW, with weight decay only on matrices that are not embeddings (unless
`decay_embeddings`).

Muon's split (its authors' rule, as Moonlight and Kimi K2 train): Muon updates the hidden
matrices, the 2-D weights of attention, MLPs, shared experts and MTP's projections, and each
expert's matrices of a MoE layer's 3-D weights; AdamW the rest: the embedding, the head, the
router and every norm and bias (`takes_muon`).

Fused on CPU too: on the `small` preset's 20.7M parameters a step of the fused kernel took
8 ms against 36 ms for foreach (and 56 ms one tensor at a time), and torchtitan uses it; its
updates differ from the unfused ones in float32 rounding only (2.4e-7 at most after 10 steps)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hp_runtime.parallel.parallelize import canonical_name
from hp_runtime.train.config import OptimConfig
from hp_runtime.train.muon import Muon
from hp_runtime.train.schedule import lr_at

NOT_HIDDEN = ("tok_embeddings.weight", "output.weight", "router.gate.weight")


def takes_muon(name: str, param: nn.Parameter) -> bool:
    """Whether Muon updates `param` (by its canonical name) under optim.name = "muon": a
    matrix, or a stack of them, that is neither the embedding, the head nor the router."""
    return param.ndim >= 2 and not name.endswith(NOT_HIDDEN)


def hidden_matrices(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of `module` Muon updates (`takes_muon`), in their order."""
    return [p for n, p in module.named_parameters() if takes_muon(canonical_name(n), p)]


def _no_decay(name: str, param: nn.Parameter, tied: bool) -> bool:
    """Norms and biases (1-D) never decay; nor do embeddings, by default. A tied head is the
    embedding: both copies of a tied weight must take the same update."""
    if param.ndim < 2:
        return True
    return name == "tok_embeddings.weight" or (tied and name == "output.weight")


def param_groups(
    modules: Iterable[nn.Module], optim: OptimConfig, tied: bool
) -> list[dict[str, object]]:
    """Two groups, decayed and not (an empty one left out), in a fixed order of parameters
    (under Muon, of those AdamW updates)."""
    decay, plain = [], []
    for module in modules:
        for wrapped, param in module.named_parameters():
            name = canonical_name(wrapped)
            if optim.name == "muon" and takes_muon(name, param):
                continue
            skip = _no_decay(name, param, tied) and not (optim.decay_embeddings and param.ndim >= 2)
            (plain if skip else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": optim.weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    # An empty group (Muon's AdamW on a tied model, or on a pipeline stage without the head
    # or a router, has nothing to decay) saves no keys, and DCP cannot load it back.
    return [group for group in groups if group["params"]]


class Optimizers:
    """The optimizers of each model part (a pipeline rank may hold several stages; Muon's
    part has AdamW beside it), stepped together: DCP's optimizer state dict maps a module's
    optimizers to it by parameter names, which is what lets a checkpoint move between
    layouts."""

    def __init__(self, optimizers: list[list[torch.optim.Optimizer]], optim: OptimConfig) -> None:
        self.optimizers = optimizers  # in the order of the model parts (TrainState.modules)
        self.schedule, self.muon_schedule = optim, muon_schedule(optim)

    @property
    def all(self) -> list[torch.optim.Optimizer]:
        return [opt for part in self.optimizers for opt in part]

    def set_lr(self, step: int, total_steps: int) -> float:
        """The schedule's rates for optimizer step `step` (Muon's its own: `muon_schedule`);
        AdamW's (SGD's) is returned."""
        lr = lr_at(step, self.schedule, total_steps)
        muon_lr = lr_at(step, self.muon_schedule, total_steps)
        for opt in self.all:
            for group in opt.param_groups:
                group["lr"] = muon_lr if isinstance(opt, Muon) else lr
        return lr

    def step(self) -> None:
        for opt in self.all:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.all:
            opt.zero_grad(set_to_none=set_to_none)


def muon_schedule(optim: OptimConfig) -> OptimConfig:
    """The schedule Muon's rate follows: optim's own (warmup, decay), peaking at
    optim.muon.lr, its floor optim.min_lr scaled by the same factor."""
    peak = optim.muon_settings.lr
    return replace(optim, lr=peak, min_lr=optim.min_lr * peak / optim.lr)


def _mixed(module: nn.Module) -> bool:
    """Whether DTensors and plain tensors share the optimizer: a MoE layer under TP without
    FSDP keeps plain parameters beside TP's DTensors (`parallel/tp.py`), and torch's fused and
    multi-tensor kernels refuse the mix in one call."""
    return len({isinstance(p, DTensor) for p in module.parameters()}) > 1


def _optimizers(
    module: nn.Module, optim: OptimConfig, tied: bool, device: torch.device
) -> list[torch.optim.Optimizer]:
    if optim.name != "muon":
        return [_optimizer(module, optim, tied, device)]
    hidden = hidden_matrices(module)
    muon = [Muon(hidden, optim.muon_settings)] if hidden else []
    return [_optimizer(module, optim, tied, device), *muon]


def _optimizer(module: nn.Module, optim: OptimConfig, tied: bool, device: torch.device):
    groups = param_groups([module], optim, tied)
    batched = not _mixed(module)  # else one tensor at a time: the same update
    if optim.name == "sgd":
        return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum, foreach=batched)
    fused = device.type in ("cuda", "cpu") and batched
    return torch.optim.AdamW(
        groups,
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        fused=fused,
        foreach=batched and not fused,
    )


def build_optimizer(
    modules: list[nn.Module], optim: OptimConfig, tied: bool, device: torch.device
) -> Optimizers:
    """The optimizers over `modules`' parameters; the rate is set every step by the loop."""
    return Optimizers([_optimizers(m, optim, tied, device) for m in modules], optim)
