"""The docs match the code: every CLI flag of the sidecar and the doctor is documented, the error tree in
docs/client.md is the code's hierarchy, the client doc names every public name, and the README stays short."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

import rr_client
from rr_client.core import errors

REPO = Path(__file__).resolve().parents[2]


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every long option a parser accepts (help excluded)."""
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


@pytest.mark.parametrize(
    ("module", "doc"), [("rr_server.proxy", "docs/sidecar.md"), ("rr_server.doctor", "docs/doctor.md")]
)
def test_every_cli_flag_is_documented(module: str, doc: str) -> None:
    import importlib

    flags = _flags(importlib.import_module(module).build_parser())
    assert len(flags) >= 5  # the parser is really read
    text = (REPO / doc).read_text()
    missing = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", text))
    assert missing == [], f"{doc} does not document {missing}"


def parse_tree(text: str) -> dict[str, str | None]:
    """``{class name: parent name}`` from an indented box-drawing tree (the first code block holding ``RRError``)."""
    m = re.search(r"^```\n(RRError\n.*?)^```", text, re.S | re.M)
    assert m is not None, "no error tree"
    block = m.group(1)
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in block.splitlines():
        m = re.match(r"^([│ ]*(?:[├└]── )?)(\w+)", line)
        if not m or not m.group(2)[0].isupper():
            continue
        depth = len(m.group(1)) // 4
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parents[m.group(2)] = stack[-1][1] if stack else None
        stack.append((depth, m.group(2)))
    return parents


def code_tree() -> dict[str, str | None]:
    """``{class name: rr parent}`` for every error class rr_client.core.errors defines."""
    mine = {name: getattr(errors, name) for name in errors.__all__}
    return {
        name: next((b.__name__ for b in cls.__bases__ if issubclass(b, errors.RRError)), None)
        for name, cls in mine.items()
    }


def test_error_tree_in_the_docs_is_the_codes() -> None:
    assert parse_tree((REPO / "docs/client.md").read_text()) == code_tree()


def test_tree_parser_sees_nesting() -> None:
    tree = parse_tree("```\nRRError\n├── A\n│   └── B\n└── C\n    └── D\n```\n")
    assert tree == {"RRError": None, "A": "RRError", "B": "A", "C": "RRError", "D": "C"}


def test_client_doc_names_every_public_name() -> None:
    text = (REPO / "docs/client.md").read_text()
    missing = [n for n in rr_client.__all__ if f"`{n}`" not in text and n not in code_tree()]
    assert missing == []


def test_readme_reads_in_two_minutes() -> None:
    """At most about 110 lines (issue 59): what rr is, the two set-up commands, three ways in, links."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 110


def test_every_rr_setting_is_in_the_engines_doc() -> None:
    from rr_client.core.settings import SETTINGS

    text = (REPO / "docs/engines.md").read_text()
    assert [n for n in SETTINGS if f"`{n}`" not in text] == []


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-``/``_`` dropped, spaces to ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_doc_links_resolve() -> None:
    """Relative links in README, CHANGELOG and docs point at files that exist, and into headings that exist."""
    docs = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
    anchors = {
        d.resolve(): {
            _slug(h) for h in re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", d.read_text(), flags=re.S), re.M)
        }
        for d in docs
    }
    broken = []
    for doc in docs:
        for target, anchor in re.findall(r"\]\(([^)#:]*)(?:#([^)]+))?\)", doc.read_text()):
            path = (doc.parent / target) if target else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(REPO)} -> {target}")
            elif anchor and anchor not in anchors.get(path.resolve(), {anchor}):
                broken.append(f"{doc.relative_to(REPO)} -> {target}#{anchor}")
    assert broken == []
    assert _slug("By reference: `rr.routing_ref/1`") == "by-reference-rrrouting_ref1"
