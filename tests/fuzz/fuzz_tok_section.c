/* libFuzzer target: tok_create on an untrusted tokenizer section, then encode and decode.

   Input: a tokenizer section (export.py's manual ("The model file"), "Tokenizer section"), seeded with the
   sections of small real model files. tok_create must either refuse it with a one-line
   reason or give a tokenizer that encodes and decodes any text without reading outside
   the section: every id it produces is in range and has a piece.

   Build: clang -g -O1 -fsanitize=fuzzer,address,undefined -I. tests/fuzz/fuzz_tok_section.c tokenizer.c */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer.h"

static const char *const TEXTS[] = {
    "Hello world! It's 2024: caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac",
    "  <|im_start|>user\n\n<start_of_turn>\t<br></s>\xe2\x96\x81x",
    "\xff\xfe\x80 \xc3\x28 \xed\xa0\x80 \xf4\x90\x80\x80 aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
};

static void exercise(const tok_tokenizer *t)
{
    const tok_info *info = tok_get_info(t);
    if (info->n_vocab <= 0) abort();
    if (info->default_system_len && !info->default_system) abort();
    for (size_t k = 0; k < sizeof TEXTS / sizeof *TEXTS; k++)
        for (int flags = 0; flags <= (TOK_ADD_SPECIAL | TOK_PARSE_SPECIAL); flags++) {
            int *ids;
            size_t n;
            if (tok_encode(t, TEXTS[k], strlen(TEXTS[k]) + (k == 2), flags, &ids, &n) != 0) abort();
            for (size_t i = 0; i < n; i++) {
                size_t len;
                if (ids[i] < 0 || ids[i] >= info->n_vocab || !tok_piece(t, ids[i], &len)) abort();
                (void)tok_is_control(t, ids[i]);
                (void)tok_is_eog(t, ids[i]);
            }
            char *out;
            size_t out_len;
            if (tok_decode(t, ids, n, flags & TOK_PARSE_SPECIAL ? TOK_RENDER_SPECIAL : 0, &out, &out_len) != 0) abort();
            free(out);
            free(ids);
        }
    /* every token's piece, and ids just outside the vocabulary */
    int probe[] = {-1, info->n_vocab, info->n_vocab - 1, 0, info->bos, info->eos, info->eot, info->unk};
    char *out;
    size_t out_len;
    if (tok_decode(t, probe, sizeof probe / sizeof *probe, TOK_RENDER_SPECIAL, &out, &out_len) != 0) abort();
    free(out);
    for (int id = 0; id < info->n_vocab; id++) {
        size_t len;
        if (!tok_piece(t, id, &len)) abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* the loader hands over a 4-byte aligned pointer into the mapping: a copy is aligned too */
    uint8_t *sec = malloc(size ? size : 1);
    if (!sec) return 0;
    memcpy(sec, data, size);
    tok_tokenizer *t;
    char err[256] = "";
    if (tok_create(&t, sec, size, err, sizeof err) != 0) {
        if (!err[0] || strchr(err, '\n') || t != NULL) abort();
    } else {
        exercise(t);
        tok_free(t);
    }
    free(sec);
    return 0;
}
