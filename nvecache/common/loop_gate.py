"""Compiled loops made ready off the caller's path, and their numpy twins serving meanwhile.

The per-key loops (:mod:`psclient.file.mirror_loops`, ``hostcache.table_loops``,
``gpu.stacks.misses.miss_loops``) are compiled by numba and cached on disk (beside their source, or
under
``NUMBA_CACHE_DIR``). With that cache cold, as on a fresh install, compiling them takes
many times what a layer's construction and first lookup should; even with it warm, a
process imports numba and starts its compiler before the first loop runs, which alone
takes longer (bench/RESULTS.md, "Cold start"). No call waits for either:

* every loop module has a twin: the same functions written as vectorized numpy, with
  identical results (the ``*_twin`` modules; tests hold each twin to its compiled loop);
* a :class:`LoopGate` per loop module hands out the compiled module once it is ready and
  the twin until then (:meth:`LoopGate.pick`, one attribute read per call). Its first pick
  asks for the compiled loops: a background thread runs a child process (this file as a
  script) that imports the loop module, compiles every signature its callers use (the
  module's ``warm_up``) into numba's cache and exits; the thread then loads the loops from
  that cache into this process and publishes the module. The child runs at a lower
  priority and imports the loop modules without their packages (bare stand-ins for the
  packages), so it loads numpy and numba, not torch;
* a process that ends before its child stops the child (what it compiled stays cached).

A path with no twin (the row mirror's writes) imports the compiled loops itself: they
compile on their first call, or load from numba's cache. A forked child starts over on its
first pick.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import threading
import types
from typing import Any

log = logging.getLogger(__name__)


class LoopGate:
    """The compiled loops of one module once they are ready, its numpy twin until then.

    Args:
        module: The loop module's absolute name, e.g. ``"hostcache.table_loops"``: numba
            functions (``cache=True``) and a ``warm_up()`` that compiles, or loads from
            numba's cache, every signature its callers use.
        twin: A module with the same functions in numpy, giving identical results.
    """

    def __init__(self, module: str, twin: types.ModuleType) -> None:
        self.module = module
        self.twin = twin
        self._compiled: types.ModuleType | None = None
        self._asked = False
        self._done = threading.Event()
        #: picks the twin answered (approximate: threads count without a lock)
        self.twin_picks = 0
        _GATES.append(self)

    @property
    def ready(self) -> bool:
        """Whether :meth:`pick` hands out the compiled loops now."""
        return self._compiled is not None

    def pick(self) -> Any:
        """The module whose functions serve this call: the compiled loops if they are
        ready, else the twin (and the compiled loops are asked for, once)."""
        m = self._compiled
        if m is not None:
            return m
        if not self._asked:
            self.ask()
        self.twin_picks += 1
        return self.twin

    def ask(self) -> None:
        """Start making the compiled loops ready in the background (once per process)."""
        with _STATE.cond:
            if self._asked:
                return
            self._asked = True
            _STATE.queue.append(self)
            if _STATE.worker is None:
                _STATE.worker = threading.Thread(target=_work, name="nvecache-loops",
                                                 daemon=True)
                _STATE.worker.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Ask for the compiled loops and wait up to ``timeout`` seconds for them; whether
        they are ready."""
        self.ask()
        self._done.wait(timeout)
        return self.ready

    def _load(self) -> None:
        """In the worker: the loops into this process (from numba's cache when the child
        filled it), then published."""
        try:
            m = importlib.import_module(self.module)
            m.warm_up()
        except Exception:  # noqa: BLE001 - the twin keeps serving
            log.warning("could not load the compiled loops of %s; their numpy twin keeps "
                        "serving", self.module, exc_info=True)
        else:
            self._compiled = m
        finally:
            self._done.set()

    def __repr__(self) -> str:
        state = "ready" if self.ready else "asked" if self._asked else "not asked"
        return f"LoopGate({self.module!r}, {state})"


class _State:
    """This process's queue of gates, its worker thread and the child the worker runs."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queue: list[LoopGate] = []
        self.worker: threading.Thread | None = None
        self.child: subprocess.Popen[bytes] | None = None
        self.exiting = False


_STATE = _State()
_GATES: list[LoopGate] = []


def gates() -> tuple[LoopGate, ...]:
    """Every gate this process has made (one per loop module whose twin was imported)."""
    return tuple(_GATES)


def _work() -> None:
    """The worker thread: each round compiles the gates asked for so far in one child,
    then loads them here; it ends when none are waiting."""
    while True:
        with _STATE.cond:
            if not _STATE.queue or _STATE.exiting:
                _STATE.worker = None
                for g in _STATE.queue:  # NOTE: exiting: nobody waits for these
                    g._done.set()
                _STATE.queue.clear()
                return
            batch = list(_STATE.queue)
            _STATE.queue.clear()
        _compile_in_child([g.module for g in batch])
        for g in batch:
            if _STATE.exiting:
                g._done.set()
            else:
                g._load()


def _compile_in_child(modules: list[str]) -> None:
    """Run this file as a script to compile ``modules`` into numba's cache, and wait."""
    specs = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            log.warning("no source for %s: its loops compile in this process", name)
            return
        specs.append(f"{name}={spec.origin}")
    if not sys.executable:
        return
    # NOTE: -P: the script's directory (this package) is not put on the child's sys.path
    cmd = [sys.executable, "-P", os.path.abspath(__file__), *specs]
    with _STATE.cond:
        if _STATE.exiting:
            return
        try:
            child = _STATE.child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.DEVNULL,
                                                    stderr=subprocess.PIPE)
        except OSError:
            log.warning("could not start a process to compile %s; they compile in this "
                        "process", ", ".join(modules), exc_info=True)
            return
    try:
        _, err = child.communicate()
    finally:
        with _STATE.cond:
            _STATE.child = None
    if child.returncode != 0 and not _STATE.exiting:
        log.warning("compiling %s in a child process failed (exit status %s); they compile "
                    "in this process: %s", ", ".join(modules), child.returncode,
                    err.decode(errors="replace")[-2000:])


def _stop_child() -> None:
    """At exit: no new child, and the running one stopped (its finished loops stay
    cached)."""
    with _STATE.cond:
        _STATE.exiting = True
        child = _STATE.child
    if child is not None and child.poll() is None:
        child.terminate()
        try:
            child.wait(5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _forget_in_child() -> None:
    """A forked child has neither its parent's worker nor its compiling child."""
    global _STATE
    _STATE = _State()
    for g in _GATES:
        if g._compiled is None:
            g._asked = False
            g._done = threading.Event()


atexit.register(_stop_child)
os.register_at_fork(after_in_child=_forget_in_child)


def _stand_in_packages(name: str, origin: str) -> None:
    """Bare package modules for the packages above ``name`` (its file at ``origin``), so
    that importing it runs none of their ``__init__``."""
    parts = name.split(".")
    path = os.path.dirname(origin)
    for i in range(len(parts) - 1, 0, -1):
        package = ".".join(parts[:i])
        if package not in sys.modules:
            stand_in = types.ModuleType(package)
            stand_in.__path__ = [path]
            sys.modules[package] = stand_in
        path = os.path.dirname(path)


def _child_main(specs: list[str]) -> None:
    """The child: ``name=path`` of each loop module; compile (or load) all its loops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # NOTE: the parent stops it at its exit
    with contextlib.suppress(OSError):
        os.nice(10)
    for spec in specs:
        name, _, origin = spec.partition("=")
        _stand_in_packages(name, origin)
        importlib.import_module(name).warm_up()


if __name__ == "__main__":
    _child_main(sys.argv[1:])
