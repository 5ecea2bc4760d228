/* Kernel tests: every kernel of every kernel set this CPU can run against
   the scalar reference set, driven by run.c's own tables, so that a type or
   a set added there is tested here without a new line: per weight type the
   row conversions (to_float, from_float), the dot product, decode's GEMV
   tile and prefill's register tile; per set the activation quantizers,
   the attention kernels (decode's and prefill's multi-query ones),
   prefill's attention step against decode's, the softmax step and SwiGLU. Also the f16
   conversions against the compiler's over every half, the integer part of
   the int8 dot products exactly, the vector exp, and the activation
   quantizer's error bound. Includes run.c whole so the static kernels are
   reachable; prints one line per check (a set the CPU lacks is reported
   as skipped, with the reason) and exits 1 if any failed. With --list it
   only reports which sets this CPU runs and which it skips (the CPU check
   alone, for a second emulated CPU whose kernels are those already tested);
   with --only SET it tests that set alone (under an emulator, where the
   sets the CPU itself runs were tested natively).
   Build: cc -O2 -march=native -I. tests/test_kernels.c tokenizer.c -lm */
#define main run_main
#include "../run.c"
#undef main

#define MAX_HD 72
static int failures;

static void check(int ok, const char *what)
{
    printf("%s %s\n", ok ? "ok  " : "FAIL", what);
    if (!ok) failures++;
}

static uint64_t rng = 88172645463325252ull;

static float frand(void) { return random_f32(&rng) * 2 - 1; } /* [-1, 1) */

static uint16_t f32_to_f16_bits(float f) /* round-to-nearest via the compiler */
{
    _Float16 h = (_Float16)f;
    uint16_t b;
    memcpy(&b, &h, 2);
    return b;
}

/* Byte offsets, inside a block, of the f16 scale fields of each quantized
   type (ggml-common.h): random bytes there would be inf/NaN, so the test
   writes small finite scales. The float types are filled as floats. */
static const struct { int type; int at[2]; } SCALES[] = {
    {T_Q8_0, {0, -1}},
    {T_Q4_0, {0, -1}},
    {T_Q4_1, {0, 2}},
    {T_Q5_0, {0, -1}},
    {T_Q5_1, {0, 2}},
    {T_Q4_K, {0, 2}},
    {T_Q5_K, {0, 2}},
    {T_Q6_K, {208, -1}},
};

/* n random weights of `type` per row, rows rb bytes apart: random bytes with
   sane scales for the block types, random values in [-1, 1) for floats. */
static void random_rows(uint8_t *w, int type, int n, int rows)
{
    size_t rb = row_bytes(type, n);
    for (size_t b = 0; b < rb * rows; b++) w[b] = random_u32(&rng);
    for (int r = 0; r < rows; r++) {
        uint8_t *row = w + r * rb;
        for (int j = 0; j < n && TYPES[type].block == 1; j++) {
            float f = frand();
            uint32_t u;
            memcpy(&u, &f, 4);
            if (type == T_F32) ((float *)row)[j] = f;
            if (type == T_F16) ((uint16_t *)row)[j] = f32_to_f16_bits(f);
            if (type == T_BF16) ((uint16_t *)row)[j] = u >> 16;
        }
        for (size_t s = 0; s < sizeof SCALES / sizeof *SCALES; s++) {
            if (SCALES[s].type != type) continue;
            for (int k = 0; k < n / TYPES[type].block; k++)
                for (int f = 0; f < 2 && SCALES[s].at[f] >= 0; f++) {
                    uint16_t h = f32_to_f16_bits(frand() * (f ? 0.05f : 0.01f));
                    memcpy(row + k * TYPES[type].block_bytes + SCALES[s].at[f], &h, 2);
                }
        }
    }
}

static int scales_known(int type)
{
    if (TYPES[type].block == 1) return 1;
    for (size_t s = 0; s < sizeof SCALES / sizeof *SCALES; s++) if (SCALES[s].type == type) return 1;
    return 0;
}

/* Per weight type: the set's row conversions against the scalar set's,
   bit for bit (one conversion and at most one multiply-add per element). */
static void test_types(void)
{
    enum { N = 1536, CONV_N = 192 };
    static float f_ref[N], f_got[N];
    static uint8_t w[N * 4], r_ref[N * 4], r_got[N * 4];
    for (int type = 0; type < N_TYPES; type++) {
        const WeightType *wt = &TYPES[type];
        if (!wt->name) continue;
        char what[160];
        if (!scales_known(type)) {
            snprintf(what, sizeof what, "the test knows where %s keeps its scales (add it to SCALES)", wt->name);
            check(0, what);
            continue;
        }
        const TypeKernels *ref = &SETS[KSET_SCALAR]->type[type], *k = &K.type[type];
        random_rows(w, type, N, 1);
        /* to_float and from_float over a row that is not a multiple of 8 where the type allows it */
        int n = wt->block == 1 ? CONV_N + 3 : wt->block * max_i(1, CONV_N / wt->block);
        ref->to_float(f_ref, w, n);
        k->to_float(f_got, w, n);
        snprintf(what, sizeof what, "%s %-4s to_float equals scalar bit for bit", K.op.name, wt->name);
        check(memcmp(f_ref, f_got, n * sizeof(float)) == 0, what);
        if (ref->from_float) {
            for (int i = 0; i < n; i++) f_ref[i] = frand() * 100;
            ref->from_float(r_ref, f_ref, n);
            k->from_float(r_got, f_ref, n);
            snprintf(what, sizeof what, "%s %-4s from_float equals scalar bit for bit", K.op.name, wt->name);
            check(memcmp(r_ref, r_got, row_bytes(type, n)) == 0, what);
        }
    }
}

/* One packed group of PACK_ROWS rows of n elements of `type` (run.c,
   "the matrices' layout"), written straight in that layout: random bytes,
   with sane finite fp16 scales in the head planes of every record (random
   ones could be inf/NaN); float types get random values in [-1, 1). With
   extreme set, every integer byte is 0xff (the largest integers, the
   SIMD kernels' int16 sums at their bound). */
static void random_group(uint8_t *group, int type, int n, int extreme)
{
    const PackForm *f = &TYPES[type].pack;
    size_t gb = packed_group_bytes(f, n), rb = packed_record_bytes(f), hb = packed_head_bytes(f);
    for (size_t b = 0; b < gb; b++) group[b] = random_u32(&rng);
    if (f->kind == PACK_FLOAT) {
        for (int i = 0; i < n * PACK_ROWS; i++) {
            float v = frand();
            uint32_t u;
            memcpy(&u, &v, 4);
            if (type == T_F32) memcpy(group + 4 * i, &v, 4);
            else {
                uint16_t h = type == T_F16 ? f32_to_f16_bits(v) : (uint16_t)(u >> 16);
                memcpy(group + 2 * i, &h, 2);
            }
        }
        return;
    }
    int halves = f->kind == PACK_K6 ? 1 : 1 + (f->kind == PACK_K4 || f->has_min); /* d (and m or dmin) planes */
    for (int k = 0; k < n / packed_block(f); k++) {
        uint8_t *rec = group + k * rb;
        for (int p = 0; p < halves; p++)
            for (int r = 0; r < PACK_ROWS; r++) {
                uint16_t h = f32_to_f16_bits(frand() * (p ? 0.05f : 0.01f));
                memcpy(rec + 2 * (p * PACK_ROWS + r), &h, 2);
            }
        if (extreme) memset(rec + hb, 0xff, rb - hb);
    }
}

/* The packed products (run.c, "the matrices' layout") of the set in use:
   for every token count of a call, bit for bit the type's definition (the
   scalar set's packed_dot_*), so a token's result does not depend on how
   many share the call: decode, prefill and verification agree; on random
   groups and on groups of the largest integers against activations of
   +-127 (the SIMD sums' overflow bounds). And the definition itself
   within float rounding of sum_e w_e x_e in double, w_e the weights as
   packed_row_to_float reads them and x_e the activations as quantized
   (d * q): the definition computes that sum, only in its own order. */
static void test_packed(void)
{
    enum { N = 1536, TOKS = PACK_TOKS };
    static float x[TOKS][N], wf[N];
    static uint8_t xq[N_ACTS][TOKS][N * 2], group[PACK_ROWS * N * sizeof(float)];
    for (int type = 0; type < N_TYPES; type++) {
        const PackForm *f = &TYPES[type].pack;
        if (!TYPES[type].name) continue;
        char what[200];
        int block = TYPES[type].block, act = TYPES[type].act;
        snprintf(what, sizeof what, "%s %-4s pack form fits its block and activations", K.op.name, TYPES[type].name);
        check(block == packed_block(f) && (act == ACT_F32) == (f->kind == PACK_FLOAT), what);
        size_t xs = act == ACT_F32 ? sizeof x[0] : sizeof xq[0][0];
        const uint8_t *xa = act == ACT_F32 ? (const uint8_t *)x : xq[act][0];
        const int lens[2] = {N, N - (block == 1 ? 3 : block)}; /* an even and an odd number of blocks (floats: not of chains) */
        for (int pass = 0; pass < 3; pass++) { /* random; largest integers x +127; x -127 */
            for (int t = 0; t < TOKS; t++) {
                for (int i = 0; i < N; i++) x[t][i] = pass == 0 ? frand() * 3 : pass == 1 ? 1 : -1;
                for (int a = ACT_F32 + 1; a < N_ACTS; a++) SETS[KSET_SCALAR]->op.quantize[a](xq[a][t], x[t], N);
            }
            for (int li = 0; li < 2; li++) {
                int len = lens[li], same = 1;
                if (packed_group_bytes(f, len) > sizeof group) {
                    check(0, "packed group fits the test's buffer");
                    continue;
                }
                random_group(group, type, len, pass > 0);
                float ref[TOKS * PACK_ROWS], got[TOKS * PACK_ROWS];
                SETS[KSET_SCALAR]->type[type].packed(group, len, xa, xs, TOKS, ref);
                for (int toks = 1; toks <= TOKS; toks++)
                    for (int t0 = 0; t0 + toks <= TOKS; t0 += toks) {
                        K.type[type].packed(group, len, xa + t0 * xs, xs, toks, got);
                        same &= memcmp(got, ref + t0 * PACK_ROWS, toks * PACK_ROWS * sizeof(float)) == 0;
                    }
                snprintf(what, sizeof what, "%s %-4s packed (n %d, 1..%d tokens%s) equals its definition bit for bit", K.op.name,
                         TYPES[type].name, len, TOKS, pass ? ", largest integers" : "");
                check(same, what);
                if (K.set != KSET_SCALAR || pass) continue;
                double worst = 0;
                for (int r = 0; r < PACK_ROWS; r++) {
                    packed_row_to_float(wf, type, f, group, r, len);
                    for (int t = 0; t < TOKS; t++) {
                        double sum = 0, mag = 0;
                        for (int e = 0; e < len; e++) {
                            double xe = act == ACT_F32 ? x[t][e]
                                      : act == ACT_Q8 ? ((const BlockQ8A *)xq[act][t])[e / QK].d * ((const BlockQ8A *)xq[act][t])[e / QK].qs[e % QK]
                                                      : ((const BlockQ8K *)xq[act][t])[e / QK_K].d * ((const BlockQ8K *)xq[act][t])[e / QK_K].qs[e % QK_K];
                            sum += wf[e] * xe;
                            mag += fabs(wf[e] * xe);
                        }
                        worst = fmax(worst, fabs(ref[t * PACK_ROWS + r] - sum) / (mag + 1e-30));
                    }
                }
                snprintf(what, sizeof what, "%-4s packed definition (n %d) vs sum of dequantized products: worst |diff| / sum|terms| = %.2e",
                         TYPES[type].name, len, worst);
                check(worst < 1e-5, what);
            }
        }
    }
}

/* The wide products (a whole prefill chunk a call, for the types whose
   set has one): for token counts up to CHUNK_TOKENS (under PACK_TOKS
   only as a chunk's rest), bit for bit the definition taken PACK_TOKS
   tokens at a time, on random groups and on the largest integers against
   activations of +-127. */
static void test_packed_wide(void)
{
    enum { N = 1536, TOKS = CHUNK_TOKENS };
    static float x[N];
    static uint8_t xq[TOKS][N * 2], group[PACK_ROWS * N * 2]; /* 2 bytes an element: room for every type but f32 (the fit check below) */
    static float ref[TOKS * PACK_ROWS], got[TOKS * PACK_ROWS];
    /* a chunk's rest under PACK_TOKS; rests past passes of 4 tokens: 0, 1, 0, 1, 3, 2, 0; of 8: 0, 1, 0, 1, 3, 6, 0 */
    const int counts[] = {PACK_TOKS - 3, PACK_TOKS, PACK_TOKS + 1, 2 * PACK_TOKS, 2 * PACK_TOKS + 1, 2 * PACK_TOKS + 3,
                          2 * PACK_TOKS + 6, TOKS};
    for (int type = 0; type < N_TYPES; type++) {
        if (!TYPES[type].name || !K.type[type].wide) continue;
        if (packed_group_bytes(&TYPES[type].pack, N) > sizeof group) {
            check(0, "wide: packed group fits the test's buffer");
            continue;
        }
        int act = TYPES[type].act, same = 1;
        size_t xs = sizeof xq[0];
        for (int pass = 0; pass < 3; pass++) {
            for (int t = 0; t < TOKS; t++) {
                for (int i = 0; i < N; i++) x[i] = pass == 0 ? frand() * 3 : pass == 1 ? 1 : -1;
                SETS[KSET_SCALAR]->op.quantize[act](xq[t], x, N);
            }
            random_group(group, type, N, pass > 0);
            for (int t = 0; t < TOKS; t += PACK_TOKS)
                SETS[KSET_SCALAR]->type[type].packed(group, N, xq[t], xs, min_i(PACK_TOKS, TOKS - t), ref + t * PACK_ROWS);
            for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
                K.type[type].wide(group, N, xq[0], xs, counts[c], got);
                same &= memcmp(got, ref, counts[c] * PACK_ROWS * sizeof(float)) == 0;
            }
        }
        char what[200];
        snprintf(what, sizeof what, "%s %-4s wide product (%d to %d tokens) equals its definition bit for bit", K.op.name,
                 TYPES[type].name, counts[0], TOKS);
        check(same, what);
    }
}

/* The f16 conversions: the scalar ones (the definitions) against the
   compiler's _Float16 over every half; the set's f16 row writer against
   them around every half (exact values, midpoints, just off them). */
static void test_fp16(int set)
{
    int bad = 0;
    for (uint32_t h = 0; h < 65536 && set == KSET_SCALAR; h++) {
        _Float16 ref;
        uint16_t hb = (uint16_t)h;
        memcpy(&ref, &hb, 2);
        float a = fp16_to_f32(hb), b = (float)ref;
        if (memcmp(&a, &b, 4) != 0 && !(isnan(a) && isnan(b))) bad++;
    }
    if (set == KSET_SCALAR) check(bad == 0, "fp16_to_f32 equals the compiler's _Float16 conversion on all 65536 inputs");
    static float probes[6 * 0x7c00 + 8];
    static uint16_t got[6 * 0x7c00 + 8];
    int n = 0;
    for (uint32_t h = 0; h < 0x7c00; h++) {
        float lo = fp16_to_f32((uint16_t)h), hi = fp16_to_f32((uint16_t)(h + 1)), mid = (lo + hi) / 2;
        float p[] = {lo, mid, nextafterf(mid, 0), nextafterf(mid, 1e9f), -lo, -mid};
        for (int i = 0; i < 6; i++) probes[n++] = p[i];
    }
    float specials[] = {INFINITY, -INFINITY, 65520.0f, 1e10f, -1e-10f, 0.0f, -0.0f, NAN};
    for (int i = 0; i < 8; i++) probes[n++] = specials[i];
    K.type[T_F16].from_float(got, probes, n);
    bad = 0;
    int first = -1;
    for (int i = 0; i < n; i++)
        if (got[i] != f32_to_f16_bits(probes[i]) && bad++ == 0) first = i;
    char what[256];
    int at = snprintf(what, sizeof what, "%s f16 row writer rounds like the compiler's _Float16 (nearest even) around every half",
                      K.op.name);
    if (bad) /* which input, so that a failure tells a rounding mode from a denormal or a NaN case */
        snprintf(what + at, sizeof what - at, ": %d of %d differ, the first %a gave 0x%04x, not 0x%04x", bad, n,
                 (double)probes[first], got[first], f32_to_f16_bits(probes[first]));
    check(bad == 0, what);
}

/* Activation quantizers: bit for bit the scalar set's (ties away from zero
   like roundf), and for the scalar one |x - d*q| <= d/2, s = d*sum(q). */
static void test_quantize_act(int set)
{
    enum { N = 4096 };
    static float x[N], ties[N];
    static BlockQ8A q[N / QK], q2[N / QK];
    for (int i = 0; i < N; i++) x[i] = frand() * (i % 97 == 0 ? 50 : 1);
    for (int i = 0; i < QK; i++) x[i] = 0; /* an all-zero block */
    for (int i = 0; i < N; i++) ties[i] = (i % QK == 0) ? 127.0f : (float)((i % 255) - 127) * 0.5f; /* exact .5 ties */
    char what[128];
    for (int a = ACT_F32 + 1; a < N_ACTS && set != KSET_SCALAR; a++) {
        int same = 1;
        for (int n = N; n >= N - QK_K; n -= QK_K) { /* 128 blocks of 32, and 120: a rest past groups of 16 blocks */
            SETS[KSET_SCALAR]->op.quantize[a](q, x, n);
            K.op.quantize[a](q2, x, n);
            same &= memcmp(q, q2, act_bytes(a, n)) == 0;
            SETS[KSET_SCALAR]->op.quantize[a](q, ties, n);
            K.op.quantize[a](q2, ties, n);
            same &= memcmp(q, q2, act_bytes(a, n)) == 0;
        }
        snprintf(what, sizeof what, "%s activation format %d quantizer equals scalar bit for bit (ties too, two lengths)", K.op.name, a);
        check(same, what);
    }
    /* Damaged weights make NaN and inf activations: the quantizers must
       still agree and keep every int8 and block sum in range (an INT_MIN
       sum overflowed offset * sum in the packed kernels). */
    static float bad[N];
    for (int i = 0; i < N; i++) bad[i] = frand();
    for (int b = 0; b < N / QK; b++) {
        float v = b % 4 == 0 ? NAN : b % 4 == 1 ? INFINITY : b % 4 == 2 ? -INFINITY : 3e38f;
        bad[b * QK + (b * 7) % QK] = v;
        if (b % 8 == 0) for (int i = 0; i < QK; i++) bad[b * QK + i] = NAN;
    }
    for (int a = ACT_F32 + 1; a < N_ACTS; a++) {
        SETS[KSET_SCALAR]->op.quantize[a](q, bad, N);
        K.op.quantize[a](q2, bad, N);
        int same = memcmp(q, q2, act_bytes(a, N)) == 0, in_range = 1;
        for (int b = 0; a == ACT_Q8 && b < N / QK; b++) {
            int sum = 0;
            for (int i = 0; i < QK; i++) sum += q2[b].qs[i], in_range &= q2[b].qs[i] >= -127;
            in_range &= q2[b].sum == sum;
            if (b % 4 == 0) in_range &= q2[b].d != q2[b].d; /* a NaN is not dropped: the block's scale is NaN */
        }
        snprintf(what, sizeof what, "%s activation format %d quantizer on NaN and inf equals scalar, sums in range, NaN kept", K.op.name, a);
        check(same && in_range, what);
    }
    if (set != KSET_SCALAR) return;
    quantize_act_scalar(q, x, N);
    int ok = 1;
    for (int i = 0; i < N; i++) {
        const BlockQ8A *b = &q[i / QK];
        if (fabsf(x[i] - b->d * b->qs[i % QK]) > b->d * 0.5f * 1.0001f + 1e-30f) ok = 0;
    }
    for (int k = 0; k < N / QK; k++) {
        int sum = 0;
        for (int i = 0; i < QK; i++) sum += q[k].qs[i];
        if (fabsf(q[k].s - q[k].d * sum) > 1e-6f * fabsf(q[k].d * sum) + 1e-30f) ok = 0;
    }
    check(ok, "int8 activation quantization error <= d/2 per element, s = d*sum(q)");
    static BlockQ8K qk[N / QK_K];
    quantize_act_k_scalar(qk, x, N);
    ok = 1;
    for (int i = 0; i < N; i++) {
        const BlockQ8K *b = &qk[i / QK_K];
        if (fabsf(x[i] - b->d * b->qs[i % QK_K]) > b->d * 0.5f * 1.0001f + 1e-30f) ok = 0;
    }
    for (int g = 0; g < N / 16; g++) {
        int sum = 0;
        for (int i = 0; i < 16; i++) sum += qk[g / (QK_K / 16)].qs[g % (QK_K / 16) * 16 + i];
        if (sum != qk[g / (QK_K / 16)].bsums[g % (QK_K / 16)]) ok = 0;
    }
    check(ok, "int8 activation quantization per 256 (K types): error <= d/2 per element, bsums = sums of each 16");
}

/* Prefill's multi-query kernels (scores of nq queries against nk key rows,
   and nq weighted sums of V rows) against the scalar set's, for each cache
   type they read in place: head sizes of SmolLM2 (64) and Gemma 3 (256)
   and odd ones that take the SIMD tails (whole 16s plus 8, plus 2, and
   less than one vector), query counts on and off the register tile, key
   counts from 1 to a whole block. The rows sit in a shuffled order in
   their pool, as a paged or ring cache may hand them. */
static void test_attention_multi(void)
{
    enum { HD = 256, NQ = 13, OS = HD + 2 };
    static float q[NQ * HD], p[NQ * ATT_KTILE], sref[NQ * ATT_KTILE], sgot[NQ * ATT_KTILE], oref[NQ * OS], ogot[NQ * OS];
    static uint8_t kpool[ATT_KTILE * HD * 4], vpool[ATT_KTILE * HD * 4];
    const int types[] = {T_F32, T_F16}, hds[] = {64, 256, 136, 130, 72, 18, 2}, nqs[] = {1, 3, 4, 7, NQ}, nks[] = {1, 7, 33, ATT_KTILE};
    const OpKernels *ref = &SETS[KSET_SCALAR]->op;
    for (int ti = 0; ti < 2; ti++) {
        double worst_s = 0, worst_a = 0;
        int type = types[ti];
        for (size_t a = 0; a < sizeof hds / sizeof *hds; a++) {
            int hd = hds[a];
            size_t rb = row_bytes(type, hd);
            const void *k[ATT_KTILE], *v[ATT_KTILE];
            random_rows(kpool, type, hd, ATT_KTILE);
            random_rows(vpool, type, hd, ATT_KTILE);
            for (int j = 0; j < ATT_KTILE; j++) k[j] = kpool + (j * 37 % ATT_KTILE) * rb, v[j] = vpool + (j * 23 % ATT_KTILE) * rb;
            for (int i = 0; i < NQ * HD; i++) q[i] = frand();
            for (int i = 0; i < NQ * ATT_KTILE; i++) p[i] = (frand() + 1) / 2;
            for (int b = 0; b < 5; b++)
                for (int c = 0; c < 4; c++) {
                    int nq = nqs[b], nk = nks[c];
                    ref->att_qk(sref, q, nq, k, type, hd, nk);
                    K.op.att_qk(sgot, q, nq, k, type, hd, nk);
                    for (int i = 0; i < NQ * OS; i++) oref[i] = ogot[i] = frand();
                    ref->att_pv(oref, OS, p, nq, v, type, hd, nk);
                    K.op.att_pv(ogot, OS, p, nq, v, type, hd, nk);
                    for (int r = 0; r < nq; r++)
                        for (int j = 0; j < nk; j++) worst_s = fmax(worst_s, fabs(sgot[r * ATT_KTILE + j] - sref[r * ATT_KTILE + j]) / hd);
                    /* every float of the buffer: the outputs, and the untouched rest (other queries, the gap) */
                    for (int i = 0; i < NQ * OS; i++) worst_a = fmax(worst_a, fabs(ogot[i] - oref[i]) / nk);
                }
        }
        char what[160];
        snprintf(what, sizeof what, "%s %s multi-query attention scores vs scalar: worst |diff| / hd = %.2e", K.op.name,
                 TYPES[type].name, worst_s);
        check(worst_s < 1e-6, what);
        snprintf(what, sizeof what, "%s %s multi-query weighted V sums vs scalar: worst |diff| / n = %.2e", K.op.name,
                 TYPES[type].name, worst_a);
        check(worst_a < 1e-6, what);
    }
}

/* The multi-query kernels give a query the same scores and the same
   output sums however many queries share the call and wherever it sits in
   the register tile: decode's call (one token's group of heads) and
   prefill's (a tile of tokens) must agree bit for bit for attention to be
   the same in every path. Each query alone against all 13 at once. */
static void test_attention_tile_independent(void)
{
    enum { HD = 136, NQ = 13, OS = HD + 2, NK = 37 };
    static float q[NQ * HD], p[NQ * ATT_KTILE], s_all[NQ * ATT_KTILE], s_one[NQ * ATT_KTILE], o_all[NQ * OS], o_one[NQ * OS];
    static uint8_t kpool[ATT_KTILE * HD * 4], vpool[ATT_KTILE * HD * 4];
    const int types[] = {T_F32, T_F16};
    int same = 1;
    for (int ti = 0; ti < 2; ti++) {
        int type = types[ti];
        size_t rb = row_bytes(type, HD);
        const void *k[ATT_KTILE], *v[ATT_KTILE];
        random_rows(kpool, type, HD, NK);
        random_rows(vpool, type, HD, NK);
        for (int j = 0; j < NK; j++) k[j] = kpool + j * rb, v[j] = vpool + j * rb;
        for (int i = 0; i < NQ * HD; i++) q[i] = frand();
        for (int i = 0; i < NQ * ATT_KTILE; i++) p[i] = (frand() + 1) / 2;
        for (int i = 0; i < NQ * OS; i++) o_all[i] = o_one[i] = frand();
        K.op.att_qk(s_all, q, NQ, k, type, HD, NK);
        K.op.att_pv(o_all, OS, p, NQ, v, type, HD, NK);
        for (int a = 0; a < NQ; a++) {
            K.op.att_qk(s_one + a * ATT_KTILE, q + (size_t)a * HD, 1, k, type, HD, NK);
            K.op.att_pv(o_one + (size_t)a * OS, OS, p + a * ATT_KTILE, 1, v, type, HD, NK);
            same &= memcmp(s_one + a * ATT_KTILE, s_all + a * ATT_KTILE, NK * sizeof(float)) == 0;
            same &= memcmp(o_one + (size_t)a * OS, o_all + (size_t)a * OS, HD * sizeof(float)) == 0;
        }
    }
    char what[160];
    snprintf(what, sizeof what, "%s multi-query attention: a query's scores and V sums do not depend on the call's other queries", K.op.name);
    check(same, what);
}

/* Attention of a whole pass (attention) on a synthetic cache: the
   pass of N consecutive tokens (prefill's path, query tiles) against the
   same tokens one pass each (decode's path, chunks of ATT_CHUNK folded in
   order): bit for bit equal in every set; and against attend, the
   definition, within float rounding. Grouped heads, a sliding window over
   a ring-buffer cache, contexts that cross ATT_CHUNK boundaries, each
   cache type. */
static void test_attention_paths(void)
{
    static const struct { int hd, heads, kv_heads, window, prev, type; } CASES[] = {
        {64, 9, 3, 0, 290, T_F16}, {256, 4, 1, 50, 120, T_F16}, {64, 9, 3, 0, 100, T_F32},
        {128, 12, 2, 0, 240, T_Q8_0}, {72, 6, 2, 300, 500, T_F32}, {64, 4, 2, 0, 20, T_Q4_0},
    };
    enum { N = 37 };
    double worst = 0;
    int same = 1;
    for (size_t ci = 0; ci < sizeof CASES / sizeof *CASES; ci++) {
        int hd = CASES[ci].hd, total = CASES[ci].prev + N;
        Config c = {.head_dim = hd, .n_heads = CASES[ci].heads, .n_kv_heads = CASES[ci].kv_heads, .n_layers = 1,
                    .window = CASES[ci].window, .att_scale = 1 / sqrtf((float)hd)};
        /* a local layer's ring holds window + CHUNK_TOKENS positions: a pass's own rows never evict one it reads */
        int cap = c.window ? c.window + CHUNK_TOKENS : total, qkv_dim = (c.n_heads + 2 * c.n_kv_heads) * hd, q_dim = c.n_heads * hd;
        size_t off = 0;
        RunState s = {.kv_type = CASES[ci].type, .kv_row = row_bytes(CASES[ci].type, hd), .kv_cap = &cap, .kv_off = &off,
                      .seq_len = total + 1, .c = &c};
        s.mx = build_machinery(&c, s.seq_len, 1); /* a team of one thread */
        Matrix wo = {.part = {{.type = T_F32}}, .n_parts = 1, .cols = q_dim}; /* reads floats: attention's output unconverted */
        s.key_cache = calloc((size_t)c.n_kv_heads * cap, s.kv_row), s.value_cache = calloc((size_t)c.n_kv_heads * cap, s.kv_row);
        s.qkv = calloc((size_t)N * qkv_dim, sizeof(float)), s.tok_pos = calloc(N, sizeof(int)), s.xb = calloc((size_t)N * q_dim, sizeof(float));
        float *row = calloc(hd, sizeof(float)), *batched = calloc((size_t)N * q_dim, sizeof(float)), *plain = calloc(hd, sizeof(float));
        float *qkv = calloc((size_t)N * qkv_dim, sizeof(float));
        for (size_t i = 0; i < (size_t)N * qkv_dim; i++) qkv[i] = frand() * 2;
        for (int pos = 0; pos < total; pos++) /* the cache in position order, as the passes write it */
            for (int g = 0; g < c.n_kv_heads; g++)
                for (int kv = 0; kv < 2; kv++) {
                    for (int i = 0; i < hd; i++) row[i] = frand() * 2;
                    SETS[KSET_SCALAR]->type[s.kv_type].from_float(cache_row(&s, kv ? s.value_cache : s.key_cache, 0, 0, g, pos), row, hd);
                }
        memcpy(s.qkv, qkv, (size_t)N * qkv_dim * sizeof(float));
        for (int t = 0; t < N; t++) s.tok_pos[t] = CASES[ci].prev + t;
        attention(&s, 0, N, &wo);
        memcpy(batched, s.xb, (size_t)N * q_dim * sizeof(float));
        for (int t = 0; t < N; t++) {
            memcpy(s.qkv, qkv + (size_t)t * qkv_dim, qkv_dim * sizeof(float));
            s.tok_pos[0] = CASES[ci].prev + t;
            attention(&s, 0, 1, &wo);
            same &= memcmp(s.xb, batched + (size_t)t * q_dim, q_dim * sizeof(float)) == 0;
            for (int h = 0; h < c.n_heads; h++) {
                attend(&s, 0, 0, h, plain, thread_scratch(&s));
                for (int i = 0; i < hd; i++) worst = fmax(worst, fabs(plain[i] - s.xb[h * hd + i]));
            }
        }
        free(s.key_cache), free(s.value_cache), free(s.qkv), free(s.tok_pos), free(s.xb), free_machinery(s.mx);
        free(row), free(batched), free(plain), free(qkv);
    }
    char what[200];
    snprintf(what, sizeof what, "%s attention: a pass of %d tokens equals %d one-token passes bit for bit", K.op.name, N, N);
    check(same, what);
    snprintf(what, sizeof what, "%s attention vs its definition (attend): worst |diff| of an output %.2e", K.op.name, worst);
    check(worst < 1e-5, what);
}

/* The online-softmax step: the set's running maximum must equal the scalar
   one exactly, its exponentials (a polynomial, not libm's expf) agree
   within a few ulp, and so does the sum; every score count takes the
   vector body and the scalar tail. */
static void test_softmax(void)
{
    float ref[ATT_KTILE], got[ATT_KTILE];
    double worst_e = 0, worst_s = 0;
    int ns[] = {1, 7, 8, 33, ATT_KTILE}, max_ok = 1;
    for (size_t c = 0; c < sizeof ns / sizeof *ns; c++)
        for (int rep = 0; rep < 50; rep++) {
            int n = ns[c];
            float m0 = rep % 2 ? -INFINITY : frand() * 20, mr = m0, mg = m0;
            for (int j = 0; j < n; j++) ref[j] = got[j] = frand() * 40;
            double sr = SETS[KSET_SCALAR]->op.att_softmax(ref, n, 0.125f, &mr), sg = K.op.att_softmax(got, n, 0.125f, &mg);
            if (mr != mg) max_ok = 0;
            for (int j = 0; j < n; j++) worst_e = fmax(worst_e, fabs(got[j] - ref[j]) / fmax(ref[j], 1e-30));
            worst_s = fmax(worst_s, fabs(sg - sr) / sr);
        }
    char what[128];
    snprintf(what, sizeof what, "%s softmax step: running maximum equal to the scalar one", K.op.name);
    check(max_ok, what);
    snprintf(what, sizeof what, "%s softmax step exp(score - max) vs expf: worst relative diff %.2e, sums %.2e", K.op.name, worst_e, worst_s);
    check(worst_e < 5e-7 && worst_s < 1e-6, what);
}

/* The FFN gates (SwiGLU, GeGLU): the set's against the scalar ones over
   gate values wide enough to reach both ends of the exponential (and the
   scalar tail). GeGLU's tanh is rebuilt from exp in the SIMD versions, so
   near 0 its error is compared to |x u| rather than to the tiny result. */
static void test_gates(void)
{
    enum { N = 1003 };
    static float g[N], u[N], ref[N], x[N];
    void (*const sets[2][2])(float *, const float *, int) = {{SETS[KSET_SCALAR]->op.swiglu, K.op.swiglu},
                                                             {SETS[KSET_SCALAR]->op.geglu, K.op.geglu}};
    static const char *const names[] = {"swiglu", "geglu"};
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < N; i++) x[i] = g[i] = ref[i] = frand() * (i % 3 ? 8 : 120), u[i] = frand() * 4;
        sets[k][0](ref, u, N);
        sets[k][1](g, u, N);
        double worst = 0;
        /* exp_avx2 reaches inf a little before expf (see it), so a gate near -88.5
           gives 0 against expf's ~1e-36: a difference that small is no error */
        for (int i = 0; i < N; i++)
            if (fabs(g[i] - ref[i]) > 1e-30) worst = fmax(worst, fabs(g[i] - ref[i]) / fabs(k ? x[i] * u[i] : ref[i]));
        char what[128];
        snprintf(what, sizeof what, "%s %s vs scalar: worst relative diff %.2e", K.op.name, names[k], worst);
        check(worst < 1e-6, what);
    }
}

#ifdef HAVE_AVX512_SET
/* The AVX-512 gates take the AVX2 ones' steps 16 lanes at a time, so they
   give the AVX2 set's numbers bit for bit, ends and tails included (n not
   a multiple of 16 or 8). */
static void test_gates_avx512_as_avx2(void)
{
    enum { N = 1003 };
    static float g[N], u[N], ref[N];
    const OpKernels *wide = &SETS[KSET_AVX512]->op, *avx2 = &SETS[KSET_AVX2]->op;
    void (*const pairs[2][2])(float *, const float *, int) = {{avx2->swiglu, wide->swiglu}, {avx2->geglu, wide->geglu}};
    static const char *const names[] = {"swiglu", "geglu"};
    for (int k = 0; k < 2; k++) {
        int same = 1;
        for (int n = N - 16; n <= N; n++) {
            for (int i = 0; i < n; i++) g[i] = ref[i] = frand() * (i % 3 ? 8 : 120), u[i] = frand() * 4;
            g[0] = ref[0] = -90, g[1] = ref[1] = 90, g[2] = ref[2] = 0; /* both ends of exp, and a zero gate */
            pairs[k][0](ref, u, n);
            pairs[k][1](g, u, n);
            same &= !memcmp(g, ref, n * sizeof(float));
        }
        char what[96];
        snprintf(what, sizeof what, "avx512 %s equal to avx2's bit for bit, 987 to 1003 elements", names[k]);
        check(same, what);
    }
}
#endif

#ifdef HAVE_X86_SETS
TARGET_BEGIN(ISA_AVX2)
/* The AVX2 set's exp alone against expf on [-100, 100]: within a few ulp
   on [-87.3, 88.3], 0 below, inf above. */
static void test_exp_avx2(void)
{
    double worst = 0;
    int ends_ok = 1;
    for (float x = -100.0f; x <= 100.0f; x += 0.00137f) {
        float v[8], e = expf(x);
        _mm256_storeu_ps(v, exp_avx2(_mm256_set1_ps(x)));
        if (x < -87.34f) ends_ok &= v[0] == 0;
        else if (x > 88.38f) ends_ok &= isinf(v[0]);
        else if (e >= 1e-37f && x <= 88.37f) worst = fmax(worst, fabs(v[0] - e) / e);
    }
    char what[128];
    snprintf(what, sizeof what, "avx2 vector exp on [-87.3, 88.3] vs expf: worst relative diff %.2e; 0 below, inf above", worst);
    check(worst < 5e-7 && ends_ok, what);
}
TARGET_END
#endif

int main(int argc, char **argv)
{
    int list = argc == 2 && !strcmp(argv[1], "--list"), ran = 0;
    const char *only = argc == 3 && !strcmp(argv[1], "--only") ? argv[2] : NULL;
    if (argc > 1 && !list && !only) { fprintf(stderr, "usage: %s [--list | --only SET]\n", argv[0]); return 2; }
    for (int set = 0; set < N_KSETS; set++) {
        if (!SETS[set]) { printf("skip kernel set %d: not compiled in this build\n", set); continue; }
        if (only && strcmp(SETS[set]->op.name, only)) { printf("skip kernel set %s: not the one asked for\n", SETS[set]->op.name); continue; }
        if (!kernel_set_available(set)) { printf("skip kernel set %s: this CPU cannot run it\n", SETS[set]->op.name); continue; }
        printf("kernels: %s\n", SETS[set]->op.name);
        if (list) { ran++; continue; }
        select_kernels(set);
        test_fp16(set);
        test_quantize_act(set);
        test_attention_paths();
        test_packed();
        test_packed_wide();
        ran++;
        if (set == KSET_SCALAR) continue; /* the reference itself: the rest compares other sets to it */
        test_types();
        test_attention_multi();
        test_attention_tile_independent();
        test_softmax();
        test_gates();
    }
    if (list) { printf("%d kernel sets found (--list: none tested)\n", ran); return 0; }
#ifdef HAVE_X86_SETS
    if (kernel_set_available(KSET_AVX2) && (!only || !strcmp(only, "avx2"))) test_exp_avx2();
#endif
#ifdef HAVE_AVX512_SET
    if (kernel_set_available(KSET_AVX512) && (!only || !strcmp(only, "avx512"))) test_gates_avx512_as_avx2();
#endif
    if (only && !ran) failures++, printf("FAIL --only %s: no such set runs here\n", only);
    printf("%d kernel sets tested\n%s\n", ran, failures ? "FAILED" : "all kernel checks passed");
    return failures != 0;
}
