"""Replica groups that drop out and heal without a restart (`parallel.fault_tolerance`, torchft).

Each group is one torchrun job holding a whole copy of the model; torchft's lighthouse says,
step by step, which groups are in the quorum. Within a step the rule is fixed, so the samples
every step trained stay known:

- group g always trains the same share of a step's global batch: the data-parallel ranks
  g x dp .. (g + 1) x dp - 1 of the groups x dp that `batch_plan` counts, i.e. in each global
  micro-batch the samples [g x dp x mbs, (g + 1) x dp x mbs);
- the gradients (and the logged loss) are averaged over the groups in the step's quorum;
- a group missing from a step leaves its share untrained: every group that committed the step
  writes a `replicas` record naming the groups present, the missing ones and the sample ranges
  they would have trained (`skipped`);
- a step whose reduction fails (a group died during it) is trained again, on the same samples,
  with the groups left: no update is ever applied from a partial reduction;
- a group that (re)joins behind its peers receives their model, optimizer and step from a
  healthy one over torchft's checkpoint transport (no checkpoint is read) and goes on from
  their next step; a fresh run waits for every group before its first step.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hp_runtime.parallel.options import FaultTolerance
from hp_runtime.train.errors import TrainError
from hp_runtime.train.launch import Runtime
from hp_runtime.train.state import TrainState

KEY = "parallel.fault_tolerance"


def lighthouse_url(ft: FaultTolerance) -> str:
    """The lighthouse's URL: the key's, else $TORCHFT_LIGHTHOUSE (torchft's own variable)."""
    url = ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not url:
        raise TrainError(
            f"{KEY}.lighthouse: not set, and $TORCHFT_LIGHTHOUSE is empty: give the URL "
            "torchft_lighthouse printed (http://HOST:PORT)"
        )
    return url


def skipped_ranges(
    first: int, micro_batches: int, micro_batch_size: int, dp_size: int, groups: int, group: int
) -> list[list[int]]:
    """The sample ranges [start, end) that group `group` trains in a step whose samples start
    at `first` (`micro_batches` global micro-batches of `micro_batch_size` x `dp_size`
    samples, the groups' ranks in order): what the step leaves untrained if it is missing."""
    per_group = dp_size // groups * micro_batch_size
    wide = micro_batch_size * dp_size
    starts = [first + j * wide + group * per_group for j in range(micro_batches)]
    return [[start, start + per_group] for start in starts]


class Replicas:
    """This job's place among the replica groups: torchft's `Manager` on each rank, driven
    once a step (`average`), and the join at the start (`join`)."""

    def __init__(self, ft: FaultTolerance, runtime: Runtime, state: TrainState) -> None:
        self.ft, self.runtime, self.state = ft, runtime, state
        self.healed_from: int | None = None  # the step a healing brought this group to
        self.present: list[int] = []  # the groups in the last committed step
        self.committed = time.monotonic()  # when a step last committed
        self.ready = False  # a quorum formed (by `join`) that the next step's reduction uses
        url = lighthouse_url(ft)
        if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            raise TrainError(f"{KEY}: launch each replica group with torchrun (one job a group)")
        os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum
        _one_line_logs()
        from torchft import Manager, ProcessGroupGloo

        timeout = timedelta(seconds=ft.quorum_timeout_s)
        if runtime.device.type == "cuda":
            from torchft import ProcessGroupNCCL

            group = ProcessGroupNCCL(timeout=timeout)
        else:
            group = ProcessGroupGloo(timeout=timeout)
        try:
            self.manager = Manager(
                pg=group,
                load_state_dict=self._load,
                state_dict=self._state_dict,
                min_replica_size=ft.min_replicas,
                use_async_quorum=False,  # a joining group heals before its first step
                init_sync=False,  # every group builds the same weights from train.seed
                timeout=timeout,
                quorum_timeout=timeout,
                connect_timeout=timeout,
                rank=runtime.rank,
                world_size=runtime.world_size,
                lighthouse_addr=url,
                replica_id=f"hp_group_{ft.replica_group}",
            )
        except Exception as exc:  # torchft's client: a RuntimeError with the gRPC status
            raise TrainError(
                f"{KEY}.lighthouse {url}: cannot reach it ({_first_line(exc)})"
            ) from None
        self.mine = torch.zeros(ft.groups, device=runtime.device)
        self.mine[ft.replica_group] = 1.0

    def _state_dict(self) -> dict[str, Any]:
        """What a healing peer receives: this rank's tensors as it holds them (a DTensor's
        local shard: the same rank of every group holds the same shard), and the scalars."""
        state = self.state
        return {
            "modules": [_local(m.state_dict()) for m in state.modules],
            "optimizers": [_local(o.state_dict()) for o in state.optimizer.all],
            "scalars": state.scalars(),
        }

    def _load(self, saved: dict[str, Any]) -> None:
        state = self.state
        with torch.no_grad():
            for module, tensors in zip(state.modules, saved["modules"], strict=True):
                for name, target in module.state_dict().items():
                    _shard(target).copy_(tensors[name])
        for optimizer, tensors in zip(state.optimizer.all, saved["optimizers"], strict=True):
            optimizer.load_state_dict(_as_params(optimizer, tensors))
        state.load_scalars(saved["scalars"])
        self.healed_from = state.step

    def _quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except Exception as exc:
            raise TrainError(
                f"{KEY}: no quorum of replica groups within quorum_timeout_s = "
                f"{self.ft.quorum_timeout_s:g} s ({_first_line(exc)}); is the lighthouse up, "
                "and are at least its min_replicas groups running?"
            ) from None

    def join(self) -> bool:
        """The first quorum: a group behind its peers heals from one (True); a fresh run waits
        until every group is in, so that each trains its share from the first step."""
        deadline = time.monotonic() + self.ft.quorum_timeout_s
        while True:
            self._quorum()
            self.ready = True  # the peers in it reduce this group's first step with it
            if self.healed_from is not None and self.healed_from > 0:
                return True
            if self.state.step > 0 or self.manager.num_participants() >= self.ft.groups:
                return False
            if time.monotonic() > deadline:
                raise TrainError(
                    f"{KEY}: {self.manager.num_participants()} of groups = {self.ft.groups} "
                    f"joined within quorum_timeout_s = {self.ft.quorum_timeout_s:g} s; a fresh "
                    "run starts with every group: start each group's torchrun job"
                )
            time.sleep(0.05)

    def average(self, loss: torch.Tensor, modules: list[nn.Module]) -> torch.Tensor | None:
        """The step's gradients (in place) and loss averaged over the groups of a new quorum;
        None when the step did not commit (a group failed during it, or fewer than
        min_replicas are in): the caller trains it again, on the same samples."""
        if not self.ready:
            self._quorum()
        self.ready = False
        works = [self.manager.allreduce(grad) for grad in _local_grads(modules)]
        packed = torch.cat([loss.detach().float().view(1), self.mine])
        works.append(self.manager.allreduce(packed, reduce_op=torch.distributed.ReduceOp.SUM))
        for work in works:
            work.wait()
        if self.manager.should_commit():
            self.committed = time.monotonic()
            counts = packed[1:].tolist()  # should_commit has synced with the host already
            twice = [g for g, n in enumerate(counts) if n > 1.5]
            if twice:  # two jobs would train one share twice and record another as missed
                raise TrainError(
                    f"{KEY}.replica_group = {twice[0]}: {int(counts[twice[0]] + 0.5)} jobs "
                    "run as this group; give each torchrun job its own replica_group"
                )
            self.present = [g for g, n in enumerate(counts) if n > 0.5]
            return packed[0] / max(len(self.present), 1)
        if time.monotonic() - self.committed > self.ft.quorum_timeout_s:
            raise TrainError(
                f"{KEY}.min_replicas = {self.ft.min_replicas}: no step committed for more than "
                f"quorum_timeout_s = {self.ft.quorum_timeout_s:g} s (last quorum: "
                f"{self.manager.num_participants()} group(s)); start the missing groups"
            )
        return None

    def saves(self) -> bool:
        """Whether this group writes the periodic checkpoints: the lowest group in the last
        committed step (one group for all; each writes its own at its end or a stop). A
        group restarted from an older one of its own heals forward from the peer."""
        return bool(self.present) and self.present[0] == self.ft.replica_group

    def account(self, step: int, first: int, micro_batches: int, mbs: int, dp: int) -> dict | None:
        """A committed step's account: each missing group noted in the state (it goes into the
        checkpoint and to a healing peer) and the `replicas` record (None: every group in)."""
        missing = [g for g in range(self.ft.groups) if g not in self.present]
        if not missing:
            return None
        groups = self.ft.groups
        skipped = [
            r for g in missing for r in skipped_ranges(first, micro_batches, mbs, dp, groups, g)
        ]
        for group in missing:
            self.state.leave_untrained(group, step)
        return {
            "kind": "replicas",
            "step": step,
            "groups": self.present,
            "missing": missing,
            "skipped": skipped,
            "skipped_samples": sum(end - start for start, end in skipped),
        }

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def _shard(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local(tree: Any) -> Any:
    """`tree` (a state dict) with each DTensor as this rank's shard of it."""
    if isinstance(tree, dict):
        return {key: _local(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_local(value) for value in tree)
    return _shard(tree) if isinstance(tree, torch.Tensor) else tree


def _as_params(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict of local shards (`_local`) with each parameter-shaped state
    a DTensor again, laid out as its parameter (a fresh optimizer has no state to copy into)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in saved["state"].items():
        param = params[int(index)]
        if not isinstance(param, DTensor):
            continue
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.shape == param.to_local().shape:
                entry[key] = DTensor.from_local(
                    value.to(param.device),
                    param.device_mesh,
                    param.placements,
                    run_check=False,
                    shape=param.shape,
                    stride=param.stride(),
                )
    return saved


def _local_grads(modules: list[nn.Module]) -> list[torch.Tensor]:
    """Each parameter's gradient as this rank holds it (a DTensor's local shard): the same
    rank of every group holds the same shard, so torchft reduces them pairwise."""
    grads = []
    for module in modules:
        for param in module.parameters():
            if param.grad is not None:
                grads.append(_shard(param.grad))
    return grads


class _FirstLine(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"torchft: {record.getMessage().strip().splitlines()[0]}"


def _one_line_logs() -> None:
    """torchft's warnings and errors (a peer lost, a commit refused) as one line each, not
    with the traceback of the collective that saw it: what hp does about them is its own
    line (`average`, `join`)."""
    logger = logging.getLogger("torchft")
    if not any(isinstance(h.formatter, _FirstLine) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(_FirstLine())
        handler.setLevel(logging.WARNING)
        logger.addHandler(handler)
        logger.propagate = False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
