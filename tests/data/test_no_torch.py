"""hp-data imports and its CLI runs on a machine without torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap


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
