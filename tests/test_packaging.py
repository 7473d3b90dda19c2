"""`uv build --all-packages` gives a wheel and an sdist per package, with the metadata and files a
published package needs; the package READMEs (their PyPI pages) link only to absolute URLs."""

from __future__ import annotations

import email
import re
import shutil
import subprocess
import tarfile
import tomllib
import zipfile
from email.message import Message
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
REPO_URL = "https://github.com/hp-project/hp"
PACKAGES = {"hp-data": "hp_data", "hp-runtime": "hp_runtime"}
SCRIPTS = {
    "hp-data": "hp-data = hp_data.cli:main",
    "hp-runtime": "hp-train = hp_runtime.train.cli:main",
}


def project(package: str) -> dict:
    with open(REPO / "packages" / package / "pyproject.toml", "rb") as stream:
        return tomllib.load(stream)["project"]


def dist_name(package: str) -> str:
    return f"{PACKAGES[package]}-{project(package)['version']}"


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory) -> Path:
    """One `uv build --all-packages` for every test of this module."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH (run the tests with `uv run pytest`)")
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [uv, "build", "--all-packages", "--out-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return out


def wheel_files(dist_dir: Path, package: str) -> dict[str, bytes]:
    with zipfile.ZipFile(dist_dir / f"{dist_name(package)}-py3-none-any.whl") as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def sdist_files(dist_dir: Path, package: str) -> dict[str, bytes]:
    with tarfile.open(dist_dir / f"{dist_name(package)}.tar.gz") as archive:
        return {
            member.name: archive.extractfile(member).read()
            for member in archive.getmembers()
            if member.isfile()
        }


def wheel_metadata(dist_dir: Path, package: str) -> Message:
    meta = wheel_files(dist_dir, package)[f"{dist_name(package)}.dist-info/METADATA"]
    return email.message_from_bytes(meta)


@pytest.mark.slow
def test_uv_build_all_packages(dist_dir):
    names = sorted(p.name for p in dist_dir.iterdir() if p.suffix in (".whl", ".gz"))
    assert names == sorted(
        name
        for package in PACKAGES
        for name in (f"{dist_name(package)}-py3-none-any.whl", f"{dist_name(package)}.tar.gz")
    )


@pytest.mark.slow
def test_requirements(dist_dir):
    runtime = wheel_metadata(dist_dir, "hp-runtime").get_all("Requires-Dist")
    assert any(line.startswith("hp-data") for line in runtime)
    assert any(line.startswith("torch") for line in runtime)
    data = wheel_metadata(dist_dir, "hp-data").get_all("Requires-Dist")
    assert not any("torch" in line for line in data)


@pytest.mark.slow
@pytest.mark.parametrize("package", PACKAGES)
def test_wheel_metadata(dist_dir, package):
    meta = wheel_metadata(dist_dir, package)
    assert meta["Name"] == package
    assert meta["Version"] == project(package)["version"]
    assert meta["Summary"] == project(package)["description"]
    assert meta["Requires-Python"] == ">=3.11"
    # PEP 639: the SPDX expression and the file; no License :: classifier beside them.
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    classifiers = meta.get_all("Classifier")
    assert "Development Status :: 3 - Alpha" in classifiers
    assert "Typing :: Typed" in classifiers
    assert not any(c.startswith("License ::") for c in classifiers)
    urls = dict(line.split(", ", 1) for line in meta.get_all("Project-URL"))
    assert sorted(urls) == ["Changelog", "Documentation", "Homepage", "Issues", "Repository"]
    assert urls["Repository"] == REPO_URL
    assert all(url.startswith(REPO_URL) for url in urls.values())
    # The PyPI page is the package's README.
    assert meta["Description-Content-Type"] == "text/markdown"
    readme = (REPO / "packages" / package / "README.md").read_text()
    assert meta.get_payload().strip() == readme.strip()


@pytest.mark.slow
@pytest.mark.parametrize("package", PACKAGES)
def test_wheel_contents(dist_dir, package):
    files = wheel_files(dist_dir, package)
    info = f"{dist_name(package)}.dist-info"
    assert files[f"{info}/licenses/LICENSE"] == (REPO / "LICENSE").read_bytes()
    assert f"{PACKAGES[package]}/py.typed" in files
    assert SCRIPTS[package] in files[f"{info}/entry_points.txt"].decode()
    assert all(name.startswith((PACKAGES[package] + "/", info + "/")) for name in files)
    if package == "hp-data":
        assert "hp_data/format/reader.py" in files


@pytest.mark.slow
@pytest.mark.parametrize("package", PACKAGES)
def test_sdist_contents(dist_dir, package):
    root = dist_name(package)
    files = sdist_files(dist_dir, package)
    assert files[f"{root}/LICENSE"] == (REPO / "LICENSE").read_bytes()
    assert f"{root}/src/{PACKAGES[package]}/py.typed" in files
    for name in ("README.md", "pyproject.toml"):
        assert files[f"{root}/{name}"] == (REPO / "packages" / package / name).read_bytes()
    pkg_info = email.message_from_bytes(files[f"{root}/PKG-INFO"])
    assert pkg_info["License-Expression"] == "Apache-2.0"
    assert pkg_info.get_all("License-File") == ["LICENSE"]


def test_license_is_apache_2_and_each_package_ships_the_same_file():
    # hatchling takes license files from inside the package directory only (and an sdist
    # keeps a symlink as a link to outside it), so each package holds a copy of the root file.
    text = (REPO / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "Copyright 2026 the hp authors" in text
    for package in PACKAGES:
        copy = REPO / "packages" / package / "LICENSE"
        assert not copy.is_symlink()
        assert copy.read_text() == text, f"{copy} differs from the root LICENSE"


MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|<(https?://[^>]+)>")
REPO_FILE_URL = re.compile(re.escape(REPO_URL) + r"/(?:blob|tree)/main/([^#?]+)")


@pytest.mark.parametrize("package", PACKAGES)
def test_package_readme_links_are_absolute_and_point_at_files_that_exist(package):
    # PyPI shows the README without the repository around it: a relative link is dead there.
    readme = (REPO / "packages" / package / "README.md").read_text()
    links = [a or b for a, b in MARKDOWN_LINK.findall(readme)]
    assert links, "the README links to the documentation"
    for link in links:
        assert link.startswith("https://"), f"{package} README: {link} is not absolute"
        if match := REPO_FILE_URL.match(link):
            assert (REPO / match.group(1)).exists(), f"{package} README: {link} has no file"
    # A repository path in the prose (`docs/format.md`) is a link a reader cannot follow; code
    # blocks may name paths of the user's own (`--out data/web`).
    text = MARKDOWN_LINK.sub("", re.sub(r"(?ms)^```.*?^```", "", readme))
    stray = re.findall(r"(?<![\w/.-])(?:docs|examples|tools|packages)/[\w./-]+", text)
    assert not stray, f"{package} README names repository paths without a link: {stray}"
