"""Preprocessing shards as tasks on a Ray cluster, merged by the driver at the end.

Ray is the executor, hp-data plans and merges: the driver cuts the inputs into shards (the
same plan every task computes, see plan.py), submits one task per shard, shows one progress
line over all of them, and merges the finished shards (shards.py) into the output,
byte-identical to a one-machine run. A task is an ordinary sharded `preprocess` run, atomic
and resumable, so Ray's retry of a task whose worker died rewrites it safely. Paths must name
storage every node can reach; they are made absolute before tasks are sent.

Ray queues a task that no node can take for ever, so the driver never waits on Ray alone: a
request larger than any node is refused before anything is submitted, and a run none of whose
tasks is running for `schedule_timeout` seconds stops, cancelling what it submitted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from hp_data.errors import PreprocessError
from hp_data.fs import first_line
from hp_data.pipeline.driver import check_shardable, preprocess
from hp_data.pipeline.options import PreprocessOptions
from hp_data.plan import plan_units, shard_groups
from hp_data.progress import Progress
from hp_data.readers.discovery import discover
from hp_data.readers.units import STDIN
from hp_data.remote import is_url, set_timeout
from hp_data.shards import merge_shards
from hp_data.tokenize import TokenizerFiles

# Seconds the driver waits while none of its tasks runs (a node may be coming up) before it
# stops: long enough for an autoscaler to add a node, short of a hang.
SCHEDULE_TIMEOUT = 600.0
CONNECT_TIMEOUT = 10.0  # seconds for a cluster's address to accept a connection


def _shard(
    inputs: list[str], out: str, tokenizer: TokenizerFiles, options: PreprocessOptions
) -> Iterator[dict | None]:
    """One task: shard `options.shard_index` of `options.num_shards` (a Ray task body). A
    generator, so that its first item (None) tells the driver it has started."""
    yield None
    yield preprocess(inputs, out, tokenizer, options).__dict__


def preprocess_on_ray(
    inputs: list[str],
    out_prefix: str,
    tokenizer: str | TokenizerFiles,
    options: PreprocessOptions | None = None,
    address: str | None = None,
    schedule_timeout: float | None = None,
) -> dict[str, Any]:
    """Run `preprocess` over a Ray cluster and merge; returns the merge's report plus totals.

    `address`: None starts a local cluster; `"auto"` joins the one this machine belongs to;
    else a Ray address. `options.num_shards` above 1 sets the number of tasks, else one per
    CPU of the cluster; `options.workers` tokenizer processes run in each task (and it asks
    Ray for as many CPUs). `schedule_timeout` (default `SCHEDULE_TIMEOUT`): seconds during
    which none of the run's tasks runs before it stops. While it runs, Ray's notices go to
    stderr (Ray prints them on stdout), and with `options.show_progress` off they are dropped."""
    try:
        import ray
    except ImportError:
        raise PreprocessError("--ray needs Ray: pip install 'hp-data[ray]'") from None
    options = options or PreprocessOptions()
    if STDIN in inputs:
        raise PreprocessError("standard input (-) cannot be split over Ray tasks; give files")
    started = time.perf_counter()
    inputs = [path if is_url(path) else os.path.abspath(path) for path in inputs]  # s3://...
    out_prefix = os.path.abspath(out_prefix)
    # Located here (a hub name resolves in this machine's cache), with an absolute path.
    if not isinstance(tokenizer, TokenizerFiles):
        tokenizer = TokenizerFiles.locate(tokenizer, options.allow_download)
    tokenizer = tokenizer.absolute()
    set_timeout(options.remote_timeout)  # the driver lists and plans remote inputs too
    found = discover(inputs, options.input_format)  # bad inputs fail here, before any task
    check_shardable(found)
    timeout = SCHEDULE_TIMEOUT if schedule_timeout is None else schedule_timeout
    started_here = not ray.is_initialized()
    with _ray_notices(quiet=not options.show_progress):
        if started_here:
            _connect(ray, address)
        try:
            _check_fits(ray, options.workers)
            return _run(ray, found, inputs, out_prefix, tokenizer, options, started, timeout)
        finally:
            if started_here:
                ray.shutdown()


@contextlib.contextmanager
def _ray_notices(quiet: bool) -> Iterator[None]:
    """Ray's driver prints its raylet's notices (a worker died, say) on stdout, where --json's
    object goes: send them to stderr, and with `quiet` drop them and Ray's logged banners (its
    token-authentication notice), errors aside."""
    ray_logger = logging.getLogger("ray")
    level = ray_logger.level
    with contextlib.ExitStack() as stack:
        sink = stack.enter_context(open(os.devnull, "w")) if quiet else sys.stderr
        stack.enter_context(contextlib.redirect_stdout(sink))
        if quiet:
            ray_logger.setLevel(logging.ERROR)
            stack.callback(ray_logger.setLevel, level)
        yield


def _connect(ray: Any, address: str | None) -> None:
    """ray.init, after a check that a given address answers at all: Ray retries one that does
    not for about a quarter of an hour."""
    given, where = address, "--ray" if address is None else f"--ray={address}"
    if address in (None, "auto") and os.environ.get("RAY_ADDRESS"):  # what Ray then joins
        given = os.environ["RAY_ADDRESS"]
        where = f"RAY_ADDRESS={given}"
    if given not in (None, "auto", "local"):
        url = urlsplit(given if "://" in given else f"//{given}")
        try:
            if url.port is None:
                raise ValueError("no port")
            socket.create_connection((url.hostname, url.port), timeout=CONNECT_TIMEOUT).close()
        except (OSError, ValueError) as exc:  # ValueError: the port is missing or no number
            raise PreprocessError(
                f"{where}: cannot reach it ({getattr(exc, 'strerror', None) or exc}); give the "
                "head node's HOST:PORT, as `ray start --head` prints it"
            ) from None
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    except ConnectionError as exc:
        raise PreprocessError(
            f"{where}: {first_line(exc)}; check that the cluster is up, and for a cluster with "
            "token authentication set RAY_AUTH_MODE=token"
        ) from None


def _largest_node(ray: Any) -> float:
    """The most CPUs one node has, or one the autoscaler says it can add: a task's CPUs must
    all be on one node."""
    cpus = [node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node["Alive"]]
    try:  # the node types an autoscaler (v2, KubeRay) publishes; absent on a fixed cluster
        config = ray._private.state.state.get_cluster_config()
    except AttributeError:  # an older Ray
        config = None
    for group in config.node_group_configs if config else ():
        if group.max_count != 0:
            cpus.append(float(group.resources.get("CPU", 0)))
    return max(cpus, default=0.0)


def _check_fits(ray: Any, workers: int) -> None:
    """Refuse a task that no node can take: Ray would queue it for ever."""
    largest = _largest_node(ray)
    if workers <= largest:
        return
    if largest < 1:
        raise PreprocessError(
            f"--workers {workers}: each Ray task asks for {workers} CPU(s), but no node of "
            "the cluster has a CPU; add a node with CPUs"
        )
    raise PreprocessError(
        f"--workers {workers}: each Ray task asks for {workers} CPUs on one node, but the "
        f"cluster's largest node has {largest:g}; give --workers {int(largest)} or fewer"
    )


def _unscheduled(ray: Any, workers: int, timeout: float) -> PreprocessError:
    free = ray.available_resources().get("CPU", 0.0)
    total = ray.cluster_resources().get("CPU", 0.0)
    return PreprocessError(
        f"--ray: none of the run's tasks could start for {timeout:g} s "
        f"(--ray-schedule-timeout): each asks for {workers} CPU(s) on one node, and the "
        f"cluster has {free:g} of {total:g} CPUs free; free CPUs or add a node, lower "
        "--workers, or raise --ray-schedule-timeout"
    )


def _next_item(ray: Any, task_items: Any, shard: int) -> dict | None:
    """A task's next item (None: it started; then its summary), or its failure in one line."""
    try:
        return ray.get(next(task_items))
    except ray.exceptions.RayTaskError as exc:  # the task raised: an hp-data error, say
        cause = exc.cause if isinstance(exc.cause, Exception) else exc
        raise PreprocessError(str(cause).splitlines()[-1] if str(cause) else repr(cause)) from None
    except ray.exceptions.RayError as exc:  # its worker or node lost beyond Ray's retries
        raise PreprocessError(f"--ray: the task of shard {shard}: {first_line(exc)}") from None


def _run(
    ray: Any,
    found: list,
    inputs: list[str],
    out_prefix: str,
    tokenizer: TokenizerFiles,
    options: PreprocessOptions,
    started: float,
    timeout: float,
) -> dict[str, Any]:
    count = options.num_shards
    if count <= 1:
        count = max(int(ray.cluster_resources().get("CPU", 1)) // options.workers, 1)
    units = plan_units(found, options.unit_bytes, options.units, count)
    groups = shard_groups(units, count)
    task = ray.remote(num_cpus=options.workers, max_retries=3)(_shard)
    pending = {
        task.remote(
            inputs,
            out_prefix,
            tokenizer,
            replace(options, num_shards=count, shard_index=i, show_progress=False),
        ): i
        for i in range(count)
    }
    sizes = [sum(units[u].nbytes for u in group) for group in groups]
    progress = Progress(sum(sizes), f"preprocess on Ray, {count} tasks", options.show_progress)
    done = documents = tokens = 0
    running: set[int] = set()  # shards whose task has started (and not finished)
    active = time.monotonic()  # when a task last started, finished or was seen running
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for task_items in ready:
                shard = pending[task_items]
                summary = _next_item(ray, task_items, shard)
                if summary is None:
                    running.add(shard)
                    continue
                running.discard(shard)
                del pending[task_items]
                done += sizes[shard]
                documents += summary["documents_in"]
                tokens += summary["tokens"]
            if ready or running:
                active = time.monotonic()
            elif time.monotonic() - active > timeout:
                raise _unscheduled(ray, options.workers, timeout)
            progress.update(done, docs=documents, tokens=tokens)
    finally:
        for task_items in pending:  # nothing of this run may keep running or start later
            ray.cancel(task_items)
    progress.close()
    merged = merge_shards(out_prefix, show_progress=options.show_progress)
    return {
        **merged,
        "tasks": count,
        "documents_in": documents,
        "tokens_in_shards": tokens,
        "seconds": round(time.perf_counter() - started, 3),
    }
