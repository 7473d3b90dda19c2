"""Preprocessing shards as tasks on a Ray cluster, merged by the driver at the end.

Ray is the executor, hp-data plans and merges: the driver cuts the inputs into shards (the
same plan every task computes, see plan.py), submits one task per shard, shows one progress
line over all of them, and merges the finished shards (shards.py) into the output,
byte-identical to a one-machine run. A task is an ordinary sharded `preprocess` run, atomic
and resumable, so Ray's retry of a task whose worker died rewrites it safely. Paths must name
storage every node can reach; they are made absolute before tasks are sent.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

from hp_data.errors import PreprocessError
from hp_data.pipeline import PreprocessOptions, preprocess
from hp_data.plan import plan_units, shard_groups
from hp_data.progress import Progress
from hp_data.readers import STDIN, discover
from hp_data.shards import merge_shards
from hp_data.tokenize import TokenizerFiles


def _shard(
    inputs: list[str], out: str, tokenizer: TokenizerFiles, options: PreprocessOptions
) -> dict:
    """One task: shard `options.shard_index` of `options.num_shards` (a Ray task body)."""
    return preprocess(inputs, out, tokenizer, options).__dict__


def preprocess_on_ray(
    inputs: list[str],
    out_prefix: str,
    tokenizer: str | TokenizerFiles,
    options: PreprocessOptions | None = None,
    address: str | None = None,
) -> dict[str, Any]:
    """Run `preprocess` over a Ray cluster and merge; returns the merge's report plus totals.

    `address`: None starts a local cluster; `"auto"` joins the one this machine belongs to;
    else a Ray address. `options.num_shards` above 1 sets the number of tasks, else one per
    CPU of the cluster; `options.workers` tokenizer processes run in each task (and it asks
    Ray for as many CPUs)."""
    try:
        import ray
    except ImportError:
        raise PreprocessError("--ray needs Ray: pip install 'hp-data[ray]'") from None
    options = options or PreprocessOptions()
    if STDIN in inputs:
        raise PreprocessError("standard input (-) cannot be split over Ray tasks; give files")
    started = time.perf_counter()
    inputs = [os.path.abspath(path) for path in inputs]
    out_prefix = os.path.abspath(out_prefix)
    # Located here (a hub name resolves in this machine's cache), with an absolute path.
    if not isinstance(tokenizer, TokenizerFiles):
        tokenizer = TokenizerFiles.locate(tokenizer, options.allow_download)
    tokenizer = tokenizer.absolute()
    found = discover(inputs, options.input_format)  # bad inputs fail here, before any task
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    try:
        return _run(ray, found, inputs, out_prefix, tokenizer, options, started)
    finally:
        if started_here:
            ray.shutdown()


def _run(
    ray: Any,
    found: list,
    inputs: list[str],
    out_prefix: str,
    tokenizer: TokenizerFiles,
    options: PreprocessOptions,
    started: float,
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
    summaries: list[dict[str, Any]] = []
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in ready:
                summary = ray.get(ref)
                summaries.append(summary)
                done += sizes[pending.pop(ref)]
                documents += summary["documents_in"]
                tokens += summary["tokens"]
            progress.update(done, docs=documents, tokens=tokens)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, Exception) else exc
        raise PreprocessError(str(cause).splitlines()[-1] if str(cause) else repr(cause)) from None
    progress.close()
    merged = merge_shards(out_prefix, show_progress=options.show_progress)
    return {
        **merged,
        "tasks": count,
        "documents_in": documents,
        "tokens_in_shards": tokens,
        "seconds": round(time.perf_counter() - started, 3),
    }
