"""hp-runtime installs beside hp-data and reports its version."""

from importlib.metadata import requires, version

import hp_runtime


def test_version_matches_metadata():
    assert hp_runtime.__version__ == version("hp-runtime")


def test_depends_on_hp_data_and_torch():
    names = {
        req.split(">")[0].split("=")[0].split("<")[0].strip() for req in requires("hp-runtime")
    }
    assert {"hp-data", "torch"} <= names
