"""Test-only fix of vLLM 0.30's CPU wiring for speculative decoding, loaded in every vLLM process through
PYTHONPATH (tests/vllm/conftest.py names it for the n-gram server).

vLLM's CPU model runner swaps its Triton kernels for its own C++ CPU kernels (``vllm.utils.cpu_triton_utils``).
For the spec-decode helpers it re-points each JIT-warm-up dispatcher's ``.kernel``; for the rejection sampler
it only rebinds the module's kernel names, which the dispatchers (``_rejection_greedy_sample`` & co.) no longer
read. Stock vLLM 0.30 CPU therefore dies on the first verified draft ("Cannot inspect kernel parameters"). This
module re-points the greedy dispatcher to vLLM's CPU kernel right after the module is imported: every kernel
that runs is vLLM's own. Only greedy: the sampled-verification CPU kernels do not match their dispatchers'
argument names in 0.30 (``_expand_kernel_impl() missing ... 'input_val'``), so re-pointing them would only
move the crash.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

TARGET = "vllm.v1.sample.rejection_sampler"
# dispatcher in the rejection sampler -> vLLM's CPU kernel of the same job
DISPATCHERS = {"_rejection_greedy_sample": "rejection_greedy_sample_kernel"}


def repoint(module: ModuleType) -> None:
    """Point each dispatcher at vLLM's CPU kernel, unless Triton (with a CPU backend) can launch its own."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return
    import vllm.utils.cpu_triton_utils as cpu_tl

    for dispatcher, kernel in DISPATCHERS.items():
        getattr(module, dispatcher).kernel = getattr(cpu_tl, kernel)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`repoint` on the rejection sampler module right after it is imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module  # type: ignore[attr-defined]

        def exec_and_repoint(module: ModuleType) -> None:
            exec_module(module)
            repoint(module)

        spec.loader.exec_module = exec_and_repoint  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _AfterImport())
