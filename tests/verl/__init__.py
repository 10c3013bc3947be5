"""verl 0.9.1's real FSDP engine and trainer steps on CPU (needs .venvs/verl via scripts/test_verl.sh)."""
