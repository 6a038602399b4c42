# The two commands of the README:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.labkit-installed

.PHONY: setup demo test lint lab clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (labkit)" >/dev/null
	@touch $(STAMP)

setup: $(STAMP)  ## create .venv and install labkit with its dev tools

demo: setup  ## the main job: the ResNet-18 optimization ladder on whatever device exists
	$(BIN)/labkit doctor
	$(BIN)/labkit ladder --out runs/ladder

lint: setup
	$(BIN)/ruff check labkit tests autograder benchmarks assignments notebooks

test: setup lint  ## everything CI runs
	$(BIN)/python -m pytest -q

# The venv's kernels win over a user-level "python3" kernel, so notebooks run on the venv's python
# ("Python 3 (labkit)"); root (a container) needs --allow-root.
lab: setup  ## open the course in JupyterLab with the labkit kernel
	JUPYTER_PREFER_ENV_PATH=1 $(BIN)/jupyter lab $$([ "$$(id -u)" = 0 ] && echo --allow-root) notebooks/

clean:
	rm -rf runs .pytest_cache .ruff_cache
