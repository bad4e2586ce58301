"""``hostcache demo``: the end-to-end main job on the embedded defaults.

Builds two synthetic embedding tables, loads them into the parameter server, brings up the
node's shared host caches (through the node service, ``hostcache serve``), runs N replica
processes of a small ranking model on a Zipf request stream, and reports per-tier hit
rates, throughput, latency and the memory the shared host cache saves (docs/demo.md).

Modules: ``command`` (the command line), ``config`` (the settings), ``run`` (the
orchestration), ``node`` (tables and host caches), ``replica`` and ``model`` (one replica
process), ``workload`` (the request stream), ``memory`` (``/proc`` figures), ``report``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nvecache.apps.demo.command import HELP, config_from_args, configure, run_command
from nvecache.apps.demo.config import DemoConfig
from nvecache.apps.errors import DemoError, DemoInterruptedError
from nvecache.common.lazy import lazy_names

if TYPE_CHECKING:
    from nvecache.apps.demo.run import run_demo

# NOTE: imported on first use (PEP 562): the ``hostcache`` command builds its parser from
# this package's command module without loading the run (torch, the replicas).
__getattr__, __dir__ = lazy_names(__name__, globals(), {"run_demo": "nvecache.apps.demo.run"})

__all__ = [
    "HELP",
    "DemoConfig",
    "DemoError",
    "DemoInterruptedError",
    "config_from_args",
    "configure",
    "run_command",
    "run_demo",
]
