"""The demo's report: figures from the replicas' results, a text table, JSON and a PNG.

Hit rates are per tier, each over the keys that reached that tier: the device cache over
every key looked up, the shared host cache over the distinct keys a batch missed in the
device cache, the parameter server over the keys the host cache missed. ``window`` figures
cover the last :data:`WINDOW_S` seconds (after warm-up); the others the whole run.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import tempfile
from typing import Any, TextIO

import numpy as np
import torch

from hostcache import BadArgumentError
from nvecache.apps.demo.config import TABLES, DemoConfig
from nvecache.apps.demo.replica import COUNTER_FIELDS
from nvecache.apps.extras import require

MIB = 1 << 20
#: seconds at the end of the run the ``window`` hit rates cover.
WINDOW_S = 5.0
#: seconds each point of the time series averages over.
SMOOTH_S = 1.0
JSON_NAME = "demo.json"
PNG_NAME = "demo.png"

_TIERS = (("gpu", 0), ("host", 2), ("ps", 4))


def _rate(hits: float, misses: float) -> float | None:
    return hits / (hits + misses) if hits + misses else None


def _tier_rates(c: list[int] | np.ndarray) -> dict[str, float | None]:
    return {tier: _rate(c[i], c[i + 1]) for tier, i in _TIERS}


def _sum(counters: list[dict[str, list[int]]], tables: list[str] | None = None) -> list[int]:
    out = [0] * len(COUNTER_FIELDS)
    for per_table in counters:
        for t, values in per_table.items():
            if tables is None or t in tables:
                for i, v in enumerate(values):
                    out[i] += v
    return out


def _series(samples: list[Any], tick: float) -> dict[str, list[float | None]]:
    """Per-point rates over ~SMOOTH_S seconds: throughput, hit rates, host resident MiB."""
    k = max(1, round(SMOOTH_S / tick))
    out: dict[str, list[float | None]] = {
        "t_s": [], "requests_per_s": [], "keys_per_s": [], "hit_rate_gpu": [],
        "hit_rate_host": [], "hit_rate_ps": [], "host_resident_mib": []}
    for i in range(1, len(samples)):
        a, b = samples[max(0, i - k)], samples[i]
        dt = b.t - a.t
        if dt <= 0:
            continue
        delta = np.array(b.counters) - np.array(a.counters)
        rates = _tier_rates(delta)
        out["t_s"].append(round(b.t, 3))
        out["requests_per_s"].append((b.requests - a.requests) / dt)
        out["keys_per_s"].append((b.keys - a.keys) / dt)
        for tier, _ in _TIERS:
            out[f"hit_rate_{tier}"].append(rates[tier])
        out["host_resident_mib"].append(b.host_resident / MIB)
    return out


def _window(samples: list[Any]) -> dict[str, float | None]:
    end = samples[-1]
    start = next((s for s in samples if s.t >= end.t - WINDOW_S), samples[0])
    return _tier_rates(np.array(end.counters) - np.array(start.counters))


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) * 1e3 if values.size else None


def build_report(cfg: DemoConfig, ps_url: str, node_kind: str, results: list[dict[str, Any]],
                 samples: list[Any], host_node: dict[str, Any], timings: dict[str, float],
                 leaked: list[str]) -> dict[str, Any]:
    """The report as a JSON-ready dict (see docs/demo.md for every field)."""
    n = len(results)
    lat = np.concatenate([np.asarray(r["latencies_s"], dtype=np.float64) for r in results]) \
        if results else np.zeros(0)
    counters = [r["counters"] for r in results]
    total = _sum(counters)
    per_table = {cfg.table_name(s): _tier_rates(_sum(counters, [s])) for s, _ in TABLES}
    shared_resident = sum(h["resident_bytes"] for h in host_node.values())
    shared_virtual = sum(h["segment_bytes"] for h in host_node.values())
    replicas = []
    for rid, r in enumerate(results):
        mem = r["memory"]
        seg_rss = sum(m["rss"] for m in mem["segments"])
        seg_pss = sum(m["pss"] for m in mem["segments"])
        rl = np.asarray(r["latencies_s"], dtype=np.float64)
        replicas.append({
            "replica": rid, "pid": r["pid"], "device": r["device"],
            "requests": r["requests"], "keys": r["keys"], "batches": r["batches"],
            "elapsed_s": r["elapsed_s"],
            "requests_per_s": r["requests"] / r["elapsed_s"],
            "keys_per_s": r["keys"] / r["elapsed_s"],
            "latency_p50_ms": _pct(rl, 50), "latency_p99_ms": _pct(rl, 99),
            "hit_rates": _tier_rates(_sum([r["counters"]])),
            "rss_bytes": mem["rss"], "pss_bytes": mem["pss"], "uss_bytes": mem["uss"],
            "segment_rss_bytes": seg_rss, "segment_pss_bytes": seg_pss,
            "device_cache_bytes": r["device_cache_bytes"],
        })
    mean_batch_keys = (sum(r["keys"] for r in results) / max(1, sum(r["batches"] for r in results)))
    return {
        "when": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "torch": _torch_version()},
        "config": {**cfg.as_dict(), "ps_url": ps_url, "host_capacity": cfg.host_capacity,
                   "gpu_cache_bytes": cfg.gpu_cache_bytes},
        "node": node_kind,
        "timing": {k: round(v, 3) for k, v in timings.items()},
        "throughput": {
            "requests_per_s": sum(x["requests_per_s"] for x in replicas),
            "keys_per_s": sum(x["keys_per_s"] for x in replicas),
            "requests": sum(x["requests"] for x in replicas),
            "keys": sum(x["keys"] for x in replicas),
        },
        "latency_ms": {"p50": _pct(lat, 50), "p99": _pct(lat, 99), "batches": int(lat.size),
                       "requests_per_batch": cfg.batch, "mean_keys_per_batch": mean_batch_keys},
        "hit_rates": {"run": _tier_rates(total), "window": _window(samples),
                      "window_s": WINDOW_S, "per_table": per_table,
                      "counters": dict(zip(COUNTER_FIELDS, total, strict=True))},
        "host_node": host_node,
        "memory": {
            "shared_resident_bytes": shared_resident,
            "shared_virtual_bytes": shared_virtual,
            "private_equivalent_bytes": n * shared_resident,
            "saved_bytes": (n - 1) * shared_resident,
            "replicas_segment_rss_bytes": sum(x["segment_rss_bytes"] for x in replicas),
            "replicas_segment_pss_bytes": sum(x["segment_pss_bytes"] for x in replicas),
            "device_cache_bytes_per_replica": cfg.gpu_cache_bytes * len(TABLES),
        },
        "replicas": replicas,
        "series": _series(samples, cfg.tick),
        "leaked_segments": leaked,
    }


def _torch_version() -> str:
    return str(torch.__version__)


def _p(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _mib(v: float) -> str:
    return f"{v / MIB:,.1f} MiB"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"


def format_summary(report: dict[str, Any], out: TextIO) -> None:
    """Print the report as the end-of-run table."""
    c = report["config"]
    n = len(report["replicas"])
    ps = "embedded file:// store" if c["ps_url"].startswith("file://") else c["ps_url"]
    node = {"service": "the node service (hostcache serve)",
            "attached": "attached to a running node service",
            }.get(report["node"], "host caches created by the demo")
    hr = report["hit_rates"]
    th = report["throughput"]
    lat = report["latency_ms"]
    mem = report["memory"]
    w = f"last {hr['window_s']:.0f} s"
    rows = [
        ("tier", "hit rate (run)", w, "size"),
        (f"device cache ({c['device']})", _p(hr["run"]["gpu"]), _p(hr["window"]["gpu"]),
         f"{c['gpu_cache_mib']:g} MiB per table per replica"),
        ("shared host cache", _p(hr["run"]["host"]), _p(hr["window"]["host"]),
         f"{c['host_capacity']:,} rows per table ({100 * c['host_fraction']:.0f}%)"),
        ("parameter server", _p(hr["run"]["ps"]), _p(hr["window"]["ps"]),
         f"{c['rows']:,} rows per table"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    print(f"\nhostcache demo: {n} replicas x {c['seconds']:g} s on {c['device']}; tables "
          f"{len(TABLES)} x {c['rows']:,} rows x dim {c['dim']} float32; Zipf {c['alpha']:g}; "
          f"{ps}; {node}", file=out)
    print(file=out)
    for r in rows:
        print("  " + "  ".join(x.ljust(widths[i]) if i in (0, 3) else x.rjust(widths[i])
                               for i, x in enumerate(r)).rstrip(), file=out)
    print(file=out)
    print(f"  throughput  {th['requests_per_s']:,.0f} requests/s  {th['keys_per_s']:,.0f} "
          f"keys/s  (" + ", ".join(f"replica {r['replica']}: {r['requests_per_s']:,.0f}/s"
                                    for r in report["replicas"]) + ")", file=out)
    print(f"  latency     p50 {_ms(lat['p50'])}  p99 {_ms(lat['p99'])}  per batch of "
          f"{lat['requests_per_batch']} requests (~{lat['mean_keys_per_batch']:,.0f} keys)",
          file=out)
    print(file=out)
    print("  memory (resident, from /proc and the /dev/shm files)", file=out)
    print(f"    shared host caches, one copy for the node   {_mib(mem['shared_resident_bytes'])}"
          f"  (of {_mib(mem['shared_virtual_bytes'])} mapped)", file=out)
    print(f"    private caches, same hit rate, {n} replicas   "
          f"{_mib(mem['private_equivalent_bytes'])}  ({n} x "
          f"{_mib(mem['shared_resident_bytes'])})", file=out)
    print(f"    saved by sharing                            {_mib(mem['saved_bytes'])}",
          file=out)
    for r in report["replicas"]:
        print(f"    replica {r['replica']} (pid {r['pid']}): maps the shared caches with RSS "
              f"{_mib(r['segment_rss_bytes'])} (PSS {_mib(r['segment_pss_bytes'])}); private "
              f"memory {_mib(r['uss_bytes'])}, of it device caches "
              f"{_mib(r['device_cache_bytes'])}", file=out)
    t = report["timing"]
    print(file=out)
    print(f"  time        {t['total_s']:.1f} s: build + load {t['load_s']:.1f} s, start "
          f"{t['start_s']:.1f} s, serve {t['serve_s']:.1f} s", file=out)
    if report["leaked_segments"]:
        print(f"  WARNING: segments left behind: {report['leaked_segments']}", file=out)


def _cannot_write(out_dir: str, e: OSError) -> BadArgumentError:
    where = f" ({e.filename})" if e.filename and e.filename != out_dir else ""
    return BadArgumentError(f"--out {out_dir}: cannot write the report there: "
                            f"{e.strerror or e}{where}; give a directory you can write to")


def check_out_dir(out_dir: str) -> None:
    """Create ``out_dir`` if needed and make sure a file can be written there.

    The demo calls it before it starts anything, so an unwritable ``--out`` costs no run.

    Raises:
        BadArgumentError: the directory cannot be created or written to.
    """
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out_dir, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise _cannot_write(out_dir, e) from None


def write_outputs(report: dict[str, Any], out_dir: str) -> dict[str, str]:
    """Write ``demo.json`` and ``demo.png`` into ``out_dir``; returns their paths.

    Raises:
        BadArgumentError: the files cannot be written there.
    """
    paths = {"json": os.path.join(out_dir, JSON_NAME), "png": os.path.join(out_dir, PNG_NAME)}
    report["outputs"] = paths
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(paths["json"], "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        plot(report, paths["png"])
    except OSError as e:
        raise _cannot_write(out_dir, e) from None
    return paths


def plot(report: dict[str, Any], path: str) -> None:
    """PNG of hit rates, throughput and shared-cache memory over time (matplotlib, Agg).

    Raises:
        MissingExtraError: matplotlib (the ``apps`` extra) is not installed.
    """
    require("matplotlib", "the demo's plot (demo.png)")
    # NOTE: matplotlib is an optional heavy dependency (the apps extra), imported only to
    # draw: the rest of the demo, and every command that imports it, runs without it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["series"]
    c = report["config"]
    n = len(report["replicas"])
    t = s["t_s"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True, constrained_layout=True)
    ax = axes[0]
    labels = {"gpu": f"device cache ({c['device']}, private)", "host": "shared host cache",
              "ps": "parameter server"}
    for tier, label in labels.items():
        ys = [np.nan if v is None else 100 * v for v in s[f"hit_rate_{tier}"]]
        ax.plot(t, ys, label=label, linewidth=2)
    ax.set_ylabel("hit rate (%)")
    ax.set_ylim(0, 105)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    ax.set_title(f"hostcache demo: {n} replicas on {c['device']}, {len(TABLES)} tables x "
                 f"{c['rows']:,} rows, Zipf {c['alpha']:g}")
    ax = axes[1]
    ax.plot(t, [v / 1e3 for v in s["requests_per_s"]], color="tab:green", linewidth=2,
            label="requests/s (all replicas)")
    ax.set_ylabel("thousand requests/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(t, [v / 1e6 for v in s["keys_per_s"]], color="tab:purple", linestyle="--",
             label="keys/s")
    ax2.set_ylabel("million keys/s")
    ax2.set_ylim(bottom=0)
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [ln.get_label() for ln in lines], loc="lower right")
    ax = axes[2]
    shared = s["host_resident_mib"]
    ax.plot(t, shared, color="tab:blue", linewidth=2, label="shared host caches (resident)")
    ax.plot(t, [n * v for v in shared], color="tab:red", linestyle="--", linewidth=2,
            label=f"{n} private caches of the same hit rate")
    ax.set_ylabel("MiB")
    ax.set_xlabel("seconds")
    ax.set_ylim(bottom=0)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)
