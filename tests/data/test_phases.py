"""Data-mixture phases (hp_data.phases) against an independent count written here: megatron's
largest-error rule as a plain loop, each corpus's position summed by hand across phases, and
every expected sample read straight from a one-epoch GPTDataset."""

from __future__ import annotations

import numpy as np
import pytest
from hp_data.blend import build_split
from hp_data.errors import HpDataError
from hp_data.gpt import GPTDataset, GPTDatasetConfig
from hp_data.phase_report import mix_report
from hp_data.phases import (
    Phase,
    PhaseError,
    build_phased,
    plan_phases,
    resolve_starts,
    state_change,
)

from tests.helpers.corpus import largest_error, write_documents

SEQ = 16


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    """Three corpora: `big` and `other` of a few hundred documents (hundreds of samples an
    epoch), `small` of a few dozen (a run wraps around it)."""
    root = tmp_path_factory.mktemp("phases")
    sizes = {"big": 300, "other": 300, "small": 30}
    out = {
        n: write_documents(str(root / n), count, 1000, k)
        for k, (n, count) in enumerate(sizes.items())
    }
    out["cache"] = str(root / "cache")
    return out


def _config(corpora, seq: int = SEQ) -> GPTDatasetConfig:
    return GPTDatasetConfig(seq_length=seq, seed=7, split="1,0,0", cache_dir=corpora["cache"])


_epochs: dict[tuple[str, int, int], GPTDataset] = {}


def epoch(corpora, prefix: str, seq: int, number: int) -> GPTDataset:
    """Epoch `number` of a stream: seed 7 for the first, then SeedSequence([7, e])'s first
    32-bit word (the documented derivation)."""
    if (prefix, seq, number) not in _epochs:
        seed = 7 if number == 0 else int(np.random.SeedSequence([7, number]).generate_state(1)[0])
        config = GPTDatasetConfig(
            seq_length=seq, seed=seed, split="1,0,0", cache_dir=corpora["cache"]
        )
        _epochs[(prefix, seq, number)] = GPTDataset(prefix, "train", None, config)
    return _epochs[(prefix, seq, number)]


def expected(corpora, phases: list[tuple[int, list[tuple[float, str]], int]]) -> list[tuple]:
    """(stream key, tokens, stream sample) of every sample of `phases` = [(samples,
    [(weight, prefix)], seq)], each corpus's position carried from phase to phase by hand."""
    position: dict[tuple[str, int], int] = {}
    out = []
    for size, blend, seq in phases:
        total = sum(w for w, _ in blend)
        for k in largest_error([w / total for w, _ in blend], size):
            key = (blend[k][1], seq)
            s = position.get(key, 0)
            position[key] = s + 1
            one = len(epoch(corpora, key[0], seq, 0))
            out.append((key, epoch(corpora, key[0], seq, s // one)[s % one]["tokens"], s))
    return out


def _steps(count: int, batch: int) -> np.ndarray:
    return np.arange(count + 1, dtype=np.int64) * batch


def test_a_single_phase_is_todays_blend(corpora):
    """Within one epoch, one phase gives exactly the samples `build_split` gives today."""
    spec = f"0.3 {corpora['big']} 0.7 {corpora['other']}"
    for path in (spec, corpora["big"]):
        phased = build_phased([Phase(from_step=1, path=path)], _config(corpora), _steps(20, 8))
        today = build_split(path, _config(corpora), "train", 160)
        assert len(phased) == 160
        for i in range(160):
            got, want = phased[i], today[i]
            np.testing.assert_array_equal(got["tokens"], want["tokens"])
            np.testing.assert_array_equal(got["labels"], want["labels"])
            assert got["dataset_id"] == want.get("dataset_id", 0)


def test_phases_carry_each_corpus_on_and_wrap_into_a_reshuffled_epoch(corpora):
    """Three phases, `small` read in the first and again after a gap, past its first epoch:
    every sample as the hand count says, nothing repeated within an epoch."""
    big, other, small = corpora["big"], corpora["other"], corpora["small"]
    phases = [
        Phase(from_step=1, path=f"0.5 {big} 0.5 {small}"),
        Phase(from_step=6, path=other),
        Phase(from_step=9, path=f"1 {small} 3 {big}"),
    ]
    dataset = build_phased(phases, _config(corpora), _steps(30, 8))
    # by hand: 5 steps x 8, 3 steps x 8, 22 steps x 8
    want = expected(
        corpora,
        [
            (40, [(0.5, big), (0.5, small)], SEQ),
            (24, [(1.0, other)], SEQ),
            (176, [(1.0, small), (3.0, big)], SEQ),
        ],
    )
    assert len(dataset) == len(want) == 240
    for i, (key, tokens, _) in enumerate(want):
        item = dataset[i]
        np.testing.assert_array_equal(item["tokens"], tokens, err_msg=str(i))
        assert dataset.plan.streams[item["dataset_id"]].prefix == key[0]
    small_size = len(epoch(corpora, small, SEQ, 0))
    taken = [s for key, _, s in want if key[0] == small]
    assert taken == list(range(len(taken))) and len(taken) > small_size  # it wraps
    # epoch 1 reshuffles the documents (megatron's samples are windows over its shuffled
    # documents, so they are not the same windows reordered): same documents, same count,
    # another order, other samples
    zero, one = epoch(corpora, small, SEQ, 0), epoch(corpora, small, SEQ, 1)
    assert len(one) == len(zero) == small_size
    assert sorted(one.document_index) == sorted(zero.document_index)
    assert list(one.document_index) != list(zero.document_index)
    assert any((one[r]["tokens"] != zero[r]["tokens"]).any() for r in range(small_size))
    # the read-ahead view: which stream rows a run of global samples reads
    streams, rows = dataset.plan.locate(np.arange(240))
    assert [dataset.plan.streams[c].prefix for c in streams] == [k[0] for k, _, _ in want]
    assert rows.tolist() == [s for _, _, s in want]


def test_from_tokens_and_another_length(corpora):
    """`from_tokens` starts at the first step whose first sample starts at or after that many
    tokens; a corpus read at another length is another stream, from its beginning."""
    big = corpora["big"]
    phases = [
        Phase(from_tokens=0, path=big),
        Phase(from_tokens=1000, path=big, seq_length=32),
        Phase(from_tokens=3000, path=big),
    ]
    # One sample a step. 1000 tokens = 62.5 samples at 16: step 63 starts after 992 tokens,
    # step 64 after 1008, the first at or past 1000. 3000 - 1008 = 1992 more tokens at 32 =
    # 62.25 samples: step 64 + 62 = 126 starts after 2992, step 127 after 3024.
    cumulative = _steps(200, 1)
    assert resolve_starts(phases, SEQ, cumulative) == [1, 64, 127]
    dataset = build_phased(phases, _config(corpora), cumulative)
    want = expected(
        corpora, [(63, [(1.0, big)], SEQ), (63, [(1.0, big)], 32), (74, [(1.0, big)], SEQ)]
    )
    for i, (_, tokens, _) in enumerate(want):
        np.testing.assert_array_equal(dataset[i]["tokens"], tokens, err_msg=str(i))
    assert dataset[63]["tokens"].shape == (32,) and dataset[126]["tokens"].shape == (16,)
    assert [want[i][2] for i in (0, 63, 126)] == [0, 0, 63]  # 32 restarts, 16 carries on


def test_the_report_counts_as_the_hand_count(corpora):
    big, small = corpora["big"], corpora["small"]
    phases = [Phase(from_step=1, path=f"0.5 {big} 0.5 {small}"), Phase(from_step=11, path=small)]
    plan = plan_phases(phases, _config(corpora), _steps(20, 8))
    report = mix_report(plan)
    picks = largest_error([0.5, 0.5], 80)
    size = len(epoch(corpora, small, SEQ, 0))
    from_small = picks.count(1) + 80  # phase 0's share, then all of phase 1
    assert report["samples"] == 160 and report["tokens"] == 160 * SEQ
    zero, one = report["phases"]
    assert (zero["from_step"], zero["to_step"], one["from_step"], one["to_step"]) == (1, 10, 11, 20)
    assert [r["samples"] for r in zero["streams"]] == [picks.count(0), picks.count(1)]
    assert one["streams"][0]["first_sample"] == picks.count(1)
    stream = report["streams"][1]
    assert stream["samples"] == from_small and stream["epoch_samples"] == size
    assert stream["repeats"] == max(0, from_small - size)
    assert stream["epochs"] == -(-from_small // size)
    # the step where `small` enters epoch 1: its sample number `size`, found by hand
    seen, step = 0, None
    for i in range(160):
        is_small = picks[i] == 1 if i < 80 else True
        if is_small:
            if seen == size:
                step = i // 8 + 1
                break
            seen += 1
    assert [(w["epoch"], w["step"]) for w in stream["wraps"]][:1] == [(1, step)]


def test_a_later_phase_leaves_the_earlier_samples_and_state(corpora):
    """Adding a phase after step 10 (and more steps) keeps samples and state up to step 10;
    inserting one before it is named."""
    big, other = corpora["big"], corpora["other"]
    old = [Phase(from_step=1, path=big), Phase(from_step=6, path=f"1 {big} 1 {other}")]
    new = [*old, Phase(from_step=11, path=other)]
    a = build_phased(old, _config(corpora), _steps(10, 8))
    b = build_phased(new, _config(corpora), _steps(16, 8))
    for i in range(80):
        np.testing.assert_array_equal(a[i]["tokens"], b[i]["tokens"])
    assert state_change(a.plan.state_at(10, 80), b.plan.state_at(10, 80), 10) is None
    inserted = [old[0], Phase(from_step=4, path=other), old[1]]
    c = build_phased(inserted, _config(corpora), _steps(10, 8))
    reason = state_change(a.plan.state_at(10, 80), c.plan.state_at(10, 80), 10)
    assert reason is not None and reason.startswith("data.phases[1] (from step 4")
    assert state_change(a.plan.state_at(5, 40), c.plan.state_at(5, 40), 5) is not None
    assert state_change(a.plan.state_at(3, 24), c.plan.state_at(3, 24), 3) is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"path": "/a"}, "from_step"),
        ({"from_step": 1, "from_tokens": 0, "path": "/a"}, "from_tokens"),
        ({"from_step": 0, "path": "/a"}, "from_step"),
        ({"from_step": True, "path": "/a"}, "from_step"),
        ({"from_tokens": -1, "path": "/a"}, "from_tokens"),
        ({"from_step": 1, "path": ""}, "path"),
        ({"from_step": 1, "path": "/a /b"}, "path"),
        ({"from_step": 1, "path": "1 /a 1 /a"}, "path"),
        ({"from_step": 1, "path": "/a", "seq_length": 1}, "seq_length"),
    ],
)
def test_a_bad_phase_names_its_field(fields, message):
    with pytest.raises(PhaseError) as info:
        Phase(**fields)
    assert info.value.field == message and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("phases", "message"),
    [
        ([Phase(from_step=2, path="/a")], r"^p\[0\]\.from_step: the first phase starts the run"),
        ([Phase(from_tokens=5, path="/a")], r"^p\[0\]\.from_tokens: the first phase"),
        (
            [
                Phase(from_step=1, path="/a"),
                Phase(from_step=5, path="/b"),
                Phase(from_step=3, path="/a"),
            ],
            r"^p\[2\]\.from_step: starts at step 3, not after p\[1\]'s step 5",
        ),
        (
            [Phase(from_step=1, path="/a"), Phase(from_tokens=0, path="/b")],
            r"^p\[1\]\.from_tokens: starts at step 1",
        ),
    ],
)
def test_phases_out_of_order_are_refused(phases, message):
    with pytest.raises(HpDataError, match=message):
        resolve_starts(phases, SEQ, _steps(10, 2), "p")


def test_a_phase_past_the_run_is_not_reached(corpora):
    phases = [Phase(from_step=1, path=corpora["big"]), Phase(from_tokens=10**9, path="/none")]
    assert resolve_starts(phases, SEQ, _steps(10, 2)) == [1, 11]


def test_a_missing_corpus_names_the_phase(corpora):
    phases = [Phase(from_step=1, path=corpora["big"]), Phase(from_step=3, path="/no/such")]
    with pytest.raises(HpDataError, match=r"^phases\[1\]\.path: "):
        plan_phases(phases, _config(corpora), _steps(10, 2))
