"""rr's engine adapters: the vLLM plugin (``rr_patches.vllm``) and the SGLang patch (``rr_patches.sglang``)."""
