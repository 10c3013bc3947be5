"""Unit tests: no server (codec, hf_config, protocol parsing, launcher flags, plugin gating, layering, README example)."""
