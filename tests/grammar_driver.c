/* Classifies byte strings with run.c's JSON automaton (the --json and
   --json-schema recognizer), for tests/test_json_output.py to compare with
   an independent reference and with Python's json and jsonschema.
   Usage: grammar_driver [--mask MODEL] [SCHEMA_FILE] < lines; each line
   of stdin is one byte string in hex (an empty line: the empty string),
   and gets one line on stdout: "invalid" (no value the grammar allows
   begins so), "prefix" (some do, and it is not one yet) or "complete" (it
   is one: a top-level number may still go on). With --mask, each valid
   line gets instead the number of tokens of MODEL's vocabulary the mask
   allows after it (the trie walk, through the cache), checked against
   feeding every token's bytes to a copy of the state one by one: a
   difference is reported and fails the run.
   grammar_driver --sample MODEL RUNS N_PREDICT PROMPT [SCHEMA_FILE]: RUNS
   sampled generations (-t 1, the default top-k, top-p and lookup
   decoding, seeds 1..RUNS) of the prompt in the chat template, each
   exactly as the generation loop of ./run --json makes it, in one process:
   the model, the trie and the prompt's KV cache are built once. Each
   output is followed by a line "\x1e INCOMPLETE" (1: the value was left
   unfinished at N_PREDICT tokens).
   Includes run.c whole so the static automaton is reachable. */
#define main run_main
#include "../run.c"
#undef main

static const char *classify(const JsonGrammar *g, int root, const unsigned char *p, size_t n)
{
    JsonState s;
    json_start(&s, root);
    if (!json_feed_all(g, &s, (const char *)p, n)) return "invalid";
    return json_complete(g, &s) ? "complete" : "prefix";
}

/* The mask after the bytes p[0..n), from the walk and token by token;
   prints how many tokens it allows, or dies at the first difference. */
static void check_mask(const JsonConstraint *jc, const Model *m, const unsigned char *p, size_t n)
{
    JsonMask jm;
    int vocab = m->c.vocab_size, allowed = 0;
    json_mask_init(&jm, jc, vocab);
    if (!json_feed_all(&jc->g, &jm.state, (const char *)p, n)) { puts("invalid"); json_mask_free(&jm); return; }
    for (int pass = 0; pass < 2; pass++) { /* the second time from the cache */
        const uint8_t *walked = grammar_mask_allowed(&jm);
        for (int id = 0; id < vocab; id++) {
            size_t len;
            const char *piece = tok_piece(m->tok, id, &len);
            JsonState s = jm.state;
            int ok = tok_is_eog(m->tok, id) ? json_complete(&jc->g, &s)
                   : !tok_is_control(m->tok, id) && piece && len && json_feed_all(&jc->g, &s, piece, len);
            if (ok != walked[id]) die(EXIT_RUNTIME, "token %d: the walk says %d, its bytes %d", id, walked[id], ok);
            allowed += ok && !pass;
        }
    }
    if (jm.walks != 1 || jm.hits != 1) die(EXIT_RUNTIME, "expected one walk and one cache hit");
    printf("%d\n", allowed);
    json_mask_free(&jm);
}

/* --sample: see the top. */
static int sample_runs(int argc, char **argv)
{
    if (argc != 5 && argc != 6) die(EXIT_USAGE, "usage: grammar_driver --sample MODEL RUNS N_PREDICT PROMPT [SCHEMA_FILE]");
    select_kernels(best_kernel_set());
    JsonConstraint jc;
    json_grammar_init(&jc.g);
    jc.root = argc == 6 ? compile_schema_file(&jc.g, argv[5]) : 0;
    Model m;
    char err[ERR_BYTES];
    if (build_model(&m, argv[1], 0, err) != 0) die(EXIT_RUNTIME, "%s: %s", argv[1], err);
    build_trie(&jc.trie, m.tok, m.c.vocab_size);
    int runs = atoi(argv[2]), n_predict = atoi(argv[3]);
    Tokens prompt = {0};
    Chat ch;
    build_chat(&ch, &m, NULL, 0);
    tokenize_prompt(&m, argv[4], strlen(argv[4]), &ch, 0, &prompt);
    RunState s;
    int seq_len = prompt.n + n_predict + VERIFY_MAX_TOKENS;
    build_state(&s, &m, seq_len, usable_cpus(), T_F16);
    GenOpts gen = {.n_predict = n_predict, .lookup = LOOKUP_DEFAULT, .json = &jc, .logprobs = -1};
    int n_prompt = prompt.n, pos = 0;
    for (int run = 1; run <= runs; run++) {
        /* the prompt but its last token is cached after the first run:
           that one is fed again, giving the logits generation starts from */
        Sampler sm = SAMPLING_DEFAULTS;
        sm.temperature = 1.0f, sm.rng = (unsigned long long)run * 0x9E3779B97F4A7C15ull + 1;
        prompt.n = n_prompt;
        if (pos) pos = n_prompt - 1;
        TextOut out;
        text_open(&out, stdout, NULL);
        Request r = {.conv = &prompt, .pos = pos, .n_predict = n_predict, .out = &out};
        int why = generate(&m, &s, &sm, &gen, &r);
        pos = r.pos;
        printf("\x1e %d\n", r.st.json_incomplete);
        hooks_close(&r, why, 0);
        free(r.st.itl);
    }
    free(prompt.ids);
    free_state(&s);
    free_trie(&jc.trie);
    free_model(&m);
    json_grammar_free(&jc.g);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--sample")) return sample_runs(argc - 1, argv + 1);
    const char *model_path = NULL;
    if (argc > 2 && !strcmp(argv[1], "--mask")) model_path = argv[2], argc -= 2, argv += 2;
    if (argc > 2) die(EXIT_USAGE, "usage: grammar_driver [--mask MODEL] [SCHEMA_FILE] < hex lines");
    JsonConstraint jc;
    JsonGrammar *gp = &jc.g;
    json_grammar_init(gp);
    int root = jc.root = argc == 2 ? compile_schema_file(gp, argv[1]) : 0;
    Model m;
    char err[ERR_BYTES];
    if (model_path) {
        if (build_model(&m, model_path, 0, err) != 0) die(EXIT_RUNTIME, "%s: %s", model_path, err);
        build_trie(&jc.trie, m.tok, m.c.vocab_size);
    }
    char line[1 << 16];
    unsigned char bytes[1 << 15];
    while (fgets(line, sizeof line, stdin)) {
        size_t len = strcspn(line, "\r\n"), n = 0;
        if (len % 2) die(EXIT_USAGE, "odd hex line");
        for (size_t i = 0; i < len; i += 2) {
            int hi = json_hex_value((unsigned char)line[i]), lo = json_hex_value((unsigned char)line[i + 1]);
            if (hi < 0 || lo < 0) die(EXIT_USAGE, "not hex: %s", line);
            bytes[n++] = (unsigned char)(hi << 4 | lo);
        }
        if (model_path) check_mask(&jc, &m, bytes, n);
        else puts(classify(gp, root, bytes, n));
    }
    if (model_path) free_trie(&jc.trie), free_model(&m);
    json_grammar_free(gp);
    return 0;
}
