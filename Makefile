# One command each: `make demo` (set up + main job), `make test` (set up + every test).
PY := .venv/bin/python

.PHONY: setup demo test test-core test-fast test-sglang test-vllm-standin test-verl bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m rr_server.demo

test-core: setup
	$(PY) -m pytest -q tests

# no vLLM server, no SGLang: tests/unit (no server) and tests/http (loopback against test-only servers and fakes)
test-fast: setup
	$(PY) -m pytest -q tests/unit tests/http

test-sglang: setup
	bash scripts/test_sglang.sh

# vLLM 0.31, 0.32 and 0.33 real code with a stand-in GPU model runner, in .venvs/vllm-0.31, -0.32, -0.33
# (scripts/setup_vllm_standin.sh): version gate, launcher, endpoint plugin, tests/vllm_standin
test-vllm-standin: setup
	bash scripts/test_vllm_standin.sh

# verl 0.9.1 (its own .venvs/verl, scripts/setup_verl.sh): R3 in verl's FSDP actor, verl's SGLang read
test-verl: setup
	bash scripts/test_verl.sh

test: test-core test-sglang test-vllm-standin test-verl

bench: setup
	$(PY) benchmarks/codec.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/sidecar.py
	$(PY) benchmarks/scale_out.py
	$(PY) benchmarks/r3_effect.py

clean:
	rm -rf .venv .venvs .cache
