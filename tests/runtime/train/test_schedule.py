"""The learning-rate schedule as a pure function of the step, against hand-computed values."""

from __future__ import annotations

import math

import pytest
from hp_runtime.train.config import OptimConfig
from hp_runtime.train.schedule import lr_at


def _optim(**fields) -> OptimConfig:
    return OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, **fields)


def test_linear_warmup_then_cosine_to_min():
    optim = _optim(decay_style="cosine")
    assert lr_at(1, optim, 110) == pytest.approx(0.1)
    assert lr_at(5, optim, 110) == pytest.approx(0.5)
    assert lr_at(10, optim, 110) == pytest.approx(1.0)
    # halfway through the 100 decay steps the cosine is at the mean of lr and min_lr
    assert lr_at(60, optim, 110) == pytest.approx(0.55)
    assert lr_at(35, optim, 110) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(110, optim, 110) == pytest.approx(0.1)
    assert lr_at(500, optim, 110) == pytest.approx(0.1)  # stays at the floor


def test_linear_and_constant():
    assert lr_at(60, _optim(decay_style="linear"), 110) == pytest.approx(0.55)
    assert lr_at(85, _optim(decay_style="linear"), 110) == pytest.approx(1 - 0.9 * 0.75)
    assert lr_at(90, _optim(decay_style="constant"), 110) == 1.0
    assert lr_at(3, _optim(decay_style="constant"), 110) == pytest.approx(0.3)


def test_warmup_stable_decay():
    # 100 decay steps, the last 20% (steps 91..110) decay
    optim = _optim(decay_style="wsd", wsd_decay_fraction=0.2)
    assert lr_at(11, optim, 110) == 1.0
    assert lr_at(90, optim, 110) == 1.0
    assert lr_at(100, optim, 110) == pytest.approx(1 - 0.9 * 0.5)
    assert lr_at(110, optim, 110) == pytest.approx(0.1)
    sqrt = _optim(decay_style="wsd", wsd_decay_fraction=0.2, wsd_decay_shape="sqrt")
    assert lr_at(100, sqrt, 110) == pytest.approx(1 - 0.9 * math.sqrt(0.5))
    cosine = _optim(decay_style="wsd", wsd_decay_fraction=0.2, wsd_decay_shape="cosine")
    assert lr_at(100, cosine, 110) == pytest.approx(0.55)


def test_explicit_decay_steps_and_no_warmup():
    optim = OptimConfig(lr=2.0, min_lr=0.0, warmup_steps=0, decay_style="linear", decay_steps=4)
    assert [lr_at(s, optim, 100) for s in range(1, 7)] == pytest.approx([1.5, 1.0, 0.5, 0, 0, 0])
