"""Scale-out: the client over replicas and routers (loopback test servers; vLLM CPU replicas, vllm/sglang-router)."""
