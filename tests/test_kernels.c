/* Kernel tests: every SIMD kernel against its scalar reference (dot
   products, prefill's register tiles and decode's GEMV tiles, the attention
   kernels, the softmax step and its vector exp, SwiGLU, KV row
   conversion), the f16 conversions against the compiler's over every half,
   and the int8 activation quantizer's error bound. Includes run.c whole so
   the static kernels are reachable; prints one line per check and exits 1
   if any failed.  Build: cc -O2 -march=native -I. tests/test_kernels.c tokenizer.c -lm */
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

/* Random weight rows of every type, one float activation row; compares the
   dot products of the SIMD kernel to the scalar one. */
static void test_dots(void)
{
    enum { N = 1536, ROWS = 64 };
    static float x[N];
    static BlockQ8A xq[N / QK];
    static uint8_t w[ROWS * N * 4];
    int types[] = {T_F32, T_F16, T_BF16, T_Q8_0, T_Q4_1};
    for (int i = 0; i < N; i++) x[i] = frand() * 3;
    quantize_act(xq, x, N);
    for (size_t i = 0; i < sizeof types / sizeof *types; i++) {
        int type = types[i];
        size_t rb = row_bytes(type, N);
        for (size_t b = 0; b < rb * ROWS; b++) w[b] = random_u32(&rng);
        for (int r = 0; r < ROWS; r++) { /* sane scales: random bits would be inf/NaN */
            uint8_t *row = w + r * rb;
            for (int k = 0; k < N / QK; k++) {
                if (type == T_Q8_0) { BlockQ8_0 *bl = (BlockQ8_0 *)row + k; bl->d = f32_to_f16_bits(frand() * 0.01f); }
                if (type == T_Q4_1) { BlockQ4_1 *bl = (BlockQ4_1 *)row + k; bl->d = f32_to_f16_bits(frand() * 0.01f); bl->m = f32_to_f16_bits(frand() * 0.05f); }
            }
            if (type == T_F32) for (int j = 0; j < N; j++) ((float *)row)[j] = frand();
            if (type == T_F16) for (int j = 0; j < N; j++) ((uint16_t *)row)[j] = f32_to_f16_bits(frand());
            if (type == T_BF16) for (int j = 0; j < N; j++) { float f = frand(); uint32_t u; memcpy(&u, &f, 4); ((uint16_t *)row)[j] = u >> 16; }
        }
        DotKernels k = dot_kernels(type);
        const void *act = uses_int8_activations(type) ? (const void *)xq : (const void *)x;
        double worst = 0;
        for (int r = 0; r < ROWS && k.simd; r++) {
            double a = k.scalar(w + r * rb, act, N), b = k.simd(w + r * rb, act, N);
            double mag = 0; /* sum of |terms| bounds the rounding error of either order */
            for (int j = 0; j < N; j++) mag += fabs(x[j]);
            worst = fmax(worst, fabs(a - b) / (mag + 1e-30));
        }
        char what[128];
        snprintf(what, sizeof what, "dot %-4s simd vs scalar: worst |diff| / sum|x| = %.2e%s", type_name(type), worst, k.simd ? "" : " (no SIMD compiled)");
        check(worst < 1e-6, what);
    }
}

/* Integer part exactly: with d = 1 scales, both kernels must return the
   exact integer sum. */
static void test_int_exact(void)
{
    enum { N = 576 };
    static BlockQ8A xq[N / QK];
    static BlockQ8_0 w8[N / QK];
    static BlockQ4_1 w4[N / QK];
    long ref8 = 0, ref4 = 0;
    for (int k = 0; k < N / QK; k++) {
        xq[k].d = 1; w8[k].d = f32_to_f16_bits(1); w4[k].d = f32_to_f16_bits(1); w4[k].m = 0; xq[k].s = 0;
        for (int i = 0; i < QK; i++) {
            xq[k].qs[i] = (int8_t)(random_u32(&rng) % 255 - 127);
            w8[k].qs[i] = (int8_t)(random_u32(&rng) % 255 - 127);
            ref8 += xq[k].qs[i] * w8[k].qs[i];
        }
        for (int j = 0; j < QK / 2; j++) {
            w4[k].qs[j] = random_u32(&rng);
            ref4 += (w4[k].qs[j] & 15) * xq[k].qs[j] + (w4[k].qs[j] >> 4) * xq[k].qs[j + 16];
        }
    }
    DotKernels k8 = dot_kernels(T_Q8_0), k4 = dot_kernels(T_Q4_1);
    check(k8.scalar(w8, xq, N) == (float)ref8, "q8_0 scalar integer sum exact");
    check(k4.scalar(w4, xq, N) == (float)ref4, "q4_1 scalar integer sum exact");
    if (k8.simd) check(k8.simd(w8, xq, N) == (float)ref8, "q8_0 simd integer sum exact");
    if (k4.simd) check(k4.simd(w4, xq, N) == (float)ref4, "q4_1 simd integer sum exact");
}

static void test_fp16(void)
{
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        _Float16 ref;
        uint16_t hb = (uint16_t)h;
        memcpy(&ref, &hb, 2);
        float a = fp16_to_f32_scalar(hb), b = (float)ref;
        if (memcmp(&a, &b, 4) != 0 && !(isnan(a) && isnan(b))) bad++;
    }
    check(bad == 0, "fp16_to_f32_scalar equals the compiler's _Float16 conversion on all 65536 inputs");
    /* float -> half: every half's neighbourhood (exact values, midpoints, just off them) */
    bad = 0;
    for (uint32_t h = 0; h < 0x7c00; h++) {
        float lo = fp16_to_f32_scalar((uint16_t)h), hi = fp16_to_f32_scalar((uint16_t)(h + 1)), mid = (lo + hi) / 2;
        float probes[] = {lo, mid, nextafterf(mid, 0), nextafterf(mid, 1e9f), -lo, -mid};
        for (int i = 0; i < 6; i++)
            if (f32_to_fp16_scalar(probes[i]) != f32_to_f16_bits(probes[i]) || f32_to_fp16(probes[i]) != f32_to_f16_bits(probes[i])) bad++;
    }
    float specials[] = {INFINITY, -INFINITY, 65520.0f, 1e10f, -1e-10f, 0.0f, -0.0f, NAN};
    for (int i = 0; i < 8; i++)
        if (f32_to_fp16_scalar(specials[i]) != f32_to_f16_bits(specials[i]) || f32_to_fp16(specials[i]) != f32_to_f16_bits(specials[i])) bad++;
    check(bad == 0, "f32_to_fp16 (scalar, and F16C when compiled) rounds like the compiler's _Float16 (nearest even) around every half");
}

/* |x - d*q| <= d/2 per element (plus float slack), and s = d * sum(q). */
static void test_quantize_act(void)
{
    enum { N = 4096 };
    static float x[N];
    static BlockQ8A q[N / QK];
    for (int i = 0; i < N; i++) x[i] = frand() * (i % 97 == 0 ? 50 : 1);
    for (int i = 0; i < QK; i++) x[i] = 0; /* an all-zero block */
    quantize_act_scalar(q, x, N);
#ifdef HAVE_AVX2
    static BlockQ8A q2[N / QK];
    static float ties[N];
    quantize_act_avx2(q2, x, N);
    check(memcmp(q, q2, sizeof q) == 0, "quantize_act avx2 equals scalar bit for bit");
    for (int i = 0; i < N; i++) ties[i] = (i % QK == 0) ? 127.0f : (float)((i % 255) - 127) * 0.5f; /* exact .5 ties */
    quantize_act_scalar(q, ties, N);
    quantize_act_avx2(q2, ties, N);
    check(memcmp(q, q2, sizeof q) == 0, "quantize_act avx2 rounds ties away from zero like roundf");
    quantize_act_scalar(q, x, N);
#endif
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
}

/* Register tiles (prefill's, and decode's several rows of one token)
   against the scalar dot product of every (row, token) pair they cover. */
static void test_tiles(void)
{
    enum { N = 576, ROWS = 4, TOKS = 4 }; /* room for either tile shape */
    static float x[TOKS][N];
    static BlockQ8A xq[TOKS][N / QK];
    static uint8_t w[ROWS][N * 4];
    int types[] = {T_F32, T_F16, T_BF16, T_Q8_0, T_Q4_1};
    for (int t = 0; t < TOKS; t++) {
        for (int i = 0; i < N; i++) x[t][i] = frand();
        quantize_act_scalar(xq[t], x[t], N);
    }
    for (size_t i = 0; i < sizeof types / sizeof *types; i++) {
        int type = types[i];
        size_t rb = row_bytes(type, N);
        for (int r = 0; r < ROWS; r++) {
            for (size_t b = 0; b < rb; b++) w[r][b] = random_u32(&rng);
            for (int k = 0; k < N / QK; k++) {
                if (type == T_Q8_0) ((BlockQ8_0 *)w[r])[k].d = f32_to_f16_bits(frand() * 0.01f);
                if (type == T_Q4_1) { ((BlockQ4_1 *)w[r])[k].d = f32_to_f16_bits(frand() * 0.01f); ((BlockQ4_1 *)w[r])[k].m = f32_to_f16_bits(frand() * 0.05f); }
            }
            for (int j = 0; j < N; j++) {
                float f = frand();
                uint32_t u;
                memcpy(&u, &f, 4);
                if (type == T_F32) ((float *)w[r])[j] = f;
                if (type == T_F16) ((uint16_t *)w[r])[j] = f32_to_f16_bits(f);
                if (type == T_BF16) ((uint16_t *)w[r])[j] = u >> 16;
            }
        }
        int int8 = uses_int8_activations(type);
        const uint8_t *act = int8 ? (const uint8_t *)xq : (const uint8_t *)x;
        size_t stride = int8 ? sizeof xq[0] : sizeof x[0];
        /* prefill's tile for every type; decode's several-row tile for the integer types */
        Tile tiles[2] = {tile_for(type, N), gemv_for(type)};
        for (int which = 0; which < 1 + int8; which++) {
            Tile tile = tiles[which];
            double worst = 0;
            if (tile.fn) {
                float out[MAX_TILE];
                check(tile.rows <= ROWS && tile.toks <= TOKS, "tile fits the test's buffers");
                tile.fn(w[0], sizeof w[0], act, stride, N, out);
                for (int r = 0; r < tile.rows; r++)
                    for (int t = 0; t < tile.toks; t++) {
                        double ref = dot_kernels(type).scalar(w[r], act + t * stride, N);
                        worst = fmax(worst, fabs(out[r * tile.toks + t] - ref) / N);
                    }
            }
            char what[128];
            snprintf(what, sizeof what, "%s %-4s (%dx%d) vs scalar dot: worst |diff| / n = %.2e%s", which ? "gemv" : "tile",
                     type_name(type), tile.rows, tile.toks, worst, tile.fn ? "" : " (not compiled)");
            check(worst < 1e-6, what);
        }
    }
}

/* Prefill attention kernels (scores against a transposed K block, weighted
   sum of V rows) against their scalar references, over head sizes that
   take every path of the SIMD code (32s, 8s, a scalar tail). */
static void test_attention(void)
{
    static float q[MAX_HD], kt[MAX_HD * ATT_KTILE], v[ATT_KTILE * MAX_HD], p[ATT_KTILE];
    int hds[] = {64, 72, 18, 2}, ns[] = {1, 7, 33, ATT_KTILE};
    double worst_s = 0, worst_a = 0, worst_r = 0;
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 4; b++) {
            int hd = hds[a], n = ns[b];
            for (int i = 0; i < hd; i++) q[i] = frand();
            for (int i = 0; i < hd * ATT_KTILE; i++) kt[i] = frand(), v[i] = frand();
            for (int j = 0; j < n; j++) p[j] = (frand() + 1) / 2;
            float ref[ATT_KTILE], got[ATT_KTILE], oref[MAX_HD], ogot[MAX_HD], rref[ATT_KTILE], rgot[ATT_KTILE];
            att_scores_scalar(ref, q, kt, hd, n);
            att_scores_rows_scalar(rref, q, v, hd, n); /* v as row-major keys */
            for (int i = 0; i < hd; i++) oref[i] = ogot[i] = frand();
            att_accum_scalar(oref, p, v, hd, n);
#ifdef HAVE_AVX2
            att_scores_avx2(got, q, kt, hd, n);
            att_accum_avx2(ogot, p, v, hd, n);
            att_scores_rows_avx2(rgot, q, v, hd, n);
#else
            memcpy(rgot, rref, sizeof rref);
            memcpy(got, ref, sizeof ref);
            memcpy(ogot, oref, sizeof oref);
#endif
            for (int j = 0; j < n; j++) worst_s = fmax(worst_s, fabs(got[j] - ref[j]) / hd);
            for (int i = 0; i < hd; i++) worst_a = fmax(worst_a, fabs(ogot[i] - oref[i]) / n);
            for (int j = 0; j < n; j++) worst_r = fmax(worst_r, fabs(rgot[j] - rref[j]) / hd);
        }
    char what[128];
    snprintf(what, sizeof what, "attention scores vs scalar: worst |diff| / hd = %.2e", worst_s);
    check(worst_s < 1e-6, what);
    snprintf(what, sizeof what, "attention weighted V sum vs scalar: worst |diff| / n = %.2e", worst_a);
    check(worst_a < 1e-6, what);
    snprintf(what, sizeof what, "attention scores, keys as rows (decode) vs scalar: worst |diff| / hd = %.2e", worst_r);
    check(worst_r < 1e-6, what);
}

/* The online-softmax step: the SIMD version's maximum must equal the
   scalar one exactly, its exponentials (a polynomial, not libm's expf)
   agree within a few ulp, and so does the sum; every score size takes the
   vector body and the scalar tail. Also the vector exp alone against expf
   on [-100, 100]: within a few ulp on [-87.3, 88.3], 0 below, inf above. */
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
            double sr = att_softmax_scalar(ref, n, 0.125f, &mr), sg = sr;
#ifdef HAVE_AVX2
            sg = att_softmax_avx2(got, n, 0.125f, &mg);
#else
            memcpy(got, ref, sizeof ref);
            mg = mr;
#endif
            if (mr != mg) max_ok = 0;
            for (int j = 0; j < n; j++) worst_e = fmax(worst_e, fabs(got[j] - ref[j]) / fmax(ref[j], 1e-30));
            worst_s = fmax(worst_s, fabs(sg - sr) / sr);
        }
    check(max_ok, "softmax step: running maximum equal to the scalar one");
    char what[128];
    snprintf(what, sizeof what, "softmax step exp(score - max) vs expf: worst relative diff %.2e, sums %.2e", worst_e, worst_s);
    check(worst_e < 5e-7 && worst_s < 1e-6, what);
#ifdef HAVE_AVX2
    double worst = 0;
    int ends_ok = 1;
    for (float x = -100.0f; x <= 100.0f; x += 0.00137f) {
        float v[8], e = expf(x);
        _mm256_storeu_ps(v, exp_avx2(_mm256_set1_ps(x)));
        if (x < -87.34f) ends_ok &= v[0] == 0;
        else if (x > 88.38f) ends_ok &= isinf(v[0]);
        else if (e >= 1e-37f && x <= 88.37f) worst = fmax(worst, fabs(v[0] - e) / e);
    }
    snprintf(what, sizeof what, "vector exp on [-87.3, 88.3] vs expf: worst relative diff %.2e; 0 below, inf above", worst);
    check(worst < 5e-7 && ends_ok, what);
#endif
}

/* SwiGLU: SIMD against scalar over gate values wide enough to reach both
   ends of the exponential (and the scalar tail). */
static void test_swiglu(void)
{
    enum { N = 1003 };
    static float g[N], u[N], ref[N];
    for (int i = 0; i < N; i++) g[i] = ref[i] = frand() * (i % 3 ? 8 : 120), u[i] = frand() * 4;
    swiglu_scalar(ref, u, N);
    swiglu(g, u, N);
    double worst = 0;
    for (int i = 0; i < N; i++) worst = fmax(worst, fabs(g[i] - ref[i]) / (fabs(ref[i]) + 1e-30));
    char what[128];
    snprintf(what, sizeof what, "swiglu simd vs scalar: worst relative diff %.2e", worst);
    check(worst < 1e-6, what);
}

/* Row conversion of the KV cache types: SIMD and scalar must agree exactly
   (each element is one conversion and at most one multiply). */
static void test_dequantize_rows(void)
{
    enum { N = 200 }; /* not a multiple of 8 or 32: the scalar tail runs too */
    static uint8_t row[N * 4];
    float ref[N], got[N];
    int types[] = {T_F16, T_Q8_0}, ok = 1;
    for (size_t i = 0; i < sizeof types / sizeof *types; i++) {
        int type = types[i], n = type == T_Q8_0 ? 192 : N;
        for (size_t b = 0; b < sizeof row; b++) row[b] = random_u32(&rng);
        for (int j = 0; j < n; j++) if (type == T_F16) ((uint16_t *)row)[j] = f32_to_f16_bits(frand() * 100);
        for (int k = 0; type == T_Q8_0 && k < n / QK; k++) ((BlockQ8_0 *)row)[k].d = f32_to_f16_bits(frand() * 0.01f);
        dequantize_row_scalar(ref, row, type, n);
#ifdef HAVE_AVX2
        dequantize_row_avx2(got, row, type, n);
#else
        memcpy(got, ref, sizeof ref);
#endif
        if (memcmp(ref, got, n * sizeof(float))) ok = 0;
    }
    check(ok, "KV row conversion (f16, q8_0): SIMD equals scalar bit for bit");
}

int main(void)
{
#ifdef HAVE_AVX2
    printf("kernels: AVX2 compiled in\n");
#else
    printf("kernels: scalar only\n");
#endif
    test_fp16();
    test_quantize_act();
    test_int_exact();
    test_dots();
    test_tiles();
    test_attention();
    test_softmax();
    test_swiglu();
    test_dequantize_rows();
    printf("%s\n", failures ? "FAILED" : "all kernel checks passed");
    return failures != 0;
}
