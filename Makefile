# hpcdl: `make demo` trains on 2 ranks; `make test` runs the suite. Both set themselves up.
VENV      ?= .venv
PYTHON    ?= python3
PY        := $(VENV)/bin/python
PIP       := $(PY) -m pip --disable-pip-version-check -q
MPIEXEC   ?= $(VENV)/bin/mpiexec
# one BLAS thread per rank: on a small machine, ranks must not fight for the cores
export OPENBLAS_NUM_THREADS ?= 1
export OMP_NUM_THREADS ?= 1

SOURCES := setup.py pyproject.toml $(wildcard ext/*.pyx ext/*.pxd ext/*.h)

.PHONY: demo test test-slow test-serial test-mpi lint docs bench reproduce install clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel

# editable install with the MPI library from the registry (mpiexec lands in the venv)
$(VENV)/.installed: $(VENV)/bin/activate $(SOURCES)
	$(PIP) install -e '.[mpich,plot]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -e '.[mpich,plot,test,dev]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	@run=runs/demo-$$(date +%Y%m%d-%H%M%S).h5; \
	echo "+ $(MPIEXEC) -n 2 $(PY) -m hpcdl.train --config digits-mlp --out $$run"; \
	$(MPIEXEC) -n 2 $(PY) -m hpcdl.train --config digits-mlp --out $$run && \
	$(PY) -m hpcdl.report $$run

test: test-serial test-mpi

# the serial tests on every core (pytest-xdist; each test still one process, no MPI; a file's
# tests in one worker: the real-Slurm tests share one cluster per file)
test-serial: $(VENV)/.installed-test
	$(PY) -m pytest -q -n auto --dist loadfile -m "not mpi and not slow" tests

test-mpi: $(VENV)/.installed-test
	MPIEXEC=$(MPIEXEC) PYTHON=$(PY) bash tests/run_mpi.sh 2 -m "mpi and not slow" tests
	MPIEXEC=$(MPIEXEC) PYTHON=$(PY) bash tests/run_mpi.sh 3 -m "mpi and not slow" tests

test-slow: $(VENV)/.installed-test
	$(PY) -m pytest -q -s -m "slow and not mpi" tests
	MPIEXEC=$(MPIEXEC) PYTHON=$(PY) bash tests/run_mpi.sh 2 -s -m "slow and mpi" tests
	MPIEXEC=$(MPIEXEC) PYTHON=$(PY) bash tests/run_mpi.sh 4 -s -m "mpi" tests

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check hpcdl tests data setup.py docs/hooks.py
	$(VENV)/bin/lint-imports  # docs/design.md's layers: [tool.importlinter] in pyproject.toml

# the docs site (mkdocs.yml): --strict fails on a broken link, anchor, image or nav entry
docs: $(VENV)/.installed-test
	$(VENV)/bin/mkdocs build --strict --site-dir build/site

# every jobs/experiments/*/run.py at its small size, then one table of what still holds
# (build/reproduce/summary.md and .json); ARGS=--full for the READMEs' sizes
reproduce: $(VENV)/.installed
	$(PY) jobs/experiments/reproduce.py --work build/reproduce $(ARGS)

bench: $(VENV)/.installed
	$(PY) -m hpcdl.bench step --model mlp32 --batch 128

clean:
	rm -rf build *.egg-info hpcdl/_ext/*.so hpcdl/_ext/*.c ext/*.c
