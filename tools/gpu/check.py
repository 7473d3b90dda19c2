"""The first GPU hour, prepared: every CUDA path of hp-runtime checked and timed in one command.

    uv run python tools/gpu/check.py --out gpu.json           # one NVIDIA GPU, < 8 minutes
    uv run python tools/gpu/check.py --device cpu --out x.json  # tiny shapes: keeps it working

Each part runs the real code (hp-train's `train()` in this process, or the library's FSDP) and
is checked against the same work in fp32 on the CPU, on the same tiny batch: the one-process
paths (bf16 autocast over fp32 master weights, fp32 with fused AdamW, FSDP at world size 1
with a bf16 mixed-precision policy, per-block `torch.compile`, activation checkpointing,
document masking (flex on CUDA), the chunked loss), then tokens/s, MFU and peak memory of `1b`
and of an 8B-shaped stack (its first layers only, to fit the time) with and without compile,
then float8 (`train.float8`, torchao): 200 steps of a 1B-shaped model on the example corpus in
bf16 and in each recipe (each float8 curve's end within 1% of bf16's), and the 8B-shaped
stack's speed with float8, with and without compile; then a checkpoint save (sync and async)
and its load; `hp-train eval`'s loglikelihoods on the device against the CPU; on request
(`--only titan`), hp-train against torchtitan's trainer (`tools/bench/bench_titan.py`). A part
that fails is reported with its error and the others still run; the exit status is 1 when any
failed. Everything goes to stdout as a table and to `--out` as JSON (`environment`, then
`parts`: one object each with `ok`, `seconds` and its figures).

Tolerances (relative, on each of the first steps' losses): fp32 paths 1e-3 (the device's
kernels sum in another order; errors grow over the optimizer steps), bf16 paths 3e-2 (bf16 has
8 bits of mantissa).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
FP32_TOL, BF16_TOL = 1e-3, 3e-2
FLOAT8_TOL = 1e-2  # a float8 curve's end against bf16's (issue 43)


class Check:
    """The shapes and the device one invocation checks on."""

    def __init__(self, device: str, tiny: bool, work: Path) -> None:
        self.device, self.tiny, self.work = device, tiny, work
        self.steps = 3
        self.seq = 32 if tiny else 256
        self.mbs = 2 if tiny else 4
        self._references: dict[str, list[float]] = {}
        self.titan_env: str | None = None  # a Python with torchtitan (`titan`); None: uv's

    # -- the trainer, in this process ---------------------------------------------------------

    def base(self, name: str) -> list[str]:
        return [
            "model.preset=tiny",
            f"model.max_seq_len={self.seq}",
            "data.type=dummy",
            f"data.seq_length={self.seq}",
            "data.num_workers=0",
            f"train.steps={self.steps}",
            f"train.micro_batch_size={self.mbs}",
            "train.cpu_threads=1" if self.device == "cpu" else "train.cpu_threads=0",
            "optim.warmup_steps=0",
            "optim.lr=1e-3",
            "metrics.log_interval=1",
            "metrics.tensorboard=false",
            "metrics.plot=false",
            "checkpoint.interval=0",
            f"train.run_dir={self.work / name}",
        ]

    def train(self, name: str, overrides: list[str]) -> dict[str, Any]:
        """hp-train's `train()` on `overrides`; its losses and its last train record."""
        from hp_runtime.train import load_config, train
        from hp_runtime.train.launch import start

        config = load_config(None, overrides)
        runtime = start(config.train.device, config.train.cpu_threads)
        log = io.StringIO()
        result = train(config, runtime, stream=log)
        records = [
            json.loads(line)
            for line in (Path(config.train.run_dir) / "metrics.jsonl").read_text().splitlines()
        ]
        trains = [r for r in records if r.get("kind") == "train"]
        return {
            "losses": [result.losses[s] for s in sorted(result.losses)],
            "last": trains[-1] if trains else {},
            "records": records,
            "log": log.getvalue(),
        }

    def reference(self, overrides: list[str]) -> list[float]:
        """The same run on the CPU in fp32, without compile: what a device path must match."""
        key = json.dumps(overrides)
        if key not in self._references:
            cpu = [o for o in overrides if not o.startswith(("train.device", "parallel.compile"))]
            cpu += ["train.device=cpu", "train.mixed_precision=fp32", "parallel.compile=false"]
            run = self.train(f"reference-{len(self._references)}", cpu)
            self._references[key] = run["losses"]
        return self._references[key]

    def path(
        self, name: str, extra: list[str], precision: str, reference: list[str] | None = None
    ) -> dict[str, Any]:
        """One trainer path on the device against its fp32 CPU reference."""
        overrides = [*self.base(name), f"train.device={self.device}", *extra]
        overrides.append(f"train.mixed_precision={precision}")
        run = self.train(name, overrides)
        expected = self.reference([*self.base(name), *(reference or extra)])
        tolerance = BF16_TOL if precision == "bf16" else FP32_TOL
        return compare(run["losses"], expected, tolerance) | figures(run["last"])

    # -- the library's FSDP at world size 1 --------------------------------------------------

    def fsdp_world_one(self) -> dict[str, Any]:
        """hp's `apply_fsdp` over a 1-rank mesh with a bf16 policy (hp-train shards only from
        2 ranks: this is the policy a 1,000-GPU run uses, on one), one forward and backward,
        against the same model in fp32 on the CPU."""
        import torch
        import torch.nn.functional as F
        from hp_runtime.model import Transformer, preset
        from hp_runtime.parallel import init_weights
        from hp_runtime.parallel.fsdp import apply_fsdp
        from torch.distributed.device_mesh import init_device_mesh

        config = preset("tiny", max_seq_len=self.seq)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, config.vocab_size, (self.mbs, self.seq + 1), generator=generator)

        def loss_and_norm(model: torch.nn.Module, device: str) -> tuple[float, float]:
            x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                     for p in model.parameters()]  # fmt: skip
            norm = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))
            return float(loss.detach()), float(norm)

        with torch.device("cpu"):
            reference = Transformer(config)
        init_weights(reference, seed=0)
        expected = loss_and_norm(reference, "cpu")
        with torch.device("meta"):
            model = Transformer(config)
        mesh = init_device_mesh(self.device, (1,))
        apply_fsdp(model, mesh, self.device, True, torch.bfloat16)
        model.to_empty(device=self.device)
        init_weights(model, seed=0)
        got = loss_and_norm(model, self.device)
        out = compare([got[0]], [expected[0]], BF16_TOL)
        norm_error = abs(got[1] - expected[1]) / max(abs(expected[1]), 1e-12)
        out["grad_norm_rel_error"] = norm_error
        out["ok"] = out["ok"] and norm_error <= BF16_TOL
        return out

    # -- speed --------------------------------------------------------------------------------

    def speed(self, name: str, model: list[str], compile_: bool) -> dict[str, Any]:
        """Steady-state tokens/s, MFU and peak memory of `model` on the device (the first
        steps, compilation's, are not timed: the last record covers the steps after them)."""
        steps = 4 if self.tiny else 14
        seq = self.seq if self.tiny else 2048
        overrides = [
            *self.base(name),
            f"train.device={self.device}",
            *model,
            f"model.max_seq_len={seq}",
            f"data.seq_length={seq}",
            f"train.steps={steps}",
            f"train.micro_batch_size={1 if self.tiny else 2}",
            f"metrics.log_interval={steps // 2}",
            f"parallel.compile={str(compile_).lower()}",
        ]
        run = self.train(name, overrides)
        finite = all(math.isfinite(v) for v in run["losses"])
        return {"ok": finite, "losses": run["losses"]} | figures(run["last"])

    # -- against torchtitan ------------------------------------------------------------------

    def titan(self) -> dict[str, Any]:
        """hp-train against torchtitan's own trainer on this device (one process, the same
        shape, weights and batches: `tools/bench/bench_titan.py`), its losses against
        torchtitan's within the tolerance of the precision, and both sides' tokens/s and
        peak memory. Opt-in (`--only titan`): it needs torchtitan, which is not in the lock
        (uv's overlay from PyPI, or `--titan-env PYTHON`)."""
        out = self.work / "titan.json"
        if self.tiny:
            shape = ["--preset", "small", "--seq", "32", "--mbs", "2", "--steps", "4"]
            shape += ["--warmup", "2", "--lr-warmup", "2"]
        else:  # torchtitan's Llama 3.2 1B flavour less its rope scaling: hp's `1b`
            shape = ["--preset", "1b", "--seq", "2048", "--mbs", "2", "--steps", "14"]
            shape += ["--warmup", "4", "--lr-warmup", "4"]
        command = [sys.executable, str(REPO / "tools" / "bench" / "bench_titan.py"), *shape,
                   "--device", self.device, "--layouts", "1", "--rounds", "1",
                   "--json", str(out)]  # fmt: skip
        if self.titan_env:
            command += ["--titan-env", self.titan_env]
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        if done.returncode:
            raise RuntimeError(f"bench_titan.py failed: {(done.stderr or done.stdout)[-3000:]}")
        layout = json.loads(out.read_text())["layouts"]["1"]
        losses = layout["losses"]
        tolerance = FP32_TOL if self.device == "cpu" else BF16_TOL
        return compare(losses["hp"], losses["titan"], tolerance) | {
            "tokens_per_s": layout["tokens_per_s"]["hp"],
            "titan_tokens_per_s": layout["tokens_per_s"]["titan"],
            "tokens_per_s_ratio": layout["tokens_per_s_ratio"],
            "peak_memory_gib": layout["peak_memory_gib"]["hp"],
            "titan_peak_memory_gib": layout["peak_memory_gib"]["titan"],
        }

    # -- float8 -------------------------------------------------------------------------------

    def float8_curve(self) -> dict[str, Any]:
        """The loss of a 1B-shaped model (tiny: 128 wide feed-forward, so that it converts)
        over 200 steps (tiny: 20) of the example corpus in bf16 and in each float8 recipe: each
        recipe's mean loss over the last tenth of the steps within 1% of bf16's."""
        steps = 20 if self.tiny else 200
        model = ["model.ffn_hidden=128"] if self.tiny else ["model.preset=1b"]
        seq = self.seq if self.tiny else 1024
        common = [
            f"train.device={self.device}", *model, *_text(self), f"model.max_seq_len={seq}",
            f"data.seq_length={seq}", f"train.steps={steps}", "optim.lr=3e-4",
            f"optim.warmup_steps={steps // 10}", "train.mixed_precision=bf16",
        ]  # fmt: skip
        ends: dict[str, float] = {}
        out: dict[str, Any] = {"steps": steps, "curves": {}}
        for recipe in ("bf16", "tensorwise", "rowwise", "rowwise_with_gw_hp"):
            float8 = [] if recipe == "bf16" else [f"train.float8.recipe={recipe}"]
            run = self.train(f"float8-{recipe}", [*self.base(f"float8-{recipe}"), *common, *float8])
            losses = run["losses"]
            out["curves"][recipe] = losses[:: max(steps // 20, 1)] + losses[-1:]
            ends[recipe] = float(np.mean(losses[-max(steps // 10, 2) :]))
            if recipe != "bf16":
                out[f"{recipe}_tokens_per_s"] = run["last"].get("tokens_per_s")
        errors = {r: abs(e - ends["bf16"]) / ends["bf16"] for r, e in ends.items() if r != "bf16"}
        return out | {
            "ok": max(errors.values()) <= FLOAT8_TOL,
            "end_losses": ends,
            "end_rel_errors": errors,
            "max_rel_error": max(errors.values()),
            "tolerance": FLOAT8_TOL,
        }

    # -- checkpoints --------------------------------------------------------------------------

    def checkpoint(self, async_save: bool) -> dict[str, Any]:
        """Save at steps 2 and 4 (sync or async), then resume from step 4 to 6 in a fresh
        `train()` and compare its losses with an uninterrupted 6-step run."""
        name = f"checkpoint-{'async' if async_save else 'sync'}"
        # 125m: its checkpoints (1.5 GB each with AdamW's moments) fit a small disk
        model = [] if self.tiny else ["model.preset=125m", "model.max_seq_len=1024"]
        seq = [] if self.tiny else ["data.seq_length=1024"]
        common = [
            *self.base(name),
            f"train.device={self.device}",
            *model,
            *seq,
            "checkpoint.interval=2",
            "optim.decay_style=constant",  # the 4-step run's rates are the 6-step run's
            f"checkpoint.async={str(async_save).lower()}",
        ]
        first = self.train(name, [*common, "train.steps=4"])
        saves = [r for r in first["records"] if r.get("kind") == "checkpoint"]
        resumed = self.train(name, [*common, "train.steps=6"])
        whole = self.train(
            name,
            [*common, "train.steps=6", "checkpoint.interval=0", f"train.run_dir={self.work}/w"],
        )
        load = next((r["load_s"] for r in resumed["records"] if r.get("kind") == "resume"), None)
        tail = whole["losses"][4:]
        return {
            "ok": bool(saves) and resumed["losses"] == tail,
            "save_seconds": [r["seconds"] for r in saves],
            "async": async_save,
            "load_seconds": load,
            "resumed_losses": resumed["losses"],
            "uninterrupted_losses": tail,
            "resume_bit_identical": resumed["losses"] == tail,
        }

    # -- hp-train eval's scorer (issue 47) ----------------------------------------------------

    def downstream(self) -> dict[str, Any]:
        """The loglikelihoods and greedy flags `hp-train eval` computes for 256 random
        requests of one checkpoint, on the device (fp32 and bf16) against the CPU in fp32;
        requests a second on the device in bf16 (batch 16)."""
        import numpy as np
        from hp_runtime.train.eval_checkpoint import checkpoint_model, stored_config

        name = "downstream"
        self.train(
            name,
            [
                *self.base(name),
                "train.device=cpu",
                f"checkpoint.interval={self.steps}",
                "model.vocab_size=8192",  # the tokenizer's, which eval checks
            ],
        )
        checkpoint = str(self.work / name / "checkpoints" / f"step-{self.steps:07d}")
        draw = np.random.default_rng(0)
        inputs, targets = [], []
        for _ in range(256):
            row = draw.integers(0, 256, int(draw.integers(8, self.seq))).tolist()
            inputs.append(row)
            scored = int(draw.integers(1, 6))  # the row's last scored - 1 tokens and one more
            targets.append(row[len(row) - scored + 1 :] + [int(draw.integers(0, 256))])
        answers, seconds = {}, {}
        for device, precision in (("cpu", "fp32"), (self.device, "fp32"), (self.device, "bf16")):
            config = stored_config(checkpoint, [
                f"train.device={device}", f"train.mixed_precision={precision}",
                "eval.batch_size=16", f"eval.tokenizer={REPO / 'examples' / 'tokenizer.json'}",
            ])  # fmt: skip
            from hp_runtime.train.launch import start

            lm = checkpoint_model(checkpoint, config, start(device, config.train.cpu_threads))
            begin = time.perf_counter()
            answers[(device, precision)] = lm.scorer.logprobs(inputs, targets)
            seconds[(device, precision)] = time.perf_counter() - begin
        reference = np.array(answers[("cpu", "fp32")][0])
        out: dict[str, Any] = {"ok": True}
        for precision, tolerance in (("fp32", FP32_TOL), ("bf16", BF16_TOL)):
            got, greedy = answers[(self.device, precision)]
            error = float(np.max(np.abs(np.array(got) - reference) / np.abs(reference)))
            same = np.mean(np.array(greedy) == np.array(answers[("cpu", "fp32")][1]))
            out[f"{precision}_max_rel_error"] = error
            out[f"{precision}_greedy_agreement"] = float(same)
            out["ok"] &= error <= tolerance
        out["requests_per_s_bf16"] = len(inputs) / seconds[(self.device, "bf16")]
        return out


def compare(got: list[float], expected: list[float], tolerance: float) -> dict[str, Any]:
    errors = [abs(g - e) / max(abs(e), 1e-12) for g, e in zip(got, expected, strict=True)]
    return {
        "ok": bool(errors) and max(errors) <= tolerance,
        "losses": got,
        "reference_losses": expected,
        "max_rel_error": max(errors) if errors else None,
        "tolerance": tolerance,
    }


def figures(record: dict[str, Any]) -> dict[str, Any]:
    return {k: record.get(k) for k in ("tokens_per_s", "mfu", "peak_memory_gib")}


def environment(device: str) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": device,
        "host": platform.node(),
    }
    if device == "cuda" and torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        out |= {
            "gpu": properties.name,
            "gpu_memory_gib": round(properties.total_memory / 2**30, 1),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "bf16": torch.cuda.is_bf16_supported(),
        }
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            out["driver"] = subprocess.run(
                query, capture_output=True, text=True, timeout=20
            ).stdout.strip()
    return out


def parts(check: Check) -> dict[str, Callable[[], dict[str, Any]]]:
    """Every part by name, in the order they run (cheapest and most basic first)."""
    doc = ["data.type=megatron", "data.document_masking=true", "data.split=1,0,0"]
    flex = "flex" if check.device == "cuda" else "auto"  # torch trains flex on CUDA only
    big = ["model.preset=1b"] if not check.tiny else []
    eight = ["model.preset=8b", "model.n_layers=4"] if not check.tiny else []
    float8 = ["train.float8.recipe=tensorwise"] + ([] if eight else ["model.ffn_hidden=128"])
    return {
        "fp32_fused_adamw": lambda: check.path("fp32", [], "fp32"),
        "bf16_autocast": lambda: check.path("bf16", [], "bf16"),
        "fsdp_world1_bf16": check.fsdp_world_one,
        "compile": lambda: check.path("compile", ["parallel.compile=true"], "bf16", []),
        "activation_checkpointing": lambda: check.path(
            "ac", ["parallel.activation_checkpointing=full", "parallel.ac_every=1"], "bf16"
        ),
        # flex's block mask on the device against SDPA's dense mask on the CPU
        "document_masking": lambda: check.path(
            "docmask",
            [*doc, *_corpus(check), f"model.attention={flex}"],
            "bf16",
            [*doc, *_corpus(check), "model.attention=sdpa"],
        ),
        "chunked_loss": lambda: check.path("chunked", ["train.loss_chunk_tokens=16"], "bf16"),
        # Muon's iteration and update on the device against the CPU's (issue 45)
        "muon": lambda: check.path("muon", ["optim.name=muon", "optim.muon.lr=0.02"], "bf16"),
        "speed_1b": lambda: check.speed("speed-1b", big, False),
        "speed_1b_compile": lambda: check.speed("speed-1b-compile", big, True),
        "speed_8b_shaped": lambda: check.speed("speed-8b", eight, False),
        "speed_8b_shaped_compile": lambda: check.speed("speed-8b-compile", eight, True),
        "speed_8b_shaped_muon": lambda: check.speed(
            "speed-8b-muon", [*eight, "optim.name=muon"], False
        ),
        "float8_curve": check.float8_curve,
        "speed_8b_shaped_float8": lambda: check.speed("speed-8b-f8", [*eight, *float8], False),
        "speed_8b_shaped_float8_compile": lambda: check.speed(
            "speed-8b-f8-compile", [*eight, *float8], True
        ),
        "checkpoint_sync": lambda: check.checkpoint(False),
        "checkpoint_async": lambda: check.checkpoint(True),
        "downstream": check.downstream,
        "titan": check.titan,  # opt-in (OPT_IN)
    }


OPT_IN = ("titan",)  # parts that run only when `--only` names them


def _corpus(check: Check) -> list[str]:
    """A small corpus of random documents ending in EOD (id 0), written once with hp-data."""
    from hp_data.format.builder import IndexedDatasetBuilder

    prefix = check.work / "corpus" / "docs"
    if not prefix.with_suffix(".idx").exists():
        prefix.parent.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        builder = IndexedDatasetBuilder(str(prefix), dtype=np.uint16)
        for _ in range(400):
            document = np.append(rng.integers(1, 256, int(rng.integers(4, 3 * check.seq))), 0)
            builder.add_document(document.astype(np.uint16), [len(document)])
        builder.finalize()
    return [f"data.path={prefix}", "data.eod_token=0", "model.vocab_size=256"]


def _text(check: Check) -> list[str]:
    """The example corpus (examples/docstrings.jsonl, its tokenizer), tokenized once: text a
    model learns, where dummy data's random tokens teach only their distribution."""
    examples = REPO / "examples"
    return [
        "data.type=json_file", f"data.path={examples / 'docstrings.jsonl'}",
        f"data.tokenizer={examples / 'tokenizer.json'}", f"data.cache_dir={check.work / 'text'}",
        "model.vocab_size=8192",
    ]  # fmt: skip


def run_part(name: str, part: Callable[[], dict[str, Any]], device: str) -> dict[str, Any]:
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        out = part()
    except BaseException as exc:  # one part's failure is reported; the others still run
        if isinstance(exc, KeyboardInterrupt):
            raise
        out = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500]}
        out["traceback"] = traceback.format_exc()[-4000:]
    out["seconds"] = round(time.perf_counter() - start, 2)
    if device == "cuda":
        out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--out", default="gpu.json", help="the JSON report")
    parser.add_argument("--only", default="", help="comma-separated parts (default: all)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the default on cpu)")
    parser.add_argument("--titan-env", help="the `titan` part: a Python that has torchtitan")
    args = parser.parse_args()

    names = list(parts(Check("cpu", True, REPO)))
    wanted = [p for p in args.only.split(",") if p] or [n for n in names if n not in OPT_IN]
    unknown = [p for p in wanted if p not in names]
    if unknown:  # before torch loads: a typo costs nothing
        print(f"check.py: --only {unknown[0]}: choose from {', '.join(names)}", file=sys.stderr)
        return 2

    import torch
    import torch.distributed as dist

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("check.py: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    # One process group for every part: gloo for the CPU references, NCCL on the GPU.
    backend = "cpu:gloo,cuda:nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    with tempfile.TemporaryDirectory(prefix="hp-gpu-check-") as work:
        check = Check(device, args.tiny or device == "cpu", Path(work))
        check.titan_env = args.titan_env
        table = parts(check)
        report: dict[str, Any] = {"environment": environment(device), "parts": {}}
        print(json.dumps(report["environment"]))
        for name in wanted:
            result = run_part(name, table[name], device)
            report["parts"][name] = result
            print(_row(name, result), flush=True)
            _write(args.out, report)
    failed = [n for n, r in report["parts"].items() if not r["ok"]]
    verdict = f"; failed: {', '.join(failed)}" if failed else ""
    print(f"check.py: {len(wanted) - len(failed)} of {len(wanted)} parts passed{verdict}; "
          f"report in {args.out}")  # fmt: skip
    dist.destroy_process_group()
    return 1 if failed else 0


def _row(name: str, result: dict[str, Any]) -> str:
    status = "ok  " if result["ok"] else "FAIL"
    bits = [f"{status} {name:<26} {result['seconds']:7.1f} s"]
    if result.get("max_rel_error") is not None:
        bits.append(f"rel err {result['max_rel_error']:.2e} (tol {result['tolerance']:g})")
    if result.get("tokens_per_s"):
        bits.append(f"{result['tokens_per_s']:,.0f} tok/s")
    if result.get("mfu") is not None:
        bits.append(f"MFU {result['mfu']:.1%}")
    if result.get("peak_memory_gib") is not None:
        bits.append(f"peak {result['peak_memory_gib']:.2f} GiB")
    if result.get("save_seconds"):
        bits.append(f"save {result['save_seconds']} s, load {result['load_seconds']} s")
    if "error" in result:
        bits.append(result["error"])
    return " | ".join(bits)


def _write(path: str, report: dict[str, Any]) -> None:
    """The report so far, replaced whole (a part that hangs leaves the earlier ones)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        json.dump(report, handle, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
