"""The ``hostcache`` console script: the table commands plus the applications.

:mod:`hostcache.cli` is the table library's command line (``ls``, ``stat``, ``create``,
``rm``; ``python -m hostcache.cli`` runs it alone). This module sits above every tier and
adds ``serve`` (the node service, docs/service.md) and ``demo`` (the main job,
docs/demo.md) to the same parser, with the same one-line errors and exit statuses.
``python -m nvecache.apps.cli`` is the console script without its install.
"""

from __future__ import annotations

import argparse
import sys

from hostcache import cli as table_cli
from hostcache.cli import Command
from nvecache.apps.demo import command as demo_cmd
from nvecache.apps.service import command as serve_cmd

#: every subcommand of ``hostcache``, in the order ``--help`` lists them.
COMMANDS: tuple[Command, ...] = (
    *table_cli.COMMANDS,
    Command("serve", serve_cmd.HELP, serve_cmd.configure, serve_cmd.run),
    Command("demo", demo_cmd.HELP, demo_cmd.configure, demo_cmd.run_command),
)


def build_parser() -> argparse.ArgumentParser:
    """The ``hostcache`` argument parser: the table commands, ``serve`` and ``demo``."""
    return table_cli.build_parser(COMMANDS)


def main(argv: list[str] | None = None) -> int:
    """Run the ``hostcache`` command; returns the exit status (0 ok, 2 user error)."""
    return table_cli.main(argv, COMMANDS)


if __name__ == "__main__":
    sys.exit(main())
