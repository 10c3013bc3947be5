"""The demo (``python -m rr_server.demo``, ``make demo``): :mod:`.quickstart` serves a tiny MoE with patched vLLM
and checks its routing, :mod:`.agentic` runs multi-turn trajectories, :mod:`.tiny_moe` builds the model."""
