"""Two gloo ranks on loopback (``torch.multiprocessing`` spawn) running a list of cases, one spawn for all of them.

Each rank imports megatron-core once (10-60 s here), so the parallel layouts of a test module share one spawn:
:func:`run_cases` starts the ranks, each runs every case in turn (a case sets up its own ``parallel_state`` over the
same process group), and returns, per case, each rank's result or the traceback of what it raised. A case is a
module-level function ``case(rank: int) -> Any`` (picklable by name); its result must be picklable too.
"""

from __future__ import annotations

import pickle
import tempfile
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

Case = Callable[[int], Any]


class CaseFailed(AssertionError):
    """A case raised on a rank: the rank's traceback is the message."""


def _rank_main(rank: int, world_size: int, port: int, cases: Sequence[Case], out: str) -> None:
    """One rank: the process group, then every case; each case's result or traceback pickled for the parent."""
    from tests.megatron import harness

    harness.env_threads()
    harness.patch_cpu()
    import torch.distributed as dist

    # a rank that raised leaves the other in a collective: gloo's timeout ends the wait instead of CI's
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=harness.TIMEOUT_MINUTES),
    )
    results: list[tuple[bool, Any]] = []
    for case in cases:
        try:
            results.append((True, case(rank)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent test, named
            results.append((False, f"rank {rank}, {case.__name__}:\n{traceback.format_exc()}"))
        dist.barrier()
    Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
    dist.destroy_process_group()


def run_cases(cases: Sequence[Case], world_size: int = 2) -> dict[str, list[tuple[bool, Any]]]:
    """Run ``cases`` on ``world_size`` spawned gloo ranks: ``{case name: [(ok, result or traceback) per rank]}``."""
    from tests.megatron.harness import free_port

    with tempfile.TemporaryDirectory(prefix="rr-megatron-") as out:
        mp.start_processes(
            _rank_main,
            args=(world_size, free_port(), list(cases), out),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        per_rank = [pickle.loads(Path(out, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]
    return {case.__name__: [per_rank[r][i] for r in range(world_size)] for i, case in enumerate(cases)}


def results_of(outcomes: dict[str, list[tuple[bool, Any]]], case: Case) -> list[Any]:
    """Each rank's result of ``case``; raises :class:`CaseFailed` with the ranks' tracebacks if any rank raised."""
    per_rank = outcomes[case.__name__]
    failed = [detail for ok, detail in per_rank if not ok]
    if failed:
        raise CaseFailed("\n".join(failed))
    return [detail for _ok, detail in per_rank]


__all__ = ["CaseFailed", "run_cases", "results_of"]
