# pdflash make targets. `make test` is the README's test command and what .ci/run calls.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
CC ?= cc
SAN_FLAGS = -std=c11 -O1 -g -fno-omit-frame-pointer -pthread -Wall -Wextra -Wno-unused-parameter
STRESS_SRC = native/stress/stress.c native/pf_sched.c
CPU_STRESS_SRC = native/stress/cpu_stress.c native/pf_cpu.c native/pf_layer.c native/pf_relay.c native/pf_sched.c
DRAFT_STRESS_SRC = native/stress/draft_stress.c native/pf_draft.c native/pf_cpu.c

.PHONY: install native test test-fast stress stress-asan stress-tsan cpu-stress-asan cpu-stress-tsan draft-stress-asan draft-stress-tsan amx-check-asan amx-check-hw bench demo gpu-check clean

# Install pdflash (editable) with its test extras. PyTorch is taken as already
# installed when importable, so a CPU or CUDA build you chose stays in place.
# The build tools go in first and the build runs without isolation (it then works
# offline too); setup.py refuses to build without cffi, and the last line proves
# the C library imports, so an install can never silently skip the native build.
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch
	$(PIP) install -q "setuptools>=77" wheel "cffi>=1.16"
	$(PIP) install -q --no-build-isolation -e ".[test]"
	@$(PYTHON) -c "import pdflash.native._pf_sched" || { echo "error: pdflash installed but its native scheduler does not import; see the build output above" >&2; exit 1; }

native:
	$(PYTHON) -m pdflash.cli.main build-native

test: install stress
	$(PYTHON) -m pytest -q tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 1; fi; exit $$rc

test-fast:
	$(PYTHON) -m pytest -q -x tests

# C stress tests of the scheduler, the CPU expert kernel and the draft pass under
# AddressSanitizer + UBSan and ThreadSanitizer; the AMX kernel's layout with software tiles.
stress: stress-asan stress-tsan cpu-stress-asan cpu-stress-tsan draft-stress-asan draft-stress-tsan amx-check-asan

native/stress/stress_asan: $(STRESS_SRC) native/pf_sched.h
	$(CC) $(SAN_FLAGS) -fsanitize=address,undefined -fno-sanitize-recover=undefined -Inative -o $@ $(STRESS_SRC) -ldl

native/stress/stress_tsan: $(STRESS_SRC) native/pf_sched.h
	$(CC) $(SAN_FLAGS) -fsanitize=thread -Inative -o $@ $(STRESS_SRC) -ldl

# A stand-in CUDA runtime in host memory, so the stress test drives the cuda backend (and its
# paced link) without a GPU; built with the same sanitizer as the test that loads it.
native/stress/stress_asan_cudart.so: native/stress/fake_cudart.c
	$(CC) $(SAN_FLAGS) -fsanitize=address,undefined -fno-sanitize-recover=undefined -shared -fPIC -o $@ $<

native/stress/stress_tsan_cudart.so: native/stress/fake_cudart.c
	$(CC) $(SAN_FLAGS) -fsanitize=thread -shared -fPIC -o $@ $<

stress-asan: native/stress/stress_asan native/stress/stress_asan_cudart.so
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ./native/stress/stress_asan --fake-cudart ./native/stress/stress_asan_cudart.so

stress-tsan: native/stress/stress_tsan native/stress/stress_tsan_cudart.so
	TSAN_OPTIONS=halt_on_error=1 setarch $$(uname -m) -R ./native/stress/stress_tsan --fake-cudart ./native/stress/stress_tsan_cudart.so

native/stress/cpu_stress_asan: $(CPU_STRESS_SRC) native/pf_cpu.h native/pf_layer.h native/pf_relay.h native/pf_sched.h native/pf_simd.h native/stress/check.h
	$(CC) $(SAN_FLAGS) -fsanitize=address,undefined -fno-sanitize-recover=undefined -Inative -o $@ $(CPU_STRESS_SRC) -lm -ldl

native/stress/cpu_stress_tsan: $(CPU_STRESS_SRC) native/pf_cpu.h native/pf_layer.h native/pf_relay.h native/pf_sched.h native/pf_simd.h native/stress/check.h
	$(CC) $(SAN_FLAGS) -fsanitize=thread -Inative -o $@ $(CPU_STRESS_SRC) -lm -ldl

cpu-stress-asan: native/stress/cpu_stress_asan
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ./native/stress/cpu_stress_asan

cpu-stress-tsan: native/stress/cpu_stress_tsan
	TSAN_OPTIONS=halt_on_error=1 setarch $$(uname -m) -R ./native/stress/cpu_stress_tsan

native/stress/draft_stress_asan: $(DRAFT_STRESS_SRC) native/pf_draft.h native/pf_cpu.h native/pf_simd.h native/stress/check.h
	$(CC) $(SAN_FLAGS) -fsanitize=address,undefined -fno-sanitize-recover=undefined -Inative -o $@ $(DRAFT_STRESS_SRC) -lm

native/stress/draft_stress_tsan: $(DRAFT_STRESS_SRC) native/pf_draft.h native/pf_cpu.h native/pf_simd.h native/stress/check.h
	$(CC) $(SAN_FLAGS) -fsanitize=thread -Inative -o $@ $(DRAFT_STRESS_SRC) -lm

draft-stress-asan: native/stress/draft_stress_asan
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ./native/stress/draft_stress_asan

draft-stress-tsan: native/stress/draft_stress_tsan
	TSAN_OPTIONS=halt_on_error=1 setarch $$(uname -m) -R ./native/stress/draft_stress_tsan

native/stress/amx_check_asan: native/stress/amx_check.c native/pf_cpu.c native/pf_cpu.h native/pf_simd.h
	$(CC) $(SAN_FLAGS) -fsanitize=address,undefined -fno-sanitize-recover=undefined -Inative -o $@ native/stress/amx_check.c -lm

amx-check-asan: native/stress/amx_check_asan
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ./native/stress/amx_check_asan

# the same checks on the real tile instructions (a CPU with AMX; elsewhere one skip)
native/stress/amx_check_hw: native/stress/amx_check.c native/pf_cpu.c native/pf_cpu.h native/pf_simd.h
	$(CC) -std=c11 -O2 -g -pthread -DPF_AMX_HARDWARE -Inative -o $@ native/stress/amx_check.c -lm

amx-check-hw: native/stress/amx_check_hw
	./native/stress/amx_check_hw

bench: install
	$(PYTHON) benchmarks/bench_scheduler.py

# The main job on the embedded model pair (CPU is enough): speculative decoding with a
# half-size expert cache behind a simulated 2 GB/s link, with the live band table.
demo: install
	$(PYTHON) -m pdflash.cli.main generate "def fibonacci(n):" --max-new-tokens 64 --expert-cache-experts 64 --link-gbps 2

# On a CUDA machine with pdflash installed: GPU-marked tests, 20 smoke runs with the cuda
# backend, a short generate on a gpt-oss-20b-shaped checkpoint (tools/gpu_check.sh).
gpu-check:
	PYTHON=$(PYTHON) bash tools/gpu_check.sh

clean:
	rm -f native/_pf_sched*.so native/stress/stress_asan native/stress/stress_tsan native/stress/cpu_stress_asan native/stress/cpu_stress_tsan
	rm -f native/stress/draft_stress_asan native/stress/draft_stress_tsan native/stress/amx_check_asan native/stress/amx_check_hw
	rm -f native/stress/stress_asan_cudart.so native/stress/stress_tsan_cudart.so
	rm -rf build *.egg-info
