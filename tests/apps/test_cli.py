"""The ``hostcache`` console script (nvecache.apps.cli): the table commands plus serve and demo, and
what ``serve`` and ``demo`` say when the ``apps`` extra is not installed.

A missing package is simulated for real: the command runs in a fresh interpreter whose
import system refuses that one module (``sys.modules[name] = None``, which makes every
``import name`` raise ModuleNotFoundError), as on a machine where it was never installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hostcache import HostCache, segment
from hostcache import cli as table_cli
from nvecache.apps import cli as apps_cli

ROOT = Path(__file__).resolve().parents[2]
INSTALL = 'pip install -e ".[apps]"'


def run_without(blocked: list[str], argv: list[str], cwd: Path,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``hostcache ARGV`` in a fresh interpreter where the ``blocked`` modules cannot be
    imported."""
    code = ("import sys\n"
            f"for name in {blocked!r}:\n"
            "    sys.modules[name] = None\n"
            "from nvecache.apps.cli import main\n"
            f"sys.exit(main({argv!r}))\n")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("hostcache: error: "), proc.stderr[-3000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    return proc.stderr


# -- one parser for all commands -------------------------------------------------------------


def test_console_script_has_the_table_commands_serve_and_demo(
        capsys: pytest.CaptureFixture[str]) -> None:
    names = [c.name for c in apps_cli.COMMANDS]
    assert names == [*(c.name for c in table_cli.COMMANDS), "serve", "demo"]
    assert apps_cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in names)
    assert apps_cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hostcache: error: give a command: ls, stat, create, rm, save, "
                          "restore, serve, demo")


def test_table_cli_alone_knows_only_the_table_commands(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert [c.name for c in table_cli.COMMANDS] == ["ls", "stat", "create", "rm", "save",
                                                    "restore"]
    assert table_cli.main(["demo"]) == 2
    assert "invalid choice: 'demo'" in capsys.readouterr().err


def test_python_m_hostcache_cli_runs_the_table_commands(table_name: str, tmp_path: Path) -> None:
    with HostCache.create(table_name, capacity=64, dim=4):
        try:
            proc = subprocess.run([sys.executable, "-m", "hostcache.cli", "ls", "--json",
                                   table_name], cwd=tmp_path, capture_output=True, text=True,
                                  timeout=120)
            assert proc.returncode == 0, proc.stderr
            (row,) = json.loads(proc.stdout)
            assert (row["name"], row["dim"]) == (table_name, 4)
        finally:
            HostCache.unlink(table_name)


def test_console_script_runs_serve_check(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "hostcache"
    script = str(exe) if exe.exists() else shutil.which("hostcache")
    if script is None:
        pytest.skip("the `hostcache` console script is not installed (pip install -e .)")
    proc = subprocess.run([script, "serve", "--hostcache", "name=t-check,capacity=64,dim=4",
                           "--state-dir", str(tmp_path / "state"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [t["name"] for t in json.loads(proc.stdout)["tables"]] == ["t-check"]


def test_serve_check_prints_each_tables_mode_in_octal(tmp_path: Path) -> None:
    """``--check`` prints a mode as the config spells it ("0600"), not as an int (384)."""
    proc = subprocess.run(
        [sys.executable, "-m", "nvecache.apps.cli", "serve",
         "--hostcache", "name=t-check,capacity=64,dim=4",
         "--linear", "name=t-check-lin,rows=8,dim=4,mode=0660",
         "--state-dir", str(tmp_path / "state"), "--check"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    tables = json.loads(proc.stdout)["tables"]
    assert [(t["name"], t["mode"]) for t in tables] == [("t-check", "0600"),
                                                        ("t-check-lin", "0660")]
    assert not (tmp_path / "state").exists()  # --check starts nothing


def test_import_apps_cli_leaves_the_heavy_extras_unimported() -> None:
    code = ("import sys, nvecache.apps.cli, nvecache.apps.demo, nvecache.apps.service; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported'; "
            "assert 'prometheus_client' not in sys.modules, 'prometheus_client imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


# -- without the apps extra ------------------------------------------------------------------


def test_help_and_table_commands_work_without_the_extra(tmp_path: Path) -> None:
    blocked = ["matplotlib", "prometheus_client"]
    proc = run_without(blocked, ["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "serve" in proc.stdout and "demo" in proc.stdout
    proc = run_without(blocked, ["ls", "--json", "t-no-such-table-*"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


def test_demo_without_matplotlib_is_one_line(table_name: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_without(["matplotlib"], ["demo", "--prefix", table_name + "-", "--out", str(out),
                                        "--rows", "20000", "--no-progress"], tmp_path)
    err = one_line_error(proc)
    assert "needs matplotlib, which is not installed" in err and INSTALL in err
    assert not out.exists()  # nothing started
    assert not [n for n in segment.list_names() if n.startswith(table_name)]


def test_demo_without_prometheus_client_is_one_line(table_name: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_without(["prometheus_client"], ["demo", "--prefix", table_name + "-", "--out",
                                               str(out), "--rows", "20000"], tmp_path)
    err = one_line_error(proc)
    assert "needs prometheus-client, which is not installed" in err and INSTALL in err
    assert "--no-service" in err  # what runs without it
    assert not out.exists()
    assert not [n for n in segment.list_names() if n.startswith(table_name)]


def test_serve_without_prometheus_client_is_one_line(table_name: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    argv = ["serve", "--hostcache", f"name={table_name},capacity=64,dim=4", "--state-dir",
            str(state), "--metrics-port", "0"]
    err = one_line_error(run_without(["prometheus_client"], argv, tmp_path))
    assert "needs prometheus-client, which is not installed" in err and INSTALL in err
    assert not segment.exists(table_name) and not state.exists()  # nothing created
    # --check validates the config without the endpoints: no prometheus-client needed
    proc = run_without(["prometheus_client"], [*argv, "--check"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tables"][0]["name"] == table_name
