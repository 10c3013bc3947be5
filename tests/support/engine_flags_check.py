"""The launchers' pre-flight reads an engine's options from its source (rr_server.launch.engine_flags); this checks
that reading against the installed release's own parser: every option it accepts is read, and every option that
takes no value is read as a switch (else a bare model name after it would be taken for its value)."""

from __future__ import annotations

import argparse

from rr_server.launch.engine_flags import EngineFlags, scan_engine_flags
from rr_server.serving.engines import releases


def check_against(parser: argparse.ArgumentParser, engine: str) -> EngineFlags:
    """Assert the scan of the installed ``engine`` covers ``parser`` (its real launch parser); the scan."""
    rel = releases(engine)
    known = scan_engine_flags(rel.package, rel.flag_sources)
    assert known is not None, f"{engine}: the scan found no parser in {rel.flag_sources}"
    options = [(s, a.nargs == 0) for a in parser._actions for s in a.option_strings]
    assert len(options) > 200  # the real parser, not a stub
    missing = [s for s, _ in options if not known.knows(s, rel.underscore_flags)]
    assert missing == [], f"{engine}: options the scan does not read: {missing}"
    not_switches = [s for s, switch in options if switch and known.takes_value(s)]
    assert not_switches == [], f"{engine}: switches read as taking a value: {not_switches}"
    return known
