"""The node service (``hostcache serve``): owns the node's shared tables, applies the
parameter servers' change feeds to them, reaps dead processes, serves metrics and health.

See docs/service.md for the config reference, endpoints, signals and failure behaviour.
"""

from __future__ import annotations

from ..errors import ServiceConfigError, ServiceRunningError
from .config import ServiceConfig, TableConfig, build_config
from .node import NodeService

__all__ = [
    "NodeService",
    "ServiceConfig",
    "ServiceConfigError",
    "ServiceRunningError",
    "TableConfig",
    "build_config",
]
