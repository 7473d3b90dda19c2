"""The `hp-data` command: parse arguments, call the library, print. No logic lives here.

The package: `conventions` (errors, printing, shared options), a module per group of commands.
"""

from __future__ import annotations

import click

from hp_data.cli.conventions import _Group
from hp_data.cli.dataset_commands import inspect, merge
from hp_data.cli.index_command import build_index
from hp_data.cli.preprocess_commands import plan_command, preprocess_command


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hp-data")
def main() -> None:
    """Build, check, merge and inspect Megatron-format (.bin/.idx) token datasets."""


for _command in (inspect, merge, plan_command, preprocess_command, build_index):
    main.add_command(_command)


if __name__ == "__main__":
    main()
