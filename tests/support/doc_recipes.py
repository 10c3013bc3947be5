"""The shell recipes of docs/*.md, as the docs write them: for the registry that says how each is checked
(tests/unit/test_doc_recipes.py) and the runs of those that run here (tests/vllm/test_doc_recipes.py).

A recipe is a fenced block in a shell language (``bash``, ``sh``, ``shell``, ``console``), or the ``$ ``-prompted
lines of a ``text`` block (a transcript: the commands in it are recipes too). Its key is ``doc.md: first command``
(the first line that is neither blank nor a comment), so the registry survives edits around it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DOCS", "REPO", "Recipe", "recipes", "commands", "split_commands", "inline_commands"]

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
_FENCE = re.compile(r"^```(\S*)\s*$")
# a command line in an inline code span: what a reader is told to run
_INLINE = re.compile(r"`((?:rr-server|make|python|\.venv/bin/python) [^`]+)`")
_OPERATORS = frozenset({"|", "||", "&", "&&", ";", ">", ">>", "<", "2>", "(", ")"})


@dataclass(frozen=True)
class Recipe:
    """One shell recipe: ``doc`` (file name under docs/), the line of its opening fence, its language, its text
    (for a transcript: the prompted commands, prompt removed)."""

    doc: str
    line: int
    lang: str
    text: str

    @property
    def key(self) -> str:
        """``doc: first command line`` (without its comment, spaces collapsed)."""
        first = next(s for s in (ln.strip() for ln in self.text.splitlines()) if s and not s.startswith("#"))
        return f"{self.doc}: " + " ".join(re.sub(r"\s+#.*$", "", first).rstrip(" \\").split())


def recipes(docs: Path = DOCS) -> list[Recipe]:
    """Every shell recipe of ``docs/*.md``, in file and line order."""
    out: list[Recipe] = []
    for path in sorted(docs.glob("*.md")):
        lang, start, body = None, 0, []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            m = _FENCE.match(line)
            if lang is None and m:
                lang, start, body = m.group(1).lower(), i, []
            elif lang is not None and line.strip() == "```":
                if lang in SHELL_LANGS:
                    out.append(Recipe(path.name, start, lang, "\n".join(body)))
                elif (prompted := [b[2:] for b in body if b.startswith("$ ")]) and lang in ("text", ""):
                    out.append(Recipe(path.name, start, lang, "\n".join(prompted)))
                lang = None
            elif lang is not None:
                body.append(line)
    return out


def _logical_lines(text: str) -> list[str]:
    """The lines of ``text`` with backslash continuations joined."""
    out: list[str] = []
    cur = ""
    for line in text.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
        else:
            out.append(cur + line)
            cur = ""
    if cur:
        out.append(cur)
    return out


def split_commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line (split at ``|``, ``&&``, ``;``, ``&``; a redirect ends its command),
    each without leading ``VAR=value`` assignments; ``[]`` when the line is not whole shell (inside a multi-line
    quoted argument)."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        tokens = list(lex)
    except ValueError:  # an unclosed quote: a line of a multi-line argument
        return []
    cmds: list[list[str]] = []
    cur: list[str] = []
    skip = False  # after a redirect: its target
    for t in tokens:
        if t in _OPERATORS:
            if cur:
                cmds.append(cur)
            cur, skip = [], t in (">", ">>", "<", "2>")
            continue
        if skip:
            skip = False
            continue
        if not cur and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", t):
            continue
        cur.append(t)
    if cur:
        cmds.append(cur)
    return [c for c in cmds if c]


def commands(text: str) -> list[list[str]]:
    """Every simple command of a recipe's text, in order."""
    return [c for line in _logical_lines(text) for c in split_commands(line)]


def inline_commands(docs: Path = DOCS) -> list[tuple[str, str]]:
    """``(doc, span)`` for every inline code span of docs/*.md that is a command line (``rr-server ...``,
    ``make ...``, ``python ...``), outside fenced blocks."""
    out: list[tuple[str, str]] = []
    for path in sorted(docs.glob("*.md")):
        fenced = False
        for line in path.read_text().splitlines():
            if _FENCE.match(line) or (fenced and line.strip() == "```"):
                fenced = not fenced
                continue
            if not fenced:
                out += [(path.name, m.group(1)) for m in _INLINE.finditer(line)]
    return out
