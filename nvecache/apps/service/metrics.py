"""The service's HTTP endpoints: Prometheus ``/metrics`` and ``/healthz``.

One small ``ThreadingHTTPServer`` in a daemon thread. The metrics are read at scrape time
from the shared tables' node-wide counters (every process, past and present) and from the
feed followers, through a custom collector on a private registry, so a scrape always
shows the current figures and nothing is counted twice. GPU-tier figures live in the
replicas (``layer.stats()``); the node only knows the host tier.

prometheus-client comes with the ``apps`` extra (an optional dependency): it is imported
where the endpoints are built and scraped, so the service runs without it when its
endpoints are off (``metrics_port = -1``) and ``serve --check`` needs none.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from nvecache.apps.extras import require
from nvecache.apps.service.feed import LAG_BUCKETS

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

logger = logging.getLogger(__name__)

#: (metric name, help, kind, snapshot field); kind "c" = counter, "g" = gauge
TABLE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("nvec_table_capacity_rows", "Rows the table can hold", "g", "capacity"),
    ("nvec_table_size_rows", "Rows the table holds now", "g", "size"),
    ("nvec_table_lookups", "Lookup batches on the host tier, node-wide", "c", "lookups"),
    ("nvec_table_lookup_keys", "Keys looked up on the host tier, node-wide", "c",
     "lookup_keys"),
    ("nvec_table_hits", "Keys found in the host tier, node-wide", "c", "hits"),
    ("nvec_table_misses", "Keys not found in the host tier, node-wide", "c", "misses"),
    ("nvec_table_inserts", "Rows written by inserts, node-wide", "c", "inserts"),
    ("nvec_table_evictions", "Rows evicted to make room, node-wide", "c", "evictions"),
    ("nvec_table_updates", "Rows overwritten by updates, node-wide", "c", "updates"),
    ("nvec_table_erases", "Rows erased, node-wide", "c", "erases"),
    ("nvec_table_replicas", "Live processes attached to the table, the service excluded",
     "g", "replicas"),
    ("nvec_table_reaped_processes", "Dead processes whose counter slots the service freed",
     "c", "reaped"),
    ("nvec_feed_up", "1 when the last change-feed poll reached the parameter server", "g",
     "feed_up"),
    ("nvec_feed_lag_seconds", "Seconds since the last successful change-feed call", "g",
     "feed_lag"),
    ("nvec_feed_keys_applied", "Changed keys applied from the change feed", "c",
     "feed_keys"),
    ("nvec_feed_gaps", "Change-feed gaps (the table was reset)", "c", "feed_gaps"),
    ("nvec_feed_errors", "Failed change-feed polls (parameter server unreachable)", "c",
     "feed_errors"),
)


class NodeCollector:
    """Builds the metric families from ``snapshot()`` (a list of per-table dicts)."""

    def __init__(self, snapshot: Callable[[], list[dict[str, Any]]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        # NOTE: lazy: prometheus-client is optional (the apps extra); see the module docstring
        from prometheus_client.metrics_core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            SummaryMetricFamily,
        )

        snaps = self._snapshot()
        for name, doc, kind, key in TABLE_METRICS:
            fam: CounterMetricFamily | GaugeMetricFamily = (
                CounterMetricFamily(name, doc, labels=["table", "kind"]) if kind == "c"
                else GaugeMetricFamily(name, doc, labels=["table", "kind"]))
            for s in snaps:
                if s.get(key) is not None:
                    fam.add_metric([s["table"], s["kind"]], float(s[key]))
            yield fam
        rate = GaugeMetricFamily("nvec_hit_rate", "Hit rate of a tier (keys hit over keys "
                                 "looked up), node-wide", labels=["table", "tier"])
        for s in snaps:
            if s.get("hit_rate") is not None:
                rate.add_metric([s["table"], "host"], s["hit_rate"])
        yield rate
        lat = SummaryMetricFamily("nvec_feed_poll_seconds", "Latency of change-feed polls "
                                  "to the parameter server", labels=["table"])
        for s in snaps:
            if s.get("feed_polls") is not None:
                lat.add_metric([s["table"]], s["feed_polls"], s["feed_poll_seconds"])
        yield lat
        prop = HistogramMetricFamily(
            "nvec_feed_propagation_seconds", "Propagation lag of the changes applied from "
            "the parameter server's feed: commit there to the erase here (per applied batch, "
            "its oldest change)", labels=["table"])
        for s in snaps:
            if s.get("feed_propagation") is not None:
                counts, total, seconds = s["feed_propagation"]
                buckets = [(str(b), c) for b, c in zip(LAG_BUCKETS, counts, strict=True)]
                prop.add_metric([s["table"]], [*buckets, ("+Inf", total)], seconds)
        yield prop


def _handler(registry: CollectorRegistry,
             health: Callable[[], tuple[bool, dict[str, Any]]]) -> type[BaseHTTPRequestHandler]:
    # NOTE: lazy: prometheus-client is optional (the apps extra); see the module docstring
    from prometheus_client import generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            elif path in ("/healthz", "/health"):
                ok, body = health()
                self._send(200 if ok else 503, "application/json",
                           json.dumps(body).encode())
            elif path == "/":
                self._send(200, "text/plain; charset=utf-8",
                           b"hostcache serve: /metrics /healthz\n")
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found\n")

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            logger.debug("http %s %s", self.address_string(), format % args)

    return Handler


class EndpointServer:
    """``/metrics`` and ``/healthz`` on ``host:port`` (port 0: a free one) in a thread.

    Raises:
        MissingExtraError: prometheus-client (the ``apps`` extra) is not installed.
    """

    def __init__(self, host: str, port: int, snapshot: Callable[[], list[dict[str, Any]]],
                 health: Callable[[], tuple[bool, dict[str, Any]]]) -> None:
        require("prometheus_client", "the node service's /metrics endpoint")
        # NOTE: lazy: prometheus-client is optional (the apps extra); see the module docstring
        from prometheus_client import CollectorRegistry

        self.registry: CollectorRegistry = CollectorRegistry(auto_describe=False)
        self.registry.register(NodeCollector(snapshot))
        self._server = ThreadingHTTPServer((host, port), _handler(self.registry, health))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.2}, name="http",
                                        daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
