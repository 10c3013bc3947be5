"""Sparse-attention indexer top-k: bytes per token on the wire and in the routing store, rr's form vs SGLang's int32
and vs the expert routing of the same model, and the time of rr's one full check.

Run: ``.venv/bin/python benchmarks/indexer_bytes.py`` (``--quick``: a shorter sample). DeepSeek-V3.2's shape by
default (61 layers, each with an indexer, index_topk 2048, MoE top-8 of 256). Per *choosing* token (a token at
position >= index_topk; earlier ones read every earlier token and rr sends no row for them, SGLang sends a
``-1``-padded one), measured on one synthetic sample by encoding it for real. Prints a table.
"""

from __future__ import annotations

import argparse
import base64
import time

import numpy as np
from _bench import int_options  # noqa: I001 - this folder's helpers

from rr_client import IndexerDims, check_indexer, encode_indexer
from rr_client.core.indexer import decode_indexer


def sample(first: int, rows: int, layers: int, topk: int, seed: int = 0) -> np.ndarray:
    """SGLang's int32 rows for tokens ``first .. first + rows``: a distinct causal pick per (token, layer)."""
    rng = np.random.default_rng(seed)
    out = np.empty((rows, layers, topk), dtype=np.int32)
    for i in range(rows):  # argsort of noise: a distinct pick with no Python loop over positions
        out[i] = np.argsort(rng.random((layers, first + i + 1)), axis=-1)[:, :topk]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    int_options(p, layers=61, index_topk=2048, choosing=64, moe_topk=8, experts=256)
    p.add_argument("--quick", action="store_true", help="index_topk 256, 16 choosing tokens")
    a = p.parse_args()
    topk, choosing = (256, 16) if a.quick else (a.index_topk, a.choosing)
    seq = topk + choosing + 1  # rows for tokens 0 .. seq - 2: `choosing` of them past index_topk
    dims = IndexerDims(tuple(range(a.layers)), topk)
    raw = sample(topk, choosing, a.layers, topk)  # SGLang's rows of the choosing tokens (its others: -1 padded)
    sglang_b64 = base64.b64encode(raw.tobytes()).decode()
    t0 = time.perf_counter()
    checked = decode_indexer(sglang_b64, dims, prompt_tokens=seq - 1, completion_tokens=1, engine_rows_from=topk)
    t_check = time.perf_counter() - t0
    rr_b64 = encode_indexer(checked)
    assert checked.array.shape[0] == choosing
    t0 = time.perf_counter()
    check_indexer(checked.array, dims, rows=choosing, start=topk)
    t_recheck = time.perf_counter() - t0
    per = {
        "SGLang int32, base64 (it also sends -1 rows for earlier tokens)": len(sglang_b64) / choosing,
        "SGLang int32, raw bytes (its capture buffer)": raw.nbytes / choosing,
        f"rr .npy {checked.array.dtype}, base64 (choosing tokens)": len(rr_b64) / choosing,
        f"rr {checked.array.dtype} raw (what a store or ref frame holds)": checked.array.nbytes / choosing,
        f"expert routing, rr uint8 ({a.layers} layers x top-{a.moe_topk})": a.layers * a.moe_topk,
    }
    print(f"indexer top-k bytes per token: {a.layers} indexer layers, index_topk {topk}, a {seq}-token sample")
    print(f"{'form':<64} {'bytes/token':>12} {'vs rr store':>12}")
    base = per[f"rr {checked.array.dtype} raw (what a store or ref frame holds)"]
    for name, v in per.items():
        print(f"{name:<64} {v:>12,.0f} {v / base:>11.3f}x")
    mb = checked.array.nbytes / 2**20
    print(f"\nrr's one full check of {choosing} rows ({mb:.1f} MiB as {checked.array.dtype}): decode + check "
          f"{1e3 * t_check:.1f} ms, check alone {1e3 * t_recheck:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
