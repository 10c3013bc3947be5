"""SGLang 0.5.22+: routing from the scheduler's output to rr's checked fields, with and without rr's detokenizer hook.

Run under an SGLang overlay (SGLang cannot be imported from the main ``.venv``)::

    PYTHONPATH="$(scripts/setup_sglang.sh --pythonpath 0.5.23)" .venv/bin/python benchmarks/sglang_detok_path.py

Uses SGLang's real code: a ``BatchTokenIDOutput`` captured from the stand-in scheduler of ``tests/sglang`` (a
real request through SGLang's TokenizerManager), its routing replaced by one request of ``tokens`` rows x 48
layers x top-8 (128 experts, int32 as SGLang's scheduler hands it). Per request, best of ``--repeat``:

* *detokenizer*: ``DetokenizerManager.handle_batch_token_id_out`` (SGLang's int32 base64, or rr's ``.npy``);
* *IPC*: SGLang's own wire for that hop (msgpack on 0.5.23, pickle before), encode + decode;
* *TokenizerManager*: rr's ``wire_fields`` (decode, the one full check, rr's ``.npy`` + base64), on its loop.

Prints a markdown table; measured on a shared 2-core machine (+-30%).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

L, K, E = 48, 8, 128


def best_of(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Best wall time (ms) of ``repeat`` calls and the last result."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3, out


async def _captured_batch() -> Any:
    """One real BatchTokenIDOutput for a routed request, as the stand-in scheduler sends it to the detokenizer."""
    from rr_server.demo.tiny_moe import build_tiny_moe
    from tests.sglang.conftest import CACHE, MODEL_SPEC
    from tests.sglang.harness import Harness

    h = Harness(build_tiny_moe(CACHE / "sglang-qwen3-dense", **MODEL_SPEC))
    seen: list[Any] = []
    detokenize = h.detok.handle_batch_token_id_out

    def spy(recv_obj: Any) -> Any:
        seen.append(recv_obj)
        return detokenize(recv_obj)

    h.detok.handle_batch_token_id_out = spy
    status, _ = await h.post(
        {"input_ids": [3, 17, 29, 41], "sampling_params": {"max_new_tokens": 4}, "return_routed_experts": True}
    )
    assert status == 200 and seen
    del h.detok.handle_batch_token_id_out  # the class's method again (swapped per path below)
    return h, seen[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--tokens", type=int, nargs="*", default=[1024, 4096, 16384, 32768])
    args = p.parse_args()

    from sglang.srt.managers.detokenizer_manager import DetokenizerManager

    from rr_client import RRInfo
    from rr_patches.sglang.convert import wire_fields
    from rr_patches.sglang.detok import DETOK_METHOD, around_handle_batch_token_id_out
    from rr_server.serving.engines.sglang import profile_for
    from tests.sglang.standin import wire

    profile = profile_for()
    h, batch = asyncio.run(_captured_batch())
    info = RRInfo(
        engine="sglang",
        engine_version=profile.version,
        rr_version="bench",
        model="bench",
        num_hidden_layers=L,
        num_experts=E,
        topk=K,
        moe_layers=list(range(L)),
        wire_dtype="uint8",
    )
    sglang_own = DetokenizerManager.__dict__[DETOK_METHOD]

    def hooked(self: Any, recv_obj: Any) -> Any:
        return around_handle_batch_token_id_out(sglang_own, self, recv_obj)

    print(
        f"SGLang {profile.version}: one request's routing, {L} layers, top-{K}, {E} experts; ms, best of "
        f"{args.repeat}\n"
    )
    print("| tokens | path | detokenizer | IPC | TokenizerManager (rr check + encode) | total | payload MB |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for n in args.tokens:
        rows = n - 1
        ids = np.argsort(rng.random((rows, L, E), dtype=np.float32), axis=-1)[..., :K].astype(np.int32)
        batch.routed_experts = [torch.from_numpy(ids)]
        for name, method in (("SGLang int32 -> rr in TM", sglang_own), ("rr .npy in detokenizer", hooked)):
            setattr(DetokenizerManager, DETOK_METHOD, method)
            t_detok, out = best_of(lambda: h.detok.handle_batch_token_id_out(batch), args.repeat)
            t_ipc, moved = best_of(lambda: wire(out), args.repeat)  # noqa: B023 - timed in this iteration
            payload = moved.routed_experts[0]
            t_tm, _ = best_of(lambda: wire_fields(payload, info, rows=rows), args.repeat)  # noqa: B023
            total = t_detok + t_ipc + t_tm
            print(
                f"| {n // 1024}k | {name} | {t_detok:.1f} | {t_ipc:.1f} | {t_tm:.1f} | {total:.1f} | "
                f"{len(payload) / 1e6:.1f} |"
            )
        setattr(DetokenizerManager, DETOK_METHOD, sglang_own)


if __name__ == "__main__":
    main()
