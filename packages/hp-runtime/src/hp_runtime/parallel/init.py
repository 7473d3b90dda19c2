"""Initialisation that does not depend on the layout: every rank computes each parameter's
full tensor (the model's own rule, `initial_tensor`) and keeps its local shard, so every
layout starts from the parameters of one process."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from hp_runtime.model import Transformer, initial_tensor
from hp_runtime.parallel.parallelize import canonical_name


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy `full`, the whole tensor, into `param`: into its local shard when it is a DTensor
    (every rank holds `full`; the shard is cut by the parameter's own placements)."""
    if isinstance(param, DTensor):
        full = distribute_tensor(full, param.device_mesh, param.placements).to_local()
        param = param.to_local()
    param.copy_(full)


@torch.no_grad()
def init_weights(model: Transformer, seed: int) -> None:
    """Initialise every parameter of `model` (a Transformer or a pipeline stage of one,
    parallelised or not, materialised) from `seed`, and recompute its buffers."""
    model.tie_weights()  # materialising on a device unties them
    for name, param in model.named_parameters():
        copy_full_(param, initial_tensor(model.config, canonical_name(name), param.shape, seed))
    # The buffers that are state (the MoE bias), by canonical name: activation checkpointing's
    # wrapper leaves its prefix out of the state dict's keys, not out of named_buffers'.
    state = {canonical_name(key) for key in model.state_dict(keep_vars=True)}
    for name, buffer in model.named_buffers():
        if canonical_name(name) in state:
            copy_full_(buffer, initial_tensor(model.config, canonical_name(name), buffer.shape, 0))
    model.reset_buffers()
