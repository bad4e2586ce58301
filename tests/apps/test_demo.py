"""``hostcache demo``: the request stream, /proc memory figures, flags, and short real runs.

The end-to-end runs start real processes (the node service, spawned replicas) and take
several seconds each; they are marked ``slow``. Table names start with the ``table_name``
fixture's ``t-`` prefix, so the session's leak check covers them too.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from hostcache import BadArgumentError, HostCache, segment
from nvecache.apps.cli import build_parser, main
from nvecache.apps.demo import DemoConfig, DemoError, run_demo
from nvecache.apps.demo.memory import process_memory, segment_file_bytes, segment_resident_bytes
from nvecache.apps.demo.workload import RequestStream, ZipfKeys
from psclient import TableNotFoundError, connect

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def demo_cmd(prefix: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "nvecache.apps.cli", "demo", "--prefix", prefix, "--out",
            str(out), "--rows", "20000", "--no-progress", *extra]


def our_segments(prefix: str) -> list[str]:
    return [n for n in segment.list_names() if n.startswith(prefix)]


# -- pieces ----------------------------------------------------------------------------------


def test_request_batches_are_well_formed_bags() -> None:
    stream = RequestStream(1000, 500, 1.05, batch=64, history=8, popularity_seed=3, seed=4)
    for _ in range(3):
        req = stream.next()
        assert req.size == 64
        assert req.user_keys.shape == (64,) and req.user_offsets.tolist() == list(range(64))
        offs = req.item_offsets
        assert offs.shape == (128,) and int(offs[0]) == 0
        lengths = torch.diff(torch.cat([offs, torch.tensor([req.item_keys.numel()])]))
        assert bool((lengths >= 1).all())
        assert lengths[64:].tolist() == [1] * 64  # one candidate item per request
        assert int(lengths[:64].max()) <= 2 * 8 - 1
        assert 0 <= int(req.user_keys.min()) and int(req.user_keys.max()) < 1000
        assert 0 <= int(req.item_keys.min()) and int(req.item_keys.max()) < 500
        assert req.num_keys == 64 + req.item_keys.numel()


def test_replicas_share_popularity_but_not_draws() -> None:
    a = ZipfKeys(10_000, 1.05, popularity_seed=7, seed=1)
    b = ZipfKeys(10_000, 1.05, popularity_seed=7, seed=2)
    ka, kb = a.sample(20_000), b.sample(20_000)
    assert not torch.equal(ka, kb)
    assert int(torch.bincount(ka).argmax()) == int(torch.bincount(kb).argmax())
    assert 0 < a.top_share(10) < a.top_share(100) < a.top_share(10_000) == pytest.approx(1.0)
    other = ZipfKeys(10_000, 1.05, popularity_seed=8, seed=1)
    assert int(torch.bincount(other.sample(20_000)).argmax()) != int(torch.bincount(ka).argmax())


def test_resident_memory_counts_written_pages_once(table_name: str) -> None:
    hc = HostCache.create(table_name, capacity=50_000, dim=64)
    try:
        size = segment_file_bytes(table_name)
        before = segment_resident_bytes(table_name)
        assert 0 < before < size / 4  # sparse: only the header and the key array are written
        hc.insert(torch.arange(40_000), torch.ones(40_000, 64))
        after = segment_resident_bytes(table_name)
        assert after - before >= 40_000 * 64 * 4 * 0.9
        mem = process_memory("self", [table_name])
        (mapping,) = mem.segments
        assert mapping.name == table_name and mapping.size >= size
        assert 0 < mapping.rss <= after + 4096 and 0 < mapping.pss <= mapping.rss
        assert mem.rss >= mapping.rss and 0 < mem.uss <= mem.rss
    finally:
        hc.close()
        HostCache.unlink(table_name)


@pytest.mark.parametrize(
    ("field", "value"),
    [("replicas", 0), ("seconds", 0.0), ("rows", 10), ("host_fraction", 1.5),
     ("device", "tpu"), ("alpha", -1.0), ("ps_url", "localhost:6379")],
)
def test_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(BadArgumentError, match=field.replace("_", "-").split("-url")[0]):
        DemoConfig(**{field: value})  # type: ignore[arg-type]


def test_bad_flag_is_one_line_and_creates_nothing(
        capsys: pytest.CaptureFixture[str], table_name: str, tmp_path: Path) -> None:
    rc = main(["demo", "--replicas", "0", "--prefix", table_name, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("hostcache: error: --replicas must be") and err.count("\n") == 1
    assert our_segments(table_name) == []


def _read_only_dir(tmp_path: Path) -> Path:
    if os.geteuid() == 0:
        pytest.skip("root writes into a directory without write permission")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    return ro


@pytest.mark.parametrize("where", ["a file in the path", "a read-only directory"])
def test_unwritable_out_is_one_line_before_anything_starts(
        capsys: pytest.CaptureFixture[str], table_name: str, tmp_path: Path, where: str) -> None:
    if where == "a file in the path":
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "demo-out"
    else:
        out = _read_only_dir(tmp_path)
    state = tmp_path / "state"
    rc = main(["demo", "--prefix", table_name, "--out", str(out), "--state-dir", str(state),
               "--rows", "20000", "--seconds", "0.5", "--replicas", "1", "--no-service",
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith(f"hostcache: error: --out {out}: cannot write the report there: ")
    assert "give a directory you can write to" in err and err.count("\n") == 1
    assert not state.exists()  # refused before the demo made its state or started its node
    assert our_segments(table_name) == []
    assert not out.exists() or list(out.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine "
                    "without CUDA; this one has it")
def test_device_cuda_without_cuda_is_one_line(
        capsys: pytest.CaptureFixture[str], table_name: str, tmp_path: Path) -> None:
    rc = main(["demo", "--device", "cuda", "--prefix", table_name, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "--device cuda needs CUDA" in err and err.count("\n") == 1
    assert our_segments(table_name) == []


def test_taken_name_is_refused_and_left_alone(
        capsys: pytest.CaptureFixture[str], table_name: str, tmp_path: Path) -> None:
    prefix = table_name + "-"
    hc = HostCache.create(prefix + "user", capacity=64, dim=8)
    try:
        rc = main(["demo", "--prefix", prefix, "--out", str(tmp_path / "o"), "--state-dir",
                   str(tmp_path / "s"), "--rows", "20000", "--no-progress"])
        err = capsys.readouterr().err
        assert rc == 2 and "already exists" in err
        assert segment.exists(prefix + "user")  # someone else's table: not removed
        assert our_segments(prefix) == [prefix + "user"]
        assert not (tmp_path / "s" / "ps").exists()  # nothing was loaded
    finally:
        hc.close()
        HostCache.unlink(prefix + "user")


def test_import_hostcache_does_not_import_gpu_or_the_apps() -> None:
    code = ("import sys, hostcache, hostcache.cli; "
            "assert 'gpu' not in sys.modules, 'gpu imported'; "
            "assert 'nvecache.apps' not in sys.modules, 'apps imported'; "
            "assert 'matplotlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# -- end to end ------------------------------------------------------------------------------


def check_report(report: dict, replicas: int, prefix: str) -> None:
    for scope in ("run", "window"):
        for tier in ("gpu", "host", "ps"):
            rate = report["hit_rates"][scope][tier]
            assert rate is not None and 0.0 <= rate <= 1.0, (scope, tier, rate)
    assert report["hit_rates"]["run"]["ps"] == 1.0  # every table row was loaded
    assert report["throughput"]["requests_per_s"] > 0
    assert report["throughput"]["keys_per_s"] > report["throughput"]["requests_per_s"]
    lat = report["latency_ms"]
    assert 0 < lat["p50"] <= lat["p99"]
    mem = report["memory"]
    assert mem["shared_resident_bytes"] > 0
    assert mem["shared_resident_bytes"] <= mem["shared_virtual_bytes"]
    assert mem["private_equivalent_bytes"] == replicas * mem["shared_resident_bytes"]
    assert len(report["replicas"]) == replicas
    for r in report["replicas"]:
        assert r["requests"] > 0 and r["segment_rss_bytes"] > 0
        assert 0 < r["segment_pss_bytes"] <= r["segment_rss_bytes"]
    # sharing, measured: every replica maps the same pages, and their PSS adds up to at
    # most the segments' resident size (the rest is charged to the node process)
    assert mem["replicas_segment_pss_bytes"] <= mem["shared_resident_bytes"] * 1.05
    assert len(report["series"]["t_s"]) >= 2
    assert report["leaked_segments"] == []
    assert our_segments(prefix) == []


@pytest.mark.slow
def test_demo_command_end_to_end_with_the_service(
        capsys: pytest.CaptureFixture[str], table_name: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = table_name + "-"
    out = tmp_path / "out"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its state dir goes
    rc = main(demo_cmd(prefix, out, "--replicas", "2", "--seconds", "2", "--device",
                       "cpu")[3:])
    stdout, err = capsys.readouterr()
    assert rc == 0, err[-3000:]
    assert "shared host cache" in stdout and "requests/s" in stdout
    report = json.loads((out / "demo.json").read_text())
    assert report["node"] == "service"
    check_report(report, 2, prefix)
    png = (out / "demo.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    assert not any(tmp_path.glob("hostcache-demo-*"))  # its state dir was removed


@pytest.mark.slow
def test_demo_in_process_without_the_service(table_name: str, tmp_path: Path) -> None:
    prefix = table_name + "-"
    cfg = DemoConfig(replicas=1, seconds=2.0, rows=20_000, prefix=prefix, progress=False,
                     out_dir=str(tmp_path / "out"), state_dir=str(tmp_path / "state"),
                     use_service=False, tick=0.25)
    report = run_demo(cfg)
    assert report["node"] == "local"
    check_report(report, 1, prefix)
    assert json.loads((tmp_path / "out" / "demo.json").read_text())["node"] == "local"
    # the state dir was given: it stays, but the demo's PS tables were dropped
    for suffix in ("user", "item"):
        with pytest.raises(TableNotFoundError):
            connect(f"file://{tmp_path / 'state' / 'ps'}", table=prefix + suffix)


@pytest.mark.slow
def test_load_only_then_attach_leaves_the_node_alone(table_name: str, tmp_path: Path) -> None:
    prefix = table_name + "-"
    state = str(tmp_path / "state")
    common = {"rows": 20_000, "prefix": prefix, "progress": False, "state_dir": state,
              "out_dir": str(tmp_path / "out")}
    first = run_demo(DemoConfig(mode="load", **common))  # type: ignore[arg-type]
    again = run_demo(DemoConfig(mode="load", **common))  # type: ignore[arg-type]
    assert (first["loaded"], again["loaded"]) == (2, 0)  # the second run keeps the tables
    cfg = DemoConfig(mode="attach", replicas=1, seconds=1.5, tick=0.25, **common)  # type: ignore[arg-type]
    with pytest.raises(DemoError, match="--attach needs the node's tables"):
        run_demo(cfg)  # no host caches yet: a clear error, nothing created
    assert our_segments(prefix) == []
    caches = [HostCache.create(n, capacity=cfg.host_capacity, dim=cfg.dim)
              for n in cfg.table_names]
    try:
        report = run_demo(cfg)
        assert report["node"] == "attached"
        assert report["throughput"]["requests_per_s"] > 0
        assert report["hit_rates"]["run"]["ps"] == 1.0
        assert sorted(our_segments(prefix)) == sorted(cfg.table_names)  # the node's: kept
        assert sum(len(c) for c in caches) > 0  # the replica filled the node's caches
    finally:
        for c in caches:
            c.close()
            HostCache.unlink(c.name)
    for name in cfg.table_names:  # loaded tables stay in the parameter server
        with connect(f"file://{state}/ps", table=name) as ps:
            assert ps.size() == 20_000


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for k in map(int, kids):
            found |= {k} | _children(k)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_ctrl_c_removes_every_process_and_segment(table_name: str, tmp_path: Path) -> None:
    prefix = table_name + "-"
    proc = subprocess.Popen(
        demo_cmd(prefix, tmp_path / "out", "--replicas", "2", "--seconds", "60"),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        process_group=0, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        # wait for the run to be under way: both segments exist and both replicas run
        deadline = time.monotonic() + 90
        kids: set[int] = set()
        while time.monotonic() < deadline and proc.poll() is None:
            kids = _children(proc.pid)
            if len(our_segments(prefix)) == 2 and len(kids) >= 3:  # service + 2 replicas
                break
            time.sleep(0.1)  # polling another process's progress
        assert proc.poll() is None and len(kids) >= 3
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 2, err[-2000:]
    assert "interrupted" in err
    assert our_segments(prefix) == []
    deadline = time.monotonic() + 10  # orphans would be reparented, not gone: wait for exit
    while [k for k in kids if _alive(k)] and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for other processes' exit
    assert not [k for k in kids if _alive(k)]
    assert not (tmp_path / "out" / "demo.json").exists()


def test_default_output_folder_is_git_ignored() -> None:
    """A demo run from anywhere in the checkout leaves no untracked files behind."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout of the project")
    default = build_parser().parse_args(["demo"]).out
    assert not os.path.isabs(default)
    for where in (ROOT, ROOT / "docs"):  # relative to the directory the demo runs in
        for name in ("demo.json", "demo.png", "replica-1/demo.json"):
            path = where / default / name
            proc = subprocess.run([git, "check-ignore", "-q", str(path)], cwd=ROOT, timeout=30)
            assert proc.returncode == 0, f"{path.relative_to(ROOT)} is not git-ignored"
