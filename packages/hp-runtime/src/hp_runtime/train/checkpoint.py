"""Checkpoints that resume exactly, on any layout: DCP for the tensors, an atomic commit.

A checkpoint of step N is written into `RUN_DIR/checkpoints/.tmp-step-000000N` by every rank
(DCP shards of the model and optimizer, keyed by parameter names, so any layout can load them;
each rank's RNG states in `extra/`; `meta.json` from rank 0 with the step, `consumed_samples`,
the run's id, the resolved config and the data's identity, stored as "fingerprint") and
committed by one rename to `step-000000N` once every rank's writes are done. A directory that
was never renamed is never loaded and is removed at the next start; older checkpoints of the
same run beyond `checkpoint.keep` are deleted only after a newer one is committed. Every file
carries a checksum taken while it was written and checked while it is read (`storage.py`);
nothing in a checkpoint is unpickled beyond plain data.

A run directory holds one run. `checkpoint.resume = "auto"` continues it; `"none"` starts
fresh only where no checkpoint is yet; an explicit path seeds a run directory that has no
checkpoints of its own (once it has, the same command continues from them: "run the same
command to resume" stays true).

With `checkpoint.async` the tensors are copied to host memory and written by a background
thread (`dcp.async_save`, over a gloo group of its own so its collectives never interleave with
training's); the commit happens at the first step boundary after the write finished.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
import tomllib
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from hp_data.errors import first_line
from hp_data.format.commit import fsync_path
from hp_data.phases import state_change
from hp_data.redact import redact_data
from hp_data.registry import same_samples
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hp_runtime.model import ModelConfig, Transformer
from hp_runtime.train import rng, storage
from hp_runtime.train.batch import BatchPlan
from hp_runtime.train.config import BatchRamp, CheckpointConfig, Config, as_table, toml_value
from hp_runtime.train.errors import TrainError
from hp_runtime.train.launch import Runtime, agree
from hp_runtime.train.state import TrainState

CHECKPOINTS = "checkpoints"
PREFIX = "step-"
TMP = ".tmp-"
META = "meta.json"
METADATA_KEY = "dcp_metadata_xxh3"  # meta.json's checksum of DCP's .metadata
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# The data keys a checkpoint records and a resume compares (stored redacted: `redact_data`).
DATA_KEYS = ("type", "path", "valid_path", "split", "seed", "seq_length")
# Fields that change nothing a checkpoint holds, so a resume may change them: the init, and
# the attention kernel (every one computes the same rule; a GPU run's `flex` resumes on CPU).
INIT_ONLY = {"init_std", "attention"}
# model.moe's fields a resume may change: the balancing's rates (the bias the checkpoint holds
# goes on from where it is); every other field shapes or routes the model.
MOE_MAY_CHANGE = {"aux_loss_coef", "bias_update_rate"}
TABLES = ("rope_scaling", "moe")  # the model's table keys, compared as config.toml writes them


class CheckpointError(TrainError):
    """A checkpoint that cannot be read (`fallback`: an older one may do), or one this run
    does not fit (the user decides)."""

    def __init__(self, message: str, fallback: bool = True) -> None:
        super().__init__(message)
        self.fallback = fallback


class SaveFailed(TrainError):
    """A save that could not be written."""

    def __init__(self, message: str, everywhere: bool) -> None:
        super().__init__(message)
        self.everywhere = everywhere  # DCP's failures reach every rank; a rank's own file not


def step_name(step: int) -> str:
    return f"{PREFIX}{step:07d}"


def committed(root: str) -> list[str]:
    """Committed checkpoint directories under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    names = sorted(
        n for n in os.listdir(root) if n.startswith(PREFIX) and n[len(PREFIX) :].isdigit()
    )
    return [os.path.join(root, n) for n in names if os.path.isdir(os.path.join(root, n))]


# meta.json's fields and their types: a file that parses but is not a checkpoint's is damage.
_META_FIELDS: dict[str, type | tuple[type, ...]] = {
    "step": int,
    "consumed_samples": int,
    "global_batch_size": int,
    "world_size": int,
    "config": str,
    "data": dict,
    "guard": dict,
}


def read_meta(path: str) -> dict[str, Any]:
    """A checkpoint's `meta.json`, checked field by field (damage is a fallback error)."""
    file = os.path.join(path, META)
    try:
        meta = storage.read_json(file, checked=False)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing; {path} is not a hp-train checkpoint") from None
    except (OSError, storage.Damaged) as exc:
        reason = str(exc) if isinstance(exc, storage.Damaged) else f"{file}: {exc}"
        raise CheckpointError(reason) from None
    for key, kind in _META_FIELDS.items():
        value = meta.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointError(f"{file}: field {key!r} is {value!r}, not a {kind.__name__}")
        if kind is int and value < (1 if key in ("global_batch_size", "world_size") else 0):
            raise CheckpointError(f"{file}: field {key!r} is {value}")
    data, guard = meta["data"], meta["guard"]
    if not (isinstance(data.get("config"), dict) and isinstance(data.get("fingerprint"), dict)):
        raise CheckpointError(f"{file}: field 'data' lacks its config or fingerprint")
    for key in ("losses", "norms"):
        values = guard.get(key)
        if not isinstance(values, list) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in values
        ):
            raise CheckpointError(f"{file}: field 'guard.{key}' is not a list of numbers")
    if not isinstance(meta.get("run_id", ""), str):
        raise CheckpointError(f"{file}: field 'run_id' is not a string")
    mixture = meta.get("mixture", {})  # with data.phases: phases begun, per-stream counts
    if not (
        isinstance(mixture, dict)
        and isinstance(mixture.get("phases", []), list)
        and isinstance(mixture.get("streams", []), list)
        and all(isinstance(p, dict) for p in mixture.get("phases", []) + mixture.get("streams", []))
    ):
        raise CheckpointError(f"{file}: field 'mixture' is not the phases and streams of a run")
    try:
        saved = tomllib.loads(meta["config"])
    except tomllib.TOMLDecodeError as exc:
        raise CheckpointError(f"{file}: field 'config' is not the run's TOML ({exc})") from None
    if not isinstance(saved.get("model"), dict):
        raise CheckpointError(f"{file}: field 'config' has no [model] table")
    return meta


def saved_section(meta: dict[str, Any], name: str) -> dict[str, Any]:
    """A table (`model`, `optim`, ...) of the config a checkpoint was written with."""
    return tomllib.loads(meta["config"]).get(name, {})


def saved_model(meta: dict[str, Any]) -> dict[str, Any]:
    """The [model] table of the config a checkpoint was written with."""
    return saved_section(meta, "model")


def first_change(
    meta: dict[str, Any], name: str, current: Any, keys: Iterable[str]
) -> tuple[str, Any, Any] | None:
    """The first of `keys` whose value in `current` (a config section) differs from the
    checkpoint's [name] table: (key, value now, value saved). A key the checkpoint does not
    record (written by an older hp) is not compared."""
    saved = saved_section(meta, name)
    for key in keys:
        if key in saved and saved[key] != getattr(current, key):
            return key, getattr(current, key), saved[key]
    return None


def tensors(state: TrainState) -> dict[str, dict[str, Any]]:
    """The model's and optimizer's tensors by parameter name (this rank's shards), merged over
    the model parts a pipeline rank holds."""
    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    for module, opt in zip(state.modules, state.optimizer.optimizers, strict=True):
        model.update(get_model_state_dict(module, options=OPTIONS))
        optim.update(get_optimizer_state_dict(module, opt, options=OPTIONS))
    return {"model": model, "optim": optim}


def _apply(state: TrainState, loaded: dict[str, dict[str, Any]]) -> None:
    for module, opt in zip(state.modules, state.optimizer.optimizers, strict=True):
        own_model = get_model_state_dict(module, options=OPTIONS)
        set_model_state_dict(module, {k: loaded["model"][k] for k in own_model}, options=OPTIONS)
        own_optim = get_optimizer_state_dict(module, opt, options=OPTIONS)
        set_optimizer_state_dict(
            module, opt, {k: loaded["optim"][k] for k in own_optim}, options=OPTIONS
        )


def seal(tmp: str) -> None:
    """Record the checksum of DCP's `.metadata` (written last, by DCP) in `meta.json`, so that
    every file of the checkpoint is covered before it is committed."""
    file = os.path.join(tmp, META)
    meta = storage.read_json(file)
    meta[METADATA_KEY] = storage.file_digest(os.path.join(tmp, ".metadata"))
    storage.write_json(file + ".tmp", meta)
    os.replace(file + ".tmp", file)


def _metadata(path: str, meta: dict[str, Any]) -> Any:
    """DCP's metadata of `path`, its checksum checked against `meta` first (when recorded)."""
    try:
        if METADATA_KEY in meta:
            found = storage.file_digest(os.path.join(path, ".metadata"))
            if found != meta[METADATA_KEY]:
                raise CheckpointError(f"{path}/.metadata: fails its checksum")
        return storage.CheckedReader(path).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"{path}/.metadata: missing") from None
    except storage.Damaged as exc:
        raise CheckpointError(str(exc)) from None
    except OSError as exc:
        raise CheckpointError(f"{path}/.metadata: unreadable ({exc.strerror})") from None


def check_files(path: str, metadata: Any) -> None:
    """Name a data file that is missing or shorter than `metadata` (DCP's, of `path`) says (a
    checkpoint cut by a crash or a full disk), before DCP fails somewhere inside it."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise CheckpointError(f"{file}: missing")
        if os.path.getsize(file) < size:
            raise CheckpointError(f"{file}: truncated ({os.path.getsize(file)} of {size} bytes)")


def checked_metadata(path: str, meta: dict[str, Any]) -> Any:
    """DCP's metadata of a checkpoint, its checksum and its shard files' sizes checked."""
    metadata = _metadata(path, meta)
    check_files(path, metadata)
    return metadata


def check_model(path: str, meta: dict[str, Any], config: ModelConfig) -> None:
    """Refuse a checkpoint of another model before any tensor is read: the resolved model
    config first (every field that shapes or means something), naming what differs."""
    keys = [item.name for item in fields(ModelConfig) if item.name not in {*INIT_ONLY, *TABLES}]
    change = first_change(meta, "model", config, keys)
    if change is not None:
        key, have, saved = change[0], repr(change[1]), repr(change[2])
    else:
        table = _table_change(meta, config)
        if table is None:
            return
        key, have, saved = table
    raise CheckpointError(
        f"model.{key} = {have}, but {path} was trained with {saved}: a checkpoint "
        f"resumes only the model that wrote it; set model.{key} = {saved} (or export it "
        f"and start a new train.run_dir with model.init_from)",
        fallback=False,
    )


def _table_change(meta: dict[str, Any], config: ModelConfig) -> tuple[str, str, str] | None:
    """The first table key that differs from the checkpoint's: (key, value now, value saved)
    as config.toml writes them. Absent is none: a comment where the preset has none, or an hp
    before the key."""
    for key in TABLES:
        then = saved_model(meta).get(key, "none")
        value = getattr(config, key)
        now = "none" if value is None else as_table(value)
        free = MOE_MAY_CHANGE if key == "moe" else set()
        if _without(then, free) != _without(now, free):
            return key, toml_value(now), toml_value(then)
    return None


def _without(table: Any, names: set[str]) -> Any:
    """A table (or "none") without the fields `names`."""
    return {k: v for k, v in table.items() if k not in names} if isinstance(table, dict) else table


# What the optimizer's state was built with; the schedule keys (lr, warmup, decay) may change.
OPTIMIZER_KEYS = ("name", "weight_decay", "decay_embeddings", "beta1", "beta2", "eps", "momentum")


def check_optimizer(path: str, meta: dict[str, Any], config: Config) -> None:
    """Refuse a resume whose optimizer differs from the checkpoint's: its saved hyperparameters
    would silently win over the config (or another optimizer's state would not load)."""
    change = first_change(meta, "optim", config.optim, OPTIMIZER_KEYS)
    if change is not None:
        key, have, saved = change
        raise CheckpointError(
            f"optim.{key} = {have!r}, but {path} was trained with {saved!r}: set it back to "
            f"resume (the schedule's keys, optim.lr, min_lr, warmup and decay, may change)",
            fallback=False,
        )


def check_tensors(path: str, metadata: Any, config: ModelConfig) -> None:
    """The checkpoint's model tensors must be exactly the model's, by name and global shape:
    a tensor missing from either side is refused by name, never skipped."""
    with torch.device("meta"):
        expected = {n: tuple(t.shape) for n, t in Transformer(config).state_dict().items()}
    saved = {
        key[len("model.") :]: tuple(getattr(value, "size", ()))
        for key, value in metadata.state_dict_metadata.items()
        if key.startswith("model.")
    }
    missing = sorted(set(expected) - set(saved))
    extra = sorted(set(saved) - set(expected))
    if missing or extra:
        parts = [f"has no {', '.join(missing)}"] if missing else []
        parts += [f"has {', '.join(extra)}, which this model does not"] if extra else []
        raise CheckpointError(f"{path}: {'; '.join(parts)}: the model changed", fallback=False)
    for name, shape in expected.items():
        if saved[name] != shape:
            raise CheckpointError(
                f"{path}: parameter {name} has shape {list(saved[name])} in the checkpoint but "
                f"{list(shape)} in this model: the model changed",
                fallback=False,
            )


@dataclass
class Pending:
    step: int
    future: Future
    tmp: str
    started: float
    nbytes: int


@dataclass(frozen=True)
class Saved:
    """A committed checkpoint, for the log."""

    step: int
    path: str
    seconds: float
    background: bool


def _nbytes(payload: dict[str, dict[str, Any]]) -> int:
    """This rank's bytes in `payload` (a DTensor counts its local shard)."""
    total = 0
    for part in payload.values():
        for value in part.values():
            local = value.to_local() if hasattr(value, "to_local") else value
            if isinstance(local, torch.Tensor):
                total += local.numel() * local.element_size()
    return total


def _no_space(exc: BaseException) -> bool:
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        for inner in (getattr(current, "failures", None) or {}).values():
            todo.append(inner[0] if isinstance(inner, tuple) else inner)
        todo += [e for e in (current.__cause__, current.__context__) if e is not None]
    return "No space left on device" in str(exc)


class Checkpointer:
    """Saves and finds this run's checkpoints (every rank holds one; rank 0 commits)."""

    def __init__(
        self, run_dir: str, config: CheckpointConfig, runtime: Runtime, identity: str = ""
    ) -> None:
        self.root = os.path.join(run_dir, CHECKPOINTS)
        self.config, self.runtime = config, runtime
        self.pending: Pending | None = None
        self.last_save_seconds = 0.0
        # The run's id, in every checkpoint it writes: `keep` prunes only these. A fresh or a
        # seeded run's is a hash of where it runs and its resolved config (`identity`), so the
        # same run started twice writes the same bytes; a resumed run keeps the one it had.
        where = os.path.abspath(run_dir) + "\0" + identity
        self.run_id = xxhash.xxh3_64_hexdigest(where.encode())
        self.done: list[Saved] = []  # committed, not yet logged
        self.failure: SaveFailed | None = None  # a background save's, until `finish`
        # A group of its own for the background writes (created by every rank, in order).
        self.group = dist.new_group(backend="gloo") if config.async_save else None

    def clean(self) -> None:
        """Remove what a killed run left uncommitted (rank 0), before anyone saves."""
        if self.runtime.is_main and os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if name.startswith(TMP):
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        dist.barrier()

    def adopt(self, meta: dict[str, Any]) -> None:
        """Continue the run that wrote `meta` (a checkpoint of this run directory)."""
        if meta.get("run_id"):
            self.run_id = meta["run_id"]

    def save(self, state: TrainState, meta: dict[str, Any], block: bool = False) -> None:
        """Checkpoint `state`; asynchronous when configured unless `block`. What is committed
        (now, or by a later `poll`) is handed out by `take`. Every rank calls it."""
        self.finish()  # one save in flight at a time
        start = time.perf_counter()
        tmp = os.path.join(self.root, TMP + step_name(state.step))
        payload = tensors(state)
        nbytes = _nbytes(payload)
        failure: BaseException | None = None
        try:
            os.makedirs(os.path.join(tmp, "extra"), exist_ok=True)
            storage.write_json(
                os.path.join(tmp, "extra", f"rank-{self.runtime.rank:05d}.json"),
                rng.capture(self.runtime.device),
            )
            if self.runtime.is_main:
                storage.write_json(
                    os.path.join(tmp, META),
                    {
                        **meta,
                        **state.scalars(),
                        "world_size": self.runtime.world_size,
                        "run_id": self.run_id,
                    },
                )
        except OSError as exc:
            failure = exc
        try:
            agree(self._failed(failure, tmp, nbytes) if failure else None, self.runtime)
        except TrainError:
            self._remove(tmp)
            raise
        if self.config.async_save and not block:
            future = dcp.async_save(
                payload, storage_writer=storage.ChecksumWriter(tmp), process_group=self.group
            )
            self.pending = Pending(state.step, future, tmp, start, nbytes)
            self.last_save_seconds = time.perf_counter() - start
            return
        try:
            dcp.save(payload, storage_writer=storage.ChecksumWriter(tmp))
        except (Exception, CheckpointException) as exc:  # DCP raises it on every rank
            self._remove(tmp)
            raise self._failed(exc, tmp, nbytes) from None
        self.last_save_seconds = time.perf_counter() - start
        failure = None
        try:
            self._commit(state.step, tmp, start, nbytes, background=False)
        except SaveFailed as exc:  # rank 0's rename or seal
            failure = exc
        agree(failure, self.runtime)

    def take(self) -> list[Saved]:
        """The checkpoints committed since the last call, for the log."""
        done, self.done = self.done, []
        return done

    def save_failed(self) -> bool:
        """Whether the background save has failed on this rank (no collective: the loop's
        stop flag carries it to every rank, which then meet in `finish`)."""
        pending = self.pending
        failed = bool(pending and pending.future.done() and pending.future.exception())
        return failed or self.failure is not None

    def poll(self) -> None:
        """Commit a finished background save (call at step boundaries). Rank 0's write
        finishing means all ranks' did: DCP gathers every rank's result before writing its
        metadata. A failure is kept for `finish`, which every rank reaches together."""
        if self.pending is None or not self.pending.future.done() or self.save_failed():
            return
        try:
            self._wait()
        except SaveFailed as exc:
            self.failure = exc

    def finish(self) -> None:
        """Every rank together: the save in flight finished and committed, or its failure
        raised (by the lowest rank that saw it; the others stop quietly)."""
        failure = None
        try:
            self._wait()
        except SaveFailed as exc:
            failure = exc
        failure, self.failure = failure or self.failure, None
        agree(failure, self.runtime)

    def _wait(self) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        try:
            pending.future.result()
        except (Exception, CheckpointException) as exc:
            self._remove(pending.tmp)
            raise self._failed(exc, pending.tmp, pending.nbytes) from None
        self._commit(pending.step, pending.tmp, pending.started, pending.nbytes, True)

    def _failed(
        self, exc: BaseException, tmp: str, nbytes: int, everywhere: bool = True
    ) -> SaveFailed:
        step = tmp.rsplit("-", 1)[-1].lstrip("0") or "0"
        need = nbytes * self.runtime.world_size
        free = shutil.disk_usage(self.root if os.path.isdir(self.root) else "/").free
        # torch's zip writer reports a failed write as "unexpected pos", without the errno
        hidden = "unexpected pos" in str(exc) or "unexpected pos" in first_line(exc, named=True)
        if _no_space(exc) or (hidden and free < need):
            reason = (
                f"no space left on the device holding {self.root} (the checkpoint needs "
                f"~{need / 1e9:.2g} GB, {free / 1e9:.2g} GB are free)"
            )
        else:
            reason = first_line(exc, named=True)
        return SaveFailed(
            f"checkpoint of step {step} not written: {reason}; the partial checkpoint was "
            f"removed and the previous ones are kept: free space or fix it, then run the same "
            f"command to resume",
            everywhere,
        )

    def _remove(self, tmp: str) -> None:
        """A save that failed leaves nothing (rank 0 removes its directory, hp's own)."""
        if self.runtime.is_main:
            shutil.rmtree(tmp, ignore_errors=True)

    def _commit(self, step: int, tmp: str, started: float, nbytes: int, background: bool) -> None:
        final = os.path.join(self.root, step_name(step))
        if self.runtime.is_main:
            try:
                seal(tmp)
                if os.path.exists(final):  # the same step again, after falling back from it
                    os.rename(final, self._aside(final))
                os.rename(tmp, final)
                fsync_path(self.root)
            except OSError as exc:
                self._remove(tmp)
                raise self._failed(exc, tmp, nbytes, everywhere=False) from None
            self._prune()
        self.done.append(Saved(step, final, time.perf_counter() - started, background))

    @staticmethod
    def _aside(final: str) -> str:
        """Where a checkpoint replaced by a new save of its step is kept: never deleted (it
        may be damaged, or not this run's), never loaded (not a `step-N` name)."""
        number = 1
        while os.path.exists(f"{final}.replaced-{number}"):
            number += 1
        return f"{final}.replaced-{number}"

    def _owned(self, path: str) -> bool:
        try:
            owner = read_meta(path).get("run_id")
        except CheckpointError:
            return False  # unreadable: not provably this run's, so never deleted
        # One written before run ids is this run's: `candidates` lets a directory hold one run.
        return owner == self.run_id or owner is None

    def _prune(self) -> None:
        if not self.config.keep:
            return
        ours = [path for path in committed(self.root) if self._owned(path)]
        for old in ours[: -self.config.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def candidates(self, say: Callable[[str], None]) -> list[str]:
        """What `checkpoint.resume` asks to load, newest first ([] for a fresh start)."""
        resume = self.config.resume
        own = committed(self.root)
        if resume == "none":
            if own:
                raise CheckpointError(
                    f"checkpoint.resume = 'none', but {self.root} already holds checkpoints "
                    f"(newest {os.path.basename(own[-1])}): a fresh run there would mix with "
                    f"them; continue it with checkpoint.resume = 'auto', or choose a new "
                    f"train.run_dir (nothing was changed)",
                    fallback=False,
                )
            return []
        if resume != "auto" and not own:  # an explicit path seeds an empty run directory
            if not os.path.isdir(resume):
                raise CheckpointError(
                    f"checkpoint.resume = {resume!r}: no such checkpoint directory",
                    fallback=False,
                )
            return [resume]
        if resume != "auto":
            inside = os.path.dirname(os.path.abspath(resume)) == os.path.abspath(self.root)
            if inside and os.path.abspath(resume) != os.path.abspath(own[-1]):
                raise CheckpointError(
                    f"checkpoint.resume = {resume!r} is an older checkpoint of this run "
                    f"directory, which goes on to {os.path.basename(own[-1])}: going back in "
                    f"place would overwrite the newer ones; seed a new train.run_dir with it, "
                    f"or use checkpoint.resume = 'auto'",
                    fallback=False,
                )
            if not inside:
                say(
                    f"hp-train: checkpoint.resume = {resume!r} seeds a run directory only "
                    f"while it has no checkpoints; {self.root} has its own: continuing from them"
                )
        owners: dict[str, str] = {}
        for path in own:
            with contextlib.suppress(CheckpointError):  # damage: met again when loaded
                owner = read_meta(path).get("run_id")
                if owner is not None:  # one written before run ids joins the run resuming it
                    owners.setdefault(owner, path)
        if len(owners) > 1:
            runs = ", ".join(f"{os.path.basename(p)} (run {r})" for r, p in owners.items())
            raise CheckpointError(
                f"{self.root} holds checkpoints of {len(owners)} runs ({runs}): move the other "
                f"run's aside, or name one with checkpoint.resume in a new train.run_dir",
                fallback=False,
            )
        return list(reversed(own))

    def seeds(self, path: str) -> bool:
        """Whether loading `path` seeds this run directory rather than continuing it."""
        return os.path.dirname(os.path.abspath(path)) != os.path.abspath(self.root)


def _ramp_shown(ramp: BatchRamp | None) -> str:
    return "none" if ramp is None else f"[{ramp.start}, {ramp.increment}, {ramp.samples}]"


def check_ramp(meta: dict[str, Any], path: str, plan: BatchPlan, phased: bool = False) -> None:
    """A changed (or added, or removed) `train.batch_ramp` changes which samples the steps
    train on: refused while the checkpoint's next step is inside either ramp. Past both ends
    every step trains the full batch either way; then it is refused only if the new ramp
    counts fewer samples up to the checkpoint than the run trained (the data is built for the
    new count, and would run out), or, with `data.phases` (`phased`), another number: each
    phase's first sample is the plan's count before its step, so the later phases would
    start at other steps."""
    recorded = saved_section(meta, "train").get("batch_ramp")  # none: written without one
    try:
        saved = None if recorded is None else BatchRamp(**recorded)
        before = replace(plan, ramp=saved)
    except (TypeError, ValueError):
        raise CheckpointError(
            f"{os.path.join(path, META)}: field 'config' holds train.batch_ramp = "
            f"{recorded!r}, not a ramp of its global batch"
        ) from None
    if saved == plan.ramp:
        return
    step, trained = meta["step"], meta["consumed_samples"]
    change = (
        f"train.batch_ramp changed from {_ramp_shown(saved)} to {_ramp_shown(plan.ramp)} "
        f"since {path}"
    )
    last = max(before.full_from, plan.full_from) - 1  # the last step smaller than the batch
    if step < last:
        raise CheckpointError(
            f"{change}, whose step {step} is inside a ramp (smaller batches until step {last}): "
            "keep train.batch_ramp as it was to resume",
            fallback=False,
        )
    if plan.samples_after(step) < trained:
        raise CheckpointError(
            f"{change}: the new ramp counts {plan.samples_after(step)} samples up to step "
            f"{step}, fewer than the {trained} trained, so the data built would run out; keep "
            "train.batch_ramp as it was to resume",
            fallback=False,
        )
    if phased and plan.samples_after(step) != trained:
        raise CheckpointError(
            f"{change}: with data.phases the new ramp counts {plan.samples_after(step)} "
            f"samples up to step {step}, not the {trained} trained, so the later phases would "
            "start at other steps than their from_step or from_tokens; keep train.batch_ramp "
            "as it was to resume",
            fallback=False,
        )


def check_compatible(
    meta: dict[str, Any],
    path: str,
    config: Config,
    plan: BatchPlan,
    identity: dict[str, Any],
    warn: Callable[[str], None],
    mixture: Callable[[int, int], dict[str, Any]] | None = None,
) -> None:
    """Refuse a resume that would not continue the same run: another model, another global
    batch size or ramp, or other data (unless `checkpoint.allow_data_change`), naming what
    changed. With `data.phases`, `mixture` (`PhasePlan.state_at`) says what this config
    trained by the checkpoint's step: a phase changed after it is the same run, one before is
    not."""
    check_model(path, meta, config.model)
    check_optimizer(path, meta, config)
    saved_gbs = meta["global_batch_size"]
    if saved_gbs != plan.global_batch_size:
        raise CheckpointError(
            f"train.global_batch_size={plan.global_batch_size}, but {path} was trained with "
            f"{saved_gbs}: keep it to resume (the data-parallel size may change)",
            fallback=False,
        )
    check_ramp(meta, path, plan, phased=mixture is not None)
    saved = meta["data"]
    now = redact_data({key: getattr(config.data, key) for key in DATA_KEYS})
    changes = [
        f"data.{key} changed from {saved['config'][key]!r} to {now[key]!r}"
        for key in saved["config"]
        if key in now and saved["config"][key] != now[key]
    ]
    # A pipeline's middle stages read no data and hold no identity: the others compare.
    if not changes and identity and not same_samples(saved["fingerprint"], identity):
        changes = ["the corpus files behind the data paths changed"]
    if not changes and mixture is not None and "mixture" in meta:
        now_mix = mixture(meta["step"], meta["consumed_samples"])
        reason = state_change(meta["mixture"], now_mix, meta["step"])
        changes = [] if reason is None else [reason]
    if not changes:
        return
    message = f"{'; '.join(changes)} since {path}"
    if not config.checkpoint.allow_data_change:
        raise CheckpointError(
            message + ": set checkpoint.allow_data_change = true to resume anyway",
            fallback=False,
        )
    warn(f"hp-train: warning: {message}; resuming anyway (checkpoint.allow_data_change)")


def _read_rng(path: str, runtime: Runtime) -> dict[str, Any] | None:
    """This rank's saved random states (None when none were saved)."""
    base = os.path.join(path, "extra", f"rank-{runtime.rank:05d}")
    file = base + ".json" if os.path.exists(base + ".json") else base + ".pt"
    if not os.path.exists(file):
        return None
    try:
        if file.endswith(".json"):
            return storage.read_json(file)
        return rng.read_legacy(file)  # written before hp saved them as data
    except ValueError as exc:  # storage.Damaged, or a refused type
        raise CheckpointError(str(exc)) from None
    except Exception as exc:  # a cut or garbled file
        raise CheckpointError(f"{file}: unreadable ({type(exc).__name__})") from None


def load(
    path: str, state: TrainState, runtime: Runtime, meta: dict[str, Any], config: ModelConfig
) -> None:
    """Load `path` into `state` (any layout), every file checked before anything is applied.
    RNG states come back when the world size is the one that saved them."""
    metadata = checked_metadata(path, meta)  # read once for every check
    check_tensors(path, metadata, config)
    states = _read_rng(path, runtime) if meta["world_size"] == runtime.world_size else None
    payload = tensors(state)
    try:
        dcp.load(
            payload,
            storage_reader=storage.CheckedReader(path),
            planner=storage.SafeLoadPlanner(),
        )
    except (Exception, CheckpointException) as exc:  # DCP's wraps every rank's failure
        raise CheckpointError(f"{path}: cannot be loaded: {first_line(exc, named=True)}") from None
    if states is not None:
        try:
            rng.restore(states, runtime.device)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise CheckpointError(
                f"{path}/extra: random states malformed ({type(exc).__name__})"
            ) from None
    _apply(state, payload)
    state.load_scalars(meta)
