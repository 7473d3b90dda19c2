"""`hp-train verify`: a layout trained shrunk against one process, on warm gloo ranks. A sound
pipeline with tied embeddings passes; the same layout with the tied copies' gradient sum
removed (the bug class of torchtitan#1750: a layout that quietly trains another model) fails,
naming a tied tensor."""

from __future__ import annotations

import io

from tests.helpers.distributed import run_ranks
from tests.helpers.train import FAST

LAYOUT = [
    *FAST,
    "model.tie_embeddings=true",
    "data.type=dummy",
    "data.seq_length=32",
    "parallel.pp=2",
    "train.global_batch_size=4",
    "optim.lr=1e-2",
]


def _verify_both(rank: int, world: int, run_dir: str) -> list[tuple[bool, str]]:
    import importlib

    from hp_runtime.train.launch import start
    from hp_runtime.train.verify import verify

    assemble = importlib.import_module("hp_runtime.parallel.assemble")  # the module, not its def
    runtime = start("cpu", 1)
    out = []
    for broken in (False, True):
        saved = assemble.sync_tied_grads
        if broken:  # each stage steps its own copy of the tied weight: they drift apart
            assemble.sync_tied_grads = lambda *args, **kwargs: None
        log = io.StringIO()
        try:
            same = verify(None, [*LAYOUT, f"train.run_dir={run_dir}"], runtime, 2, stream=log)
        finally:
            assemble.sync_tied_grads = saved
        out.append((same, log.getvalue()))
    return out


def test_verify_passes_a_sound_layout_and_fails_a_broken_one(tmp_path):
    (sound, sound_log), (broken, broken_log) = run_ranks(_verify_both, 2, str(tmp_path))[0]
    assert sound, sound_log
    assert "pp 2 against one process" in sound_log
    rows = [line for line in sound_log.splitlines() if line.strip()[:1].isdigit()]
    assert [int(row.split("|")[0]) for row in rows] == [1, 2]
    assert not broken, broken_log
    assert "the layout DIFFERS from one process" in broken_log
    worst = broken_log.splitlines()[-2]  # the last row names the tensor that drifted most
    assert "tok_embeddings.weight" in worst or "output.weight" in worst, broken_log
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # verify's own runs are removed


def test_the_shrunk_model_keeps_what_shards():
    from hp_runtime.train.config import load_config
    from hp_runtime.train.verify import shrink

    given = ["model.preset=qwen3-moe-30b-a3b", "data.type=dummy", "data.seq_length=4096",
             "train.steps=1", "parallel.tp=4", "parallel.pp=2"]  # fmt: skip
    config = load_config(None, given)
    small = load_config(None, [*given, *shrink(config)])
    m, s = config.model, small.model
    assert (s.n_heads, s.n_kv_heads, s.vocab_size) == (m.n_heads, m.n_kv_heads, m.vocab_size)
    assert s.moe.experts == m.moe.experts and s.moe.top_k == m.moe.top_k
    assert s.dim == m.n_heads * 8 and s.n_layers == 2 and s.moe.expert_ffn_hidden == s.dim
    assert small.data.seq_length == 128 and small.model.max_seq_len >= 128
    assert small.train.mixed_precision == "fp32" and small.checkpoint.interval == 1


def _verify_bounded(rank: int, world: int, run_dir: str) -> str:
    from hp_runtime.train.errors import TrainError
    from hp_runtime.train.launch import start
    from hp_runtime.train.verify import verify

    runtime = start("cpu", 1)
    overrides = [
        *FAST, "data.type=dummy", "data.seq_length=32", f"train.run_dir={run_dir}",
        f"parallel.dp_shard={world}", f"train.global_batch_size={world}",
    ]  # fmt: skip
    try:  # a twin that cannot start in 0.5 s (it imports torch): rank 0 waits no longer
        verify(
            None, [*overrides, "train.collective_timeout_s=0.5"], runtime, 1, stream=io.StringIO()
        )
    except TrainError as exc:
        return f"{exc} (everywhere: {exc.everywhere})"
    return "no error"


def test_verify_waits_for_its_one_process_twin_no_longer_than_the_collective_timeout(tmp_path):
    # on 2 ranks: the peer gets rank 0's line (rank 0 alone prints it) rather than waiting
    # in a broadcast that rank 0, gone to the closing barrier, never joins
    message, peer = run_ranks(_verify_bounded, 2, str(tmp_path), timeout=60)
    assert message.startswith("verify: the one-process run did not finish in 0.5 s"), message
    assert peer == message and message.endswith("(everywhere: True)")
    assert list(tmp_path.iterdir()) == []  # its own runs removed, as on success
