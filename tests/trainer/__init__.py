"""The trainer layer on CPU torch, no server: layouts, replay and record on tiny models, the audit, the session."""
