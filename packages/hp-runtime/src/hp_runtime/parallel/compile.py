"""Per-block `torch.compile`: each block compiled on its own (all blocks share the code, so
inductor compiles once and reuses it), applied after TP and AC and before FSDP."""

from __future__ import annotations

import torch
from torch import nn

# What the compiled wrapper (torch's OptimizedModule) adds to the names of the parameters
# inside (`parallelize.canonical_name`).
COMPILE_NAME_PREFIX = "_orig_mod."


def apply_compile(model: nn.Module) -> None:
    """Replace every block of `model.layers` with its compiled version, in place."""
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=True)
