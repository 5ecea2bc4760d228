/* tok_driver - exercise tokenizer.c on a model file (export.py's manual ("The model file")) for the tests.

   cc -O2 -std=c11 -Wall -Wextra -I. tests/tok_driver.c tokenizer.c -o tok_driver

   tok_driver MODEL --info
   tok_driver MODEL --encode FILE [--special] [--add-special]
       FILE holds one string per line, hex-encoded (so any bytes fit); writes one line of
       space-separated ids per string.
   tok_driver MODEL --roundtrip-file FILE
       for each hex line x: check decode(encode(x)) == x; prints failures and a summary.
   tok_driver MODEL --roundtrip N SEED
       the same for N random byte strings (random bytes, UTF-8 of random code points incl.
       surrogates, whitespace runs, special-token look-alikes); exit 1 on any failure.
       --drop-bytes HEX names bytes the vocabulary cannot represent (expected to vanish).
   tok_driver MODEL --bench FILE [--seconds S] [--min-bytes N]
       MB/s (per CPU second) of tok_encode and tok_decode on the file's bytes (the file repeated until it has
       at least N bytes; each measured for >= S seconds).
   tok_driver MODEL --fuzz-section N SEED
       N truncated / corrupted copies of the tokenizer section through tok_create; accepted
       ones are used (encode, decode, pieces). For the sanitizer build.
   tok_driver MODEL --time FILE [--min-bytes N] [--drop-bytes HEX]
       CPU seconds for one tok_encode of the file, and whether it round-trips (for the
       "never quadratic" tests).
   --special / --add-special set TOK_PARSE_SPECIAL / TOK_ADD_SPECIAL for encoding.

   Exit status: 0 ok, 1 check failed, 2 usage / file error. */
#define _POSIX_C_SOURCE 199309L
#include "tokenizer.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define HEADER_SIZE 256
#define MAGIC "LLMF"
#define OFF_TOK_OFFSET 72
#define OFF_TOK_SIZE 80
#define SPM_SPACE "\xe2\x96\x81"

static void die(const char *msg, const char *arg) {
    fprintf(stderr, "tok_driver: %s%s%s\n", msg, arg ? ": " : "", arg ? arg : "");
    exit(2);
}

static uint64_t rd64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static size_t section_size;    /* of the section load() read */

/* Load the tokenizer section of a model file into a malloc'd (so aligned) buffer. */
static tok_tokenizer *load(const char *path, void **section) {
    FILE *f = fopen(path, "rb");
    if (!f) die("cannot open", path);
    unsigned char h[HEADER_SIZE];
    if (fread(h, 1, sizeof h, f) != sizeof h || memcmp(h, MAGIC, 4) != 0) die("not a model file", path);
    uint64_t off = rd64(h + OFF_TOK_OFFSET), size = rd64(h + OFF_TOK_SIZE);
    if (size == 0 || size > ((uint64_t)1 << 32) || off > ((uint64_t)1 << 62)) die("bad tokenizer section", path);
    *section = malloc((size_t)size);
    if (!*section) die("out of memory", NULL);
    if (fseek(f, (long)off, SEEK_SET) != 0 || fread(*section, 1, (size_t)size, f) != size) die("truncated file", path);
    fclose(f);
    section_size = (size_t)size;
    tok_tokenizer *t;
    char err[256];
    if (tok_create(&t, *section, (size_t)size, err, sizeof err) != 0) die(err, path);
    return t;
}

static unsigned char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) die("cannot open", path);
    size_t cap = 1 << 16, n = 0;
    unsigned char *buf = malloc(cap);
    for (;;) {
        if (!buf) die("out of memory", NULL);
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap) break;
        cap *= 2;
        buf = realloc(buf, cap);
    }
    fclose(f);
    *len = n;
    return buf;
}

static int hexval(int c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* Split a file of hex lines into decoded strings (in place); returns the count. */
static size_t parse_hex_lines(unsigned char *buf, size_t len, unsigned char ***strs, size_t **lens) {
    size_t count = 0, cap = 1024;
    *strs = malloc(cap * sizeof **strs);
    *lens = malloc(cap * sizeof **lens);
    for (size_t i = 0; i < len;) {
        size_t j = i;
        while (j < len && buf[j] != '\n') j++;
        if ((j - i) % 2) die("odd-length hex line", NULL);
        size_t out = i;
        for (size_t k = i; k < j; k += 2) {
            int a = hexval(buf[k]), b = hexval(buf[k + 1]);
            if (a < 0 || b < 0) die("bad hex line", NULL);
            buf[out++] = (unsigned char)(a << 4 | b);
        }
        if (count == cap) {
            cap *= 2;
            *strs = realloc(*strs, cap * sizeof **strs);
            *lens = realloc(*lens, cap * sizeof **lens);
        }
        if (!*strs || !*lens) die("out of memory", NULL);
        (*strs)[count] = buf + i;
        (*lens)[count] = out - i;
        count++;
        i = j + 1;
    }
    return count;
}

static void print_hex(FILE *f, const unsigned char *s, size_t n) {
    for (size_t i = 0; i < n; i++) fprintf(f, "%02x", s[i]);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);   /* CPU time: other load does not count */
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Bytes the vocabulary has no token for (--drop-bytes): the reference drops them. */
static unsigned char dropped[256];

/* decode(encode(x)) must give x, except that bytes listed with --drop-bytes are missing,
   and that for SentencePiece U+2581 and space are one character (the reference tokenizer
   identifies them: x's U+2581 comes back as a space, and an invalid UTF-8 byte right
   before a space can turn that space into the bytes of U+2581). */
static int roundtrip_equal(const tok_tokenizer *t, const unsigned char *x, size_t n, const unsigned char *y, size_t m) {
    int spm = tok_get_info(t)->kind == TOK_KIND_SPM;
    size_t i = 0, j = 0;
    for (;;) {
        while (i < n && dropped[x[i]]) i++;
        if (i == n || j == m) break;
        int xs = x[i] == ' ' || (spm && i + 3 <= n && memcmp(x + i, SPM_SPACE, 3) == 0);
        int ys = y[j] == ' ' || (spm && j + 3 <= m && memcmp(y + j, SPM_SPACE, 3) == 0);
        if (spm && xs && ys) {
            i += x[i] == ' ' ? 1 : 3;
            j += y[j] == ' ' ? 1 : 3;
            continue;
        }
        if (x[i] != y[j]) return 0;
        i++;
        j++;
    }
    return i == n && j == m;
}

static int roundtrip_one(const tok_tokenizer *t, const unsigned char *s, size_t n) {
    int *ids;
    size_t n_ids;
    char *dec;
    size_t dec_n;
    if (tok_encode(t, (const char *)s, n, 0, &ids, &n_ids) != 0) die("tok_encode failed", NULL);
    if (tok_decode(t, ids, n_ids, 0, &dec, &dec_n) != 0) die("tok_decode failed", NULL);
    int ok = roundtrip_equal(t, s, n, (const unsigned char *)dec, dec_n);
    if (!ok && getenv("TOK_DEBUG")) {
        fprintf(stderr, "in  ");
        print_hex(stderr, s, n);
        fprintf(stderr, "\nout ");
        print_hex(stderr, (const unsigned char *)dec, dec_n);
        fprintf(stderr, "\n");
    }
    free(ids);
    free(dec);
    return ok;
}

static uint64_t rng_state;
static uint64_t rng(void) {          /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Dull;
}

static size_t put_utf8(unsigned char *d, uint32_t cp) {
    if (cp < 0x80) { d[0] = (unsigned char)cp; return 1; }
    if (cp < 0x800) { d[0] = (unsigned char)(0xC0 | cp >> 6); d[1] = (unsigned char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        d[0] = (unsigned char)(0xE0 | cp >> 12); d[1] = (unsigned char)(0x80 | (cp >> 6 & 0x3F));
        d[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    d[0] = (unsigned char)(0xF0 | cp >> 18); d[1] = (unsigned char)(0x80 | (cp >> 12 & 0x3F));
    d[2] = (unsigned char)(0x80 | (cp >> 6 & 0x3F)); d[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

#define MAX_RANDOM_ATOMS 48
#define MAX_ATOM_BYTES 40

/* A random test string made of random atoms; returns its length. */
static size_t random_string(unsigned char *d) {
    static const char *const looks_special[] = {
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",
        "<s>", "</s>", "<unk>", "<0x41>", "<table>", "[multimodal]", "'s", "'LL", "\r\n", "\xe2\x96\x81",
    };
    size_t n = 0, atoms = (size_t)(rng() % MAX_RANDOM_ATOMS);
    for (size_t a = 0; a < atoms; a++) {
        uint64_t r = rng();
        size_t k = 1 + (r >> 8) % 12;
        switch (r % 8) {
        case 0:                                   /* any byte */
            d[n++] = (unsigned char)(r >> 8);
            break;
        case 1:                                   /* printable ASCII */
            d[n++] = (unsigned char)(0x20 + (r >> 8) % 0x5F);
            break;
        case 2:                                   /* any code point, surrogates included */
            n += put_utf8(d + n, (uint32_t)((r >> 8) % 0x110000));
            break;
        case 3:                                   /* the common scripts */
            n += put_utf8(d + n, (uint32_t)(0x80 + (r >> 8) % 0x3000));
            break;
        case 4:                                   /* a whitespace run */
            while (k--) d[n++] = (unsigned char)" \t\n\r\v\f"[(r >> 16) % 6];
            break;
        case 5: {                                 /* text that looks like a special token */
            const char *s = looks_special[(r >> 8) % (sizeof looks_special / sizeof *looks_special)];
            memcpy(d + n, s, strlen(s));
            n += strlen(s);
            break;
        }
        case 6:                                   /* digits */
            while (k--) d[n++] = (unsigned char)('0' + rng() % 10);
            break;
        default:                                  /* lowercase letters */
            while (k--) d[n++] = (unsigned char)('a' + rng() % 26);
            break;
        }
    }
    return n;
}

/* Exercise a tokenizer that tok_create accepted: nothing may crash or read out of bounds. */
static void exercise(const tok_tokenizer *t) {
    unsigned char buf[MAX_RANDOM_ATOMS * MAX_ATOM_BYTES];
    const tok_info *info = tok_get_info(t);
    for (int k = 0; k < 4; k++) {
        size_t n = random_string(buf);
        int *ids;
        size_t n_ids;
        if (tok_encode(t, (const char *)buf, n, k, &ids, &n_ids) != 0) die("tok_encode failed on a valid tokenizer", NULL);
        for (size_t i = 0; i < n_ids; i++)
            if (ids[i] < 0 || ids[i] >= info->n_vocab) die("tok_encode produced an id out of range", NULL);
        char *out;
        size_t out_n;
        if (tok_decode(t, ids, n_ids, k & 1 ? TOK_RENDER_SPECIAL : 0, &out, &out_n) != 0) die("tok_decode failed", NULL);
        free(out);
        free(ids);
    }
    for (int k = 0; k < 8; k++) {
        int id = (int)(rng() % ((uint64_t)info->n_vocab + 4)) - 2;
        size_t len;
        const char *p = tok_piece(t, id, &len);
        if (p && len) (void)*(volatile const char *)(p + len - 1);
        (void)tok_is_control(t, id);
        (void)tok_is_eog(t, id);
    }
    if (info->default_system_len) (void)*(volatile const char *)(info->default_system + info->default_system_len - 1);
}

/* Feed tok_create truncated and corrupted copies of the section (each in its own exactly
   sized allocation, so that a sanitizer sees any read past it). */
static int mode_fuzz_section(const void *section, size_t size, long count, unsigned long long seed) {
    static const uint32_t interesting[] = {0, 1, 2, 3, 4, 5, 6, 7, 63, 64, 65, 255, 256, 0x7FFF, 0xFFFF, 0x10000,
                                           0x7FFFFFFF, 0x80000000u, 0xFFFFFFFE, 0xFFFFFFFF};
    rng_state = seed ? seed : 1;
    long accepted = 0;
    for (long it = 0; it < count; it++) {
        size_t n = size;
        unsigned char *copy = malloc(size);
        if (!copy) die("out of memory", NULL);
        memcpy(copy, section, size);
        uint64_t r = rng();
        switch (r % 5) {
        case 0:                                   /* truncate, often right after the header */
            n = (r >> 8) % 2 ? (size_t)((r >> 9) % (size < 4096 ? size : 4096)) : (size_t)((r >> 9) % size);
            n &= ~(size_t)3;                      /* keep the 4-byte alignment the API asks for */
            break;
        case 1: {                                 /* a header field gets an extreme value */
            uint32_t v = (r >> 8) % 3 ? interesting[(r >> 16) % (sizeof interesting / sizeof *interesting)] : (uint32_t)(r >> 32);
            memcpy(copy + 4 * ((r >> 12) % 12), &v, 4);
            break;
        }
        case 2: {                                 /* a text offset or merge id gets an extreme value */
            size_t at = 64 + 4 * (size_t)((r >> 8) % ((size - 64) / 4));
            uint32_t v = interesting[(r >> 40) % (sizeof interesting / sizeof *interesting)];
            memcpy(copy + at, &v, 4);
            break;
        }
        default:                                  /* random bytes */
            for (int k = 0; k < 1 + (int)((r >> 8) % 16); k++) copy[rng() % size] = (unsigned char)rng();
            break;
        }
        unsigned char *exact = malloc(n ? n : 1);
        if (!exact) die("out of memory", NULL);
        memcpy(exact, copy, n);
        free(copy);
        tok_tokenizer *t;
        char err[256];
        if (tok_create(&t, exact, n, err, sizeof err) == 0) {
            accepted++;
            exercise(t);
            tok_free(t);
        } else if (!err[0]) {
            die("tok_create failed without a reason", NULL);
        }
        free(exact);
    }
    printf("fuzz-section: %ld variants, %ld accepted and exercised, the rest refused\n", count, accepted);
    return 0;
}

static int mode_roundtrip_random(const tok_tokenizer *t, long count, unsigned long long seed) {
    unsigned char buf[MAX_RANDOM_ATOMS * MAX_ATOM_BYTES];
    rng_state = seed ? seed : 1;
    long failures = 0;
    for (long i = 0; i < count; i++) {
        size_t n = random_string(buf);
        if (!roundtrip_one(t, buf, n)) {
            if (failures++ < 10) { fprintf(stdout, "FAIL "); print_hex(stdout, buf, n); fputc('\n', stdout); }
        }
    }
    printf("roundtrip: %ld strings, %ld failures\n", count, failures);
    return failures ? 1 : 0;
}

static int mode_roundtrip_file(const tok_tokenizer *t, const char *path) {
    size_t len, *lens;
    unsigned char *buf = read_file(path, &len), **strs;
    size_t count = parse_hex_lines(buf, len, &strs, &lens);
    long failures = 0;
    for (size_t i = 0; i < count; i++) {
        if (!roundtrip_one(t, strs[i], lens[i])) {
            failures++;
            printf("FAIL line %zu\n", i + 1);
        }
    }
    printf("roundtrip: %zu strings, %ld failures\n", count, failures);
    free(buf);
    free(strs);
    free(lens);
    return failures ? 1 : 0;
}

static int mode_encode(const tok_tokenizer *t, const char *path, int flags) {
    size_t len, *lens;
    unsigned char *buf = read_file(path, &len), **strs;
    size_t count = parse_hex_lines(buf, len, &strs, &lens);
    for (size_t i = 0; i < count; i++) {
        int *ids;
        size_t n;
        if (tok_encode(t, (const char *)strs[i], lens[i], flags, &ids, &n) != 0) die("tok_encode failed", NULL);
        for (size_t k = 0; k < n; k++) printf(k ? " %d" : "%d", ids[k]);
        putchar('\n');
        free(ids);
    }
    free(buf);
    free(strs);
    free(lens);
    return 0;
}

/* The file's bytes, repeated until there are at least min_bytes. */
static unsigned char *read_repeated(const char *path, size_t min_bytes, size_t *len) {
    size_t n;
    unsigned char *one = read_file(path, &n);
    if (!n || n >= min_bytes) { *len = n; return one; }
    size_t reps = (min_bytes + n - 1) / n;
    unsigned char *all = malloc(reps * n);
    if (!all) die("out of memory", NULL);
    for (size_t r = 0; r < reps; r++) memcpy(all + r * n, one, n);
    free(one);
    *len = reps * n;
    return all;
}

static int mode_bench(const tok_tokenizer *t, const char *path, double seconds, size_t min_bytes) {
    size_t len;
    unsigned char *text = read_repeated(path, min_bytes, &len);
    int *ids = NULL;
    size_t n = 0;
    double t0 = now(), enc = 0;
    long reps = 0;
    do {
        free(ids);
        double a = now();
        if (tok_encode(t, (const char *)text, len, 0, &ids, &n) != 0) die("tok_encode failed", NULL);
        enc += now() - a;
        reps++;
    } while (now() - t0 < seconds);
    double dec = 0;
    long dreps = 0;
    size_t out_n = 0;
    t0 = now();
    do {
        char *out;
        double a = now();
        if (tok_decode(t, ids, n, 0, &out, &out_n) != 0) die("tok_decode failed", NULL);
        dec += now() - a;
        free(out);
        dreps++;
    } while (now() - t0 < seconds);
    double mb = (double)len / 1e6;
    printf("bytes %zu tokens %zu encode %.2f MB/s (%.4f s/run, %ld runs) decode %.2f MB/s (%.5f s/run, %ld runs)\n",
           len, n, mb * (double)reps / enc, enc / (double)reps, reps, mb * (double)dreps / dec, dec / (double)dreps, dreps);
    free(ids);
    free(text);
    return 0;
}

static int mode_time(const tok_tokenizer *t, const char *path, size_t min_bytes, int flags) {
    size_t len;
    unsigned char *text = read_repeated(path, min_bytes, &len);
    int *ids;
    size_t n;
    double a = now();
    if (tok_encode(t, (const char *)text, len, flags, &ids, &n) != 0) die("tok_encode failed", NULL);
    double s = now() - a;
    char *out;
    size_t out_n;
    if (tok_decode(t, ids, n, 0, &out, &out_n) != 0) die("tok_decode failed", NULL);
    int same = roundtrip_equal(t, text, len, (const unsigned char *)out, out_n);
    printf("bytes %zu tokens %zu seconds %.4f roundtrip %s\n", len, n, s, same ? "ok" : "FAIL");
    free(out);
    free(ids);
    free(text);
    return same ? 0 : 1;
}

static int mode_info(const tok_tokenizer *t) {
    const tok_info *i = tok_get_info(t);
    printf("kind %d pre %d n_vocab %d n_merges %d bos %d eos %d eot %d unk %d add_bos %d add_eos %d "
           "add_space_prefix %d chat_template %d default_system_len %zu\n",
           i->kind, i->pre, i->n_vocab, i->n_merges, i->bos, i->eos, i->eot, i->unk, i->add_bos, i->add_eos,
           i->add_space_prefix, i->chat_template, i->default_system_len);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) die("usage: tok_driver MODEL --info|--encode FILE|--roundtrip N SEED|--roundtrip-file FILE|--bench FILE|--time FILE", NULL);
    void *section;
    tok_tokenizer *t = load(argv[1], &section);
    const char *mode = argv[2];
    int flags = 0, rc = 2;
    double seconds = 1.0;
    size_t min_bytes = 0;
    for (int i = 3; i < argc; i++) {
        if (!strcmp(argv[i], "--special")) flags |= TOK_PARSE_SPECIAL;
        else if (!strcmp(argv[i], "--add-special")) flags |= TOK_ADD_SPECIAL;
        else if (!strcmp(argv[i], "--seconds") && i + 1 < argc) seconds = atof(argv[++i]);
        else if (!strcmp(argv[i], "--min-bytes") && i + 1 < argc) min_bytes = (size_t)strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--drop-bytes") && i + 1 < argc) {
            for (const char *h = argv[++i]; h[0] && h[1]; h += 2) {
                int a = hexval(h[0]), b = hexval(h[1]);
                if (a < 0 || b < 0) die("bad --drop-bytes", argv[i]);
                dropped[a << 4 | b] = 1;
            }
        }
    }
    if (!strcmp(mode, "--info")) rc = mode_info(t);
    else if (!strcmp(mode, "--encode") && argc > 3) rc = mode_encode(t, argv[3], flags);
    else if (!strcmp(mode, "--roundtrip") && argc > 4) rc = mode_roundtrip_random(t, atol(argv[3]), strtoull(argv[4], NULL, 10));
    else if (!strcmp(mode, "--roundtrip-file") && argc > 3) rc = mode_roundtrip_file(t, argv[3]);
    else if (!strcmp(mode, "--bench") && argc > 3) rc = mode_bench(t, argv[3], seconds, min_bytes);
    else if (!strcmp(mode, "--fuzz-section") && argc > 4)
        rc = mode_fuzz_section(section, section_size, atol(argv[3]), strtoull(argv[4], NULL, 10));
    else if (!strcmp(mode, "--time") && argc > 3) rc = mode_time(t, argv[3], min_bytes, flags);
    else die("unknown mode", mode);
    tok_free(t);
    free(section);
    return rc;
}
