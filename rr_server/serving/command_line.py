"""What every ``rr-server`` command's argument handling shares: one-line refusals with a "did you mean", and the
check that a server can listen where it was asked to, both answered before anything loads."""

from __future__ import annotations

import argparse
import difflib
import socket
import sys
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["CommandParser", "did_you_mean", "port_problem", "url_problem"]


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """``" did you mean X?"`` for the closest of ``choices`` to a mistyped ``word``, else ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" did you mean {close[0]}?" if close else ""


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be a server's address, in a clause naming it, or None (an ``http(s)://`` URL)."""
    return None if url.startswith(("http://", "https://")) else f"{url!r} is not a URL: give http://HOST:PORT"


class CommandParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose mistakes are one line naming the way out: an unknown option gets the
    closest known one (``--upstrem`` -> ``--upstream``, not "--upstream is required"), and every error ends with
    where the options are listed, instead of argparse's whole usage block."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """Refuse an option this parser does not have before argparse's own checks (required options) run."""
        words = list(sys.argv[1:] if args is None else args)
        options = [s for a in self._actions for s in a.option_strings]
        for word in words:
            if word == "--":
                break
            name = word.split("=", 1)[0]
            if not name.startswith("--") or name in options:
                continue
            if len([o for o in options if o.startswith(name)]) == 1:  # argparse's unambiguous abbreviation
                continue
            self.error(f"unknown option {name}:{did_you_mean(name, options) or ' not one of its options.'}")
        return super().parse_known_args(words, namespace)

    def error(self, message: str) -> NoReturn:
        """One line on stderr, exit 2 (argparse prints its whole usage block)."""
        self.exit(2, f"{self.prog}: {message} ({self.prog} --help lists the options)\n")


def port_problem(port: str | int | None, host: str | None, default_port: int, default_host: str) -> str | None:
    """Why a server cannot listen on ``host:port`` (the defaults where not given), in one line, or None: not a port
    number, out of range, a host that does not resolve, or a port already in use (tried by binding it, as the server
    will, with ``SO_REUSEADDR`` as uvicorn sets it, so a closing connection's TIME_WAIT does not count)."""
    value = str(port) if port is not None else str(default_port)
    try:
        number = int(value)
    except ValueError:
        return f"--port {value}: not a port number (1-65535)"
    if not 0 < number < 65536:
        return f"--port {value}: out of range (1-65535)"
    where = host or default_host
    try:
        family, _, _, _, address = socket.getaddrinfo(where, number, type=socket.SOCK_STREAM)[0]
    except OSError as e:
        return f"--host {where}: cannot be resolved ({e.strerror or e})"
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except PermissionError as e:  # EACCES: a port below 1024 as a user
            return f"--port {number}: this user may not listen on it ({e.strerror}: ports below 1024 need root)"
        except OSError as e:
            default = " (the default)" if port is None else ""
            return (
                f"port {number}{default} on {where} is already in use ({e.strerror or e}): another server listens "
                "there; pick a free one with --port N"
            )
    return None
