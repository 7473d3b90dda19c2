"""TrainState: everything a resume needs, in one object.

The model's parameters and the optimizer's moments are referenced, not copied; the rest is a
step counter and `consumed_samples` (the samples trained on, which says where the data
sampler goes on, on any data-parallel size). The learning rate is a pure function of the step
and needs no saving. `checkpoint.py` saves and loads this object as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class TrainState:
    modules: list[nn.Module]
    optimizer: torch.optim.Optimizer
    global_batch_size: int
    step: int = 0
    consumed_samples: int = 0

    def advance(self) -> None:
        """One optimizer step done (or skipped) on one global batch."""
        self.step += 1
        self.consumed_samples += self.global_batch_size

    def samples_of(self, step: int) -> tuple[int, int]:
        """The global sample ids [first, end) that step `step` trained on."""
        end = self.consumed_samples - (self.step - step) * self.global_batch_size
        return end - self.global_batch_size, end
