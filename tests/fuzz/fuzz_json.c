/* libFuzzer target: run.c's JSON reader and string writer.

   Input: any bytes. json_parse must refuse them with a one-line "at byte N: reason" (N
   within the input) or accept them; an accepted value written canonically (no whitespace,
   tests/json_canon.h) must parse again to a value with the same canonical text. The input
   written as one JSON string (json_put_string) must parse back to a string: the input
   itself when it was valid UTF-8. Sanitizers catch reads past the input, leaks and deep
   recursion; JSON_MAX_DEPTH bounds the latter. The bound on the memory a parse takes
   (JSON_MEM_PER_BYTE per byte of text) is lowered to short inputs' reach: a canonical text
   shorter than its input may be refused for it, and only for it.

   run.c is included whole (its functions are static), like tests/fuzz/fuzz_loader.c does.
   Build: clang -g -O1 -fsanitize=fuzzer,address,undefined -I. tests/fuzz/fuzz_json.c tokenizer.c -lm */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>

#ifndef FUZZ_RUN_C_INCLUDED   /* tests/fuzz/fuzz_engine.c has included run.c already */
#ifndef RUN_C
#define RUN_C "../../run.c"   /* -DRUN_C='"path"' fuzzes a patched copy */
#endif
#define JSON_MEM_BASE 512 /* the reader's memory bound (16 bytes per byte of text, plus this) within reach of short inputs */
#define main run_main
#include RUN_C
#undef main
#endif
#include "../json_canon.h"

/* An error must be one line, "at byte N: ..." with N <= len. */
static void check_error(const char *err, size_t len)
{
    size_t at;
    int used = 0;
    if (sscanf(err, "at byte %zu: %n", &at, &used) != 1 || !used || at > len || !err[used]) abort();
    for (const char *p = err; *p; p++)
        if ((unsigned char)*p < 0x20) abort();
}

/* The canonical text of data[0..size) parsed, or -1 (out left empty). */
static int canonical(const char *data, size_t size, Buf *out)
{
    Json v;
    char err[ERR_BYTES];
    if (json_parse(data, size, &v, err, sizeof err) != 0) { check_error(err, size); return -1; }
    json_put_value(out, &v);
    json_free(&v);
    return 0;
}

static int valid_utf8(const char *s, size_t n)
{
    for (size_t i = 0, k; i < n; i += k)
        if (!(k = utf8_valid((const unsigned char *)s + i, n - i))) return 0;
    return 1;
}

/* The input as a JSON string reads back as a string: the input when it was UTF-8. */
static void check_string_writer(const char *data, size_t size)
{
    Buf w = {0};
    json_put_string(&w, data, size);
    Json v;
    if (json_parse(w.p, w.len, &v, NULL, 0) != 0 || v.kind != JSON_STRING || !valid_utf8(w.p, w.len)) abort();
    if (valid_utf8(data, size) && (v.len != size || memcmp(v.str, data, size))) abort();
    json_free(&v);
    free(w.p);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    Buf once = {0}, twice = {0};
    if (canonical((const char *)data, size, &once) == 0) {
        char err[ERR_BYTES] = "";
        Json v;
        if (json_parse(once.p, once.len, &v, err, sizeof err) != 0) { /* allowed only when the bound explains it */
            if (once.len >= size || !strstr(err, "bytes of memory per byte")) abort();
        } else {
            json_put_value(&twice, &v);
            json_free(&v);
            if (twice.len != once.len || memcmp(twice.p, once.p, once.len)) abort();
        }
    }
    free(once.p);
    free(twice.p);
    check_string_writer((const char *)data, size);
    return 0;
}
