# The README's two commands:
#   make train   installs what is missing, builds, trains on the embedded default
#   make test    installs what is missing, builds, runs the whole test suite
# Everything else here is a convenience around Meson.

PACKAGES := g++ meson ninja-build pkg-config cmake catch2 libfmt-dev libopenblas-dev \
            libopenblas-openmp-dev libdnnl-dev libtomlplusplus-dev nlohmann-json3-dev libcli11-dev \
            libopenmpi-dev openmpi-bin fortunes gnuplot-nox python3
# The suite's libFuzzer test compiles with clang (skipped without it).
FUZZ_PACKAGES := clang libclang-rt-14-dev
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
BUILD ?= build
RANKS ?= 4
ROOT_FLAG := $(shell [ "$$(id -u)" = 0 ] && echo --allow-run-as-root)
MESON_FLAGS ?= --buildtype=release

.PHONY: train train-build test deps build install bench clean tsan asan fuzz cudnn-frontend

# Installs the Debian packages that are not installed yet (nothing when all are).
deps:
	@missing=""; for p in $(PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing; \
	fi

$(BUILD)/build.ninja:
	meson setup $(BUILD) $(MESON_FLAGS)

build: deps $(BUILD)/build.ninja
	meson compile -C $(BUILD)

# Only what the run needs: the library and tessera-train (ninja's [n/N] lines
# are the progress). The tests, benchmarks and other tools wait for make test.
train-build: deps $(BUILD)/build.ninja
	@echo "building the library and tessera-train: about 4 minutes the first time on 2 cores" \
	  "(make test builds the rest)"
	meson compile -C $(BUILD) tessera-train

# FSDP over $(RANKS) ranks (more ranks than cores is fine: --oversubscribe);
# the progress bar when make's output is a terminal.
train: train-build
	@progress=$$([ -t 1 ] && echo on || echo off); \
	echo "mpirun -np $(RANKS) $(BUILD)/tools/tessera-train"; \
	mpirun -np $(RANKS) --oversubscribe --bind-to none $(ROOT_FLAG) \
	  $(BUILD)/tools/tessera-train --metrics.progress $$progress

test: PACKAGES += $(FUZZ_PACKAGES)
test: build
	meson test -C $(BUILD) --print-errorlogs --num-processes 1

# The runtime, dist, FSDP and pipeline tests (1-3 ranks, the async_cpu device included)
# under ThreadSanitizer, in build-tsan/. Uninstrumented libraries (OpenMP, MPI,
# OpenBLAS) are suppressed in tests/tsan.supp. TSan cannot see libgomp's
# barriers, so in this build parallel_for runs on std::threads (runtime/parallel.h)
# and OMP_NUM_THREADS=1 keeps the libraries' own OpenMP teams out; tsan-canary
# checks that a deliberate race is reported. TSAN_TESTS picks other tests.
TSAN_TESTS ?= tsan-canary runtime autograd dist-plain dist-np2 dtensor-np2 fsdp-plain fsdp-np2 fsdp-np3 pp-np2
tsan: deps
	@[ -f build-tsan/build.ninja ] || meson setup build-tsan --buildtype=debugoptimized \
	  -Db_sanitize=thread -Dbenchmarks=false -Dnative=false -Dcuda=disabled
	meson compile -C build-tsan
	OMP_NUM_THREADS=1 TSAN_OPTIONS="suppressions=$(CURDIR)/tests/tsan.supp halt_on_error=1 exitcode=66 allocator_may_return_null=1" \
	  meson test -C build-tsan --print-errorlogs --num-processes 1 --timeout-multiplier 4 $(TSAN_TESTS)

# The whole suite built with AddressSanitizer + UndefinedBehaviorSanitizer, in
# build-asan/. Leak checking is off for the suite (Open MPI and OpenBLAS keep
# their buffers to exit); the readers of untrusted files are leak-checked by
# `make fuzz` and the fuzz-libfuzzer test.
asan: deps
	@[ -f build-asan/build.ninja ] || meson setup build-asan --buildtype=debugoptimized \
	  -Db_sanitize=address,undefined -Db_lundef=false -Dbenchmarks=false -Dnative=false -Dcuda=disabled
	meson compile -C build-asan
	ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1" \
	UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1" \
	  meson test -C build-asan --print-errorlogs --num-processes 1 --timeout-multiplier 4 $(ASAN_TESTS)

# Coverage-guided fuzzing of every reader (token shards, checkpoint metadata and
# data files, safetensors, TOML) with libFuzzer, FUZZ_SECONDS per reader; the
# inputs that add coverage are merged into tests/fuzz/corpus/. (The suite runs
# the same for 20 s per reader, without merging.)
FUZZ_SECONDS ?= 300
fuzz: PACKAGES += $(FUZZ_PACKAGES)
fuzz: build
	tests/fuzz/libfuzzer.sh $(BUILD) $(FUZZ_SECONDS) merge

bench: build
	$(BUILD)/benchmarks/bench_step

install: build
	meson install -C $(BUILD)

clean:
	rm -rf $(BUILD)

# cuDNN's frontend headers (header-only, MIT), for attention on cuDNN's fused
# kernels: taken from PyPI's nvidia-cudnn-frontend wheel into
# third_party/cudnn-frontend/ (not in git); the next build compiles
# runtime/cuda/cudnn_attention.cpp against them (docs/gpu.md). Needs the network.
cudnn-frontend:
	rm -rf third_party/.wheel && mkdir -p third_party/.wheel
	python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
	  --platform manylinux_2_28_x86_64 nvidia-cudnn-frontend -d third_party/.wheel
	python3 -c 'import glob, shutil, zipfile; \
	  shutil.rmtree("third_party/cudnn-frontend", ignore_errors=True); \
	  z = zipfile.ZipFile(glob.glob("third_party/.wheel/*.whl")[0]); \
	  [z.extract(n, "third_party/cudnn-frontend") for n in z.namelist() if n.startswith("include/")]'
	rm -rf third_party/.wheel
	@echo "third_party/cudnn-frontend/include: $$(ls third_party/cudnn-frontend/include | wc -l) entries;" \
	  "reconfigure: meson setup --reconfigure $(BUILD)"
