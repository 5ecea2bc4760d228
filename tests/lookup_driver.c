/* Lookup decoding's drafting logic (run.c's lookup_draft, lookup_adapt and
   lookup_plan) against references written here from their contracts:
   1. lookup_draft: on random token strings over small alphabets (many
      repeats) and a long periodic one (matches past LOOKUP_MATCH_MAX), the
      match length and source equal a direct search: the longest end of the
      text, at most LOOKUP_MATCH_MAX tokens, that occurred before, and of
      equal ones the latest.
   2. lookup_adapt: along a verbatim copy the pointer moves with every
      token and the run counts them; a token off the copy drops the pointer
      and a new search takes its place.
   3. lookup_plan: for random odds and random pass costs (measured sizes
      and guessed ones, not monotone), its drafts give the best expected
      tokens per unit of time that any combination of draft lengths gives
      (all enumerated; drafting only when that beats none by
      LOOKUP_MARGIN, and once a pass without drafts was timed), and it
      drafts nothing when every pass costs its tokens' decode steps.
   4. lookup_cost / lookup_time: the expected cost never falls as the pass
      grows, is the measured time where measured times rise, and a spike
      moves a size's average by a bounded step.
   Includes run.c whole; prints one line per check and exits 1 if any
   failed. Build: cc -O2 -I. tests/lookup_driver.c tokenizer.c -lm

   `lookup_driver --trace` instead reads texts from stdin, one a line: the
   number of tokens the first search sees, then the token ids; for each
   token from there on it joins the text (lookup_adapt) and the pointer's
   "src run anchor" is printed, one text a line, for test_lookup.py's
   reference of the pointer (resync after edits included). */
#define main run_main
#include "../run.c"
#undef main

#define TEXT_MAX 400
#define SEQS_MAX 3
#define ROOM_MAX 4

static int failures;
static uint64_t rng = 0x2545F4914F6CDD1Dull;

static void check(int ok, const char *what)
{
    printf("%s %s\n", ok ? "ok  " : "FAIL", what);
    if (!ok) failures++;
}

static int rand_below(int n) { return (int)(random_f32(&rng) * n) % n; }

/* The longest g <= LOOKUP_MATCH_MAX such that ids[n-g..n) occurred
   earlier ending before n - 1, the latest such occurrence; *src is the
   index after it. */
static int ref_match(const int *ids, int n, int *src)
{
    for (int g = min_i(LOOKUP_MATCH_MAX, n - 1); g >= 1; g--)
        for (int j = n - 1 - g; j >= 0; j--)
            if (!memcmp(ids + j, ids + n - g, g * sizeof *ids)) {
                *src = j + g;
                return g;
            }
    return 0;
}

static void test_draft(void)
{
    static int ids[TEXT_MAX];
    int bad = 0, cases = 0;
    for (int alphabet = 2; alphabet <= 12; alphabet += 5)
        for (int trial = 0; trial < 200; trial++) {
            int n = 2 + rand_below(TEXT_MAX - 2);
            for (int i = 0; i < n; i++) ids[i] = rand_below(alphabet);
            if (trial % 10 == 0) /* periodic: matches longer than LOOKUP_MATCH_MAX */
                for (int i = 0; i < n; i++) ids[i] = i % (2 + trial % 7);
            int src = -1, want_src = -1, got = lookup_draft(ids, n, &src), want = ref_match(ids, n, &want_src);
            bad += got != want || (want && src != want_src);
            cases++;
        }
    char what[MSG_BYTES];
    snprintf(what, sizeof what, "lookup_draft: longest earlier match, latest of equals (%d texts, %d wrong)", cases, bad);
    check(!bad, what);
}

static void test_adapt(void)
{
    Tokens t = {0};
    int bad = 0;
    for (int i = 0; i < 120; i++) push(&t, 1000 + i); /* a source without repeats */
    Lookup lk = {.max = LOOKUP_DEFAULT, .src = -1};
    push(&t, 7); /* a token the source lacks: no pointer */
    lookup_adapt(&lk, t.ids, t.n);
    bad += lk.src != -1;
    for (int i = 30; i < 90; i++) { /* a copy of source[30..90) */
        push(&t, 1000 + i);
        lookup_adapt(&lk, t.ids, t.n);
        bad += lk.src != i + 1 || lk.run != i - 29;
    }
    push(&t, 1000 + 10); /* off the copy: a new search from the text as it ends */
    lookup_adapt(&lk, t.ids, t.n);
    int src, run = ref_match(t.ids, t.n, &src);
    bad += lk.run != run || lk.src != src;
    free(t.ids);
    check(!bad, "lookup_adapt: the pointer follows a copy token by token and searches again off it");
}

/* Expected tokens per unit of time of draft lengths k[] for the n sequences. */
static double plan_rate(Lookup *const *lk, int n, const int *k, const PassCost *pc)
{
    double yield = n;
    int rows = n;
    for (int i = 0; i < n; i++) {
        double q = 1;
        for (int j = 0; j < k[i]; j++) {
            q *= lookup_odds(lk[i], lk[i]->run + j);
            yield += q;
        }
        rows += k[i];
    }
    return yield / lookup_cost(pc, rows);
}

/* The best rate over every combination of lengths up to room[i]; the
   rate without drafts unless some combination beats it by LOOKUP_MARGIN. */
static double best_rate(Lookup *const *lk, int n, const int *room, const PassCost *pc)
{
    int k[SEQS_MAX] = {0};
    double plain = plan_rate(lk, n, k, pc), best = 0;
    if (pc->ms[n] <= 0) return plain; /* the time to beat is not known yet */
    while (1) {
        int i = 0;
        while (i < n && k[i] == room[i]) k[i++] = 0;
        if (i == n) return best > plain * (1 + LOOKUP_MARGIN) ? best : plain;
        k[i]++;
        best = fmax(best, plan_rate(lk, n, k, pc));
    }
}

static void random_lookup(Lookup *lk)
{
    *lk = (Lookup){.max = LOOKUP_DEFAULT, .src = 0, .run = 1 + rand_below(40)};
    for (int c = 0; c < LOOKUP_CLASSES; c++) {
        lk->seen[c] = rand_below(40);
        lk->stood[c] = lk->seen[c] * random_f32(&rng);
    }
}

static void test_plan(void)
{
    int bad = 0, drafted = 0, cases = 0;
    for (int trial = 0; trial < 3000; trial++) {
        Lookup seqs[SEQS_MAX], *lk[SEQS_MAX];
        int n = 1 + rand_below(SEQS_MAX), room[SEQS_MAX], k[SEQS_MAX];
        for (int i = 0; i < n; i++) random_lookup(&seqs[i]), lk[i] = &seqs[i], room[i] = rand_below(ROOM_MAX + 1);
        PassCost pc = {0};
        double step = 10 + 40 * random_f32(&rng), per = step * (0.05 + random_f32(&rng));
        lookup_time(&pc, 1, step);
        lookup_time(&pc, CHUNK_TOKENS, per * CHUNK_TOKENS); /* a prefill chunk */
        for (int m = 2; m <= n + SEQS_MAX * ROOM_MAX; m++)     /* some sizes measured, at random times */
            if (rand_below(2)) lookup_time(&pc, m, fmax(step, m * per) * (0.7 + 0.6 * random_f32(&rng)));
        int rows = lookup_plan(lk, room, n, &pc, BATCH_MAX, k), sum = n;
        for (int i = 0; i < n; i++) sum += k[i], bad += k[i] < 0 || k[i] > room[i];
        double got = plan_rate(lk, n, k, &pc), want = best_rate(lk, n, room, &pc);
        bad += rows != sum || fabs(got - want) > want * 1e-12;
        drafted += sum > n;
        cases++;
    }
    char what[MSG_BYTES];
    snprintf(what, sizeof what, "lookup_plan: the best expected tokens per time of every combination (%d cases, %d drafted, %d wrong)",
             cases, drafted, bad);
    check(!bad && drafted > cases / 4 && drafted < cases, what);
    /* passes that cost their tokens' decode steps: no guess can pay */
    Lookup one, *lk = &one;
    random_lookup(&one);
    PassCost pc = {0};
    for (int m = 1; m <= VERIFY_MAX_TOKENS; m++) lookup_time(&pc, m, 20.0 * m);
    int room = VERIFY_MAX_TOKENS - 1, k;
    check(lookup_plan(&lk, &room, 1, &pc, VERIFY_MAX_TOKENS, &k) == 1 && k == 0,
          "lookup_plan: no drafts when a pass of m tokens costs m decode steps");
}

/* lookup_cost's contract: never less for more tokens (a slow outlier at one
   size must not make a longer pass look cheaper, nor a shorter dearer), the
   measured time itself where the measured times already rise with m, and a
   size not timed between its measured neighbours; lookup_time's: a spike
   (a descheduled thread) moves the average by at most LOOKUP_EMA of
   LOOKUP_SPIKE - 1 times it. */
static void test_cost(void)
{
    int bad = 0;
    for (int trial = 0; trial < 1000; trial++) {
        PassCost pc = {0};
        int rising = rand_below(2);
        double last = 0;
        for (int m = 1; m <= CHUNK_TOKENS; m++) {
            if (m > 1 && rand_below(3)) continue; /* sizes not timed */
            double ms = rising ? last + 1 + 10 * random_f32(&rng) : 1 + 100 * random_f32(&rng);
            lookup_time(&pc, m, ms);
            last = ms;
        }
        double prev = 0;
        for (int m = 1; m <= CHUNK_TOKENS; m++) {
            double c = lookup_cost(&pc, m);
            bad += c < prev || (rising && pc.ms[m] > 0 && c != pc.ms[m]);
            prev = c;
        }
        int m = 1 + rand_below(CHUNK_TOKENS);
        double before = pc.ms[m];
        if (before > 0) {
            lookup_time(&pc, m, before * 1000);
            bad += pc.ms[m] > before * (1 + LOOKUP_EMA * (LOOKUP_SPIKE - 1)) * (1 + 1e-12);
        }
    }
    check(!bad, "lookup_cost: rises with the pass's tokens, is the measured time where those rise, spikes bounded");
}

/* --trace: the pointer after every token of each text on stdin. */
static int trace(void)
{
    static int ids[TEXT_MAX * 8];
    char line[TEXT_MAX * 8 * 8];
    while (fgets(line, sizeof line, stdin)) {
        char *p = line, *end;
        int first = (int)strtol(p, &end, 10), n = 0;
        for (p = end; n < TEXT_MAX * 8; p = end) {
            long v = strtol(p, &end, 10);
            if (end == p) break;
            ids[n++] = (int)v;
        }
        Lookup lk = {.max = LOOKUP_DEFAULT, .src = -1};
        for (int m = first; m <= n; m++) {
            lookup_adapt(&lk, ids, m);
            printf("%s%d %d %d", m > first ? " " : "", lk.src, lk.run, lk.anchor);
        }
        printf("\n");
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc > 1 && !strcmp(argv[1], "--trace")) return trace();
    test_draft();
    test_adapt();
    test_plan();
    test_cost();
    printf("%s\n", failures ? "FAILED" : "all lookup checks passed");
    return failures != 0;
}
