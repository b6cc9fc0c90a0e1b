# The two commands of the README: `make demo` and `make test`. Each sets up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml setup.py themis_compile/planner/_cplan.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned to the CPU build this machine carries; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0" -e ".[triton,dev,hf]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m demo

# Two workers, each taking whole test files (module fixtures computed once): single-process tests on one
# core while a multi-rank test or a waiting deadline test holds the other.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

bench: $(STAMP)
	$(PY) -m themis_compile.bench all

clean:
	rm -rf $(VENV) runs .pytest_cache
