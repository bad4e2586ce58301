"""README stays true: CI runs README's test command verbatim, and its main job names a real
subcommand. Every other block of README.md (and of docs/) runs in tests/test_docs.py."""

from __future__ import annotations

import re
from pathlib import Path

from nvecache.apps.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    return [b.strip() for b in blocks[:2]]


def test_ci_runs_readmes_test_command_verbatim() -> None:
    main_job, tests = _commands()
    assert "pytest" in tests and "hostcache demo" in main_job
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines


def test_main_job_names_a_real_subcommand() -> None:
    main_job, _ = _commands()
    argv = main_job.split("hostcache ", 1)[1].split()
    args = build_parser().parse_args(argv)
    assert args.replicas == 2 and args.seconds == 20
