"""Layering: no import cycles among rr's modules, and the light entry points stay light.

(a) every module of rr_client / rr_server / rr_patches is parsed with ``ast`` (imports inside functions
included), and the graph must be acyclic, even through ``if TYPE_CHECKING:`` imports.
(b), (c) run in fresh interpreters: what an import loads is checked in ``sys.modules``, never timed.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.deadlines import STARTUP_TIMEOUT_S

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("rr_client", "rr_server", "rr_patches")


def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of rr's three packages."""
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST, type_checking: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run (module level, in functions and classes), minus TYPE_CHECKING blocks
    unless ``type_checking`` (a circle through type hints is still two modules that need each other)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if not type_checking and isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Edges between rr modules: ``import a.b`` -> a.b; ``from a import b`` -> a.b if that is a module, else a
    (``type_checking``: the imports of ``if TYPE_CHECKING:`` blocks too)."""
    mods = module_files()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _runtime_imports(ast.parse(path.read_text(), str(path)), type_checking):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative import: resolve against this module's package
                    anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in mods else base)
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first search meets (each reported once, as the path that closes it)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list[str] = []
    cycles: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def dfs(node: str) -> None:
        color[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if color[nxt] == GREY:
                cycle = stack[stack.index(nxt) :] + [nxt]
                if frozenset(cycle) not in seen:
                    seen.add(frozenset(cycle))
                    cycles.append(cycle)
            elif color[nxt] == WHITE:
                dfs(nxt)
        stack.pop()
        color[node] = BLACK

    for node in sorted(graph):
        if color[node] == WHITE:
            dfs(node)
    return cycles


def test_graph_sees_imports_inside_functions() -> None:
    """The parser is not blind: known lazy imports (inside functions) are edges."""
    graph = import_graph()
    assert "rr_server.launch.vllm" in graph["rr_server.cli"]  # imported inside cli.main
    assert "rr_server.proxy.app" in graph["rr_server.proxy"]  # imported inside proxy.main
    assert "rr_patches.vllm.routes" in graph["rr_patches.vllm.plugin"]  # imported inside the build_app wrapper
    assert "rr_client.core._rowcheck" in graph["rr_client.core.codec"]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycles() -> None:
    """No circle, counting the imports made only for type hints (a Protocol names what a module needs instead)."""
    cycles = find_cycles(import_graph(type_checking=True))
    for cycle in cycles:
        print("import cycle: " + " -> ".join(cycle))
    assert not cycles, f"{len(cycles)} import cycle(s), first: {' -> '.join(cycles[0])}"


def _loaded_after(code: str) -> dict[str, bool]:
    """Run ``code`` in a fresh interpreter; report which heavy modules ended up in sys.modules."""
    probe = code + "\nimport json, sys\nprint(json.dumps({m: m in sys.modules for m in ('torch', 'httpx', 'fastapi')}))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=STARTUP_TIMEOUT_S
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_client_core_imports_neither_torch_nor_httpx() -> None:
    core = (
        "import rr_client.core.codec, rr_client.core.errors, rr_client.core.info, rr_client.core.hf_config, rr_client.core._rowcheck, "
        "rr_client.core.versions, rr_client.core.patching, rr_client.core.optional, rr_client.core.settings, rr_client.trainer.keys, "
        "rr_client.core.reference, rr_client.core.logprobs, rr_client.core.provenance, "
        "rr_client"
    )
    loaded = _loaded_after(core)
    assert not loaded["torch"] and not loaded["httpx"], loaded
    loaded = _loaded_after(core + "\nfrom rr_client import RoutedExpertsClient")
    assert loaded["httpx"] and not loaded["torch"], loaded
    loaded = _loaded_after(core + "\nfrom rr_client import to_tensors")
    assert loaded["torch"], loaded


def test_proxy_help_is_light() -> None:
    code = (
        "import contextlib, io\nfrom rr_server.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n        main(['proxy', '--help'])\n    except SystemExit as e:\n        assert e.code == 0, e.code\n"
        "assert '--upstream' in out.getvalue()"
    )
    loaded = _loaded_after(code)
    assert loaded == {"torch": False, "httpx": False, "fastapi": False}, loaded


# ----------------------------------------------------------------------------- direction: every arrow points down
# engine -> one full check -> wire -> client -> layout -> replay; the folders, bottom to top:
#   rr_client: core/ < client/ < trainer/ < integrations/, and the package root (the facade) above its layers;
#   rr_server/serving/ (on the core) < adapters (rr_patches, the sidecar rr_server/proxy/) < commands (the rest)
# A module's layer is the folder it sits in: no name list to keep up to date.
ALLOWED = {
    "core": {"core"},
    "client": {"core", "client"},
    "trainer": {"core", "client", "trainer"},
    "integrations": {"core", "client", "trainer", "integrations"},
    "facade": {"core", "client", "trainer"},  # for users; of rr's own code only the commands (its users) import it
    "serving": {"core", "serving"},
    "patches": {"core", "client", "serving", "patches"},
    "sidecar": {"core", "client", "serving", "sidecar"},
    "commands": {"core", "client", "trainer", "facade", "serving", "sidecar", "commands"},  # never rr_patches
}
# the one arrow up, named: ``GenerateBatch.to_tensors()`` / ``.to_packed()`` import the trainer's layouts inside
# the method (a convenience of the client's result type; the client never imports torch otherwise)
LAZY_UP = {("rr_client.client._results", "rr_client.trainer.layouts")}
FOLDERS = {
    "rr_client": {"core": "core", "client": "client", "trainer": "trainer", "integrations": "integrations"},
    "rr_server": {"serving": "serving", "proxy": "sidecar"},
}


def layer_of(module: str) -> str:
    """The layer a module of rr belongs to: the folder it sits in (``rr_server`` itself is an empty namespace,
    checked apart)."""
    top, _, rest = module.partition(".")
    folder = rest.split(".")[0]
    if top == "rr_patches":
        return "patches"
    if top == "rr_client":
        if not rest:
            return "facade"
        if folder not in FOLDERS["rr_client"]:
            raise AssertionError(
                f"{module}: every rr_client module sits in a layer's folder "
                f"({', '.join(FOLDERS['rr_client'])}), never at the root"
            )
        return FOLDERS["rr_client"][folder]
    return FOLDERS["rr_server"].get(folder, "commands")


def direction_violations(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` edges where b's layer is not below or beside a's, plus package-level arrows back up."""
    bad = [
        f"{a} ({layer_of(a)}) -> {b} ({layer_of(b)})"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if b != "rr_server" and (a, b) not in LAZY_UP and layer_of(b) not in ALLOWED[layer_of(a)]
    ]
    # package level: every top-level package's imports, as sets; rr_client imports neither other, rr_server never
    # imports rr_patches (rr_patches -> rr_server.serving is the only arrow between them)
    tops: dict[str, set[str]] = {}
    for a, targets in graph.items():
        tops.setdefault(a.split(".")[0], set()).update(b.split(".")[0] for b in targets)
    if tops.get("rr_client", set()) - {"rr_client"}:
        bad.append(f"package rr_client imports {sorted(tops['rr_client'] - {'rr_client'})}")
    if "rr_patches" in tops.get("rr_server", set()):
        bad.append("package rr_server imports rr_patches")
    return bad


def private_imports(graph: dict[str, set[str]]) -> list[str]:
    """Edges into a ``_private`` module from outside the package that holds it."""
    bad = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            parts = b.split(".")
            private = [i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")]
            if not private:
                continue
            owner = ".".join(parts[: private[0]])
            if a != owner and not a.startswith(owner + "."):
                bad.append(f"{a} -> {b}")
    return bad


def test_every_arrow_points_down() -> None:
    """Inside rr_client: core < client < trainer < integrations; rr_client imports nothing of rr_server/rr_patches;
    serving only rr_client's core; rr_patches only rr_client and serving; commands never rr_patches."""
    bad = direction_violations(import_graph())
    assert not bad, "imports running back up:\n" + "\n".join(bad)


def test_rr_server_namespace_is_empty() -> None:
    """``rr_server/__init__`` imports nothing, so ``import rr_server.serving`` loads no launcher, sidecar or patch."""
    assert import_graph()["rr_server"] == set()


def test_no_package_imports_anothers_private_module() -> None:
    bad = private_imports(import_graph())
    assert not bad, "private modules imported from outside their package:\n" + "\n".join(bad)


def test_the_direction_checks_can_fail() -> None:
    """The checks see what they must: an arrow up at module and package level, and a foreign private module."""
    graph = {
        "rr_client.core.codec": {"rr_server.serving.auth"},
        "rr_server.serving.auth": {"rr_server.proxy.app"},
        "rr_client.client.trajectory": {"rr_client.trainer.session"},
        "rr_client.trainer.session": {"rr_client.integrations.weight_sync"},
        "rr_client.core.info": {"rr_client.client._client"},
        "rr_patches.vllm.plugin": {"rr_server.launch.vllm"},
        "rr_server.launch.sglang": {"rr_patches.sglang.apply"},
        "rr_server.proxy.upstream": {"rr_client.client._results"},
        "rr_client.core.versions": {"rr_client.core._rowcheck"},
        "rr_client.integrations.weight_sync": {"rr_client"},
    }
    bad = direction_violations(graph)
    assert "rr_client.integrations.weight_sync (integrations) -> rr_client (facade)" in bad
    assert "rr_client.core.codec (core) -> rr_server.serving.auth (serving)" in bad
    assert "rr_client.client.trajectory (client) -> rr_client.trainer.session (trainer)" in bad
    assert "rr_client.trainer.session (trainer) -> rr_client.integrations.weight_sync (integrations)" in bad
    assert "rr_client.core.info (core) -> rr_client.client._client (client)" in bad
    assert "rr_server.serving.auth (serving) -> rr_server.proxy.app (sidecar)" in bad
    assert "rr_patches.vllm.plugin (patches) -> rr_server.launch.vllm (commands)" in bad
    assert "rr_server.launch.sglang (commands) -> rr_patches.sglang.apply (patches)" in bad
    assert "package rr_server imports rr_patches" in bad and "package rr_client imports ['rr_server']" in bad
    assert private_imports(graph) == [
        "rr_client.core.info -> rr_client.client._client",
        "rr_server.proxy.upstream -> rr_client.client._results",
    ]


def test_a_module_outside_the_layer_folders_is_refused() -> None:
    """The layer is the folder: a module dropped at rr_client's root has none, and the check says so."""
    assert layer_of("rr_client.core.codec") == "core" and layer_of("rr_server.serving.store.ledger") == "serving"
    assert layer_of("rr_server.launch.vllm") == "commands" and layer_of("rr_client") == "facade"
    with pytest.raises(AssertionError, match="sits in a layer's folder"):
        layer_of("rr_client.codec")


def test_the_layers_are_folders() -> None:
    """rr_client's root holds only the facade; every module lives in core/, client/, trainer/ or integrations/."""
    root = sorted(p.name for p in (REPO / "rr_client").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists())
    assert root == ["__init__.py", "client", "core", "integrations", "trainer"], root
