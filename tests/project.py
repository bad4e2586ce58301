"""What the project declares about itself, read from pyproject.toml (installed or not)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def project_version() -> str:
    """The version pyproject.toml declares (what ``--version`` prints, installed or not)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["version"])
