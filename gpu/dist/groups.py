"""Process groups and the file-descriptor exchange of :class:`gpu.dist.distmem.DistMemBlock`.

A *group* is the set of processes that build one memblock together (one per GPU,
launched by torchrun or mpirun). :func:`as_group` adapts what the user passes:

* ``None``: this process alone;
* ``"torch"`` or a ``torch.distributed`` process group: the default group is initialised
  from torchrun's environment (``env://``, gloo) when it is not yet;
* an mpi4py communicator (anything with ``Get_rank``/``Get_size``/``allgather``/
  ``bcast``/``Barrier``), e.g. ``MPI.COMM_WORLD``.

:func:`exchange_fds` hands every process the file descriptors of every other process's
shards over a Unix socket (``SCM_RIGHTS`` through :func:`socket.send_fds`), so no
process needs ptrace rights over another (``pidfd_getfd`` would). Rank 0 listens in a
fresh 0700 directory; the others connect, prove they belong (a random token sent through
the group, and the peer's uid), send their descriptors, and receive everyone's.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import struct
import tempfile
from typing import Any, Protocol

import torch.distributed as dist

from gpu.errors import BadArgumentError, GroupError

__all__ = ["Group", "GroupError", "MPIGroup", "SoloGroup", "TorchGroup", "as_group",
           "exchange_fds"]


class Group(Protocol):
    rank: int
    size: int

    def allgather(self, obj: Any) -> list[Any]: ...
    def bcast(self, obj: Any) -> Any: ...
    def barrier(self) -> None: ...
    def alive(self) -> bool: ...


class SoloGroup:
    """This process alone."""

    rank, size = 0, 1

    def allgather(self, obj: Any) -> list[Any]:
        return [obj]

    def bcast(self, obj: Any) -> Any:
        return obj

    def barrier(self) -> None:
        return None

    def alive(self) -> bool:
        return True


class MPIGroup:
    """An mpi4py communicator."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank = int(comm.Get_rank())
        self.size = int(comm.Get_size())

    def allgather(self, obj: Any) -> list[Any]:
        return list(self.comm.allgather(obj))

    def bcast(self, obj: Any) -> Any:
        return self.comm.bcast(obj, root=0)

    def barrier(self) -> None:
        self.comm.Barrier()

    def alive(self) -> bool:
        try:  # NOTE: lazy: mpi4py is optional (and initialises MPI when imported)
            from mpi4py import MPI
        except ImportError:
            return True  # a stand-in communicator: nothing to tear down
        return not MPI.Is_finalized()


class TorchGroup:
    """A ``torch.distributed`` process group (the default one for ``"torch"``)."""

    def __init__(self, pg: Any = None) -> None:
        if not dist.is_available():
            raise BadArgumentError("this torch build has no torch.distributed; pass group="
                                   "an mpi4py communicator or None")
        if not dist.is_initialized():
            if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
                raise BadArgumentError(
                    "group='torch' needs torch.distributed initialised, or the environment "
                    "torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): launch with "
                    "torchrun, or call torch.distributed.init_process_group() first")
            dist.init_process_group(backend="gloo")
        self.pg = pg
        self.rank = int(dist.get_rank(pg))
        self.size = int(dist.get_world_size(pg))

    def allgather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def bcast(self, obj: Any) -> Any:
        box = [obj]
        src = dist.get_global_rank(self.pg, 0) if self.pg is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.pg)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.pg)

    def alive(self) -> bool:
        return bool(dist.is_initialized())


def as_group(group: Any) -> Group:
    """Adapt ``group`` (see the module docstring)."""
    if group is None:
        return SoloGroup()
    if isinstance(group, (SoloGroup, MPIGroup, TorchGroup)):
        return group
    if isinstance(group, str):
        if group != "torch":
            raise BadArgumentError(f"group must be None, 'torch', a torch.distributed "
                                   f"process group or an mpi4py communicator; got {group!r}")
        return TorchGroup(None)
    if all(hasattr(group, a) for a in ("Get_rank", "Get_size", "allgather", "bcast", "Barrier")):
        return MPIGroup(group)
    if dist.is_available() and isinstance(group, dist.ProcessGroup):
        return TorchGroup(group)
    raise BadArgumentError(f"group must be None, 'torch', a torch.distributed process group "
                           f"or an mpi4py communicator; got {type(group).__name__}")


# -- the exchange -------------------------------------------------------------------------

_MAX_MSG = 1 << 16
_MAX_FDS = 250  # SCM_RIGHTS carries at most 253 descriptors per message


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _send(conn: socket.socket, obj: Any, fds: list[int]) -> None:
    if len(fds) > _MAX_FDS:
        raise GroupError(f"cannot pass {len(fds)} descriptors in one message (max {_MAX_FDS})")
    socket.send_fds(conn, [json.dumps(obj).encode()], fds)


def _recv(conn: socket.socket) -> tuple[Any, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(conn, _MAX_MSG, _MAX_FDS)
    if not data:
        for fd in fds:
            os.close(fd)
        raise GroupError("a peer closed the exchange socket before sending its shards")
    return json.loads(data.decode()), list(fds)


def exchange_fds(group: Group, meta: Any, fds: list[int], *, timeout: float = 60.0
                 ) -> list[tuple[Any, list[int]]]:
    """Every rank's ``(meta, fds)``, by rank; this rank's entry is its own (not duplicated).

    The descriptors received are new ones owned by the caller (close them when done).
    Collective: every rank of ``group`` must call it.

    Raises:
        GroupError: a peer did not connect within ``timeout`` seconds, failed the token or
            uid check, or hung up.
    """
    if group.size == 1:
        return [(meta, fds)]
    path: str | None = None
    token = secrets.token_hex(16)
    if group.rank == 0:
        tmp = tempfile.mkdtemp(prefix="nvec-fds-")  # 0700: only this user can connect
        path = os.path.join(tmp, "s")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server.bind(path)
        server.listen(group.size)
        server.settimeout(timeout)
    path, token = group.bcast((path, token))
    assert path is not None
    if group.rank == 0:
        try:
            return _serve(group, server, token, meta, fds)
        finally:
            server.close()
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return _join(group, path, token, meta, fds, timeout)


def _serve(group: Group, server: socket.socket, token: str, meta: Any, fds: list[int]
           ) -> list[tuple[Any, list[int]]]:
    got: dict[int, tuple[Any, list[int]]] = {0: (meta, fds)}
    conns: dict[int, socket.socket] = {}
    try:
        while len(got) < group.size:
            try:
                conn, _ = server.accept()
            except TimeoutError as e:
                missing = sorted(set(range(group.size)) - set(got))
                raise GroupError(f"ranks {missing} did not connect within the timeout; did "
                                 "every rank of the group create the memblock?") from e
            conn.settimeout(server.gettimeout())
            if _peer_uid(conn) != os.getuid():
                conn.close()
                continue
            msg, their = _recv(conn)
            if not isinstance(msg, dict) or msg.get("token") != token:
                for fd in their:
                    os.close(fd)
                conn.close()
                continue
            rank = int(msg["rank"])
            got[rank] = (msg["meta"], their)
            conns[rank] = conn
        counts = [len(got[r][1]) for r in range(group.size)]
        everyone = {"metas": [got[r][0] for r in range(group.size)], "counts": counts}
        flat = [fd for r in range(group.size) for fd in got[r][1]]
        for conn in conns.values():
            _send(conn, everyone, flat)
        return [got[r] for r in range(group.size)]
    except BaseException:
        for r, (_, their) in got.items():
            if r != 0:
                for fd in their:
                    os.close(fd)
        raise
    finally:
        for conn in conns.values():
            conn.close()


def _join(group: Group, path: str, token: str, meta: Any, fds: list[int], timeout: float
          ) -> list[tuple[Any, list[int]]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.settimeout(timeout)
        try:
            conn.connect(path)
        except OSError as e:
            raise GroupError(f"rank {group.rank} cannot reach rank 0's exchange socket "
                             f"{path}: {e}; are all ranks on one node?") from e
        if _peer_uid(conn) != os.getuid():
            raise GroupError("the exchange socket belongs to another user")
        _send(conn, {"token": token, "rank": group.rank, "meta": meta}, fds)
        everyone, flat = _recv(conn)
    out: list[tuple[Any, list[int]]] = []
    i = 0
    for r, (m, n) in enumerate(zip(everyone["metas"], everyone["counts"], strict=True)):
        theirs = flat[i:i + n]
        i += n
        if r == group.rank:
            for fd in theirs:
                os.close(fd)  # our own, back from rank 0
            out.append((meta, fds))
        else:
            out.append((m, theirs))
    return out
