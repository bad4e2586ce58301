"""Whether this torch's AOTInductor can load a package at all.

Some torch builds crash (a segmentation fault inside ``aoti_load_package``) loading any
package, a plain ``nn.Linear`` one included; such a build cannot run ``gpu.export``'s
``aot=True`` exports, whatever the model holds. The tests of those exports skip there,
with the reason. The probe compiles and loads a one-layer package in a child process, once
per test session (the answer is shared by xdist's workers through a file in pytest's
base temporary directory, which pytest owns and prunes).
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path

import torch

_PROBE = """
import tempfile, torch
model = torch.nn.Linear(4, 2)
program = torch.export.export(model, (torch.randn(3, 4),))
path = tempfile.mkdtemp() + "/probe.pt2"
torch._inductor.aoti_compile_and_package(program, package_path=path)
runner = torch._inductor.aoti_load_package(path)
x = torch.randn(3, 4)
assert torch.allclose(runner(x), model(x), atol=1e-5)
"""

#: the reason the tests give where the probe fails
REASON = (f"this torch ({torch.__version__}) cannot load an AOTInductor package: a plain "
          "nn.Linear package crashes aoti_load_package in a child process")


def _ask() -> bool:
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=600, check=False)
    return done.returncode == 0


def aoti_loads(root: Path) -> bool:
    """True when a plain package compiles and loads here; the answer is kept in ``root``
    (the session's temporary directory, shared by its workers)."""
    answer = root / "aoti-probe"
    with open(str(answer) + ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not answer.exists():
                answer.write_text("yes" if _ask() else "no")
            return answer.read_text() == "yes"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
