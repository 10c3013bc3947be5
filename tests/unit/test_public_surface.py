"""rr_client's public surface: the lazy table, the static TYPE_CHECKING imports and ``__all__`` agree (the
huggingface_hub rule), and every public name resolves."""

from __future__ import annotations

import ast
from pathlib import Path

import rr_client

INIT = Path(rr_client.__file__)


def _surface() -> tuple[dict[str, str], dict[str, str], set[str], set[str]]:
    """(_LAZY, TYPE_CHECKING imports name -> module, eager imports, __all__) read from the source."""
    tree = ast.parse(INIT.read_text())
    lazy: dict[str, str] = {}
    typed: dict[str, str] = {}
    eager: set[str] = set()
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "_LAZY":
                lazy = ast.literal_eval(node.value)
            elif node.targets[0].id == "__all__":
                names = set(ast.literal_eval(node.value))
        elif isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                typed.update({a.name: str(imp.module) for a in imp.names})
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rr_client"):
            eager.update(a.asname or a.name for a in node.names)
    return lazy, typed, eager, names


def test_lazy_table_and_type_checking_imports_agree() -> None:
    lazy, typed, _, _ = _surface()
    assert lazy == typed


def test_all_is_exactly_what_the_module_offers() -> None:
    lazy, _, eager, names = _surface()
    assert names == (set(lazy) | eager) - {"annotations"}
    for name in sorted(names):
        assert getattr(rr_client, name) is not None, name


def test_replica_stats_is_public() -> None:
    """``RoutedExpertsClient.replica_stats()`` returns it, so users can name it."""
    from rr_client._replicas import ReplicaStats

    assert rr_client.ReplicaStats is ReplicaStats
