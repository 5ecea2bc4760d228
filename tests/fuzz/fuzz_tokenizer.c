/* libFuzzer target: tokenizer encode and decode on real vocabularies.

   Input: one selector byte, then the text (any bytes).
     selector bits 0-1  which vocabulary (line of the file named by $FUZZ_VOCABS, modulo
                        their number): model files whose tokenizer section is used
     bit 2              encode with TOK_PARSE_SPECIAL
     bit 3              encode with TOK_ADD_SPECIAL
   Checks, besides ASan/UBSan: every id is in range; BOS/EOS are where the vocabulary's
   flags put them; decoding the ids with TOK_RENDER_SPECIAL gives the text back (the
   tokenizer drops nothing, except, in byte-level BPE, bytes that no token stands for:
   SmolLM2 has no token for 21 byte values (0xC0, 0xF5.., some controls), and llama.cpp drops
   those too). SentencePiece
   identifies U+2581 with a space, so both sides are compared with U+2581 read as a space,
   and with add_space_prefix (a space goes in front of every text fragment, after each
   special token too, as llama.cpp does) spaces are ignored. The text's bytes are also
   decoded as a list of raw int32 ids (out-of-range ids must be skipped).

   Build:  clang -g -O1 -fsanitize=fuzzer,address,undefined -I. tests/fuzz/fuzz_tokenizer.c tokenizer.c
   Run:    FUZZ_VOCABS=/tmp/llm-fuzz/vocab.list ./fuzz_tokenizer CORPUS_DIR SEED_DIR */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tokenizer.h"

#define MAX_VOCABS 4
#define TOK_OFFSET_AT 72
#define TOK_SIZE_AT 80
#define SEL_PARSE_SPECIAL 4
#define SEL_ADD_SPECIAL 8

static tok_tokenizer *vocab[MAX_VOCABS];
static uint8_t has_byte[MAX_VOCABS][256];   /* some non-control token's text is this one byte */
static int n_vocab_files;

static void fatal(const char *what, const char *detail)
{
    fprintf(stderr, "fuzz_tokenizer: %s: %s\n", what, detail);
    exit(2);
}

static void load_vocab(const char *path)
{
    int fd = open(path, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_size < 256) fatal("cannot read model file", path);
    const uint8_t *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) fatal("cannot map", path);
    uint64_t off, size;
    memcpy(&off, p + TOK_OFFSET_AT, 8);
    memcpy(&size, p + TOK_SIZE_AT, 8);
    if (off > (uint64_t)st.st_size || size > (uint64_t)st.st_size - off) fatal("bad tokenizer section", path);
    char err[256];
    tok_tokenizer *t;
    if (tok_create(&t, p + off, size, err, sizeof err) != 0) fatal(path, err);
    for (int id = 0; id < tok_get_info(t)->n_vocab; id++) {
        size_t len;
        const char *piece = tok_piece(t, id, &len);
        if (len == 1 && !tok_is_control(t, id)) has_byte[n_vocab_files][(uint8_t)piece[0]] = 1;
    }
    vocab[n_vocab_files] = t;
    n_vocab_files++;   /* the mapping stays for the life of the process */
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    const char *list = getenv("FUZZ_VOCABS");
    if (!list) fatal("FUZZ_VOCABS is not set", "it names a file listing model files, one a line");
    FILE *f = fopen(list, "r");
    if (!f) fatal("cannot open", list);
    char line[4096];
    while (n_vocab_files < MAX_VOCABS && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        if (line[0]) load_vocab(line);
    }
    fclose(f);
    if (!n_vocab_files) fatal("no vocabularies listed in", list);
    return 0;
}

/* Copies s: for SentencePiece (spm) with U+2581 read as a space and every space dropped
   when drop_spaces; for byte-level BPE without the bytes that keep[] does not mark. */
static size_t normalize(const char *s, size_t n, char *out, int spm, int drop_spaces, const uint8_t *keep)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (keep && !keep[(uint8_t)c]) continue;
        if (spm && i + 2 < n && (uint8_t)s[i] == 0xE2 && (uint8_t)s[i + 1] == 0x96 && (uint8_t)s[i + 2] == 0x81) {
            c = ' ';
            i += 2;
        }
        if (!(drop_spaces && c == ' ')) out[k++] = c;
    }
    return k;
}

static void check_roundtrip(int v, const char *text, size_t len, const int *ids, size_t n)
{
    const tok_tokenizer *t = vocab[v];
    const tok_info *info = tok_get_info(t);
    char *dec;
    size_t dec_len;
    if (tok_decode(t, ids, n, TOK_RENDER_SPECIAL, &dec, &dec_len) != 0) abort();
    if (dec[dec_len] != 0) abort();                          /* documented NUL terminator */
    int spm = info->kind == TOK_KIND_SPM, drop = spm && info->add_space_prefix;
    char *a = malloc(len + 1), *b = malloc(dec_len + 1);
    if (!a || !b) abort();
    size_t na = normalize(text, len, a, spm, drop, spm ? NULL : has_byte[v]);
    size_t nb = normalize(dec, dec_len, b, spm, drop, NULL);
    if (na != nb || memcmp(a, b, na) != 0) {
        fprintf(stderr, "roundtrip mismatch: %zu input bytes -> %zu ids -> %zu bytes\nids:", len, n, dec_len);
        for (size_t i = 0; i < n; i++) fprintf(stderr, " %d", ids[i]);
        fprintf(stderr, "\nin: ");
        for (size_t i = 0; i < len; i++) fprintf(stderr, "%02x", (uint8_t)text[i]);
        fprintf(stderr, "\nout:");
        for (size_t i = 0; i < dec_len; i++) fprintf(stderr, "%02x", (uint8_t)dec[i]);
        fprintf(stderr, "\n");
        abort();
    }
    free(a);
    free(b);
    free(dec);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    int v = data[0] % MAX_VOCABS % n_vocab_files;
    const tok_tokenizer *t = vocab[v];
    const tok_info *info = tok_get_info(t);
    int flags = (data[0] & SEL_PARSE_SPECIAL ? TOK_PARSE_SPECIAL : 0) | (data[0] & SEL_ADD_SPECIAL ? TOK_ADD_SPECIAL : 0);
    const char *text = (const char *)data + 1;
    size_t len = size - 1;

    int *ids;
    size_t n;
    if (tok_encode(t, text, len, flags, &ids, &n) != 0) abort();   /* only fails when out of memory */
    if (!ids) abort();
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= info->n_vocab) abort();
        size_t plen;
        if (!tok_piece(t, ids[i], &plen)) abort();
        (void)tok_is_control(t, ids[i]);
        (void)tok_is_eog(t, ids[i]);
    }
    size_t first = 0, last = n;
    if (flags & TOK_ADD_SPECIAL) {
        if (info->add_bos && info->bos >= 0) {
            if (n < 1 || ids[0] != info->bos) abort();
            first = 1;
        }
        if (info->add_eos && info->eos >= 0) {
            if (last <= first || ids[last - 1] != info->eos) abort();
            last--;
        }
    }
    check_roundtrip(v, text, len, ids + first, last - first);
    free(ids);

    /* the raw bytes as ids: out-of-range ones are skipped, others decoded */
    size_t n_raw = len / sizeof(int);
    int *raw = malloc((n_raw ? n_raw : 1) * sizeof(int));
    if (!raw) abort();
    memcpy(raw, text, n_raw * sizeof(int));
    char *out;
    size_t out_len;
    for (int f = 0; f <= TOK_RENDER_SPECIAL; f += TOK_RENDER_SPECIAL) {
        if (tok_decode(t, raw, n_raw, f, &out, &out_len) != 0) abort();
        free(out);
    }
    for (size_t i = 0; i < n_raw; i++) {
        size_t plen;
        const char *p = tok_piece(t, raw[i], &plen);
        if ((raw[i] < 0 || raw[i] >= info->n_vocab) != (p == NULL)) abort();
    }
    free(raw);
    return 0;
}
