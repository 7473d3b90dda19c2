"""hp-data imports and its CLI runs on a machine without torch, and the README's data-only
command installs none."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest


def test_hp_data_works_when_torch_cannot_be_imported(tmp_path, example_corpus, example_tokenizer):
    # sys.modules[name] = None makes every `import torch` fail, as on a torch-free machine.
    script = textwrap.dedent(f"""
        import sys, pkgutil, importlib
        sys.modules["torch"] = None
        import hp_data
        for module in pkgutil.walk_packages(hp_data.__path__, "hp_data."):
            importlib.import_module(module.name)
        from hp_data.cli import main
        for args in (
            ["preprocess", {str(example_corpus)!r}, "--out", {str(tmp_path / "ds")!r},
             "--tokenizer", {str(example_tokenizer)!r}, "--append-eod", "--quiet"],
            ["inspect", {str(tmp_path / "ds")!r}, "--check"],
        ):
            try:
                main(args)
            except SystemExit as exit:
                assert exit.code == 0, (args, exit.code)
        assert not any(name == "torch" or name.startswith("torch.") for name in sys.modules
                       if sys.modules[name] is not None)
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "every invariant holds" in result.stdout


@pytest.mark.slow
def test_data_only_command_installs_hp_data_without_torch(
    tmp_path, repo, example_corpus, example_tokenizer
):
    # The README's `uv run --package hp-data --no-dev hp-data ...`, into a fresh environment
    # (UV_PROJECT_ENVIRONMENT stands for a clean clone's .venv). --frozen and --offline change
    # nothing that is installed: the lock as it is, wheels from uv's cache.
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH (run the tests with `uv run pytest`)")
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_NO_SYNC")}
    env["UV_PROJECT_ENVIRONMENT"] = str(venv)
    command = [uv, "run", "--frozen", "--offline", "--package", "hp-data", "--no-dev", "hp-data"]
    out = tmp_path / "ds"
    for args in (
        ["preprocess", example_corpus, "--out", out, "--tokenizer", example_tokenizer,
         "--append-eod", "--workers", "1", "--quiet"],
        ["inspect", out, "--check"],
    ):  # fmt: skip
        result = subprocess.run(
            command + [str(a) for a in args],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
    assert "every invariant holds" in result.stdout
    listing = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import importlib.metadata as m, json; "
         "print(json.dumps(sorted(d.metadata['Name'].lower() for d in m.distributions())))"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    installed = set(json.loads(listing))
    assert "hp-data" in installed
    heavy = {n for n in installed if n in ("torch", "triton", "hp-runtime") or "nvidia" in n}
    assert not heavy, f"the data-only path installed {sorted(heavy)}"
