/* libFuzzer target: the model-file loader of run.c, then a short run of what was loaded.

   Input: a whole model file (export.py's manual ("The model file")). It is written to a memfd and loaded through
   build_model() by path, exactly as ./run does. A file that is refused must be refused with
   a one-line reason; a file that is accepted then goes through the engine: the chat
   template (when the file has one), a prompt tokenized and prefilled, one decode step and
   both samplers on the logits, whatever numbers the weights hold. A refused file is loaded
   again as --tokenize loads it (load_model with tokenizer_only): only a file without tensors
   may load so, and then its tokenizer runs on the prompt. Sanitizers catch any read
   outside the mapping or any undefined arithmetic; the checks here catch a refusal without
   a reason and a sampled token outside the vocabulary.

   run.c is included whole (its functions are static), like tests/test_kernels.c does.
   Build: clang -g -O1 -fsanitize=fuzzer,address,undefined -I. tests/fuzz/fuzz_loader.c tokenizer.c -lm */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

/* die() after a successful load (e.g. on weights that compute NaN) is a clear error, not
   a crash: run.c's exit() comes back here instead of ending the fuzzer. */
static jmp_buf fuzz_exit_jmp;
static _Noreturn void fuzz_exit(int code) { longjmp(fuzz_exit_jmp, code ? code : -1); }

#ifndef RUN_C
#define RUN_C "../../run.c"   /* -DRUN_C='"path"' fuzzes a patched copy */
#endif
#define exit(code) fuzz_exit(code)
#define main run_main
#include RUN_C
#undef main
#undef exit

#define MAX_FUZZ_SEQ 6   /* positions run per input: enough for prefill + decode, cheap */

static int memfd = -1;
static char memfd_path[64];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc, (void)argv;
    memfd = memfd_create("fuzz_model", 0);
    if (memfd < 0) { perror("memfd_create"); exit(2); }
    snprintf(memfd_path, sizeof memfd_path, "/proc/self/fd/%d", memfd);
    return 0;
}

static void put_file(const uint8_t *data, size_t size)
{
    if (ftruncate(memfd, 0) != 0 || ftruncate(memfd, (off_t)size) != 0) abort();
    for (size_t done = 0; done < size;) {
        ssize_t k = pwrite(memfd, data + done, size - done, (off_t)done);
        if (k <= 0) abort();
        done += (size_t)k;
    }
}

/* The prompt: with a chat template, one user turn wrapped in it (as -c does), else plain
   text with the model's BOS/EOS. Clipped to leave one position for the decode step. */
static void fuzz_prompt(const Model *m, Tokens *t, int seq_len)
{
    static const char text[] = "Hi! \xc3\xa9t\xc3\xa9 <|im_end|>\n\xff";
    const tok_info *ti = tok_get_info(m->tok);
    int chatml = ti->chat_template == TOK_CHAT_CHATML, gemma = ti->chat_template == TOK_CHAT_GEMMA;
    /* build_chat() refuses a template whose turn tokens are missing: only go there when they exist */
    int start = chatml ? special_id(m, "<|im_start|>") : gemma ? special_id(m, "<start_of_turn>") : -1;
    int end = chatml ? special_id(m, "<|im_end|>") : gemma ? special_id(m, "<end_of_turn>") : -1;
    if (start >= 0 && end >= 0) {
        Chat ch;
        build_chat(&ch, m, NULL, 0);
        chat_open(&ch, m, t);
        chat_user_turn(&ch, m, t, text, sizeof text - 1);
    } else {
        int *ids;
        size_t n;
        if (tok_encode(m->tok, text, sizeof text - 1, TOK_ADD_SPECIAL, &ids, &n) != 0) abort();
        for (size_t i = 0; i < n; i++) push(t, ids[i]);
        free(ids);
    }
    for (int i = 0; i < t->n; i++)
        if (t->ids[i] < 0 || t->ids[i] >= m->c.vocab_size) abort();
    if (t->n == 0) push(t, m->c.vocab_size - 1);   /* the last embedding row */
    if (t->n > seq_len - 1) t->n = seq_len - 1;
}

/* What run_model allocates, freed by the caller also when die() jumps out. */
static RunState s;
static Tokens prompt;
static Candidate *cand;

static void run_model(const Model *m, uint32_t variant)
{
    int seq_len = min_i(m->c.max_seq_len, MAX_FUZZ_SEQ);
    int kv = (int[]){T_F16, T_F32, T_Q8_0}[variant % 3];
    if (kv == T_Q8_0 && m->c.head_dim % QK) kv = T_F16;
    select_kernels(variant / 3 % 2 ? KSET_SCALAR : best_kernel_set());
    build_state(&s, m, seq_len, 1, kv);
    if (seq_len >= 2) fuzz_prompt(m, &prompt, seq_len);
    else push(&prompt, 0);
    int vocab = m->c.vocab_size;
    cand = xmalloc((size_t)vocab * sizeof *cand);
    prefill(m, &s, prompt.ids, prompt.n, 0, 0);
    Sampler greedy = {.top_p = 1, .rng = 1}, topp = SAMPLING_DEFAULTS;
    topp.rng = 88172645463325252ull, topp.top_p = 0.9f;
    topp.min_p = 0.05f, topp.repeat = 1.1f, topp.presence = 0.5f, topp.frequency = 0.5f;
    int tok = sample(&greedy, s.logits, vocab, cand, NULL, &prompt);
    if (tok < 0 || tok >= vocab) abort();
    if (prompt.n < seq_len) {
        decode_step(m, &s, tok, prompt.n);
        push(&prompt, tok);
        tok = sample(&topp, s.logits, vocab, cand, NULL, &prompt); /* the penalties over the prompt and tok */
        if (tok < 0 || tok >= vocab) abort();
        size_t len;
        (void)tok_piece(m->tok, tok, &len);
        (void)tok_is_eog(m->tok, tok);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    put_file(data, size);
    Model m;
    char err[ERR_BYTES] = "";
    if (build_model(&m, memfd_path, 0, err) != 0) {
        /* refused: there must be a one-line reason */
        if (!err[0] || strchr(err, '\n')) abort();
        /* --tokenize loads a file without tensors too: only such a file may load so, and its tokenizer runs */
        free_model(&m);
        err[0] = 0;
        if (load_model(&m, memfd_path, 1, 0, err) != 0) {
            if (!err[0] || strchr(err, '\n')) abort();
        } else {
            if (!m.tokenizer_only || m.layers) abort();
            if (setjmp(fuzz_exit_jmp) == 0) fuzz_prompt(&m, &prompt, min_i(m.c.max_seq_len, MAX_FUZZ_SEQ));
            free(prompt.ids);
            prompt = (Tokens){0};
        }
    } else {
        uint32_t variant = 0;
        for (size_t i = 0; i < size; i += 4099) variant = variant * 31 + data[i];
        memset(&s, 0, sizeof s);
        if (setjmp(fuzz_exit_jmp) == 0) run_model(&m, variant);
        free(cand);
        free(prompt.ids);
        free_state(&s);
        cand = NULL;
        prompt = (Tokens){0};
    }
    free_model(&m);
    return 0;
}
