/* run.c's JSON reader and string writer on stdin, for tests/test_json.py
   to compare with Python's json module.
     json_driver             parse stdin: stdout gets the canonical text of
                             the value (tests/json_canon.h), exit 0; or
                             stderr gets the one-line error, exit 1
     json_driver --string    stdin's bytes as one JSON string (json_put_string)
     json_driver --frames [--string]
                             many inputs in one run: stdin holds frames
                             "LENGTH\n" + LENGTH bytes; for each, stdout gets
                             "0 LENGTH\n" + the output, or "1 LENGTH\n" + the
                             error, then "\n"
   Includes run.c whole so the static functions are reachable. */
#define main run_main
#include "../run.c"
#undef main
#include "json_canon.h"

/* One input's result into out; 0 when it parsed (or was written). */
static int one_input(const char *in, size_t len, int string_mode, Buf *out)
{
    if (string_mode) { json_put_string(out, in, len); return 0; }
    Json v;
    char err[ERR_BYTES];
    if (json_parse(in, len, &v, err, sizeof err) != 0) { buf_put(out, err, strlen(err)); return 1; }
    json_put_value(out, &v);
    json_free(&v);
    return 0;
}

static void frames(const char *in, size_t len, int string_mode)
{
    for (size_t at = 0; at < len;) {
        char *end;
        unsigned long long n = strtoull(in + at, &end, 10);
        if (end == in + at || *end != '\n' || n > len - (size_t)(end + 1 - in)) die(EXIT_USAGE, "bad frame at byte %zu", at);
        Buf out = {0};
        int rc = one_input(end + 1, (size_t)n, string_mode, &out);
        printf("%d %zu\n", rc, out.len);
        fwrite(out.p, 1, out.len, stdout);
        putchar('\n');
        free(out.p);
        at = (size_t)(end + 1 - in) + n;
    }
}

int main(int argc, char **argv)
{
    int string_mode = 0, framed = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--string")) string_mode = 1;
        else if (!strcmp(argv[i], "--frames")) framed = 1;
        else die(EXIT_USAGE, "usage: json_driver [--frames] [--string] < INPUT");
    }
    size_t len;
    char *in = read_stream(stdin, "stdin", 0, SIZE_MAX - 1, "", &len);
    int rc = 0;
    if (framed) frames(in, len, string_mode);
    else {
        Buf out = {0};
        rc = one_input(in, len, string_mode, &out);
        fwrite(out.p, 1, out.len, rc ? stderr : stdout);
        if (rc) fputc('\n', stderr);
        free(out.p);
    }
    free(in);
    close_stdout();
    return rc;
}
