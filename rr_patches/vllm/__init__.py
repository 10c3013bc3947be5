"""rr's vLLM plugin: ``/generate``, ``/rr/info`` and rr's fields on the OpenAI endpoints, through vLLM's plugin hooks."""
