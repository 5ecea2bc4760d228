/* tokenizer.h - text <-> token ids for the model files of export.py's manual ("The model file") (C11, libc only).

   Two algorithms, chosen by the file's tokenizer section:
   - byte-level BPE (GPT-2 style: SmolLM2, GPT-2, Llama 3, Qwen 2): the input is split by
     the model's pre-tokenizer ("gpt-2", "smollm", "llama3"/"llama-bpe", "qwen2"), each
     piece starts as single bytes and the adjacent pair with the lowest merge rank is merged
     until none applies. With the llama3 pre-tokenizer a piece that is already a token is
     emitted whole (llama.cpp's ignore_merges).
   - SentencePiece-style BPE (Llama 2, Gemma): spaces become U+2581, an optional space is
     put in front (add_space_prefix), adjacent symbols merge by highest token score, and a
     symbol that is no token falls back to byte tokens <0xXX>.
   The reference is llama.cpp (llama_tokenize with parse_special = false unless
   TOK_PARSE_SPECIAL), and the tests compare against its output id for id.

   Usage:
       tok_tokenizer *tok;
       char err[256];
       if (tok_create(&tok, section_ptr, section_size, err, sizeof err) != 0) die(err);
       int *ids; size_t n;
       if (tok_encode(tok, text, strlen(text), TOK_ADD_SPECIAL, &ids, &n) != 0) die("out of memory");
       for (size_t i = 0; i < n; i++) {
           size_t len;
           const char *piece = tok_piece(tok, ids[i], &len);   // bytes, not NUL-terminated
           if (!tok_is_control(tok, ids[i])) fwrite(piece, 1, len, stdout);
       }
       free(ids);
       tok_free(tok);

   Special tokens. Control tokens (<|im_start|>, <start_of_turn>, <bos>, ...) are produced
   only from text when TOK_PARSE_SPECIAL is given: by default the text "<|im_start|>" in a
   prompt is tokenized as ordinary characters, so pasted text cannot inject control tokens.
   User-defined tokens (GGUF type 4) are matched literally in the input even without the
   flag, as llama.cpp and Hugging Face tokenizers do; for Gemma 3 these are runs of
   newlines, tabs and spaces, some HTML tags, <s>, [multimodal], <start_of_image> and
   <end_of_image>. Special texts are cut out of the input longest first (among equal
   lengths, left to right), again as llama.cpp does.
   Chat prompts: encode the template's own text (<|im_start|>user\n, <end_of_turn>\n, ...)
   with TOK_PARSE_SPECIAL and the user's text without it, and concatenate the ids: encoding
   the whole rendered string with the flag would turn a "<|im_end|>" typed by the user into
   the control token (llama.cpp's own chat tools do exactly that). The ids then equal those
   of the whole string unless the user's text starts with whitespace that would have
   joined the template's preceding newline; with an add_space_prefix vocabulary every part
   would get its own leading space. Gemma's template writes <bos>: no TOK_ADD_SPECIAL there.
   Like llama.cpp, tokens whose text marks end of generation or fill-in-the-middle
   (e.g. "</s>", "<|endoftext|>", "<end_of_turn>", "<|fim_prefix|>") are treated as control
   tokens whatever type the file gives them; tok_is_eog() reports llama.cpp's
   end-of-generation set (eos, end-of-turn, and those texts).

   Any bytes are accepted (invalid UTF-8, NUL, encoded surrogates, huge runs) and nothing
   is lost as long as the vocabulary covers every byte (SentencePiece vocabularies with
   <0xXX> tokens do; SmolLM2's lacks 21 byte values that UTF-8 text hardly uses, and, as in
   llama.cpp, those bytes are dropped). One deliberate difference from llama.cpp, on input
   that is not valid UTF-8 for byte-level BPE: llama.cpp replaces every invalid byte (and
   re-encodes overlong forms) before merging, losing it; here the original bytes are kept.
   Pre-token boundaries are the same (an invalid byte is classed as U+FFFD would be), only
   the ids of those bytes differ. Where llama.cpp would abort (a missing SentencePiece byte
   token) the unknown token is used instead; no supported vocabulary gets there.
   SentencePiece identifies U+2581 with a space (the model cannot tell them apart): such
   input decodes to a space; and, as in llama.cpp, an invalid UTF-8 lead byte directly
   before a space swallows part of that space's U+2581, which then comes out as byte
   tokens (decoding to U+2581 rather than a space).

   Cost: encoding is O(n log n) in the input length, never quadratic, whatever the piece
   sizes: merges are heap-ordered within each piece, a piece is first cut where no merge
   can cross (between two symbols that occur next to each other in no token), repeated
   pieces are looked up in a per-call memo, and special texts are searched only at the
   positions where one can start. About 12-60 MB/s on ordinary text on one core.
   Thread safety: a tokenizer is read-only after tok_create; any number of threads may
   encode/decode with it at once.

   Decoding SentencePiece output: the space that add_space_prefix put in front is removed
   by tok_decode() (llama.cpp's rule: one leading space of the first token's piece, unless
   the sequence starts with BOS). A streaming printer that calls tok_piece() per generated
   token needs no stripping: generated text continues after the prompt. */
#ifndef TOKENIZER_H
#define TOKENIZER_H

#include <stddef.h>

typedef struct tok_tokenizer tok_tokenizer;

enum { TOK_KIND_BPE = 1, TOK_KIND_SPM = 2 };                       /* tok_info.kind */
enum { TOK_PRE_NONE, TOK_PRE_GPT2, TOK_PRE_SMOLLM, TOK_PRE_LLAMA3, TOK_PRE_QWEN2 };  /* tok_info.pre */
enum { TOK_CHAT_NONE, TOK_CHAT_CHATML, TOK_CHAT_GEMMA, TOK_CHAT_LLAMA3 }; /* tok_info.chat_template */

typedef struct {
    int kind, pre, n_vocab, n_merges;
    int bos, eos, eot, unk;            /* token ids, -1 = none */
    int add_bos, add_eos, add_space_prefix;
    int chat_template;
    const char *default_system;        /* the chat template's default system prompt (UTF-8, not NUL-terminated) */
    size_t default_system_len;         /* 0 = none */
} tok_info;

/* Parse a tokenizer section (export.py's manual ("The model file")) of `size` bytes at `section`, which must be
   4-byte aligned and stay mapped while the tokenizer lives. Every count and offset is
   checked against `size` (the file is untrusted). Returns 0, or -1 with a one-line reason
   in err (err may be NULL). */
int tok_create(tok_tokenizer **out, const void *section, size_t size, char *err, size_t errlen);
void tok_free(tok_tokenizer *t);
const tok_info *tok_get_info(const tok_tokenizer *t);

#define TOK_ADD_SPECIAL    1  /* tok_encode: add BOS/EOS as the model's flags say */
#define TOK_PARSE_SPECIAL  2  /* tok_encode: match control-token texts in the input */
#define TOK_RENDER_SPECIAL 4  /* tok_decode: write control tokens' text instead of skipping them */

/* Encode len bytes of text (any bytes; NUL allowed). *ids is malloc'd (caller frees; it is
   a valid pointer even when *n_ids is 0). Returns 0, or -1 when out of memory or len is
   above 256 MiB (then *ids = NULL, *n_ids = 0). */
int tok_encode(const tok_tokenizer *t, const char *text, size_t len, int flags, int **ids, size_t *n_ids);

/* The bytes token `id` stands for (the decoded form: byte tokens give their byte, spaces
   are spaces; control tokens give their literal text). Not NUL-terminated. NULL (and
   *len = 0) for an id out of range. len may be NULL. */
const char *tok_piece(const tok_tokenizer *t, int id, size_t *len);

/* 1 if id is a control, unknown or unused token (never printed as generated text). */
int tok_is_control(const tok_tokenizer *t, int id);

/* 1 if id ends generation for llama.cpp: eos, end-of-turn, or a token whose text is one of
   its end-of-generation markers ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "</s>", ...). */
int tok_is_eog(const tok_tokenizer *t, int id);

/* Decode ids to text: the concatenated pieces, control/unknown/unused tokens skipped unless
   TOK_RENDER_SPECIAL, out-of-range ids skipped, and the add_space_prefix space removed as
   described above. *out is malloc'd and NUL-terminated (the text may itself hold NULs; use
   *out_len). Returns 0, or -1 when out of memory. */
int tok_decode(const tok_tokenizer *t, const int *ids, size_t n, int flags, char **out, size_t *out_len);

#endif
