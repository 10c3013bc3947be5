"""What rr's SGLang patch costs per request on the TokenizerManager's event loop, next to what SGLang spends.

Run: ``.venv/bin/python benchmarks/sglang_patch_cost.py`` (``--quick``: 1k and 4k only). Prints a markdown
table. It does not import SGLang (the main ``.venv`` has none); it mirrors SGLang 0.5.23's own calls:

* SGLang's encode: ``DetokenizerManager._b64_encode_per_request`` =
  ``pybase64.b64encode(tensor.numpy().tobytes()).decode("utf-8")`` on the int32 (rows, layers, top-k) tensor.
* SGLang's serialize: ``orjson.dumps`` of the response body (``orjson_response``), meta_info with the
  int32 base64 string.
* IPC detokenizer -> TokenizerManager: ``pickle`` dumps+loads of the base64 string (the bytes zmq carries).
* rr's transcode (what the patch adds, on the TokenizerManager's loop): ``rr_patches.sglang.convert.wire_fields``
  on SGLang's base64 int32 string: decode, full check (``check_routing``), uint8 ``.npy`` + base64.
* rr's serialize: ``orjson.dumps`` of the body with rr's meta_info fields instead.
* rr in the detokenizer (the 0.5.23 alternative): ``routing_meta_fields(check_routing(tensor.numpy()))``
  straight from the int32 tensor, replacing SGLang's own encode there.

Times are the best of ``--repeat`` runs, single thread. Machine caveat: measured on a shared 2-core box.
"""

from __future__ import annotations

import argparse
import pickle
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pybase64
import torch

from rr_client import RRInfo
from rr_client.core.codec import check_routing, routing_meta_fields
from rr_patches.sglang.convert import wire_fields

OPT = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY  # SGLang 0.5.23 ORJSON_RESPONSE_OPTIONS


def best_of(fn: Callable[[], Any], repeat: int) -> float:
    """Best wall time of ``repeat`` calls, in milliseconds."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def row(t: int, info: RRInfo, pool: np.ndarray, rng: np.random.Generator, repeat: int) -> str:
    """One table row for a ``t``-token request."""
    rows = t - 1
    tensor = torch.from_numpy(pool[rng.integers(0, 256, size=rows)])
    sg = pybase64.b64encode(tensor.numpy().tobytes()).decode("utf-8")
    base_meta = {
        "id": "x",
        "finish_reason": {"type": "length"},
        "prompt_tokens": t // 2,
        "completion_tokens": t - t // 2,
    }
    rr_fields = wire_fields(sg, info, rows=rows)
    rr_b64 = rr_fields["routed_experts"]
    t_sg_enc = best_of(lambda: pybase64.b64encode(tensor.numpy().tobytes()).decode("utf-8"), repeat)
    t_sg_json = best_of(
        lambda: orjson.dumps({"text": "", "meta_info": {**base_meta, "routed_experts": sg}}, option=OPT), repeat
    )
    t_ipc_sg = best_of(lambda: pickle.loads(pickle.dumps(sg, protocol=pickle.HIGHEST_PROTOCOL)), repeat)
    t_rr = best_of(lambda: wire_fields(sg, info, rows=rows), repeat)
    t_rr_json = best_of(lambda: orjson.dumps({"text": "", "meta_info": {**base_meta, **rr_fields}}, option=OPT), repeat)
    t_ipc_rr = best_of(lambda: pickle.loads(pickle.dumps(rr_b64, protocol=pickle.HIGHEST_PROTOCOL)), repeat)
    t_detok = best_of(lambda: routing_meta_fields(check_routing(tensor.numpy(), info, rows=rows)), repeat)
    return (
        f"| {t // 1024}k | {t_sg_enc:.2f} | {t_sg_json:.2f} | {t_ipc_sg:.2f} | "
        f"{t_sg_enc + t_sg_json + t_ipc_sg:.2f} | {t_rr:.2f} | {t_rr_json:.2f} | {t_ipc_rr:.2f} | "
        f"{t_detok:.2f} | {len(sg) / 1e6:.1f} | {len(rr_b64) / 1e6:.1f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    lengths = [1024, 4096] if a.quick else a.lengths
    info = RRInfo(
        engine="sglang",
        engine_version="0.5.23",
        rr_version="bench",
        num_hidden_layers=a.layers,
        num_experts=a.experts,
        topk=a.topk,
        moe_layers=list(range(a.layers)),
        wire_dtype="uint8",
    )
    rng = np.random.default_rng(0)
    pool = np.argsort(rng.random((256, a.layers, a.experts)), axis=-1)[..., : a.topk].astype(np.int32)
    print(f"{a.layers} layers, top-{a.topk}, {a.experts} experts; ms per request, best of {a.repeat}\n")
    print(
        "| tokens | SGLang b64 int32 (detok) | SGLang orjson body | IPC pickle int32 b64 | SGLang total "
        "| rr transcode (TM loop) | rr orjson body | IPC pickle rr b64 | rr-in-detok encode "
        "| int32 b64 MB | rr b64 MB |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for t in lengths:
        print(row(t, info, pool, rng, a.repeat))


if __name__ == "__main__":
    main()
