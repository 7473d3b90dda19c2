"""The loss-spike guard (off by default) and the stop on a non-finite loss.

Megatron only detects spikes and torchtitan declined a guard; hp can skip the update of a step
whose loss or gradient norm lies more than `sigma` standard deviations above the mean of the
last `window` steps, or stop the run there. Skipped steps join the history too: were they left
out, a lasting shift of the loss would freeze the history and skip every step after it. The
guard needs the step's values on the host before the optimizer runs, so it costs one device
sync per step while it is on.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import fmean, pstdev

from hp_runtime.train.errors import TrainError


class NonFiniteLoss(TrainError):
    """The loss or the gradient norm is NaN or infinite."""

    everywhere = True  # every rank holds the same reduced values


class SpikeStop(TrainError):
    """A spike with `train.spike_action = 'stop'`."""

    everywhere = True


def check_finite(
    step: int, loss: float, grad_norm: float, samples: tuple[int, int], run_dir: str
) -> None:
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteLoss(
            f"step {step}: loss {loss}, grad norm {grad_norm} (samples {samples[0]} to "
            f"{samples[1] - 1}); stopping. Lower optim.lr, check the data of those samples "
            f"({blame_command(run_dir, step)} lists them), or resume from an earlier checkpoint"
        )


def blame_command(run_dir: str, step: int) -> str:
    """The command that lists a step's samples down to their raw records (`train/blame.py`)."""
    return f"hp-train blame {run_dir} --step {step}"


class SpikeGuard:
    """Judges each step against the recent history of steps."""

    def __init__(self, action: str, window: int, sigma: float) -> None:
        self.action, self.sigma = action, sigma
        self.enabled = action != "off"
        self.losses: deque[float] = deque(maxlen=window)
        self.norms: deque[float] = deque(maxlen=window)

    def _outlier(self, history: deque[float], value: float) -> float | None:
        """How many standard deviations above the mean `value` is, when that is too many."""
        if len(history) < (history.maxlen or 0):
            return None  # not enough history yet
        mean = fmean(history)
        spread = max(pstdev(history, mean), 1e-6 * abs(mean), 1e-12)
        score = (value - mean) / spread
        return score if score > self.sigma else None

    def judge(self, loss: float, grad_norm: float) -> str | None:
        """Why this step is a spike (None if it is not); the step then joins the history."""
        reason = None
        for name, history, value in (
            ("loss", self.losses, loss),
            ("grad norm", self.norms, grad_norm),
        ):
            score = self._outlier(history, value)
            if score is not None and reason is None:
                reason = (
                    f"{name} {value:.4g} is {score:.1f} standard deviations above the mean "
                    f"{fmean(history):.4g} of the last {len(history)} steps"
                )
        self.losses.append(loss)
        self.norms.append(grad_norm)
        return reason
