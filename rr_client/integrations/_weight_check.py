"""Check a weight push with the engines' own weight checkers: what :class:`DiskWeightSync` compares after a reload.

The engines hash their own copy of every weight, per tensor and per rank (read from the released code):

* vLLM 0.32+ (dev mode, ``vllm/entrypoints/rl/online/api_router.py``; read from the 0.32.0 and 0.33.0 wheels): ``POST /weight_checker {"action": "checksum"}``
  answers ``{"checksums": {"dp0:pp0:pcp0:tp0:<parameter>": <SHA-256 hex>}}``, one key per parameter of each worker
  (``vllm/model_executor/model_loader/weight_checksum.py``: SHA-256 of the parameter's bytes).
* SGLang 0.5.12+ (``/weights_checker``): ``{"success": true, "ranks": [{"checksums": {<parameter>: <hex>},
  "parallelism_info": {tp_rank, dp_rank, pp_rank, ...} (0.5.23: a list of those, one per runner)}, ...]}``,
  one entry per rank; draft runners' parameters are prefixed with their role. 0.5.7 - 0.5.11 have the route but no
  ``checksum`` action (400 ``Unsupported action='checksum'``).

Those are digests of the engine's parameters after its loader fused, sharded, cast or quantized them (vLLM's
``qkv_proj`` and stacked experts; SGLang hashes on the GPU with its own kernel), so a trainer cannot compute them
from its checkpoint. What is compared instead:

* **replicas agree**: every engine of one kind and one parallel layout (the same keys) loaded the same folder, so
  each key must have one digest across them; a replica that differs is named with its tensors and ranks.
* **the push took**: each engine's digests against its own after the previous push, and the trainer's checkpoint
  against the previous one (per saved tensor: SHA-256 of its bytes, and of its bfloat16 rounding). A tensor the
  trainer changed (even in bfloat16) whose name the engine keeps (norms, routers, unfused projections) must have
  changed on some rank; one the trainer left byte-identical must not have changed on any; and when the trainer
  changed anything, the engine cannot have kept every digest (the reload answered 200 and loaded nothing). The
  first push is compared with the engine's checksums read just before its reload (the baseline): it must move some
  digest unless the engine already held the pushed values.
* **complete answers**: an answer that lost keys since the last one, or lacks tensors (or, at the same ranks, keys)
  its same-kind replicas have, is partial, not another layout: the push fails naming what is missing.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rr_client.core.engines import engine as find_engine
from rr_client.core.errors import WeightSyncError

__all__ = [
    "CHECKSUM_BODY",
    "Checksums",
    "TensorDigest",
    "absent_checker",
    "parse_checksums",
    "split_key",
    "skip_filter",
    "trainer_digests",
    "check_complete",
    "check_replicas_agree",
    "check_push_took",
]

CHECKSUM_BODY: dict[str, str] = {"action": "checksum"}  #: what both engines' checkers take for per-tensor digests
Checksums = dict[str, str]
"""``"<ranks>:<tensor>"`` (vLLM's own keys; SGLang's made the same way, ``dp0:pp0:tp0:<tensor>``) -> digest."""

_RANKS = re.compile(r"^((?:[a-z]+\d+:)+)(.+)$")
_SHOWN = 6  # tensors named in a message before "and N more"


def split_key(key: str) -> tuple[str, str]:
    """``(ranks, tensor)`` of a checksum key: ``"dp0:pp0:pcp0:tp1:model.norm.weight"`` -> ``("dp0:pp0:pcp0:tp1",
    "model.norm.weight")``; a key without rank fields is ``("", key)``."""
    m = _RANKS.match(key)
    return (m.group(1)[:-1], m.group(2)) if m else ("", key)


def absent_checker(kind: str, status: int, body: Any) -> str | None:
    """Why the engine has no checksum checker (its answer to :data:`CHECKSUM_BODY`), or None when it has one."""
    eng = find_engine(kind)
    if status == 404:
        absent = f" ({eng.weight_checker_absent_in})" if eng.weight_checker_absent_in else ""
        return f"{eng.label} serves no {eng.weight_checker_route}{absent}"
    message = body.get("message") if isinstance(body, dict) else None
    if status == 400 and isinstance(message, str) and "Unsupported" in message and "checksum" in message:
        return f"{eng.label}'s weights checker has no 'checksum' action (SGLang 0.5.7 - 0.5.11): {message}"
    return None


def _ranks_of(info: Any) -> str:
    """SGLang's ``parallelism_info`` (a dict, or 0.5.23's list of one per runner, all on one GPU) as key ranks."""
    if isinstance(info, list):
        info = info[0] if info else {}
    info = info if isinstance(info, dict) else {}

    def rank(name: str) -> int:
        v = info.get(name)
        return v if isinstance(v, int) else 0

    return f"dp{rank('dp_rank')}:pp{rank('pp_rank')}:tp{rank('tp_rank')}"


def parse_checksums(kind: str, body: Any, where: str) -> Checksums:
    """The per-rank tensor digests in an engine checker's answer; WeightSyncError naming ``where`` when malformed."""

    def digests(d: Any) -> dict[str, str]:
        if not isinstance(d, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in d.items()):
            raise WeightSyncError(f"{where} answered no checksum map ({{tensor: digest}}): {str(body)[:300]}")
        return d

    if find_engine(kind).weight_checker_per_rank:
        ranks = body.get("ranks") if isinstance(body, dict) else None
        if not isinstance(ranks, list) or not ranks:
            raise WeightSyncError(f"{where} answered no per-rank checksums: {str(body)[:300]}")
        out: Checksums = {}
        for r in ranks:
            prefix = _ranks_of(r.get("parallelism_info") if isinstance(r, dict) else None)
            for name, digest in digests(r.get("checksums") if isinstance(r, dict) else None).items():
                out[f"{prefix}:{name}"] = digest
        return out
    return dict(digests(body.get("checksums") if isinstance(body, dict) else None))


def skip_filter(sums: Mapping[str, str], skip: Sequence[str]) -> Checksums:
    """``sums`` without the keys whose tensor name contains one of ``skip``."""
    return {k: v for k, v in sums.items() if not any(s in split_key(k)[1] for s in skip)}


@dataclass(frozen=True, slots=True)
class TensorDigest:
    """One saved tensor as the trainer pushed it: SHA-256 of its bytes, and of its bfloat16 rounding (floating
    tensors; the bytes otherwise): a change visible there is visible in any engine dtype at least as fine."""

    exact: str
    coarse: str


def _sha256(t: Any) -> str:
    """SHA-256 of a torch tensor's bytes (as vLLM's checker hashes a parameter)."""
    import torch

    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def trainer_digests(folder: Path, skip: Sequence[str] = ()) -> dict[str, TensorDigest]:
    """:class:`TensorDigest` of every tensor in ``folder``'s ``*.safetensors`` (what the engines load), by name.
    Raises (OSError, ValueError, ImportError, safetensors' errors) when the folder holds no readable safetensors."""
    import torch
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {folder}")
    out: dict[str, TensorDigest] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                if any(s in name for s in skip):
                    continue
                t = st.get_tensor(name)
                exact = _sha256(t)
                coarse = exact
                if t.is_floating_point() and t.dtype != torch.bfloat16 and t.element_size() > 1:
                    coarse = _sha256(t.to(torch.bfloat16))
                out[name] = TensorDigest(exact, coarse)
    return out


def _listing(items: Iterable[str]) -> str:
    """``a, b, c`` with at most :data:`_SHOWN` shown, then ``and N more``."""
    items = list(items)
    shown = ", ".join(items[:_SHOWN])
    return shown if len(items) <= _SHOWN else f"{shown} and {len(items) - _SHOWN} more"


def _by_tensor(keys: Iterable[str]) -> dict[str, list[str]]:
    """``{tensor: [ranks, ...]}`` of checksum keys, in key order."""
    out: dict[str, list[str]] = defaultdict(list)
    for k in keys:
        ranks, tensor = split_key(k)
        out[tensor].append(ranks or "-")
    return out


def _named(keys: Iterable[str]) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """Keys as a message (``tensor (ranks)``, ...), and the tensors and ranks they name."""
    grouped = _by_tensor(keys)
    text = _listing(f"{t} ({', '.join(r)})" for t, r in grouped.items())
    ranks = tuple(dict.fromkeys(r for rs in grouped.values() for r in rs))
    return text, tuple(grouped), ranks


_SKIP_HINT = (
    "tensors that legitimately move or differ per process (EPLB-moved experts, uninitialized MoE padding) are left "
    "out with DiskWeightSync(..., verify_skip=(<name part>, ...)); verify_weights=False turns the check off"
)


def _naming(url: str, keys: Iterable[str], says: Callable[[int, str], str]) -> WeightSyncError:
    """The error for ``url`` naming the tensors and ranks of ``keys``: ``says(how many tensors, them with their
    ranks)``, then how to leave tensors out."""
    text, tensors, ranks = _named(keys)
    return WeightSyncError(f"{says(len(tensors), text)}; {_SKIP_HINT}", engine=url, tensors=tensors, ranks=ranks)


def _partial(url: str, missing: Iterable[str], against: str, folder: Path) -> WeightSyncError:
    """The error for a checksum answer that lacks ``missing`` keys (a rank or a loader that hashed less)."""
    return _naming(
        url,
        sorted(missing),
        lambda n, text: (
            f"{url}'s weight checksums after loading {folder} are partial: {n} tensor(s) missing from "
            f"its checker's answer that {against} has: {text}. A checker that hashed less (a rank that did not answer, "
            "a loader that dropped parameters) is not another layout"
        ),
    )


def check_complete(engines: Mapping[str, tuple[str, Checksums]], folder: Path) -> None:
    """Raise WeightSyncError when an engine's answer lacks keys its same-kind replicas have: a tensor no rank of it
    hashed, or, between replicas with the same ranks, a key (another parallel layout has other ranks, same tensors)."""
    by_kind: dict[str, list[str]] = defaultdict(list)
    for url, (kind, _) in engines.items():
        by_kind[kind].append(url)
    for urls in by_kind.values():
        if len(urls) < 2:
            continue
        tensors = {u: {split_key(k)[1] for k in engines[u][1]} for u in urls}
        ranks = {u: frozenset(split_key(k)[0] for k in engines[u][1]) for u in urls}
        every = set().union(*tensors.values())
        for u in urls:
            peers = [v for v in urls if v != u and ranks[v] == ranks[u]]
            missing = set().union(*(engines[v][1].keys() for v in peers)) - engines[u][1].keys() if peers else set()
            missing |= every - tensors[u]
            if missing:
                raise _partial(u, missing, "a replica of the same kind", folder)


def check_replicas_agree(engines: Mapping[str, tuple[str, Checksums]], folder: Path) -> list[str]:
    """Raise WeightSyncError when engines of one kind and layout hold different digests for a key (the replica(s)
    outside the majority named, with the tensors and ranks), or when one's answer is partial (:func:`check_complete`);
    return notes on engines of other kinds or parallel layouts, compared only within each."""
    check_complete(engines, folder)
    groups: dict[tuple[str, frozenset[str]], list[str]] = defaultdict(list)
    for url, (kind, sums) in engines.items():
        groups[(kind, frozenset(sums))].append(url)
    notes = []
    if len(groups) > 1:
        layouts = "; ".join(f"{', '.join(urls)} ({kind}, {len(keys)} keys)" for (kind, keys), urls in groups.items())
        notes.append(f"engines with different kinds or parallel layouts are compared only within each: {layouts}")
    for (_, keys), urls in groups.items():
        if len(urls) < 2:
            continue
        odd: dict[str, list[str]] = defaultdict(list)  # url -> keys where it is outside the majority (or a tie)
        for key in sorted(keys):
            votes = Counter(engines[u][1][key] for u in urls)
            if len(votes) == 1:
                continue
            (top, n), *rest = votes.most_common()
            tie = any(m == n for _, m in rest)
            for u in urls:
                if tie or engines[u][1][key] != top:
                    odd[u].append(key)
        if odd:
            parts = []
            tensors: list[str] = []
            ranks: list[str] = []
            for u, ks in odd.items():
                text, ts, rs = _named(ks)
                parts.append(f"{u} differs in {len(ks)} tensor shard(s): {text}")
                tensors += ts
                ranks += rs
            others = [u for u in urls if u not in odd]
            against = f" from {', '.join(others)}" if others else " (no majority: they all disagree)"
            raise WeightSyncError(
                f"after loading {folder}, the replicas' own weight checksums disagree{against}: "
                f"{'; '.join(parts)}. Every replica loaded the same checkpoint, so the one(s) named hold other weights "
                f"(a partial or failed reload, another checkpoint, a corrupted copy); {_SKIP_HINT}",
                engine=", ".join(odd),
                tensors=tuple(dict.fromkeys(tensors)),
                ranks=tuple(dict.fromkeys(ranks)),
            )
    return notes


def _holds(sums: Checksums, trainer: Mapping[str, TensorDigest]) -> bool:
    """Some tensor the engine keeps by name has the checkpoint's digest (exact, or of its bfloat16 rounding): the
    engine holds pushed values (vLLM hashes a parameter's bytes as the trainer's digests do)."""
    return any((t := trainer.get(split_key(k)[1])) is not None and v in (t.exact, t.coarse) for k, v in sums.items())


def _quantized_modules(tensors: Iterable[str]) -> set[str]:
    """Modules holding a ``*scale*`` parameter (quantized weights: a small change may not move their bytes)."""
    return {t.rsplit(".", 1)[0] for t in tensors if "." in t and "scale" in t.rsplit(".", 1)[1]}


def check_push_took(
    url: str,
    before: Checksums | None,
    after: Checksums,
    trainer_before: Mapping[str, TensorDigest] | None,
    trainer_after: Mapping[str, TensorDigest] | None,
    folder: Path,
) -> None:
    """Raise WeightSyncError when ``url``'s digests since its previous push (``before``; before the first push, its
    baseline) contradict what the trainer changed since then: a changed tensor the engine kept, an identical one it
    changed, or nothing changed at all; or when the answer lost keys it had (partial).

    The first push has no trainer checkpoint to compare with (``trainer_before`` None): the engine must have moved
    some digest, unless it already held what was pushed (a kept tensor's digest equals the checkpoint's)."""
    if not after or before is None:
        return  # nothing to compare with (no baseline, all skipped)
    if missing := before.keys() - after.keys():
        raise _partial(url, missing, "its answer before this push", folder)
    if trainer_after is None or set(before) != set(after):
        return  # a checkpoint not read, or another layout since (more keys)
    if trainer_before is None:
        if after == before and not _holds(after, trainer_after):
            raise WeightSyncError(
                f"{url} kept every one of its {len(after)} weight checksums through the first push (read before the "
                f"reload from {folder}), and none of them is the pushed checkpoint's: the reload answered success but "
                "loaded nothing new (a stale path, a no-op reload). If the checkpoint is the weights the engine "
                f"started from, nothing needed pushing; {_SKIP_HINT}",
                engine=url,
            )
        return
    common = trainer_before.keys() & trainer_after.keys()
    changed = {n for n in common if trainer_before[n].coarse != trainer_after[n].coarse}
    same = {n for n in common if trainer_before[n].exact == trainer_after[n].exact}
    moved = {k for k in after if after[k] != before[k]}
    moved_tensors = {split_key(k)[1] for k in moved}
    quantized = _quantized_modules(split_key(k)[1] for k in after)
    kept = [
        k
        for k in after
        if (t := split_key(k)[1]) in changed and t not in moved_tensors and t.rsplit(".", 1)[0] not in quantized
    ]
    if changed and not moved:
        example = _listing(sorted(changed))
        raise WeightSyncError(
            f"{url} kept every one of its {len(after)} weight checksums since the last push although the trainer "
            f"changed {len(changed)} tensor(s) (e.g. {example}): the reload from {folder} answered success but loaded "
            f"nothing new (a stale path, a no-op reload); {_SKIP_HINT}",
            engine=url,
            tensors=tuple(sorted(changed)),
        )
    if kept:
        raise _naming(
            url,
            kept,
            lambda n, text: (
                f"{url} did not load {n} tensor(s) the trainer changed since the last push (from "
                f"{folder}): {text} kept the digest the engine's own checker gave after the last push; the reload answered "
                "success but these weights are stale (a loader that skipped their names, a partial load)"
            ),
        )
    if altered := [k for k in sorted(moved) if split_key(k)[1] in same]:
        raise _naming(
            url,
            altered,
            lambda n, text: (
                f"{url} changed {n} tensor(s) the trainer pushed byte-identical to the last push (from "
                f"{folder}): {text}; the engine holds other values than were pushed (another writer, a corrupted load)"
            ),
        )
    if not changed and common and len(same) == len(common) and moved:
        raise _naming(
            url,
            sorted(moved),
            lambda n, text: (
                f"{url} changed {n} tensor(s) although the checkpoint in {folder} is byte-identical to "
                f"the last push's: {text}; the engine holds other values than were pushed"
            ),
        )
