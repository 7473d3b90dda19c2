"""`hp-train plan`: per kind of rank, the bytes a real run allocates, built over a fake process
group on this CPU. Checked against real gloo runs of the same layouts (parameters, gradients
and AdamW's state, to the byte), against a real CPU forward's saved tensors (activations,
within 10%), and against ZeRO-3's published 16 bytes a parameter over the shards."""

from __future__ import annotations

import pytest
from hp_runtime.train.config import load_config

from tests.helpers.distributed import run_ranks
from tests.helpers.train import hp_train_here

BASE = ["model.preset=tiny", "data.type=dummy", "data.seq_length=64", "train.steps=1",
        "train.micro_batch_size=2"]  # fmt: skip


def _allocated(rank: int, world: int, overrides: list[str]) -> dict[str, int]:
    """What a real run of this layout allocates on this rank, after one step of AdamW."""
    from unittest import mock

    import torch
    import torch.distributed as dist
    from hp_runtime.parallel import assemble
    from hp_runtime.train.optim import build_optimizer
    from torch.distributed.tensor import DTensor

    config = load_config(None, [*BASE, *overrides])
    p = config.parallel
    assembly = assemble(config.model, p, torch.device("cpu"), seed=0, options=p,
                        param_dtype=torch.bfloat16, loss_fn=lambda a, b: a.sum())  # fmt: skip
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    for param in assembly.parameters:  # the gradients a backward leaves: one a parameter
        param.grad = torch.zeros_like(param)
    optimizer = build_optimizer(assembly.modules, config.optim, False, torch.device("cpu"))
    sent = 0  # bytes Muon's gathers and scatters send from this rank

    def gather(tensor, gather_list=None, dst=None, group=None):
        nonlocal sent
        sent += 0 if dist.get_rank() == dst else tensor.numel() * tensor.element_size()
        return real_gather(tensor, gather_list, dst=dst, group=group)

    def scatter(tensor, scatter_list=None, src=None, group=None):
        nonlocal sent
        if dist.get_rank() == src:
            sent += sum(t.numel() * t.element_size() for t in scatter_list) - tensor.nbytes
        return real_scatter(tensor, scatter_list, src=src, group=group)

    real_gather, real_scatter = dist.gather, dist.scatter
    with mock.patch.object(dist, "gather", gather), mock.patch.object(dist, "scatter", scatter):
        optimizer.step()
    states = [v for o in optimizer.all for s in o.state.values() for v in s.values()]
    nbytes = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)  # noqa: E731
    return {
        "param_bytes": nbytes(assembly.parameters),
        "grad_bytes": nbytes(param.grad for param in assembly.parameters),
        "optim_bytes": nbytes(states),
        "muon_sent_bytes": sent,
    }


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.dp_shard=2", "parallel.tp=2"],
        [
            "parallel.pp=2",
            "parallel.dp_shard=2",
            "parallel.pp_microbatches=2",
            "train.global_batch_size=8",
        ],
        # Muon: a momentum a hidden matrix, AdamW's state the rest, and what its step sends
        ["parallel.dp_shard=2", "parallel.tp=2", "optim.name=muon"],
    ],
)
def test_state_bytes_equal_a_real_run(layout):
    from hp_runtime.train.plan import plan

    real = run_ranks(_allocated, 4, layout)
    report = plan(load_config(None, [*BASE, *layout]), 4)
    planned = {r: t for t in report["rank_types"] for r in t["ranks"]}
    assert planned  # the kinds the planner built: the first and last rank of each stage
    for rank, kind in planned.items():
        for key in ("param_bytes", "grad_bytes", "optim_bytes", "muon_sent_bytes"):
            assert kind[key] == real[rank][key], (layout, rank, key)
    assert ("optim.name=muon" in layout) == (real[0]["muon_sent_bytes"] > 0)


def test_activations_within_ten_percent_of_a_real_forward():
    import torch
    from hp_runtime.model import Transformer
    from hp_runtime.train.plan import plan

    config = load_config(None, [*BASE, "train.mixed_precision=fp32"])
    model = Transformer(config.model)
    seen, total = set(), [0]

    def pack(tensor):
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen and tensor.requires_grad is not None:
            seen.add(key)
            total[0] += tensor.numel() * tensor.element_size()
        return tensor

    tokens = torch.randint(0, config.model.vocab_size, (2, 64))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(tokens, labels=tokens)
    planned = plan(config, 1)["rank_types"][0]["activation_bytes"]
    assert abs(planned - total[0]) <= 0.10 * total[0], (planned, total[0])
    assert total[0] > 2 * 64 * config.model.dim * 4 * config.model.n_layers  # not a trivial count


def test_sharded_state_is_zero3s_sixteen_bytes_a_parameter():
    from hp_runtime.train.plan import plan

    config = load_config(None, [*BASE, "model.preset=125m", "parallel.dp_shard=8"])
    kind = plan(config, 8)["rank_types"][0]
    state = kind["param_bytes"] + kind["grad_bytes"] + kind["optim_bytes"]
    expected = 16 * config.model.num_params() / 8  # Rajbhandari et al. 2020, stage 3
    assert abs(state - expected) <= 0.001 * expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world", "3", "parallel.dp_shard=2"], "world size"),
        (["--world", "0"], "--world 0: give the number of ranks"),
        (["--world", "2", "--gpu", "h100", "parallel.dp_shard=2"], "--gpu h100: choose one of"),
    ],
)
def test_bad_requests_are_one_line(args, message):
    done = hp_train_here("plan", *BASE, *args)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr


def test_the_table_and_the_roofline():
    done = hp_train_here("plan", *BASE, "parallel.dp_shard=4", "--world", "4", "--gpu",
                         "h100-80gb")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "on H100 SXM 80GB: step" in done.stdout and "MFU" in done.stdout
    assert "fsdp" in done.stdout  # the traffic of the one dimension there is


def test_float8_all_gather_halves_the_converted_weights_traffic():
    """`train.float8.fsdp_all_gather`: FSDP gathers the converted weights (every block's
    linears; not the head, embedding or norms) a byte an element instead of bf16's two, in
    the traffic and in the gathered blocks; without the all-gather float8 moves nothing less,
    and activations are what they were (torchao keeps the linears' inputs in bf16)."""
    import torch
    from hp_runtime.model import Transformer
    from hp_runtime.train.plan import plan

    pytest.importorskip("torchao")
    layout = [*BASE, "model.ffn_hidden=128", "parallel.dp_shard=4"]
    float8 = [*layout, "train.float8.recipe=tensorwise"]
    reports = [
        plan(load_config(None, overrides), 4)
        for overrides in (layout, float8, [*float8, "train.float8.fsdp_all_gather=true"])
    ]
    config = load_config(None, layout).model
    with torch.device("meta"):
        model = Transformer(config)
    linears = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    blocks = sum(m.weight.numel() for m in linears if m is not model.output)  # all 16-multiples
    plain, cast_after, gathered = reports
    micro = plain["micro_batches"]
    saved = micro * (4 - 1) * (blocks // 4) * (2 - 1) * 2  # forward and backward gathers
    assert cast_after["communication_bytes"] == plain["communication_bytes"]
    assert plain["communication_bytes"]["fsdp"] - gathered["communication_bytes"]["fsdp"] == saved
    for a, b, c in zip(*(r["rank_types"] for r in reports), strict=True):
        assert b["float8_param_bytes"] == c["float8_param_bytes"] == 4 * blocks // 4
        assert a["float8_param_bytes"] == 0
        assert a["activation_bytes"] == b["activation_bytes"] == c["activation_bytes"]
        per_block = blocks // config.n_layers
        assert a["gathered_bytes"] - c["gathered_bytes"] == 2 * per_block * (2 - 1)


DEEPSEEK_2048 = [
    "model.preset=deepseek-v3-671b", "data.type=dummy", "data.seq_length=4096",
    "parallel.dp_shard=128", "parallel.ep=64", "parallel.pp=16", "train.micro_batch_size=1",
    "train.global_batch_size=4096", "parallel.activation_checkpointing=full", "train.steps=1",
]  # fmt: skip


def test_deepseek_v3_671b_plans_on_2048_ranks():
    """DeepSeek-V3's own layout (pp 16 x ep 64 over 2,048 GPUs; FSDP where it had ZeRO-1)
    builds, and expert parallelism's shards stay shards in FSDP's gathers: a MoE block gathers
    its own 256 / 64 experts (before, all 256: 86 GiB where this is a few), and each
    parameter's gather sends to the other ranks of its own group (128 for the dense ones,
    128 / 64 for the experts). Expected from the shapes, written here from DeepSeek's config."""
    from hp_runtime.train.plan import plan

    report = plan(load_config(None, DEEPSEEK_2048), 2048)
    assert report["layout"]["ep"] == 64 and report["micro_batches"] == 32
    dim, experts, hidden = 7168, 256, 2048
    mla = dim * 1536 + 1536 + 1536 * 128 * 192 + dim * (512 + 64) + 512 + 512 * 128 * 256
    mla += 128 * 128 * dim  # wq_a, q norm, wq_b, wkv_a, kv norm, wkv_b, wo
    moe_block = mla + 2 * dim + dim * experts + 3 * dim * hidden * (1 + experts // 64)
    middle = next(t for t in report["rank_types"] if t["stage"] == 1)
    assert middle["gathered_bytes"] == moe_block * (2 * 2 + 4)  # bf16 gathered, fp32 grads
    assert middle["layers"] == 4  # 61 layers over 16 stages: the first 13 hold 4
    last = next(t for t in report["rank_types"] if t["stage"] == 15)
    assert last["layers"] == 3 + 1  # and the MTP module on the last stage
    experts_sent = 3 * dim * hidden * (experts // 64) // 2 * (2 - 1)  # a group of 2 ranks
    rows = {  # the dense weights' (rows, columns): each rank's rows padded to ceil(rows / 128)
        "wq_a": (1536, dim), "q_norm": (1536, 1), "wq_b": (128 * 192, 1536),
        "wkv_a": (512 + 64, dim), "kv_norm": (512, 1), "wkv_b": (128 * 256, 512),
        "wo": (dim, 128 * 128), "norms": (dim, 2), "router": (experts, dim),
        "shared": (3 * hidden, dim),
    }  # fmt: skip
    dense_sent = sum(-(-r // 128) * c * 127 for r, c in rows.values())
    assert middle["fsdp_sent_elements"] == 4 * (dense_sent + experts_sent)
