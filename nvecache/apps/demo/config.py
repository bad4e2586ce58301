"""The demo's settings: one validated dataclass, built from the command line."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from hostcache import BadArgumentError

Device = Literal["cpu", "cuda"]
#: ``"all"``: everything in one command; ``"attach"``: replicas only, on a node whose
#: service and parameter-server tables already exist; ``"load"``: load the tables, exit.
Mode = Literal["all", "attach", "load"]

#: the two embedding tables of the demo's ranking model: (suffix, what it holds)
TABLES: tuple[tuple[str, str], ...] = (("user", "one row per user"), ("item", "one row per item"))


@dataclass(frozen=True)
class DemoConfig:
    """Everything one ``hostcache demo`` run needs; validated at construction."""

    #: replica processes (spawned), each with its own model and device-side cache.
    replicas: int = 2
    #: seconds every replica serves requests (after all are ready).
    seconds: float = 20.0
    #: where the replicas' models run: ``"cpu"`` or ``"cuda"`` (replica i on GPU i % count).
    device: Device = "cpu"
    #: parameter-server URL; None: an embedded ``file://`` store in the state directory.
    ps_url: str | None = None
    #: rows of each of the two tables (user, item).
    rows: int = 750_000
    #: elements per row (float32).
    dim: int = 64
    #: Zipf exponent of key popularity (1.05: the standard workload; 0: uniform).
    alpha: float = 1.05
    #: requests (samples) per batch.
    batch: int = 256
    #: mean length of a request's item-history bag (lengths uniform in 1..2*mean-1).
    history: int = 20
    #: shared host cache capacity per table, as a fraction of the table's rows.
    host_fraction: float = 0.2
    #: device-side (GPU, or CPU with --device cpu) cache per table per replica, MiB.
    gpu_cache_mib: float = 8.0
    #: torch threads per replica process.
    threads: int = 1
    #: directory for the JSON report and the PNG plot.
    out_dir: str = "demo-out"
    #: directory for the embedded parameter server and the service state; None: a fresh
    #: temporary directory, removed at the end.
    state_dir: str | None = None
    #: prefix of the table names (segments are ``/dev/shm/nvec.<prefix>user`` ...).
    prefix: str = field(default_factory=lambda: f"demo{os.getpid()}-")
    #: start the node service (``hostcache serve``, which needs the ``apps`` extra's
    #: prometheus-client); False: the demo creates the host caches itself.
    use_service: bool = True
    #: seconds between progress samples (bars, the time series of the plot).
    tick: float = 0.5
    #: show progress bars.
    progress: bool = True
    #: seed of the table contents, the key popularity and the model weights.
    seed: int = 0
    #: mixed into the replicas' request draws only (not the tables, the key popularity or
    #: the model): demos attached to one node (``--attach``) each pass another value.
    stream_seed: int = 0
    #: what this run does (see :data:`Mode`).
    mode: Mode = "all"

    def __post_init__(self) -> None:
        def bad(name: str, what: str, value: object) -> BadArgumentError:
            return BadArgumentError(f"--{name.replace('_', '-')} must be {what}; got {value!r}")

        def positive_int(name: str, value: object, lo: int = 1) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise bad(name, f"an integer >= {lo}", value)

        positive_int("replicas", self.replicas)
        if self.replicas > 64:
            raise bad("replicas", "at most 64 (one process each)", self.replicas)
        positive_int("rows", self.rows, 1000)
        positive_int("dim", self.dim)
        positive_int("batch", self.batch)
        positive_int("history", self.history)
        positive_int("threads", self.threads)
        if not 0 < self.seconds <= 24 * 3600:
            raise bad("seconds", "a duration in (0, 86400]", self.seconds)
        if self.device not in ("cpu", "cuda"):
            raise bad("device", "'cpu' or 'cuda'", self.device)
        if not 0 <= self.alpha <= 3:
            raise bad("alpha", "a Zipf exponent in [0, 3]", self.alpha)
        if not 0 < self.host_fraction <= 1:
            raise bad("host_fraction", "a fraction in (0, 1]", self.host_fraction)
        if not 0 <= self.gpu_cache_mib <= 1 << 20:
            raise bad("gpu_cache_mib", "a size in MiB >= 0", self.gpu_cache_mib)
        if not 0.05 <= self.tick <= 10:
            raise bad("tick", "seconds in [0.05, 10]", self.tick)
        if self.mode not in ("all", "attach", "load"):
            raise bad("mode", "'all', 'attach' or 'load'", self.mode)
        if self.mode != "all" and self.ps_url is None and self.state_dir is None:
            raise BadArgumentError(
                "--attach and --load-only share tables with other commands: pass --ps URL "
                "(e.g. redis://127.0.0.1:6379/0) or --state-dir DIR (its file:// store)")
        if self.ps_url is not None and "://" not in self.ps_url:
            raise bad("ps", "a URL such as redis://127.0.0.1:6379/0", self.ps_url)

    @property
    def host_capacity(self) -> int:
        """Rows of each shared host cache."""
        return max(64, int(self.rows * self.host_fraction))

    @property
    def gpu_cache_bytes(self) -> int:
        """Bytes of each device-side cache (per table, per replica)."""
        return int(self.gpu_cache_mib * (1 << 20))

    def table_name(self, suffix: str) -> str:
        """Segment (and parameter-server table) name of one of :data:`TABLES`."""
        return f"{self.prefix}{suffix}"

    @property
    def table_names(self) -> list[str]:
        return [self.table_name(suffix) for suffix, _ in TABLES]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
