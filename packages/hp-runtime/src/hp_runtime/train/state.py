"""TrainState: everything a resume needs, in one object.

The model's parameters and the optimizer's moments are referenced, not copied; the rest is a
step counter and `consumed_samples` (the samples trained on, which says where the data
sampler goes on, on any data-parallel size). The learning rate is a pure function of the step
and needs no saving. `checkpoint.py` saves this object as it is, `checkpoint_load.py` loads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hp_runtime.train.batch import BatchPlan
from hp_runtime.train.guard import SpikeGuard
from hp_runtime.train.optim import Optimizers


@dataclass
class TrainState:
    modules: list[nn.Module]
    optimizer: Optimizers
    plan: BatchPlan  # each step's global batch (`train.batch_ramp` grows it)
    guard: SpikeGuard
    step: int = 0
    consumed_samples: int = 0
    # With `[[data.phases]]`: (step, samples) -> the phases begun and each corpus stream's
    # consumed count (`PhasePlan.state_at`), saved as meta's "mixture", compared on resume.
    mixture: Callable[[int, int], dict[str, Any]] | None = None
    # With `parallel.fault_tolerance`: [group, first step, last step], each run of steps a
    # replica group was missing from and left its share of the batch untrained (replicas.py).
    untrained: list[list[int]] = field(default_factory=list)

    def scalars(self) -> dict[str, Any]:
        """What is saved beside the tensors (the same on every rank)."""
        return {
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "global_batch_size": self.plan.global_batch_size,
            "guard": {"losses": list(self.guard.losses), "norms": list(self.guard.norms)},
            **(
                {}
                if self.mixture is None
                else {"mixture": self.mixture(self.step, self.consumed_samples)}
            ),
            **({"untrained": [list(run) for run in self.untrained]} if self.untrained else {}),
        }

    def load_scalars(self, saved: dict[str, Any]) -> None:
        self.step, self.consumed_samples = saved["step"], saved["consumed_samples"]
        self.guard.losses.clear()
        self.guard.norms.clear()
        self.guard.losses.extend(saved["guard"]["losses"])
        self.guard.norms.extend(saved["guard"]["norms"])
        self.untrained = [list(run) for run in saved.get("untrained", [])]

    def leave_untrained(self, group: int, step: int) -> None:
        """Replica group `group` was missing from step `step` (steps come in order)."""
        for run in reversed(self.untrained):
            if run[0] == group:
                if run[2] == step - 1:
                    run[2] = step
                    return
                break
        self.untrained.append([group, step, step])

    def advance(self) -> None:
        """One optimizer step done (or skipped) on one global batch."""
        self.step += 1
        self.consumed_samples += self.plan.global_batch_at(self.step)

    def samples_of(self, step: int) -> tuple[int, int]:
        """The global sample ids [first, end) that step `step` trained on."""
        end = self.consumed_samples - (
            self.plan.samples_after(self.step) - self.plan.samples_after(step)
        )
        return end - self.plan.global_batch_at(step), end
