"""hp-train against torchtitan's own trainer, side by side in one run.

    uv run python tools/bench/bench_titan.py     # layouts 1 and fsdp2, about 6 minutes on 2 cores
    uv run python tools/bench/bench_titan.py --rounds 3 --malloc keep   # both keep freed memory

Both sides train the same Llama shape (`--preset`, default `small`) from the same initial
weights on the same token batches: hp-train as `hp-train` runs it (torchrun, its TOML keys as
overrides), torchtitan as its `Trainer` runs it (its `Trainer.Config`, model, parallelize
function, optimizer and LR-scheduler builders, loss, clipping, `train_step` and `train()` loop),
each layout in turn, alternating `--rounds` times; medians compared. Printed per layout:
steady-state tokens/s (after `--warmup` steps), peak memory (the largest rank's: peak resident
set on CPU, `max_memory_allocated` on CUDA), their ratios hp / torchtitan, and each side's
losses of the first steps with their difference.

`--malloc` sets each side's C-library memory policy on CPU, as in bench_train.py: `shipped`
(default) as each comes, hp-train keeping freed memory (`train.cpu_keep_freed_memory`, on by
default) and torchtitan with glibc's default; `keep`, both keeping it (torchtitan's ranks call
hp's `launch.keep_freed_memory`): the trainers like for like; `system`, glibc's default for both.
`--hp KEY=VALUE` (repeatable) adds an hp-train key, e.g. `train.loss_chunk_tokens=128` (hp's
loss in 8 chunks, as torchtitan's); torchtitan's ranks read hp's config too, so a key of the
shape, the data or the optimizer changes both sides.

torchtitan is a dev-only reference: it is not in uv.lock. Its side runs in uv's overlay
environment, `uv run --with torchtitan==0.3.0` (resolved with torchtitan's own pins: the lock's
torch and numpy, an older `datasets`, `fsspec` and `huggingface_hub`; cached after the first
run); `--titan-env PYTHON` runs it with another interpreter that has torchtitan and hp's
packages instead (a machine without PyPI). hp-train runs in the locked environment.

What is made equal (docs/benchmarks.md has the list): vocabulary, dim, layers, heads, kv heads,
ffn width, rope theta, norm eps, tied or untied embeddings, sequence, micro-batch and global
batch; AdamW's lr, betas, eps and weight decay (torchtitan's param groups set to leave the
norms and the embedding undecayed, as hp does); the LR schedule (torchtitan's linear warmup and
linear decay; hp's `wsd` keys set to the same rates, which the run checks step by step);
clipping at `train.max_norm`; fp32 on CPU (bf16 compute on CUDA, each its own way); no
activation checkpointing, no compile. The weights: hp's initial tensors (`train.seed`) under
HF's names (hp's `hf_names`), then torchtitan's (its `Llama3StateDictAdapter.from_hf`, which
permutes q and k for its interleaved rotary, and its fused-qkv merge). The batches: hp's own
dataset, sampler and DataLoader, handed to torchtitan's trainer by a small `BaseDataLoader`.
Each side keeps its own defaults otherwise: torchtitan its fused qkv projection, complex
rotary, FSDP at world size 1, chunked loss (8 chunks, as its llama3 configs), fused AdamW and
float32 clipping norm; hp its three projections, no FSDP on one process, one loss chunk per
1,024 tokens, foreach AdamW on CPU and float64 norm.

torchtitan on CPU, where it does not run as shipped: (1) it takes "cuda" for its device when
torch sees no accelerator (`tools/utils.get_device_info`), so each rank first sets its device
to the CPU, with the memory calls its metrics make of a device module answered from the
resident set (`CpuDevice`); (2) it sets FSDP's gradient divide factor to 1, for which torch
reduce-scatters with PREMUL_SUM, which gloo lacks ("Cannot use ReduceOp.PREMUL_SUM with
Gloo"): each FSDP module gets torch's `set_force_sum_reduction_for_comms(True)`, the same sum;
(3) its language-model attention backends are flex (torch: "FlexAttention does not support
backward on CPU") and varlen (CUDA flash kernels): its SDPA module runs instead (causal, no
document masks), which is what hp runs without `data.document_masking`. The rest runs as it
ships.

GPU layouts (`--device cuda`, one machine): `1`, `fsdp8` (8 ranks) and `tp2` (2 ranks,
sequence parallel and the vocabulary-parallel loss on both sides; it runs on CPU too); bf16
compute (torchtitan's FSDP mixed-precision policy, hp's own policy when sharded and autocast on
one process); torchtitan keeps its CUDA graphs (`--no-cuda-graphs` turns them off).
`tools/gpu/check.py --only titan` runs layout `1` with the `1b` preset.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import REPO, preprocess, torchrun

TITAN = "torchtitan==0.3.0"
MARK = "BENCH_TITAN "  # the line a torchtitan rank 0 prints its figures on
# Each layout: ranks, hp-train's keys, torchtitan's ParallelismConfig fields.
LAYOUTS: dict[str, tuple[int, list[str], dict[str, int]]] = {
    "1": (1, [], {"data_parallel_shard_degree": 1}),
    "fsdp2": (2, ["parallel.dp_shard=2"], {"data_parallel_shard_degree": 2}),
    "fsdp8": (8, ["parallel.dp_shard=8"], {"data_parallel_shard_degree": 8}),
    # torchtitan's TP always takes the loss vocabulary-parallel; hp's does with this key
    "tp2": (
        2,
        ["parallel.tp=2", "parallel.loss_parallel=true"],
        {"data_parallel_shard_degree": 1, "tensor_parallel_degree": 2},
    ),
}
FIRST = 5  # the first steps whose losses are printed side by side
SETUP = (
    *("device", "preset", "steps", "rounds", "warmup", "lr_warmup", "seq", "mbs", "malloc"),
    *("hp", "no_cuda_graphs"),
)


def threads_for(args: argparse.Namespace, nproc: int) -> int:
    return args.threads or max(1, (os.cpu_count() or 1) // nproc)


def hp_overrides(args: argparse.Namespace, layout: str, run_dir: str) -> list[str]:
    """hp-train's keys for `layout`; torchtitan's rank reads the same ones (its shape, data,
    optimizer and schedule come from hp's config)."""
    nproc, keys, _ = LAYOUTS[layout]
    w, t = args.lr_warmup, args.steps
    return [
        f"model.preset={args.preset}", f"model.max_seq_len={args.seq}",
        "data.type=megatron", f"data.path={args.prefix}", "data.split=1,0,0",
        f"data.seq_length={args.seq}", f"data.cache_dir={args.cache}", *keys,
        f"train.steps={t}", f"train.micro_batch_size={args.mbs}", "train.seed=0",
        f"train.device={args.device}", f"train.cpu_threads={threads_for(args, nproc)}",
        f"train.mixed_precision={'fp32' if args.device == 'cpu' else 'bf16'}",
        f"train.cpu_keep_freed_memory={str(args.malloc != 'system').lower()}",
        f"train.run_dir={run_dir}", "train.max_norm=1.0",
        "optim.lr=3e-4", "optim.min_lr=3e-5", f"optim.warmup_steps={w}",
        # torchtitan's linear decay holds the peak one step after warmup, then reaches the
        # floor at the last step: hp's wsd with this span and fraction gives the same rates
        "optim.decay_style=wsd", "optim.wsd_decay_shape=linear",
        f"optim.decay_steps={t - w + 1}", f"optim.wsd_decay_fraction={(t - w) / (t - w + 1)!r}",
        "optim.weight_decay=0.1", "optim.beta1=0.9", "optim.beta2=0.95", "optim.eps=1e-8",
        "metrics.log_interval=1", "metrics.plot=false", "metrics.tensorboard=false",
        "checkpoint.interval=0", *args.hp,
    ]  # fmt: skip


# --- torchtitan's side (one rank, under torchrun, in the environment that has torchtitan) ---


class CpuDevice:
    """torch.cpu as torchtitan's device module, with what its metrics ask of one (a name, the
    memory size, peak memory statistics: the process's peak resident set)."""

    def __getattr__(self, name: str):
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(device: object = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: object = None):
        from types import SimpleNamespace

        return SimpleNamespace(
            total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        )

    @staticmethod
    def memory_stats(device: object = None) -> dict[str, int]:
        peak = peak_rss_bytes()
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}

    @staticmethod
    def reset_peak_memory_stats(device: object = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def titan_model(model):  # hp's ModelConfig -> torchtitan's Llama3Model.Config
    """torchtitan's llama3 model config of hp's shape: its own layer builder (fused qkv, the
    complex rotary), with its SDPA inner attention instead of flex."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    unsupported = {
        "model.moe": model.moe is not None,
        "model.qk_norm": model.qk_norm,
        "model.head_dim": model.head_dim is not None,
        "model.rope_scaling": model.rope_scaling is not None,
    }
    for key, used in unsupported.items():
        if used:
            sys.exit(f"bench_titan: {key} is not mapped onto torchtitan's llama3 here")
    rope = ComplexRoPE.Config(
        dim=model.head_size, max_seq_len=model.max_seq_len, theta=model.rope_theta
    )
    layers = _build_llama3_layers(
        n_layers=model.n_layers,
        dim=model.dim,
        n_heads=model.n_heads,
        n_kv_heads=model.n_kv_heads,
        hidden_dim=model.ffn_hidden,
        rope=rope,
        fuse_qkv=True,
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention_norm.eps = layer.ffn_norm.eps = model.norm_eps
    return Llama3Model.Config(
        dim=model.dim,
        vocab_size=model.vocab_size,
        tok_embeddings=Embedding.Config(
            num_embeddings=model.vocab_size, embedding_dim=model.dim, param_init=_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=model.dim, eps=model.norm_eps, param_init=_NORM_INIT),
        lm_head=Linear.Config(
            in_features=model.dim,
            out_features=model.vocab_size,
            param_init=_output_linear_init(model.dim),
        ),
        layers=layers,
        enable_weight_tying=model.tie_embeddings,
    )


def hp_weights_into_titan(module, model, titan_config, seed: int) -> None:
    """hp's initial weights (`initial_tensor`, as hp-train draws them from `train.seed`) into
    torchtitan's model `module`, sharded or not: hp's names -> HF's (hp's `hf_names`) ->
    torchtitan's (its adapter's `from_hf`, then its fused-qkv merge)."""
    import torch
    from hp_runtime.model import Transformer, initial_tensor
    from hp_runtime.parallel.init import copy_full_
    from hp_runtime.train.hf_families import export_family
    from hp_runtime.train.hf_names import hf_names
    from torchtitan.components.checkpointer.utils import canonical_fqn
    from torchtitan.models.common.attention import FusedQKVLinear
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Transformer(model).named_parameters()}
    family = export_family(model)
    hf = {
        hf_names(family, model, n)[0]: initial_tensor(model, n, s, seed) for n, s in shapes.items()
    }
    state = Llama3StateDictAdapter(titan_config, None).from_hf(hf)
    if titan_config.enable_weight_tying:  # one parameter, named after the embedding
        del state["lm_head.weight"]
    for name, sub in module.named_modules():
        if isinstance(sub, FusedQKVLinear):
            FusedQKVLinear._merge_qkv_on_load(sub, state, canonical_fqn(name) + ".")
    for name, param in module.named_parameters():
        copy_full_(param, state.pop(canonical_fqn(name)))
    if state:
        raise RuntimeError(f"hp tensors without a torchtitan parameter: {sorted(state)}")


def titan_rank(args: argparse.Namespace) -> None:
    """One rank of torchtitan's Trainer on hp's shape, weights and batches."""
    import torch

    if args.device == "cpu":
        torch.set_num_threads(threads_for(args, int(os.environ["WORLD_SIZE"])))
        if args.malloc == "keep":
            from hp_runtime.train.launch import keep_freed_memory

            keep_freed_memory()
        import torchtitan.tools.utils as titan_utils  # before anything reads its device

        titan_utils.device_type, titan_utils.device_module = "cpu", CpuDevice()

    from dataclasses import dataclass, field

    import torch.distributed as dist
    from hp_data.sampler import PretrainingSampler
    from hp_data.torch_adapter import make_dataloader
    from hp_runtime.train import load_config
    from hp_runtime.train.batch import batch_plan
    from hp_runtime.train.data import resolve_data
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import (
        LRSchedulersContainer,
        OptimizersContainer,
        ParamGroupConfig,
    )
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import Llama3StateDictAdapter, parallelize_llama
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    hp = load_config(None, hp_overrides(args, args.layout, args.run_dir))
    workers = 1 if (os.cpu_count() or 1) > 1 else 0  # hp's Loader's default

    class HpBatches(BaseDataLoader):
        """hp's micro-batches (its dataset, sampler and DataLoader) as torchtitan's trainer
        takes them: ({"input": tokens}, labels), IGNORE where hp's loss_mask is 0."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            overrides: list[str] = field(default_factory=list)

        def __init__(self, config, *, dp_world_size, dp_rank, local_batch_size, **kwargs):
            rank = dist.get_rank()
            if rank:  # rank 0 builds the index caches first (tensor-parallel ranks read too)
                dist.barrier()
            dataset = resolve_data(hp, batch_plan(hp)).build("train")
            if not rank and dist.get_world_size() > 1:
                dist.barrier()
            sampler = PretrainingSampler(len(dataset), 0, local_batch_size, dp_rank, dp_world_size)
            self.loader = make_dataloader(
                dataset, sampler, num_workers=workers, pin_memory=args.device == "cuda"
            )

        def __iter__(self):
            for batch in self.loader:
                labels = batch["labels"].masked_fill(batch["loss_mask"] == 0, IGNORE_INDEX)
                yield {"input": batch["tokens"]}, labels

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict) -> None:
            pass

    model_config = titan_model(hp.model)
    o, t = hp.optim, hp.train
    adamw = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps}
    parallelism = LAYOUTS[args.layout][2]
    config = Trainer.Config(
        model_spec=ModelSpec(
            name="llama3",
            flavor=f"hp-{args.preset}",
            model=model_config,
            parallelize_fn=parallelize_llama,
            pipelining_fn=pipeline_llm,
            post_optimizer_build_fn=None,
            state_dict_adapter=Llama3StateDictAdapter,
        ),
        hf_assets_path=str(REPO / "examples"),  # the tokenizer the corpus was made with
        dump_folder=args.run_dir,
        # as every llama3 config of torchtitan's: the head and loss a chunk of the sequence at
        # a time (8 chunks), each chunk's backward at once
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=hp.model.vocab_size)
        ),
        optimizer=OptimizersContainer.Config(
            param_groups=[  # hp decays neither the norms nor the embedding
                ParamGroupConfig(
                    pattern=r"norm\.weight$|^tok_embeddings\.weight$",
                    optimizer_name="AdamW",
                    optimizer_kwargs={**adamw, "weight_decay": 0.0},
                ),
                ParamGroupConfig(
                    pattern=r".*",
                    optimizer_name="AdamW",
                    optimizer_kwargs={**adamw, "weight_decay": o.weight_decay},
                ),
            ]
        ),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=o.warmup_steps, decay_type="linear", min_lr_factor=o.min_lr / o.lr
        ),
        training=TrainingConfig(
            local_batch_size=t.micro_batch_size,
            seq_len=args.seq,
            max_norm=t.max_norm,
            steps=t.steps,
            dtype="float32",
            mixed_precision_param="float32" if args.device == "cpu" else "bfloat16",
            disable_cuda_graphs=args.device == "cpu" or args.no_cuda_graphs,
        ),
        parallelism=ParallelismConfig(**parallelism),
        activation_checkpoint=None,
        compile=CompileConfig(enable=False),
        metrics=MetricsProcessor.Config(log_freq=1),
        dataloader=HpBatches.Config(),
    )
    trainer = Trainer(config)
    hp_weights_into_titan(trainer.model_parts[0], hp.model, model_config, t.seed)
    if args.device == "cpu":
        # torchtitan sets FSDP's gradient divide factor to 1 (its loss is already divided by
        # the global token count), for which torch reduce-scatters with PREMUL_SUM(1.0): gloo
        # has no PREMUL_SUM. torch's own switch for a plain SUM (the one torchtitan's
        # symmetric-memory option sets on GPUs) gives the same gradients.
        from torch.distributed.fsdp import FSDPModule

        for module in trainer.model_parts[0].modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    losses, norms, rates, times, peaks = [], [], [], [], [0]
    log, train_step = trainer.metrics_processor.log, trainer.train_step

    def logged(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        if args.device == "cuda":  # before torchtitan's log resets the peak
            peaks.append(torch.cuda.max_memory_allocated())
        losses.append(float(global_avg_loss))
        norms.append(float(grad_norm))
        rates.append(next(v for k, v in (extra_metrics or {}).items() if k.startswith("lr/")))
        return log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    def timed(data_iterator):
        train_step(data_iterator)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter())

    trainer.metrics_processor.log, trainer.train_step = logged, timed
    trainer.train()
    if args.device == "cuda":
        memory = torch.tensor(float(max(peaks)), device="cuda")
    else:
        memory = torch.tensor(float(peak_rss_bytes()))
    dist.all_reduce(memory, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        figures = {
            "losses": losses,
            "grad_norms": norms,
            "lrs": rates,
            "times": times,
            "peak_gib": memory.item() / 2**30,
        }
        print(MARK + json.dumps(figures), flush=True)
    trainer.close()
    dist.destroy_process_group()


# --- the driver -------------------------------------------------------------------------------


def titan_launcher(args: argparse.Namespace) -> tuple[str, ...]:
    if args.titan_env:
        return (args.titan_env, "-m", "torch.distributed.run")
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        sys.exit("bench_titan: needs uv (for torchtitan's overlay) or --titan-env PYTHON")
    return (uv, "run", "--frozen", "--with", TITAN, "python", "-m", "torch.distributed.run")


def run_hp(args: argparse.Namespace, layout: str, run_dir: str) -> dict:
    nproc = LAYOUTS[layout][0]
    torchrun(
        "-m",
        "hp_runtime.train",
        *hp_overrides(args, layout, run_dir),
        nproc=nproc,
        threads=threads_for(args, nproc),
    )
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if r.get("kind") == "train"]
    return {
        "losses": [r["loss"] for r in steps],
        "grad_norms": [r["grad_norm"] for r in steps],
        "lrs": [r["lr"] for r in steps],
        "times": [r["elapsed_s"] for r in steps],
        "peak_gib": max(r["peak_memory_gib"] for r in steps),
    }


def run_titan(args: argparse.Namespace, layout: str, run_dir: str) -> dict:
    nproc = LAYOUTS[layout][0]
    done = torchrun(
        __file__, "--titan-rank", f"--layout={layout}", f"--run-dir={run_dir}",
        f"--prefix={args.prefix}", f"--cache={args.cache}", f"--preset={args.preset}",
        f"--steps={args.steps}", f"--lr-warmup={args.lr_warmup}", f"--seq={args.seq}",
        f"--mbs={args.mbs}", f"--threads={args.threads}", f"--malloc={args.malloc}",
        f"--device={args.device}", *(f"--hp={key}" for key in args.hp),
        *(["--no-cuda-graphs"] if args.no_cuda_graphs else []),
        nproc=nproc, threads=threads_for(args, nproc), launcher=titan_launcher(args),
    )  # fmt: skip
    line = next(x for x in reversed(done.stdout.splitlines()) if x.startswith(MARK))
    return json.loads(line[len(MARK) :])


def tokens_per_s(args: argparse.Namespace, layout: str, times: list[float]) -> float:
    """Steady state: the steps after `--warmup` over the time they took."""
    nproc, keys, _ = LAYOUTS[layout]
    dp = 1 if any(k.startswith("parallel.tp") for k in keys) else nproc
    steps = len(times) - args.warmup
    return steps * args.mbs * dp * args.seq / (times[-1] - times[args.warmup - 1])


def summary(args: argparse.Namespace, layout: str, runs: dict[str, list[dict]]) -> dict:
    """One layout's figures: medians over the rounds; the losses of the first round (every
    round trains the same numbers)."""
    speed = {side: [tokens_per_s(args, layout, r["times"]) for r in runs[side]] for side in runs}
    ratios = [h / t for h, t in zip(speed["hp"], speed["titan"], strict=True)]
    memory = {side: statistics.median(r["peak_gib"] for r in runs[side]) for side in runs}
    hp, titan = runs["hp"][0], runs["titan"][0]
    pairs = list(zip(hp["losses"], titan["losses"], strict=True))
    return {
        "ranks": LAYOUTS[layout][0],
        "tokens_per_s": {side: statistics.median(v) for side, v in speed.items()},
        "tokens_per_s_ratio": statistics.median(ratios),
        "peak_memory_gib": memory,
        "peak_memory_ratio": memory["hp"] / memory["titan"],
        "losses": {"hp": hp["losses"], "titan": titan["losses"]},
        "loss_max_abs_diff": max(abs(h - t) for h, t in pairs),
        "grad_norm_step1": {"hp": hp["grad_norms"][0], "titan": titan["grad_norms"][0]},
        "lr_max_rel_diff": max(
            abs(h - t) / t for h, t in zip(hp["lrs"], titan["lrs"], strict=True)
        ),
        "rounds": {
            "tokens_per_s": speed,
            "ratios": ratios,
            "peak_memory_gib": {side: [r["peak_gib"] for r in runs[side]] for side in runs},
        },
    }


def report(args: argparse.Namespace, layout: str, s: dict) -> None:
    speed, memory, losses = s["tokens_per_s"], s["peak_memory_gib"], s["losses"]
    print(f"layout {layout}: medians of {args.rounds} rounds")
    print(f"{'':34}{'hp-train':>14}{'torchtitan':>14}{'hp / titan':>12}")
    print(
        f"{'tokens/s (steady)':34}{speed['hp']:14.0f}{speed['titan']:14.0f}"
        f"{s['tokens_per_s_ratio']:12.3f}"
    )
    label = "peak memory, GiB (largest rank)"
    print(f"{label:34}{memory['hp']:14.3f}{memory['titan']:14.3f}{s['peak_memory_ratio']:12.3f}")
    for i in range(min(FIRST, args.steps)):
        h, t = losses["hp"][i], losses["titan"][i]
        print(f"{f'loss, step {i + 1}':34}{h:14.6f}{t:14.6f}{'diff':>6}{h - t:+.1e}")
    norms = s["grad_norm_step1"]
    print(
        f"  loss, largest |difference| over {args.steps} steps {s['loss_max_abs_diff']:.1e}; "
        f"grad norm of step 1 {norms['hp']:.6f} / {norms['titan']:.6f}; learning rates, "
        f"largest relative difference {s['lr_max_rel_diff']:.1e}"
    )
    rounds = s["rounds"]
    pairs = zip(rounds["tokens_per_s"]["hp"], rounds["tokens_per_s"]["titan"], strict=True)
    print(
        "  rounds, tokens/s (hp / titan): "
        + "; ".join(f"{h:.0f} / {t:.0f}" for h, t in pairs)
        + "; peak GiB hp "
        + ", ".join(f"{m:.3f}" for m in rounds["peak_memory_gib"]["hp"])
        + ", titan "
        + ", ".join(f"{m:.3f}" for m in rounds["peak_memory_gib"]["titan"]),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default=None, help="of 1, fsdp2, fsdp8, tp2")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of tokens/s")
    parser.add_argument("--lr-warmup", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--mbs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="per rank on CPU; 0: cores/ranks")
    parser.add_argument("--malloc", choices=["shipped", "keep", "system"], default="shipped")
    parser.add_argument("--titan-env", help="a Python with torchtitan (default: uv's overlay)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--hp", action="append", default=[], metavar="KEY=VALUE", help="one more hp-train key"
    )
    parser.add_argument(
        "--no-cuda-graphs", action="store_true", help="torchtitan without its CUDA graphs"
    )
    parser.add_argument("--titan-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.titan_rank:
        titan_rank(args)
        return
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    layouts = (args.layouts or ("1,fsdp2" if args.device == "cpu" else "1")).split(",")
    for layout in layouts:
        if layout not in LAYOUTS:
            sys.exit(f"bench_titan: --layouts {layout}: choose from {', '.join(LAYOUTS)}")
    if not 0 < args.warmup < args.steps or not 0 < args.lr_warmup < args.steps:
        sys.exit("bench_titan: --warmup and --lr-warmup must lie between 0 and --steps")
    with tempfile.TemporaryDirectory() as work:
        args.prefix, args.cache = preprocess(work), f"{work}/cache"
        print(
            f"{args.preset} model, {args.device}, micro-batch {args.mbs} x {args.seq} tokens, "
            f"{args.steps} steps, steady state after {args.warmup}, malloc {args.malloc}; "
            f"torchtitan: {args.titan_env or 'uv run --with ' + TITAN}",
            flush=True,
        )
        results: dict = {"setup": {k: v for k, v in vars(args).items() if k in SETUP}}
        results["layouts"] = {}
        for layout in layouts:
            nproc = LAYOUTS[layout][0]
            print(f"layout {layout}: {nproc} rank(s) x {threads_for(args, nproc)} thread(s)")
            runs: dict[str, list[dict]] = {"hp": [], "titan": []}
            for _ in range(args.rounds):
                runs["hp"].append(run_hp(args, layout, f"{work}/hp-{time.monotonic_ns()}"))
                runs["titan"].append(run_titan(args, layout, f"{work}/tt-{time.monotonic_ns()}"))
                hp_s = tokens_per_s(args, layout, runs["hp"][-1]["times"])
                titan_s = tokens_per_s(args, layout, runs["titan"][-1]["times"])
                print(
                    f"  round: hp {hp_s:.0f}, torchtitan {titan_s:.0f} tokens/s, ratio "
                    f"{hp_s / titan_s:.3f} (load average {os.getloadavg()[0]:.2f})",
                    flush=True,
                )
            results["layouts"][layout] = summary(args, layout, runs)
            report(args, layout, results["layouts"][layout])
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
