"""`uv build --all-packages` gives a wheel and an sdist per package, with the right metadata."""

from __future__ import annotations

import shutil
import subprocess
import zipfile

import pytest


@pytest.mark.slow
def test_uv_build_all_packages(tmp_path, repo):
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH (run the tests with `uv run pytest`)")
    result = subprocess.run(
        [uv, "build", "--all-packages", "--out-dir", str(tmp_path)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".whl", ".gz"))
    assert names == [
        "hp_data-0.1.0-py3-none-any.whl",
        "hp_data-0.1.0.tar.gz",
        "hp_runtime-0.1.0-py3-none-any.whl",
        "hp_runtime-0.1.0.tar.gz",
    ]

    def metadata(wheel: str) -> list[str]:
        with zipfile.ZipFile(tmp_path / wheel) as archive:
            meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            return archive.read(meta).decode().splitlines()

    runtime = metadata("hp_runtime-0.1.0-py3-none-any.whl")
    assert any(line.startswith("Requires-Dist: hp-data") for line in runtime)
    assert any(line.startswith("Requires-Dist: torch") for line in runtime)
    data = metadata("hp_data-0.1.0-py3-none-any.whl")
    assert not any("torch" in line for line in data if line.startswith("Requires-Dist"))
    with zipfile.ZipFile(tmp_path / "hp_data-0.1.0-py3-none-any.whl") as archive:
        assert "hp_data/format/reader.py" in archive.namelist()
        entry_points = next(n for n in archive.namelist() if n.endswith("entry_points.txt"))
        assert "hp-data = hp_data.cli:main" in archive.read(entry_points).decode()
