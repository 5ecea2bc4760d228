/* One libFuzzer binary for the two targets that include run.c whole: the loader
   (tests/fuzz/fuzz_loader.c) and the JSON reader (tests/fuzz/fuzz_json.c).

   Compiling run.c with -fsanitize=fuzzer,address,undefined takes clang about two minutes
   of CPU at -O1 (25 s at -O0, which run_fuzz.py uses: see its OPT); one binary holding both
   targets pays that once instead of twice. The name it is
   run by picks the target: run_fuzz.py links bin/fuzz_loader and bin/fuzz_json to it, so
   `bin/fuzz_json crash-input` replays a JSON input as the separate binary did. Each target's
   own source still builds alone (the Build: line at its top).

   Both targets see run.c as they did alone: the loader's exit() is redirected only around
   run.c (the JSON code never calls it), and JSON_MEM_BASE is lowered for both, which only
   the JSON reader reads.
   Build: clang -g -O0 -fsanitize=fuzzer,address,undefined -I. tests/fuzz/fuzz_engine.c tokenizer.c -lm */
#define JSON_MEM_BASE 512 /* as tests/fuzz/fuzz_json.c sets it: the reader's bound within reach of short inputs */

#define LLVMFuzzerInitialize fuzz_loader_init
#define LLVMFuzzerTestOneInput fuzz_loader_one
#include "fuzz_loader.c"
#undef LLVMFuzzerTestOneInput
#undef LLVMFuzzerInitialize

#define FUZZ_RUN_C_INCLUDED
#define LLVMFuzzerTestOneInput fuzz_json_one
#include "fuzz_json.c"
#undef LLVMFuzzerTestOneInput

#include <libgen.h>

static int (*fuzz_one)(const uint8_t *data, size_t size);

/* The target named by the program's name: fuzz_loader or fuzz_json (any directory). */
int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    char name[PATH_MAX];
    snprintf(name, sizeof name, "%s", (*argv)[0]);
    const char *base = basename(name);
    if (!strcmp(base, "fuzz_loader")) {
        fuzz_one = fuzz_loader_one;
        return fuzz_loader_init(argc, argv);
    }
    if (!strcmp(base, "fuzz_json")) {
        fuzz_one = fuzz_json_one;
        return 0;
    }
    fprintf(stderr, "fuzz_engine: run it as fuzz_loader or fuzz_json (a link to it), not as %s\n", base);
    exit(2);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    return fuzz_one(data, size);
}
