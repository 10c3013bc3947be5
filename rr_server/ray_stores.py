"""``rr-server ray-stores``: list the Ray routing store actors on a cluster (``RR_ROUTING_STORE=ray``) and remove
leftovers: a store normally goes away with its engine, but rr before 0.1 made one detached store per node that
nothing removed, and a store whose engine hangs stays until it is killed."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from rr_server.serving.command_line import CommandParser

__all__ = ["main"]


def _line(s: dict[str, Any]) -> str:
    if s["state"] != "live":
        return f"{s['name']}  {s['state']}" + (f" ({s['why']})" if s.get("why") else "")
    e = s.get("engine", {})
    age = time.time() - float(e.get("started", time.time()))
    return (
        f"{s['name']}  live  engine {e.get('host')} pid {e.get('pid')} up {age:.0f}s  entries {s['entries']}  "
        f"bytes {s['bytes']}/{s['max_bytes']}  weight_version {s['weight_version']}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """List the store actors; ``--remove NAME`` / ``--remove-leftovers`` (legacy or unreachable) kill them."""
    p = CommandParser(
        prog="rr-server ray-stores",
        description=(
            "List the Ray routing store actors (RR_ROUTING_STORE=ray) on a cluster and remove leftovers: a store goes "
            "away with its engine, but rr before 0.1 made one detached store per node that nothing removed."
        ),
    )
    p.add_argument("--address", help="the Ray cluster (default: RR_RAY_ADDRESS, else auto)")
    p.add_argument("--remove", nargs="+", default=[], metavar="NAME", help="kill these store actors")
    p.add_argument(
        "--remove-leftovers",
        action="store_true",
        help="kill every store that is legacy (a detached per-node store of rr before 0.1) or unreachable",
    )
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    args = p.parse_args(list(argv or []))
    from rr_server.serving.store.ray import list_stores, remove_stores

    stores = list_stores(args.address)
    doomed = list(args.remove) + [s["name"] for s in stores if args.remove_leftovers and s["state"] != "live"]
    try:
        removed = remove_stores(doomed, args.address) if doomed else []
    except ValueError as e:
        sys.stderr.write(f"rr-server ray-stores: {e}\n")
        return 2
    if args.json:
        print(json.dumps({"stores": stores, "removed": removed}, indent=2, default=str))
    else:
        for s in stores:
            print(_line(s) + ("  REMOVED" if s["name"] in removed else ""))
        if not stores:
            print("no routing store actors on this cluster")
    missing = sorted(set(args.remove) - set(removed))
    if missing:
        sys.stderr.write(f"rr-server ray-stores: no such store actor: {', '.join(missing)}\n")
        return 1
    return 0
