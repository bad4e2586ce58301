"""Gaps in the parameter server's change feed heal: the node ends consistent with the PS
again (a full re-sync, never a silent skip) and says so (nvec_feed_gaps_total, the table's
feed status).

A Redis restart without persistence loses the feed (and the rows) the node followed: its
cursor is then ahead of the new feed, a gap. The rows written after the restart must be
served, never the node's cached copies of the old ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import psclient
from hostcache import HostCache, segment
from nvecache.apps.service import build_config
from tests.apps.test_service import Running
from tests.servers import REDIS_SERVER, RedisProc, free_port, wait_until
from tests.test_failures import DIM, http_get, rows_of, write_config


@pytest.fixture
def volatile_redis(tmp_path: Path) -> Any:
    """A private redis-server that keeps nothing on disk (a restart empties it)."""
    if REDIS_SERVER is None:
        pytest.skip("needs the redis-server binary (apt-get install redis-server)")
    srv = RedisProc(tmp_path / "redis", free_port(), "--appendonly", "no").start()
    yield srv
    srv.kill()


def test_a_redis_restart_that_lost_the_feed_resyncs_the_node(
        volatile_redis: RedisProc, tmp_path: Path, table_name: str) -> None:
    url = volatile_redis.url
    keys = torch.arange(100)
    with psclient.connect(url, table=table_name, dim=DIM) as ps:
        ps.insert(keys, rows_of(keys, 0))
    path = write_config(tmp_path / "node.toml",
                        {"state_dir": str(tmp_path / "state"), "metrics_port": 0,
                         "poll_interval": 0.05, "settle": 0.0},
                        [{"name": table_name, "capacity": 1024, "dim": DIM, "ps_url": url,
                          "warmup": 100}])
    run = Running(build_config(path, env={}))
    try:
        hc = HostCache.attach(table_name)
        follower = run.service.followers[table_name]
        wait_until(lambda: follower.state.up, 10, "the follower on the feed")
        assert bool(hc.contains(keys).all())  # warmed up with version 0
        volatile_redis.kill()
        volatile_redis.start()  # empty: rows and feed are gone
        with psclient.connect(url, table=table_name, dim=DIM) as ps:
            ps.insert(keys, rows_of(keys, 1))  # restored with newer rows
        wait_until(lambda: hc.feed_status().gaps == 1, 30, "the gap to be re-synced")
        # nothing cached from before the restart survives the re-sync
        values, hit = hc.lookup(keys)
        assert bool((values[hit, 1] == 1).all())
        _, body = http_get(run.url + "/metrics")
        assert f'nvec_feed_gaps_total{{kind="hostcache",table="{table_name}"}} 1.0' in body
        # and the feed is followed again after the gap
        with psclient.connect(url, table=table_name) as ps:
            ps.update(keys[:3], rows_of(keys[:3], 2))
        wait_until(lambda: not hc.contains(keys[:3]).any(), 10, "the new feed applied")
        hc.close()
    finally:
        run.stop()
        if segment.exists(table_name):
            segment.unlink(table_name)
