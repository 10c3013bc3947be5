# One command each: `make demo` (set up + main job), `make test` (set up + every test).
PY := .venv/bin/python

.PHONY: setup demo lint format test test-race test-releases test-core test-fast test-sglang \
	test-vllm-standin test-verl test-transformers-lowest docker test-docker docker-save docker-stop docs bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m rr_server.demo

# the quality gate: lint (pyflakes, pycodestyle, bugbear, pyupgrade), import order and format ([tool.ruff] in
# pyproject.toml); `make format` applies what it can
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# the vLLM tests that wait for a request to be running across a pause or a reload (a race with its decode: see
# CHANGELOG, issue 43); `make test` runs them first, alone, and test-core then skips them (CORE_SKIP)
RACE_TESTS := tests/vllm/test_provenance.py tests/vllm/test_doctor.py tests/vllm/test_doc_recipes.py
CORE_SKIP ?=

test-core: setup
	$(PY) -m pytest -q --durations=25 $(addprefix --ignore=,$(CORE_SKIP)) tests

test-race: setup
	$(PY) -m pytest -q $(RACE_TESTS)

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

# the low end of the declared transformers range (5.10.4, verl's env): the replay tests of tests/trainer; test-core
# is the high end (5.24.0)
test-transformers-lowest: setup
	bash scripts/test_transformers_lowest.sh

# rr's CPU images from nothing, no registry (docker/build_cpu.sh): a Docker engine (Debian's docker.io, started if
# none answers; root), a Debian base image, rr-vllm:cpu and rr-sglang:cpu. Cached: a second build takes seconds.
docker: setup
	bash docker/build_cpu.sh

# the images run for real (tests/docker): rr-vllm:cpu serves the tiny MoE from a container (rows equal
# transformers, the doctor from the host, --api-key, non-root, docker stop); rr-sglang:cpu's patch and launcher.
# Not in `make test`: it needs root (Debian's docker.io) and adds 8-11 min cold to a CI run of 37-80 of its 90
# (docs/docker.md); run at each release check.
test-docker: docker
	RR_TEST_DOCKER=1 $(PY) -m pytest -q -p no:cacheprovider tests/docker

# each CPU image as a `docker save | gzip` archive in build/docker-images/ (docker load on another host)
docker-save: docker
	bash docker/save.sh

# stop the dockerd that `make docker` started
docker-stop:
	bash docker/stop_daemon.sh

# test-core beside the release stages (each in its own .venvs/, one after another): the two chains overlap on the
# machine's cores (core's single-threaded tests and server waits leave one idle); each chain's output is printed
# whole when it ends. A server start may then take longer than on an idle machine (RR_TEST_STARTUP_TIMEOUT).
test: setup lint
	RR_TEST_STARTUP_TIMEOUT=$${RR_TEST_STARTUP_TIMEOUT:-900} $(MAKE) --no-print-directory test-race
	RR_TEST_STARTUP_TIMEOUT=$${RR_TEST_STARTUP_TIMEOUT:-900} $(MAKE) --no-print-directory -j2 -Orecurse \
		test-core test-releases CORE_SKIP="$(RACE_TESTS)"

test-releases: setup
	$(MAKE) --no-print-directory -j1 test-sglang test-vllm-standin test-verl test-transformers-lowest

# the Python API reference (pdoc) of rr_client's public modules -> build/api/index.html; any warning fails it.
# Left out: rr_client.integrations.trl (importing TRL raises torch's own DeprecationWarnings) and
# rr_client.integrations.verl (verl lives in .venvs/verl); both are described in docs/trainer.md.
# tests/unit/test_api_docs.py builds the same list.
API_MODULES := rr_client rr_client.core rr_client.core.codec rr_client.core.errors rr_client.core.info \
	rr_client.core.reference rr_client.core.settings rr_client.core.versions rr_client.core.agreement \
	rr_client.core.hf_config rr_client.client rr_client.client.http_errors rr_client.client.trajectory \
	rr_client.trainer rr_client.trainer.layouts rr_client.trainer.metrics rr_client.trainer.session \
	rr_client.trainer.replay rr_client.integrations.weight_sync

docs: setup
	rm -rf build/api
	$(PY) -W error -m pdoc -o build/api $(API_MODULES)
	@echo "API reference: build/api/index.html"

bench: setup
	$(PY) benchmarks/codec.py
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/sidecar.py
	$(PY) benchmarks/scale_out.py
	$(PY) benchmarks/r3_effect.py

clean:
	rm -rf .venv .venvs .cache
