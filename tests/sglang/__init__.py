"""Tests that drive SGLang's real code (run per version by scripts/test_sglang.sh)."""
