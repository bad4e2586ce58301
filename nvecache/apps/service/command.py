"""``hostcache serve``: argument setup, logging, signals, and the run loop.

``hostcache serve --config node.toml [--state-dir DIR] [--metrics-port N] [--keep] ...``
runs until SIGTERM or SIGINT, then shuts down cleanly (segments removed unless kept).
Exit status: 0 after a clean shutdown, 2 for a user error (bad config, a second service,
a geometry mismatch, the ``apps`` extra's prometheus-client missing while the endpoints are
on), printed as one ``hostcache: error: ...`` line.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TextIO

from nvecache.apps.extras import require
from nvecache.common.lazy import deferred

if TYPE_CHECKING:
    from nvecache.apps.service.config import build_config
    from nvecache.apps.service.node import NodeService
else:  # NOTE: `hostcache --help` and the table commands build this parser: no torch for them
    build_config = deferred("nvecache.apps.service.config", "build_config")
    NodeService = deferred("nvecache.apps.service.node", "NodeService")

EXIT_OK = 0
HELP = "run the node service (docs/service.md)"

_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus any ``extra=`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
            "thread": record.threadName,
        }
        out.update({k: v for k, v in vars(record).items() if k not in _STD_ATTRS})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(fmt: str, level: str, stream: TextIO | None = None) -> None:
    """Log to stderr as text or JSON lines (replaces the root logger's handlers)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def configure(p: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand's arguments (flags override NVEC_* env over the file)."""
    p.add_argument("--config", metavar="FILE", help="node config (TOML); default $NVEC_CONFIG")
    p.add_argument("--state-dir", help="lock, cursors and endpoint.json live here "
                   "(one service per state dir)")
    p.add_argument("--metrics-host", help="address of /metrics and /healthz (127.0.0.1)")
    p.add_argument("--metrics-port", type=int,
                   help="port of /metrics and /healthz (9464; 0 = any free, -1 = none)")
    p.add_argument("--poll-interval", type=float, help="seconds between idle feed polls")
    p.add_argument("--reap-interval", type=float, help="seconds between dead-process reaps")
    p.add_argument("--keep", action="store_const", const=True, default=None,
                   help="keep the segments on shutdown (default: remove them)")
    p.add_argument("--log-format", choices=["text", "json"], help="log lines (text)")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--hostcache", action="append", default=[], metavar="SPEC",
                   help="a host cache, e.g. name=ctr,capacity=100000,dim=64,"
                   "ps_url=redis://127.0.0.1:6379/0 (repeatable; overrides the file)")
    p.add_argument("--linear", action="append", default=[], metavar="SPEC",
                   help="a linear table, e.g. name=item,rows=100000,dim=64 (repeatable)")
    p.add_argument("--check", action="store_true",
                   help="validate the config, print it as JSON and exit")


def checked_config(cfg: Any) -> dict[str, Any]:
    """The config as ``--check`` prints it: its fields, a table's ``mode`` spelled as in
    the file (octal, ``"0600"``)."""
    printed = asdict(cfg)
    for table in printed["tables"]:
        table["mode"] = f"{table['mode']:04o}"
    return printed


def run(args: argparse.Namespace, out: TextIO) -> int:
    """Build the config, start the service, wait for SIGTERM/SIGINT, stop.

    Raises:
        ServiceConfigError: the config is bad (nothing was created).
        MissingExtraError: the endpoints are on (``metrics_port`` >= 0) and prometheus-client
            is not installed (checked before any table is created).
        ServiceRunningError: another service runs for this state dir.
    """
    overrides = {k: getattr(args, k) for k in ("state_dir", "metrics_host", "metrics_port",
                                                "poll_interval", "reap_interval", "keep",
                                                "log_format", "log_level")}
    cfg = build_config(args.config, overrides=overrides, table_specs=args.hostcache,
                       linear_specs=args.linear)
    if args.check:
        print(json.dumps(checked_config(cfg), indent=2, default=str), file=out)
        return EXIT_OK
    if cfg.metrics_port >= 0:
        require("prometheus_client", "the node service's /metrics endpoint (metrics_port -1 "
                "turns the endpoints off)")
    setup_logging(cfg.log_format, cfg.log_level)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logging.getLogger(__name__).info("%s received: shutting down",
                                         signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    service = NodeService(cfg)
    service.start()
    service.serve(stop)
    return EXIT_OK
