"""What the ``psclient`` and ``hostcache`` commands share: one-line usage errors, the version,
argument types."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

#: the distribution the commands belong to (``pip install nvecache``)
DISTRIBUTION = "nvecache"

#: exit status of a command line the user got wrong (argparse's own)
EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        prog = self.prog.split()[0]  # a subcommand's parser reports as the command
        self.exit(EXIT_USAGE, f"{prog}: error: {message} (see `{self.prog} --help`)\n")


def package_version() -> str:
    """The project's version: the installed distribution's, else the source tree's.

    A source tree never installed (``python -m psclient.cli`` from a checkout) has no
    distribution metadata; its ``pyproject.toml`` says the version then. Packages copied
    without either say so instead of a version.
    """
    from importlib import metadata  # NOTE: here: its import alone takes milliseconds

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        pass
    tree = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    pyproject = os.path.join(tree, "pyproject.toml")
    try:
        return source_version(pyproject)
    except (OSError, ValueError, KeyError):
        return f"unknown (not installed, and no pyproject.toml at {pyproject})"


def source_version(pyproject: str) -> str:
    """``project.version`` of a ``pyproject.toml``.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not TOML (``tomllib.TOMLDecodeError``).
        KeyError: it has no ``project.version``.
    """
    import tomllib

    with open(pyproject, "rb") as f:
        version: str = tomllib.load(f)["project"]["version"]
    return version


class _VersionAction(argparse.Action):
    """``--version``: prints ``PROG VERSION`` and exits 0; the version is looked up only
    when asked for (reading the distribution's metadata takes tens of milliseconds)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default,
                         nargs=0, help=help or "show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"{parser.prog} {package_version()}", file=sys.stdout)
        parser.exit()


def add_version(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` a ``--version`` flag (see :class:`_VersionAction`)."""
    parser.add_argument("--version", action=_VersionAction)


def positive_int(text: str) -> int:
    """argparse type: an integer > 0, else a usage error in command-line terms."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}")
    return value
