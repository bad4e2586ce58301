"""Triton's once-per-process start-up work, done before a replica's first lookup.

The first launch of a compiled kernel in a process does work that the kernel's own
variant does not need, none of it cached across processes by Triton: on a node whose
caches are warm it is most of a replica's first lookup (bench/RESULTS.md, "Cold start").

* Before Triton looks a compiled kernel up in its on-disk cache, it computes
  ``triton.runtime.cache.triton_key()``: a SHA-256 over its own compiler sources and the
  whole ``libtriton`` shared library, hundreds of megabytes. :func:`install` swaps in a
  function that returns the key remembered in Triton's cache directory under a
  fingerprint of Triton's files (each one's path, size, modification time and inode, plus
  the version): a few milliseconds of ``stat`` calls. Any change to those files changes
  the fingerprint, and Triton's own function computes the key again. Where Triton has no
  such function (another version's layout), nothing is swapped.
* Its first argument specialization imports Triton's tensor-descriptor modules, and its
  first cache lookup asks ``ptxas`` for its version (a subprocess). :func:`prime` does both
  when a layer loads its compiled kernels, with the key, so they are part of building the
  layer instead of its first lookup.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

#: the parts of the Triton package its key covers (and a little more: stricter is safe)
_PARTS = ("_C", "backends", "compiler", "language", "runtime")


def fingerprint(root: Path, version: str) -> str:
    """A digest of every file under ``root``'s key-bearing folders: relative path, size,
    modification time (ns) and inode, with ``version``. Changes whenever any of those
    files is replaced, edited, added or removed."""
    h = hashlib.sha256(version.encode())
    for part in _PARTS:
        base = root / part
        for dirpath, dirnames, filenames in os.walk(base):
            # NOTE: bytecode is written as modules are first imported; its sources count
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except OSError:  # NOTE: vanished meanwhile: it still marks the tree as changed
                    h.update(f"{path}\0gone\n".encode())
                    continue
                rel = os.path.relpath(path, root)
                h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
    return h.hexdigest()


def remembered(directory: Path, print_: str, compute: Callable[[], str]) -> str:
    """The key remembered in ``directory`` under the fingerprint ``print_``, or
    ``compute()``'s value, then remembered there (owner-only file, written whole by a
    rename so a reader never sees part of one). A directory that cannot be written leaves
    the computed key unremembered."""
    path = directory / f"triton-key-{print_[:40]}.txt"
    try:
        key = path.read_text()
        if key:
            return key
    except OSError:
        pass
    key = compute()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".triton-key-")  # NOTE: mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(key)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        logger.debug("triton's cache key not remembered in %s: %s", directory, e)
    return key


def install() -> bool:
    """Route ``triton.runtime.cache.triton_key`` (and the autotuner's reference to it)
    through :func:`remembered`, in Triton's cache directory. Returns whether it was
    installed (False: this Triton has no such function, or it was installed already)."""
    import triton  # NOTE: lazy: called once triton imported (triton_access)
    from triton.runtime import cache

    original = getattr(cache, "triton_key", None)
    if not callable(original) or getattr(original, "_nvecache_remembered", False):
        return False
    knobs = getattr(triton, "knobs", None)
    if getattr(getattr(knobs, "cache", None), "dir", None) is None:
        return False  # NOTE: a layout without the cache knob: Triton hashes as before
    root = Path(triton.__file__).parent
    version = str(getattr(triton, "__version__", "?"))

    @functools.cache
    def triton_key() -> str:
        # NOTE: the directory read at first use, as Triton reads TRITON_CACHE_DIR
        directory = Path(knobs.cache.dir) / "nvecache"
        return remembered(directory, fingerprint(root, version), original)

    triton_key._nvecache_remembered = True  # type: ignore[attr-defined]
    cache.triton_key = triton_key
    try:
        from triton.runtime import autotuner
    except Exception:  # pragma: no cover - the autotuner ships with every Triton
        return True
    if getattr(autotuner, "triton_key", None) is original:
        autotuner.triton_key = triton_key
    return True


def prime() -> None:
    """Do Triton's per-process first-launch work now (see the module's docstring): the
    cache key, the specializer's imports, the backend's compiler version. Each step is
    skipped where this Triton lacks it or no GPU answers; a skipped step is done by
    Triton at the first launch instead, as before."""
    import torch

    try:
        from triton.runtime import cache

        cache.triton_key()
    except Exception as e:  # NOTE: only start-up time is at stake, never a result
        logger.debug("triton's cache key not primed: %s", e)
    try:
        from triton.runtime.jit import mangle_type

        mangle_type(torch.empty(1))  # NOTE: its first call imports the descriptor modules
    except Exception as e:
        logger.debug("triton's specializer not primed: %s", e)
    try:
        from triton.compiler.compiler import make_backend
        from triton.runtime.driver import driver

        make_backend(driver.active.get_current_target()).hash()  # NOTE: ptxas --version
    except Exception as e:
        logger.debug("triton's backend not primed: %s", e)
