"""vLLM 0.31-0.33's real API server with a stand-in executor (needs .venvs/vllm-0.3x: test_vllm_standin.sh)."""
