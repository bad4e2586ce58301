"""The package map holds: a lower tier never imports a higher one (docs/architecture.md).

nvecache.common < psclient < hostcache < gpu < nvecache.apps: a module may import its own
tier and the tiers below it, never one above, lazily inside a function included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the tiers, lowest first (dotted package names)
TIERS = ["nvecache.common", "psclient", "hostcache", "gpu", "nvecache.apps"]


def tier_of(dotted: str, tiers: list[str]) -> int:
    """Rank of the tier a dotted module name belongs to (-1: none of them)."""
    best, rank = "", -1
    for i, tier in enumerate(tiers):
        if (dotted == tier or dotted.startswith(tier + ".")) and len(tier) > len(best):
            best, rank = tier, i
    return rank


def upward_imports(root: Path, tiers: list[str]) -> list[str]:
    """``"module: imports package"`` for every import, anywhere in a module, of a package
    above the module's own tier."""
    found = []
    for tier in tiers:
        for path in sorted((root / tier.replace(".", "/")).rglob("*.py")):
            own = tier_of(".".join(path.relative_to(root).with_suffix("").parts), tiers)
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    targets = [node.module]
                else:
                    continue  # relative imports stay inside their package
                for target in targets:
                    if tier_of(target, tiers) > own and own == tiers.index(tier):
                        found.append(f"{path.relative_to(root)}: imports {target}")
    return found


def test_no_tier_imports_a_higher_one() -> None:
    assert upward_imports(ROOT, TIERS) == []


def test_the_check_sees_an_upward_import_even_inside_a_function(tmp_path: Path) -> None:
    for tier in TIERS:
        (tmp_path / tier.replace(".", "/")).mkdir(parents=True, exist_ok=True)
        (tmp_path / tier.replace(".", "/") / "__init__.py").write_text("")
    (tmp_path / "psclient" / "ok.py").write_text("import numpy\nfrom . import x\n")
    (tmp_path / "hostcache" / "bad.py").write_text(
        "import psclient\n\ndef f():\n    from gpu.layers import NVEmbedding\n")
    (tmp_path / "gpu" / "bad.py").write_text("import nvecache.apps.demo\n")
    (tmp_path / "nvecache" / "common" / "bad.py").write_text("from psclient.keys import x\n")
    assert upward_imports(tmp_path, TIERS) == [
        "nvecache/common/bad.py: imports psclient.keys",
        "hostcache/bad.py: imports gpu.layers",
        "gpu/bad.py: imports nvecache.apps.demo",
    ]
