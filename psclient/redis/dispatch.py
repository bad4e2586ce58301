"""Where a partition's commands go, and what happens when the cluster moves a partition.

A batch's commands (one per partition chunk, each tagged with its partition) are packed into
pipelines (no MULTI), one node per pipeline, whole partitions per pipeline: a node's share of
a batch of up to ``inline_keys`` keys is one pipeline, a larger share pipelines of about
``pipeline_keys`` keys; the pipelines run concurrently on a thread pool (one pipeline in all
runs on the calling thread). The commands' bytes come from
:mod:`psclient.redis.resp`; :mod:`psclient.redis.wire` sends them and reads the replies.

NOTE: all chunks of one partition go into the same pipeline, in key order, so the last of
duplicate keys in a batch wins, as in a dict.

Redirections (a cluster resharding or failing over while we run): a command answered
``MOVED`` (the slot has a new owner: the slot map is refreshed), ``ASK`` (the slot is being
migrated and this partition's keys are already on the target: the command is resent there
after ``ASKING``), ``TRYAGAIN`` (a multi-key script whose keys are split between the two nodes
mid-migration: resent after a backoff) or ``CLUSTERDOWN`` is resent alone, not the batch:
commands that were applied are never applied twice. The resends follow a
``redis.retry.Retry(ExponentialBackoff)`` of ``redirect_retries`` attempts (by default
longer in all than a slot's migration). Every write script is safe to run again anyway
(its notice would list the keys again: a superset).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import redis.exceptions as rex
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from psclient.redis import resp
from psclient.redis.wire import run_pipeline

log = logging.getLogger(__name__)

#: replies that mean "send this command elsewhere or again", kept in place by the pipelines
REDIRECTS: tuple[type[Exception], ...] = (rex.AskError, rex.TryAgainError, rex.ClusterDownError)
_ASKING = resp.pack("ASKING")


class Cmd(NamedTuple):
    """One encoded command: partition, the range of sorted keys it covers, its bytes, and how
    many replies it gets (4 for a ``MULTI``, script, ``HSET``, ``EXEC`` transaction)."""

    part: int
    start: int
    stop: int
    payload: list[bytes | memoryview]
    replies: int = 1


#: errors kept in place while a pipeline's replies are read
_KEEP = (*REDIRECTS, rex.ExecAbortError)


def _take(replies: Any, cmd: Cmd) -> Any:
    """The result of ``cmd`` from the reply iterator: its one reply, or a transaction's
    ``EXEC`` reply (a redirection of a queued command stands for the whole transaction)."""
    if cmd.replies == 1:
        return next(replies)
    got = [next(replies) for _ in range(cmd.replies)]
    redirect = next((r for r in got if isinstance(r, REDIRECTS)), None)
    if redirect is not None:
        return redirect
    if isinstance(got[-1], Exception):
        raise got[-1]
    return got[-1]


class _StillRedirectedError(Exception):
    """Some commands were redirected again (the Retry's signal to back off and resend)."""


#: ``job(client, commands) -> replies``: runs one pipeline (default: run_pipeline)
Job = Callable[[Any, list[Cmd]], list[Any]]
#: ``finish(index, reply) -> result``: what a resent command's parsed reply becomes
Finish = Callable[[int, Any], Any]


class Dispatcher:
    """Runs a table's commands on the node that serves each partition."""

    _executor: ThreadPoolExecutor | None = None

    def __init__(self, client: Any, cluster: bool, part_keys: list[bytes], opts: dict[str, Any],
                 where: str, bell: bytes | None) -> None:
        self.client = client
        self._cluster = cluster
        self._part_keys = part_keys
        self._opts = opts
        self._where = where
        self._bell = None if bell is None else resp.pack("PUBLISH", bell, "1")
        self._node_of: list[Any] | None = None

    def nodes(self) -> list[Any]:
        """The client that serves each partition (one client when standalone)."""
        if self._node_of is None:
            if not self._cluster:
                self._node_of = [self.client] * len(self._part_keys)
            else:
                nm = self.client.nodes_manager
                self._node_of = [
                    self.client.get_redis_connection(nm.get_node_from_slot(self.client.keyslot(k)))
                    for k in self._part_keys
                ]
        return self._node_of

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._opts["max_workers"],
                                                thread_name_prefix="psclient")
        return self._executor

    def run(self, cmds: list[Cmd], job: Job | None = None, finish: Finish | None = None,
            *, bell: bool = False) -> list[Any]:
        """Execute commands; return their replies in order (redirections followed).

        Args:
            cmds: the commands.
            job: runs one pipeline and returns one reply per command, keeping replies of
                :data:`REDIRECTS` types in place (default: :func:`run_pipeline`).
            finish: turns a resent command's reply (parsed by redis-py) into its result.
            bell: end each pipeline with the cluster's doorbell ``PUBLISH`` (writes).
        """
        out = self._dispatch(cmds, job, bell)
        pending = [i for i, r in enumerate(out) if isinstance(r, REDIRECTS)]
        if pending:
            self._follow_redirects(cmds, out, pending, finish, bell)
        return out

    def _dispatch(self, cmds: list[Cmd], job: Job | None, bell: bool) -> list[Any]:
        nodes = self.nodes()
        if not self._cluster and cmds and \
                cmds[-1].stop - cmds[0].start <= self._opts["inline_keys"] and \
                all(a.stop == b.start for a, b in zip(cmds, cmds[1:], strict=False)):
            # NOTE: the common case (one node, one batch's consecutive commands, few keys):
            # one pipeline on this thread, without the per-command grouping below
            return self._run_work([(nodes[0], list(range(len(cmds))))], cmds, job, bell)
        jobs: dict[int, list[list[int]]] = {}  # id(node) -> pipelines (command indices)
        clients: dict[int, Any] = {}
        rows_in_last: dict[int, int] = {}
        last_part: dict[int, int] = {}
        # NOTE: a node's share of up to inline_keys keys is one pipeline (on the calling
        # thread when it is the only one): below that, splitting it over the pool cost more
        # client CPU than it overlapped (bench/RESULTS.md, "Parameter-server clients").
        keys_on: dict[int, int] = {}
        for cmd in cmds:
            nid = id(nodes[cmd.part])
            keys_on[nid] = keys_on.get(nid, 0) + cmd.stop - cmd.start
        inline = self._opts["inline_keys"]
        for i, cmd in enumerate(cmds):
            node = nodes[cmd.part]
            nid = id(node)
            clients[nid] = node
            pipes = jobs.setdefault(nid, [])
            limit = keys_on[nid] if keys_on[nid] <= inline else self._opts["pipeline_keys"]
            # NOTE: a new pipeline starts only at a partition boundary (keeps duplicate order)
            if not pipes or (rows_in_last[nid] >= limit and last_part[nid] != cmd.part):
                pipes.append([])
                rows_in_last[nid] = 0
            pipes[-1].append(i)
            rows_in_last[nid] += cmd.stop - cmd.start
            last_part[nid] = cmd.part
        work = [(clients[nid], idx) for nid, pipes in jobs.items() for idx in pipes]
        return self._run_work(work, cmds, job, bell)

    def _run_work(self, work: list[tuple[Any, list[int]]], cmds: list[Cmd], job: Job | None,
                  bell: bool) -> list[Any]:
        """Run the pipelines ``work`` (a client and its command indices each): on this
        thread when there is one, else on the pool; the replies in command order."""
        ring = self._bell if bell else None

        def execute(work_item: tuple[Any, list[int]]) -> list[Any]:
            client, idx = work_item
            if job is not None:
                return job(client, [cmds[i] for i in idx])
            payload = [part for i in idx for part in cmds[i].payload]
            n = sum(cmds[i].replies for i in idx)
            if ring is not None:
                # NOTE: the doorbell follows the scripts on the same connection: it rings
                # after they committed. A hint only; atomicity is the scripts'.
                payload.append(ring)
                n += 1
            replies = iter(run_pipeline(client, payload, n, keep=_KEEP))
            return [_take(replies, cmds[i]) for i in idx]

        out: list[Any] = [None] * len(cmds)
        if len(work) == 1:
            results = [execute(work[0])]
        else:
            results = list(self._pool().map(execute, work))
        for (_, idx), res in zip(work, results, strict=True):
            for i, r in zip(idx, res, strict=True):
                out[i] = r
        return out

    def _follow_redirects(self, cmds: list[Cmd], out: list[Any], pending: list[int],
                          finish: Finish | None, bell: bool) -> None:
        if not self._cluster:
            raise out[pending[0]]
        log.info("%s: %d command(s) redirected by the cluster (%s); following",
                 self._where, len(pending), type(out[pending[0]]).__name__)
        route: dict[int, tuple[Any, bool]] = {}  # index -> (client, send ASKING first)
        left = list(pending)
        retry = Retry(ExponentialBackoff(cap=0.5, base=0.01), self._opts["redirect_retries"],
                      supported_errors=(_StillRedirectedError,))

        def attempt() -> None:
            nonlocal left
            errs = [out[i] for i in left]
            if any(isinstance(e, (rex.MovedError, rex.ClusterDownError)) for e in errs):
                self.client.nodes_manager.initialize()  # NOTE: a new owner: re-read the map
                self._node_of = None
                route.clear()
            nodes = self.nodes()
            groups: dict[int, tuple[Any, list[int]]] = {}
            for i in left:
                e = out[i]
                if isinstance(e, rex.AskError) and not isinstance(e, rex.MovedError):
                    route[i] = (self._node_client(e.host, e.port), True)
                elif not isinstance(e, rex.TryAgainError) or i not in route:
                    route[i] = (nodes[cmds[i].part], False)
                client = route[i][0]
                groups.setdefault(id(client), (client, []))[1].append(i)
            for client, idx in groups.values():
                payload: list[bytes | memoryview] = []
                for i in idx:
                    payload += [_ASKING, *cmds[i].payload] if route[i][1] else cmds[i].payload
                # NOTE: ASKING holds for a whole MULTI block (Redis keeps the flag in MULTI)
                n = sum(cmds[i].replies + route[i][1] for i in idx)
                if bell and self._bell is not None:
                    payload.append(self._bell)
                    n += 1
                replies = iter(run_pipeline(client, payload, n, keep=_KEEP))
                for i in idx:
                    if route[i][1]:
                        next(replies)  # ASKING's +OK
                    reply = _take(replies, cmds[i])
                    out[i] = reply if isinstance(reply, REDIRECTS) or finish is None \
                        else finish(i, reply)
            left = [i for i in left if isinstance(out[i], REDIRECTS)]
            if left:
                raise _StillRedirectedError

        try:
            retry.call_with_retry(attempt, lambda _e: None)
        except _StillRedirectedError:
            raise out[left[0]] from None

    def _node_client(self, host: str, port: int | str) -> Any:
        nm = self.client.nodes_manager
        node = nm.get_node(host=host, port=int(port))
        if node is None:
            nm.initialize()
            self._node_of = None
            node = nm.get_node(host=host, port=int(port))
        return self.client.get_redis_connection(node)

    def forget(self, client: Any) -> None:
        """After fork: the parent's sockets and pool threads are not ours; drop them unclosed."""
        self._executor = None
        self._node_of = None
        self.client = client

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
