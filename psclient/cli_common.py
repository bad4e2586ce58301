"""What the ``psclient`` and ``hostcache`` commands share: one-line usage errors, the version,
argument types."""

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


def positive_int(text: str) -> int:
    """argparse type: an integer > 0, else a usage error in command-line terms."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}")
    return value
