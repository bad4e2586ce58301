"""The package map holds: a lower tier never imports a higher one (docs/architecture.md).

psclient < hostcache < gpu < apps: a module may import its own package and the packages
below it, never one above, lazily inside a function included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the tiers, lowest first
TIERS = ["psclient", "hostcache", "gpu", "apps"]


def upward_imports(root: Path, tiers: list[str]) -> list[str]:
    """``"module: imports package"`` for every import, anywhere in a module, of a package
    above the module's own tier."""
    rank = {name: i for i, name in enumerate(tiers)}
    found = []
    for tier in tiers:
        for path in sorted((root / tier).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    targets = [node.module]
                else:
                    continue  # relative imports stay inside their package
                for target in targets:
                    top = target.split(".")[0]
                    if rank.get(top, -1) > rank[tier]:
                        found.append(f"{path.relative_to(root)}: imports {target}")
    return found


def test_no_tier_imports_a_higher_one() -> None:
    assert upward_imports(ROOT, TIERS) == []


def test_the_check_sees_an_upward_import_even_inside_a_function(tmp_path: Path) -> None:
    for tier in TIERS:
        (tmp_path / tier).mkdir()
        (tmp_path / tier / "__init__.py").write_text("")
    (tmp_path / "psclient" / "ok.py").write_text("import numpy\nfrom . import x\n")
    (tmp_path / "hostcache" / "bad.py").write_text(
        "import psclient\n\ndef f():\n    from gpu.layers import NVEmbedding\n")
    (tmp_path / "gpu" / "bad.py").write_text("import apps.demo\n")
    assert upward_imports(tmp_path, TIERS) == [
        "hostcache/bad.py: imports gpu.layers",
        "gpu/bad.py: imports apps.demo",
    ]
