"""Real vLLM CPU servers (marked vllm_server): rr plugin end to end, the sidecar in front of vLLM, upstream kill."""
