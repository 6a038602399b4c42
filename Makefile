# The two commands of the README:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.labkit-installed
PORT   ?=

.PHONY: setup demo test check lint lab student clean clean-all FORCE

# Before any target: refuse a Python older than 3.11 in one clear line, and note whether an existing .venv was
# made by another Python (or is broken), so that setup rebuilds it instead of reusing it. Cleaning needs neither.
VERSION_OF = $(shell $(1) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
ifneq ($(filter-out clean clean-all,$(or $(MAKECMDGOALS),setup)),)
PY_VERSION := $(call VERSION_OF,$(PYTHON))
ifeq ($(shell echo "$(PY_VERSION)" | awk -F. '$$1 > 3 || ($$1 == 3 && $$2 >= 11) { print "ok" }'),)
$(error labkit needs Python 3.11 or newer, but PYTHON=$(PYTHON) is $(or $(PY_VERSION),not a working Python): install one, then run e.g. make PYTHON=python3.11 (or newer))
endif
ifneq ($(wildcard $(VENV)),)
VENV_VERSION := $(call VERSION_OF,$(BIN)/python)
ifneq ($(VENV_VERSION),$(PY_VERSION))
VENV_STALE := yes
endif
endif
endif

$(STAMP): pyproject.toml $(if $(VENV_STALE),FORCE)
ifdef VENV_STALE
	@echo "$(VENV) was made by $(if $(VENV_VERSION),Python $(VENV_VERSION),a Python that no longer runs); rebuilding it with $(PYTHON) ($(PY_VERSION))"
	rm -rf $(VENV)
endif
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[course,dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (labkit)" >/dev/null
	@touch $(STAMP)

FORCE:

setup: $(STAMP)  ## create .venv (Python 3.11+) and install labkit with its dev tools

demo: setup  ## the main job: the ResNet-18 optimization ladder on whatever device exists
	$(BIN)/labkit doctor
	$(BIN)/labkit ladder --out runs/ladder

lint: setup
	$(BIN)/ruff check labkit tests autograder benchmarks assignments notebooks

test: setup lint  ## everything CI runs
	$(BIN)/python -m pytest -q

# The fast tier, before each commit: the tests in tests/slow_tests.txt (notebook runs, whole-class grading, the
# sandboxed hostile class, ...) are left to `make test`.
check: setup lint  ## lint plus every module's fast tests: a few minutes
	$(BIN)/python -m pytest -q -m "not slow"

# The venv's kernels win over a user-level "python3" kernel, so notebooks run on the venv's python
# ("Python 3 (labkit)"); root (a container) needs --allow-root. PORT=8899 picks the port (default: Jupyter's).
lab: setup  ## open the course in JupyterLab with the labkit kernel
	JUPYTER_PREFER_ENV_PATH=1 $(BIN)/jupyter lab $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(if $(PORT),--port=$(PORT) )notebooks/

# The student release: dist/student/ and dist/labkit-student-<version>.tar.gz (assignments/README.md, "Running a
# course"). OUT=folder builds elsewhere; ROSTER=roster.csv also writes dist/lab3_handouts/<id>/slow_train.py.
student: setup  ## build the student release (no solutions, hidden tests or references in it)
	$(BIN)/python -m autograder.release --out $(or $(OUT),dist)$(if $(ROSTER), --roster $(ROSTER))

clean:  ## remove results and caches
	rm -rf runs .pytest_cache .ruff_cache

clean-all: clean  ## also remove .venv (the next make builds it again)
	rm -rf $(VENV) *.egg-info
