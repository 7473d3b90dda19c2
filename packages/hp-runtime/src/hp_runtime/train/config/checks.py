"""Relations between keys that no single key's range expresses, checked once every key is
read (`check`), and the layout against the world and device a run starts on (`check_layout`);
each a one-line `ConfigError` naming the keys and what to do."""

from __future__ import annotations

import importlib.util
import math
import re

from hp_data.registry import dataset_type

from hp_runtime.parallel.options import MULTIPLE
from hp_runtime.train.config.messages import _shown
from hp_runtime.train.config.schema import Config, MetricsConfig
from hp_runtime.train.errors import ConfigError

MAX_PARAMS = 2**40  # ~1.1e12 parameters: past any dense model, far before an int64 overflows


def check(config: Config) -> None:
    """Relations between keys that no single range expresses (each key's own range is checked
    as it is read, from `RANGES`)."""
    data = config.data
    kind = dataset_type(data.type)
    if kind.needs_path and not data.path and not data.phases:
        raise ConfigError(f"data.path: required for data.type = {data.type!r}")
    if kind.needs_tokenizer and not data.tokenizer:
        raise ConfigError(f"data.tokenizer: required for data.type = {data.type!r}")
    check_length("data.seq_length", data.seq_length, config)
    vocab = config.model.vocab_size
    if data.eod_token is not None and not 0 <= data.eod_token < vocab:
        raise ConfigError(
            f"data.eod_token = {data.eod_token} is not a token id of model.vocab_size = {vocab}: "
            f"give an id from 0 to {vocab - 1}"
        )
    optim = config.optim
    if optim.min_lr > optim.lr:
        raise ConfigError(f"optim.min_lr={optim.min_lr} must be between 0 and optim.lr={optim.lr}")
    if optim.muon is not None and optim.name != "muon":
        raise ConfigError(
            f"optim.muon is set, but optim.name = {optim.name!r}: set optim.name = 'muon', or "
            "leave optim.muon unset"
        )
    model = config.model
    if model.num_params() > MAX_PARAMS:
        moe = model.moe
        experts = (
            ""
            if moe is None
            else f", moe.experts={moe.experts}, moe.expert_ffn_hidden={moe.expert_ffn_hidden}, "
            f"moe.shared_experts={moe.shared_experts}"
        )
        mla = model.mla
        if mla is not None:  # latent attention's widths shape it too
            experts += "".join(f", mla.{k}={v}" for k, v in vars(mla).items() if v is not None)
        raise ConfigError(
            f"model: {model.num_params():.3g} parameters (model.dim={model.dim}, n_layers="
            f"{model.n_layers}, ffn_hidden={model.ffn_hidden}, vocab_size={model.vocab_size}"
            f"{experts}) is more than hp-train's {MAX_PARAMS:.3g}"
        )
    if model.attention == "segments" and data.document_masking and config.parallel.compile:
        raise ConfigError(
            "model.attention = 'segments' reads document boundaries on the host, which a "
            "compiled block cannot: use model.attention = 'auto', or parallel.compile = false"
        )
    check_profile(config.metrics)
    check_moe(config)
    check_phases(config)
    check_float8(config)
    check_eval(config)
    check_fault_tolerance(config)


def check_eval(config: Config) -> None:
    """`[eval]`: lm-eval installed, a tokenizer to turn the tasks' text into ids, and a layout
    that keeps each sequence whole on a rank (`train/scorer.py`)."""
    ev = config.eval
    if not ev.tasks:
        return
    if any(not name.strip() for name in ev.tasks):
        raise ConfigError("eval.tasks: a task name is empty; give lm-eval task names or files")
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            "eval.tasks: downstream evaluation needs lm-evaluation-harness: "
            "pip install 'hp-runtime[eval]'"
        )
    if ev.tokenizer is None and config.data.tokenizer is None:
        raise ConfigError(
            "eval.tokenizer: required for eval.tasks (data.tokenizer is not set): give the "
            "tokenizer the model was trained with (a tokenizer.json, a directory, a hub name)"
        )
    check_eval_layout(config.parallel.pp, config.parallel.cp, "eval.tasks")


def check_fault_tolerance(config: Config) -> None:
    """`parallel.fault_tolerance` (`train/replicas.py`): torchft installed, this group one of
    the groups, a layout whose replicas are the groups."""
    ft, p = config.parallel.fault_tolerance, config.parallel
    if ft is None:
        return
    key = "parallel.fault_tolerance"
    if ft.replica_group >= ft.groups:
        raise ConfigError(
            f"{key}.replica_group = {ft.replica_group} is not one of groups = {ft.groups} "
            f"(0 to {ft.groups - 1}): give each torchrun job its own group number"
        )
    if ft.min_replicas > ft.groups:
        raise ConfigError(
            f"{key}.min_replicas = {ft.min_replicas} is more than groups = {ft.groups}: no "
            "step could commit"
        )
    if ft.lighthouse is not None and not re.fullmatch(r"https?://[^/\s:]+:\d+/?", ft.lighthouse):
        raise ConfigError(
            f"{key}.lighthouse = {_shown(ft.lighthouse)}: give the lighthouse's URL, "
            "http://HOST:PORT (what torchft_lighthouse prints)"
        )
    if p.dp_replicate > 1 or p.pp > 1:
        raise ConfigError(
            f"{key}: the replica groups are the run's replicas: set parallel.dp_replicate = 1 "
            f"and parallel.pp = 1 (got {p.dp_replicate} and {p.pp}); shard inside a group "
            "with dp_shard and tp"
        )
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(f"{key}: replica groups need torchft: pip install 'hp-runtime[ft]'")


def check_eval_layout(pp: int, cp: int, key: str) -> None:
    """Downstream evaluation reads each sequence's logits whole on one rank."""
    if pp > 1 or cp > 1:
        raise ConfigError(
            f"{key}: downstream evaluation runs on layouts without a pipeline or context "
            f"parallelism (parallel.pp = {pp}, parallel.cp = {cp}): evaluate the checkpoints "
            "with hp-train eval and parallel.pp=1 parallel.cp=1"
        )


def check_float8(config: Config) -> None:
    """`train.float8` against the layout and the other keys (`parallel/float8.py`)."""
    float8, p = config.train.float8, config.parallel
    if float8 is None:
        return
    if float8.fsdp_all_gather and float8.recipe != "tensorwise":
        raise ConfigError(
            f"train.float8.fsdp_all_gather = true needs recipe = 'tensorwise' (torchao gathers "
            f"one scale a tensor), not {float8.recipe!r}: set fsdp_all_gather = false"
        )
    if float8.fsdp_all_gather and p.dp_shard * p.cp == 1:
        raise ConfigError(
            "train.float8.fsdp_all_gather = true needs FSDP, and parallel.dp_shard x cp = 1 "
            "shards no weight: set it false, or parallel.dp_shard > 1"
        )
    if float8.fsdp_all_gather and float8.round_scales_to_power_of_2:
        raise ConfigError(
            "train.float8.round_scales_to_power_of_2 = true cannot go with fsdp_all_gather = "
            "true (torchao precomputes the all-gather's scales unrounded): set one false"
        )
    if float8.recipe == "mxfp8" and float8.round_scales_to_power_of_2 is False:
        raise ConfigError(
            "train.float8.round_scales_to_power_of_2 = false: mxfp8's scales are powers of two "
            "by its format; leave the key unset"
        )
    moe = config.model.moe
    if float8.fsdp_all_gather and p.tp > 1 and moe is not None and moe.shared_experts:
        raise ConfigError(
            "train.float8.fsdp_all_gather = true cannot go with model.moe.shared_experts under "
            "parallel.tp > 1 yet (the shared experts are whole on each tp rank, the other "
            "linears split, and torchao precomputes all their scales in one collective): set "
            "fsdp_all_gather = false"
        )
    tokens = config.train.micro_batch_size * config.data.seq_length // p.cp
    if tokens % MULTIPLE[float8.recipe]:
        raise ConfigError(
            f"train.float8: a micro-batch's tokens on a rank (train.micro_batch_size x "
            f"data.seq_length / parallel.cp = {tokens}) must be a multiple of "
            f"{MULTIPLE[float8.recipe]}: the weight gradients' float8 matmul runs over them; "
            "change data.seq_length or train.micro_batch_size"
        )
    if float8.recipe == "mxfp8" and p.tp > 1:
        raise ConfigError(
            "train.float8.recipe = 'mxfp8' cannot go with parallel.tp > 1 yet (torchao's MX "
            "linears do not train under TP as on one process): use 'tensorwise' or 'rowwise', "
            "or parallel.tp = 1"
        )


def check_length(key: str, length: int, config: Config) -> None:
    """A sequence length (`data.seq_length`, a phase's) against the model and the layout."""
    mtp = config.model.mtp
    if mtp is not None and mtp.depth >= length:
        raise ConfigError(
            f"{key}={length} is not more than model.mtp.depth={mtp.depth}: prediction module "
            "k predicts the token k + 1 ahead within a sample; lower the depth or lengthen it"
        )
    if length > config.model.max_seq_len:
        raise ConfigError(
            f"{key}={length} is longer than model.max_seq_len="
            f"{config.model.max_seq_len}; raise model.max_seq_len or shorten the sequences"
        )
    cp = config.parallel.cp
    if cp > 1 and length % (2 * cp):
        raise ConfigError(
            f"{key}={length} does not divide into 2 x parallel.cp = {2 * cp} "
            f"equal chunks (context parallelism gives each rank two); make it a multiple of "
            f"{2 * cp}"
        )
    tp = config.parallel.tp
    if cp == 1 and length % tp:
        raise ConfigError(
            f"{key}={length} is not divisible by parallel.tp="
            f"{tp} (sequence parallel splits the sequence)"
        )
    if cp > 1 and (length // cp) % tp:
        raise ConfigError(
            f"{key}={length} / parallel.cp={cp} = {length // cp} "
            f"rows a context-parallel rank, not divisible by parallel.tp={tp} (sequence "
            f"parallel splits them); make {key} a multiple of {math.lcm(2 * cp, cp * tp)}"
        )


def check_phases(config: Config) -> None:
    """`[[data.phases]]` against the other keys (where each starts needs the batch plan:
    `hp_runtime.train.batch.phase_starts`)."""
    data = config.data
    if not data.phases:
        return
    if data.type != "megatron":
        raise ConfigError(
            f"data.phases: only with data.type = 'megatron' (each phase names a prefix or a "
            f"blend), not {data.type!r}"
        )
    if data.path is not None:
        raise ConfigError(
            "data.path: not with data.phases, which say what trains: move it into a phase, "
            "or unset it with data.path=none on the command line (validation reads "
            "data.valid_path, else the first phase's valid share)"
        )
    for i, phase in enumerate(data.phases):
        if phase.seq_length is not None:
            check_length(f"data.phases[{i}].seq_length", phase.seq_length, config)
    lengths = {phase.seq_length or data.seq_length for phase in data.phases}
    if config.parallel.pp > 1 and len(lengths) > 1:
        raise ConfigError(
            f"data.phases: sequence lengths {sorted(lengths)} with parallel.pp="
            f"{config.parallel.pp}: a pipeline's stages keep the shapes of its first step; "
            "give every phase one seq_length, or parallel.pp = 1"
        )


def check_profile(metrics: MetricsConfig) -> None:
    """A repeated profile window needs a window, and room for it before the next."""
    every, window = metrics.profile_every, metrics.profile_steps
    if every and window is None:
        raise ConfigError(
            f"metrics.profile_every={every} repeats metrics.profile_steps, which is not set: "
            "give metrics.profile_steps = [first step, steps]"
        )
    if every and window is not None and every < window[1]:
        raise ConfigError(
            f"metrics.profile_every={every} is shorter than the window of "
            f"metrics.profile_steps = [{window[0]}, {window[1]}]: windows would overlap"
        )


def check_moe(config: Config) -> None:
    """A MoE model's keys against the model and the layout, what the world size does not
    decide: the layout's rules as `ParallelDims` (their one home) states them, then what the
    config's options add."""
    p = config.parallel
    problems = p.expert_problems(config.model)
    if problems:
        raise ConfigError(problems[0].text)
    if config.model.moe is None:
        return
    if p.ep > 1 and p.compile:
        # The experts' own FSDP unit (`parallel/fsdp.py`) inside a compiled block: dynamo
        # refuses FSDP's hooks there (torch 2.15), a traceback at the first step.
        raise ConfigError(
            f"parallel.compile = true with parallel.ep={p.ep} is not supported yet: set "
            "parallel.compile = false, or parallel.ep = 1 (a MoE model compiles without ep)"
        )


def check_layout(config: Config, world_size: int, device_type: str) -> None:
    """The layout against the world it runs on (`ParallelDims.validate`) and the device: what
    only the start of a run knows, where every rank finds the same errors before any work."""
    p = config.parallel
    try:
        p.validate(world_size, config.model)
    except ValueError as exc:
        ep = "; parallel.ep adds no ranks: it splits parallel.dp_shard" if p.ep > 1 else ""
        raise ConfigError(
            f"parallel: {exc} (set parallel.dp_shard, cp, tp, pp, dp_replicate{ep})"
        ) from None
    if p.loss_parallel and p.tp == 1:
        raise ConfigError("parallel.loss_parallel needs parallel.tp > 1")
    if p.pp == 1 and p.pp_virtual_stages > 1:
        raise ConfigError("parallel.pp_virtual_stages > 1 needs parallel.pp > 1")
    if config.train.float8 is not None:
        check_float8_here(config, device_type)
    if config.model.attention == "flex" and device_type == "cpu":
        import torch  # here: loading a config needs no torch

        raise ConfigError(
            f"model.attention = 'flex' cannot train on the CPU (torch {torch.__version__} has "
            f"FlexAttention's forward only there): use 'auto' or 'segments'"
        )


def check_float8_here(config: Config, device_type: str) -> None:
    """What `train.float8` needs of this machine and of the model built on it: torchao, the
    row-wise linears unconverted under `parallel.tp_reduce_dtype`, skip patterns that name
    linears of the model, and a GPU whose matmuls take the recipe's format."""
    import torch  # here: loading a config needs no torch

    float8 = config.train.float8
    assert float8 is not None
    from hp_runtime.model import Transformer
    from hp_runtime.parallel.float8 import (
        CAPABILITY,
        high_precision,
        import_torchao,
        unmatched_patterns,
    )
    from hp_runtime.parallel.tp import ROW_WISE

    try:
        import_torchao()
    except ImportError:
        raise ConfigError("train.float8 needs torchao: pip install 'hp-runtime[float8]'") from None

    with torch.device("meta"):
        model = Transformer(config.model)
    kept = high_precision(model, float8, config.parallel.tp)
    names = [name for name, _ in model.named_modules()]
    rowwise = [n for n in names if n.endswith(ROW_WISE) and n not in kept]
    if config.parallel.tp_reduce_dtype is not None and config.parallel.tp > 1 and rowwise:
        raise ConfigError(
            f"parallel.tp_reduce_dtype replaces the row-wise linears' matmul, which train.float8 "
            f"converts ({rowwise[0]}, ...): leave parallel.tp_reduce_dtype unset, or skip them "
            '(train.float8.skip = ["wo", "w2"])'
        )
    unmatched = unmatched_patterns(model, float8.skip)
    if unmatched:
        raise ConfigError(
            f"train.float8.skip: {unmatched[0]!r} matches no linear of this model (names such "
            "as 'layers.0.attention.wq', 'feed_forward.w2', 'wo'; `fnmatch` patterns)"
        )
    if device_type == "cuda":
        have, need = torch.cuda.get_device_capability(), CAPABILITY[float8.recipe]
        if have < need:
            raise ConfigError(
                f"train.float8.recipe = {float8.recipe!r} needs a GPU of compute capability "
                f"{need[0]}.{need[1]} or newer ({'Blackwell' if need[0] >= 10 else 'Ada, Hopper'}"
                f"); this {torch.cuda.get_device_name()} is {have[0]}.{have[1]}: "
                "use another recipe, or leave train.float8 unset"
            )
