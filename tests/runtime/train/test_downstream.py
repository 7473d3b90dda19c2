"""Downstream evaluation (lm-evaluation-harness): `hp-train eval` and `[eval]` in a training
job, checked against lm-eval's own HF backend on the checkpoint's export, one process against
FSDP 2 and TP 2, and in-loop results against `hp-train eval` of the same steps' checkpoints."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers.train import FAST, hp_train_here, records, torchrun

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

SEQ = 64  # the model's length: contexts and rolling windows are cut to it
MODEL = [*FAST, "model.vocab_size=8192", f"model.max_seq_len={SEQ}", "train.seed=3"]
LIMIT = 12


def _write_tasks(root: Path) -> Path:
    """Four local tasks, one of each request type, their data beside them (JSONL)."""
    import random

    tasks = root / "tasks"
    tasks.mkdir()
    draw = random.Random(0)
    words = ["cat", "dog", "sun", "tree", "river", "stone", "bird", "house"]
    with open(tasks / "items.jsonl", "w") as out:
        for _ in range(20):
            a, b = draw.randint(1, 9), draw.randint(1, 9)
            picks = draw.sample(words, 4)
            out.write(json.dumps({
                "question": f"The {picks[0]} and the {picks[1]}: {a} plus {b} is",
                "choices": [str(a + b), str(a + b + 1), picks[2], f"the {picks[3]}"],
                "answer": draw.randrange(4),
                "text": " ".join(draw.choice(words) for _ in range(draw.randint(5, 90))),
            }) + "\n")  # fmt: skip
    data = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'items.jsonl'}\n"
    )
    data += "test_split: test\n"
    (tasks / "mc.yaml").write_text(
        "task: hp_mc\n" + data + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    (tasks / "ll.yaml").write_text(
        "task: hp_ll\n" + data + "output_type: loglikelihood\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: ' {{choices[0]}}'\nmetric_list:\n  - metric: perplexity\n"
        "  - metric: acc\n"
    )
    (tasks / "roll.yaml").write_text(
        "task: hp_roll\n" + data + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
        "  - metric: bits_per_byte\n"
    )
    (tasks / "gen.yaml").write_text(
        "task: hp_gen\n" + data + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: ' {{choices[0]}}'\ngeneration_kwargs:\n  until: ['.']\n"
        "  max_gen_toks: 5\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
    )
    return tasks


@pytest.fixture(scope="module")
def world(tmp_path_factory, example_tokenizer):
    """A few steps of the tiny model (8,192 ids, the shipped tokenizer's), checkpoints at
    steps 2 and 4; its export at step 4 with the tokenizer, as `lm_eval --model hf` reads it;
    the four tasks."""
    root = tmp_path_factory.mktemp("downstream")
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    shutil.copy(example_tokenizer, tokenizer / "tokenizer.json")
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast",
    }))  # fmt: skip
    run = root / "run"
    done = hp_train_here(
        *MODEL, "data.type=dummy", "data.seq_length=32", "train.steps=4",
        "checkpoint.interval=2", f"train.run_dir={run}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    checkpoint = run / "checkpoints" / "step-0000004"
    hf = root / "hf"
    done = hp_train_here("export", checkpoint, "--out", hf, "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, hf / name)
    bos, hf_bos = _bos_tokenizer(tokenizer, root), root / "hf-bos"
    shutil.copytree(hf, hf_bos, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bos / name, hf_bos / name)
    return {
        "root": root, "run": run, "checkpoint": checkpoint, "hf": hf,
        "tokenizer": tokenizer, "tasks": _write_tasks(root), "bos": bos, "hf_bos": hf_bos,
    }  # fmt: skip


def _bos_tokenizer(plain: Path, root: Path) -> Path:
    """The same tokenizer with a post-processor that puts BOS before every text (as Llama 3's
    does), BOS named in its config: what HF's `tok_encode` adds, hp must add too."""
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_file(str(plain / "tokenizer.json"))
    end = "<|endoftext|>"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{end} $A", pair=f"{end} $A $B", special_tokens=[(end, tokenizer.token_to_id(end))]
    )
    out = root / "tokenizer-bos"
    out.mkdir()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": end, "bos_token": end, "tokenizer_class": "PreTrainedTokenizerFast",
    }))  # fmt: skip
    return out


def _instances(tasks_dir: Path, name: str) -> list:
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    task = manager.load([name])["tasks"][name]
    task.build_all_requests(limit=LIMIT, rank=0, world_size=1)
    return task.instances


def _hf_lm(world, hf: str = "hf"):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(world[hf]), device="cpu", dtype="float32", batch_size=4)


def _hp_lm(world, tokenizer: str = "tokenizer"):
    """`hp-train eval`'s model on one process (its own process group, as the command's)."""
    from hp_runtime.train.eval_checkpoint import checkpoint_model, stored_config
    from hp_runtime.train.launch import start

    config = stored_config(
        str(world["checkpoint"]),
        [
            "train.cpu_threads=1",
            f'eval.tokenizer="{world[tokenizer]}"',
            "eval.batch_size=3",
        ],
    )
    runtime = start("cpu", 1)
    return checkpoint_model(str(world["checkpoint"]), config, runtime)


@pytest.mark.parametrize("variant", ["plain", "bos"])
def test_each_request_type_answers_as_lm_evals_hf_backend_on_the_export(world, variant):
    """Per request: loglikelihoods within 1e-4 and the same greedy flags (multiple choice and
    plain loglikelihood), rolling loglikelihoods (texts longer than the model's 64 positions:
    several windows), greedy generations as text; with the shipped tokenizer, and with one
    that puts BOS before every text (HF's backend encodes with it, so must hp)."""
    from hp_runtime.train.launch import stop

    bos = variant == "bos"
    hf = _hf_lm(world, "hf_bos" if bos else "hf")
    try:
        hp = _hp_lm(world, "bos" if bos else "tokenizer")
        if bos:  # the requests do start with it
            assert hp.tok_encode("a cat")[0] == hp.prefix_token_id == hf.prefix_token_id
        for name in ("hp_mc", "hp_ll"):
            requests = _instances(world["tasks"], name)
            theirs, mine = hf.loglikelihood(requests), hp.loglikelihood(requests)
            assert len(mine) == len(theirs) >= LIMIT
            for (a, greedy_a), (b, greedy_b) in zip(mine, theirs, strict=True):
                assert a == pytest.approx(b, abs=1e-4, rel=0)
                assert greedy_a == greedy_b
        requests = _instances(world["tasks"], "hp_roll")
        longest = max(len(hp.tok_encode(r.args[0])) for r in requests)
        assert longest > 2 * SEQ  # several windows
        theirs, mine = hf.loglikelihood_rolling(requests), hp.loglikelihood_rolling(requests)
        assert mine == pytest.approx(theirs, abs=1e-3, rel=1e-6)
        requests = _instances(world["tasks"], "hp_gen")
        theirs, mine = hf.generate_until(requests), hp.generate_until(requests)
        assert mine == theirs
        assert any(text for text in mine)
    finally:
        stop()


def _eval_json(world, *args: str, tasks: str = "hp_mc,hp_ll", step: int = 4) -> dict:
    out = world["root"] / f"results-{abs(hash((args, tasks, step)))}.json"
    checkpoint = world["run"] / "checkpoints" / f"step-{step:07d}"
    done = hp_train_here(
        "eval", checkpoint, "--tasks", tasks, "--include", world["tasks"], "--limit", LIMIT,
        "--tokenizer", world["tokenizer"], "--bootstrap-iters", "0", "--output", out,
        "train.cpu_threads=1", *args,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "hp_mc" in done.stdout  # lm-eval's table
    return json.loads(out.read_text())


def _metrics(results: dict) -> dict[str, float]:
    return {
        f"{task}/{name}": value
        for task, values in results["results"].items()
        for name, value in values.items()
        if isinstance(value, float | int) and "," in name and "stderr" not in name
    }


def test_hp_train_eval_scores_as_lm_eval_on_the_export(world):
    """`hp-train eval`'s results JSON against `lm_eval.simple_evaluate` with the HF backend:
    the same accuracies, perplexities within 1e-4 (relative)."""
    mine = _metrics(_eval_json(world))
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    theirs = evaluator.simple_evaluate(
        model=_hf_lm(world),
        tasks=["hp_mc", "hp_ll"],
        task_manager=TaskManager(include_path=str(world["tasks"]), include_defaults=False),
        limit=LIMIT,
        bootstrap_iters=0,
    )
    theirs = _metrics(theirs)
    assert set(mine) == set(theirs) and "hp_mc/acc,none" in mine
    for key, value in theirs.items():
        assert mine[key] == pytest.approx(value, rel=1e-4), key


@pytest.mark.parametrize("layout", ["parallel.dp_shard=2", "parallel.tp=2"])
def test_fsdp_and_tp_score_as_one_process(world, layout):
    """torchrun, two ranks, as users launch it: the results of one process."""
    one = _metrics(_eval_json(world, tasks="hp_mc,hp_roll,hp_gen"))
    out = world["root"] / f"{layout}.json"
    done = torchrun(
        2, "eval", world["checkpoint"], "--tasks", "hp_mc,hp_roll,hp_gen", "--include",
        world["tasks"], "--limit", LIMIT, "--tokenizer", world["tokenizer"],
        "--bootstrap-iters", "0", "--output", out, "train.cpu_threads=1", layout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    two = _metrics(json.loads(out.read_text()))
    assert set(two) == set(one)
    for key, value in one.items():
        assert two[key] == pytest.approx(value, rel=1e-5), key


def test_in_loop_results_equal_hp_train_eval_of_those_steps_and_a_resume_logs_the_same(world):
    """`[eval]` at steps 10 and 20 of a tiny run: the `eval/TASK/METRIC` values of
    `hp-train eval` on the checkpoints of those steps; resumed from step 10, the run logs the
    same at step 20, and its losses are those of a run without `[eval]`."""
    run = world["root"] / "in-loop"
    tasks = f'["{world["tasks"] / "mc.yaml"}", "{world["tasks"] / "ll.yaml"}"]'
    common = [
        *MODEL, "data.type=dummy", "data.seq_length=32", "train.steps=20",
        "checkpoint.interval=10",
    ]  # fmt: skip
    ev = [
        f"eval.tasks={tasks}", "eval.interval=10", f"eval.limit={LIMIT}",
        f'eval.tokenizer="{world["tokenizer"]}"', "eval.batch_size=5",
    ]  # fmt: skip
    drawn = ["metrics.tensorboard=true", "metrics.plot=true"]
    done = hp_train_here(*common, *ev, *drawn, f"train.run_dir={run}")
    assert done.returncode == 0, done.stderr
    logged = {r["step"]: r for r in records(run, "downstream")}
    assert sorted(logged) == [10, 20]
    _check_drawn(run, logged)
    for step in (10, 20):
        expected = _eval_json({**world, "run": run}, step=step)
        for key, value in _metrics(expected).items():
            task, _, metric = key.partition("/")
            name = f"eval/{task}/{metric.removesuffix(',none')}"
            assert logged[step][name] == pytest.approx(value, rel=1e-6), name
    plain = world["root"] / "no-eval"
    done = hp_train_here(*common, f"train.run_dir={plain}")
    assert done.returncode == 0, done.stderr
    assert [r["loss"] for r in records(run)] == [r["loss"] for r in records(plain)]
    resumed = world["root"] / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-0000020")
    done = hp_train_here(*common, *ev, f"train.run_dir={resumed}")
    assert done.returncode == 0, done.stderr
    again = {r["step"]: r for r in records(resumed, "downstream")}
    assert {k: v for k, v in again[20].items() if k != "eval_s"} == {
        k: v for k, v in logged[20].items() if k != "eval_s"
    }
    assert "downstream at step 20 | hp_mc/acc" in done.stdout


def _check_drawn(run: Path, logged: dict[int, dict]) -> None:
    """TensorBoard holds every `eval/` value at its step; metrics.png has the downstream row
    (3 rows of 350 pixels, not 2)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    names = [k for k in logged[10] if k.startswith("eval/")]
    assert "eval/hp_mc/acc" in names and "eval/hp_ll/perplexity" in names
    for name in names:
        scalars = events.Scalars(name)
        assert [e.step for e in scalars] == [10, 20]
        expected = [logged[10][name], logged[20][name]]
        assert [e.value for e in scalars] == pytest.approx(expected, rel=1e-6)
    png = (run / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[20:24], "big") == 3 * 350


def _refused(*args: str) -> str:
    done = hp_train_here(*args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hp-train: error: "), done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


@pytest.fixture
def bad_tasks(world, tmp_path):
    shutil.copy(world["tasks"] / "items.jsonl", tmp_path / "items.jsonl")
    mc = (world["tasks"] / "mc.yaml").read_text()
    (tmp_path / "broken.yaml").write_text("task: hp_broken\n  output_type: [\n")
    (tmp_path / "metric.yaml").write_text(
        mc.replace("hp_mc", "hp_metric").replace("metric: acc_norm", "metric: acc_nrom")
    )
    (tmp_path / "nodata.yaml").write_text(
        mc.replace("hp_mc", "hp_nodata").replace(str(world["tasks"]), str(tmp_path / "gone"))
    )
    return tmp_path


@pytest.mark.parametrize(
    ("tasks", "expected"),
    [
        ('["hp_mcc"]', "eval.tasks: no task 'hp_mcc' in lm-eval or the include directories"),
        ('["BROKEN"]', "broken.yaml is not a task lm-eval can read"),
        ('["METRIC"]', "task 'hp_metric' asks for metric 'acc_nrom', which lm-eval does not"),
        ('["NODATA"]', "task 'hp_nodata' cannot be loaded: FileNotFoundError"),
        ('["GONE"]', "no such file or directory"),
        ('[""]', "eval.tasks: a task name is empty"),
    ],
)
def test_a_task_that_cannot_run_is_refused_in_one_line_before_a_step(
    world, bad_tasks, tmp_path, tasks, expected
):
    tasks = tasks.replace("BROKEN", str(bad_tasks / "broken.yaml"))
    tasks = tasks.replace("METRIC", str(bad_tasks / "metric.yaml"))
    tasks = tasks.replace("NODATA", str(bad_tasks / "nodata.yaml"))
    tasks = tasks.replace("GONE", str(bad_tasks / "gone.yaml"))
    run = tmp_path / "run"
    line = _refused(
        *MODEL, "data.type=dummy", "data.seq_length=32", "train.steps=2",
        f"eval.tasks={tasks}", f"eval.include=[\"{world['tasks']}\"]",
        f'eval.tokenizer="{world["tokenizer"]}"', f"train.run_dir={run}",
    )  # fmt: skip
    assert expected in line
    assert not (run / "metrics.jsonl").exists() or not records(run)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("eval.interval=0", "eval.interval"),
        ("eval.interval=-5", "eval.interval"),
        ("eval.limit=0", "eval.limit"),
        ("eval.batch_size=0", "eval.batch_size"),
        ("eval.tokenizer=none", "eval.tokenizer: required for eval.tasks"),
        ("parallel.pp=2", "downstream evaluation runs on layouts without a pipeline"),
        ('eval.include=["/no/such/dir"]', "eval.include: '/no/such/dir': no such file"),
    ],
)
def test_bad_eval_keys_are_refused_in_one_line(world, tmp_path, override, expected):
    line = _refused(
        *MODEL, "data.type=dummy", "data.seq_length=32", "train.steps=2",
        'eval.tasks=["hp_mc"]', f'eval.tokenizer="{world["tokenizer"]}"',
        f"train.run_dir={tmp_path / 'run'}", override,
    )  # fmt: skip
    assert expected in line


def test_what_the_model_cannot_answer_is_refused_before_a_step(world, tmp_path):
    """A tokenizer with more ids than the model, and a generation task that asks for more
    tokens than the model has positions: one line each, exit 2, no step trained."""
    long = tmp_path / "long.yaml"
    long.write_text(
        (world["tasks"] / "gen.yaml").read_text().replace("hp_gen", "hp_long")
        .replace("max_gen_toks: 5", f"max_gen_toks: {SEQ}")
    )  # fmt: skip
    common = [*MODEL, "data.type=dummy", "data.seq_length=32", "train.steps=2",
              f'eval.tokenizer="{world["tokenizer"]}"']  # fmt: skip
    cases = [
        ([f'eval.tasks=["{long}"]'], "task 'hp_long' generates up to 64 tokens (max_gen_toks)"),
        (['eval.tasks=["hp_mc"]', f"eval.include=[\"{world['tasks']}\"]",
          "model.vocab_size=4096"], "has 8192 ids, model.vocab_size is 4096"),
    ]  # fmt: skip
    for i, (extra, expected) in enumerate(cases):
        run = tmp_path / f"run{i}"
        assert expected in _refused(*common, *extra, f"train.run_dir={run}")
        assert not records(run)


def test_hp_train_eval_options_are_refused_in_one_line(world, tmp_path):
    """No task in --tasks, a .yml task file (lm-eval indexes *.yaml only), a --limit of 0."""
    base = ["eval", world["checkpoint"], "--tokenizer", world["tokenizer"]]
    for args, expected in [
        (["--tasks", " , "], "--tasks: give lm-eval task names or task YAML files"),
        (["--tasks", str(tmp_path / "qa.yml")], "lm-eval reads task files named *.yaml"),
        (["--tasks", "hp_mc", "--limit", "0"], "--limit"),
    ]:
        done = hp_train_here(*base, *args)
        assert done.returncode == 2, (args, done.stderr)
        assert expected in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_without_lm_eval_the_eval_keys_name_the_install_command(tmp_path):
    """lm-eval hidden from the interpreter, as on an install without hp-runtime[eval]."""
    import subprocess

    code = (
        "import sys; sys.modules['lm_eval'] = None\n"
        "from hp_runtime.train.cli import main\n"
        f"main(['model.preset=tiny', 'data.type=dummy', 'data.seq_length=8', 'train.steps=1', "
        f"'eval.tasks=[\"hellaswag\"]', 'eval.tokenizer=x', 'train.run_dir={tmp_path}'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "hp-train: error: eval.tasks: downstream evaluation needs lm-evaluation-harness: "
        "pip install 'hp-runtime[eval]'"
    )


def test_hp_train_eval_refuses_what_it_cannot_read(world, tmp_path):
    """A checkpoint that is not one, a task it cannot find, an output that is a directory:
    one line each, nothing written."""
    args = ["--tasks", "hp_mc", "--include", world["tasks"], "--tokenizer", world["tokenizer"]]
    done = hp_train_here("eval", tmp_path, *args)
    assert done.returncode == 1 and "is not a hp-train checkpoint" in done.stderr
    done = hp_train_here("eval", world["checkpoint"], *args[:1], "hp_mcq", *args[2:])
    assert done.returncode == 2
    assert "--tasks: no task 'hp_mcq'" in done.stderr and "Traceback" not in done.stderr
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    done = hp_train_here("eval", world["checkpoint"], *args, "--limit", "2", "--output", mine)
    assert done.returncode == 1 and "--output" in done.stderr and "is a directory" in done.stderr
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_hp_train_eval_reads_a_checkpoint_in_object_storage(world, s3_server, tmp_path):
    """The same run saved to an s3:// `checkpoint.dir` (moto): `hp-train eval URL` gives the
    results of the local checkpoint of that step."""
    import uuid

    from tests.helpers.object_store import flip_object, s3_client, s3_endpoint

    moto = s3_server["FSSPEC_S3_ENDPOINT_URL"]
    bucket = f"eval-{uuid.uuid4().hex[:8]}"
    s3_client(moto).create_bucket(Bucket=bucket)  # type: ignore[attr-defined]
    url = f"s3://{bucket}/run"
    with s3_endpoint(moto):
        done = hp_train_here(
            *MODEL, "data.type=dummy", "data.seq_length=32", "train.steps=4",
            "checkpoint.interval=2", f"train.run_dir={tmp_path / 'run'}", f"checkpoint.dir={url}",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        out = tmp_path / "remote.json"
        done = hp_train_here(
            "eval", f"{url}/step-0000004", "--tasks", "hp_mc", "--include", world["tasks"],
            "--limit", LIMIT, "--tokenizer", world["tokenizer"], "--bootstrap-iters", "0",
            "--output", out, "train.cpu_threads=1",
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    local = _metrics(_eval_json(world, tasks="hp_mc"))
    assert _metrics(json.loads(out.read_text())) == local

    # a shard damaged in the store: the fetch's own verdict, in one line, no results written
    shard = "run/step-0000002/__0_0.distcp"
    flip_object(s3_client(moto), bucket, shard)
    with s3_endpoint(moto):
        done = hp_train_here(
            "eval", f"{url}/step-0000002", "--tasks", "hp_mc", "--include", world["tasks"],
            "--limit", LIMIT, "--tokenizer", world["tokenizer"], "--bootstrap-iters", "0",
            "--output", tmp_path / "damaged.json", "train.cpu_threads=1",
        )  # fmt: skip
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert f"s3://{bucket}/{shard}: not the bytes its commit" in done.stderr, done.stderr
    assert not (tmp_path / "damaged.json").exists()
