"""Run hp-data's preprocessing from tests, through the library or the installed command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from hp_data.pipeline import PreprocessOptions, PreprocessSummary, preprocess

HP_DATA = str(Path(sys.executable).parent / "hp-data")


def run_preprocess(inputs, out, tokenizer, **options) -> PreprocessSummary:
    options.setdefault("workers", 1)
    options.setdefault("show_progress", False)
    return preprocess(
        [str(i) for i in inputs], str(out), str(tokenizer), PreprocessOptions(**options)
    )


def cli(*args: str, cwd=None, timeout: float = 300, env=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [HP_DATA, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env=env,
    )


def cli_json(*args: str) -> dict:
    result = cli(*args, "--json", "--quiet")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def read_bytes(prefix, metadata: bool = False) -> tuple[bytes, ...]:
    """The dataset's `.bin` and `.idx`, and with `metadata` its `.hp.json` (which must exist)."""
    suffixes = (".bin", ".idx", ".hp.json") if metadata else (".bin", ".idx")
    return tuple(Path(f"{prefix}{suffix}").read_bytes() for suffix in suffixes)


def documented_json_keys() -> dict[str, set[str]]:
    """`{"hp-data inspect --json": {keys}}` from the tables of docs/cli.md."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    tables = {}
    for heading, body in re.findall(r"^### `(hp-data [^`]+)`\n(.*?)(?=^#|\Z)", text, re.S | re.M):
        rows = re.findall(r"^\| (`[^|]+) \|", body, re.M)
        tables[heading] = {key for row in rows for key in re.findall(r"`(\w+)`", row)}
    return tables
