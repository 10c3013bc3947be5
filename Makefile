# One command each: `make demo` (set up + main job), `make test` (set up + every test).
PY := .venv/bin/python

.PHONY: setup demo test test-core test-sglang bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m rr_server.demo

test-core: setup
	$(PY) -m pytest -q tests

test-sglang: setup
	bash scripts/test_sglang.sh

test: test-core test-sglang

bench: setup
	$(PY) benchmarks/codec.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/sidecar.py

clean:
	rm -rf .venv .venvs .cache
