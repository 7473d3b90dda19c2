"""hp-train checkpoints: save and load time, sync against async, resume-to-first-step.

For each model (`small`, `125m`), one process on CPU trains a few steps three times: without
checkpoints, with a synchronous save every `--interval` steps, and with asynchronous saves;
then resumes from the last checkpoint. Read from each run's metrics.jsonl:

- save: the seconds a step boundary is blocked by a save (sync: the whole save; async: copying
  the tensors to host memory before the background write);
- async cost: the extra wall time of the steps that run while a background write is in flight,
  as a share of a normal step;
- load and resume-to-first-step: the seconds to load the checkpoint, and from the start of the
  run (after imports) to the end of its first step, fresh and resumed.

    uv run python tools/bench/bench_checkpoint.py [--models small,125m] [--steps 9] [--interval 3]

`--checksums` measures instead what hp's checkpoint checksums cost: in one process, the same
model and AdamW state saved and loaded by DCP's own `FileSystemWriter`/`FileSystemReader` and
by hp's `ChecksumWriter`/`CheckedReader` (xxh3 of every item taken while it is written, checked
while it is read), alternating, best of `--repeats`; the ratio is hp's time over DCP's.

    uv run python tools/bench/bench_checkpoint.py --checksums [--models small,125m] [--repeats 5]

`--store` measures checkpoints in object storage against the local disk: the same runs (one
process, a save every `--interval` steps, sync and async) with `checkpoint.dir` on the local
disk and as an s3:// URL of a local S3 server (moto, in this process); per run the median of
the `checkpoint` records' `blocked_s` (the seconds a step boundary waited for the save) and
`seconds` (from the save's start to its commit), and the run's wall time past the plain
run's; the ratio is s3 over local.

    uv run python tools/bench/bench_checkpoint.py --store [--models small] [--steps 9]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent


def run(
    run_dir: Path, model: str, steps: int, *extra: str, env: dict[str, str] | None = None
) -> list[dict]:
    command = [
        str(BIN / "hp-train"), f"model.preset={model}", "data.type=dummy", "data.seq_length=256",
        "model.max_seq_len=256", "train.micro_batch_size=2", f"train.steps={steps}",
        "metrics.log_interval=1", "metrics.plot=false", "metrics.tensorboard=false",
        "data.num_workers=0", f"train.run_dir={run_dir}", *extra,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        sys.exit(f"failed: {' '.join(command)}\n{done.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def step_seconds(records: list[dict]) -> dict[int, float]:
    """Wall seconds of each step after the first, from consecutive train records."""
    train = [r for r in records if r["kind"] == "train"]
    return {b["step"]: b["elapsed_s"] - a["elapsed_s"] for a, b in itertools.pairwise(train)}


def measure(model: str, steps: int, interval: int, work: Path) -> dict[str, float]:
    plain = run(work / f"{model}-plain", model, steps)
    sync = run(work / f"{model}-sync", model, steps, f"checkpoint.interval={interval}")
    asynchronous = run(
        work / f"{model}-async", model, steps, f"checkpoint.interval={interval}",
        "checkpoint.async=true",
    )  # fmt: skip
    normal = statistics.median(step_seconds(plain).values())
    saves = [r for r in sync if r["kind"] == "checkpoint"]
    async_saves = [r for r in asynchronous if r["kind"] == "checkpoint"]
    # the step after each async save (but the last) runs beside the background write
    overlapped = step_seconds(asynchronous)
    during = [overlapped[r["step"] + 1] for r in async_saves if r["step"] + 1 in overlapped]
    resumed = run(work / f"{model}-sync", model, steps + 1, f"checkpoint.interval={interval}")
    resume = next(r for r in resumed if r["kind"] == "resume")
    first_resumed = next(r for r in resumed if r["kind"] == "train" and r["step"] == steps + 1)
    first_fresh = next(r for r in plain if r["kind"] == "train")
    return {
        "step_s": normal,
        "save_sync_s": statistics.median(r["seconds"] for r in saves),
        "save_async_blocking_s": statistics.median(r["seconds"] for r in async_saves),
        "async_cost_pct": 100 * (statistics.median(during) - normal) / normal if during else 0,
        "load_s": resume["load_s"],
        "first_step_fresh_s": first_fresh["elapsed_s"],
        "first_step_resumed_s": first_resumed["elapsed_s"],
        "checkpoint_mb": sum(
            f.stat().st_size for f in (work / f"{model}-sync" / "checkpoints").rglob("*")
            if f.is_file()
        ) / 1e6 / len(list((work / f"{model}-sync" / "checkpoints").iterdir())),
    }  # fmt: skip


def checksum_cost(model: str, repeats: int, work: Path) -> dict[str, float]:
    """Best save and load seconds of one state, by DCP's plain file storage and by hp's."""
    import time

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from hp_runtime.model import PRESETS, Transformer
    from hp_runtime.train.storage import CheckedReader, ChecksumWriter
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    net = Transformer(PRESETS[model])
    state = {"model": dict(net.state_dict())}
    state["optim"] = {
        f"{name}.{moment}": torch.randn_like(param)
        for name, param in net.named_parameters()
        for moment in ("exp_avg", "exp_avg_sq")
    }
    target = {part: {k: torch.empty_like(v) for k, v in d.items()} for part, d in state.items()}
    kinds = {"dcp": (FileSystemWriter, FileSystemReader), "hp": (ChecksumWriter, CheckedReader)}
    best = {f"{kind}_{op}": float("inf") for kind in kinds for op in ("save", "load")}
    for attempt in range(repeats):
        for kind, (writer, reader) in kinds.items():
            path = work / f"{model}-{kind}-{attempt}"
            start = time.perf_counter()
            dcp.save(state, storage_writer=writer(str(path)))
            best[f"{kind}_save"] = min(best[f"{kind}_save"], time.perf_counter() - start)
            start = time.perf_counter()
            dcp.load(target, storage_reader=reader(str(path)))
            best[f"{kind}_load"] = min(best[f"{kind}_load"], time.perf_counter() - start)
            for file in path.iterdir():
                file.unlink()
            path.rmdir()
    nbytes = sum(t.numel() * t.element_size() for d in state.values() for t in d.values())
    return {"mb": nbytes / 1e6, **best}


def store_cost(model: str, steps: int, interval: int, work: Path) -> dict[str, dict]:
    """Each of local/s3 x sync/async: median blocked and commit seconds, extra wall time."""
    import os
    import uuid

    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    keys = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
    endpoint = f"http://{host}:{port}"
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint, **{k.lower(): v for k, v in keys.items()
                                               if k != "AWS_DEFAULT_REGION"},
                 region_name="us-east-1").create_bucket(Bucket=bucket)  # fmt: skip
    env = {**os.environ, **keys, "FSSPEC_S3_ENDPOINT_URL": endpoint}
    try:
        plain = run(work / f"{model}-plain", model, steps)
        wall = plain[-2]["elapsed_s"] if plain[-1]["kind"] == "end" else plain[-1]["elapsed_s"]
        out = {}
        for where in ("local", "s3"):
            for mode in ("sync", "async"):
                name = f"{model}-{where}-{mode}"
                target = f"s3://{bucket}/{name}" if where == "s3" else str(work / name / "ckpt")
                records = run(
                    work / name, model, steps, f"checkpoint.interval={interval}",
                    f"checkpoint.dir={target}", f"checkpoint.async={str(mode == 'async').lower()}",
                    env=env,
                )  # fmt: skip
                saves = [r for r in records if r["kind"] == "checkpoint"]
                last = [r for r in records if r["kind"] == "train"][-1]["elapsed_s"]
                out[f"{where}-{mode}"] = {
                    "blocked_s": statistics.median(r["blocked_s"] for r in saves),
                    "commit_s": statistics.median(r["seconds"] for r in saves),
                    "extra_s": last - wall,
                }
        return out
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="small,125m")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--interval", type=int, default=3)
    parser.add_argument("--checksums", action="store_true", help="the cost of checksums only")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--store", action="store_true", help="local disk against s3 (moto)")
    args = parser.parse_args()
    if args.store:
        print("model | save | blocked: local s, s3 s, ratio | to commit: local s, s3 s | "
              "run's extra wall: local s, s3 s")  # fmt: skip
        with tempfile.TemporaryDirectory() as work:
            for model in args.models.split(","):
                r = store_cost(model, args.steps, args.interval, Path(work))
                for mode in ("sync", "async"):
                    a, b = r[f"local-{mode}"], r[f"s3-{mode}"]
                    print(
                        f"{model} | {mode} | {a['blocked_s']:.3f}, {b['blocked_s']:.3f}, "
                        f"{b['blocked_s'] / a['blocked_s']:.2f}x | {a['commit_s']:.2f}, "
                        f"{b['commit_s']:.2f} | {a['extra_s']:.2f}, {b['extra_s']:.2f}",
                        flush=True,
                    )
        return
    if args.checksums:
        print("model | state MB | save: DCP s, hp s, ratio | load: DCP s, hp s, ratio")
        with tempfile.TemporaryDirectory() as work:
            for model in args.models.split(","):
                r = checksum_cost(model, args.repeats, Path(work))
                print(
                    f"{model} | {r['mb']:.0f} | {r['dcp_save']:.3f}, {r['hp_save']:.3f}, "
                    f"{r['hp_save'] / r['dcp_save']:.2f}x | {r['dcp_load']:.3f}, "
                    f"{r['hp_load']:.3f}, {r['hp_load'] / r['dcp_load']:.2f}x",
                    flush=True,
                )
        return
    rows = {}
    with tempfile.TemporaryDirectory() as work:
        for model in args.models.split(","):
            rows[model] = measure(model, args.steps, args.interval, Path(work))
            print(f"  {model}: {rows[model]}", flush=True)
    print("one process on CPU, micro-batch 2 x 256 tokens, AdamW (model + 2 moments saved)")
    header = ["model", "ckpt MB", "step s", "sync save s", "async block s", "async cost",
              "load s", "1st step fresh s", "1st step resumed s"]  # fmt: skip
    print(" | ".join(header))
    for model, r in rows.items():
        print(
            f"{model} | {r['checkpoint_mb']:.0f} | {r['step_s']:.2f} | {r['save_sync_s']:.2f} | "
            f"{r['save_async_blocking_s']:.2f} | {r['async_cost_pct']:.0f}% of a step | "
            f"{r['load_s']:.2f} | {r['first_step_fresh_s']:.2f} | {r['first_step_resumed_s']:.2f}"
        )


if __name__ == "__main__":
    main()
