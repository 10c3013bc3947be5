"""Megatron-core (megatron.core 0.16.1) on this CPU: the harness, one-process and two-rank replay tests."""
