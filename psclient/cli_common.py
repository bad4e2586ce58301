"""What the ``psclient`` and ``hostcache`` commands share: one-line usage errors, the version."""

from __future__ import annotations

import argparse
from importlib import metadata
from typing import NoReturn

#: exit status of a command line the user got wrong (argparse's own)
EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        prog = self.prog.split()[0]  # a subcommand's parser reports as the command
        self.exit(EXIT_USAGE, f"{prog}: error: {message} (see `{self.prog} --help`)\n")


def package_version() -> str:
    """The installed version of the project (``unknown`` in a source tree never installed)."""
    try:
        return metadata.version("nvecache")
    except metadata.PackageNotFoundError:
        return "unknown"
