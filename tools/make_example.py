"""Regenerate the shipped example: `examples/docstrings.jsonl` and `examples/tokenizer.json`.

The corpus is the docstrings of CPython's standard library, read with `ast` (nothing is
imported or run), one JSON line per module, class or function docstring. CPython's source is
under the PSF licence, which allows redistribution. The tokenizer is a byte-level BPE trained
on that corpus with the `tokenizers` library, so nothing is downloaded at run time.

    uv run python tools/make_example.py
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "lib2to3", "__pycache__"}


def docstrings(stdlib: Path, min_chars: int):
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if SKIP_PARTS & set(relative.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        module = ".".join(relative.with_suffix("").parts)
        nodes = [(module, tree)] + [
            (f"{module}.{node.name}", node)
            for node in ast.walk(tree)
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for name, node in nodes:
            text = ast.get_docstring(node)
            if text and len(text) >= min_chars:
                yield {"text": text, "source": name}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-bytes", type=int, default=3_000_000)
    parser.add_argument("--min-chars", type=int, default=200)
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()

    EXAMPLES.mkdir(exist_ok=True)
    corpus = EXAMPLES / "docstrings.jsonl"
    written = 0
    with corpus.open("w", encoding="utf-8") as out:
        for record in docstrings(Path(sysconfig.get_paths()["stdlib"]), args.min_chars):
            line = json.dumps(record, ensure_ascii=False) + "\n"
            if written + len(line.encode()) > args.max_bytes:
                break
            out.write(line)
            written += len(line.encode())

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (json.loads(line)["text"] for line in corpus.open(encoding="utf-8"))
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(EXAMPLES / "tokenizer.json"))
    print(f"{corpus}: {written:,} bytes; tokenizer: {tokenizer.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
