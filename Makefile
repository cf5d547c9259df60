# Two commands on a fresh machine: `make demo` (the main job on the bundled model) and `make test`.
# Both create .venv first. Where python3 already has torch (a GPU box), the venv sees and keeps it;
# elsewhere torch==2.13.0 is installed before anything can ask for a CUDA build: the CPU wheel
# where pip's configuration finds it (this project's machines), else from TORCH_INDEX (PyTorch's
# CPU wheel index: make TORCH_INDEX=URL test), which pip's default index would not give on Linux.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV) && $(BIN)/pip install -q torch==2.13.0 \
			$(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); \
	fi
	$(BIN)/pip install -q -e ".[dev]"
	@touch $(STAMP)

.PHONY: install demo test bench lint
install: $(STAMP)

demo: $(STAMP)
	$(BIN)/agentflash run examples/structured.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/agentflash bench

lint: $(STAMP)
	$(BIN)/ruff check agentflash tests
