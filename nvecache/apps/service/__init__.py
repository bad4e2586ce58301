"""The node service (``hostcache serve``): owns the node's shared tables, applies the
parameter servers' change feeds to them, reaps dead processes, serves metrics and health.

See docs/service.md for the config reference, endpoints, signals and failure behaviour.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nvecache.apps.errors import ServiceConfigError, ServiceRunningError
from nvecache.common.lazy import lazy_names

if TYPE_CHECKING:
    from nvecache.apps.service.config import ServiceConfig, TableConfig, build_config
    from nvecache.apps.service.node import NodeService

# NOTE: imported on first use (PEP 562): the ``hostcache`` command builds its parser from
# this package's command module without loading the service (torch, the feeds).
__getattr__, __dir__ = lazy_names(__name__, globals(), {
    "ServiceConfig": "nvecache.apps.service.config",
    "TableConfig": "nvecache.apps.service.config",
    "build_config": "nvecache.apps.service.config",
    "NodeService": "nvecache.apps.service.node",
})

__all__ = [
    "NodeService",
    "ServiceConfig",
    "ServiceConfigError",
    "ServiceRunningError",
    "TableConfig",
    "build_config",
]
