"""Downstream tasks through lm-evaluation-harness (`hp-runtime[eval]`): the tasks named by
`[eval]` or `hp-train eval --tasks` found and loaded (a name lm-eval does not know, a task file
that does not parse, a metric lm-eval does not have, data that cannot be read: one line each,
before a rank trains), run on `HpLM`, and their results as the flat `eval/TASK/METRIC` values
that metrics.jsonl, TensorBoard and W&B take.

lm-eval seeds Python's, numpy's and torch's generators before it builds requests; inside a
training job the run's own states are put back after (`rng.capture`/`restore`), so a run that
evaluates trains the same samples and losses as one that does not.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hp_runtime.train import rng
from hp_runtime.train.config import paths
from hp_runtime.train.errors import ConfigError
from hp_runtime.train.launch import Runtime, agree

MAX_GEN_TOKS = 256  # lm-eval's tokens to generate where a task names none
PREFIX = "eval/"  # metrics.jsonl's, TensorBoard's and W&B's names: eval/TASK/METRIC
DEFAULT_FILTER = "none"  # lm-eval's name for a metric's unfiltered value: left out of ours


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """lm-eval's info lines and warnings (a dozen a task: defaults it chose) and datasets'
    progress bars kept off the run's output."""
    import datasets

    logger = logging.getLogger("lm_eval")
    level, bars = logger.level, not datasets.are_progress_bars_disabled()
    logger.setLevel(logging.ERROR)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


@dataclass
class Tasks:
    """The tasks to run: lm-eval's names for them and the manager that indexes them."""

    names: list[str]
    manager: Any  # lm_eval.tasks.TaskManager
    generated: dict[str, int] = field(default_factory=dict)  # generation tasks' max_gen_toks

    @classmethod
    def load(cls, tasks: Sequence[str], include: Sequence[str], key: str) -> Tasks:
        """Each task found, its metrics known and its data read, or one `ConfigError` naming
        `key` (`eval.tasks`, `--tasks`). Only the include directories (and task files') are
        indexed where they hold every task: lm-eval's own index takes seconds to build."""
        from lm_eval.tasks import TaskManager

        directories = list(include)
        files = [os.path.abspath(name) for name in tasks if paths.is_task_file(name)]
        directories += sorted({os.path.dirname(file) for file in files})
        with _quiet():
            manager = TaskManager(include_path=directories or None, include_defaults=False)
            names = [_named(manager, name) for name in tasks]
            missing = [g for n, g in zip(names, tasks, strict=True) if n is None]
            if missing and not all(paths.is_task_file(g) for g in missing):
                manager = TaskManager(include_path=directories or None)
                names = [_named(manager, name) for name in tasks]
        found = cls(
            [_known(manager, name, given, key) for name, given in zip(names, tasks, strict=True)],
            manager,
        )
        found.check(key)
        return found

    @classmethod
    def agreed(
        cls, tasks: Sequence[str], include: Sequence[str], key: str, runtime: Runtime
    ) -> Tasks:
        """`load` on every rank, a refusal on any stopping them all (`launch.agree`)."""
        failure, found = None, None
        try:
            found = cls.load(tasks, include, key)
        except ConfigError as exc:
            failure = exc
        agree(failure, runtime)
        assert found is not None
        return found

    def check(self, key: str) -> None:
        """Every task's metrics are lm-eval's own, and every task loads (its data read); what
        each generation task asks to generate is kept for `check_length`."""
        from lm_eval.api.registry import METRIC_REGISTRY

        for name in self.names:
            cfg = getattr(self.manager.task_index.get(name), "cfg", None) or {}
            if "process_results" in cfg:  # the task computes its metrics itself
                continue
            for item in cfg.get("metric_list", []) or []:
                metric = item.get("metric") if isinstance(item, dict) else None
                if (
                    isinstance(metric, str)
                    and metric not in METRIC_REGISTRY
                    and not item.get("hf_evaluate")
                    and "aggregation" not in item  # a metric the task's own code reports
                    and "/" not in metric  # a metric script's path, for HF evaluate
                ):
                    known = ", ".join(sorted(METRIC_REGISTRY))
                    raise ConfigError(
                        f"{key}: task {name!r} asks for metric {metric!r}, which lm-eval does "
                        f"not have ({known})"
                    )
        for name in self.names:
            try:
                with _quiet():
                    loaded = self.manager.load([name])["tasks"]
            except Exception as exc:  # datasets' and lm-eval's own: a missing file, no network
                raise ConfigError(
                    f"{key}: task {name!r} cannot be loaded: {_first_line(exc)}"
                ) from None
            for task_name, task in loaded.items():
                if getattr(task, "OUTPUT_TYPE", None) == "generate_until":
                    settings = dict(getattr(task.config, "generation_kwargs", None) or {})
                    self.generated[task_name] = int(settings.get("max_gen_toks", MAX_GEN_TOKS))

    def check_length(self, length: int, key: str) -> None:
        """A generation task leaves room for a context in the model's `length` positions."""
        for name, count in self.generated.items():
            if count >= length:
                raise ConfigError(
                    f"{key}: task {name!r} generates up to {count} tokens (max_gen_toks), the "
                    f"model has {length} positions: lower max_gen_toks in its YAML"
                )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _named(manager: Any, name: str) -> str | None:
    """lm-eval's name for an entry of `tasks`: a task file's own `task:`, or the name given;
    None where `manager` does not index it."""
    if paths.is_task_file(name):
        wanted = os.path.realpath(name)
        for task, entry in manager.task_index.items():
            where = getattr(entry, "yaml_path", None)
            if where is not None and os.path.realpath(where) == wanted:
                return task
        return None
    return name if name in manager.all_tasks else None


def _known(manager: Any, name: str | None, given: str, key: str) -> str:
    if name is not None:
        return name
    if paths.is_task_file(given):
        raise ConfigError(
            f"{key}: {given} is not a task lm-eval can read (it does not parse as YAML, or "
            "names no task:)"
        )
    close = difflib.get_close_matches(given, manager.all_tasks, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(
        f"{key}: no task {given!r} in lm-eval or the include directories{hint}; "
        "`lm-eval ls tasks` lists lm-eval's"
    )


def run(
    lm: Any, tasks: Tasks, limit: int | None, bootstrap_iters: int, device: torch.device
) -> dict[str, Any]:
    """lm-eval's results of `tasks` on `lm` (its own JSON's fields), the caller's random
    states as they were."""
    from lm_eval import evaluator

    states = rng.capture(device)
    try:
        with _quiet():
            return evaluator.simple_evaluate(
                model=lm,
                tasks=list(tasks.names),
                task_manager=tasks.manager,
                limit=limit,
                bootstrap_iters=bootstrap_iters,
                log_samples=False,
            )
    finally:
        rng.restore(states, device)


def flat(results: dict[str, Any]) -> dict[str, float]:
    """`eval/TASK/METRIC` (`METRIC,FILTER` for a filter other than lm-eval's "none") for
    every number of every task and group in `results`."""
    out: dict[str, float] = {}
    for task, values in results.get("results", {}).items():
        for name, value in values.items():
            if not isinstance(value, int | float) or isinstance(value, bool) or "," not in name:
                continue
            metric, _, kind = name.partition(",")
            label = metric if kind == DEFAULT_FILTER else name
            out[f"{PREFIX}{task}/{label}"] = float(value)
    return out


@dataclass
class Downstream:
    """`[eval]` inside a training job: the run's own model (no second copy of its weights) as
    lm-eval's model, and the tasks loaded before the first step."""

    lm: Any  # HpLM
    tasks: Tasks
    limit: int | None
    device: torch.device

    def __call__(self) -> dict[str, float]:
        """The `eval/TASK/METRIC` values now (no bootstrapped standard errors: their
        100,000 resamples would cost more than the forwards)."""
        results = run(self.lm, self.tasks, self.limit, 0, self.device)
        return flat(results or {})  # lm-eval returns None where LOCAL_RANK is not 0
