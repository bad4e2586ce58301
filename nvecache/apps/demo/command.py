"""``hostcache demo``'s command line: its flags, their checks, and the run's output.

The run needs the ``apps`` extra (matplotlib for the plot; prometheus-client for the node
service it starts): a missing one is a one-line error before anything starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from typing import TYPE_CHECKING, TextIO

from hostcache import BadArgumentError
from nvecache.apps.demo.config import DemoConfig
from nvecache.common.lazy import deferred, lazy_import

if TYPE_CHECKING:
    import torch

    from hostcache import segment
    from nvecache.apps.demo.report import format_summary
    from nvecache.apps.demo.run import run_demo
else:  # NOTE: `hostcache --help` and the table commands build this parser: no torch for them
    torch = lazy_import("torch", globals())
    segment = lazy_import("hostcache.segment", globals())
    format_summary = deferred("nvecache.apps.demo.report", "format_summary")
    run_demo = deferred("nvecache.apps.demo.run", "run_demo")

__all__ = ["HELP", "config_from_args", "configure", "run_command"]

HELP = "run the end-to-end demo: N replicas sharing the node's host caches (docs/demo.md)"


def configure(p: argparse.ArgumentParser) -> None:
    """Add the demo's flags to ``p``."""
    d = DemoConfig(prefix="x")
    p.add_argument("--replicas", type=int, default=d.replicas,
                   help=f"replica processes (default {d.replicas})")
    p.add_argument("--seconds", type=float, default=d.seconds,
                   help=f"seconds every replica serves (default {d.seconds:g})")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the models and their private caches run (default: cuda when "
                        "torch has CUDA and the gpu extra is installed, else cpu)")
    p.add_argument("--ps", metavar="URL", default=None,
                   help="parameter server URL, e.g. redis://127.0.0.1:6379/0 (default: an "
                        "embedded file:// store in the state directory)")
    p.add_argument("--rows", type=int, default=d.rows,
                   help=f"rows of each of the two tables (default {d.rows:,})")
    p.add_argument("--dim", type=int, default=d.dim, help=f"row length (default {d.dim})")
    p.add_argument("--alpha", type=float, default=d.alpha,
                   help=f"Zipf exponent of key popularity (default {d.alpha:g})")
    p.add_argument("--batch", type=int, default=d.batch,
                   help=f"requests per batch (default {d.batch})")
    p.add_argument("--history", type=int, default=d.history,
                   help=f"mean items in a request's history bag (default {d.history})")
    p.add_argument("--host-fraction", type=float, default=d.host_fraction,
                   help="shared host cache size as a fraction of a table's rows "
                        f"(default {d.host_fraction:g})")
    p.add_argument("--gpu-cache-mib", type=float, default=d.gpu_cache_mib,
                   help="private device cache per table per replica, MiB "
                        f"(default {d.gpu_cache_mib:g})")
    p.add_argument("--threads", type=int, default=d.threads,
                   help=f"torch threads per replica (default {d.threads})")
    p.add_argument("--out", default=d.out_dir, metavar="DIR",
                   help=f"where demo.json and demo.png go (default ./{d.out_dir})")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="directory for the embedded parameter server and the service state "
                        "(default: a temporary directory, removed at the end)")
    p.add_argument("--prefix", default=None,
                   help="table name prefix (default demo<pid>-)")
    p.add_argument("--no-service", action="store_true",
                   help="create the host caches in the demo process instead of starting "
                        "`hostcache serve`")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--attach", action="store_true",
                      help="replicas only: use the host caches of a running `hostcache serve` "
                           "and tables already in --ps (docker-compose.yml runs it so)")
    mode.add_argument("--load-only", action="store_true",
                      help="build the tables, load them into --ps (kept; a table already "
                           "loaded is left alone) and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true",
                   help="print the JSON report instead of the table")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the tables, the key popularity and the model")
    p.add_argument("--stream-seed", type=int, default=d.stream_seed,
                   help="seed of the request draws only: give each demo attached to one node "
                        "its own (--attach)")


def _cuda_ready() -> str | None:
    """None when replicas can run on CUDA here, else what is missing."""
    if not torch.cuda.is_available():
        return "CUDA, which torch reports unavailable here"
    if importlib.util.find_spec("cuda") is None:
        return ("cuda-python to register the shared host caches with CUDA: install the gpu "
                "extra (pip install -e '.[gpu]')")
    return None


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """The :class:`DemoConfig` of parsed ``hostcache demo`` arguments.

    Raises:
        BadArgumentError: a flag is out of range (``--device cuda`` without CUDA too).
    """
    device = args.device
    if device is None:
        device = "cuda" if _cuda_ready() is None else "cpu"
    elif device == "cuda":
        missing = _cuda_ready()
        if missing is not None:
            raise BadArgumentError(f"--device cuda needs {missing}; pass --device cpu")
    extra = {} if args.prefix is None else {"prefix": args.prefix}
    if args.prefix is not None:
        segment.check_name(args.prefix + "user")
    return DemoConfig(
        replicas=args.replicas, seconds=args.seconds, device=device, ps_url=args.ps,
        rows=args.rows, dim=args.dim, alpha=args.alpha, batch=args.batch,
        history=args.history, host_fraction=args.host_fraction,
        gpu_cache_mib=args.gpu_cache_mib, threads=args.threads, out_dir=args.out,
        state_dir=args.state_dir, use_service=not args.no_service,
        progress=not args.no_progress and not args.json, seed=args.seed,
        stream_seed=args.stream_seed,
        mode="attach" if args.attach else "load" if args.load_only else "all", **extra,
    )


def run_command(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run ``hostcache demo``: the summary table (or ``--json``) to ``out``; exit status.

    Raises:
        BadArgumentError: a flag is out of range.
        MissingExtraError: a package of the ``apps`` extra is missing.
        DemoError: the run failed or was interrupted (everything it started was removed).
    """
    cfg = config_from_args(args)
    report = run_demo(cfg)
    if cfg.mode == "load":
        print(f"tables {', '.join(report['tables'])} are in {report['ps_url']} (loaded "
              f"{report['loaded']} now, in {report['timing']['total_s']:.1f} s)", file=out)
        return 0
    if args.json:
        print(json.dumps(report, indent=2), file=out)
    else:
        format_summary(report, out)
        print(f"\n  wrote {report['outputs']['json']} and {report['outputs']['png']}", file=out)
    return 0
