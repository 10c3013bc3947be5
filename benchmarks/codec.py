"""Codec benchmark: payload size and encode / decode+validate+pad time, rr vs SGLang int32 vs JSON lists.

Run: ``.venv/bin/python benchmarks/codec.py`` (``--quick`` for a small batch). Prints a table; the
README quotes it. Times are the best of ``--repeat`` runs on this machine (single thread per stage).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pybase64
import torch
from _bench import int_options, synthetic_info  # noqa: I001 - this folder's helpers

from rr_client import RRInfo, check_routing, encode_routed_experts, parse_sample, to_tensors
from rr_client.core._rowcheck import HAVE_C


def best_of(fn: Callable[[], Any], repeat: int) -> float:
    """Best wall time of ``repeat`` calls (seconds)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def make_batch(b: int, t: int, layers: int, k: int, e: int, seed: int = 0) -> list[np.ndarray]:
    """Per-sample int32 routing with distinct ids per row, lengths spread over [3t/4, t]."""
    rng = np.random.default_rng(seed)
    pool = np.argsort(rng.random((256, layers, e)), axis=-1)[..., :k].astype(np.int32)  # 256 distinct rows
    lengths = rng.integers(3 * t // 4, t + 1, size=b)
    lengths[0] = t
    return [pool[rng.integers(0, 256, size=n - 1)] for n in lengths]


def replies_for(samples: list[np.ndarray], payloads: list[str], info: RRInfo, prompt_len: int) -> list[dict[str, Any]]:
    """SGLang-style reply dicts carrying each payload (as the client receives them)."""
    out = []
    for arr, p in zip(samples, payloads):
        n = arr.shape[0] + 1
        meta = {"prompt_tokens": prompt_len, "completion_tokens": n - prompt_len, "routed_experts": p}
        out.append({"output_ids": [1] * (n - prompt_len), "meta_info": meta})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    int_options(ap, batch=64, tokens=4096, layers=48, topk=8, experts=128, repeat=5)
    ap.add_argument("--json-samples", type=int, default=2, help="JSON is slow: time this many samples and scale")
    ap.add_argument("--quick", action="store_true", help="8 x 1024 tokens")
    a = ap.parse_args()
    if a.quick:
        a.batch, a.tokens = 8, 1024
    b, t, layers, k, e = a.batch, a.tokens, a.layers, a.topk, a.experts
    samples = make_batch(b, t, layers, k, e)
    prompt_len = 16
    info = synthetic_info(layers, e, k, engine="bench", version="0")
    prompt_ids = [[1] * prompt_len for _ in samples]

    # ---- payloads
    ours = [encode_routed_experts(check_routing(s, info, rows=s.shape[0])) for s in samples]
    sglang = [pybase64.b64encode(s.tobytes()).decode() for s in samples]
    js = [orjson.dumps(s.tolist()).decode() for s in samples[: a.json_samples]]
    scale = b / a.json_samples
    ours_b = sum(map(len, ours))
    sgl_b = sum(map(len, sglang))
    js_b = sum(map(len, js)) * scale

    # ---- encode (server side)
    # the server's work per sample: the one full check, then the encoder
    t_enc_ours = best_of(
        lambda: [encode_routed_experts(check_routing(s, info, rows=s.shape[0])) for s in samples], a.repeat
    )
    t_enc_sgl = best_of(lambda: [pybase64.b64encode(s.tobytes()) for s in samples], a.repeat)
    t_enc_js = best_of(lambda: [orjson.dumps(s.tolist()) for s in samples[: a.json_samples]], 1) * scale

    # ---- decode + validate + pad (client side)
    replies = replies_for(samples, ours, info, prompt_len)

    def rr_path(validate: bool) -> torch.Tensor:
        res = [
            parse_sample(
                r, index=i, prompt_index=i, prompt_ids=prompt_ids[i], info=info, want_routing=True, validate=validate
            )
            for i, r in enumerate(replies)
        ]
        return to_tensors(res, info).routed_experts

    def floor() -> list[bytes]:
        # a consumer keeps what it decodes, so the floor keeps its outputs too (fresh memory, like ours)
        return [pybase64.b64decode(p, validate=True) for p in ours]

    def floor_discard() -> None:
        for p in ours:
            pybase64.b64decode(p, validate=True)

    def slime_areal_int32() -> torch.Tensor:
        # as slime/AReaL decode SGLang: b64 -> int32, size check, reshape; then pad (int32 kept)
        out = torch.zeros((b, t, layers, k), dtype=torch.int32)
        for i, p in enumerate(sglang):
            arr = np.frombuffer(pybase64.b64decode(p), dtype=np.int32)
            rows = samples[i].shape[0]
            if arr.size % rows:
                raise ValueError("size mismatch")
            arr = arr.reshape(rows, layers, k)
            out[i, t - rows - 1 : t - 1] = torch.from_numpy(arr.copy())
        return out

    def json_lists() -> torch.Tensor:
        out = torch.zeros((a.json_samples, t, layers, k), dtype=torch.int32)
        for i, p in enumerate(js):
            arr = np.asarray(json.loads(p), dtype=np.int32)
            out[i, t - arr.shape[0] - 1 : t - 1] = torch.from_numpy(arr)
        return out

    # correctness of what is timed
    padded = rr_path(True)
    assert padded.dtype == torch.uint8 and padded.shape == (b, t, layers, k)
    np.testing.assert_array_equal(padded[0, : t - 1].numpy(), samples[0])

    t_floor = best_of(floor, a.repeat)
    t_floor_discard = best_of(floor_discard, a.repeat)
    t_ours = best_of(lambda: rr_path(True), a.repeat)
    t_ours_nv = best_of(lambda: rr_path(False), a.repeat)
    t_sgl = best_of(slime_areal_int32, a.repeat)
    t_js = best_of(json_lists, 1) * scale

    mb = 1e6
    print(
        f"batch {b} x {t} tokens x {layers} layers x top-{k}, {e} experts; C row checker: {HAVE_C}; "
        f"best of {a.repeat}; JSON timed on {a.json_samples} samples and scaled"
    )
    print()
    print(
        f"| {'path':<46} | {'payload MB':>10} | {'vs int32':>8} | {'encode s':>8} | {'decode+check+pad s':>18} | "
        f"{'vs floor':>8} |"
    )
    print(f"|{'-' * 48}|{'-' * 12}|{'-' * 10}|{'-' * 10}|{'-' * 20}|{'-' * 10}|")

    def row(name: str, size: float, enc: float | None, dec: float) -> None:
        enc_s = f"{enc:8.3f}" if enc is not None else f"{'-':>8}"
        print(
            f"| {name:<46} | {size / mb:10.1f} | {size / sgl_b:8.3f} | {enc_s} | {dec:18.3f} | {t_floor / dec:8.2f} |"
        )

    row("bare b64decode of rr payload, kept (floor)", ours_b, None, t_floor)
    row("bare b64decode, output discarded at once", ours_b, None, t_floor_discard)
    row("rr npy uint8, full validation", ours_b, t_enc_ours, t_ours)
    row("rr npy uint8, validation off", ours_b, t_enc_ours, t_ours_nv)
    row("SGLang b64 int32 as slime/AReaL (size check)", sgl_b, t_enc_sgl, t_sgl)
    row("JSON nested lists (vLLM 0.21)", js_b, t_enc_js, t_js)
    print()
    print(
        f"rr full validation: {t_floor / t_ours:.2f}x floor throughput, {t_sgl / t_ours:.2f}x faster than the "
        f"int32 path, payload {ours_b / sgl_b:.3f}x of int32"
    )


if __name__ == "__main__":
    main()
