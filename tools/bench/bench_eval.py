"""`hp-train eval`'s model against lm-eval's own HF backend (`lm_eval --model hf`) on the same
checkpoint's export: loglikelihood requests a second, side by side, in one process.

The checkpoint is one step of the `small` preset (8,192 ids: the shipped tokenizer's), its
export in float32 beside it with the tokenizer. Two local multiple-choice tasks are made, of
`--docs` documents each: `hellaswag-like` (a ~60-token context, four ~20-token endings) and
`mmlu-like` (a ~150-token question, four one-token answers " A" to " D": the requests whose
four inputs are one and the same, which hp runs once). Both models answer the same requests
(lm-eval builds them once), in fp32 on the CPU with the same threads and batch size; the
rounds alternate which goes first, and the table gives the median of each and of the ratio
within a round, with the largest difference of their loglikelihoods.

    uv run python tools/bench/bench_eval.py [--docs 100] [--batch-size 16] [--rounds 3]
        [--threads 2] [--preset small]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
WORDS = (
    "the a river stone bird house light north walked quickly under over small green old "
    "market city road window morning evening water fire garden table paper music"
).split()


def _words(draw: random.Random, count: int) -> str:
    return " ".join(draw.choice(WORDS) for _ in range(count))


def make_tasks(root: Path, docs: int) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    draw = random.Random(0)
    with open(tasks / "hella.jsonl", "w") as out:
        for _ in range(docs):
            endings = [_words(draw, 18) for _ in range(4)]
            row = {"ctx": _words(draw, 55), "endings": endings, "label": draw.randrange(4)}
            out.write(json.dumps(row) + "\n")
    with open(tasks / "mmlu.jsonl", "w") as out:
        for _ in range(docs):
            question = _words(draw, 120) + "\nA. x\nB. y\nC. z\nD. w\nAnswer:"
            out.write(json.dumps({"question": question, "answer": draw.randrange(4)}) + "\n")
    common = "output_type: multiple_choice\ntest_split: test\ndataset_path: json\n"
    (tasks / "hella.yaml").write_text(
        f"task: hellaswag_like\n{common}dataset_kwargs:\n  data_files:\n"
        f"    test: {tasks / 'hella.jsonl'}\ndoc_to_text: '{{{{ctx}}}}'\n"
        "doc_to_choice: '{{endings}}'\ndoc_to_target: '{{label}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    (tasks / "mmlu.yaml").write_text(
        f"task: mmlu_like\n{common}dataset_kwargs:\n  data_files:\n"
        f"    test: {tasks / 'mmlu.jsonl'}\ndoc_to_text: '{{{{question}}}}'\n"
        "doc_to_choice: ['A', 'B', 'C', 'D']\ndoc_to_target: '{{answer}}'\n"
        "target_delimiter: ' '\nmetric_list:\n  - metric: acc\n"
    )
    return tasks


def make_checkpoint(root: Path, preset: str) -> tuple[Path, Path, Path]:
    """(checkpoint, HF export, tokenizer directory)."""
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    shutil.copy(ROOT / "examples" / "tokenizer.json", tokenizer / "tokenizer.json")
    (tokenizer / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    run = root / "run"
    hp_train = str(BIN / "hp-train")
    subprocess.run(
        [
            hp_train, f"model.preset={preset}", "model.vocab_size=8192", "data.type=dummy",
            "data.seq_length=64", "train.steps=1", "checkpoint.interval=1",
            "metrics.tensorboard=false", "metrics.plot=false", f"train.run_dir={run}",
        ],
        check=True, capture_output=True,
    )  # fmt: skip
    checkpoint = run / "checkpoints" / "step-0000001"
    hf = root / "hf"
    subprocess.run(
        [hp_train, "export", str(checkpoint), "--out", str(hf), "--dtype", "float32"],
        check=True, capture_output=True,
    )  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, hf / name)
    return checkpoint, hf, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--preset", default="small")
    args = parser.parse_args()

    import torch
    from hp_runtime.train.eval_checkpoint import checkpoint_model, stored_config
    from hp_runtime.train.launch import start, stop
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tasks_dir = make_tasks(root, args.docs)
        checkpoint, hf_dir, tokenizer = make_checkpoint(root, args.preset)
        config = stored_config(
            str(checkpoint),
            [
                f"train.cpu_threads={args.threads}",
                f'eval.tokenizer="{tokenizer}"',
                f"eval.batch_size={args.batch_size}",
            ],
        )
        runtime = start("cpu", args.threads)
        try:
            hp = checkpoint_model(str(checkpoint), config, runtime)
            hf = HFLM(pretrained=str(hf_dir), device="cpu", dtype="float32",
                      batch_size=args.batch_size)  # fmt: skip
            torch.set_num_threads(args.threads)
            manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
            loaded = manager.load(["hellaswag_like", "mmlu_like"])["tasks"]
            print(
                f"{args.preset} preset, {args.docs} documents a task, batch {args.batch_size}, "
                f"{args.threads} threads, fp32 CPU, {args.rounds} rounds"
            )
            print("| task | requests | hp req/s | lm-eval HF req/s | hp / HF | max abs diff |")
            print("| --- | --- | --- | --- | --- | --- |")
            for name, task in loaded.items():
                task.build_all_requests(rank=0, world_size=1)
                requests = task.instances
                times: dict[str, list[float]] = {"hp": [], "hf": []}
                answers = {}
                for round_ in range(args.rounds):
                    order = [("hp", hp), ("hf", hf)][:: 1 if round_ % 2 == 0 else -1]
                    for label, lm in order:
                        begin = time.perf_counter()
                        answers[label] = lm.loglikelihood(requests, disable_tqdm=True)
                        times[label].append(time.perf_counter() - begin)
                diff = max(
                    abs(a[0] - b[0]) for a, b in zip(answers["hp"], answers["hf"], strict=True)
                )
                ratio = statistics.median(
                    h / p for p, h in zip(times["hp"], times["hf"], strict=True)
                )
                count = len(requests)
                print(
                    f"| {name} | {count} | {count / statistics.median(times['hp']):.1f} | "
                    f"{count / statistics.median(times['hf']):.1f} | {ratio:.2f}x | {diff:.1e} |"
                )
        finally:
            stop()


if __name__ == "__main__":
    main()
