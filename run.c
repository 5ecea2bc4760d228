/* run.c — inference for transformer language models in one C file.

   USAGE
     ./run MODEL [-i PROMPT] [-n N] [-t TEMP] [-p TOPP] [-k TOPK] [-s SEED]
                 [-c] [-m chat] [--threads N] [--ctx N] [--kv TYPE] [--lookup N] [-v]
                 [--stop STR] [--json | --json-schema FILE] [--logprobs N]
                 [--min-p P] [--repeat-penalty R] [--repeat-last-n N]
                 [--presence-penalty X] [--frequency-penalty X] [--prompt-cache FILE]
     echo "PROMPT" | ./run MODEL
     ./run MODEL --batch FILE [--parallel B] [--kv-mem MB]   (one record per input line)

   MODEL is a file written by export.py (format: its manual, "The model file").
   The generated text, and nothing else, goes to stdout as it is produced;
   errors and -v statistics go to stderr. ./run -h lists every flag.

   HOW IT WORKS
     Part I, the engine, in plain C and in the order data flows:
     1. model file   mmap the file, read the header into Config and point the
                     weight structs into the mapping (no copy); the header
                     says which optional steps the model's family takes.
                     The threads then fill the mapping's page tables.
     2. math         the definitions: RMSNorm, softmax, RoPE, SwiGLU/GeGLU,
                     int8 activations, each weight type's dot product (f32
                     f16 bf16 q4_0 q4_1 q5_0 q5_1 q8_0 q4_k q5_k q6_k).
     3. forward      one function, forward(): embed -> every layer (norm,
                     QKV, RoPE, the KV cache, attention as three plain
                     loops in attend, the feed-forward) -> logits; its
                     steps share their work among the threads themselves
                     (PARALLEL_FOR). prefill takes the prompt in chunks,
                     decode_step one token.
     4. sampling     penalties, then greedy, or temperature, top-k, top-p,
                     min-p and a seeded RNG.
     5. generation   tokenize (-c: the chat template) -> prefill -> decode
                     loop -> text streamed whole UTF-8 characters at a time.
     6. main
     Part II, the machinery Part I calls by name: the checks of the model
     file (before section 1's values are used), the thread team, the
     packed layout, the kernel tables and sets, attention in chunks (what
     the SIMD sets run instead of attend, with the same results up to
     float rounding), measurement, stop strings, JSON (--json,
     --logprobs), the prompt cache, lookup decoding, chat and batch mode,
     perplexity, the command line; one appendix per instruction set (AVX2,
     AVX-VNNI, AVX-512, NEON), each kernel tested against its definition in
     Part I (tests/test_kernels.c).
     tests/ref_forward.py's forward() is the whole forward pass in about
     70 lines of numpy, with a few helpers.

   WHY PREFILL AND DECODE ARE DIFFERENT PROBLEMS
     Each weight matrix must stream from memory once per forward pass. In
     decode that pass serves one token: ~2 FLOPs per weight against 0.5-4
     bytes per weight read, far below what the cores could compute, so decode
     speed is set by memory bandwidth (bytes of weights / GB/s). Prefill
     reuses each weight tile across every prompt token in the batch, so the
     same bytes feed a batch's worth (72 tokens) more arithmetic and the limit
     becomes the cores' FLOP rate. That is why prefill tokens/s is many times
     decode tokens/s, why quantization (fewer bytes) speeds decode the most,
     and why checking several guessed tokens in one pass (lookup decoding)
     costs about one decode step.

   LIMITS
     Families llama (incl. Llama 3.x RoPE scaling), Qwen 2/2.5, Qwen 3 and
     Gemma 3 (what export.py's manual describes). One model per process.
     Build without OpenMP for a single-threaded binary with the same results.
*/
#define _GNU_SOURCE /* POSIX 2008, and sched_getaffinity for the default thread count */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "tokenizer.h"

#define VERSION "0.1.0"
#define FILE_MAGIC "LLMF"
#define FILE_VERSION 2 /* 2: matrices stored packed (version 1 stored them as rows: re-export) */
#define HEADER_BYTES 256
#define TENSOR_ENTRY_BYTES 80
#define TENSOR_NAME_BYTES 48
#define TENSOR_ALIGN 64
#define ARCH_LLAMA 1  /* architecture ids; 2 qwen2, 3 qwen3 between them */
#define ARCH_GEMMA3 4
#define FLAG_TIED_EMBEDDINGS 1u /* header flags (export.py's manual, "The model file") */
#define FLAG_QKV_BIAS 2u
#define FLAG_QK_NORM 4u
#define FLAG_POST_NORMS 8u
#define FLAG_ROPE_FREQS 16u
#define FLAG_SPLIT 32u
#define N_FLAGS 6
#define QK 32          /* elements per quantization block (q4_0 .. q8_0, their activations) */
#define QK_K 256       /* elements per K-type super-block (q4_k, q5_k, q6_k) and their activations */
#define K4_SUB 32      /* q4_k, q5_k: elements per sub-block (one scale and minimum) */
#define K6_SUB 16      /* q6_k: elements per sub-block (one scale; also a Q8_K sum's span) */
#define CHUNK_TOKENS 72 /* prefill batch: tokens pushed through a layer together (whole kernel calls of
                          PACK_TOKS; measured: +5-7% float prefill against 64) */
#define PPL_MIN_CTX 3 /* --ppl: the smallest window whose second half scores a token */
#define PPL_DEFAULT_CTX 512 /* --ppl's window when --ctx is not given */
#define MAX_SEQ (1 << 20)
#define ERR_BYTES 256
#define MSG_BYTES 4200 /* an error message: room for a path of PATH_MAX (4096) bytes */

/* ----------------------------------------------------------------------------
   Errors. A failure anywhere in loading or running prints one line to stderr
   and exits 1; usage errors exit 2. The message names what is wrong.
   ------------------------------------------------------------------------- */

#define EXIT_RUNTIME 1
#define EXIT_USAGE 2

static _Noreturn void die(int code, const char *fmt, ...); /* the message, escaped to one line (Part II, "errors") */
static void *xmalloc(size_t n);               /* malloc, or die */
static void *xcalloc(size_t n, size_t size);  /* calloc, or die */

/* Loader errors: the reason goes to err (ERR_BYTES) and the function
   returns -1; the caller frees what was built. A reason may quote bytes
   from a damaged file: one_line keeps it one line. */
static void one_line(char *s);
#define LOAD_FAIL(...) do { snprintf(err, ERR_BYTES, __VA_ARGS__); one_line(err); return -1; } while (0)

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* When the program started (main's first line) and when it wrote its
   first byte of text to stdout: -v's time to first byte, the TTFT a shell
   script sees. One program, one of each. */
static struct {
    double start_ms, first_text_ms;
} marks;

/* ############################################################################
   PART I: THE ENGINE
   ######################################################################### */

/* ============================================================================
   1. THE MODEL FILE
   One little-endian file written by export.py, mapped read-only: the weight
   structs point into the mapping. Zero padding only between its parts:
     [header: 256 bytes][tokenizer section][tensor table][tensor data ...]
   header        shape and family: the HDR_* fields below, read into Config
   tokenizer     at byte 256: a 64-byte header, then text offsets, types,
                 scores, merges, default system prompt and text blob, each
                 from a 4-byte boundary (tokenizer.c reads it)
   tensor table  at the next 64-byte boundary: n_tensors entries (ENT_*)
   tensor data   in table order, each at the 64-byte boundary after what
                 precedes it; the last tensor ends the file
   What is read here is used only after Part II ("validating the model
   file") has checked it: every field, size, offset, name and padding
   byte. export.py's manual, "The model file", has the whole format.
   ========================================================================= */

/* Tensor element types; ids and block layouts are ggml's, so quantized blocks
   can be copied from GGUF files bit for bit. */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30, N_TYPES };

/* The header's fields by byte offset: u32 unless marked; a family field
   (from HDR_EMBED_SCALE) of 0 means the value after "0:", llama's. */
enum {
    HDR_MAGIC = 0 /* FILE_MAGIC */, HDR_VERSION = 4, HDR_SIZE = 8 /* HEADER_BYTES */, HDR_ARCH = 12 /* ARCH_*, for -v */,
    HDR_DIM = 16,   /* dim, hidden_dim, n_layers, n_heads, n_kv_heads, head_dim, vocab_size, */
                    /* max_seq_len: HDR_SHAPE_FIELDS consecutive u32s from HDR_DIM */
    HDR_ROPE_THETA = 48 /* f32 */, HDR_NORM_EPS = 52 /* f32 */, HDR_FLAGS = 56 /* FLAG_* */,
    HDR_ACTIVATION = 60 /* GATE_* */, HDR_ROPE_DIM = 64, HDR_N_TENSORS = 68,
    HDR_TOK_OFFSET = 72, HDR_TOK_SIZE = 80, HDR_TABLE_OFFSET = 88, HDR_FILE_SIZE = 96, /* u64s */
    HDR_EMBED_SCALE = 104 /* f32, 0: 1 */, HDR_ATT_SCALE = 108 /* f32, 0: 1/sqrt(head_dim) */,
    HDR_WINDOW = 112 /* 0: no local layers */, HDR_WINDOW_PATTERN = 116 /* see Config */,
    HDR_ROPE_THETA_LOCAL = 120 /* f32, 0: rope_theta */, HDR_ROPE_SCALE = 124 /* f32, 0: 1 */,
    HDR_RESERVED = 128 /* up to HEADER_BYTES: zero */
};
#define HDR_SHAPE_FIELDS 8
/* ... of a tensor table entry (TENSOR_ENTRY_BYTES long): char[48] name, NUL-padded; u32 type (T_*),
   rows, cols (elements a row), layout; u64 offset of the data in the file, and its size */
enum { ENT_NAME = 0, ENT_TYPE = 48, ENT_ROWS = 52, ENT_COLS = 56, ENT_LAYOUT = 60, ENT_OFFSET = 64, ENT_SIZE = 72 };
enum { LAYOUT_ROWS, LAYOUT_PACKED, N_LAYOUTS }; /* a tensor's layout: the forward pass multiplies by packed ones */

typedef struct {
    const char *name;
    int type;
    int rows, cols;   /* cols elements a row */
    int layout;       /* LAYOUT_ROWS: row-major blocks; LAYOUT_PACKED: groups of PACK_ROWS rows (Part II, "the packed layout") */
    const void *data; /* points into the mapped file */
} Tensor;

typedef struct {
    int dim;          /* residual stream width */
    int hidden_dim;   /* FFN inner width */
    int n_layers;
    int n_heads;      /* query heads */
    int n_kv_heads;   /* key/value heads; n_heads / n_kv_heads queries share one */
    int head_dim;
    int rope_dim;     /* leading dims of each head that RoPE rotates */
    int vocab_size;
    int max_seq_len;  /* context length the model was trained for */
    float rope_theta;
    float norm_eps;
    /* What sets a model family apart from llama, read from the header's flags
       and fields (export.py's manual, "The model file"); zero/one values are llama's.
       forward takes each optional step when its switch is on. */
    int arch;         /* 1 llama, 2 qwen2, 3 qwen3, 4 gemma3: for -v; the switches below say what runs */
    uint32_t flags;   /* FLAG_* bits, as the header has them */
    int tied;         /* output head = token embedding */
    int qkv_bias;     /* Q, K, V projections add a bias (Qwen 2) */
    int qk_norm;      /* per-head RMSNorm of Q and K before RoPE (Qwen 3, Gemma 3) */
    int post_norms;   /* RMSNorm of the attention and FFN outputs before the residual adds (Gemma 3) */
    int rope_freqs;   /* per-pair RoPE frequency factors (Llama 3.x "llama3" scaling) */
    int split;        /* Q, K, V and gate, up stored as tensors of their own, not fused */
    int gate;         /* the FFN gate's activation: GATE_SILU (SwiGLU) or GATE_GELU (GeGLU, tanh form) */
    float embed_scale; /* embedding rows are multiplied by it (Gemma 3: sqrt(dim)) */
    float att_scale;  /* q.k is multiplied by it (usually 1/sqrt(head_dim)) */
    int window;       /* local layers: a query sees keys less than `window` positions back (0 = none) */
    int window_pattern; /* layer l is global when (l + 1) % pattern == 0, else local (when window > 0); 0: every layer local */
    float rope_theta_local; /* RoPE base of local layers */
    float rope_scale;  /* global layers: positions are divided by it (linear RoPE scaling) */
} Config;

enum { GATE_SILU, GATE_GELU };

/* A local (sliding-window) layer attends to the last c->window positions only. */
static int is_local(const Config *c, int l)
{
    return c->window > 0 && (c->window_pattern == 0 || (l + 1) % c->window_pattern != 0);
}

/* The weights of one matrix product: one tensor, or the parts of a fused
   projection (Q, K, V or gate, up) that a split file stores as tensors of
   their own, each in its own type. The parts' rows stack in order: row r
   of the matrix is row r - base of the part it falls in, base being the
   rows of the parts before it. All parts have `cols` columns and read one
   activation format, so one converted input serves them all. */
#define MAX_PARTS 3
typedef struct {
    Tensor part[MAX_PARTS];
    int n_parts;
    int rows, cols;   /* rows of all the parts together */
} Matrix;

typedef struct {
    Tensor attn_norm; /* [1, dim] */
    Matrix wqkv;      /* [q_dim + 2*kv_dim, dim]: Q rows, K rows, V rows (split: three parts) */
    Tensor bqkv;      /* [1, q_dim + 2*kv_dim] their biases (qkv_bias) */
    Tensor q_norm;    /* [1, head_dim] (qk_norm) */
    Tensor k_norm;    /* [1, head_dim] (qk_norm) */
    Matrix wo;        /* [dim, q_dim] */
    Tensor post_attn_norm; /* [1, dim] (post_norms) */
    Tensor ffn_norm;  /* [1, dim] */
    Matrix w13;       /* [2*hidden_dim, dim]: gate rows, then up rows (split: two parts) */
    Matrix w2;        /* [dim, hidden_dim] */
    Tensor post_ffn_norm;  /* [1, dim] (post_norms) */
} Layer;

typedef struct {
    Config c;
    Tensor tok_embeddings; /* [vocab, dim] */
    Layer *layers;         /* [n_layers] */
    Tensor norm;           /* [1, dim] */
    Matrix output;         /* [vocab, dim]; the embedding itself when tied */
    Tensor rope_freqs;     /* [1, rope_dim/2] frequency divisors (rope_freqs) */
    tok_tokenizer *tok;
    const uint8_t *map;    /* the whole file, read-only */
    size_t map_size;
    int copied;            /* map is the run's own copy (--hugepages), not the file mapped */
    dev_t dev;             /* the file's identity: no file this run writes may name it */
    ino_t ino;
    double n_params;
    double matmul_params;  /* weights multiplied per token: layer matrices + output head */
    double weight_bytes;   /* bytes of those weights: what decode streams per token */
    const char *dtype;     /* the type of most weight bytes, for -v */
    int tokenizer_only;    /* a file without tensors (export.py --tokenizer-only), loaded for --tokenize */
} Model;

static uint32_t rd_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t rd_u64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static float rd_f32(const uint8_t *p) { float v; memcpy(&v, p, 4); return v; }

/* Defined with the weight-type table (Part II, "the kernel tables"): a type's name (NULL for
   a type this build does not know), and the bytes of a row of cols elements
   (0 when that is not a whole number of its blocks). */
static const char *type_name(int type);
static size_t row_bytes(int type, size_t cols);

/* Row r of a tensor stored as rows. */
static const uint8_t *tensor_row(const Tensor *t, int r)
{
    return (const uint8_t *)t->data + (size_t)r * row_bytes(t->type, t->cols);
}

/* Reads the header's shape into c. */
static void read_config(Config *c, const uint8_t *h)
{
    c->arch = rd_u32(h + HDR_ARCH);
    uint32_t v[HDR_SHAPE_FIELDS];
    for (int i = 0; i < HDR_SHAPE_FIELDS; i++) v[i] = rd_u32(h + HDR_DIM + 4 * i);
    c->dim = v[0]; c->hidden_dim = v[1]; c->n_layers = v[2]; c->n_heads = v[3];
    c->n_kv_heads = v[4]; c->head_dim = v[5]; c->vocab_size = v[6]; c->max_seq_len = v[7];
    c->rope_theta = rd_f32(h + HDR_ROPE_THETA);
    c->norm_eps = rd_f32(h + HDR_NORM_EPS);
    c->rope_dim = rd_u32(h + HDR_ROPE_DIM);
}

/* Reads the family's switches into c: the flags, HDR_ACTIVATION and the
   fields from HDR_EMBED_SCALE on, whose zeros mean llama's behaviour. */
static void read_family(Config *c, const uint8_t *h)
{
    uint32_t flags = c->flags = rd_u32(h + HDR_FLAGS);
    c->tied = !!(flags & FLAG_TIED_EMBEDDINGS), c->qkv_bias = !!(flags & FLAG_QKV_BIAS);
    c->qk_norm = !!(flags & FLAG_QK_NORM), c->post_norms = !!(flags & FLAG_POST_NORMS);
    c->rope_freqs = !!(flags & FLAG_ROPE_FREQS), c->split = !!(flags & FLAG_SPLIT);
    c->gate = rd_u32(h + HDR_ACTIVATION);
    c->window = rd_u32(h + HDR_WINDOW);
    c->window_pattern = rd_u32(h + HDR_WINDOW_PATTERN);
    float embed_scale = rd_f32(h + HDR_EMBED_SCALE), att_scale = rd_f32(h + HDR_ATT_SCALE);
    float theta_local = rd_f32(h + HDR_ROPE_THETA_LOCAL), rope_scale = rd_f32(h + HDR_ROPE_SCALE);
    c->embed_scale = embed_scale ? embed_scale : 1;
    c->att_scale = att_scale ? att_scale : 1 / sqrtf((float)c->head_dim);
    c->rope_theta_local = theta_local ? theta_local : c->rope_theta;
    c->rope_scale = rope_scale ? rope_scale : 1;
}

/* The tensors a file can hold, by slot: the model's own, then each
   layer's, in the order of their names (SLOT_NORM: "norm", LT_WO:
   "layers.N.wo"). Which of them a file holds, the header's flags say
   (Part II: global_tensor, layer_tensor). */
enum { SLOT_TOK_EMBEDDINGS, SLOT_NORM, SLOT_OUTPUT, SLOT_ROPE_FREQS, SLOT_LAYERS };
enum { LT_ATTN_NORM, LT_WQKV, LT_WQ, LT_WK, LT_WV, LT_BQKV, LT_Q_NORM, LT_K_NORM, LT_WO, LT_POST_ATTN_NORM, LT_FFN_NORM,
       LT_W13, LT_W1, LT_W3, LT_W2, LT_POST_FFN_NORM, LAYER_TENSORS };

static int n_slots(const Config *c) { return SLOT_LAYERS + LAYER_TENSORS * c->n_layers; }

/* Part II: the slot of tensor `name` ("layers.3.wo": SLOT_LAYERS + 3 * LAYER_TENSORS + LT_WO). */
static int slot_of_name(const Config *c, const char *name);

/* Reads the tensor table into slots (n_slots entries, by name; a NULL
   name marks a slot without a tensor). */
static Tensor *read_tensor_table(const Model *m)
{
    const uint8_t *table = m->map + rd_u64(m->map + HDR_TABLE_OFFSET);
    Tensor *t = xcalloc(n_slots(&m->c), sizeof *t);
    for (uint32_t i = 0; i < rd_u32(m->map + HDR_N_TENSORS); i++) {
        const uint8_t *e = table + (size_t)i * TENSOR_ENTRY_BYTES;
        const char *name = (const char *)e + ENT_NAME;
        t[slot_of_name(&m->c, name)] = (Tensor){name, (int)rd_u32(e + ENT_TYPE), (int)rd_u32(e + ENT_ROWS),
            (int)rd_u32(e + ENT_COLS), (int)rd_u32(e + ENT_LAYOUT), m->map + rd_u64(e + ENT_OFFSET)};
    }
    return t;
}

/* Completes matrix w from its first n_parts parts: its shape. (Its parts
   read one activation format: check_model_file refuses a file where not.) */
static void join_parts(Matrix *w, int n_parts)
{
    w->n_parts = n_parts;
    w->rows = 0;
    w->cols = w->part[0].cols;
    for (int i = 0; i < n_parts; i++) w->rows += w->part[i].rows;
}

/* Points the weight structs at the tensors of the table (by slot). */
static void bind_weights(Model *m, const Tensor *tab)
{
    Config *c = &m->c;
    m->tok_embeddings = tab[SLOT_TOK_EMBEDDINGS];
    m->norm = tab[SLOT_NORM];
    m->output.part[0] = c->tied ? m->tok_embeddings : tab[SLOT_OUTPUT];
    join_parts(&m->output, 1);
    m->rope_freqs = tab[SLOT_ROPE_FREQS]; /* without the flag: an empty slot */
    m->layers = xcalloc(c->n_layers, sizeof(Layer));
    for (int l = 0; l < c->n_layers; l++) {
        Layer *L = &m->layers[l];
        /* each tensor's field: a split file's parts are fields of the matrix they form */
        Tensor *field[LAYER_TENSORS] = {
            [LT_ATTN_NORM] = &L->attn_norm, [LT_WQKV] = &L->wqkv.part[0], [LT_WQ] = &L->wqkv.part[0],
            [LT_WK] = &L->wqkv.part[1], [LT_WV] = &L->wqkv.part[2], [LT_BQKV] = &L->bqkv, [LT_Q_NORM] = &L->q_norm,
            [LT_K_NORM] = &L->k_norm, [LT_WO] = &L->wo.part[0], [LT_POST_ATTN_NORM] = &L->post_attn_norm,
            [LT_FFN_NORM] = &L->ffn_norm, [LT_W13] = &L->w13.part[0], [LT_W1] = &L->w13.part[0],
            [LT_W3] = &L->w13.part[1], [LT_W2] = &L->w2.part[0], [LT_POST_FFN_NORM] = &L->post_ffn_norm,
        };
        const Tensor *lt = tab + SLOT_LAYERS + LAYER_TENSORS * l; /* in layer_tensor order */
        for (int i = 0; i < LAYER_TENSORS; i++)
            if (lt[i].name) *field[i] = lt[i];
        join_parts(&L->wqkv, c->split ? 3 : 1), join_parts(&L->wo, 1);
        join_parts(&L->w13, c->split ? 2 : 1), join_parts(&L->w2, 1);
    }
}

/* Part II, "validating the model file": checks every byte that the reading
   here trusts, in file order, building the tokenizer into *tok on the way
   (tokenizer.c checks its arrays as it reads them); the counts for -v. */
static int check_model_file(const Model *m, tok_tokenizer **tok, char *err);
static void count_weights(Model *m, const Tensor *tab);
/* Part II, "files read into memory of the run's own": the model in huge pages (--hugepages). */
static void *read_copy(int fd, size_t size);

/* build_model, or with tokenizer_only (--tokenize) also a file of the
   header and tokenizer section alone (n_tensors 0, checked as any other
   file): m->tokenizer_only is then set and no weights are bound. The file
   is mapped (its pages are the page cache's, shared by every process
   running it), or with copy read into memory of the run's own
   (--hugepages: read_copy). */
static int load_model(Model *m, const char *path, int tokenizer_only, int copy, char *err)
{
    memset(m, 0, sizeof *m);
    /* O_NONBLOCK: opening a FIFO would wait for a writer; whatever is not a
       regular file is refused before a byte of it is read */
    int fd = open(path, O_RDONLY | O_NONBLOCK);
    if (fd < 0) LOAD_FAIL("cannot open: %s", strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) { close(fd); LOAD_FAIL("not a regular file"); }
    if ((size_t)st.st_size < HEADER_BYTES) { close(fd); LOAD_FAIL("not a model file (only %lld bytes)", (long long)st.st_size); }
    void *p = copy ? read_copy(fd, st.st_size) : mmap(NULL, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED)
        LOAD_FAIL("cannot %s: %s", copy ? "read" : "map", copy && errno == EIO ? "it shrank while it was read" : strerror(errno));
    m->map = p;
    m->copied = copy;
    m->map_size = st.st_size;
    m->dev = st.st_dev, m->ino = st.st_ino;
    m->tokenizer_only = tokenizer_only && rd_u32(m->map + HDR_N_TENSORS) == 0;
    read_config(&m->c, m->map); /* copied as they are: check_model_file judges them */
    read_family(&m->c, m->map);
    if (check_model_file(m, &m->tok, err)) return -1;
    if (m->tokenizer_only) return 0;
    Tensor *tab = read_tensor_table(m);
    bind_weights(m, tab);
    count_weights(m, tab);
    free(tab); /* the Tensor structs were copied out; names still point into the map */
    return 0;
}

/* Maps (with copy: reads, --hugepages) and validates a model file.
   Returns 0, or -1 with a one-line reason in err (ERR_BYTES); the caller
   then frees the partial model with free_model. Never reads outside the
   mapping, whatever the file holds. */
static int build_model(Model *m, const char *path, int copy, char *err) { return load_model(m, path, 0, copy, err); }

static void free_model(Model *m)
{
    if (m->tok) tok_free(m->tok);
    free(m->layers);
    if (m->map) munmap((void *)m->map, m->map_size);
    memset(m, 0, sizeof *m);
}

/* ============================================================================
   2. THE MATH, IN PLAIN C
   Each step's definition. --kernels scalar runs these; the SIMD sets of
   Part II's appendices, one chosen at start-up for the CPU
   (select_kernels), must agree with them (tests/test_kernels.c).
   ========================================================================= */

/* out = x / sqrt(mean(x^2) + eps) * w. A sum of squares out of the float
   range, past FLT_MAX (an RMS above ~1e17) or underflowed while x is not
   zero (below ~1e-20), means a damaged scale or weight: the row becomes
   NaN, which check_logits reports, not zeros the model would answer from. */
static void rmsnorm(float *out, const float *x, const float *w, int n, float eps)
{
    float ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    int lost = !(ss <= FLT_MAX);
    for (int i = 0; ss < FLT_MIN && i < n; i++) lost |= x[i] != 0;
    float scale = lost ? NAN : 1.0f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * scale * w[i];
}

static void softmax(float *x, int n)
{
    float max = x[0], sum = 0;
    for (int i = 1; i < n; i++) max = fmaxf(max, x[i]);
    for (int i = 0; i < n; i++) sum += x[i] = expf(x[i] - max);
    for (int i = 0; i < n; i++) x[i] /= sum;
}

/* Rotates pairs (x[i], x[i + rope_dim/2]) of one head by the position's
   angles (half-split convention; cos/sin hold rope_dim/2 values). */
static void rope(float *x, const float *cos_t, const float *sin_t, int rope_dim)
{
    int half = rope_dim / 2;
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos_t[i] - b * sin_t[i];
        x[i + half] = a * sin_t[i] + b * cos_t[i];
    }
}

/* --- SwiGLU, the feed-forward's activation -----------------------------
   g = silu(g) * u elementwise, silu(x) = x / (1 + exp(-x)). */
static void swiglu_scalar(float *g, const float *u, int n)
{
    for (int i = 0; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* GeGLU, Gemma's gate: g = gelu(g) * u with GELU's tanh approximation,
   gelu(x) = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). */
#define GELU_C 0.7978845608028654f /* sqrt(2/pi) */
#define GELU_A 0.044715f
static void geglu_scalar(float *g, const float *u, int n)
{
    for (int i = 0; i < n; i++) {
        float x = g[i];
        g[i] = 0.5f * x * (1.0f + tanhf(GELU_C * (x + GELU_A * x * x * x))) * u[i];
    }
}

/* --- the online softmax --------------------------------------------------
   Attention in chunks (Part II) takes the softmax a block at a time, and
   the sampler's exponentials (the vocabulary as one block) use the same
   step: */

/* One step of the online softmax for a query and a block of n scores:
   scales them, raises the running maximum *m to cover them, and replaces
   each by exp(score - *m); returns their sum. */
static float att_softmax_scalar(float *sc, int n, float scale, float *m)
{
    float mx = *m, sum = 0;
    for (int j = 0; j < n; j++) {
        sc[j] *= scale;
        mx = sc[j] > mx ? sc[j] : mx; /* not fmaxf: a libm call per score */
    }
    for (int j = 0; j < n; j++) sum += sc[j] = expf(sc[j] - mx);
    *m = mx;
    return sum;
}

/* --- int8 activations ------------------------------------------------------ */

/* Activations for integer dot products: x quantized per block of 32 to int8
   with scale d = max|x|/127; s = d * sum(qs) lets the types with a minimum
   (q4_1, q5_1) add it with one multiply per block. Quantized once per
   matmul, reused by every row. */
typedef struct {
    float d, s;
    int32_t sum;   /* sum(qs): a type's offset costs offset * sum per block, in integers */
    int8_t qs[QK];
} BlockQ8A;

/* The K types' activations: int8 per 256 with one scale, and the sum of
   each 16 (the K types' minimums and q6_k's offset of 32 are multiples of
   them: one multiply-add per 16 or 32 elements, not one per element). */
typedef struct {
    float d;
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16];
} BlockQ8K;

/* round(x) to int8 for |x| <= 127. NaN or inf activations (weights that
   overflow) give a defined 0 or +-127 instead of undefined behaviour. */
static int8_t round_i8(float x)
{
    return x == x ? (int8_t)roundf(fmaxf(-127.0f, fminf(127.0f, x))) : 0;
}

/* n floats to int8 q with one scale d = max|x| / 127, returned. A NaN
   among them makes d NaN (and every q 0): damaged weights then give NaN
   logits, which check_logits reports, instead of a plausible answer. */
static float quantize_i8(int8_t *q, const float *x, int n)
{
    float amax = 0;
    for (int i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        amax = a > amax || a != a ? a : amax; /* not fmaxf, which skips a NaN */
    }
    float d = amax / 127, id = d ? 1 / d : 0;
    for (int i = 0; i < n; i++) q[i] = round_i8(x[i] * id);
    return d;
}

static void quantize_act_scalar(void *blocks, const float *x, int n)
{
    BlockQ8A *out = blocks;
    for (int b = 0; b < n / QK; b++, x += QK) {
        out[b].d = quantize_i8(out[b].qs, x, QK);
        int sum = 0;
        for (int i = 0; i < QK; i++) sum += out[b].qs[i];
        out[b].sum = sum;
        out[b].s = out[b].d * sum;
    }
}

static void q8k_bsums(BlockQ8K *b)
{
    for (int g = 0; g < QK_K / 16; g++) {
        int sum = 0;
        for (int i = 0; i < 16; i++) sum += b->qs[16 * g + i];
        b->bsums[g] = (int16_t)sum;
    }
}

static void quantize_act_k_scalar(void *blocks, const float *x, int n)
{
    BlockQ8K *out = blocks;
    for (int b = 0; b < n / QK_K; b++, x += QK_K) {
        out[b].d = quantize_i8(out[b].qs, x, QK_K);
        q8k_bsums(&out[b]);
    }
}

/* --- the weight types' blocks, as the file stores them --------------------
   ggml's layouts, bit for bit (T_*). The definitions below read them through
   weight_block; Part II's row conversions read them directly. */
typedef struct {
    uint16_t d;      /* scale, fp16 */
    int8_t qs[QK];   /* value = qs[i] * d */
} BlockQ8_0;         /* 34 bytes */

typedef struct {
    uint16_t d;         /* scale, fp16 */
    uint8_t qs[QK / 2]; /* byte j: element j in the low nibble, j+16 in the high */
} BlockQ4_0;            /* 18 bytes: value = (nibble - 8) * d */

typedef struct {
    uint16_t d, m;      /* scale and minimum, fp16 */
    uint8_t qs[QK / 2]; /* byte j: element j in the low nibble, j+16 in the high */
} BlockQ4_1;            /* 20 bytes: value = nibble * d + m */

typedef struct {
    uint16_t d;         /* scale, fp16 */
    uint8_t qh[4];      /* bit j (little-endian): bit 4 of element j */
    uint8_t qs[QK / 2]; /* the low 4 bits, laid out as q4_0's nibbles */
} BlockQ5_0;            /* 22 bytes: value = (q - 16) * d, q = 0..31 */

typedef struct {
    uint16_t d, m;      /* scale and minimum, fp16 */
    uint8_t qh[4];
    uint8_t qs[QK / 2]; /* as q5_0 */
} BlockQ5_1;            /* 24 bytes: value = q * d + m */

/* The K types: super-blocks of QK_K = 256 elements in sub-blocks, each
   sub-block with its own small integer scale (and minimum) under the
   super-block's fp16 ones. */
typedef struct {
    uint16_t d, dmin;       /* fp16 scales of the sub-block scales and of the minimums */
    uint8_t scales[12];     /* 8 six-bit scales and 8 six-bit minimums, packed (k4_scale_min) */
    uint8_t qs[QK_K / 2];   /* 64 elements per 32 bytes: the low nibbles, then the high ones */
} BlockQ4K;                 /* 144 bytes: value = d * sc_j * q - dmin * m_j in sub-block j of 32 */

typedef struct {
    uint16_t d, dmin;       /* as q4_k */
    uint8_t scales[12];
    uint8_t qh[QK_K / 8];   /* bit j of qh[l]: bit 4 of element l of sub-block j */
    uint8_t qs[QK_K / 2];   /* the low 4 bits, as q4_k */
} BlockQ5K;                 /* 176 bytes: value = d * sc_j * q - dmin * m_j, q = 0..31 */

typedef struct {
    uint8_t ql[QK_K / 2];     /* low 4 bits: 128 elements per 64 bytes, in four 32s: low nibbles of
                                 bytes 0-31, of 32-63, high nibbles of 0-31, of 32-63 */
    uint8_t qh[QK_K / 4];     /* high 2 bits: 128 elements per 32 bytes, byte l holding element l of each of the four 32s */
    int8_t scales[QK_K / 16]; /* one per 16 elements */
    uint16_t d;               /* fp16 */
} BlockQ6K;                   /* 210 bytes: value = d * scales[i / 16] * (q - 32), q = 0..63 */
_Static_assert(sizeof(BlockQ4K) == 144 && sizeof(BlockQ5K) == 176 && sizeof(BlockQ6K) == 210, "ggml's K block sizes");

/* --- the matrices' layout: packed groups of rows -----------------------------
   Every matrix the forward pass multiplies by is stored as the file holds
   it, in groups of PACK_ROWS rows whose blocks are interleaved so that a
   SIMD kernel reads them in one stream, in the order it uses them (decode
   reads each weight once per token). Every byte of ggml's blocks is kept,
   only moved (export.py's manual, "Packed matrices").
   The layout itself, its accessors and the byte counts are in Part II
   ("the packed layout"); the definitions below read a matrix through
   weight_block and weight_float only. */
#define PACK_ROWS 16  /* rows per group: one per int32 lane of a 512-bit vector */
#define PACK_TOKS 8   /* tokens per kernel call: a group's bytes stay in cache for all of them */
#define STRETCH 32    /* elements per run of packed integers */
_Static_assert(CHUNK_TOKENS % PACK_TOKS == 0, "a prefill chunk is whole kernel calls");

/* The packed product: out[t * PACK_ROWS + r] = row r of the group . token t
   (toks activation rows xs bytes apart: <= PACK_TOKS, or up to
   CHUNK_TOKENS for a wide product), for n elements. */
typedef void (*PackedFn)(const uint8_t *group, int n, const uint8_t *x, size_t xs, int toks, float *out);

/* How a type's record is laid out and what its integers mean. */
enum { PACK_BLOCK32, PACK_K4, PACK_K6, PACK_FLOAT };
typedef struct {
    int kind;    /* PACK_* */
    int bits;    /* integer width: 4, 5, 6 or 8 (floats: bits per element, 32 or 16) */
    int offset;  /* value = (u - offset) * d ... */
    int has_min; /* ... or u * d + m */
} PackForm;

/* --- each weight type's dot product ----------------------------------------
   Row r of a matrix times one activation row, for n elements: the
   definitions that --kernels scalar runs and that every other kernel set
   matches bit for bit (tests/test_kernels.c). They read the matrix as the
   file holds it through one accessor, weight_block (weight_float for the
   float types), which hands over one row's block as numbers: its unsigned
   integers u, its scale d, its minimum m and, for the K types, each
   sub-block's integer scale and minimum. Integer sums are exact (so their
   order does not matter); the float steps, each correctly rounded, are the
   ones written here. */
typedef struct {
    uint8_t u[QK_K];     /* the block's unsigned integers (QK or QK_K of them) */
    float d, m;          /* its scale, and its minimum (q4_1, q5_1) or dmin (q4_k, q5_k) */
    int sc[QK_K / 16];   /* K types: each sub-block's integer scale (q4_k, q5_k: 8 of 32 elements; q6_k: 16 of 16) ... */
    int mn[QK_K / 32];   /* ... and minimum (q4_k, q5_k) */
} RowBlock;

/* The accessors (Part II, "the packed layout"): a row's block as numbers,
   and one element of a float row. */
static void weight_block(const PackForm *f, const uint8_t *group, int k, int r, RowBlock *b);
static float weight_float(int bits, int type, const uint8_t *group, int e, int r);

/* The 32-element types (q4_0 q4_1 q5_0 q5_1 q8_0) against int8
   activations (BlockQ8A), per block: isum = sum (u - offset) * x.q, then
   acc += (isum * x.d) * d, and for a type with a minimum acc += m * x.s. */
static float dot_block32(const PackForm *f, const uint8_t *group, int r, const BlockQ8A *a, int n)
{
    float acc = 0;
    RowBlock b;
    for (int k = 0; k < n / QK; k++, a++) {
        weight_block(f, group, k, r, &b);
        int isum = 0;
        for (int e = 0; e < QK; e++) isum += (b.u[e] - f->offset) * a->qs[e];
        acc = fmaf((float)isum * a->d, b.d, acc);
        if (f->has_min) acc = fmaf(b.m, a->s, acc);
    }
    return acc;
}

/* The K types against Q8_K activations, per super-block: the sub-blocks'
   exact integer sums times their integer scales, one float step each for
   the sum and for the minimums (q4_k, q5_k: acc += (isum * x.d) * d, then
   acc += (msum * x.d) * -dmin, msum = sum_j m_j * x's sum of sub-block j)
   or q6_k's offset of 32 (isum = sum_g sc_g * (s_g - 32 * x's sum of g)). */
static float dot_k(const PackForm *f, const uint8_t *group, int r, const BlockQ8K *a, int n)
{
    int sub = f->kind == PACK_K4 ? K4_SUB : K6_SUB;
    float acc = 0;
    RowBlock b;
    for (int k = 0; k < n / QK_K; k++, a++) {
        weight_block(f, group, k, r, &b);
        int isum = 0, msum = 0;
        for (int j = 0; j < QK_K / sub; j++) {
            int s = 0;
            for (int e = j * sub; e < (j + 1) * sub; e++) s += b.u[e] * a->qs[e];
            if (f->kind == PACK_K4) {
                isum += b.sc[j] * s;
                msum += b.mn[j] * (a->bsums[2 * j] + a->bsums[2 * j + 1]);
            } else {
                isum += b.sc[j] * (s - f->offset * a->bsums[j]);
            }
        }
        acc = fmaf((float)isum * a->d, b.d, acc);
        if (f->kind == PACK_K4) acc = fmaf((float)msum * a->d, -b.m, acc);
    }
    return acc;
}

/* The float types (f32, f16, bf16) against float activations: the row's
   products added in element order, one fused multiply-add each. */
static float dot_float(int type, int bits, const uint8_t *group, int r, const float *a, int n)
{
    float acc = 0;
    for (int e = 0; e < n; e++) acc = fmaf(weight_float(bits, type, group, e, r), a[e], acc);
    return acc;
}

/* Activation formats: what a matrix product reads as its input rows. */
enum { ACT_F32, ACT_Q8, ACT_Q8K, N_ACTS };
static const struct {
    int block;          /* elements per block */
    size_t block_bytes; /* bytes per block */
} ACT_FORMATS[N_ACTS] = {
    [ACT_F32] = {1, sizeof(float)},
    [ACT_Q8] = {QK, sizeof(BlockQ8A)}, /* int8 per 32, with d, sum and d*sum */
    [ACT_Q8K] = {QK_K, sizeof(BlockQ8K)}, /* int8 per 256, with d and the sums of each 16 */
};

/* --- the kernel interface ---------------------------------------------------
   The forward pass calls its kernels through these names. Each calls the
   kernel set chosen at start-up (the best one the CPU runs, or --kernels:
   Part II, "the kernel tables"); with --kernels scalar they are the plain
   definitions above. */
static size_t row_bytes(int type, size_t cols);
static size_t act_bytes(int act, size_t n);
static int act_format(int type);
static void to_float(float *out, const void *row, int type, int n);
static void from_float(void *row, const float *x, int type, int n);
static void tensor_row_to_float(float *out, const Tensor *t, int r);
static float att_softmax(float *sc, int n, float scale, float *m);
static void swiglu(float *g, const float *u, int n);
static void geglu(float *g, const float *u, int n);

/* ============================================================================
   3. FORWARD PASS
   ========================================================================= */

enum { ROPE_GLOBAL, ROPE_LOCAL, N_ROPE }; /* RoPE tables: global layers', local (sliding-window) layers' */

/* Part II's share of a run: the thread pool's counters, attention's chunk
   scratch and batch mode's page tables. The forward pass never looks inside. */
typedef struct Machinery Machinery;
typedef struct PageTable PageTable; /* batch mode's pages of a sequence (Part II) */

/* The state of a run: the activations of one pass of up to CHUNK_TOKENS
   tokens (a prefill chunk, or one decode token), and the KV cache. */
typedef struct {
    const Config *c; /* the model's shape */
    int seq_len;    /* positions the KV cache holds */
    int kv_type;    /* a type with a kv_name (f32, f16, q8_0, q4_0) */
    size_t kv_row;  /* bytes of one cached head_dim row */
    float *x;       /* [chunk, dim] residual stream */
    float *xb;      /* [chunk, max_cols] input of the next matmul, rows packed */
    uint8_t *xq;    /* [chunk, act_bytes(max_cols)] the same in the activation format of the weights it feeds */
    float *qkv;     /* [chunk, q_dim + 2*kv_dim] */
    float *hb;      /* [chunk, 2*hidden_dim] gate | up; the gate half then holds act(gate) * up */
    uint8_t *hq;    /* [chunk, act_bytes(hidden_dim)] act(gate) * up in W2's activation format: apart
                       from xq because other threads may still be reading xq in W13 */
    float *xo;      /* [chunk, dim] an attention or FFN output waiting for its post-norm (post_norms) */
    float *rope_cos[N_ROPE], *rope_sin[N_ROPE]; /* [chunk, rope_dim/2] each position's angles, per RoPE kind */
    float *inv_freq[N_ROPE];                    /* [rope_dim/2] */
    int *kv_cap;    /* [n_layers] positions a layer's cache holds: seq_len, or for a local layer
                       a ring of window + CHUNK_TOKENS (a batch stores its rows before attending) */
    size_t *kv_off; /* [n_layers] the row where a layer's cache starts */
    uint8_t *key_cache;   /* [layer, kv_head, kv_cap[layer], kv_row bytes], read through cache_row */
    uint8_t *value_cache; /* the same for V */
    int *tok_pos;   /* [chunk] the position of each token of the pass */
    float *logits;  /* [chunk, vocab] */
    Machinery *mx;  /* Part II's share (build_machinery) */
} RunState;

/* A matmul's input rows as its weights read them: floats, or int8 blocks
   for integer weights (quantized once per matmul, then read by every
   weight row). stride is in bytes. */
typedef struct {
    const uint8_t *rows;
    size_t stride;
} Act;

/* Part II's side of the forward pass: the parallel-for below, the matmuls
   (one call through the kernel table each, split over the threads inside),
   a row converted into the form a matrix reads, attention in chunks (what
   the SIMD sets run instead of attend) and batch mode's paged cache. */
typedef struct {
    int lo, hi, open;
} Share;
static Share share_begin(int n, int unit);
static int share_end(void);
static void forward_on_pool(const Model *m, RunState *s, const int *tokens, int n, int first_logit);
static void matmul(float *out, const Matrix *w, Act in, int n);
static void matmul_add(float *out, const Matrix *w, Act in, int n);
static void matmul_rows(float *out, int stride, const Matrix *w, Act in, int n, int r0, int r1);
static void to_input(const Matrix *w, uint8_t *q, const float *row, int t, int i0, int i1);
static Act input_of(const Matrix *w, const float *f, int f_cols, const uint8_t *q);
static Act attention(RunState *s, int l, int n, const Matrix *wo);
static Act attend_in_chunks(RunState *s, int l, int n, const Matrix *wo);
static float *thread_scratch(const RunState *s);
static int glu_job(int hid, int block);
static uint8_t *paged_row(const RunState *s, uint8_t *cache, int t, int l, int h, int pos);

/* PARALLEL_FOR(i, n, unit) { body } runs body for every i in [0, n), read
   it as a plain for loop. A forward pass runs on every thread of the pool
   at once (forward_on_pool), each executing the same function; each
   thread runs the body for its own share of the i's (whole multiples of
   unit), and at the end waits for the others, so the next step sees every
   result. Which thread computes an i never changes its result. The body
   must not break out or return. Without OpenMP there is one thread. */
#define PARALLEL_FOR(i, n, unit) \
    for (Share sh_ = share_begin(n, unit); sh_.open; sh_.open = share_end()) \
        for (int i = sh_.lo; i < sh_.hi; i++)

/* The cached K or V row (cache: s->key_cache or s->value_cache) of layer
   l, KV head h, position pos of token t's sequence. One sequence's cache
   is laid out [layer][kv_head][pos][head_dim]: a head's positions are
   contiguous, so attention streams them in order. A local layer keeps the
   last kv_cap positions only, as a ring: position pos lives in slot
   pos % kv_cap. Batch mode keeps every sequence's rows in pages of
   PAGE_TOKENS positions (paged_row, Part II). */
static uint8_t *cache_row(const RunState *s, uint8_t *cache, int t, int l, int h, int pos)
{
    uint8_t *paged = paged_row(s, cache, t, l, h, pos);
    if (paged) return paged;
    return cache + (s->kv_off[l] + (size_t)h * s->kv_cap[l] + pos % s->kv_cap[l]) * s->kv_row;
}

/* RMSNorm of each of the n rows of x ([n, dim]) into xb, and xb in the
   form W, the matrix it feeds, reads. */
static Act rmsnorm_each(RunState *s, const float *x, const Tensor *norm, const Matrix *w, int n)
{
    const Config *c = s->c;
    PARALLEL_FOR(t, n, 1) {
        float *row = s->xb + (size_t)t * c->dim;
        rmsnorm(row, x + (size_t)t * c->dim, norm->data, c->dim, c->norm_eps);
        to_input(w, s->xq, row, t, 0, c->dim);
    }
    return input_of(w, s->xb, c->dim, s->xq);
}

/* Attention as its definition states it: for query head h of token t, the
   three plain loops over the cached positions it sees (its own and the
   ones before it; on a local layer the last `window` only): scores
   q . k_j * scale, their softmax, and the weighted sum of the values.
   scratch holds seq_len scores and a head_dim row. out gets head_dim
   values. */
static void attend(const RunState *s, int l, int t, int h, float *out, float *scratch)
{
    const Config *c = s->c;
    int hd = c->head_dim, g = h / (c->n_heads / c->n_kv_heads), pos = s->tok_pos[t];
    int lo = is_local(c, l) && pos >= c->window ? pos - c->window + 1 : 0, n = pos + 1 - lo;
    const float *q = s->qkv + (size_t)t * (c->n_heads + 2 * c->n_kv_heads) * hd + (size_t)h * hd;
    float *sc = scratch, *row = scratch + s->seq_len;
    for (int j = 0; j < n; j++) { /* 1: scores */
        to_float(row, cache_row(s, s->key_cache, t, l, g, lo + j), s->kv_type, hd);
        float dot = 0;
        for (int i = 0; i < hd; i++) dot += q[i] * row[i];
        sc[j] = dot * c->att_scale;
    }
    softmax(sc, n); /* 2: weights */
    memset(out, 0, hd * sizeof(float));
    for (int j = 0; j < n; j++) { /* 3: the weighted sum of the values */
        to_float(row, cache_row(s, s->value_cache, t, l, g, lo + j), s->kv_type, hd);
        for (int i = 0; i < hd; i++) out[i] += sc[j] * row[i];
    }
}

/* Layer l's attention for the pass's n tokens, every query head of every
   token, into xb ([n, q_dim]) in the form Wo reads: the scalar set's
   attention step (the kernel set chooses it, like a matmul's kernel). The
   others compute the same sums in chunks of the cache (attend_in_chunks,
   Part II), which tests/test_kernels.c holds to attend within float
   rounding. */
static Act attend_each(RunState *s, int l, int n, const Matrix *wo)
{
    const Config *c = s->c;
    int hd = c->head_dim, q_dim = c->n_heads * hd;
    PARALLEL_FOR(job, n * c->n_heads, 1) {
        int t = job / c->n_heads, h = job % c->n_heads;
        attend(s, l, t, h, s->xb + (size_t)t * q_dim + (size_t)h * hd, thread_scratch(s));
    }
    PARALLEL_FOR(t, n, 1) to_input(wo, s->xq, s->xb + (size_t)t * q_dim, t, 0, q_dim);
    return input_of(wo, s->xb, q_dim, s->xq);
}

/* The feed-forward's first half: gate and up rows of W13 (one matrix, the
   two halves stacked) for the input in, then act(gate) * up written over
   the gate half, act SiLU (SwiGLU) or GELU (GeGLU), in the form W2 reads.
   The hidden units go whole blocks of W2's activation format at a time:
   whoever computes a block converts it, with no wait between the steps. */
static Act glu_each(RunState *s, const Layer *L, Act in, int n)
{
    const Config *c = s->c;
    int hid = c->hidden_dim, block = ACT_FORMATS[act_format(L->w2.part[0].type)].block;
    int unit = glu_job(hid, block > QK ? block : QK); /* float W2 (block 1): still jobs of whole packed groups of W13 */
    PARALLEL_FOR(b, (hid + unit - 1) / unit, 1) {
        int i0 = b * unit, i1 = i0 + unit < hid ? i0 + unit : hid;
        matmul_rows(s->hb, 2 * hid, &L->w13, in, n, i0, i1);
        matmul_rows(s->hb, 2 * hid, &L->w13, in, n, hid + i0, hid + i1);
        for (int t = 0; t < n; t++) {
            float *gate = s->hb + (size_t)t * 2 * hid, *up = gate + hid;
            if (c->gate == GATE_GELU) geglu(gate + i0, up + i0, i1 - i0);
            else swiglu(gate + i0, up + i0, i1 - i0);
            to_input(&L->w2, s->hq, gate, t, i0, i1);
        }
    }
    return input_of(&L->w2, s->hb, 2 * hid, s->hq);
}

/* A block's output, W . in, added to the residual stream x; with
   post_norms (Gemma 3) RMSNormed first. */
static void residual(RunState *s, const Matrix *w, Act in, const Tensor *post_norm, int n)
{
    const Config *c = s->c;
    if (!c->post_norms) {
        matmul_add(s->x, w, in, n);
        return;
    }
    matmul(s->xo, w, in, n);
    PARALLEL_FOR(t, n, 1) {
        float *o = s->xo + (size_t)t * c->dim, *x = s->x + (size_t)t * c->dim;
        rmsnorm(o, o, post_norm->data, c->dim, c->norm_eps);
        for (int i = 0; i < c->dim; i++) x[i] += o[i];
    }
}

/* The embedding: each token id selects its row of the table, which starts
   the residual stream. Positions enter through RoPE on the queries and
   keys: each token's angles pos * theta^(-2i/rope_dim) are computed once
   here for every layer, for each RoPE base the layers use. */
static void embed(const Model *m, RunState *s, const int *tokens, int n)
{
    const Config *c = &m->c;
    int dim = c->dim, half = c->rope_dim / 2;
    PARALLEL_FOR(t, n, 1) {
        float *x = s->x + (size_t)t * dim;
        tensor_row_to_float(x, &m->tok_embeddings, tokens[t]);
        if (c->embed_scale != 1)
            for (int i = 0; i < dim; i++) x[i] *= c->embed_scale;
        for (int k = 0; k < (c->window ? N_ROPE : ROPE_GLOBAL + 1); k++)
            for (int i = 0; i < half; i++) {
                double angle = (double)s->tok_pos[t] * s->inv_freq[k][i];
                s->rope_cos[k][t * half + i] = (float)cos(angle);
                s->rope_sin[k][t * half + i] = (float)sin(angle);
            }
    }
}

/* Each Q, K and V head of each token in s->qkv ([n, heads, head_dim], the
   Q heads first) made ready for attention: the bias added, Q and K
   RMSNormed per head and rotated by RoPE for their position, and K and V
   written into layer l's cache at the token's position. */
static void position_heads(RunState *s, const Layer *L, int l, int n)
{
    const Config *c = s->c;
    int hd = c->head_dim, half = c->rope_dim / 2, heads = c->n_heads + 2 * c->n_kv_heads;
    int kind = is_local(c, l) ? ROPE_LOCAL : ROPE_GLOBAL;
    PARALLEL_FOR(job, n * heads, 1) {
        int t = job / heads, h = job % heads, kv = h - c->n_heads; /* K heads: kv 0..n_kv-1, V heads: n_kv.. */
        float *x = s->qkv + (size_t)t * heads * hd + (size_t)h * hd;
        if (c->qkv_bias) /* Qwen 2 */
            for (int i = 0; i < hd; i++) x[i] += ((const float *)L->bqkv.data)[h * hd + i];
        if (c->qk_norm && kv < c->n_kv_heads) /* Qwen 3, Gemma 3: RMSNorm of each Q and K head */
            rmsnorm(x, x, kv < 0 ? L->q_norm.data : L->k_norm.data, hd, c->norm_eps);
        if (kv < c->n_kv_heads) rope(x, s->rope_cos[kind] + t * half, s->rope_sin[kind] + t * half, c->rope_dim);
        if (kv >= 0) /* K and V go into the cache at the token's position */
            from_float(cache_row(s, kv < c->n_kv_heads ? s->key_cache : s->value_cache, t, l, kv % c->n_kv_heads, s->tok_pos[t]),
                       x, s->kv_type, hd);
    }
}

/* The forward pass: the n (<= CHUNK_TOKENS) tokens at positions
   s->tok_pos through every layer, appending their K and V to the cache,
   then the output head for the tokens [first_logit, n) into s->logits
   rows 0.. (none when first_logit == n). The same function runs a prefill
   chunk and one decode token. Every thread of the pool runs it
   (forward_on_pool); each step shares its work among them. */
static void forward(const Model *m, RunState *s, const int *tokens, int n, int first_logit)
{
    const Config *c = &m->c;
    embed(m, s, tokens, n);
    for (int l = 0; l < c->n_layers; l++) {
        const Layer *L = &m->layers[l];
        /* attention block: x += Wo . attention(q, k, v), q|k|v = Wqkv . RMSNorm(x) */
        Act in = rmsnorm_each(s, s->x, &L->attn_norm, &L->wqkv, n);
        matmul(s->qkv, &L->wqkv, in, n);
        position_heads(s, L, l, n);
        in = attention(s, l, n, &L->wo);
        residual(s, &L->wo, in, &L->post_attn_norm, n);
        /* feed-forward block: x += W2 . (act(Wgate . h) * (Wup . h)), h = RMSNorm(x) */
        in = rmsnorm_each(s, s->x, &L->ffn_norm, &L->w13, n);
        in = glu_each(s, L, in, n);
        residual(s, &L->w2, in, &L->post_ffn_norm, n);
    }
    if (first_logit < n) { /* the output head: final norm, then logits = Wout . x */
        Act in = rmsnorm_each(s, s->x + (size_t)first_logit * c->dim, &m->norm, &m->output, n - first_logit);
        matmul(s->logits, &m->output, in, n - first_logit);
    }
}

/* n tokens at positions pos0.. of the one sequence in the cache. */
static void forward_at(const Model *m, RunState *s, const int *tokens, int n, int pos0, int first_logit)
{
    for (int t = 0; t < n; t++) s->tok_pos[t] = pos0 + t;
    forward_on_pool(m, s, tokens, n, first_logit);
}

/* Prefill: the prompt goes through the layers CHUNK_TOKENS at a time as a
   batch, filling the KV cache from position pos0. The output head (a
   vocab x dim matmul, the largest single one) runs only for the last
   position, or, when all_logits is set (perplexity, tests), for every
   position: then n <= CHUNK_TOKENS and s->logits receives n rows. Chunks
   start at multiples of CHUNK_TOKENS from pos0. Prefill is bound by
   arithmetic: each weight read from memory serves the whole chunk. */
static void prefill(const Model *m, RunState *s, const int *tokens, int n, int pos0, int all_logits)
{
    for (int done = 0; done < n; done += CHUNK_TOKENS) {
        int k = n - done < CHUNK_TOKENS ? n - done : CHUNK_TOKENS;
        forward_at(m, s, tokens + done, k, pos0 + done, all_logits ? 0 : done + k == n ? k - 1 : k);
    }
}

/* Decode: one token at position pos, attending over everything cached.
   Each weight is read once per token for two flops (a multiply and an
   add), so decode is bound by memory bandwidth where prefill, which uses
   each weight read for CHUNK_TOKENS tokens, is bound by arithmetic. */
static void decode_step(const Model *m, RunState *s, int token, int pos)
{
    forward_at(m, s, &token, 1, pos, 0);
}

/* --- the state of a run: activations of one pass, the KV cache ---------- */

static int min_i(int a, int b) { return a < b ? a : b; }
static int max_i(int a, int b) { return a > b ? a : b; }

/* Positions layer l's cache holds for a context of seq_len. */
static int kv_positions(const Config *c, int l, int seq_len)
{
    return is_local(c, l) ? min_i(seq_len, c->window + CHUNK_TOKENS) : seq_len;
}

/* The run's buffers for a context of seq_len (Part II, "the state of a
   run"): a chunk's activations, the RoPE tables, the KV cache (calloc maps
   its zero pages lazily: memory is committed as positions are written). */
static void build_state(RunState *s, const Model *m, int seq_len, int n_threads, int kv_type);
static void free_state(RunState *s);

/* ============================================================================
   4. SAMPLING
   ========================================================================= */

/* The tokens of a conversation in order (Request.pos says how many of
   them are in the KV cache). */
typedef struct {
    int *ids;
    int n, cap;
} Tokens;

typedef struct Logprobs Logprobs; /* --logprobs: what a draw reports (Part II, "log-probabilities") */

/* The sampling chain's settings (README "Sampling": the order, the
   defaults). A zero-initialized field turns its step off, so a Sampler
   written with the first five fields only samples as before the penalties. */
typedef struct {
    float temperature; /* 0 = greedy */
    float top_p;       /* nucleus: smallest set with probability >= top_p (1 = off) */
    int top_k;         /* keep the k most likely (0 = off) */
    uint64_t rng;      /* xorshift64* state */
    Logprobs *report;  /* each draw's report goes here (owned by the request); NULL: none */
    float min_p;       /* keep the tokens with probability >= min_p x the most likely's (0 = off) */
    float repeat;      /* repetition penalty: a repeated token's logit divided by it (1 = off) */
    int repeat_last_n; /* the penalties look at the context's last N tokens (0 = no penalties) */
    float presence;    /* subtracted from the logit of a token present in that window (0 = off) */
    float frequency;   /* ... and this times its count there (0 = off) */
} Sampler;

#define TEMP_MAX 100    /* -t: the highest temperature */
#define PENALTY_MAX 100 /* the highest repetition, presence and frequency penalties */
/* The lowest repetition penalty: dividing by less would scale a repeated
   token's logit by more than PENALTY_MAX, and a tiny one (1e-38)
   overflowed it to inf, then NaN log-probabilities and draws of control
   tokens. */
#define REPEAT_PENALTY_MIN (1.0 / PENALTY_MAX)
/* -t, -p, -k, --min-p, --repeat-penalty, --repeat-last-n, --presence-penalty
   and --frequency-penalty when not given: the sampler of earlier versions
   (min-p and the penalties off, so a seed gives the text it gave), with
   llama.cpp's window of 64 tokens for the penalties when they are on. */
#define SAMPLING_DEFAULTS ((Sampler){.temperature = 0.8f, .top_p = 0.95f, .top_k = 40, .min_p = 0, .repeat = 1, \
                                     .repeat_last_n = 64, .presence = 0, .frequency = 0})

typedef struct {
    float p;
    int id;
} Candidate;

static uint32_t random_u32(uint64_t *state)
{
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return (uint32_t)((*state * 0x2545F4914F6CDD1Dull) >> 32);
}

static float random_f32(uint64_t *state) { return (random_u32(state) >> 8) / 16777216.0f; } /* [0,1) */

/* The generator's state for a seed: times 2^64/phi (odd, so distinct seeds
   stay distinct; nearby seeds land far apart), plus 1 so that seed 0 does
   not give the state 0, where xorshift stays. */
#define SEED_MIX 0x9E3779B97F4A7C15ull
static uint64_t seed_state(unsigned long long seed) { return seed * SEED_MIX + 1; }

#define MAX_LANES 16  /* independent maxima in max_of: a vector's worth, so the loop vectorizes */
#define SCAN_BLOCK 64  /* gather_candidates skips blocks of this many probabilities below what it needs */

/* The largest of x[0..n) (n >= 1; no NaN). MAX_LANES running maxima
   instead of one: a single one is a chain of dependent compares, which the
   compiler cannot turn into vector instructions without reassociating. */
static float max_of(const float *x, int n)
{
    float lane[MAX_LANES];
    int i = 0;
    for (int j = 0; j < MAX_LANES; j++) lane[j] = x[0];
    for (; i + MAX_LANES <= n; i += MAX_LANES)
        for (int j = 0; j < MAX_LANES; j++) lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
    for (; i < n; i++) lane[0] = x[i] > lane[0] ? x[i] : lane[0];
    for (int j = 1; j < MAX_LANES; j++) lane[0] = lane[j] > lane[0] ? lane[j] : lane[0];
    return lane[0];
}

/* The first index of the largest logit (no NaN: see check_logits). */
static int sample_argmax(const float *logits, int n)
{
    float max = max_of(logits, n);
    int best = 0;
    while (logits[best] != max) best++;
    return best;
}

static int by_prob_desc(const void *a, const void *b)
{
    float pa = ((const Candidate *)a)->p, pb = ((const Candidate *)b)->p;
    return pa < pb ? 1 : pa > pb ? -1 : ((const Candidate *)a)->id - ((const Candidate *)b)->id;
}

/* Puts c into the heap cand[0..k) of the best candidates so far, the worst
   (by_prob_desc's order) on top, in place of that worst one. */
static void heap_replace_top(Candidate *cand, int k, Candidate c)
{
    int at = 0;
    while (1) { /* sift down: the worse child rises */
        int ch = 2 * at + 1;
        if (ch >= k) break;
        if (ch + 1 < k && by_prob_desc(&cand[ch + 1], &cand[ch]) > 0) ch++;
        if (by_prob_desc(&cand[ch], &c) <= 0) break;
        cand[at] = cand[ch];
        at = ch;
    }
    cand[at] = c;
}

/* Appends c to the heap cand[0..k) (worst on top), which grows by one. */
static void heap_push(Candidate *cand, int k, Candidate c)
{
    int at = k;
    for (; at > 0 && by_prob_desc(&cand[(at - 1) / 2], &c) < 0; at = (at - 1) / 2) cand[at] = cand[(at - 1) / 2];
    cand[at] = c;
}

/* The tokens that can be kept: each with p[i] >= floor, and with top_k > 0
   only the top_k most likely of them (by_prob_desc's order, a total one:
   ties go to the lower id), into cand unsorted; returns their count. With
   top-k a heap of the best so far, the worst on top: O(n log k) instead of
   sorting all n. A block of SCAN_BLOCK probabilities whose largest (a
   vectorized max) is below the floor, or no better than the heap's worst,
   is skipped whole: with top-k and a vocabulary of 262144 almost every
   block, once the heap is full. Tokens come in rising id order, so one
   tied with the heap's worst is the worse of the two. */
static int gather_candidates(const float *p, int n, float floor, int top_k, Candidate *cand)
{
    int nc = 0;
    for (int i0 = 0; i0 < n; i0 += SCAN_BLOCK) {
        int i1 = min_i(n, i0 + SCAN_BLOCK), full = top_k > 0 && nc == top_k;
        float most = max_of(p + i0, i1 - i0);
        if (most < floor || (full && most <= cand[0].p)) continue;
        for (int i = i0; i < i1; i++) {
            if (p[i] < floor) continue;
            Candidate c = {p[i], i};
            if (top_k <= 0) cand[nc++] = c;
            else if (nc < top_k) heap_push(cand, nc++, c);
            else if (p[i] > cand[0].p) heap_replace_top(cand, nc, c);
        }
    }
    return nc;
}

/* The repetition penalties (llama.cpp's llama_sampler_penalties_apply):
   each token that occurs c > 0 times among the last repeat_last_n ids of
   hist[0..n_hist) (the context so far, prompt included) has its logit
   divided by the repetition penalty (multiplied when it is not positive,
   so that a penalty above 1 always lowers it), then lowered by
   c * frequency + presence (OpenAI's frequency and presence penalties).
   cand[t].id counts token t meanwhile: cand is scratch until the
   candidates are gathered. */
static void apply_penalties(const Sampler *sm, float *logits, const int *hist, int n_hist, Candidate *cand)
{
    if (sm->repeat_last_n <= 0 || !hist || (sm->repeat == 1 && sm->presence == 0 && sm->frequency == 0)) return;
    int from = max_i(0, n_hist - sm->repeat_last_n);
    for (int i = from; i < n_hist; i++) cand[hist[i]].id = 0;
    for (int i = from; i < n_hist; i++) cand[hist[i]].id++;
    for (int i = from; i < n_hist; i++) {
        int t = hist[i], c = cand[t].id;
        if (!c) continue; /* counted and penalized already */
        cand[t].id = 0;
        float x = logits[t] <= 0 ? logits[t] * sm->repeat : logits[t] / sm->repeat;
        x -= (float)c * sm->frequency + (float)(c > 0) * sm->presence;
        /* held finite: a huge logit (damaged weights) times a penalty in range may still overflow, and an
           inf one makes the softmax's logit - max NaN */
        logits[t] = fminf(fmaxf(x, -FLT_MAX), FLT_MAX);
    }
}

/* The distribution the sampler draws from, as cand[0..keep) by falling
   probability (keep is returned; the kept probabilities sum to *total,
   the normalizer). The temperature comes first, then three cuts, each of
   which keeps a prefix of that order (so their own order does not matter):
   p = softmax(logits / T) over the whole vocabulary; top-k keeps the k most
   likely; top-p the shortest prefix whose p (normalized over the whole
   vocabulary) reaches top_p; min-p the tokens with p >= min_p times the
   most likely's p. logits is overwritten with p; cand is scratch for n
   candidates. */
static int sampling_dist(const Sampler *sm, float *logits, int n, Candidate *cand, float *total)
{
    /* logit - max: the largest becomes exactly 0, so no temperature, however
       small, can overflow it to inf (inf - inf = NaN in the softmax); and
       1/T is held to a finite float, so that 0 * (1/T) stays 0 */
    int top = sample_argmax(logits, n);
    float max = logits[top], scale = 1 / sm->temperature, running = -INFINITY;
    if (!(scale <= FLT_MAX)) scale = FLT_MAX;
    for (int i = 0; i < n; i++) logits[i] -= max;
    float sum = att_softmax(logits, n, scale, &running); /* exp((logit - max) / T), vectorized; returns their sum */
    for (int i = 0; i < n; i++) logits[i] /= sum;
    /* Tokens below (1-p)/(n-1) can never be in the nucleus, and min-p drops
       those below its floor: neither is gathered and sorted. */
    float cutoff = sm->top_p < 1 && n > 1 ? (1 - sm->top_p) / (n - 1) : 0, floor = sm->min_p * logits[top];
    int nc = gather_candidates(logits, n, floor > cutoff ? floor : cutoff, sm->top_k, cand);
    qsort(cand, nc, sizeof *cand, by_prob_desc);
    int keep = nc;
    *total = 0;
    for (int i = 0; i < nc; i++) {
        *total += cand[i].p;
        if (sm->top_p < 1 && *total >= sm->top_p) { keep = i + 1; break; } /* 1 = off: a float sum may reach 1 early */
    }
    return keep;
}

/* One draw from cand[0..keep) weighted by p, leaving out token `skip` (-1:
   none); total is the sum of the probabilities drawn from. When rounding
   leaves r past the sum, the last token of nonzero probability stands. */
static int draw(Sampler *sm, const Candidate *cand, int keep, float total, int skip)
{
    float r = random_f32(&sm->rng) * total, acc = 0;
    int last = -1;
    for (int i = 0; i < keep; i++) {
        if (cand[i].id == skip || cand[i].p <= 0) continue; /* p 0: a masked token, never drawn by rounding */
        acc += cand[i].p;
        if (cand[i].p > 0 || last < 0) last = cand[i].id;
        if (r < acc) return last;
    }
    return last;
}

/* --logprobs: a greedy pick's and a draw's report (Part II, "log-probabilities"). */
static void report_greedy(Logprobs *lp, const float *logits, int n, int chosen);
static void report_kept(Logprobs *lp, const Candidate *cand, int keep, float total, int chosen);

static void check_logits(const float *logits, int n)
{
    int bad = 0;
    for (int i = 0; i < n; i++) bad |= !(fabsf(logits[i]) <= FLT_MAX); /* no early exit: the loop vectorizes */
    for (int i = 0; bad && i < n; i++)
        if (!isfinite(logits[i]))
            die(EXIT_RUNTIME, "the model computed a non-finite logit (token %d): are the model file's weights damaged?", i);
}

/* Tokens not allowed (allowed[i] == 0; allowed NULL: all are) get
   probability 0: constrained output (the hooks' mask). */
static void mask_logits(float *logits, int n, const uint8_t *allowed)
{
    if (allowed)
        for (int i = 0; i < n; i++) if (!allowed[i]) logits[i] = -INFINITY;
}

static int sample_greedy(Sampler *sm, const float *logits, int n)
{
    int id = sample_argmax(logits, n);
    if (sm->report) report_greedy(sm->report, logits, n, id);
    return id;
}

/* The chain's steps before the draw: the logits must be finite; the
   penalties, then the hooks' mask change them. */
static void prepare_logits(const Sampler *sm, float *logits, int n, Candidate *cand, const uint8_t *allowed, const Tokens *hist)
{
    check_logits(logits, n);
    apply_penalties(sm, logits, hist->ids, hist->n, cand);
    mask_logits(logits, n, allowed);
}

/* The next token after the context hist (the ids fed so far, the
   prompt's included: the penalties look at them), from its logits;
   allowed, when not NULL, masks the tokens a hook forbids. */
static int sample(Sampler *sm, float *logits, int n, Candidate *cand, const uint8_t *allowed, const Tokens *hist)
{
    prepare_logits(sm, logits, n, cand, allowed, hist);
    if (sm->temperature == 0) return sample_greedy(sm, logits, n);
    float total;
    int keep = sampling_dist(sm, logits, n, cand, &total);
    int id = draw(sm, cand, keep, total, -1);
    if (sm->report) report_kept(sm->report, cand, keep, total, id);
    return id;
}

/* ============================================================================
   5. THE GENERATION LOOP
   ========================================================================= */

/* What the generation loop takes from the command line. */
typedef struct {
    int n_predict;      /* -n: tokens to generate at most */
    int lookup, lookup_fixed; /* --lookup N: longest draft of lookup decoding (0 = off); --lookup-fixed: see PassCost */
    int ignore_eos;     /* --ignore-eos: generate -n tokens whatever is sampled (benchmarks) */
    int print_ids;      /* --print-prompt-ids: each prefilled block's token ids go to stderr */
    int verbose;        /* -v: statistics per request */
    int logprobs;       /* --logprobs N: a record per token with N alternatives, not text (-1: text) */
    int special;        /* --special: control-token texts in prompts and chat messages are parsed */
    const char *system; /* -y: the system prompt (NULL: the template's own) */
    const struct Stops *stops; /* --stop: the answer ends before the first of these (NULL: none) */
    struct JsonConstraint *json; /* --json, --json-schema: the output's grammar (NULL: free text) */
    struct PromptCache *cache; /* --prompt-cache: where each prompt's K and V go after prefill (NULL: nowhere) */
} GenOpts;

/* Why an answer ended (generate's result; batch mode's records name it with FINISH). */
enum { STOP_END, STOP_LIMIT, STOP_CONTEXT, STOP_INTERRUPT, STOP_STRING,
       STOP_JSON_DONE /* --json: the value is complete (its last token was text) */ };

/* Set by SIGINT in chat mode: ends the current answer. */
static volatile sig_atomic_t interrupted, answering;

static void push(Tokens *t, int id)
{
    if (t->n == t->cap) {
        t->cap = t->cap ? 2 * t->cap : 256;
        t->ids = realloc(t->ids, t->cap * sizeof(int));
        if (!t->ids) die(EXIT_RUNTIME, "out of memory");
    }
    t->ids[t->n++] = id;
}

/* ----- tokenization ----------------------------------------------------------- */

/* Appends text, tokenized with tok_encode's flags, to t. Without
   TOK_PARSE_SPECIAL control-token look-alikes inside it stay text, so a
   message cannot inject template tokens. Returns the number of ids added. */
static size_t push_encoded(const Model *m, Tokens *t, const char *text, size_t len, int flags)
{
    int *ids;
    size_t n;
    if (tok_encode(m->tok, text, len, flags, &ids, &n) != 0) die(EXIT_RUNTIME, "out of memory tokenizing");
    for (size_t i = 0; i < n; i++) push(t, ids[i]);
    free(ids);
    return n;
}

/* Appends text tokenized as plain text (no BOS/EOS, no control tokens). */
static void push_text(const Model *m, Tokens *t, const char *text, size_t len) { push_encoded(m, t, text, len, 0); }

/* The id of a control token given by its text, or -1. */
static int special_id(const Model *m, const char *text)
{
    int *ids, id = -1;
    size_t n;
    if (tok_encode(m->tok, text, strlen(text), TOK_PARSE_SPECIAL, &ids, &n) != 0) die(EXIT_RUNTIME, "out of memory");
    if (n == 1 && tok_is_control(m->tok, ids[0])) id = ids[0];
    free(ids);
    return id;
}

/* ----- chat templates ----------------------------------------------------- */

/* The chat templates, reduced to what the generation loop needs. A turn is
   START ROLE [HEADER_END] SEP TEXT END AFTER; START, HEADER_END and END are
   control tokens, the rest text:
   ChatML:  <|im_start|>ROLE\nTEXT<|im_end|>\n
   Gemma:   <bos> <start_of_turn>ROLE\nTEXT<end_of_turn>\n  (the assistant is
            "model"; the system text opens the first user message)
   Llama 3: <|begin_of_text|> <|start_header_id|>ROLE<|end_header_id|>\n\nTEXT<|eot_id|> */
static const struct {
    const char *start, *header_end, *end; /* control tokens (header_end NULL: none) */
    const char *sep, *after;              /* text after the role, after the turn */
    const char *assistant;                /* the answering role */
    int bos;                              /* the conversation opens with BOS */
    int system_in_user;                   /* no system turn: the system text opens the first user message */
} TEMPLATES[] = {
    [TOK_CHAT_CHATML] = {"<|im_start|>", NULL, "<|im_end|>", "\n", "\n", "assistant", 0, 0},
    [TOK_CHAT_GEMMA] = {"<start_of_turn>", NULL, "<end_of_turn>", "\n", "\n", "model", 1, 1},
    [TOK_CHAT_LLAMA3] = {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "\n\n", "", "assistant", 1, 0},
};

typedef struct {
    int kind;            /* TOK_CHAT_*: the row of TEMPLATES */
    int start, header_end, end; /* their token ids (header_end -2: the template has none) */
    const char *system;  /* system prompt (-y, else the template's default) */
    size_t system_len;
    int system_pending;  /* system_in_user: not yet folded into a user message */
    int system_turn;     /* otherwise: open with a system turn */
    int special;         /* --special: control-token texts in the system and user text are parsed */
} Chat;

/* Why the model cannot chat, or NULL when it can; fills ch's template and turn tokens. */
static const char *chat_problem(Chat *ch, const Model *m)
{
    memset(ch, 0, sizeof *ch);
    ch->kind = tok_get_info(m->tok)->chat_template;
    if (ch->kind == TOK_CHAT_NONE) return "this model file has no chat template (export it from a GGUF/HF model that has one)";
    if (ch->kind < TOK_CHAT_NONE || ch->kind >= (int)(sizeof TEMPLATES / sizeof *TEMPLATES)) {
        static char unknown[ERR_BYTES]; /* one model per process: the text outlives the call (batch keeps it) */
        snprintf(unknown, sizeof unknown, "this model file's chat template id %u is unknown (this build knows "
                 "1 ChatML, 2 Gemma, 3 Llama 3)", (unsigned)ch->kind);
        return unknown;
    }
    ch->start = special_id(m, TEMPLATES[ch->kind].start);
    ch->end = special_id(m, TEMPLATES[ch->kind].end);
    ch->header_end = TEMPLATES[ch->kind].header_end ? special_id(m, TEMPLATES[ch->kind].header_end) : -2;
    if (ch->start < 0 || ch->end < 0 || ch->header_end == -1) return "the chat template's turn tokens are missing from the vocabulary";
    return NULL;
}

/* system[0..system_len) (any bytes, NUL too), or NULL for the template's default. */
static void build_chat(Chat *ch, const Model *m, const char *system, size_t system_len)
{
    const tok_info *ti = tok_get_info(m->tok);
    const char *problem = chat_problem(ch, m);
    if (problem) die(EXIT_RUNTIME, "%s", problem);
    ch->system = system ? system : ti->default_system;
    ch->system_len = system ? system_len : ti->default_system_len;
    ch->system_pending = TEMPLATES[ch->kind].system_in_user && ch->system_len;
    /* An explicit -y "" is an empty system message: the turn is still
       rendered (templates add their default only without one). */
    ch->system_turn = !TEMPLATES[ch->kind].system_in_user && (ch->system_len || system);
}

/* START ROLE [HEADER_END] SEP BODY: a turn's opening and its text. The
   text between two control tokens is tokenized as one piece, as the
   template rendered to a string and tokenized would be: a body that
   starts with a line break merges with SEP's ("\n\n" is one token in
   Qwen's vocabulary, not two). */
static void chat_turn_open(const Chat *ch, const Model *m, Tokens *t, const char *role, const char *body, size_t body_len)
{
    const char *sep = TEMPLATES[ch->kind].sep;
    size_t lead = strlen(role), sep_len = strlen(sep);
    push(t, ch->start);
    if (ch->header_end >= 0) { /* the role ends at its own control token */
        push_text(m, t, role, lead);
        push(t, ch->header_end);
        lead = 0;
    }
    char *buf = xmalloc(lead + sep_len + body_len + 1);
    memcpy(buf, role, lead);
    memcpy(buf + lead, sep, sep_len);
    if (body_len) memcpy(buf + lead + sep_len, body, body_len);
    push_encoded(m, t, buf, lead + sep_len + body_len, ch->special ? TOK_PARSE_SPECIAL : 0);
    free(buf);
}

/* END AFTER: a turn's close. */
static void chat_turn_close(const Chat *ch, const Model *m, Tokens *t)
{
    push(t, ch->end);
    push_text(m, t, TEMPLATES[ch->kind].after, strlen(TEMPLATES[ch->kind].after));
}

/* The tokens that open a conversation: BOS if the template has one, and
   the system turn, unless the template folds the system text into the
   first user message. */
static void chat_open(const Chat *ch, const Model *m, Tokens *t)
{
    const tok_info *ti = tok_get_info(m->tok);
    if (TEMPLATES[ch->kind].bos && ti->bos >= 0) push(t, ti->bos);
    if (ch->system_turn) {
        chat_turn_open(ch, m, t, "system", ch->system, ch->system_len);
        chat_turn_close(ch, m, t);
    }
}

/* A user turn followed by the assistant's opening, e.g.
   <|im_start|>user\nTEXT<|im_end|>\n<|im_start|>assistant\n */
static void chat_user_turn(Chat *ch, const Model *m, Tokens *t, const char *text, size_t len)
{
    size_t sys = ch->system_pending ? ch->system_len + 2 : 0;
    char *buf = xmalloc(len + sys + 1);
    if (sys) { memcpy(buf, ch->system, ch->system_len); memcpy(buf + ch->system_len, "\n\n", 2); }
    memcpy(buf + sys, text, len);
    chat_turn_open(ch, m, t, "user", buf, sys + len);
    chat_turn_close(ch, m, t);
    chat_turn_open(ch, m, t, TEMPLATES[ch->kind].assistant, "", 0);
    ch->system_pending = 0;
    free(buf);
}

/* Tokenization, where generation starts: the prompt's text becomes token
   ids, either wrapped in the chat template as one user turn (chat_wrap,
   with the template's or -y's system text) or as plain text to continue,
   with BOS where the model wants one and control-token texts parsed only
   with `special` (in the chat turns' system and user text too: a template
   turn typed by the user is what --special asks for). */
static void tokenize_prompt(const Model *m, const char *text, size_t len, Chat *ch, int special, Tokens *t)
{
    if (ch) {
        ch->special = special;
        chat_open(ch, m, t);
        chat_user_turn(ch, m, t, text, len);
    } else {
        push_encoded(m, t, text, len, TOK_ADD_SPECIAL | (special ? TOK_PARSE_SPECIAL : 0));
    }
}

/* Per-request numbers for -v: what the user waits for before the first
   token (TTFT, bound by prefill compute) and between tokens (ITL, bound by
   memory bandwidth in decode). */
typedef struct {
    int pos0;       /* tokens already cached before this request */
    int n_prompt, n_gen;
    double prefill_ms;
    double *itl;    /* [n_itl] gaps between sampled tokens, ms (a pass that yields several shares its time) */
    int n_itl;
    int passes, drafted, accepted; /* lookup decoding: forward passes after the prefill, drafts checked, drafts kept */
    int json_incomplete; long json_walks, json_hits; double json_walk_ms; /* --json: see grammar_mask_end */
} Stats;

/* Part II's entry points that the generation loop calls: the hooks that
   bring its features into the loop (hooks_open makes a single request's
   from GenOpts), the byte strings of a buffered answer, -v's report. */
typedef struct Buf Buf;
typedef struct Machine Machine; /* --probe's measured limits (Part II, "measurement") */
typedef struct Request Request;
typedef struct Hooks Hooks;
static void buf_put(Buf *b, const char *s, size_t n);
static void hooks_open(Request *r, const Model *m, RunState *s, Sampler *sm, const GenOpts *o);
static const uint8_t *hook_allowed(Request *r);
static void hook_logprobs(Request *r, int token);
static int hook_text(Request *r, int token, const char *text, size_t len);
static int hook_decode(Request *r, int *why, int *yielded);
static void hook_prefilled(Request *r, int n, double ms);
static void hook_prompt(Request *r, int n);
static void hook_answer_end(Request *r);
static int hooks_close(Request *r, int why, int fatal);
static int cached_prefix(const GenOpts *o, const Model *m, RunState *s, const Tokens *t, int pos);
static void report_stats(const Model *m, const RunState *s, const Machine *mc, Stats *st);
/* ----- streaming --------------------------------------------------------------- */

/* Token texts are written so that a UTF-8 character split across tokens
   is written whole: bytes of an unfinished character wait for the next
   token (or for the end of the answer). */
typedef struct {
    char buf[4];
    int len;
} Utf8Stream;

static int utf8_len(unsigned char lead)
{
    return lead < 0x80 ? 1 : (lead >> 5) == 6 ? 2 : (lead >> 4) == 14 ? 3 : (lead >> 3) == 30 ? 4 : 1;
}

/* stdout must take every byte. A reader that went away (EPIPE, e.g.
   `| head`) ends the run quietly with status 0, like other filters; any
   other failure (a full disk, a closed stdout) is an error. */
static void check_stdout(void)
{
    if (fflush(stdout) == 0 && !ferror(stdout)) return;
    if (errno == EPIPE) exit(EXIT_SUCCESS);
    die(EXIT_RUNTIME, "cannot write to stdout: %s", strerror(errno ? errno : EIO));
}

/* Before a successful exit: all of stdout written, and closed without
   error (some file systems report a failed write only at close). */
static void close_stdout(void)
{
    check_stdout();
    errno = 0;
    if (fclose(stdout) != 0 && errno != EPIPE) die(EXIT_RUNTIME, "cannot write to stdout: %s", strerror(errno ? errno : EIO));
}

/* Where an answer's text goes: through the UTF-8 holdback (a character is
   written whole) into the sink: stdout, or a memory buffer. The request
   owns it. */
typedef struct {
    FILE *f;  /* the sink: stdout (its failures end the run, see check_stdout) ... */
    Buf *buf; /* ... or, when f is NULL, a buffer the text is appended to (neither: none is kept; --logprobs) */
    Utf8Stream u;
} TextOut;

static void text_open(TextOut *o, FILE *f, Buf *buf)
{
    *o = (TextOut){.f = f, .buf = buf};
}

static void sink_put(TextOut *o, const char *p, size_t n)
{
    if (o->f == stdout && n && !marks.first_text_ms) marks.first_text_ms = now_ms();
    if (o->f) fwrite(p, 1, n, o->f);
    else if (o->buf) buf_put(o->buf, p, n);
}

/* Takes text, written a whole character at a time. */
static void text_put(TextOut *o, const char *p, size_t n)
{
    Utf8Stream *u = &o->u;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = p[i];
        if (u->len && (ch & 0xc0) != 0x80) { sink_put(o, u->buf, u->len); u->len = 0; } /* broken sequence */
        if (!u->len && utf8_len(ch) == 1) { sink_put(o, p + i, 1); continue; }
        u->buf[u->len++] = ch;
        if (u->len == utf8_len((unsigned char)u->buf[0])) { sink_put(o, u->buf, u->len); u->len = 0; }
    }
}

/* After a token's text: stdout is flushed when no character is pending. */
static void text_flush(TextOut *o)
{
    if (o->f && !o->u.len) check_stdout();
}

/* At the end of the answer: an unfinished character is written as it is. */
static void text_end(TextOut *o)
{
    sink_put(o, o->u.buf, o->u.len);
    o->u.len = 0;
    if (o->f) check_stdout();
}

/* One answer in the making: what the caller gives generate (conv, pos,
   n_predict, out), what it gets back (st, last), and what the loop's steps
   share. Batch mode keeps one per sequence and takes its tokens with the
   same steps. */
struct Request {
    Tokens *conv;  /* the conversation: every token fed is appended, so conv->n == pos after each step */
    int pos;       /* tokens of conv in the KV cache */
    int n_predict; /* tokens to generate at most */
    int capped;    /* n_predict was cut to what the context holds: reaching it is STOP_CONTEXT */
    TextOut *out;  /* where the answer's text goes */
    Stats st;      /* what it measured (st.itl: the caller frees it) */
    int last;      /* the last token sampled and taken, not fed (-1 when n_predict is 0) */
    /* the rest is set by hooks_open (batch mode: admit) */
    const Model *m;
    RunState *s;
    Sampler *sm;
    Candidate *cand; /* [vocab] the sampler's scratch */
    int ignore_eos;  /* an end token does not end the answer (--ignore-eos, unless a hook needs the end) */
    Hooks *h;        /* Part II's features on this answer */
};

/* The next token from a row of logits, under the hooks' mask of allowed
   tokens and with the conversation so far as the penalties' history. */
static int sample_next(Request *r, float *logits)
{
    return sample(r->sm, logits, r->m->c.vocab_size, r->cand, hook_allowed(r), r->conv);
}

/* Takes a sampled token, in every mode: an end token stops (never printed,
   never fed back); otherwise its text goes out (hook_text, which may end
   the answer) and it is counted, and the limits are checked (-n, the
   context at position r->pos, Ctrl-C). Returns STOP_* or -1 to go on.
   With the sampler's report (--logprobs) the token's record is written
   instead of its text, the stopping end token's too: the records then
   cover every token the model chose, and their log-probabilities add up to
   the likelihood of the whole answer, its end included. */
static int take_token(Request *r, int token)
{
    const Model *m = r->m;
    r->last = token;
    if (r->sm->report) hook_logprobs(r, token);
    if (tok_is_eog(m->tok, token) && !r->ignore_eos) return STOP_END;
    size_t len;
    const char *piece = tok_piece(m->tok, token, &len);
    const char *text = piece && !tok_is_control(m->tok, token) ? piece : NULL;
    int why = hook_text(r, token, text, text ? len : 0);
    r->st.n_gen++;
    if (why >= 0) return why;
    if (r->st.n_gen >= r->n_predict) return r->capped ? STOP_CONTEXT : STOP_LIMIT;
    if (r->pos >= r->s->seq_len) return STOP_CONTEXT;
    if (interrupted) return STOP_INTERRUPT;
    return -1;
}

/* One step of the decode loop: feeds the last token taken (at position
   r->pos), then samples and takes the next. A hook may instead feed more
   tokens in one pass and take several (hook_decode). Returns STOP_* or -1
   to go on; *yielded gets the number of tokens taken. */
static int decode_next(Request *r, int *yielded)
{
    push(r->conv, r->last);
    r->st.passes++;
    int why;
    if (hook_decode(r, &why, yielded)) return why;
    decode_step(r->m, r->s, r->last, r->pos++);
    *yielded = 1;
    return take_token(r, sample_next(r, r->s->logits));
}

/* Prefills the tokens of r->conv not yet cached (from r->pos), then samples,
   streams into r->out and decodes until an end token (never printed, never
   fed back), the hooks' end, n_predict tokens, the end of the context or
   Ctrl-C. Every token fed to the model is appended to conv, so conv->n ==
   r->pos on return. Returns why it stopped; r->last is the last token
   sampled (not fed; -1 when n_predict is 0: then nothing is sampled or
   printed). hook_prompt is told when the prompt's first token is out (or
   at the end), so that neither the TTFT nor a run cut short by its reader
   (`| head`) waits for what it does. The caller closes the hooks it opens
   (hooks_close), once r->st is reported. */
static int generate(const Model *m, RunState *s, Sampler *sm, const GenOpts *o, Request *r)
{
    hooks_open(r, m, s, sm, o);
    Tokens *conv = r->conv;
    Stats *st = &r->st;
    int n = conv->n - r->pos, why = STOP_LIMIT;
    *st = (Stats){.pos0 = r->pos, .n_prompt = n, .itl = xmalloc((r->n_predict + 1) * sizeof(double))};
    if (o->print_ids) {
        fputs("ids:", stderr);
        for (int i = 0; i < n; i++) fprintf(stderr, " %d", conv->ids[r->pos + i]);
        fputc('\n', stderr);
    }
    double t0 = now_ms();
    prefill(m, s, conv->ids + r->pos, n, r->pos, 0);
    r->pos += n;
    int n_prompt = r->pos, told = 0;
    int token = r->n_predict > 0 ? sample_next(r, s->logits) : -1;
    double t_prev = now_ms();
    st->prefill_ms = t_prev - t0;
    hook_prefilled(r, n, st->prefill_ms);
    r->last = token;
    if (r->n_predict > 0) why = take_token(r, token);
    while (r->n_predict > 0 && why < 0) {
        if (!told) hook_prompt(r, n_prompt), told = 1;
        int yielded;
        why = decode_next(r, &yielded);
        /* the pass yielded the tokens taken: they share its time */
        double t = now_ms();
        for (int i = 0; i < yielded && st->n_itl <= r->n_predict; i++) st->itl[st->n_itl++] = (t - t_prev) / yielded;
        t_prev = t;
    }
    hook_answer_end(r);
    if (!told) hook_prompt(r, n_prompt); /* the decode steps wrote only positions after it */
    return why;
}

/* What --batch takes from the command line besides GenOpts. */
typedef struct {
    const char *path; /* --batch FILE, "-": stdin */
    int parallel;     /* --parallel: sequences in flight (0: from the pool) */
    int kv_mb;        /* --kv-mem: the KV page pool */
    int chat, special; /* -c and --special: the defaults of every line */
} BatchOpts;

/* ============================================================================
   6. MAIN
   ========================================================================= */

/* The command line. */
typedef struct {
    const char *model_path, *prompt, *ids, *dump_logits, *ppl, *mode;
    int threads, ctx, tokenize, seed_set, chat_wrap, kv_type, probe;
    int exact_batch;  /* --no-batch (1), --exact-batch N: --dump-logits passes computed as decode steps */
    int no_batch;     /* --no-batch was given */
    int hugepages;    /* --hugepages: the model read into memory of the run's own, in 2 MiB pages */
    Sampler sampling; /* -t, -p, -k, --min-p and the penalties (the generator is seeded in main) */
    unsigned long long seed;
    const char *kernels; /* --kernels NAME (NULL: $KERNELS_ENV, else the best set this CPU runs) */
    GenOpts gen;      /* what the generation loop takes (see GenOpts) */
    BatchOpts batch;  /* --batch, --parallel, --kv-mem */
} Args;
#define KERNELS_ENV "RUN_KERNELS" /* the environment's default for --kernels */


/* Part II's entry points that main calls: the command line, the kernel set,
   the features' set-up (open_features), the machine probe, and the modes
   other than generation (chat, batch, perplexity, logits). */
static void reserve_std_fds(void);
static void parse_args(Args *a, int argc, char **argv);
static int usable_cpus(void);
static void check_stacks(int threads);
static void select_kernels(int set);
static int kernel_set_named(const char *v, const char *what);
static int best_kernel_set(void);
static void watch_model_file(const Model *m, const char *path);
static double fill_page_tables(const Model *m, int threads);
static const char *kernel_set_name(void);
static void check_kv_type(int type, int head_dim);
static size_t prompt_tokens(const Model *m, const Args *a, int ctx, Tokens *t);
static void keep_every_position(RunState *s, const Config *c);
static void open_features(GenOpts *o, const Model *m, const RunState *s);
static void close_features(GenOpts *o);
static const Machine *probe_machine(int threads);
static void report_process(const Model *m, double load_ms);
static void report_model(const Model *m, const char *path, int seq_len, int kv_type, int keep_all, int threads, double load_ms);
static void chat_loop(const Model *m, RunState *s, Sampler *sm, const GenOpts *o, const Machine *mc);
/* Runs every line of bo->path ("-": stdin) and writes the records.
   Returns the exit status: 1 if a line failed, 130 after Ctrl-C, else 0. */
static int run_batch(const Model *m, RunState *s, const Sampler *sm, const GenOpts *o, const BatchOpts *bo);
static void perplexity(const Model *m, RunState *s, const char *path, int ctx);
static void dump_logits(const Model *m, RunState *s, const Tokens *p, const Args *a);
/* The team's size: --threads, or the CPUs this process may use, and never
   more than those: the barriers spin, so threads beyond the cores only wait
   for each other (--threads 1024 on 2 cores took over a minute per token). */
static int team_threads(int requested, int verbose)
{
    int cores = usable_cpus(), threads = requested ? requested : cores;
    if (threads > cores) {
        if (verbose) fprintf(stderr, "note: --threads %d capped to the %d CPUs this process may use\n", threads, cores);
        threads = cores;
    }
#ifdef _OPENMP
    omp_set_num_threads(threads > 0 ? threads : 1);
#else
    threads = 1;
#endif
    return threads;
}

/* Single mode: one answer to the prompt, streamed to stdout. */
static void answer(const Model *m, RunState *s, Sampler *sm, const GenOpts *o, Tokens *prompt, int seq_len, const Machine *mc)
{
    TextOut out;
    text_open(&out, o->logprobs >= 0 ? NULL : stdout, NULL); /* --logprobs: records, not text */
    Request r = {.conv = prompt, .n_predict = o->n_predict, .out = &out};
    r.pos = cached_prefix(o, m, s, prompt, 0);
    if (r.n_predict > seq_len - prompt->n + 1) {
        r.n_predict = seq_len - prompt->n + 1, r.capped = 1;
        if (o->verbose) fprintf(stderr, "note: -n %d capped to %d by the context (%d tokens, %d in the prompt)\n", o->n_predict, r.n_predict, seq_len, prompt->n);
    }
    int why = generate(m, s, sm, o, &r);
    if (o->verbose) report_stats(m, s, mc, &r.st);
    free(r.st.itl);
    hooks_close(&r, why, 1);
}

/* --tokenize: the prompt's token ids on one line, and nothing else. */
static int print_ids(Tokens *prompt, Model *m)
{
    for (int i = 0; i < prompt->n; i++) printf(i ? " %d" : "%d", prompt->ids[i]);
    printf("\n");
    close_stdout();
    free(prompt->ids);
    free_model(m);
    return 0;
}

int main(int argc, char **argv)
{
    marks.start_ms = now_ms();
    reserve_std_fds();
    Args a;
    parse_args(&a, argc, argv);
    signal(SIGPIPE, SIG_IGN); /* a closed stdout shows up as EPIPE: see check_stdout */
    /* RUN_KERNELS in the environment: the default of --kernels, so that a script (the test suite) can pin
       every run it starts to one set without passing the flag to each (set but empty, it is unset) */
    const char *env = getenv(KERNELS_ENV), *kernels = a.kernels ? a.kernels : env && *env ? env : NULL;
    select_kernels(kernels ? kernel_set_named(kernels, a.kernels ? "--kernels" : KERNELS_ENV) : best_kernel_set());
    signal(SIGXFSZ, SIG_IGN); /* a file-size limit shows up as EFBIG, reported like any failed write */
    double t0 = now_ms();
    Model m;
    char err[ERR_BYTES];
    if ((a.tokenize ? load_model(&m, a.model_path, 1, 0, err) : build_model(&m, a.model_path, a.hugepages, err)) != 0)
        die(EXIT_RUNTIME, "%s: %s", a.model_path, err);
    watch_model_file(&m, a.model_path);
    double load_ms = now_ms() - t0;
    int chat = !strcmp(a.mode, "chat");
    int seq_len = a.ctx ? a.ctx : a.ppl ? PPL_DEFAULT_CTX : m.c.max_seq_len;
    if (seq_len > m.c.max_seq_len) die(EXIT_USAGE, "--ctx %d exceeds the model's context length %d", seq_len, m.c.max_seq_len);
    if (a.ppl && seq_len < PPL_MIN_CTX)
        die(EXIT_USAGE, "--ppl needs --ctx %d or more: a window of %d tokens has no second half to score", PPL_MIN_CTX, seq_len);

    Tokens prompt = {0};
    size_t prompt_bytes = 0;
    int batch = a.batch.path != NULL;
    if (!chat && !a.ppl && !batch) prompt_bytes = prompt_tokens(&m, &a, a.tokenize ? MAX_SEQ : seq_len, &prompt);
    if (a.tokenize) return print_ids(&prompt, &m);
    if (!chat && !a.ppl && !batch && prompt.n == 0) {
        if (prompt_bytes) die(EXIT_RUNTIME, "the prompt's %zu bytes have no token in this model's vocabulary", prompt_bytes);
        die(EXIT_RUNTIME, "the prompt is empty");
    }
    if (prompt.n > seq_len) die(EXIT_RUNTIME, "prompt has %d tokens but the context holds %d", prompt.n, seq_len);

    int threads = team_threads(a.threads, a.gen.verbose);
    check_stacks(threads);
    load_ms += fill_page_tables(&m, threads);
    RunState s;
    check_kv_type(a.kv_type, m.c.head_dim);
    build_state(&s, &m, seq_len, threads, a.kv_type);
    int keep_all = a.gen.cache && !batch && m.c.window; /* a prompt cache stores whole prompts (batch mode: whole pages) */
    if (keep_all) keep_every_position(&s, &m.c);
    if (a.gen.verbose) report_model(&m, a.model_path, seq_len, a.kv_type, keep_all, threads, load_ms);
    open_features(&a.gen, &m, &s);
    const Machine *mc = a.probe ? probe_machine(threads) : NULL;
    Sampler sm = a.sampling;
    sm.rng = seed_state(a.seed_set ? a.seed : (unsigned long long)time(NULL) ^ ((unsigned long long)getpid() << 32));
    int status = EXIT_SUCCESS;
    if (a.ppl) perplexity(&m, &s, a.ppl, seq_len);
    else if (batch) status = run_batch(&m, &s, &sm, &a.gen, &a.batch);
    else if (a.dump_logits) dump_logits(&m, &s, &prompt, &a);
    else if (chat) chat_loop(&m, &s, &sm, &a.gen, mc);
    else if (a.gen.n_predict > 0 || a.gen.cache) /* -n 0 with a prompt cache: prefill the prompt into it */
        answer(&m, &s, &sm, &a.gen, &prompt, seq_len, mc);
    close_features(&a.gen);
    if (a.gen.verbose) report_process(&m, load_ms);
    close_stdout();
    free(prompt.ids);
    free_state(&s);
    free_model(&m);
    return status;
}

/* ############################################################################
   PART II: THE MACHINERY
   What makes Part I fast and useful without changing what it computes:
   the thread team, the kernel tables and the choice of a kernel set, the
   packed layout of the matrices, attention in chunks, measurement, stop
   strings, JSON (reading, writing and constraining output to a grammar),
   the prompt cache, lookup decoding, batch mode with its paged KV cache,
   perplexity and the command line. Then the appendices, one per
   instruction set, each with its kernels and its rows of the tables.
   ######################################################################### */

/* ----- limits and tuning --------------------------------------------------
   The bounds check_model_file puts on a header, and the machinery's work units. */
#define ATT_CHUNK 256  /* cached positions per attention chunk: decode's work unit, whose partial softmaxes fold in order */
#define HUGE_PAGE_BYTES ((size_t)2 << 20) /* a transparent huge page on x86-64 (and aarch64 with 4 KiB pages) */
#define PARTIAL_HEAD 2 /* a partial softmax's running maximum and sum, before its head_dim outputs */
#define VERIFY_MAX_TOKENS 16 /* lookup decoding: the last token and up to 15 drafts in one pass */
#define PAGE_TOKENS CHUNK_TOKENS /* batch mode: positions per KV cache page (a prefill chunk's worth);
                          a shared prompt prefix is shared in whole pages */
#define BATCH_MAX 64   /* batch mode: sequences decoded together in one pass, at most */
#define ATT_QTILE 16   /* prefill: query tokens per attention work unit */
#define ATT_KTILE 64   /* cached positions converted to floats at a time */
#define KV_AHEAD 4096       /* bytes of a KV stream requested ahead of use (attend_chunk; measured: 1-16 KB all help) */
#define WEIGHT_AHEAD 8192   /* bytes of a weight stream requested ahead of use (decode_prefetch) */
#define WIDE_AHEAD 3   /* a wide K product asks for the record this many ahead in its stream (prefetch_part) */
#define CACHE_LINE 64
#define MAX_DIM (1 << 16)
#define MAX_LAYERS 1024
#define MAX_HEADS 1024
#define MAX_HEAD_DIM 1024
#define MAX_VOCAB (1 << 24)
#define MAX_TENSORS (1 << 20)

/* The packed layout's constants and the entry points of Part II used before their sections. */
#define PACK_ALIGN 64 /* every group starts on a cache line */
#define PACK_CHAINS 4 /* a one-token call's integer sums run in this many independent chains (integer
                         adds: the same result in any order) */
#define PACK_VECTOR 64 /* bytes of one vector of packed integers ... */
#define PACK_LANE 4   /* ... of which each row has one lane */
static void quantize_act(int act, void *out, const float *x, int n);
static PackedFn packed_kernel(int type);
static const PackForm *packed_form(int type);
static size_t packed_group_bytes(const PackForm *f, int n);
static void packed_row_to_float(float *out, int type, const PackForm *f, const uint8_t *group, int r, int n);

/* ----- errors --------------------------------------------------------------
   die and the allocators that Part I declares at its top. */

#define LINE_BYTES (4 * MSG_BYTES + 8) /* a message with every byte escaped */

/* Formats "run: MESSAGE\n" into out (LINE_BYTES) with control characters
   escaped as Python's repr shows them (\n, \x1b; C1 controls in UTF-8
   too), so that a message quoting a hostile argument, path or file byte
   stays one plain line and cannot colour the terminal. */
static void format_error(char *out, const char *fmt, va_list ap)
{
    char msg[MSG_BYTES];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t k = sprintf(out, "run: ");
    for (const unsigned char *p = (const unsigned char *)msg; *p; p++) {
        int c1 = p[0] == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f; /* U+0080..U+009F */
        unsigned c = c1 ? *++p : *p;
        if (c == '\n') k += sprintf(out + k, "\\n");
        else if (c == '\t') k += sprintf(out + k, "\\t");
        else if (c == '\r') k += sprintf(out + k, "\\r");
        else if (c < 0x20 || c == 0x7f || c1) k += sprintf(out + k, "\\x%02x", c);
        else out[k++] = (char)c;
    }
    sprintf(out + k, "\n");
}

static void print_error(const char *fmt, va_list ap)
{
    char line[LINE_BYTES];
    format_error(line, fmt, ap);
    fputs(line, stderr);
}

/* format_error with arguments. */
static void format_line(char *out, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    format_error(out, fmt, ap);
    va_end(ap);
}

/* A file this run is writing under a temporary name (--dump-logits,
   --prompt-cache), or "": removed by die() and by the fatal-signal
   handlers, so that no partial file outlives the run. */
static char temp_path[MSG_BYTES];

static _Noreturn void die(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (temp_path[0]) unlink(temp_path);
    print_error(fmt, ap);
    va_end(ap);
    exit(code);
}

/* Ends the run on a fatal signal without leaving the temporary file. */
static void on_fatal_signal(int sig)
{
    if (temp_path[0]) unlink(temp_path);
    signal(sig, SIG_DFL);
    raise(sig);
}


static void *xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p) die(EXIT_RUNTIME, "out of memory allocating %zu bytes", n);
    return p;
}

static void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) die(EXIT_RUNTIME, "out of memory allocating %zu x %zu bytes", n, size);
    return p;
}

/* Replaces control bytes with '?' (a loader error quoting a damaged file). */
static void one_line(char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s < 0x20 || *s == 0x7f) *s = '?';
}

/* ----- validating the model file ----------------------------------------------
   The file is untrusted, and section 1 reads it trusting every byte: before
   it does, check_model_file checks them all, in the order the file holds
   them. The header's fields (check_header, check_family); the tokenizer
   section (read_tokenizer, which builds the tokenizer); the tensor table,
   each tensor's place in the file and the padding between them
   (check_tensor_table); then each tensor's shape, type and layout against
   what the header implies (check_weights). A file that breaks a rule is
   refused with one line that names what is wrong, so nothing reads outside
   the mapping and a damaged offset or count is never read as weights.
   Last, the weights' counts that -v reports (count_weights). */

/* The tokenizer section's header: the byte offsets of the counts that size
   its arrays (tokenizer.c reads the rest), and of its reserved bytes */
enum { TOKS_N_VOCAB = 8, TOKS_N_MERGES = 12, TOKS_FLAGS = 32, TOKS_SYSTEM_LEN = 40, TOKS_BLOB_LEN = 44,
       TOKS_RESERVED = 48, TOKS_HEADER_BYTES = 64 };
#define TOKS_N_FLAGS 3      /* the tokenizer flags' bits this build knows: add BOS, add EOS, space prefix */
#define TOKS_ALIGN 4        /* each array of the tokenizer section starts on a 4-byte boundary */
#define TOKS_MERGE_BYTES 12 /* a merge rule: three i32 ids */

/* From "the packed layout" below: a record's bytes and elements, and which
   row owns byte o of a record and what that byte holds in a zero block. */
static size_t packed_record_bytes(const PackForm *f);
static int packed_block(const PackForm *f);
static int packed_byte_row(const PackForm *f, size_t o);
static int packed_zero_byte(const PackForm *f, size_t o);

/* Index of the first nonzero byte of p[0..n), or n when all are zero. */
static size_t nonzero_at(const uint8_t *p, size_t n)
{
    size_t i = 0;
    while (i < n && !p[i]) i++;
    return i;
}

/* From "the kernel tables" below: the bytes of a packed matrix. */
static size_t packed_bytes(int type, size_t rows, size_t cols);

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* The bytes a tensor's data takes in the file. */
static size_t tensor_bytes(const Tensor *t)
{
    return t->layout == LAYOUT_PACKED ? packed_bytes(t->type, t->rows, t->cols) : row_bytes(t->type, t->cols) * t->rows;
}

/* The lowest bit of flags at or above n_known (a bit this build does not
   know), or -1. */
static int unknown_bit(uint32_t flags, int n_known)
{
    for (int bit = n_known; bit < 32; bit++)
        if (flags >> bit & 1) return bit;
    return -1;
}

/* The header flags' names, by bit (export.py's manual, "The model file"). */
static const char *const FLAG_NAME[N_FLAGS] = {"tied", "qkv_bias", "qk_norm", "post_norms", "rope_freqs", "split"};

/* The header's fields, which read_config and read_family have copied into
   m->c: every one is checked before anything is sized by it. */
static int check_header(const Model *m, char *err)
{
    const uint8_t *h = m->map;
    const Config *c = &m->c;
    if (m->map_size < HEADER_BYTES || memcmp(h + HDR_MAGIC, FILE_MAGIC, 4) != 0)
        LOAD_FAIL("not a model file (bad magic; convert it with export.py)");
    if (rd_u32(h + HDR_VERSION) != FILE_VERSION)
        LOAD_FAIL("unsupported file version %u (this build reads version %d%s)", rd_u32(h + HDR_VERSION), FILE_VERSION,
                  rd_u32(h + HDR_VERSION) < FILE_VERSION ? ": re-export the model with this version's export.py" : "");
    if (rd_u32(h + HDR_SIZE) != HEADER_BYTES)
        LOAD_FAIL("header size %u, but a version %d header is %d bytes", rd_u32(h + HDR_SIZE), FILE_VERSION, HEADER_BYTES);
    if (rd_u64(h + HDR_FILE_SIZE) != m->map_size)
        LOAD_FAIL("file is %zu bytes but its header says %llu (truncated or damaged)",
            m->map_size, (unsigned long long)rd_u64(h + HDR_FILE_SIZE));
    if (rd_u32(h + HDR_ARCH) < ARCH_LLAMA || rd_u32(h + HDR_ARCH) > ARCH_GEMMA3)
        LOAD_FAIL("unsupported architecture id %u (this build knows 1 llama, 2 qwen2, 3 qwen3, 4 gemma3)", rd_u32(h + HDR_ARCH));
    size_t z = HDR_RESERVED + nonzero_at(h + HDR_RESERVED, HEADER_BYTES - HDR_RESERVED);
    if (z < HEADER_BYTES) LOAD_FAIL("header: reserved byte %zu is 0x%02x, not zero", z, h[z]);
    uint32_t v[HDR_SHAPE_FIELDS];
    for (int i = 0; i < HDR_SHAPE_FIELDS; i++) v[i] = rd_u32(h + HDR_DIM + 4 * i);
    /* one check per field, so that the message names the field that is wrong */
    static const char *const field[HDR_SHAPE_FIELDS] = {"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads",
                                                        "head_dim", "vocab_size", "context length"};
    const uint32_t max[HDR_SHAPE_FIELDS] = {MAX_DIM, MAX_DIM, MAX_LAYERS, MAX_HEADS, MAX_HEADS, MAX_HEAD_DIM, MAX_VOCAB, MAX_SEQ};
    for (int i = 0; i < HDR_SHAPE_FIELDS; i++)
        if (v[i] == 0 || v[i] > max[i]) LOAD_FAIL("header: %s %u is outside [1, %u]", field[i], v[i], max[i]);
    if (v[4] > v[3] || v[3] % v[4]) LOAD_FAIL("header: n_kv_heads %u does not divide n_heads %u", v[4], v[3]);
    if (v[5] % 2) LOAD_FAIL("header: head_dim %u is odd", v[5]);
    if ((size_t)v[3] * v[5] > MAX_DIM) LOAD_FAIL("header: n_heads x head_dim = %zu exceeds %d", (size_t)v[3] * v[5], MAX_DIM);
    if (c->rope_dim <= 0 || c->rope_dim > c->head_dim || c->rope_dim % 2)
        LOAD_FAIL("header: rope_dim %u is not an even number in [2, head_dim %d]", (unsigned)c->rope_dim, c->head_dim);
    if (!isfinite(c->rope_theta) || c->rope_theta <= 1) LOAD_FAIL("header: rope_theta %g is not a finite number > 1", c->rope_theta);
    if (!isfinite(c->norm_eps) || c->norm_eps <= 0) LOAD_FAIL("header: norm_eps %g is not a finite number > 0", c->norm_eps);
    return 0;
}

/* The header's flags, and the family's fields from offset 104 (zero means
   llama's behaviour), once check_header has checked the shape. */
static int check_family(const Model *m, char *err)
{
    const uint8_t *h = m->map;
    const Config *c = &m->c;
    uint32_t flags = rd_u32(h + HDR_FLAGS), gate = rd_u32(h + HDR_ACTIVATION);
    float embed_scale = rd_f32(h + HDR_EMBED_SCALE), att_scale = rd_f32(h + HDR_ATT_SCALE);
    float theta_local = rd_f32(h + HDR_ROPE_THETA_LOCAL), rope_scale = rd_f32(h + HDR_ROPE_SCALE);
    int bit = unknown_bit(flags, N_FLAGS);
    if (bit >= 0) {
        char known[ERR_BYTES / 2] = "";  /* the names take ~60 bytes; the sentence around them fits beside */
        for (int b = 0; b < N_FLAGS; b++)
            snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", b ? ", " : "", FLAG_NAME[b]);
        LOAD_FAIL("unsupported feature flag bit %d (this build knows bits 0-%d: %s)", bit, N_FLAGS - 1, known);
    }
    if (gate > GATE_GELU) LOAD_FAIL("header: unknown activation %u (this build knows 0 SiLU, 1 GELU)", gate);
    /* u32 fields held in ints: compared and shown as read */
    if ((unsigned)c->window > (unsigned)c->max_seq_len)
        LOAD_FAIL("header: sliding window %u exceeds the context length %d", (unsigned)c->window, c->max_seq_len);
    if ((unsigned)c->window_pattern > (unsigned)c->n_layers)
        LOAD_FAIL("header: sliding-window pattern %u exceeds n_layers %d", (unsigned)c->window_pattern, c->n_layers);
    /* scales: 0 means the usual value; anything else must be a positive
       normal float (a subnormal one scales every value to 0 or near it) */
    const float *f[] = {&embed_scale, &att_scale, &theta_local, &rope_scale};
    static const char *const fname[] = {"embedding scale", "attention scale", "local rope_theta", "rope scaling factor"};
    for (int i = 0; i < 4; i++)
        if (*f[i] != 0 && !(isnormal(*f[i]) && *f[i] > 0))
            LOAD_FAIL("header: %s %g is not a finite, normal number > 0", fname[i], *f[i]);
    if (c->rope_theta_local <= 1) LOAD_FAIL("header: local rope_theta %g is not > 1", c->rope_theta_local);
    return 0;
}

/* The tokenizer section's arrays, in order, for messages. */
static const char *const TOKS_ARRAY[] = {"text offsets", "token types", "scores", "merges", "default system prompt",
                                         "text blob"};

/* Where the tokenizer section's last array ends (export.py's manual, "Tokenizer
   section"): text offsets, types, scores, merges, default system prompt,
   text blob, each from a 4-byte boundary. Called once tok_create has
   checked that they fit; it does not check that nothing follows them.
   *pad: the first nonzero padding byte between two arrays (0: none), and
   *after: the array that it follows. */
static size_t tok_section_end(const uint8_t *sec, size_t *pad, int *after)
{
    size_t n = rd_u32(sec + TOKS_N_VOCAB);
    size_t bytes[] = {(n + 1) * sizeof(uint32_t), n, n * sizeof(float), (size_t)rd_u32(sec + TOKS_N_MERGES) * TOKS_MERGE_BYTES,
                      rd_u32(sec + TOKS_SYSTEM_LEN), rd_u32(sec + TOKS_BLOB_LEN)};
    _Static_assert(sizeof bytes / sizeof *bytes == sizeof TOKS_ARRAY / sizeof *TOKS_ARRAY, "a name per array");
    size_t end = TOKS_HEADER_BYTES;
    *pad = 0;
    for (int i = 0; i < (int)(sizeof bytes / sizeof *bytes); i++) {
        size_t start = align_up(end, TOKS_ALIGN), z = end + nonzero_at(sec + end, start - end);
        if (z < start && !*pad) *pad = z, *after = i - 1; /* the header ends on a boundary: i > 0 here */
        end = start + bytes[i];
    }
    return end;
}

/* The tokenizer section: right after the header, exactly as long as its
   arrays, its reserved header bytes zero. Builds the tokenizer into *tok:
   tok_create checks the arrays as it reads them. */
static int read_tokenizer(const Model *m, tok_tokenizer **tok, char *err)
{
    uint64_t off = rd_u64(m->map + HDR_TOK_OFFSET), size = rd_u64(m->map + HDR_TOK_SIZE);
    if (off % TOKS_ALIGN || off > m->map_size || m->map_size - off < size)
        LOAD_FAIL("tokenizer section lies outside the file or is misaligned");
    if (off != HEADER_BYTES) LOAD_FAIL("tokenizer section at offset %llu, not right after the header (%d)", (unsigned long long)off, HEADER_BYTES);
    const uint8_t *sec = m->map + off;
    char why[ERR_BYTES];
    if (tok_create(tok, sec, size, why, sizeof why) != 0) LOAD_FAIL("tokenizer: %.200s", why);
    size_t pad;
    int after = 0;
    size_t end = tok_section_end(sec, &pad, &after);
    if (end != size)
        LOAD_FAIL("tokenizer section size %llu disagrees with its arrays, which end at byte %zu", (unsigned long long)size, end);
    size_t z = TOKS_RESERVED + nonzero_at(sec + TOKS_RESERVED, TOKS_HEADER_BYTES - TOKS_RESERVED);
    if (z < TOKS_HEADER_BYTES) LOAD_FAIL("tokenizer section: reserved byte %zu is 0x%02x, not zero", z, sec[z]);
    if (pad) LOAD_FAIL("tokenizer section: padding byte %zu after the %s is 0x%02x, not zero", pad, TOKS_ARRAY[after], sec[pad]);
    int bit = unknown_bit(rd_u32(sec + TOKS_FLAGS), TOKS_N_FLAGS);
    if (bit >= 0) LOAD_FAIL("tokenizer section: unknown flag bit %d (this build knows bits 0-%d: add BOS, add EOS, space prefix)",
                            bit, TOKS_N_FLAGS - 1);
    if (tok_get_info(*tok)->n_vocab > m->c.vocab_size)
        LOAD_FAIL("tokenizer has %d tokens but the embedding only %d rows", tok_get_info(*tok)->n_vocab, m->c.vocab_size);
    return 0;
}

/* The tensors of section 1's slots (SLOT_*, LT_*) by name. Which of them
   a file holds depends on the header's flags: a tensor is present when the
   header sets its `flag` (0: always) and not its `absent` flag (a split
   file stores wq, wk, wv instead of wqkv). */
typedef struct {
    const char *name;
    uint32_t flag, absent;
} SlotRule;
static const SlotRule global_tensor[SLOT_LAYERS] = {
    {"tok_embeddings", 0, 0}, {"norm", 0, 0}, {"output", 0, FLAG_TIED_EMBEDDINGS}, {"rope_freqs", FLAG_ROPE_FREQS, 0},
};
static const SlotRule layer_tensor[LAYER_TENSORS] = {
    {"attn_norm", 0, 0}, {"wqkv", 0, FLAG_SPLIT}, {"wq", FLAG_SPLIT, 0}, {"wk", FLAG_SPLIT, 0}, {"wv", FLAG_SPLIT, 0},
    {"bqkv", FLAG_QKV_BIAS, 0}, {"q_norm", FLAG_QK_NORM, 0}, {"k_norm", FLAG_QK_NORM, 0}, {"wo", 0, 0},
    {"post_attn_norm", FLAG_POST_NORMS, 0}, {"ffn_norm", 0, 0}, {"w13", 0, FLAG_SPLIT}, {"w1", FLAG_SPLIT, 0},
    {"w3", FLAG_SPLIT, 0}, {"w2", 0, 0}, {"post_ffn_norm", FLAG_POST_NORMS, 0},
};

static const SlotRule *slot_rule(int slot)
{
    return slot < SLOT_LAYERS ? &global_tensor[slot] : &layer_tensor[(slot - SLOT_LAYERS) % LAYER_TENSORS];
}

/* Does a model with the header's flags hold the tensor of this slot? */
static int slot_present(const Config *c, int slot)
{
    const SlotRule *r = slot_rule(slot);
    return (c->flags & r->flag) == r->flag && !(c->flags & r->absent);
}

/* The slot of tensor `name` in a model of shape c, whatever the flags, or
   -1 when it has none such ("layers.30.wo" in a 30-layer model, "layers.01.wo"). */
static int slot_of_name(const Config *c, const char *name)
{
    for (int i = 0; i < SLOT_LAYERS; i++)
        if (!strcmp(name, global_tensor[i].name)) return i;
    const char *p = name + strlen("layers.");
    if (strncmp(name, "layers.", strlen("layers.")) || *p < '0' || *p > '9') return -1;
    char *end;
    unsigned long l = strtoul(p, &end, 10);
    if (l >= (unsigned long)c->n_layers || *end != '.' || (*p == '0' && end != p + 1)) return -1;
    for (int i = 0; i < LAYER_TENSORS; i++)
        if (!strcmp(end + 1, layer_tensor[i].name)) return SLOT_LAYERS + LAYER_TENSORS * (int)l + i;
    return -1;
}

/* ... and -1 also when the header's flags leave that tensor out. */
static int tensor_slot(const Config *c, const char *name)
{
    int slot = slot_of_name(c, name);
    return slot >= 0 && slot_present(c, slot) ? slot : -1;
}

static void slot_name(char name[TENSOR_NAME_BYTES], int slot)
{
    if (slot < SLOT_LAYERS) snprintf(name, TENSOR_NAME_BYTES, "%s", global_tensor[slot].name);
    else snprintf(name, TENSOR_NAME_BYTES, "layers.%d.%s", (slot - SLOT_LAYERS) / LAYER_TENSORS,
                  layer_tensor[(slot - SLOT_LAYERS) % LAYER_TENSORS].name);
}

/* Refuses, by name, a table entry that the header's flags leave out
   (layers.N.wqkv in a split file, a bias without qkv_bias): checked before
   the tensor count, which could only say that the count is wrong. */
static int check_flag_tensors(const Model *m, uint32_t n, uint64_t off, char *err)
{
    const Config *c = &m->c;
    for (uint32_t i = 0; i < n; i++) {
        const char *name = (const char *)m->map + off + (size_t)i * TENSOR_ENTRY_BYTES + ENT_NAME;
        int slot = memchr(name, 0, TENSOR_NAME_BYTES) ? slot_of_name(c, name) : -1; /* unterminated: refused later */
        if (slot < 0 || slot_present(c, slot)) continue;
        const SlotRule *r = slot_rule(slot);
        uint32_t why = c->flags & r->absent ? r->absent : r->flag & ~c->flags;
        int bit = 0;
        while (!(why >> bit & 1)) bit++;
        LOAD_FAIL("tensor %s does not belong in this file: the header %s flag bit %d (%s)", name,
                  c->flags & r->absent ? "sets" : "does not set", bit, FLAG_NAME[bit]);
    }
    return 0;
}

/* Into name: " (no T)", T the first tensor the header implies that none
   of the table's n entries names, or "" when there is none such. For the
   message of a table with too few entries. */
static void first_missing(const Model *m, uint32_t n, uint64_t off, char name[TENSOR_NAME_BYTES + 8])
{
    const Config *c = &m->c;
    char *seen = xcalloc(n_slots(c), 1);
    for (uint32_t i = 0; i < n; i++) {
        const char *e = (const char *)m->map + off + (size_t)i * TENSOR_ENTRY_BYTES + ENT_NAME;
        int slot = memchr(e, 0, TENSOR_NAME_BYTES) ? tensor_slot(c, e) : -1;
        if (slot >= 0) seen[slot] = 1;
    }
    int s = 0;
    while (s < n_slots(c) && (!slot_present(c, s) || seen[s])) s++;
    free(seen);
    name[0] = 0;
    if (s < n_slots(c)) {
        char t[TENSOR_NAME_BYTES];
        slot_name(t, s);
        snprintf(name, TENSOR_NAME_BYTES + 8, " (no %s)", t);
    }
}

/* Which section before the tensor data holds byte `off`. */
static const char *section_at(uint64_t off, uint64_t tok_end)
{
    return off < HEADER_BYTES ? "the header" : off < tok_end ? "the tokenizer section" : "the tensor table";
}

/* Padding bytes [from, to) of the file, before `what`, must be zero. */
static int check_padding(const Model *m, uint64_t from, uint64_t to, const char *what, char *err)
{
    size_t z = nonzero_at(m->map + from, to - from);
    if (z < to - from) LOAD_FAIL("padding byte %llu before %s is 0x%02x, not zero", (unsigned long long)(from + z), what, m->map[from + z]);
    return 0;
}

/* A tensor table entry's name field (entry i): a printable ASCII name,
   then NUL up to the field's end, so that the bytes after the name carry
   nothing a reader of the name would miss. */
static int check_name(const uint8_t *field, uint32_t i, char *err)
{
    const uint8_t *nul = memchr(field, 0, TENSOR_NAME_BYTES);
    if (nul == NULL) LOAD_FAIL("tensor %u has an unterminated name", i);
    for (const uint8_t *p = field; *p; p++)
        if (*p <= ' ' || *p >= 0x7f) LOAD_FAIL("tensor %u's name has a byte 0x%02x that is not printable ASCII", i, *p);
    if (nul == field) LOAD_FAIL("tensor %u has an empty name", i);
    size_t after = (size_t)(nul - field), z = after + nonzero_at(nul, TENSOR_NAME_BYTES - after);
    if (z < TENSOR_NAME_BYTES)
        LOAD_FAIL("tensor %s: byte %zu of its name field is 0x%02x, after the name's NUL, not zero", (const char *)field,
                  z, field[z]);
    return 0;
}

/* The last group of packed matrix t: its rows past t->rows must be those of
   zero blocks (ggml's bytes all zero, so q8_0's integers, stored as q + 128,
   read 128), and the bytes after its records zero. Only the last group: it
   is one place per matrix, where the padding rows are. Every group ends in
   such padding when its records do not fill whole cache lines (an odd count
   of q4_0, q5_0, q8_0 or q6_k blocks, or of f16/bf16 elements, in a row), but the
   other groups' padding is not read here: that would touch every page of
   the matrix at load, and loading is mapping. No kernel reads it. */
static int check_packed_padding(const Tensor *t, char *err)
{
    const PackForm *f = packed_form(t->type);
    size_t group = packed_group_bytes(f, t->cols), rec = packed_record_bytes(f);
    size_t used = (size_t)(t->cols / packed_block(f)) * rec, z;
    int first = (t->rows - 1) / PACK_ROWS * PACK_ROWS, live = t->rows - first; /* the last group's rows, and the matrix's of them */
    const uint8_t *last = (const uint8_t *)t->data + tensor_bytes(t) - group;
    if ((z = used + nonzero_at(last + used, group - used)) < group)
        LOAD_FAIL("tensor %s: padding byte %zu of its last group is 0x%02x, not zero", t->name, z, last[z]);
    for (size_t o = 0; o < used && live < PACK_ROWS; o++) {
        int r = packed_byte_row(f, o % rec);
        if (r >= live && last[o] != packed_zero_byte(f, o % rec))
            LOAD_FAIL("tensor %s: padding row %d (after its %d rows) has byte 0x%02x at byte %zu of its last group, "
                      "not a zero block's", t->name, first + r, t->rows, last[o], o);
    }
    return 0;
}

/* The forward pass multiplies by the matrices, which must be packed, and
   reads every other tensor (norms, biases, an untied embedding) by rows. */
static int check_layout(const Tensor *t, int matmul, char *err)
{
    if (matmul && t->layout != LAYOUT_PACKED)
        LOAD_FAIL("tensor %s is stored as rows, but the matrices of this file version are packed: re-export the model "
                  "with this version's export.py", t->name);
    if (!matmul && t->layout != LAYOUT_ROWS) LOAD_FAIL("tensor %s is packed, but only the matrices are", t->name);
    return matmul ? check_packed_padding(t, err) : 0;
}

/* Checks the tensor table, reading it into slots for check_weights (*out:
   n_slots entries, by tensor_slot; a NULL name marks a slot without a
   tensor, and the caller frees it). The table must list exactly
   the tensors the header's shape implies, and their data must tile the
   rest of the file in table order: each tensor at the first TENSOR_ALIGN
   boundary after the previous one (the first after the table), padding
   zero, the file ending with the last tensor. So no tensor overlaps
   another or the sections before it, and no byte goes unchecked. */
static int check_tensor_table(const Model *m, Tensor **out, char *err)
{
    const uint8_t *h = m->map;
    const Config *c = &m->c;
    uint32_t n = rd_u32(h + HDR_N_TENSORS);
    uint64_t off = rd_u64(h + HDR_TABLE_OFFSET), tok_end = HEADER_BYTES + rd_u64(h + HDR_TOK_SIZE);
    if (n > MAX_TENSORS || off > m->map_size || (m->map_size - off) / TENSOR_ENTRY_BYTES < n)
        LOAD_FAIL("tensor table (%u entries at offset %llu) lies outside the file", n, (unsigned long long)off);
    if (off != align_up(tok_end, TENSOR_ALIGN))
        LOAD_FAIL("tensor table at offset %llu, not at the first %d-byte boundary after the tokenizer section (%llu)",
                  (unsigned long long)off, TENSOR_ALIGN, (unsigned long long)align_up(tok_end, TENSOR_ALIGN));
    if (check_padding(m, tok_end, off, "the tensor table", err) || check_flag_tensors(m, n, off, err)) return -1;
    int want = 0;
    for (int s = 0; s < n_slots(c); s++) want += slot_present(c, s);
    if (n == 0 && !m->tokenizer_only)
        LOAD_FAIL("the file holds a tokenizer but no tensors (export.py --tokenizer-only): only --tokenize runs on it");
    if ((int)n != want && !m->tokenizer_only) {
        char missing[TENSOR_NAME_BYTES + 8] = "";
        if ((int)n < want) first_missing(m, n, off, missing);
        LOAD_FAIL("tensor table has %u entries, but a %d-layer model with %s embeddings%s has %d tensors%s", n,
                  c->n_layers, c->tied ? "tied" : "untied", c->flags & ~FLAG_TIED_EMBEDDINGS ? " and the header's flags" : "",
                  want, missing);
    }
    Tensor *t = *out = xcalloc(n_slots(c), sizeof *t);
    const char *stray = NULL, *prev = "the tensor table";
    uint64_t table_end = off + (uint64_t)n * TENSOR_ENTRY_BYTES, end = table_end; /* end of the previous item */
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *e = m->map + off + (size_t)i * TENSOR_ENTRY_BYTES;
        if (check_name(e + ENT_NAME, i, err)) return -1;
        const char *name = (const char *)e + ENT_NAME;
        int type = rd_u32(e + ENT_TYPE);
        uint32_t rows = rd_u32(e + ENT_ROWS), cols = rd_u32(e + ENT_COLS), layout = rd_u32(e + ENT_LAYOUT);
        uint64_t data = rd_u64(e + ENT_OFFSET), size = rd_u64(e + ENT_SIZE);
        if (layout >= N_LAYOUTS) LOAD_FAIL("tensor %s: unknown layout %u (0 rows, 1 packed)", name, layout);
        if (!type_name(type)) LOAD_FAIL("tensor %s has unsupported type %u", name, rd_u32(e + ENT_TYPE));
        size_t rb = row_bytes(type, cols);
        if (rows == 0 || cols == 0 || rows > MAX_VOCAB || cols > MAX_DIM || rb == 0)
            LOAD_FAIL("tensor %s has a bad shape %ux%u for type %s", name, rows, cols, type_name(type));
        uint64_t want = layout == LAYOUT_PACKED ? packed_bytes(type, rows, cols) : (uint64_t)rb * rows;
        if (size != want)
            LOAD_FAIL("tensor %s: size %llu bytes does not match its %ux%u %s shape (%llu bytes%s)", name,
                      (unsigned long long)size, rows, cols, type_name(type), (unsigned long long)want,
                      layout == LAYOUT_PACKED ? " packed" : "");
        if (data % TENSOR_ALIGN || data > m->map_size || m->map_size - data < size)
            LOAD_FAIL("tensor %s (%llu bytes at offset %llu) lies outside the file or is misaligned",
                      name, (unsigned long long)size, (unsigned long long)data);
        if (data < table_end)
            LOAD_FAIL("tensor %s's data (offset %llu) lies in %s", name, (unsigned long long)data, section_at(data, tok_end));
        if (data < end)
            LOAD_FAIL("tensor %s's data (offset %llu) overlaps the tensors before it, up to %s's end at %llu",
                      name, (unsigned long long)data, prev, (unsigned long long)end);
        if (data != align_up(end, TENSOR_ALIGN))
            LOAD_FAIL("tensor %s is at offset %llu, not at the first %d-byte boundary after %s (%llu)", name,
                      (unsigned long long)data, TENSOR_ALIGN, prev, (unsigned long long)align_up(end, TENSOR_ALIGN));
        if (check_padding(m, end, data, name, err)) return -1;
        int slot = tensor_slot(c, name);
        if (slot >= 0 && t[slot].name) LOAD_FAIL("tensor %s appears twice in the table", name);
        if (slot < 0 && !stray) stray = name;
        if (slot >= 0) t[slot] = (Tensor){name, type, (int)rows, (int)cols, (int)layout, m->map + data};
        prev = name;
        end = data + size;
    }
    if (end != m->map_size)
        LOAD_FAIL("%llu bytes follow %s, which should end the file", (unsigned long long)(m->map_size - end), prev);
    for (int s = 0; s < n_slots(c) && !m->tokenizer_only; s++) {
        if (t[s].name || !slot_present(c, s)) continue;
        char name[TENSOR_NAME_BYTES];
        slot_name(name, s);
        if (stray) LOAD_FAIL("model file has no tensor %s (but a tensor %s that a %d-layer model %s embeddings has not)",
                             name, stray, c->n_layers, c->tied ? "with tied" : "with untied");
        LOAD_FAIL("model file has no tensor %s", name);
    }
    return 0;
}

/* Tensor t (from check_tensor_table) must have the shape the header implies. */
static int check_shape(const Tensor *t, int rows, int cols, char *err)
{
    if (t->rows != rows || t->cols != cols)
        LOAD_FAIL("tensor %s is %dx%d, expected %dx%d", t->name, t->rows, t->cols, rows, cols);
    return 0;
}

/* The n parts of one projection (slots `part` of a layer's tensors lt, in
   order) must read one activation format: one converted input serves them
   all (join_parts). */
static int check_parts(const Tensor *lt, const int *part, int n, char *err)
{
    const Tensor *first = &lt[part[0]];
    for (int i = 0; i < n; i++) {
        const Tensor *p = &lt[part[i]];
        if (act_format(p->type) != act_format(first->type))
            LOAD_FAIL("tensors %s (%s) and %s (%s) are parts of one projection but read different activation formats",
                      first->name, type_name(first->type), p->name, type_name(p->type));
    }
    return 0;
}

/* The tensors of the table (by slot) against what the header implies, in
   the order bind_weights takes them: shapes, layouts, f32 vectors. */
static int check_weights(const Model *m, const Tensor *tab, char *err)
{
    const Config *c = &m->c;
    int q_dim = c->n_heads * c->head_dim, kv_dim = c->n_kv_heads * c->head_dim, hid = c->hidden_dim;
    const Tensor *emb = &tab[SLOT_TOK_EMBEDDINGS], *norm = &tab[SLOT_NORM], *out = c->tied ? emb : &tab[SLOT_OUTPUT];
    if (check_shape(emb, c->vocab_size, c->dim, err) || check_shape(norm, 1, c->dim, err) ||
        (!c->tied && check_shape(out, c->vocab_size, c->dim, err)))
        return -1;
    if (check_layout(emb, c->tied, err) || check_layout(norm, 0, err) || check_layout(out, 1, err)) return -1;
    if (norm->type != T_F32) LOAD_FAIL("norm weights must be f32");
    if (c->rope_freqs) {
        const Tensor *rf = &tab[SLOT_ROPE_FREQS];
        if (check_shape(rf, 1, c->rope_dim / 2, err) || check_layout(rf, 0, err)) return -1;
        if (rf->type != T_F32) LOAD_FAIL("rope_freqs must be f32");
        for (int i = 0; i < c->rope_dim / 2; i++) {
            float f = ((const float *)rf->data)[i];
            if (!isfinite(f) || f <= 0) LOAD_FAIL("rope_freqs[%d] = %g is not a finite number > 0", i, f);
        }
    }
    /* each layer tensor's shape [rows, cols]; vectors (norms, biases) are f32 */
    const int shape[LAYER_TENSORS][2] = {
        [LT_ATTN_NORM] = {1, c->dim}, [LT_WQKV] = {q_dim + 2 * kv_dim, c->dim}, [LT_WQ] = {q_dim, c->dim},
        [LT_WK] = {kv_dim, c->dim}, [LT_WV] = {kv_dim, c->dim}, [LT_BQKV] = {1, q_dim + 2 * kv_dim},
        [LT_Q_NORM] = {1, c->head_dim}, [LT_K_NORM] = {1, c->head_dim}, [LT_WO] = {c->dim, q_dim},
        [LT_POST_ATTN_NORM] = {1, c->dim}, [LT_FFN_NORM] = {1, c->dim}, [LT_W13] = {2 * hid, c->dim},
        [LT_W1] = {hid, c->dim}, [LT_W3] = {hid, c->dim}, [LT_W2] = {c->dim, hid}, [LT_POST_FFN_NORM] = {1, c->dim},
    };
    static const int qkv[] = {LT_WQ, LT_WK, LT_WV}, gate_up[] = {LT_W1, LT_W3}; /* a split file's parts */
    for (int l = 0; l < c->n_layers; l++) {
        const Tensor *lt = tab + SLOT_LAYERS + LAYER_TENSORS * l; /* in layer_tensor order */
        for (int i = 0; i < LAYER_TENSORS; i++) {
            if (!slot_present(c, SLOT_LAYERS + i)) continue;
            int vector = i == LT_ATTN_NORM || i == LT_BQKV || i == LT_Q_NORM || i == LT_K_NORM || i == LT_POST_ATTN_NORM ||
                         i == LT_FFN_NORM || i == LT_POST_FFN_NORM;
            if (check_shape(&lt[i], shape[i][0], shape[i][1], err) || check_layout(&lt[i], !vector, err)) return -1;
            if (vector && lt[i].type != T_F32) LOAD_FAIL("tensor %s must be f32 (it is %s)", lt[i].name, type_name(lt[i].type));
        }
        if (c->split && (check_parts(lt, qkv, 3, err) || check_parts(lt, gate_up, 2, err))) return -1;
    }
    return 0;
}

/* Section 1's one call: the whole file, in the order it holds its parts.
   Returns 0, or -1 with the reason in err; *tok may then hold a tokenizer
   for the caller to free (free_model). */
static int check_model_file(const Model *m, tok_tokenizer **tok, char *err)
{
    Tensor *tab = NULL;
    int rc = check_header(m, err) || check_family(m, err) || read_tokenizer(m, tok, err) ||
             check_tensor_table(m, &tab, err) || (!m->tokenizer_only && check_weights(m, tab, err)) ? -1 : 0;
    free(tab);
    return rc;
}

/* A layer's matrix products, in the order a token meets them. */
#define LAYER_MATRICES 4
static void layer_matrices(Layer *L, Matrix *out[LAYER_MATRICES])
{
    out[0] = &L->wqkv, out[1] = &L->wo, out[2] = &L->w13, out[3] = &L->w2;
}

/* Adds matrix w to the per-token counts: the weights each token is
   multiplied by, and the bytes decode streams for them. */
static void count_matmul(Model *m, const Matrix *w)
{
    for (int i = 0; i < w->n_parts; i++) {
        const Tensor *p = &w->part[i];
        m->matmul_params += (double)p->rows * p->cols;
        m->weight_bytes += (double)tensor_bytes(p);
    }
}

/* The counts of a bound model (tab: its tensors by slot): parameters and
   the type holding the most weight bytes, for -v; the weights and bytes
   each token is multiplied by, for the roofline. */
static void count_weights(Model *m, const Tensor *tab)
{
    const Config *c = &m->c;
    size_t bytes_by_type[T_BF16 + 1] = {0};
    for (int i = 0; i < n_slots(c); i++) {
        if (!tab[i].name) continue;
        m->n_params += (double)tab[i].rows * tab[i].cols;
        bytes_by_type[tab[i].type] += tensor_bytes(&tab[i]);
    }
    int best = T_F32;
    for (int t = 0; t <= T_BF16; t++) if (bytes_by_type[t] > bytes_by_type[best]) best = t;
    m->dtype = type_name(best);
    for (int l = 0; l < c->n_layers; l++) {
        Matrix *mats[LAYER_MATRICES];
        layer_matrices(&m->layers[l], mats);
        for (int i = 0; i < LAYER_MATRICES; i++) count_matmul(m, mats[i]);
    }
    count_matmul(m, &m->output);
}

/* ----- instruction sets ---------------------------------------------------
   Every x86-64 build (GCC or clang) carries every x86 kernel set, each
   compiled for its own instruction set whatever the compiler targets, and
   picks one at run time from what the CPU reports: TARGET_BEGIN(isa) ..
   TARGET_END gives each function between them the target attribute isa. */
/* The kernels' register tiles. */
#define ATT_QK_Q 4     /* prefill scores' register tile: queries ... */
#define ATT_QK_K 2     /* ... times keys, 8 sums (one tree of horizontal adds) */
#define ATT_PV_Q 4     /* prefill weighted V sum's register tile: queries ... */
#define ATT_PV_V 2     /* ... times vectors of output elements */
_Static_assert(ATT_QK_Q * ATT_QK_K == 8, "att_qk_tile_avx2 reduces 8 sums at once");
#define ATT_QK_NEON 4  /* NEON's 32 registers: 4 x 4 scores ... */
#define ATT_PV_V32 4   /* ... and, there and in AVX-512's, 4 queries x 4 vectors of outputs */
#define ATT_QK_Q32 4   /* AVX-512's score tile: 4 x 4 512-bit sums */
#define ATT_QK_K32 4
_Static_assert(ATT_QK_Q32 == 4 && ATT_QK_K32 == 4, "att_qk_tile_avx512 reduces 2 x 8 sums: 2 queries x 4 keys each");
_Static_assert(ATT_KTILE % ATT_QK_K == 0 && ATT_KTILE % ATT_QK_K32 == 0, "a full block of keys is whole score tiles");
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#define PRAGMA_STR(...) #__VA_ARGS__
/* SCALAR_SET_ONLY leaves every SIMD set out: for test drivers of code that
   runs no kernel (the JSON reader's, lookup's), which then compile in a
   fraction of the time. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(SCALAR_SET_ONLY)
#define HAVE_X86_SETS 1
#ifdef __clang__
#define TARGET_BEGIN(isa) _Pragma(PRAGMA_STR(clang attribute push(__attribute__((target(isa))), apply_to = function)))
#define TARGET_END _Pragma("clang attribute pop")
#else
#define TARGET_BEGIN(isa) _Pragma("GCC push_options") _Pragma(PRAGMA_STR(GCC target(isa)))
#define TARGET_END _Pragma("GCC pop_options")
#endif
#define ISA_AVX2 "avx2,fma,f16c"
#define ISA_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c"
/* The AVX-VNNI set's 256-bit vpdpbusd. The tests also build that set with
   AVXVNNI_TWIN: the same instruction in its AVX512-VL encoding, so that a
   CPU with AVX-512 VNNI but not AVX-VNNI (AMD Zen 4) runs its kernels. */
#ifndef AVXVNNI_TWIN
#define ISA_AVXVNNI "avx2,fma,f16c,avxvnni"
#define DPBUSD_256 _mm256_dpbusd_avx_epi32
#else
#define ISA_AVXVNNI "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
#define DPBUSD_256 _mm256_dpbusd_epi32
#endif
/* Every x86-64 build carries the AVX-VNNI and AVX-512 sets, chosen at run
   time. NATIVE_SETS_ONLY, for test builds made with -march=native (the
   sanitizer, fuzz and kernel-test builds), leaves out the sets that
   -march=native says this CPU lacks: there they could only be compiled,
   which the normal builds do, and their kernels are a large part of such a
   build's time. */
#if !defined(NATIVE_SETS_ONLY) || (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
                                   defined(__AVX512DQ__) && defined(__AVX512VNNI__))
#define HAVE_AVX512_SET 1
#endif
#if !defined(NATIVE_SETS_ONLY) || defined(__AVXVNNI__) || (defined(AVXVNNI_TWIN) && defined(HAVE_AVX512_SET))
#define HAVE_AVXVNNI_SET 1
#endif
#endif
/* Every aarch64 build carries the NEON set (NEON is part of ARMv8-A) and
   the set with the dot-product extension (sdot, ARMv8.2-A and later; the
   kernel reports it in the hwcaps), compiled for it as the x86 sets are. */
#if defined(__aarch64__) && defined(__ARM_NEON) && defined(__GNUC__) && !defined(SCALAR_SET_ONLY)
#define HAVE_NEON_SET 1
#include <arm_neon.h>
#include <sys/auxv.h>
#ifdef __clang__
#define TARGET_BEGIN(isa) _Pragma(PRAGMA_STR(clang attribute push(__attribute__((target(isa))), apply_to = function)))
#define TARGET_END _Pragma("clang attribute pop")
#define ISA_DOTPROD "dotprod"
#else
#define TARGET_BEGIN(isa) _Pragma("GCC push_options") _Pragma(PRAGMA_STR(GCC target(isa)))
#define TARGET_END _Pragma("GCC pop_options")
#define ISA_DOTPROD "arch=armv8.2-a+dotprod"
#endif
#endif
/* ----- threads --------------------------------------------------------------
   One team of threads runs a whole forward pass (one OpenMP parallel region
   per chunk or token, forward_on_pool): every thread runs forward(), and
   each PARALLEL_FOR step splits its work by thread index and ends at a
   barrier. Waiting threads spin: a sleep and wake-up costs tens of
   microseconds, while a decoded token of a small model takes a few
   milliseconds spread over ~250 steps. Without OpenMP the team is one
   thread and the barrier does nothing. */

#define SPINS_BEFORE_YIELD 2000 /* ~10-80 us of spinning at a barrier (a pause is 5-40 ns), then yield the core */
#define CONTENDED_SHARE 8       /* a pass whose threads spent over 1/8 of their time in such waits ran on contended cores */
#define CONTENDED_PASSES 2      /* ... in this many passes in a row (one alone is a hiccup: the host took a vCPU) */
#define TEAM_RETRY 64           /* passes with a smaller team before the full team is tried again ... */
#define TEAM_RETRY_MAX 4096     /* ... doubling after each retry that is still contended, up to this */

typedef struct {
    atomic_int arrived;
    atomic_int phase;
    atomic_long long_wait_us; /* time spent in waits that outlasted SPINS_BEFORE_YIELD, since adapt_team looked */
} Barrier;

/* Where the team's threads meet: the program has one pool of threads
   (OpenMP's), and one team of it runs at a time. */
static Barrier pool_barrier;

/* Where a pass's time goes (batch mode's -v breakdown line): each thread
   adds up its time in the matmuls (the output head apart), in attention
   and waiting at barriers; the rest of a pass is its other steps (norms,
   RoPE, conversions, the GLU, starting the team). Counted only while `on`
   (batch mode's decode steps with -v): the clock is read a few hundred
   times a pass, ~50 ns each. */
enum { PT_MATMUL, PT_HEAD, PT_ATTN, PT_WAIT, PT_N };
typedef struct {
    double ms[PT_N];
    char pad[CACHE_LINE - PT_N * sizeof(double)]; /* each thread its own cache line */
} ThreadTimes;
static struct {
    int on;
    ThreadTimes *th;      /* [n_threads] */
    const void *head;     /* the output head's matrix */
    double pass_ms, thread_ms; /* the passes' wall time, and times their team's size */
} pass_prof;

static int thread_id(void);

static double prof_start(void) { return pass_prof.on ? now_ms() : 0; }

static void prof_add(int kind, double t0)
{
    if (pass_prof.on) pass_prof.th[thread_id()].ms[kind] += now_ms() - t0;
}

/* Part II's share of a run (RunState.mx): the team's size and how it
   adapts, attention's chunk scratch, and batch mode's pages. */
struct Machinery {
    int n_threads;  /* the full team */
    int team;       /* threads of the next forward pass: n_threads, fewer while the cores are contended */
    int retry_in, backoff; /* passes until the full team is tried again; the wait after the next failed try */
    int warm;       /* a forward pass has run: the mapped weights' pages are in the page tables */
    int contended;  /* passes in a row that waited long */
    int scattered;  /* the pass's tokens are not consecutive positions of one sequence (decode_batch) */
    int paged;      /* the cache is a pool of pages (batch mode), else one sequence's (kv_off, kv_cap) */
    const PageTable **tok_pages; /* [chunk] each token's sequence's KV pages, when paged */
    float *scratch; /* [n_threads, seq_len + head_dim] attend's scores and a K or V row as floats */
    float *partial; /* partial softmaxes (attend_in_chunks): one token at a time, [tokens, n_kv_heads,
                       seq_len/ATT_CHUNK + 1, group, PARTIAL_HEAD + head_dim] per chunk, then
                       [n_threads, group, ...] running ones; a tile of tokens, [n_threads, 2, ATT_QTILE * group, ...]:
                       a running one and the chunk's per query */
    float *kblock;  /* [n_threads, ATT_KTILE, head_dim] a block of K as floats (caches of other types than f32, f16) */
    float *vblock;  /* [n_threads, ATT_KTILE, head_dim] the same block of V */
    float *qblock;  /* [n_threads, ATT_QTILE * group, head_dim] the queries of attend_chunk, gathered */
    float *pblock;  /* [n_threads, ATT_QTILE * group, ATT_KTILE] their scores, then weights */
    size_t scratch_row; /* seq_len + head_dim */
};

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
}

static int thread_id(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static int thread_count(void)
{
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

static void barrier(void)
{
    Barrier *b = &pool_barrier;
    int nth = thread_count();
    if (nth == 1) return;
    double t0 = prof_start();
    int phase = atomic_load_explicit(&b->phase, memory_order_relaxed);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == nth - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->phase, phase + 1, memory_order_release);
    } else {
        /* spin; if the wait is long the cores are oversubscribed (another
           program is running), and yielding lets the late thread run */
        long spins = 0;
        double long_since = 0;
        while (atomic_load_explicit(&b->phase, memory_order_acquire) == phase)
            if (spins++ < SPINS_BEFORE_YIELD) cpu_relax();
            else {
                if (!long_since) long_since = now_ms();
                sched_yield();
            }
        if (long_since) atomic_fetch_add_explicit(&b->long_wait_us, (long)((now_ms() - long_since) * 1e3) + 1, memory_order_relaxed);
    }
    prof_add(PT_WAIT, t0);
}

/* Thread me's share [*lo, *hi) of n items, cut in whole units so that
   every thread gets the same number of units, give or take one. */
static void split(int n, int unit, int me, int nth, int *lo, int *hi)
{
    long units = (n + unit - 1) / unit;
    *lo = min_i(n, (int)(units * me / nth) * unit);
    *hi = min_i(n, (int)(units * (me + 1) / nth) * unit);
}

/* PARALLEL_FOR's two ends: this thread's share of [0, n), then the wait
   for the team. */
static Share share_begin(int n, int unit)
{
    Share sh = {0, 0, 1};
    split(n, unit, thread_id(), thread_count(), &sh.lo, &sh.hi);
    return sh;
}

static int share_end(void)
{
    barrier();
    return 0;
}

/* Hidden units per job of glu_each: whole blocks of `block`, GLU_JOB_UNITS
   or more, unless that would leave a thread under GLU_JOBS_PER_THREAD jobs
   (too few to share evenly). A block's conversion is a chain of dependent
   steps (its maximum, the scale, the rounding, the sums); several in one
   call overlap: on SmolLM2 (q8 blocks of 32) the conversions took 7.4 % of
   a batch step with jobs of one block, 4.7 % with jobs of 4, which made 16
   in flight 3-6.5 % faster, prefill 1-3 % (AMD Zen 5, 2 threads). */
#define GLU_JOB_UNITS 128
#define GLU_JOBS_PER_THREAD 4
static int glu_job(int hid, int block)
{
    int blocks = (hid + block - 1) / block, want = (GLU_JOB_UNITS + block - 1) / block;
    return block * max_i(1, min_i(want, blocks / (GLU_JOBS_PER_THREAD * thread_count())));
}

/* Sizes the team of the next forward pass. When other programs take the
   cores, a thread of the team is descheduled for whole timeslices and every
   barrier waits for it: two 2-thread runs on 2 cores each decoded 4x slower
   than with one thread. A pass (pass_ms long) whose threads spent more than
   1/CONTENDED_SHARE of their time in long waits, CONTENDED_PASSES times in
   a row, halves the team; the full team is tried again
   after mx->backoff passes, which doubles while the retries find the cores
   still contended. On cores of its own a pass waits long rarely, and
   briefly (a prefill step's uneven split). The first pass is not judged:
   it takes the page faults of every page the process has not touched yet
   (the weights' too, where fill_page_tables could not fill their tables),
   unevenly between the threads, so on a quiet machine it looked contended
   (30 of 75 ms in waits on the 1.5B) and its first 64 decode steps ran on
   one core. Results do not depend on the team size (see split), so it may
   change between passes. */
static void adapt_team(Machinery *mx, double pass_ms)
{
    double waited_ms = atomic_exchange_explicit(&pool_barrier.long_wait_us, 0, memory_order_relaxed) / 1e3;
    if (!mx->warm) {
        mx->warm = 1;
        return;
    }
    mx->contended = waited_ms * CONTENDED_SHARE > pass_ms * mx->team ? mx->contended + 1 : 0;
    if (mx->team > 1 && mx->contended >= CONTENDED_PASSES) {
        mx->contended = 0;
        mx->team /= 2;
        mx->retry_in = mx->backoff;
        mx->backoff = min_i(2 * mx->backoff, TEAM_RETRY_MAX);
    } else if (mx->team > 1 && mx->team == mx->n_threads && !mx->contended) {
        mx->backoff = TEAM_RETRY; /* the full team ran uncontended */
    } else if (mx->team < mx->n_threads && --mx->retry_in <= 0) {
        mx->team = mx->n_threads;
    }
}

/* Runs forward() on every thread of the team, and sizes the next team. */
static void forward_on_pool(const Model *m, RunState *s, const int *tokens, int n, int first_logit)
{
    double t0 = now_ms();
    #pragma omp parallel num_threads(s->mx->team)
    forward(m, s, tokens, n, first_logit);
    double ms = now_ms() - t0;
    if (pass_prof.on) pass_prof.pass_ms += ms, pass_prof.thread_ms += ms * s->mx->team;
    adapt_team(s->mx, ms);
}

/* Verification of drafted tokens: n <= VERIFY_MAX_TOKENS tokens at
   positions pos0.. in one pass, with the logits of every one in
   s->logits. Every token goes through the same operations in any pass
   (the packed kernels, attention's chunks), so its logits are bit for bit
   those of a decode step; the weights are still read once for all of them,
   which is what makes checking k drafts cost about one decode step. */
static void verify_step(const Model *m, RunState *s, const int *tokens, int n, int pos0)
{
    forward_at(m, s, tokens, n, pos0, 0);
}


static Machinery *build_machinery(const Config *c, int seq_len, int n_threads)
{
    Machinery *mx = xcalloc(1, sizeof *mx);
    int group = c->n_heads / c->n_kv_heads;
    mx->n_threads = mx->team = n_threads;
    mx->backoff = TEAM_RETRY;
    mx->scratch_row = (size_t)seq_len + c->head_dim;
    mx->scratch = xcalloc((size_t)n_threads * mx->scratch_row, sizeof(float));
    size_t one_at_a_time = (size_t)BATCH_MAX * c->n_kv_heads * (seq_len / ATT_CHUNK + 1) + n_threads;
    mx->partial = xcalloc(max_i(one_at_a_time, 2 * n_threads * ATT_QTILE) * group * (PARTIAL_HEAD + c->head_dim), sizeof(float));
    mx->kblock = xcalloc((size_t)n_threads * c->head_dim * ATT_KTILE, sizeof(float));
    mx->vblock = xcalloc((size_t)n_threads * c->head_dim * ATT_KTILE, sizeof(float));
    mx->qblock = xcalloc((size_t)n_threads * ATT_QTILE * group * c->head_dim, sizeof(float));
    mx->pblock = xcalloc((size_t)n_threads * ATT_QTILE * group * ATT_KTILE, sizeof(float));
    mx->tok_pages = xcalloc(CHUNK_TOKENS, sizeof *mx->tok_pages);
    return mx;
}

static void free_machinery(Machinery *mx)
{
    if (!mx) return;
    free(mx->scratch); free(mx->partial); free(mx->kblock); free(mx->vblock); free(mx->qblock); free(mx->pblock);
    free(mx->tok_pages);
    free(mx);
}

/* This thread's scratch for attend: seq_len scores, then a head_dim row. */
static float *thread_scratch(const RunState *s)
{
    return s->mx->scratch + (size_t)thread_id() * s->mx->scratch_row;
}

/* ----- matrix products on the team -------------------------------------------- */

/* Where a matmul writes: token t's output row at p + t * stride, added to
   what is there with accumulate (a residual connection), else stored. */
typedef struct {
    float *p;
    int stride;
    int accumulate;
} Out;

/* The activation format W reads: its first part's, which all its parts share (join_parts). */
static int matrix_act(const Matrix *w) { return act_format(w->part[0].type); }

/* From "the kernel tables" below: the type's product for any number of tokens, or NULL. */
static PackedFn wide_kernel(int type);

/* Rows [r0, r1) of out[t][r] = W[r] . x[t] (or += with accumulate) for the
   n_tok input rows in = x, W one packed tensor: a group of PACK_ROWS rows
   at a time, PACK_TOKS tokens a call (a type with a wide product: a
   pass of more tokens in one call, which unpacks each group once for
   them all), so that prefill reads each weight byte from memory once per
   batch and decode once per token. Every token
   takes the same operations whatever the batch, so prefill, decode and
   verification agree bit for bit. */
static void tensor_rows(Out out, const Tensor *w, Act in, int n_tok, int r0, int r1)
{
    PackedFn fn = packed_kernel(w->type), wide = wide_kernel(w->type);
    size_t gb = packed_group_bytes(packed_form(w->type), w->cols);
    int step = wide && n_tok > PACK_TOKS ? CHUNK_TOKENS : PACK_TOKS;
    if (step > PACK_TOKS) fn = wide;
    float v[CHUNK_TOKENS * PACK_ROWS];
    for (int g = r0 / PACK_ROWS; g * PACK_ROWS < r1; g++) {
        int a = max_i(r0, g * PACK_ROWS), b = min_i(r1, (g + 1) * PACK_ROWS);
        for (int t = 0; t < n_tok; t += step) {
            int toks = min_i(step, n_tok - t);
            /* the outputs' lines (one per token, a row of the output apart) asked for while the kernel runs:
               the copy's stores below were the hot spot of its 3 % of the 1.5B's prefill, each waiting for its
               line; asked for, prefill 512 went 1.9 % faster there, 1.4 % on SmolLM2 (AMD Zen 5) */
            if (step > PACK_TOKS)
                for (int j = 0; j < toks; j++) __builtin_prefetch(out.p + (size_t)(t + j) * out.stride + a, 1, 3);
            fn((const uint8_t *)w->data + g * gb, w->cols, in.rows + t * in.stride, in.stride, toks, v);
            for (int j = 0; j < toks; j++) {
                float *o = out.p + (size_t)(t + j) * out.stride + a;
                const float *vj = v + j * PACK_ROWS + a - g * PACK_ROWS;
                if (out.accumulate) for (int r = 0; r < b - a; r++) o[r] += vj[r];
                else if (b - a == PACK_ROWS) memcpy(o, vj, PACK_ROWS * sizeof(float)); /* a constant size: no call */
                else memcpy(o, vj, (b - a) * sizeof(float));
            }
        }
    }
}

/* The same for matrix W: each part computes the rows of [r0, r1) that fall
   in it, with its own type's kernels, into the output columns of those
   rows (a part's row i is the matrix's row base + i). */
static void matrix_rows(Out out, const Matrix *w, Act in, int n_tok, int r0, int r1)
{
    double t0 = prof_start();
    for (int i = 0, base = 0; i < w->n_parts; base += w->part[i++].rows) {
        int a = max_i(r0, base), b = min_i(r1, base + w->part[i].rows);
        if (a < b) tensor_rows((Out){out.p + base, out.stride, out.accumulate}, &w->part[i], in, n_tok, a - base, b - base);
    }
    prof_add(w == pass_prof.head ? PT_HEAD : PT_MATMUL, t0);
}

/* out = W . in for n tokens ([n, W.rows]), the rows shared by the team. */
static void matmul(float *out, const Matrix *w, Act in, int n)
{
    Share sh = share_begin(w->rows, PACK_ROWS);
    matrix_rows((Out){out, w->rows, 0}, w, in, n, sh.lo, sh.hi);
    share_end();
}

/* out += W . in: a residual connection. */
static void matmul_add(float *out, const Matrix *w, Act in, int n)
{
    Share sh = share_begin(w->rows, PACK_ROWS);
    matrix_rows((Out){out, w->rows, 1}, w, in, n, sh.lo, sh.hi);
    share_end();
}

/* Rows [r0, r1) of W . in, by this thread alone, into out (token t's row at out + t * stride). */
static void matmul_rows(float *out, int stride, const Matrix *w, Act in, int n, int r0, int r1)
{
    matrix_rows((Out){out, stride, 0}, w, in, n, r0, r1);
}

/* Elements [i0, i1) of token t's input row to W (row: its floats), in the
   form W reads, into q's row t: nothing for float weights, int8 blocks for
   integer weights. Done once per matmul, then read by every weight row. */
static void to_input(const Matrix *w, uint8_t *q, const float *row, int t, int i0, int i1)
{
    int fmt = matrix_act(w);
    if (fmt != ACT_F32) quantize_act(fmt, q + t * act_bytes(fmt, w->cols) + act_bytes(fmt, i0), row + i0, i1 - i0);
}

/* W's input from float rows f ([n, f_cols]) or, when W reads another
   activation format, from the same rows converted into q (to_input). */
static Act input_of(const Matrix *w, const float *f, int f_cols, const uint8_t *q)
{
    int fmt = matrix_act(w);
    if (fmt != ACT_F32) return (Act){q, act_bytes(fmt, w->cols)};
    return (Act){(const uint8_t *)f, f_cols * sizeof(float)};
}

/* ----- a model file that changes while mapped -------------------------------- */

/* The mapping watched by on_sigbus, and the line it prints. */
static struct {
    const uint8_t *lo, *hi;
    char msg[LINE_BYTES];
    size_t len;
} watched;

/* A read of the mapping past the end of a file that shrank (or that was
   replaced in place) raises SIGBUS: say so in one line instead of dying of
   the signal. Only async-signal-safe calls here (unlink, write, pause,
   _exit); when several threads fault at once, one reports. A SIGBUS
   elsewhere is a bug: it stays fatal. */
static void on_sigbus(int sig, siginfo_t *si, void *uc)
{
    (void)uc;
    const uint8_t *at = si->si_addr;
    if (at >= watched.lo && at < watched.hi) {
        static atomic_flag reported = ATOMIC_FLAG_INIT;
        if (atomic_flag_test_and_set(&reported)) /* another thread of the team: it prints and ends the run */
            for (;;) pause();
        if (temp_path[0]) unlink(temp_path);
        ssize_t w = write(STDERR_FILENO, watched.msg, watched.len);
        (void)w;
        _exit(EXIT_RUNTIME);
    }
    signal(sig, SIG_DFL); /* the faulting access repeats and ends the run with the signal */
}

/* Installs on_sigbus for the model m mapped from path. */
static void watch_model_file(const Model *m, const char *path)
{
    format_line(watched.msg, "%s: the model file changed or shrank while in use", path);
    watched.len = strlen(watched.msg);
    watched.lo = m->map;
    watched.hi = m->map + m->map_size;
    struct sigaction sa = {0};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigaction(SIGBUS, &sa, NULL);
}

/* ----- the mapped weights' page tables ---------------------------------------
   Mapping the file sets up no page tables: each 4 KiB page a pass first
   reads takes a minor fault, which maps it and its neighbours (the
   kernel's fault-around, 64 KiB). The first pass over the 1.5B's 1.1 GB
   took about 17,000 of them, 75-80 ms of a 6-token prompt's 105 ms
   prefill, unevenly between the threads, so they also waited for each
   other at barriers. Filled at load instead, by the team's threads in
   parallel (MADV_POPULATE_READ, Linux 5.14), the same tables cost about
   45 ms (AMD EPYC Zen 5, 2 threads): the first byte of text came 135 ->
   100 ms after start (medians of 4), and a 512-token prefill ran at 398
   tok/s instead of 374 (8 pairs). Every weight a pass reads is filled,
   the token embedding only when it is also the output head: otherwise a
   run reads a row of it per token. */

/* Fills in the page tables of the weights every pass reads, in equal
   shares on `threads` threads; returns the milliseconds it took. A hint:
   a kernel without MADV_POPULATE_READ (EINVAL), or a file cut short
   (EFAULT, which the pass then meets as SIGBUS: on_sigbus) leaves the
   faults to the first pass. */
static double fill_page_tables(const Model *m, int threads)
{
    double t0 = now_ms();
    (void)threads; /* read by the pragma alone: unused without OpenMP */
#ifdef MADV_POPULATE_READ
    if (m->copied || m->tokenizer_only) return 0; /* a copy is in memory already; a tokenizer has no weights */
    size_t page = (size_t)sysconf(_SC_PAGESIZE), skip_lo = m->map_size, skip_hi = m->map_size;
    if (!m->c.tied) {
        size_t at = (size_t)((const uint8_t *)m->tok_embeddings.data - m->map);
        skip_lo = at / page * page;
        skip_hi = align_up(at + tensor_bytes(&m->tok_embeddings), page);
        if (skip_hi > m->map_size) skip_hi = m->map_size;
    }
    size_t gap = skip_hi - skip_lo, kept = m->map_size - gap; /* the file but [skip_lo, skip_hi) */
    #pragma omp parallel num_threads(threads)
    {
        /* thread me's share [a, b) of the kept bytes, in whole pages; those past skip_lo lie gap further on */
        size_t me = (size_t)thread_id(), nth = (size_t)thread_count(), pages = kept / page;
        size_t a = pages * me / nth * page, b = me + 1 == nth ? kept : pages * (me + 1) / nth * page;
        if (a < skip_lo) madvise((void *)(m->map + a), (b < skip_lo ? b : skip_lo) - a, MADV_POPULATE_READ);
        if (b > skip_lo) {
            size_t from = (a > skip_lo ? a : skip_lo) + gap;
            madvise((void *)(m->map + from), b + gap - from, MADV_POPULATE_READ);
        }
    }
#else
    (void)m;
#endif
    return now_ms() - t0;
}

/* ----- row conversions: one row of n elements to and from floats ----------
   to_float serves embedding lookups and attention's reads of the KV cache;
   from_float is how the KV cache stores K and V rows. */

/* IEEE half -> float, including subnormals, infinities and NaN. */
static float fp16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);           /* inf, NaN */
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);      /* normal */
    else if (!man) bits = sign;                                         /* zero */
    else {                                                              /* subnormal */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float bf16_to_f32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* float -> IEEE half, rounding to nearest even; overflow gives infinity. */
static uint16_t f32_to_fp16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, e = (x >> 23) & 0xff, man = x & 0x7fffff;
    if (e == 0xff) return sign | 0x7c00 | (man ? 0x200 : 0);         /* inf, NaN */
    int exp = (int)e - 127 + 15;
    if (exp >= 0x1f) return sign | 0x7c00;                            /* overflow */
    if (exp <= 0) {                                                   /* subnormal or zero */
        if (exp < -10) return sign;
        man |= 0x800000;
        int shift = 14 - exp;
        uint32_t h = man >> shift, rem = man & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        return sign | (h + (rem > halfway || (rem == halfway && (h & 1))));
    }
    uint32_t h = ((uint32_t)exp << 10) | (man >> 13), rem = man & 0x1fff;
    return sign | (h + (rem > 0x1000 || (rem == 0x1000 && (h & 1)))); /* a carry rounds up the exponent */
}

static void to_float_f32_scalar(float *out, const void *row, int n) { memcpy(out, row, n * sizeof(float)); }
static void from_float_f32_scalar(void *row, const float *x, int n) { memcpy(row, x, n * sizeof(float)); }

static void to_float_f16_scalar(float *out, const void *row, int n)
{
    for (int i = 0; i < n; i++) out[i] = fp16_to_f32(((const uint16_t *)row)[i]);
}

static void from_float_f16_scalar(void *row, const float *x, int n)
{
    for (int i = 0; i < n; i++) ((uint16_t *)row)[i] = f32_to_fp16(x[i]);
}

static void to_float_bf16_scalar(float *out, const void *row, int n)
{
    for (int i = 0; i < n; i++) out[i] = bf16_to_f32(((const uint16_t *)row)[i]);
}

static void to_float_q8_0_scalar(float *out, const void *row, int n)
{
    for (int i = 0; i < n; i++) {
        const BlockQ8_0 *b = (const BlockQ8_0 *)row + i / QK;
        out[i] = b->qs[i % QK] * fp16_to_f32(b->d);
    }
}

/* The int8 KV cache: q8_0 blocks with d = max|x| / 127. */
static void from_float_q8_0_scalar(void *row, const float *x, int n)
{
    BlockQ8_0 *out = row;
    for (int b = 0; b < n / QK; b++, x += QK) out[b].d = f32_to_fp16(quantize_i8(out[b].qs, x, QK));
}

/* The int4 KV cache: q4_0 blocks as ggml's quantize_row_q4_0_ref makes
   them: d = -x_m / 8 for the element x_m of largest magnitude, so x_m
   itself lands exactly on -8; q = x/d + 8.5 truncated, at most 15 (NaN
   and inf give 0, where a cast would be undefined). */
static void from_float_q4_0_scalar(void *row, const float *x, int n)
{
    BlockQ4_0 *out = row;
    for (int b = 0; b < n / QK; b++, x += QK) {
        float amax = 0, xm = 0;
        for (int i = 0; i < QK; i++)
            if (amax < fabsf(x[i])) amax = fabsf(x[i]), xm = x[i];
        float d = xm / -8, id = d ? 1 / d : 0;
        out[b].d = f32_to_fp16(d);
        for (int j = 0; j < QK / 2; j++) {
            int lo = (int)fminf(15.0f, fmaxf(0.0f, x[j] * id + 8.5f));
            int hi = (int)fminf(15.0f, fmaxf(0.0f, x[j + QK / 2] * id + 8.5f));
            out[b].qs[j] = (uint8_t)(lo | hi << 4);
        }
    }
}

static void to_float_q4_1_scalar(float *out, const void *row, int n)
{
    for (int i = 0; i < n; i++) {
        const BlockQ4_1 *b = (const BlockQ4_1 *)row + i / QK;
        int j = i % QK, q = j < QK / 2 ? b->qs[j] & 0xf : b->qs[j - QK / 2] >> 4;
        out[i] = q * fp16_to_f32(b->d) + fp16_to_f32(b->m);
    }
}

static void to_float_q4_0_scalar(float *out, const void *row, int n)
{
    for (int i = 0; i < n; i++) {
        const BlockQ4_0 *b = (const BlockQ4_0 *)row + i / QK;
        int j = i % QK, q = j < QK / 2 ? b->qs[j] & 0xf : b->qs[j - QK / 2] >> 4;
        out[i] = (q - 8) * fp16_to_f32(b->d);
    }
}

/* Element j (0..31) of a 5-bit block: its nibble, and bit j of qh as bit 4. */
static int q5_int(const uint8_t *qs, const uint8_t *qh, int j)
{
    uint32_t h;
    memcpy(&h, qh, 4);
    return (j < QK / 2 ? qs[j] & 0xf : qs[j - QK / 2] >> 4) | ((h >> j) & 1) << 4;
}

static void to_float_q5_0_scalar(float *out, const void *row, int n)
{
    for (int i = 0; i < n; i++) {
        const BlockQ5_0 *b = (const BlockQ5_0 *)row + i / QK;
        out[i] = (q5_int(b->qs, b->qh, i % QK) - 16) * fp16_to_f32(b->d);
    }
}

static void to_float_q5_1_scalar(float *out, const void *row, int n)
{
    for (int i = 0; i < n; i++) {
        const BlockQ5_1 *b = (const BlockQ5_1 *)row + i / QK;
        out[i] = q5_int(b->qs, b->qh, i % QK) * fp16_to_f32(b->d) + fp16_to_f32(b->m);
    }
}

/* --- the K types' integers (ggml-quants.c, dequantize_row_q4_K and kin) --- */

/* Sub-block j's 6-bit scale and minimum in a q4_k/q5_k block's 12 bytes:
   j < 4 in the low 6 bits of bytes j and j+4; j >= 4 in the nibbles of
   byte j+4 with their top 2 bits in the spare bits of bytes j-4 and j. */
static void k4_scale_min(const uint8_t *s, int j, int *sc, int *m)
{
    if (j < 4) *sc = s[j] & 63, *m = s[j + 4] & 63;
    else *sc = (s[j + 4] & 0xf) | (s[j - 4] >> 6) << 4, *m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
}

/* Element i (0..255) of a q4_k block, of a q5_k block: 0..15, 0..31. */
static int q4_k_int(const uint8_t *block, int i)
{
    const BlockQ4K *b = (const BlockQ4K *)block;
    return b->qs[i / 64 * 32 + i % 32] >> (i % 64 / 32 * 4) & 0xf;
}

static int q5_k_int(const uint8_t *block, int i)
{
    const BlockQ5K *b = (const BlockQ5K *)block;
    return (b->qs[i / 64 * 32 + i % 32] >> (i % 64 / 32 * 4) & 0xf) | (b->qh[i % 32] >> (i / 32) & 1) << 4;
}

/* Element i (0..255) of a q6_k block, 0..63 (the offset 32 not taken). */
static int q6_k_int(const BlockQ6K *b, int i)
{
    int h = i / 128, g = i % 128 / 32, l = i % 32;
    int low = b->ql[64 * h + 32 * (g & 1) + l] >> (4 * (g >> 1)) & 0xf;
    return low | (b->qh[32 * h + l] >> (2 * g) & 3) << 4;
}

/* q4_k and q5_k share their header (d, dmin, scales): bb bytes a block. */
static void to_float_k4(float *out, const uint8_t *row, int n, size_t bb, int (*q)(const uint8_t *, int))
{
    for (int i = 0; i < n; i++) {
        const uint8_t *blk = row + i / QK_K * bb;
        const BlockQ4K *b = (const BlockQ4K *)blk;
        int sc, m;
        k4_scale_min(b->scales, i % QK_K / 32, &sc, &m);
        float d = fp16_to_f32(b->d) * sc, dm = fp16_to_f32(b->dmin) * m;
        out[i] = d * q(blk, i % QK_K) - dm;
    }
}

static void to_float_q4_k_scalar(float *out, const void *row, int n) { to_float_k4(out, row, n, sizeof(BlockQ4K), q4_k_int); }
static void to_float_q5_k_scalar(float *out, const void *row, int n) { to_float_k4(out, row, n, sizeof(BlockQ5K), q5_k_int); }

static void to_float_q6_k_scalar(float *out, const void *row, int n)
{
    for (int i = 0; i < n; i++) {
        const BlockQ6K *b = (const BlockQ6K *)row + i / QK_K;
        float d = fp16_to_f32(b->d) * b->scales[i % QK_K / 16];
        out[i] = d * (q6_k_int(b, i % QK_K) - 32);
    }
}

/* ----- the packed layout ---------------------------------------------------
   Where Part I's accessors find a value, and the byte counts of records
   and groups (export.py's manual, "Packed matrices").
   Every matrix the forward pass multiplies by is stored packed, the way the kernels read it: decode streams each
   weight once per token, so the bytes must arrive in the order they are
   used, and export.py writes them so; the engine maps the file and computes
   from it in place. Rows go in groups of PACK_ROWS (the last group padded
   with zero rows), one row per 32-bit lane of a 512-bit vector: a broadcast
   of four activation bytes meets four integers of each of 16 rows in one
   vpdpbusd (two 256-bit vectors on AVX2, four 128-bit ones on NEON), each
   lane sums its own row and no sum ever crosses lanes. A group of n
   elements per row is n / block records (one per block; the float types
   one per element), padded to PACK_ALIGN bytes. A record holds the block
   of each of the 16 rows, every byte of ggml's block kept, only moved:
     scales   ggml's non-integer fields as planes [field][row]: the fp16 d
              (then m or dmin) of the 16 rows side by side, then (K types)
              each scale byte of the 16 rows side by side
     integers per 32 elements of a row (a "stretch"), unsigned:
              8-bit (q8_0, stored as q + 128): 8 vectors of 64 bytes;
                byte 64g + 4r + i = element 4g + i of row r
              4-bit: the high planes (bits above the nibble; q5: 1 bit,
                q6_k: 2, as 64 * bits bytes), then 4 vectors of 64 bytes
                of nibbles: byte 64j + 4r + i holds element 8j + i of row
                r in its low nibble and element 8j + 4 + i in its high one;
                high-plane field k = 2j + h of that element (h = 0 low,
                1 high) is at bit (k % (8 / bits)) * bits of byte
                64 (k / (8 / bits)) + 4r + i
   So a kernel turns 64 bytes into 16 rows x 4 elements with an and or a
   shift, and a 5- or 6-bit integer with a shift, an and and an or more.
   The float types' record is element e of the 16 rows (64 or 32 bytes). */

/* A set's packed product for a type, one instance per token count (so
   that T is a constant): packed_NAME_SET, calling impl(group, n, x, xs, T,
   out, a, b, c ...), a b c the type's constants and what else impl takes. */
#define PACKED_KERNEL(name, set, impl, ...)                                                                          \
    static void packed_##name##_##set(const uint8_t *group, int n, const uint8_t *x, size_t xs, int toks, float *out) \
    {                                                                                                                \
        switch (toks) {                                                                                              \
        case 1: impl(group, n, x, xs, 1, out, __VA_ARGS__); break;                                                   \
        case 2: impl(group, n, x, xs, 2, out, __VA_ARGS__); break;                                                   \
        case 3: impl(group, n, x, xs, 3, out, __VA_ARGS__); break;                                                   \
        case 4: impl(group, n, x, xs, 4, out, __VA_ARGS__); break;                                                   \
        case 5: impl(group, n, x, xs, 5, out, __VA_ARGS__); break;                                                   \
        case 6: impl(group, n, x, xs, 6, out, __VA_ARGS__); break;                                                   \
        case 7: impl(group, n, x, xs, 7, out, __VA_ARGS__); break;                                                   \
        default: impl(group, n, x, xs, PACK_TOKS, out, __VA_ARGS__); break;                                          \
        }                                                                                                            \
    }
_Static_assert(PACK_TOKS == 8, "PACKED_KERNEL has a case per token count");

/* Bytes of a record's scales (before its integers). */
static size_t packed_head_bytes(const PackForm *f)
{
    if (f->kind == PACK_K4) return PACK_ROWS * sizeof(BlockQ4K) - PACK_ROWS * QK_K / 2; /* d, dmin, 12 scale bytes */
    if (f->kind == PACK_K6) return PACK_ROWS * (sizeof(uint16_t) + QK_K / 16);      /* d, 16 scale bytes */
    return PACK_ROWS * sizeof(uint16_t) * (1 + f->has_min);
}

/* Bytes of one stretch of PACK_ROWS rows' integers: the high planes, then the nibbles (or the bytes). */
static size_t packed_stretch_bytes(const PackForm *f) { return (size_t)PACK_ROWS * STRETCH * (f->bits == 8 ? 8 : f->bits) / 8; }

/* Elements of a row per record. */
static int packed_block(const PackForm *f) { return f->kind == PACK_FLOAT ? 1 : f->kind == PACK_BLOCK32 ? QK : QK_K; }

/* Bytes of one record: one block of PACK_ROWS rows. */
static size_t packed_record_bytes(const PackForm *f)
{
    if (f->kind == PACK_FLOAT) return PACK_ROWS * f->bits / 8;
    return packed_head_bytes(f) + packed_block(f) / STRETCH * packed_stretch_bytes(f);
}

/* Bytes of one group of PACK_ROWS rows of n elements. */
static size_t packed_group_bytes(const PackForm *f, int n)
{
    return align_up(n / packed_block(f) * packed_record_bytes(f), PACK_ALIGN);
}

/* Bytes of a record's fp16 planes (d, then m or dmin): the start of the
   K types' one-byte scale planes. */
static size_t packed_half_bytes(const PackForm *f)
{
    return PACK_ROWS * sizeof(uint16_t) * (1 + f->has_min);
}

/* The row that owns byte o of a record: the fp16 planes hold 2 bytes a row,
   the K types' scale planes 1, every 64-byte vector of integers 4, and a
   float record one element a row. */
static int packed_byte_row(const PackForm *f, size_t o)
{
    if (f->kind == PACK_FLOAT) return (int)(o / (f->bits / 8));
    size_t halves = packed_half_bytes(f), head = packed_head_bytes(f);
    if (o < halves) return (int)(o % (PACK_ROWS * sizeof(uint16_t)) / sizeof(uint16_t));
    if (o < head) return (int)((o - halves) % PACK_ROWS);
    return (int)((o - head) % PACK_VECTOR / PACK_LANE);
}

/* Byte o of a record of zero blocks: 0, but q8_0's integers, which are
   signed in ggml's block and stored as q + offset (128). */
static int packed_zero_byte(const PackForm *f, size_t o)
{
    return f->kind == PACK_BLOCK32 && f->bits == 8 && o >= packed_head_bytes(f) ? f->offset : 0;
}

/* Row r's unsigned integers of a stretch of packed integers of `bits`
   bits: u[e] = element e (0..STRETCH-1) (the layout above, read in its
   own order). */
static void packed_row_ints(const uint8_t *stretch, int bits, int r, uint8_t u[STRETCH])
{
    if (bits == 8) { /* byte 64g + 4r + i = element 4g + i of row r */
        for (int g = 0; g < STRETCH / 4; g++) memcpy(&u[4 * g], stretch + 64 * g + 4 * r, 4);
        return;
    }
    int extra = bits - 4, per_byte = extra ? 8 / extra : 1;
    const uint8_t *nib = stretch + (size_t)PACK_ROWS * STRETCH / 8 * extra; /* the high planes come first */
    for (int j = 0; j < STRETCH / 8; j++) /* byte 64j + 4r + i: element 8j + i low, 8j + 4 + i high */
        for (int i = 0; i < 4; i++) {
            uint8_t b = nib[64 * j + 4 * r + i];
            u[8 * j + i] = b & 0xf, u[8 * j + 4 + i] = b >> 4;
        }
    for (int k = 0; k < STRETCH / 4 && extra; k++) /* field k of element 4k + i: bits above the nibble */
        for (int i = 0; i < 4; i++)
            u[4 * k + i] |= (stretch[64 * (k / per_byte) + 4 * r + i] >> (k % per_byte * extra) & ((1 << extra) - 1)) << 4;
}

/* Row r's fp16 field of a plane of PACK_ROWS of them, as a float. */
static float packed_half(const uint8_t *plane, int r)
{
    uint16_t h;
    memcpy(&h, plane + 2 * r, 2);
    return fp16_to_f32(h);
}

/* Row r's 12 scale bytes of a packed q4_k/q5_k record, as ggml's block has them. */
static void packed_k4_scales(const uint8_t *rec, int r, uint8_t s[12])
{
    for (int b = 0; b < 12; b++) s[b] = rec[PACK_ROWS * (4 + b) + r];
}

/* The blocks' accessor: row r's block k of a packed group as numbers,
   every field read from where the layout above keeps it. */
static void weight_block(const PackForm *f, const uint8_t *group, int k, int r, RowBlock *b)
{
    const uint8_t *rec = group + k * packed_record_bytes(f);
    size_t hb = packed_head_bytes(f), sb = packed_stretch_bytes(f);
    for (int j = 0; j < packed_block(f) / STRETCH; j++) packed_row_ints(rec + hb + j * sb, f->bits, r, b->u + j * STRETCH);
    b->d = packed_half(rec, r);
    b->m = f->has_min || f->kind == PACK_K4 ? packed_half(rec + 2 * PACK_ROWS, r) : 0;
    if (f->kind == PACK_K4) {
        uint8_t scales[12];
        packed_k4_scales(rec, r, scales);
        for (int j = 0; j < QK_K / STRETCH; j++) k4_scale_min(scales, j, &b->sc[j], &b->mn[j]);
    } else if (f->kind == PACK_K6) {
        for (int j = 0; j < QK_K / 16; j++) b->sc[j] = (int8_t)rec[PACK_ROWS * (2 + j) + r];
    }
}

/* The float types' accessor: element e of row r of a packed float group. */
static float weight_float(int bits, int type, const uint8_t *group, int e, int r)
{
    const uint8_t *p = group + (size_t)(e * PACK_ROWS + r) * (bits / 8);
    uint16_t h;
    float f;
    if (bits == 32) return memcpy(&f, p, 4), f;
    memcpy(&h, p, 2);
    return type == T_F16 ? fp16_to_f32(h) : bf16_to_f32(h);
}

/* Row r of a packed group as floats, as the row's own dequantization
   (to_float) rounds it: a tied embedding's lookup reads the output head. */
static void packed_row_to_float(float *out, int type, const PackForm *f, const uint8_t *group, int r, int n)
{
    RowBlock b;
    int bs = packed_block(f);
    for (int e = 0; e < n; e++) {
        if (f->kind == PACK_FLOAT) { out[e] = weight_float(f->bits, type, group, e, r); continue; }
        int i = e % bs, q;
        if (i == 0) weight_block(f, group, e / bs, r, &b);
        q = b.u[i];
        if (f->kind == PACK_BLOCK32) out[e] = f->has_min ? q * b.d + b.m : (q - f->offset) * b.d;
        else if (f->kind == PACK_K6) out[e] = b.d * b.sc[i / K6_SUB] * (q - f->offset);
        else out[e] = b.d * b.sc[i / K4_SUB] * q - b.m * b.mn[i / K4_SUB]; /* PACK_K4 */
    }
}

/* Asks for a cached K or V row before attend_chunk reads it: the hardware
   prefetcher follows a run of rows only after a few misses, and not from
   one batch page into the next. A prefetch past the end of the cache is
   harmless (it never faults). */
static void prefetch_row(const uint8_t *row, size_t bytes)
{
    for (size_t i = 0; i < bytes; i += CACHE_LINE) __builtin_prefetch(row + i);
}

/* ----- the state of a run: its sizes and buffers ------------------------- */

/* Bytes that hold a row of up to cols activations in any format but floats. */
static size_t act_room(int cols)
{
    size_t most = 0;
    for (int f = ACT_F32 + 1; f < N_ACTS; f++) {
        size_t bytes = (cols / ACT_FORMATS[f].block + 1) * ACT_FORMATS[f].block_bytes;
        most = bytes > most ? bytes : most;
    }
    return most;
}

/* Bytes of the K and V caches for a context of seq_len; with full = 1 as
   if every layer were global (what ring buffers save, for -v). */
static size_t kv_cache_bytes(const Config *c, int seq_len, int kv_type, int full)
{
    size_t rows = 0;
    for (int l = 0; l < c->n_layers; l++) rows += (size_t)c->n_kv_heads * (full ? seq_len : kv_positions(c, l, seq_len));
    return 2 * rows * row_bytes(kv_type, c->head_dim);
}

static void build_state(RunState *s, const Model *m, int seq_len, int n_threads, int kv_type)
{
    const Config *c = &m->c;
    memset(s, 0, sizeof *s);
    s->c = c;
    int q_dim = c->n_heads * c->head_dim, kv_dim = c->n_kv_heads * c->head_dim, T = CHUNK_TOKENS;
    int max_cols = max_i(max_i(c->dim, q_dim), c->hidden_dim);
    s->seq_len = seq_len;
    s->kv_type = kv_type;
    s->kv_row = row_bytes(kv_type, c->head_dim);
    s->x = xcalloc((size_t)T * c->dim, sizeof(float));
    s->xb = xcalloc((size_t)T * max_cols, sizeof(float));
    s->xq = xcalloc((size_t)T, act_room(max_cols));
    s->qkv = xcalloc((size_t)T * (q_dim + 2 * kv_dim), sizeof(float));
    s->hb = xcalloc((size_t)T * 2 * c->hidden_dim, sizeof(float));
    s->hq = xcalloc((size_t)T, act_room(c->hidden_dim));
    if (c->post_norms) s->xo = xcalloc((size_t)T * c->dim, sizeof(float));
    /* pair i turns by pos * theta^(-2i/rope_dim), divided by its frequency
       factor (rope_freqs) and, on global layers, by the linear scaling */
    for (int k = 0; k < N_ROPE; k++) {
        double theta = k == ROPE_LOCAL ? c->rope_theta_local : c->rope_theta, scale = k == ROPE_LOCAL ? 1 : c->rope_scale;
        s->rope_cos[k] = xcalloc((size_t)T * c->rope_dim / 2, sizeof(float));
        s->rope_sin[k] = xcalloc((size_t)T * c->rope_dim / 2, sizeof(float));
        s->inv_freq[k] = xcalloc(c->rope_dim / 2, sizeof(float));
        for (int i = 0; i < c->rope_dim / 2; i++) {
            double factor = c->rope_freqs ? ((const float *)m->rope_freqs.data)[i] : 1;
            s->inv_freq[k][i] = (float)(pow(theta, -2.0 * i / c->rope_dim) / factor / scale);
        }
    }
    /* calloc of a large block maps zero pages lazily: memory is committed
       only as positions are written. */
    s->kv_cap = xcalloc(c->n_layers, sizeof(int));
    s->kv_off = xcalloc(c->n_layers, sizeof(size_t));
    for (int l = 0; l < c->n_layers; l++) {
        s->kv_cap[l] = kv_positions(c, l, seq_len);
        if (l + 1 < c->n_layers) s->kv_off[l + 1] = s->kv_off[l] + (size_t)c->n_kv_heads * s->kv_cap[l];
    }
    s->key_cache = xcalloc(kv_cache_bytes(c, seq_len, kv_type, 0) / 2, 1);
    s->value_cache = xcalloc(kv_cache_bytes(c, seq_len, kv_type, 0) / 2, 1);
    s->logits = xcalloc((size_t)T * c->vocab_size, sizeof(float));
    s->tok_pos = xcalloc(T, sizeof(int));
    s->mx = build_machinery(c, seq_len, n_threads);
}

static void free_state(RunState *s)
{
    free(s->x); free(s->xb); free(s->xq); free(s->qkv); free(s->hb); free(s->hq);
    for (int k = 0; k < N_ROPE; k++) { free(s->rope_cos[k]); free(s->rope_sin[k]); free(s->inv_freq[k]); }
    free(s->xo); free(s->kv_cap); free(s->kv_off);
    free(s->key_cache); free(s->value_cache); free(s->logits); free(s->tok_pos);
    free_machinery(s->mx);
}

/* ----- the kernel sets' interface -----------------------------------------
   One type's kernels and the other kernels of a set, as the tables below
   hold them, and the set in use. */

typedef void (*ToFloatFn)(float *out, const void *row, int n);
typedef void (*FromFloatFn)(void *row, const float *x, int n);
typedef void (*QuantizeFn)(void *out, const float *x, int n);

/* One type's kernels in one kernel set; NULL = take the inherited set's. */
typedef struct {
    ToFloatFn to_float;     /* a row as stored (a KV cache row, an embedding row) as floats */
    FromFloatFn from_float; /* floats into a row (KV cache types only) */
    PackedFn packed;        /* the matrix product over packed groups: decode's GEMV and prefill's tile at once */
    PackedFn wide;          /* the same for any number of tokens a call (a whole prefill chunk), sharing each
                               group's unpacking among them all; NULL: calls of PACK_TOKS to packed */
} TypeKernels;

enum { KSET_SCALAR, KSET_AVX2, KSET_AVX512, KSET_NEON, KSET_NEON_DOT, KSET_AVXVNNI, N_KSETS };
/* From plainest to best: without --kernels a run takes the last one its CPU runs. */
static const int KSET_RANK[N_KSETS] = {KSET_SCALAR, KSET_AVX2, KSET_AVXVNNI, KSET_AVX512, KSET_NEON, KSET_NEON_DOT};

typedef struct {
    const char *name;    /* as -v and messages print it */
    const char *kv_name; /* the name --kv takes, or NULL: not a KV cache type */
    int block;           /* elements per block (1 for float types) */
    size_t block_bytes;
    int act;             /* ACT_*: the activations its matrix products read */
    PackForm pack;       /* how its matrices are packed */
} WeightType;

/* The kernels that do not depend on a weight type, per kernel set. */
typedef struct {
    const char *name;
    int (*available)(void); /* can this CPU run the set? */
    int inherits;           /* KSET_*: the set whose kernels fill what this one leaves NULL */
    QuantizeFn quantize[N_ACTS]; /* floats -> activation blocks (NULL for ACT_F32: used as they are) */
    float (*att_softmax)(float *sc, int n, float scale, float *m);
    void (*att_qk)(float *s, const float *q, int nq, const void *const *k, int type, int hd, int nk); /* prefill */
    void (*att_pv)(float *o, int os, const float *p, int nq, const void *const *v, int type, int hd, int nk);
    void (*swiglu)(float *g, const float *u, int n);
    void (*geglu)(float *g, const float *u, int n);
    double (*peak_f32)(float *sink); /* --probe: PROBE_ITERS of independent FMA chains; returns FLOPs */
    double (*peak_i8)(unsigned *sink); /* ... of int8 multiply-add chains; returns ops (2 per MAC); sums wrap */
    Act (*attention)(RunState *s, int l, int n, const Matrix *wo); /* a layer's attention step */
} OpKernels;

/* The kernel set in use, resolved: one per program, set once by
   select_kernels before the first forward pass. */
static struct {
    int set;
    OpKernels op;
    TypeKernels type[N_TYPES];
    int stream_nta; /* the weight streams' prefetches take the non-temporal hint (streams_nta) */
} K;

/* The weight-type table, one row per type (a tentative definition: the
   rows, with each kernel set's functions, are in the tables below). */
static const WeightType TYPES[N_TYPES];
/* ----- attention in chunks -------------------------------------------------
   attend_chunk scores a tile of queries against ATT_KTILE
   cached keys at a time (att_qk), takes the online softmax step over the
   block (att_softmax) and adds the weighted V rows (att_pv). Each query's
   numbers come out the same whatever the other queries of the call: these
   are small GEMMs whose sums run in a fixed order per query. The softmax
   step uses a polynomial exp in its SIMD versions. */

/* The multi-query kernels read K and V rows straight from the cache, in
   its type (T_F32 or T_F16; attend_chunk converts the other cache types
   to f32 rows first). A K or V element loaded into a register then feeds
   every query of the tile (a token's `group` query heads, times the
   tokens of a prefill tile). Row j of K or V is at k[j] (rows of a block
   need not be adjacent: pages, ring buffers). */

/* Element i of a cached row of type T_F32 or T_F16. */
static float kv_elem(const void *row, int type, int i)
{
    return type == T_F16 ? fp16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* s[a * ATT_KTILE + j] = q_a . k_j for a < nq, j < nk (q is [nq, hd]). */
static void att_qk_scalar(float *s, const float *q, int nq, const void *const *k, int type, int hd, int nk)
{
    for (int a = 0; a < nq; a++)
        for (int j = 0; j < nk; j++) {
            float sum = 0;
            for (int i = 0; i < hd; i++) sum += q[(size_t)a * hd + i] * kv_elem(k[j], type, i);
            s[a * ATT_KTILE + j] = sum;
        }
}

/* o_a += sum over j < nk of p[a * ATT_KTILE + j] * v_j for a < nq, where
   o_a is the hd floats at o + a * os. */
static void att_pv_scalar(float *o, int os, const float *p, int nq, const void *const *v, int type, int hd, int nk)
{
    for (int a = 0; a < nq; a++)
        for (int j = 0; j < nk; j++)
            for (int i = 0; i < hd; i++) o[(size_t)a * os + i] += p[a * ATT_KTILE + j] * kv_elem(v[j], type, i);
}

static void att_qk(float *s, const float *q, int nq, const void *const *k, int type, int hd, int nk)
{
    K.op.att_qk(s, q, nq, k, type, hd, nk);
}
static void att_pv(float *o, int os, const float *p, int nq, const void *const *v, int type, int hd, int nk)
{
    K.op.att_pv(o, os, p, nq, v, type, hd, nk);
}

/* A partial softmax over some keys, for one query: the running maximum m
   of its scaled scores, l = sum exp(score - m), and o = sum exp(score - m) v
   (head_dim values): [m, l, o...], PARTIAL_HEAD + head_dim floats. */

static void partial_init(float *p, int hd)
{
    p[0] = -INFINITY, p[1] = 0;
    memset(p + PARTIAL_HEAD, 0, hd * sizeof(float));
}

/* Folds partial p (over later keys) into the running partial acc: the one
   way chunks of keys combine. Decode folds its chunks' partials in chunk
   order, prefill each chunk as it finishes it: the same steps, so the same
   numbers. A partial over no keys (a chunk all in the query's future, or
   out of its window) changes nothing. */
static void partial_fold(float *acc, const float *p, int hd)
{
    if (p[1] == 0) return;
    if (acc[1] == 0) {
        memcpy(acc, p, (PARTIAL_HEAD + hd) * sizeof(float));
        return;
    }
    float m = fmaxf(acc[0], p[0]), a = expf(acc[0] - m), b = expf(p[0] - m);
    acc[1] = acc[1] * a + p[1] * b;
    for (int i = 0; i < hd; i++) acc[PARTIAL_HEAD + i] = acc[PARTIAL_HEAD + i] * a + p[PARTIAL_HEAD + i] * b;
    acc[0] = m;
}

/* The partials of the queries of tokens [t0, t1) of the pass (consecutive
   positions of one sequence, from s->tok_pos[t0]) and the `group` query
   heads of KV head g, over the keys of [j_lo, j_hi) that each sees: part
   is [t1 - t0][group][PARTIAL_HEAD + head_dim]. Keys are taken ATT_KTILE
   at a time from j_lo (a multiple of ATT_CHUNK, so blocks start at the same
   positions for every query, whoever computes them), in the style of
   flash attention: scores for every query and key of the block (att_qk),
   each query's online-softmax step (att_softmax), then the weighted sum of
   V (att_pv). Every score, every weight and every output element goes
   through the same operations however many queries share the call: a
   query's partial is the same computed alone (decode) or in a tile
   (prefill). Where some query sees only part of a block (its own position
   falls in it, or it is out of its window) each token's queries take the
   V sum on their own, over the keys they see. */
static void attend_chunk(RunState *s, const Config *c, int l, int g, int t0, int t1, int j_lo, int j_hi, float *part, int me)
{
    int hd = c->head_dim, group = c->n_heads / c->n_kv_heads, nq = (t1 - t0) * group, pos0 = s->tok_pos[t0] - t0;
    int qkv_dim = (c->n_heads + 2 * c->n_kv_heads) * hd, last = min_i(j_hi, pos0 + t1) - 1, ps = PARTIAL_HEAD + hd;
    int native = s->kv_type == T_F32 || s->kv_type == T_F16, type = native ? s->kv_type : T_F32;
    const Machinery *mx = s->mx;
    float *kb = mx->kblock + (size_t)me * hd * ATT_KTILE, *vb = mx->vblock + (size_t)me * hd * ATT_KTILE;
    float *q = mx->qblock + (size_t)me * ATT_QTILE * group * hd, *pb = mx->pblock + (size_t)me * ATT_QTILE * group * ATT_KTILE;
    const void *krow[ATT_KTILE], *vrow[ATT_KTILE];
    int window = is_local(c, l) ? c->window : 0, ahead = max_i(1, KV_AHEAD / (int)s->kv_row);
    for (int k = 0; k < nq; k++) {
        partial_init(part + (size_t)k * ps, hd);
        memcpy(q + (size_t)k * hd, s->qkv + (size_t)(t0 + k / group) * qkv_dim + (g * group + k % group) * hd, hd * sizeof(float));
    }
    for (int j0 = j_lo; j0 <= last; j0 += ATT_KTILE) {
        int nj = min_i(ATT_KTILE, last + 1 - j0), shared = 1;
        /* Each row is asked for `ahead` rows before its use, and a job's first rows at its start. One
           sequence's rows of a KV head are consecutive, so the row `ahead` further is the address
           that far on; a batch's pages hold PAGE_TOKENS positions each, so there it is looked up by
           its position. (Asking for the bytes ahead in pages fetched the next head's rows at the end
           of every page, and a job's first rows were asked for by nobody: the loads of att_qk waited
           on DRAM: on SmolLM2 with 16 in flight, 6.5 ms of a 16.4 ms step.) */
        for (int j = 0; j < nj; j++) {
            const uint8_t *kc = cache_row(s, s->key_cache, t0, l, g, j0 + j), *vc = cache_row(s, s->value_cache, t0, l, g, j0 + j);
            if (j0 == j_lo && j < ahead) prefetch_row(kc, s->kv_row), prefetch_row(vc, s->kv_row);
            if (!mx->paged) {
                prefetch_row(kc + ahead * s->kv_row, s->kv_row);
                prefetch_row(vc + ahead * s->kv_row, s->kv_row);
            } else if (j0 + j + ahead <= last) {
                prefetch_row(cache_row(s, s->key_cache, t0, l, g, j0 + j + ahead), s->kv_row);
                prefetch_row(cache_row(s, s->value_cache, t0, l, g, j0 + j + ahead), s->kv_row);
            }
            krow[j] = kc, vrow[j] = vc;
            if (native) continue;
            to_float(kb + (size_t)j * hd, kc, s->kv_type, hd);
            to_float(vb + (size_t)j * hd, vc, s->kv_type, hd);
            krow[j] = kb + (size_t)j * hd, vrow[j] = vb + (size_t)j * hd;
        }
        att_qk(pb, q, nq, krow, type, hd, nj);
        for (int k = 0; k < nq; k++) {
            int t = t0 + k / group, n = min_i(nj, pos0 + t + 1 - j0);
            /* a local layer's query sees only keys j > pos - window: the first `hidden` of the block are masked */
            int hidden = window ? max_i(0, pos0 + t - window + 1 - j0) : 0;
            shared &= n == nj && n > hidden;
            if (n <= hidden) continue; /* the whole block lies in this token's future (or out of its window) */
            float *sc = pb + (size_t)k * ATT_KTILE, *p = part + (size_t)k * ps, m = p[0];
            for (int j = 0; j < hidden; j++) sc[j] = -INFINITY; /* exp gives them weight 0 */
            float sum = att_softmax(sc, n, c->att_scale, &m), rescale = expf(p[0] - m); /* 0 on the first block */
            if (rescale != 1.0f)
                for (int i = 0; i < hd; i++) p[PARTIAL_HEAD + i] *= rescale;
            p[1] = p[1] * rescale + sum;
            p[0] = m;
        }
        if (shared) {
            att_pv(part + PARTIAL_HEAD, ps, pb, nq, vrow, type, hd, nj);
            continue;
        }
        for (int t = t0; t < t1; t++) {
            int n = min_i(nj, pos0 + t + 1 - j0), hidden = window ? max_i(0, pos0 + t - window + 1 - j0) : 0, k = (t - t0) * group;
            if (n > hidden) att_pv(part + (size_t)k * ps + PARTIAL_HEAD, ps, pb + (size_t)k * ATT_KTILE, group, vrow, type, hd, n);
        }
    }
}

/* The outputs of KV head g's query heads for token t, from their folded
   partial acc ([group][PARTIAL_HEAD + head_dim]), into s->xb ([n, q_dim]),
   and converted into s->xq in activation format fmt unless that is ACT_F32
   (the caller checked that the slice is made of whole blocks; converting
   here spares Wo a pass and a barrier). */
static void attention_out(RunState *s, const Config *c, const float *acc, int g, int t, int fmt)
{
    int hd = c->head_dim, group = c->n_heads / c->n_kv_heads, q_dim = c->n_heads * hd;
    float *o = s->xb + (size_t)t * q_dim + g * group * hd;
    for (int h = 0; h < group; h++)
        for (int i = 0; i < hd; i++) o[h * hd + i] = acc[h * (PARTIAL_HEAD + hd) + PARTIAL_HEAD + i] / acc[h * (PARTIAL_HEAD + hd) + 1];
    if (fmt != ACT_F32) quantize_act(fmt, s->xq + t * act_bytes(fmt, q_dim) + act_bytes(fmt, g * group * hd), o, group * hd);
}

/* The first and one past the last chunk of ATT_CHUNK positions that token
   t's queries see on layer l. */
static void chunk_range(const RunState *s, const Config *c, int l, int t, int *k0, int *k1)
{
    int pos = s->tok_pos[t];
    *k0 = is_local(c, l) ? max_i(0, pos - c->window + 1) / ATT_CHUNK : 0;
    *k1 = pos / ATT_CHUNK + 1;
}

/* Attention for the pass's n tokens, thread me's share, in chunks of
   ATT_CHUNK positions: a pass of consecutive tokens of one sequence
   (prefill, lookup verification) deals (query tile, KV head) jobs
   round-robin, each folding the chunks its tokens see in order (the
   tile's ATT_QTILE tokens times `group` heads share each K and V load). A
   pass of one token, or of tokens of different sequences (batch mode's
   step), deals (token, KV head, chunk) jobs, so that even one KV head's
   long context is spread over every thread, then folds each token's
   chunks in order; where every token sees one chunk only (contexts up to
   ATT_CHUNK: most batch steps) a job's partial is already whole, and the
   job writes its output with no fold and no wait for the other threads
   (SmolLM2 with 16 in flight: +3 %). All compute a query's output by the
   same steps, and no job depends on the thread count. */
static void attend_chunks(RunState *s, int l, int n, int fmt)
{
    const Config *c = s->c;
    int me = thread_id(), nth = thread_count();
    int hd = c->head_dim, group = c->n_heads / c->n_kv_heads, ps = PARTIAL_HEAD + hd;
    int part = group * ps, max_chunks = s->seq_len / ATT_CHUNK + 1;
    if (n > 1 && !s->mx->scattered) {
        int tiles = (n + ATT_QTILE - 1) / ATT_QTILE;
        float *acc = s->mx->partial + (size_t)me * 2 * ATT_QTILE * part, *cur = acc + (size_t)ATT_QTILE * part;
        for (int job = me; job < tiles * c->n_kv_heads; job += nth) {
            int g = job % c->n_kv_heads, t0 = job / c->n_kv_heads * ATT_QTILE, t1 = min_i(t0 + ATT_QTILE, n), k0, k1, unused;
            chunk_range(s, c, l, t0, &k0, &unused);
            chunk_range(s, c, l, t1 - 1, &unused, &k1);
            for (int k = 0; k < (t1 - t0) * group; k++) partial_init(acc + (size_t)k * ps, hd);
            for (int ch = k0; ch < k1; ch++) {
                attend_chunk(s, c, l, g, t0, t1, ch * ATT_CHUNK, (ch + 1) * ATT_CHUNK, cur, me);
                for (int k = 0; k < (t1 - t0) * group; k++) partial_fold(acc + (size_t)k * ps, cur + (size_t)k * ps, hd);
            }
            for (int t = t0; t < t1; t++) attention_out(s, c, acc + (size_t)(t - t0) * part, g, t, fmt);
        }
        return;
    }
    float *acc = s->mx->partial + ((size_t)n * c->n_kv_heads * max_chunks + me) * part; /* past the chunks: thread me's */
    int one = 1, k0, k1; /* does every token see one chunk only? */
    for (int t = 0; t < n && one; t++) {
        chunk_range(s, c, l, t, &k0, &k1);
        one = k1 - k0 == 1;
    }
    if (one) {
        for (int job = me; job < n * c->n_kv_heads; job += nth) {
            int t = job / c->n_kv_heads, g = job % c->n_kv_heads;
            chunk_range(s, c, l, t, &k0, &k1);
            attend_chunk(s, c, l, g, t, t + 1, k0 * ATT_CHUNK, k1 * ATT_CHUNK, acc, me);
            attention_out(s, c, acc, g, t, fmt);
        }
        return;
    }
    for (int t = 0, job = 0; t < n; t++) {
        chunk_range(s, c, l, t, &k0, &k1);
        for (int g = 0; g < c->n_kv_heads; g++)
            for (int k = k0; k < k1; k++, job++) {
                if (job % nth != me) continue;
                float *dst = s->mx->partial + (((size_t)t * c->n_kv_heads + g) * max_chunks + (k - k0)) * part;
                attend_chunk(s, c, l, g, t, t + 1, k * ATT_CHUNK, (k + 1) * ATT_CHUNK, dst, me);
            }
    }
    barrier();
    for (int job = me; job < n * c->n_kv_heads; job += nth) {
        int t = job / c->n_kv_heads, g = job % c->n_kv_heads;
        chunk_range(s, c, l, t, &k0, &k1);
        const float *chunks = s->mx->partial + ((size_t)t * c->n_kv_heads + g) * max_chunks * part;
        for (int k = 0; k < group; k++) partial_init(acc + (size_t)k * ps, hd);
        for (int ch = 0; ch < k1 - k0; ch++)
            for (int k = 0; k < group; k++) partial_fold(acc + (size_t)k * ps, chunks + (size_t)ch * part + (size_t)k * ps, hd);
        attention_out(s, c, acc, g, t, fmt);
    }
}

/* The attention step (OpKernels.attention) of every set but the scalar
   one: layer l's attention for the pass's n tokens in chunks of the cache,
   into s->xb in the form Wo reads. attention_out converts each KV head's
   slice of the output when the slices are whole blocks of Wo's format
   (sparing Wo a pass and a wait); otherwise whole rows are converted
   afterwards. A build with no SIMD set (SCALAR_SET_ONLY, or a CPU family
   without one) never calls it. */
static __attribute__((unused)) Act attend_in_chunks(RunState *s, int l, int n, const Matrix *wo)
{
    const Config *c = s->c;
    int q_dim = c->n_heads * c->head_dim, group = c->n_heads / c->n_kv_heads, wo_fmt = matrix_act(wo);
    int fmt = group * c->head_dim % ACT_FORMATS[wo_fmt].block ? ACT_F32 : wo_fmt;
    double t0 = prof_start(), waited = pass_prof.on ? pass_prof.th[thread_id()].ms[PT_WAIT] : 0;
    attend_chunks(s, l, n, fmt);
    prof_add(PT_ATTN, t0);
    if (pass_prof.on) pass_prof.th[thread_id()].ms[PT_ATTN] -= pass_prof.th[thread_id()].ms[PT_WAIT] - waited;
    barrier();
    if (fmt != wo_fmt) PARALLEL_FOR(t, n, 1) to_input(wo, s->xq, s->xb + (size_t)t * q_dim, t, 0, q_dim);
    return input_of(wo, s->xb, q_dim, s->xq);
}

/* ----- the kernel tables -----------------------------------------------------
   Everything the engine knows about a tensor type is one row of TYPES:
   its block shape, the activations its matrix products consume, how its
   matrices are packed, and its kernels in every kernel set. A kernel set
   is one instruction-set level (the scalar reference; AVX2, AVX-VNNI and
   AVX-512 VNNI on x86-64; NEON and NEON with sdot on aarch64), all
   compiled into every build for the machine's architecture; select_kernels
   picks one at start-up (the best the CPU runs, or --kernels) and resolves
   every row against it, filling what a set leaves out from the set it
   inherits from, down to the scalar reference. Every set reads the one
   packed layout of the file. The forward pass only ever calls the
   resolved kernels. Adding a type is: its kernel functions and one row here. */

/* The scalar set's packed products: the definitions, output by output. */
static void packed_scalar(int type, const PackForm *f, const uint8_t *group, int n, const uint8_t *x, size_t xs, int toks,
                          float *out)
{
    for (int t = 0; t < toks; t++)
        for (int r = 0; r < PACK_ROWS; r++) {
            const void *a = x + t * xs;
            float *o = out + t * PACK_ROWS + r;
            if (f->kind == PACK_BLOCK32) *o = dot_block32(f, group, r, a, n);
            else if (f->kind == PACK_FLOAT) *o = dot_float(type, f->bits, group, r, a, n);
            else *o = dot_k(f, group, r, a, n);
        }
}

/* Each type's packed form: kind, integer bits, offset, has a minimum. */
#define FORM_F32 {PACK_FLOAT, 32, 0, 0}
#define FORM_F16 {PACK_FLOAT, 16, 0, 0}
#define FORM_BF16 {PACK_FLOAT, 16, 0, 0}
#define FORM_Q4_0 {PACK_BLOCK32, 4, 8, 0}
#define FORM_Q4_1 {PACK_BLOCK32, 4, 0, 1}
#define FORM_Q5_0 {PACK_BLOCK32, 5, 16, 0}
#define FORM_Q5_1 {PACK_BLOCK32, 5, 0, 1}
#define FORM_Q8_0 {PACK_BLOCK32, 8, 128, 0}
#define FORM_Q4_K {PACK_K4, 4, 0, 1}
#define FORM_Q5_K {PACK_K4, 5, 0, 1}
#define FORM_Q6_K {PACK_K6, 6, 32, 0}
#define PACKED_SCALAR(name, T, FORM)                                                                             \
    static void packed_##name##_scalar(const uint8_t *group, int n, const uint8_t *x, size_t xs, int toks, float *out) \
    {                                                                                                            \
        packed_scalar(T, &(const PackForm)FORM, group, n, x, xs, toks, out);                                     \
    }
PACKED_SCALAR(f32, T_F32, FORM_F32) PACKED_SCALAR(f16, T_F16, FORM_F16) PACKED_SCALAR(bf16, T_BF16, FORM_BF16)
PACKED_SCALAR(q4_0, T_Q4_0, FORM_Q4_0) PACKED_SCALAR(q4_1, T_Q4_1, FORM_Q4_1) PACKED_SCALAR(q5_0, T_Q5_0, FORM_Q5_0)
PACKED_SCALAR(q5_1, T_Q5_1, FORM_Q5_1) PACKED_SCALAR(q8_0, T_Q8_0, FORM_Q8_0) PACKED_SCALAR(q4_k, T_Q4_K, FORM_Q4_K)
PACKED_SCALAR(q5_k, T_Q5_K, FORM_Q5_K) PACKED_SCALAR(q6_k, T_Q6_K, FORM_Q6_K)

/* The scalar set's probes (--probe), defined with the measurements. */
static double peak_f32_scalar(float *sink);
static double peak_i8_scalar(unsigned *sink);

/* Type ids and block layouts are ggml's (ggml-common.h), so quantized
   blocks are copied from GGUF files bit for bit (and packed). */
static const WeightType TYPES[N_TYPES] = {
    [T_F32] = {"f32", "f32", 1, 4, ACT_F32, FORM_F32},
    [T_F16] = {"f16", "f16", 1, 2, ACT_F32, FORM_F16},
    [T_BF16] = {"bf16", NULL, 1, 2, ACT_F32, FORM_BF16},
    [T_Q4_0] = {"q4_0", "q4", QK, sizeof(BlockQ4_0), ACT_Q8, FORM_Q4_0},
    [T_Q4_1] = {"q4_1", NULL, QK, sizeof(BlockQ4_1), ACT_Q8, FORM_Q4_1},
    [T_Q5_0] = {"q5_0", NULL, QK, sizeof(BlockQ5_0), ACT_Q8, FORM_Q5_0},
    [T_Q5_1] = {"q5_1", NULL, QK, sizeof(BlockQ5_1), ACT_Q8, FORM_Q5_1},
    [T_Q8_0] = {"q8_0", "q8", QK, sizeof(BlockQ8_0), ACT_Q8, FORM_Q8_0},
    [T_Q4_K] = {"q4_k", NULL, QK_K, sizeof(BlockQ4K), ACT_Q8K, FORM_Q4_K},
    [T_Q5_K] = {"q5_k", NULL, QK_K, sizeof(BlockQ5K), ACT_Q8K, FORM_Q5_K},
    [T_Q6_K] = {"q6_k", NULL, QK_K, sizeof(BlockQ6K), ACT_Q8K, FORM_Q6_K},
};

static int always(void) { return 1; }

/* A kernel set: its kernels that do not depend on a type, and its row of
   kernels for each type (NULL where it takes the set it inherits from). */
typedef struct {
    OpKernels op;
    TypeKernels type[N_TYPES];
} KernelSet;

/* The scalar set: Part I's definitions. */
#define SCALAR(t, from) {.to_float = to_float_##t##_scalar, .from_float = from, .packed = packed_##t##_scalar}
static const KernelSet SET_SCALAR = {
    {"scalar", always, KSET_SCALAR, {[ACT_Q8] = quantize_act_scalar, [ACT_Q8K] = quantize_act_k_scalar}, att_softmax_scalar,
     att_qk_scalar, att_pv_scalar, swiglu_scalar, geglu_scalar, peak_f32_scalar, peak_i8_scalar, attend_each},
    {[T_F32] = SCALAR(f32, from_float_f32_scalar), [T_F16] = SCALAR(f16, from_float_f16_scalar), [T_BF16] = SCALAR(bf16, NULL),
     [T_Q4_0] = SCALAR(q4_0, from_float_q4_0_scalar), [T_Q4_1] = SCALAR(q4_1, NULL), [T_Q5_0] = SCALAR(q5_0, NULL),
     [T_Q5_1] = SCALAR(q5_1, NULL), [T_Q8_0] = SCALAR(q8_0, from_float_q8_0_scalar), [T_Q4_K] = SCALAR(q4_k, NULL),
     [T_Q5_K] = SCALAR(q5_k, NULL), [T_Q6_K] = SCALAR(q6_k, NULL)},
};
#undef SCALAR

/* The other sets are defined at the end of their appendices, beside their
   kernels; these tentative definitions let the table below name them. */
#ifdef HAVE_X86_SETS
static const KernelSet SET_AVX2;
#endif
#ifdef HAVE_AVXVNNI_SET
static const KernelSet SET_AVXVNNI;
#endif
#ifdef HAVE_AVX512_SET
static const KernelSet SET_AVX512;
#endif
#ifdef HAVE_NEON_SET
static const KernelSet SET_NEON, SET_NEON_DOT;
#endif
#ifdef HAVE_X86_SETS
static int streams_nta(void);
#else
static int streams_nta(void) { return 0; }
#endif
static const KernelSet *const SETS[N_KSETS] = {
    [KSET_SCALAR] = &SET_SCALAR,
#ifdef HAVE_X86_SETS
    [KSET_AVX2] = &SET_AVX2,
#endif
#ifdef HAVE_AVXVNNI_SET
    [KSET_AVXVNNI] = &SET_AVXVNNI,
#endif
#ifdef HAVE_AVX512_SET
    [KSET_AVX512] = &SET_AVX512,
#endif
#ifdef HAVE_NEON_SET
    [KSET_NEON] = &SET_NEON, [KSET_NEON_DOT] = &SET_NEON_DOT,
#endif
};

static int kernel_set_available(int set) { return set >= 0 && set < N_KSETS && SETS[set] && SETS[set]->op.available(); }

/* Makes `set` the kernel set of every call below; fields it leaves NULL
   come from the set it inherits from, and so on down to the scalar set. */
static void select_kernels(int set)
{
    K.set = set;
    K.stream_nta = streams_nta();
    K.op = SETS[set]->op;
    for (int t = 0; t < N_TYPES; t++) K.type[t] = SETS[set]->type[t];
    for (int s = set; s != KSET_SCALAR;) {
        s = SETS[s]->op.inherits;
        const OpKernels *ref = &SETS[s]->op;
#define FILL(field) if (!K.op.field) K.op.field = ref->field
        for (int a = 0; a < N_ACTS; a++) FILL(quantize[a]);
        FILL(att_softmax); FILL(att_qk); FILL(att_pv);
        FILL(swiglu); FILL(geglu);
        FILL(peak_f32); FILL(peak_i8); FILL(attention);
#undef FILL
        for (int t = 0; t < N_TYPES; t++) {
            const TypeKernels *r = &SETS[s]->type[t];
            TypeKernels *k = &K.type[t];
            if (!k->to_float) k->to_float = r->to_float;
            if (!k->from_float) k->from_float = r->from_float;
            if (!k->packed) k->packed = r->packed;
            if (!k->wide) k->wide = r->wide;
        }
    }
}

/* The best set this CPU runs: the last available one in KSET_RANK. */
static int best_kernel_set(void)
{
    int best = KSET_SCALAR;
    for (int i = 0; i < N_KSETS; i++) if (kernel_set_available(KSET_RANK[i])) best = KSET_RANK[i];
    return best;
}

static const char *type_name(int type) { return type >= 0 && type < N_TYPES ? TYPES[type].name : NULL; }

/* Bytes one row of `cols` elements takes, or 0 for an unknown type or a
   row that is not a whole number of blocks. */
static size_t row_bytes(int type, size_t cols)
{
    if (!type_name(type) || cols % TYPES[type].block) return 0;
    return cols / TYPES[type].block * TYPES[type].block_bytes;
}

/* Bytes of a packed matrix of rows x cols (whole groups), or 0 as row_bytes. */
static size_t packed_bytes(int type, size_t rows, size_t cols)
{
    if (!row_bytes(type, cols)) return 0;
    return (rows + PACK_ROWS - 1) / PACK_ROWS * packed_group_bytes(&TYPES[type].pack, (int)cols);
}

/* Bytes of n activations in format act (n a multiple of its block). */
static size_t act_bytes(int act, size_t n) { return n / ACT_FORMATS[act].block * ACT_FORMATS[act].block_bytes; }

static int act_format(int type) { return TYPES[type].act; }

/* One row of n elements of any type as floats (embedding rows, KV rows). */
static void to_float(float *out, const void *row, int type, int n) { K.type[type].to_float(out, row, n); }

/* Row r of tensor t as floats, whatever its layout (the embedding is the
   packed output head when the two are tied). */
static void tensor_row_to_float(float *out, const Tensor *t, int r)
{
    if (t->layout == LAYOUT_ROWS) {
        to_float(out, tensor_row(t, r), t->type, t->cols);
        return;
    }
    const PackForm *f = &TYPES[t->type].pack;
    const uint8_t *group = (const uint8_t *)t->data + (size_t)(r / PACK_ROWS) * packed_group_bytes(f, t->cols);
    packed_row_to_float(out, t->type, f, group, r % PACK_ROWS, t->cols);
}

static void quantize_act(int act, void *out, const float *x, int n) { K.op.quantize[act](out, x, n); }
static float att_softmax(float *sc, int n, float scale, float *m) { return K.op.att_softmax(sc, n, scale, m); }
static void swiglu(float *g, const float *u, int n) { K.op.swiglu(g, u, n); }
static void geglu(float *g, const float *u, int n) { K.op.geglu(g, u, n); }

/* Floats into a row of a KV cache type. */
static void from_float(void *row, const float *x, int type, int n) { K.type[type].from_float(row, x, n); }
static PackedFn packed_kernel(int type) { return K.type[type].packed; }
static PackedFn wide_kernel(int type) { return K.type[type].wide; }
static const PackForm *packed_form(int type) { return &TYPES[type].pack; }
static Act attention(RunState *s, int l, int n, const Matrix *wo) { return K.op.attention(s, l, n, wo); }
static const char *kernel_set_name(void) { return K.op.name; }

/* --kv TYPE must divide the model's head_dim into whole blocks. */
static void check_kv_type(int type, int head_dim)
{
    if (head_dim % TYPES[type].block)
        die(EXIT_USAGE, "--kv %s needs a head_dim that is a multiple of %d (this model: %d)", TYPES[type].kv_name,
            TYPES[type].block, head_dim);
}


/* ----- measurement: roofline and statistics ---------------------------------- */

struct Machine {
    double gbps;       /* DRAM read, GB/s */
    double llc_gbps;   /* last-level cache read, GB/s (0: the cache's size is unknown) */
    size_t llc_bytes;  /* its size: one instance, the cache this CPU's threads share (0: unknown) */
    int llc_level;     /* its level: 3 on most x86-64 CPUs (0: unknown) */
    double f32_gflops; /* FMA peak, GFLOP/s */
    double i8_gops;    /* int8 multiply-add peak, GOP/s (2 ops per MAC) */
};


/* How fast could this machine go? Small probes (--probe) measure the read
   bandwidth of DRAM and of the last-level cache and the f32 and int8
   arithmetic peaks with the same thread team; -v then puts each phase next
   to its own limit: decode against the bandwidth of the level its bytes
   stream from (weights and KV cache read per token: the cache when they fit
   in it, else DRAM), prefill against arithmetic (FLOPs per prompt). */

#define PROBE_BYTES (256u << 20)  /* DRAM probe buffer: far beyond most L3s... */
#define PROBE_DRAM_OVER_LLC 4     /* ...and at least this many times the last-level cache, which it then misses */
#define PROBE_LLC_FRACTION 2      /* the cache probe reads 1/this of the cache (why: probe_llc) */
#define PROBE_LLC_READ (2ull << 30) /* bytes the cache probe reads per timed pass: ~10 ms at 200 GB/s */
#define PROBE_PASSES 3            /* timed passes of a bandwidth probe, the best one counts */
#define PROBE_LANES 64            /* partial sums per thread: independent add chains, so the adds keep up with the loads */
#define PROBE_ITERS 20000000      /* ~10 ms of arithmetic per thread */
#define LLC_STREAM_SHARE 0.75     /* decode streams from the cache when it reads at most this share of it per token
                                     (the rest holds activations, code and other processes' lines) */

/* cpu0's cache attribute `name` of cache `index` in /sys, one line
   ("3", "Unified", "32768K"); 0 when there is no such cache. */
static int cache_attr(int index, const char *name, char word[MSG_BYTES])
{
    char path[MSG_BYTES];
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/%s", index, name);
    FILE *f = fopen(path, "r");
    int ok = f && fgets(word, MSG_BYTES, f);
    if (f) fclose(f);
    if (ok) word[strcspn(word, "\n")] = 0;
    return ok;
}

/* The size (bytes) and level of the last-level cache: the highest level
   /sys lists for cpu0, one instance of it (on a chip of several core
   complexes, the L3 of one complex: what a core can hit in). sysconf's L3
   figure is the fallback only, since some x86 VMs report the whole
   package's there (320 MiB on an EPYC whose complexes have 32 MiB each).
   0 when neither says. */
static size_t llc_size(int *level)
{
    size_t best = 0;
    *level = 0;
    char lv[MSG_BYTES], type[MSG_BYTES], size[MSG_BYTES];
    for (int i = 0; cache_attr(i, "level", lv); i++) {
        if (!cache_attr(i, "type", type) || !strcmp(type, "Instruction") || !cache_attr(i, "size", size)) continue;
        char *unit;
        size_t bytes = strtoull(size, &unit, 10);
        bytes <<= *unit == 'K' ? 10 : *unit == 'M' ? 20 : *unit == 'G' ? 30 : 0;
        if (bytes && atoi(lv) > *level) *level = atoi(lv), best = bytes;
    }
#ifdef _SC_LEVEL3_CACHE_SIZE
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (!best && l3 > 0) *level = 3, best = (size_t)l3;
#endif
    return best;
}

/* The request the x86 sets' packed kernels make ahead of their weight
   stream, and --probe's DRAM read with them (read_share): the line
   WEIGHT_AHEAD bytes further down the one stream of packed groups, into
   L2 only (__builtin_prefetch's locality 1: prefetcht2), or with the
   non-temporal hint (prefetchnta) where the CPU streams faster so
   (streams_nta, in the x86 appendix). Asking for it in
   L1, as prefetch_row does, measured 30 % slower there: the requests
   held L1's few miss buffers that the loads themselves needed. The
   integer kernels ask for every call, not only one token's: a pass of a
   few tokens (a batch step, lookup's verification) streams the weights as
   decode does (one thread's CPU time for one pass on the 1.5B, AVX-512: 4
   tokens 0.18 -> 0.13 s, 16 tokens 0.29 -> 0.25 s, 64 tokens 0.72 -> 0.68 s;
   AVX2: 0.20 -> 0.16, 0.39 -> 0.36, 1.14 -> 1.15). 8 KB ahead rather than
   4: at 4 SmolLM2's output head in a 16-row step (q8_0, which streams
   about 24 GB/s a thread there) outran its requests (AMD EPYC Zen 5,
   interleaved runs: the head 0.9 -> 0.7 ms, 16 in flight +2.6 %; one
   stream's AVX2 decode +6 % on the 1.5B, +4 % on SmolLM2; AVX-512 decode
   even; prefill +1.5-2 %). */
static void decode_prefetch(const uint8_t *p)
{
    if (K.stream_nta) __builtin_prefetch(p + WEIGHT_AHEAD, 0, 0);
    else __builtin_prefetch(p + WEIGHT_AHEAD, 0, 1);
}

/* Sums this thread's share of buf[n] `reps` times over (each thread its
   own rows, as decode splits a matrix's rows); the sum keeps the loads.
   With ahead, each line is asked for as the kernels ask for their weights
   (decode_prefetch), so that the probe reads DRAM as a decode can: AMD
   EPYC Zen 5, the non-temporal hint, 41 -> 49-51 GB/s. */
static uint32_t read_share(const uint32_t *buf, size_t n, long reps, int ahead)
{
    int lo, hi;
    split((int)(n / PROBE_LANES), 1, thread_id(), thread_count(), &lo, &hi);
    uint32_t acc[PROBE_LANES] = {0}, sum = 0;
    for (long r = 0; r < reps; r++)
        for (size_t i = (size_t)lo * PROBE_LANES; i < (size_t)hi * PROBE_LANES; i += PROBE_LANES) {
            for (size_t b = 0; ahead && b < PROBE_LANES * sizeof *buf; b += CACHE_LINE) decode_prefetch((const uint8_t *)(buf + i) + b);
            for (int j = 0; j < PROBE_LANES; j++) acc[j] += buf[i + j];
        }
    for (int j = 0; j < PROBE_LANES; j++) sum += acc[j];
    return sum;
}

/* Read bandwidth, GB/s, of every thread reading its share of a buffer of
   `bytes`, `reps` times per pass. An untimed first pass faults the pages
   in (and fills the cache when the buffer fits); of PROBE_PASSES timed
   ones the best counts, as other processes may take the cores in any.
   ahead: read_share's requests ahead (DRAM; a cache-sized buffer is read
   without them). */
static double probe_read(size_t bytes, long reps, int ahead)
{
    size_t n = bytes / sizeof(uint32_t);
    uint32_t *buf = xmalloc(n * sizeof *buf), sum = 0;
    memset(buf, 0, n * sizeof *buf);
    double best = 0;
    for (int pass = 0; pass <= PROBE_PASSES; pass++) {
        double t0 = now_ms();
        #pragma omp parallel reduction(+ : sum)
        sum += read_share(buf, n, reps, ahead);
        double gbps = (double)n * sizeof *buf * reps / ((now_ms() - t0) / 1e3) / 1e9;
        if (pass > 0 && gbps > best) best = gbps;
    }
    free(buf);
    volatile uint32_t keep = sum; /* the sums are used: the loads stay */
    (void)keep;
    return best;
}

/* The cache's read bandwidth, from a buffer of half its size: a buffer as
   large as the cache would partly miss, since the cache also holds code,
   stacks and other processes' lines and does not replace perfectly
   least-recently-used; half still leaves each of a few threads a share
   larger than its own L2. Each pass reads the buffer many times over, so that
   a pass lasts milliseconds, long against the clock and the thread start. */
static double probe_llc(size_t llc_bytes)
{
    size_t bytes = llc_bytes / PROBE_LLC_FRACTION;
    long reps = (long)(PROBE_LLC_READ / bytes) + 1;
    return probe_read(bytes, reps, 0);
}

/* Arithmetic peaks: independent FMA (or int8 multiply-add) chains per
   thread, enough of them to hide latency. */
/* The scalar set's peaks: plain C chains, which the compiler vectorizes
   as far as the build's target allows. */
static double peak_f32_scalar(float *sink)
{
    float acc[8];
    for (int j = 0; j < 8; j++) acc[j] = (float)j;
    for (long i = 0; i < PROBE_ITERS / 8; i++)
        for (int j = 0; j < 8; j++) acc[j] = acc[j] * 0.999f + 1e-3f;
    for (int j = 0; j < 8; j++) *sink += acc[j];
    return (double)PROBE_ITERS / 8 * 8 * 2;
}

static double peak_i8_scalar(unsigned *sink)
{
    unsigned acc[8]; /* unsigned: the chains' sums wrap, as the SIMD sets' int32 lanes do */
    for (int j = 0; j < 8; j++) acc[j] = j;
    for (long i = 0; i < PROBE_ITERS / 8; i++)
        for (int j = 0; j < 8; j++) acc[j] += (unsigned)((int8_t)(i + j) * 3);
    for (int j = 0; j < 8; j++) *sink += acc[j];
    return (double)PROBE_ITERS / 8 * 8 * 2;
}

/* The kernel set in use's arithmetic peaks, on every thread at once. */
static void probe_compute(double *f32_gflops, double *i8_gops)
{
    double t0 = now_ms(), flops = 0, ops = 0;
    float fsink = 0;
    unsigned isink = 0;
    #pragma omp parallel reduction(+ : flops, fsink)
    flops += K.op.peak_f32(&fsink);
    *f32_gflops = flops / ((now_ms() - t0) / 1e3) / 1e9;
    t0 = now_ms();
    #pragma omp parallel reduction(+ : ops, isink)
    ops += K.op.peak_i8(&isink);
    *i8_gops = ops / ((now_ms() - t0) / 1e3) / 1e9;
    if (fsink == 1234.5f && isink == 12345) fputc(' ', stderr); /* keep the chains alive */
}

/* --probe: this machine's limits, measured once per run. */
static const Machine *probe_machine(int threads)
{
    static Machine machine;
    Machine *mc = &machine;
    mc->llc_bytes = llc_size(&mc->llc_level);
    size_t dram = PROBE_BYTES;
    if (mc->llc_bytes > dram / PROBE_DRAM_OVER_LLC) dram = mc->llc_bytes * PROBE_DRAM_OVER_LLC;
    mc->gbps = probe_read(dram, 1, 1);
    mc->llc_gbps = mc->llc_bytes ? probe_llc(mc->llc_bytes) : 0;
    probe_compute(&mc->f32_gflops, &mc->i8_gops);
    fprintf(stderr, "machine: %d threads, DRAM read %.1f GB/s, f32 FMA %.0f GFLOP/s, int8 %.0f GOP/s", threads,
            mc->gbps, mc->f32_gflops, mc->i8_gops);
    if (mc->llc_bytes)
        fprintf(stderr, ", L%d cache (%.0f MiB) read %.1f GB/s\n", mc->llc_level, mc->llc_bytes / 1048576.0, mc->llc_gbps);
    else
        fprintf(stderr, ", last-level cache size unknown\n");
    return mc;
}

/* FLOPs to prefill n tokens after pos0 cached ones: 2 per weight per token
   (the output head once), plus attention, 4*q_dim per attended position. */
static double prefill_flops(const Model *m, int n, int pos0)
{
    const Config *c = &m->c;
    double head = 2.0 * c->vocab_size * c->dim, attended = (double)n * pos0 + (double)n * (n + 1) / 2;
    return 2.0 * (m->matmul_params - (double)c->vocab_size * c->dim) * n + head +
           4.0 * c->n_heads * c->head_dim * c->n_layers * attended;
}

/* Bytes decode reads per token at position pos: every weight, and the
   cached K and V rows of every layer. */
static double decode_bytes(const Model *m, const RunState *s, int pos)
{
    return m->weight_bytes + 2.0 * m->c.n_layers * m->c.n_kv_heads * (pos + 1) * s->kv_row;
}

static int by_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The -v lines of one request: speed, achieved GFLOP/s (prefill) and GB/s
   (decode), and with --probe the fraction of the machine's limit and which
   limit binds. */
static void report_stats(const Model *m, const RunState *s, const Machine *mc, Stats *st)
{
    double pre = st->prefill_ms, itl_sum = 0;
    int k = min_i(st->n_itl, st->n_gen > 1 ? st->n_gen - 1 : 0);
    for (int i = 0; i < k; i++) itl_sum += st->itl[i];
    qsort(st->itl, k, sizeof(double), by_double);
    double gflops = pre > 0 ? prefill_flops(m, st->n_prompt, st->pos0) / (pre / 1e3) / 1e9 : 0;
    double bytes = decode_bytes(m, s, st->pos0 + st->n_prompt + k / 2), itl = k ? itl_sum / k : 0;
    /* each forward pass reads the weights once, whatever number of tokens it yields (lookup decoding) */
    int passes = st->passes ? min_i(st->passes, k) : k;
    double gbps = k ? bytes * passes / (itl_sum / 1e3) / 1e9 : 0;
    fprintf(stderr, "prefill: %d tokens in %.1f ms, %.0f tok/s, TTFT %.1f ms, %.1f GFLOP/s\n",
            st->n_prompt, pre, pre > 0 ? st->n_prompt / (pre / 1e3) : 0.0, pre, gflops);
    fprintf(stderr, "decode: %d tokens, %.1f tok/s, ITL %.2f ms, p50 %.2f ms, p90 %.2f ms, %.1f GB/s\n", st->n_gen,
            k ? k / (itl_sum / 1e3) : 0.0, itl, k ? st->itl[(k - 1) / 2] : 0.0, k ? st->itl[(int)(0.9 * (k - 1))] : 0.0, gbps);
    if (st->json_walks)
        fprintf(stderr, "json: %ld allowed sets walked over the vocabulary (%.1f ms each), %ld taken from the cache\n",
                st->json_walks, st->json_walk_ms / st->json_walks, st->json_hits);
    if (st->drafted)
        fprintf(stderr, "lookup: %d drafted, %d accepted (%.0f%%), %.2f tokens per forward pass\n", st->drafted, st->accepted,
                100.0 * st->accepted / st->drafted, st->passes ? (double)st->n_gen / st->passes : 0.0);
    if (!mc) return;
    int int8 = matrix_act(&m->layers[0].w2) != ACT_F32;
    double peak = int8 ? mc->i8_gops : mc->f32_gflops;
    /* decode streams from the cache when a token's bytes stay in it from
       one token to the next, with room to spare for everything else */
    int cached = mc->llc_bytes && bytes <= LLC_STREAM_SHARE * mc->llc_bytes;
    double bw = cached ? mc->llc_gbps : mc->gbps;
    char level[MSG_BYTES] = "DRAM", note[MSG_BYTES] = "";
    if (cached) {
        snprintf(level, sizeof level, "L%d", mc->llc_level);
        snprintf(note, sizeof note, ": it fits in the %.0f MiB L%d, so decode streams from there and is not DRAM-bound",
                 mc->llc_bytes / 1048576.0, mc->llc_level);
    }
    fprintf(stderr, "roofline: prefill at %.0f%% of the %s peak (%.0f G/s); decode at %.0f%% of %s bandwidth "
            "(%.1f MB/token at %.1f GB/s%s); decode is %s-bound\n",
            100 * gflops / peak, int8 ? "int8" : "f32", peak, 100 * gbps / bw, level, bytes / 1e6, bw, note,
            bytes / (bw * 1e9) > 2 * m->matmul_params / (peak * 1e9) ? level : "compute");
}

/* A field in kB ("RssAnon:") of a /proc file of this process, or -1. */
static long proc_kb(const char *path, const char *field)
{
    FILE *f = fopen(path, "r");
    char line[256];
    long kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, field, strlen(field))) kb = atol(line + strlen(field));
    if (f) fclose(f);
    return kb;
}

/* Bytes of the model file's mapping that are in memory (mincore: its pages
   in the page cache, which every process mapping the file shares), or -1.
   /proc's RssFile would count every mapped file, the binary and libc too. */
static double model_resident_bytes(const Model *m)
{
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0) return -1;
    size_t n = (m->map_size + page - 1) / page, in = 0;
    unsigned char *vec = malloc(n);
    if (!vec || mincore((void *)m->map, m->map_size, vec) != 0) { free(vec); return -1; }
    for (size_t i = 0; i < n; i++) in += vec[i] & 1;
    free(vec);
    return fmin((double)in * page, (double)m->map_size); /* the last page is counted whole */
}

/* -v: the model, the context and its KV cache, the team and the kernels. */
static void report_model(const Model *m, const char *path, int seq_len, int kv_type, int keep_all, int threads, double load_ms)
{
    static const char *const arch[] = {"?", "llama", "qwen2", "qwen3", "gemma3"};
    fprintf(stderr, "model: %s, %s, %d layers, dim %d, %.1fM params, %s weights, ctx %d, KV cache %.1f MB (%s), %d threads, "
            "%s kernels, loaded in %.1f ms\n", path, arch[m->c.arch], m->c.n_layers, m->c.dim, m->n_params / 1e6, m->dtype,
            seq_len, kv_cache_bytes(&m->c, seq_len, kv_type, keep_all) / 1e6, type_name(kv_type), threads, kernel_set_name(), load_ms);
    if (m->c.window && !keep_all)
        fprintf(stderr, "sliding window: %d positions on local layers (ring buffers); KV cache %.1f MB instead of %.1f MB\n",
                m->c.window, kv_cache_bytes(&m->c, seq_len, kv_type, 0) / 1e6, kv_cache_bytes(&m->c, seq_len, kv_type, 1) / 1e6);
    else if (keep_all)
        fprintf(stderr, "sliding window: %d positions on local layers, which keep every position for --prompt-cache\n",
                m->c.window);
}

/* -v's last lines: how long loading took and when the first byte of text
   left (from the start of main, so what a script waiting on the output
   sees, but exec and the dynamic loader); and memory, split into what is
   private to this process (its heap and anonymous mappings: activations,
   the KV cache positions written) and what it maps from the model file
   (page cache that every process running the same file shares). */
static void report_process(const Model *m, double load_ms)
{
    fprintf(stderr, "time: loaded in %.1f ms", load_ms);
    if (marks.first_text_ms) fprintf(stderr, ", first byte of text %.1f ms after start", marks.first_text_ms - marks.start_ms);
    long anon = proc_kb("/proc/self/status", "RssAnon:"), peak = proc_kb("/proc/self/status", "VmHWM:");
    long huge = m->copied ? proc_kb("/proc/self/smaps_rollup", "AnonHugePages:") : -1; /* smaps_rollup walks every mapping */
    double file = model_resident_bytes(m);
    if (m->copied && anon >= 0 && huge >= 0)
        fprintf(stderr, "\nmemory: %.1f MB private (the model's %.1f MB copy, activations, KV cache; %.1f MB of it in huge "
                "pages), peak RSS %.1f MB", anon / 1024.0, m->map_size / 1048576.0, huge / 1024.0, peak / 1024.0);
    else if (anon >= 0 && file >= 0)
        fprintf(stderr, "\nmemory: %.1f MB private (activations, KV cache), %.1f MB of the %.1f MB model file resident "
                "(in the page cache, shared between processes), peak RSS %.1f MB", anon / 1024.0, file / 1048576.0,
                m->map_size / 1048576.0, peak / 1024.0);
    fputc('\n', stderr);
}

/* ----- JSON -------------------------------------------------------------------
   Reading and writing it (a record is written into a Buf, the growable
   byte string below). The JSON reader takes exactly
   RFC 8259 and nothing more (a script's input should mean one thing); the
   writer escapes any bytes into valid JSON and valid UTF-8. */

typedef struct Buf { char *p; size_t len, cap; } Buf; /* a growable byte string, NUL-terminated */

/* Room for n more bytes and the NUL. */
static void buf_reserve(Buf *b, size_t n)
{
    if (b->p && n < b->cap - b->len) return;
    if (n > SIZE_MAX / 4 - b->len) die(EXIT_RUNTIME, "out of memory");
    size_t cap = b->cap ? b->cap : 64;
    while (cap - b->len <= n) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) die(EXIT_RUNTIME, "out of memory");
    b->p = p, b->cap = cap;
}

static void buf_put(Buf *b, const char *s, size_t n)
{
    buf_reserve(b, n);
    if (n) memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void buf_printf(Buf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) die(EXIT_RUNTIME, "cannot format '%s'", fmt);
    buf_reserve(b, (size_t)n);
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

#define JSON_MAX_DEPTH 64  /* arrays/objects nested deeper are refused: the reader recurses */
#define JSON_QUOTE_MAX 40  /* bytes of a key or number quoted in an error */
#define JSON_EXACT_INT 9007199254740992.0 /* 2^53: integers below it print exactly without an exponent */
#define JSON_MEM_PER_BYTE 16 /* a parse may allocate this many bytes per byte of its text ... */
#ifndef JSON_MEM_BASE       /* tests/fuzz/fuzz_json.c lowers it, so that short inputs reach the bound */
#define JSON_MEM_BASE 65536  /* ... plus this much: any small document fits, a long one of tiny values does not */
#endif
#define JSON_ALLOC_COST 16   /* what malloc keeps beside each block it hands out, counted against the bound */
#define JSON_NUMBER_BYTES 64 /* a number this short is converted from a copy on the stack */

/* How many bytes at s[0..n) (n >= 1) follow the well-formed UTF-8 table
   (the Unicode standard's table 3-7: no overlong forms, no surrogates
   U+D800..DFFF, nothing above U+10FFFF); *need gets the length of the
   sequence s[0] begins (0: no sequence begins with it). The sequence is
   well-formed when the two agree; otherwise the bytes counted are its
   "maximal subpart", which the writer replaces by one U+FFFD. */
static int utf8_scan(const unsigned char *s, size_t n, int *need)
{
    unsigned c = s[0];
    *need = c < 0x80 ? 1 : c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
    if (*need <= 1) return *need;
    unsigned lo = c == 0xe0 ? 0xa0 : c == 0xf0 ? 0x90 : 0x80, hi = c == 0xed ? 0x9f : c == 0xf4 ? 0x8f : 0xbf;
    if (n < 2 || s[1] < lo || s[1] > hi) return 1;
    int k = 2;
    while (k < *need && (size_t)k < n && (s[k] & 0xc0) == 0x80) k++;
    return k;
}

/* The length (1-4) of the well-formed UTF-8 sequence at s[0..n), or 0. */
static int utf8_valid(const unsigned char *s, size_t n)
{
    int need, k = utf8_scan(s, n, &need);
    return k == need ? k : 0;
}

static void utf8_put(Buf *b, unsigned cp)
{
    char u[4];
    int n = cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
    static const unsigned char lead[] = {0, 0, 0xc0, 0xe0, 0xf0};
    for (int i = n - 1; i > 0; i--, cp >>= 6) u[i] = (char)(0x80 | (cp & 0x3f));
    u[0] = (char)(n == 1 ? cp : lead[n] | cp);
    buf_put(b, u, n);
}

/* The escape of one byte that JSON strings cannot hold as it is: the short
   forms where RFC 8259 has them, else \u00XX. */
static void json_put_escape(Buf *b, unsigned char c)
{
    static const char raw[] = "\"\\\b\f\n\r\t", esc[] = "\"\\bfnrt";
    const char *hit = c ? strchr(raw, c) : NULL;
    if (hit) buf_printf(b, "\\%c", esc[hit - raw]);
    else buf_printf(b, "\\u%04x", c);
}

/* s[0..n) as a JSON string, quotes included. Quote, backslash and control
   characters are escaped; DEL and all other well-formed UTF-8 are written
   as they are; ill-formed UTF-8 (a token may hold part of a character)
   becomes U+FFFD, one per maximal subpart as Unicode recommends (what
   Python's decode(errors="replace") gives). The output is valid JSON and
   valid UTF-8 whatever s holds. */
static void json_put_string(Buf *b, const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    buf_put(b, "\"", 1);
    for (size_t i = 0; i < n;) {
        size_t run = 0;
        while (i + run < n && p[i + run] >= 0x20 && p[i + run] < 0x80 && p[i + run] != '"' && p[i + run] != '\\') run++;
        if (run) { buf_put(b, s + i, run); i += run; continue; }
        int need, k = utf8_scan(p + i, n - i, &need);
        if (p[i] < 0x80) json_put_escape(b, p[i]);
        else if (need && k == need) buf_put(b, s + i, k);
        else buf_put(b, "\xef\xbf\xbd", 3);
        i += k ? k : 1;
    }
    buf_put(b, "\"", 1);
}

/* A finite double as a JSON number that reads back as the same double:
   integers below 2^53 as plain digits, anything else with %.17g. A
   non-finite one (which the sampling parameters' ranges are chosen to
   prevent) is null: JSON has no inf or NaN, and a record must stay valid
   JSON whatever it holds. */
static void json_put_number(Buf *b, double x)
{
    if (!isfinite(x)) buf_put(b, "null", 4);
    else if (x == floor(x) && fabs(x) < JSON_EXACT_INT) buf_printf(b, "%.0f", x);
    else buf_printf(b, "%.17g", x);
}

typedef enum { JSON_NULL, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT } JsonKind;

/* One value: 32 bytes, the fields of each kind sharing their place, so
   that a long array of small values costs as little as it can (read only
   the fields of v->kind). */
typedef struct Json {
    JsonKind kind;
    int n;                  /* ARRAY / OBJECT: element count (0 for the other kinds) */
    union {
        int boolean;        /* JSON_BOOL */
        double number;      /* JSON_NUMBER (its text in str/len, as written) */
        char **keys;        /* OBJECT: the keys, decoded, in document order */
    };
    union {
        char *str;          /* JSON_STRING: the decoded UTF-8 (may hold NUL bytes), NUL-terminated; JSON_NUMBER:
                               its text inside the parsed text (not a copy, not NUL-terminated) */
        struct Json *items; /* ARRAY: the elements; OBJECT: the values */
    };
    union {
        size_t len;         /* JSON_STRING, JSON_NUMBER: str's length */
        size_t *key_lens;   /* OBJECT: the keys' lengths */
    };
} Json;

/* The reader's position in text[0..len); err receives the first error;
   spent counts the bytes allocated, at most `budget`. */
typedef struct {
    const unsigned char *s;
    size_t len, at;
    char *err;
    size_t err_len;
    size_t spent, budget;
} JsonReader;

/* Records "at byte N: REASON" (N counts from 0) and returns -1. */
static int json_fail(JsonReader *r, const char *fmt, ...)
{
    char why[ERR_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    if (r->err_len) {
        snprintf(r->err, r->err_len, "at byte %zu: %s", r->at, why);
        one_line(r->err);
    }
    return -1;
}

/* "expected WHAT, found X": X the byte at the position, shown readably. */
static int json_unexpected(JsonReader *r, const char *what)
{
    if (r->at == r->len) return json_fail(r, "expected %s, found the end of the input", what);
    unsigned c = r->s[r->at];
    if (c > 0x20 && c < 0x7f) return json_fail(r, "expected %s, found '%c'", what, c);
    return json_fail(r, "expected %s, found byte 0x%02x%s", what, c, c ? "" : " (NUL)");
}

/* Counts n more bytes allocated for the tree: a text of many tiny values
   (`[0,0,...]`, 2 bytes each for a 32-byte node) is refused once it needs
   more than JSON_MEM_PER_BYTE bytes per byte, so that no line or file
   takes more memory than a small multiple of its size. */
static int json_charge(JsonReader *r, size_t n)
{
    if (n <= r->budget - r->spent) { r->spent += n; return 0; }
    return json_fail(r, "too many values for the length of the text: holding them takes more than %d bytes of memory "
                     "per byte of it", JSON_MEM_PER_BYTE);
}

static void json_space(JsonReader *r)
{
    for (int c; r->at < r->len && ((c = r->s[r->at]) == ' ' || c == '\t' || c == '\r' || c == '\n');) r->at++;
}

static int json_eat(JsonReader *r, char c)
{
    if (r->at == r->len || r->s[r->at] != (unsigned char)c) return 0;
    r->at++;
    return 1;
}

/* Four hex digits at s[at..at+4) as a number, or -1. */
static long json_hex4(const JsonReader *r, size_t at)
{
    long v = 0;
    if (at + 4 > r->len) return -1;
    for (size_t i = at; i < at + 4; i++) {
        int c = r->s[i], d = c >= '0' && c <= '9' ? c - '0' : (c | 0x20) >= 'a' && (c | 0x20) <= 'f' ? (c | 0x20) - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

/* A \uXXXX escape at r->at (UTF-16: a surrogate pair is one character, a
   surrogate alone is refused) appended to b as UTF-8. */
static int json_unicode_escape(JsonReader *r, Buf *b)
{
    long cp = json_hex4(r, r->at + 2), lo = -1;
    if (cp < 0) return json_fail(r, "\\u needs four hex digits");
    if (cp >= 0xdc00 && cp <= 0xdfff) return json_fail(r, "\\u%04lX is a lone low surrogate", cp);
    if (cp >= 0xd800 && cp <= 0xdbff) {
        if (r->at + 7 < r->len && r->s[r->at + 6] == '\\' && r->s[r->at + 7] == 'u') lo = json_hex4(r, r->at + 8);
        if (lo < 0xdc00 || lo > 0xdfff) return json_fail(r, "\\u%04lX is a high surrogate without a low one after it", cp);
        cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
        r->at += 6;
    }
    r->at += 6;
    utf8_put(b, (unsigned)cp);
    return 0;
}

/* A backslash escape at r->at, appended to b decoded. */
static int json_escape(JsonReader *r, Buf *b)
{
    static const char name[] = "\"\\/bfnrt", raw[] = "\"\\/\b\f\n\r\t";
    int c = r->at + 1 < r->len ? r->s[r->at + 1] : 0;
    const char *hit = c ? strchr(name, c) : NULL;
    if (hit) {
        buf_put(b, raw + (hit - name), 1);
        r->at += 2;
        return 0;
    }
    if (c == 'u') return json_unicode_escape(r, b);
    return json_fail(r, "invalid escape (RFC 8259 has \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)");
}

/* The characters of a string after its opening quote, up to and past the
   closing one, appended to b decoded. */
static int json_string_body(JsonReader *r, Buf *b)
{
    while (r->at < r->len) {
        const unsigned char *p = r->s + r->at;
        size_t run = 0;
        while (r->at + run < r->len && p[run] >= 0x20 && p[run] < 0x80 && p[run] != '"' && p[run] != '\\') run++;
        buf_put(b, (const char *)p, run);
        r->at += run;
        if (r->at == r->len) break;
        p += run;
        if (*p == '"') { r->at++; return 0; }
        if (*p == '\\') { if (json_escape(r, b) != 0) return -1; continue; }
        if (*p < 0x20) return json_fail(r, "control character 0x%02x in a string (write it as an escape)", *p);
        int k = utf8_valid(p, r->len - r->at);
        if (!k) return json_fail(r, "invalid UTF-8 in a string");
        buf_put(b, (const char *)p, k);
        r->at += k;
    }
    return json_fail(r, "unterminated string");
}

/* The string at r->at (its opening quote), decoded into a malloc'd
   NUL-terminated *out of *n bytes. Decoding never lengthens it (an escape
   is longer than what it stands for), so one block of its written length
   holds it. */
static int json_string(JsonReader *r, char **out, size_t *n)
{
    size_t end = r->at + 1;
    while (end < r->len && r->s[end] != '"') end += r->s[end] == '\\' ? 2 : 1;
    size_t room = (end < r->len ? end : r->len) - r->at; /* the written bytes after the quote, and the NUL */
    if (json_charge(r, room + JSON_ALLOC_COST) != 0) return -1;
    Buf b = {xmalloc(room), 0, room};
    b.p[0] = 0;
    r->at++;
    if (json_string_body(r, &b) != 0) { free(b.p); return -1; }
    *out = b.p, *n = b.len;
    return 0;
}

static int json_digits(JsonReader *r)
{
    size_t at = r->at;
    while (r->at < r->len && r->s[r->at] >= '0' && r->s[r->at] <= '9') r->at++;
    return r->at > at;
}

/* A number: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?, its value by
   strtod (correctly rounded; this program never changes the C locale).
   One beyond the double range is refused; one below it becomes 0. */
static int json_number(JsonReader *r, Json *v)
{
    size_t start = r->at;
    v->kind = JSON_NUMBER;
    json_eat(r, '-');
    if (json_eat(r, '0')) {
        if (r->at < r->len && r->s[r->at] >= '0' && r->s[r->at] <= '9') return json_fail(r, "leading zero in a number");
    } else if (!json_digits(r)) return json_unexpected(r, "a digit");
    if (json_eat(r, '.') && !json_digits(r)) return json_unexpected(r, "a digit after '.'");
    if (r->at < r->len && (r->s[r->at] | 0x20) == 'e') {
        r->at++;
        if (!json_eat(r, '+')) json_eat(r, '-');
        if (!json_digits(r)) return json_unexpected(r, "a digit in the exponent");
    }
    v->len = r->at - start;
    v->str = (char *)r->s + start;
    /* strtod wants a NUL after the digits, which the text need not have */
    char stack[JSON_NUMBER_BYTES], *copy = v->len < sizeof stack ? stack : xmalloc(v->len + 1);
    memcpy(copy, v->str, v->len);
    copy[v->len] = 0;
    v->number = strtod(copy, NULL);
    if (copy != stack) free(copy);
    if (isinf(v->number)) {
        r->at = start;
        return json_fail(r, "number %.*s is out of the range of a double", (int)(v->len < JSON_QUOTE_MAX ? v->len : JSON_QUOTE_MAX), v->str);
    }
    return 0;
}

static int json_value(JsonReader *r, Json *v, int depth);

typedef struct { const char *key; size_t len, at; } JsonKey; /* an object's key, for the duplicate check */

/* Makes room in an array or object for element v->n; *cap is its size.
   Doubling from 1 leaves a small container without slack. An object's
   member also needs the place of its key (json_object's ats, and the
   duplicate check's JsonKey), counted here too. */
static int json_grow(JsonReader *r, Json *v, int *cap)
{
    if (v->n < *cap) return 0;
    if (*cap > INT_MAX / 2) die(EXIT_RUNTIME, "out of memory");
    int more = *cap ? *cap : 1;
    size_t member = sizeof *v->items + (v->kind == JSON_OBJECT ? sizeof *v->keys + sizeof *v->key_lens + sizeof(size_t) + sizeof(JsonKey) : 0);
    if (json_charge(r, (size_t)more * member) != 0) return -1;
    *cap += more;
    v->items = realloc(v->items, *cap * sizeof *v->items);
    if (v->kind == JSON_OBJECT) {
        v->keys = realloc(v->keys, *cap * sizeof *v->keys);
        v->key_lens = realloc(v->key_lens, *cap * sizeof *v->key_lens);
        if (!v->keys || !v->key_lens) die(EXIT_RUNTIME, "out of memory");
    }
    if (!v->items) die(EXIT_RUNTIME, "out of memory");
    return 0;
}

/* '[' was read: the elements and the closing ']'. */
static int json_array(JsonReader *r, Json *v, int depth)
{
    json_space(r);
    if (json_eat(r, ']')) return 0;
    for (int cap = 0;;) {
        if (json_grow(r, v, &cap) != 0) return -1;
        v->items[v->n++] = (Json){0};
        if (json_value(r, &v->items[v->n - 1], depth) != 0) return -1;
        json_space(r);
        if (json_eat(r, ']')) return 0;
        if (!json_eat(r, ',')) return json_unexpected(r, "',' or ']' in an array");
    }
}

/* One object member: "key" : value, as element v->n; *key_at gets where
   the key starts. */
static int json_member(JsonReader *r, Json *v, int depth, size_t *key_at)
{
    json_space(r);
    *key_at = r->at;
    if (r->at == r->len || r->s[r->at] != '"') return json_unexpected(r, "a string (an object's key)");
    if (json_string(r, &v->keys[v->n], &v->key_lens[v->n]) != 0) return -1;
    v->items[v->n++] = (Json){0};
    json_space(r);
    if (!json_eat(r, ':')) return json_unexpected(r, "':' after an object's key");
    return json_value(r, &v->items[v->n - 1], depth);
}

static int by_key_then_place(const void *a, const void *b)
{
    const JsonKey *x = a, *y = b;
    int c = memcmp(x->key, y->key, x->len < y->len ? x->len : y->len);
    if (c) return c;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    return (x->at > y->at) - (x->at < y->at);
}

/* Refuses an object that names a key twice (RFC 8259 leaves the meaning
   open; readers disagree on which value wins, so this one takes neither).
   Sorting keeps it O(n log n) for objects with many keys; the error points
   at the first repeat in document order. ats[i]: where key i starts. */
static int json_unique_keys(JsonReader *r, const Json *v, const size_t *ats)
{
    JsonKey *k = xmalloc(v->n * sizeof *k);
    for (int i = 0; i < v->n; i++) k[i] = (JsonKey){v->keys[i], v->key_lens[i], ats[i]};
    qsort(k, v->n, sizeof *k, by_key_then_place);
    int dup = -1;
    for (int i = 1; i < v->n; i++)
        if (k[i].len == k[i - 1].len && !memcmp(k[i].key, k[i - 1].key, k[i].len) && (dup < 0 || k[i].at < k[dup].at)) dup = i;
    int rc = 0;
    if (dup >= 0) {
        r->at = k[dup].at;
        rc = json_fail(r, "duplicate key \"%.*s\" in an object", (int)(k[dup].len < JSON_QUOTE_MAX ? k[dup].len : JSON_QUOTE_MAX), k[dup].key);
    }
    free(k);
    return rc;
}

/* '{' was read: the members, the closing '}', then the keys' check. */
static int json_object(JsonReader *r, Json *v, int depth)
{
    size_t *ats = NULL;
    int rc = 0, cap = 0;
    json_space(r);
    if (!json_eat(r, '}'))
        for (;;) {
            if ((rc = json_grow(r, v, &cap)) != 0) break;
            if (!(ats = realloc(ats, cap * sizeof *ats))) die(EXIT_RUNTIME, "out of memory");
            if ((rc = json_member(r, v, depth, &ats[v->n])) != 0) break;
            json_space(r);
            if (json_eat(r, '}')) break;
            if (!json_eat(r, ',')) { rc = json_unexpected(r, "',' or '}' in an object"); break; }
        }
    if (rc == 0 && v->n > 1) rc = json_unique_keys(r, v, ats);
    free(ats);
    return rc;
}

static int json_literal(JsonReader *r, const char *word)
{
    size_t n = strlen(word);
    if (r->len - r->at < n || memcmp(r->s + r->at, word, n)) return 0;
    r->at += n;
    return 1;
}

/* One value at r->at (after optional whitespace) into v, which json_free
   can free whatever happens. depth: the arrays/objects around it. */
static int json_value(JsonReader *r, Json *v, int depth)
{
    json_space(r);
    int c = r->at < r->len ? r->s[r->at] : -1;
    if (c == '[' || c == '{') {
        if (depth == JSON_MAX_DEPTH) return json_fail(r, "arrays and objects nested more than %d deep", JSON_MAX_DEPTH);
        r->at++;
        v->kind = c == '[' ? JSON_ARRAY : JSON_OBJECT;
        return c == '[' ? json_array(r, v, depth + 1) : json_object(r, v, depth + 1);
    }
    if (c == '"') { v->kind = JSON_STRING; return json_string(r, &v->str, &v->len); }
    if (c == '-' || (c >= '0' && c <= '9')) return json_number(r, v);
    if (json_literal(r, "true")) { v->kind = JSON_BOOL; v->boolean = 1; return 0; }
    if (json_literal(r, "false")) { v->kind = JSON_BOOL; return 0; }
    if (json_literal(r, "null")) { v->kind = JSON_NULL; return 0; }
    return json_unexpected(r, "a value");
}

static void json_free(Json *v)
{
    if (v->kind == JSON_STRING) free(v->str);
    if (v->kind == JSON_ARRAY || v->kind == JSON_OBJECT) {
        for (int i = 0; i < v->n; i++) {
            json_free(&v->items[i]);
            if (v->kind == JSON_OBJECT) free(v->keys[i]);
        }
        free(v->items);
    }
    if (v->kind == JSON_OBJECT) free(v->keys), free(v->key_lens);
    *v = (Json){0};
}

/* Parses exactly one JSON value (RFC 8259, strict) from text[0..len); 0 on
   success, else -1 with a one-line reason in err ("at byte 17: ...") and
   *out empty. Strict: only space, tab, CR, LF around tokens; no comments,
   trailing commas, single quotes, leading zeros, '+', NaN or Infinity;
   strings of well-formed UTF-8 without raw control characters, only the
   RFC's escapes, surrogates only in pairs; numbers within the double
   range; no key twice in an object; at most JSON_MAX_DEPTH levels. The
   tree takes at most JSON_MEM_PER_BYTE bytes of memory per byte of text
   (and JSON_MEM_BASE): more values than that for the text's length are
   refused. A number's str points into text: keep text while *out is used. */
static int json_parse(const char *text, size_t len, Json *out, char *err, size_t err_len)
{
    size_t budget = len > (SIZE_MAX - JSON_MEM_BASE) / JSON_MEM_PER_BYTE ? SIZE_MAX : len * JSON_MEM_PER_BYTE + JSON_MEM_BASE;
    JsonReader r = {(const unsigned char *)text, len, 0, err, err_len, 0, budget};
    *out = (Json){0};
    int rc = json_value(&r, out, 0);
    if (rc == 0) {
        json_space(&r);
        if (r.at < r.len) rc = json_unexpected(&r, "the end of the input after the value");
    }
    if (rc != 0) json_free(out);
    return rc;
}

/* The value of key in an object, or NULL (absent, or obj not an object). */
static const Json *json_get(const Json *obj, const char *key)
{
    size_t n = strlen(key);
    if (!obj || obj->kind != JSON_OBJECT) return NULL;
    for (int i = 0; i < obj->n; i++)
        if (obj->key_lens[i] == n && !memcmp(obj->keys[i], key, n)) return &obj->items[i];
    return NULL;
}

/* ----- log-probabilities ----------------------------------------------------
   --logprobs N: instead of text, one JSON record per generated token, the
   token and the N most likely of the distribution it was drawn from (the
   sampler's report, section 4). A record is formatted into a Buf, so that
   the caller decides where it goes (stdout here, a batch record's array). */

#define LOGPROBS_MAX 20 /* --logprobs N: alternatives reported per token, at most */

typedef struct {
    int id;
    double logprob;
} TokenProb;

/* What one draw reports for --logprobs: the drawn token's log-probability
   and the `want` most likely tokens of the distribution it was drawn from,
   by falling probability (ties by id). That distribution is the one
   sampled: softmax(logits / T) over the tokens top-k, top-p and min-p keep,
   renormalized; a token they drop, or whose probability is 0 as a float,
   cannot be drawn and has no entry, so n may be below want. With -t 0 it
   is the full softmax at temperature 1. */
typedef struct Logprobs {
    int want;        /* alternatives asked for, 0..LOGPROBS_MAX */
    int n;           /* alternatives reported */
    double logprob;  /* of the token drawn */
    TokenProb top[LOGPROBS_MAX];
} Logprobs;


/* Adds a token to lp's top list if it is among the `want` most likely so
   far (ties: the one added first stays ahead). */
static void top_insert(Logprobs *lp, int id, double logprob)
{
    if (lp->n == lp->want && (lp->n == 0 || logprob <= lp->top[lp->n - 1].logprob)) return;
    int k = lp->n < lp->want ? lp->n++ : lp->n - 1; /* the free slot, or the least likely's */
    for (; k > 0 && lp->top[k - 1].logprob < logprob; k--) lp->top[k] = lp->top[k - 1];
    lp->top[k] = (TokenProb){id, logprob};
}

/* The report of a greedy pick: log-softmax of the logits at temperature 1,
   in double (logit - log-sum-exp). */
static void report_greedy(Logprobs *lp, const float *logits, int n, int chosen)
{
    double max = logits[chosen], sum = 0;
    for (int i = 0; i < n; i++) sum += exp((double)logits[i] - max);
    double lse = max + log(sum);
    lp->logprob = logits[chosen] - lse;
    lp->n = 0;
    for (int i = 0; i < n; i++) top_insert(lp, i, logits[i] - lse);
}

/* The report of a draw from cand[0..keep) (sampling_dist's order, the
   probabilities summing to total). */
static void report_kept(Logprobs *lp, const Candidate *cand, int keep, float total, int chosen)
{
    lp->n = 0;
    for (int i = 0; i < keep; i++) {
        int listed = lp->n < lp->want && cand[i].p > 0;
        if (!listed && cand[i].id != chosen) continue;
        double logprob = log((double)cand[i].p / total);
        if (listed) lp->top[lp->n++] = (TokenProb){cand[i].id, logprob};
        if (cand[i].id == chosen) lp->logprob = logprob;
    }
}


/* "id":ID,"text":"...","logprob":X: a token's bytes as the tokenizer gives
   them (a control token's text too; part of a character becomes U+FFFD). */
static void token_fields(Buf *b, const Model *m, int id, double logprob)
{
    size_t len;
    const char *piece = tok_piece(m->tok, id, &len);
    buf_printf(b, "\"id\":%d,\"text\":", id);
    json_put_string(b, piece ? piece : "", piece ? len : 0);
    buf_printf(b, ",\"logprob\":");
    json_put_number(b, logprob);
}

/* {"id":ID,"text":"...","logprob":X,"top":[{"id","text","logprob"}, ...]} */
static void logprobs_record(Buf *b, const Model *m, int token, const Logprobs *lp)
{
    buf_put(b, "{", 1);
    token_fields(b, m, token, lp->logprob);
    buf_printf(b, ",\"top\":[");
    for (int i = 0; i < lp->n; i++) {
        buf_put(b, i ? ",{" : "{", i ? 2 : 1);
        token_fields(b, m, lp->top[i].id, lp->top[i].logprob);
        buf_put(b, "}", 1);
    }
    buf_put(b, "]}", 2);
}

/* A record as one line of stdout. */
static void put_logprobs_line(const Model *m, int token, const Logprobs *lp)
{
    Buf b = {0};
    logprobs_record(&b, m, token, lp);
    buf_put(&b, "\n", 1);
    fwrite(b.p, 1, b.len, stdout);
    free(b.p);
    check_stdout();
}

/* ----- stop strings -------------------------------------------------------------
   --stop STR ends an answer just before the first occurrence of STR in the
   generated text (the bytes of the token pieces as they stream; control
   tokens are not text), and STR is never printed. The text is matched one
   byte at a time: the bytes that could still begin a stop string, i.e. the
   longest suffix of the text so far that is a proper prefix of one, are
   held back, and released as soon as a further byte shows they cannot. So
   "Question" streams at once with --stop "\n\n", and a held "\n" waits for
   one more byte only. An occurrence is found where it ends: the first to
   end wins, so the matcher never waits for a longer candidate (stops "bc"
   and "abcd" on "abcd" leave "a"); of several ending at the same byte the
   longest wins, as it starts first (stops "b" and "ab" on "ab" leave ""). */

#define STOP_MAX 16        /* --stop strings per request */
#define STOP_MAX_BYTES 256 /* bytes per stop string: the matcher's work per byte grows with its square */

typedef struct Stops {
    char text[STOP_MAX][STOP_MAX_BYTES]; /* unescaped, not NUL-terminated */
    int len[STOP_MAX];                   /* each >= 1 */
    int n;
} Stops;


/* One request's matcher state. */
typedef struct {
    const Stops *stops;
    char held[STOP_MAX_BYTES]; /* the text's longest suffix that is a proper prefix of a stop string */
    int n_held;
    int hit; /* 1 + the index of the stop string found; 0 while none */
} StopMatch;


/* Whether p[0..n) is a proper prefix of some stop string. */
static int stop_prefix(const Stops *st, const char *p, int n)
{
    for (int k = 0; k < st->n; k++)
        if (st->len[k] > n && !memcmp(st->text[k], p, n)) return 1;
    return 0;
}

/* Appends byte c to the text and copies into out (STOP_MAX_BYTES) the bytes
   it settles, returning their count: with no match, the held bytes that
   can no longer begin a stop string; with a match, the held bytes before
   it (m->hit is set; the match is dropped). Any occurrence ending at c
   starts inside held + c, since its part before c is a suffix of the text
   that is a proper prefix of a stop string, and held is the longest such. */
static int stop_step(StopMatch *m, char c, char *out)
{
    const Stops *st = m->stops;
    int best = -1, n;
    m->held[m->n_held++] = c;
    for (int k = 0; k < st->n; k++)
        if (st->len[k] <= m->n_held && !memcmp(m->held + m->n_held - st->len[k], st->text[k], st->len[k]) &&
            (best < 0 || st->len[k] > st->len[best]))
            best = k;
    if (best >= 0) {
        m->hit = best + 1;
        n = m->n_held - st->len[best];
        memcpy(out, m->held, n);
        m->n_held = 0;
        return n;
    }
    for (n = 0; n < m->n_held && !stop_prefix(st, m->held + n, m->n_held - n); n++) {}
    memcpy(out, m->held, n);
    memmove(m->held, m->held + n, m->n_held - n);
    m->n_held -= n;
    return n;
}

/* A token's text through the matcher (none: straight) into out; returns 1
   once a stop string has ended the answer (later text is ignored). */
static int stop_put(StopMatch *m, TextOut *out, const char *p, size_t n)
{
    char settled[STOP_MAX_BYTES];
    if (!m->stops) text_put(out, p, n);
    else for (size_t i = 0; i < n && !m->hit; i++) text_put(out, settled, stop_step(m, p[i], settled));
    text_flush(out);
    return m->hit != 0;
}

/* At the end of the answer: held bytes that began no stop string are
   written as they are. */
static void stop_end(StopMatch *m, TextOut *out)
{
    if (m->stops && !m->hit) text_put(out, m->held, m->n_held);
    m->n_held = 0;
}

/* ----- constrained output: JSON ---------------------------------------------
   --json and --json-schema make the output exactly one JSON value (RFC
   8259), by construction: before each token is sampled, every token whose
   bytes would turn the output so far into something no JSON value (no
   value the schema allows) begins with gets probability zero.

   The recognizer is a pushdown automaton over bytes. Its state (JsonState)
   is a small plain struct: what is being read (mode), the lexer's place
   inside a string, number or fixed text, and a stack of open containers
   bounded by JSON_GEN_DEPTH. Copying it is cheap, so trying a token means
   feeding its bytes to a copy. A schema compiles into the same automaton
   (JsonGrammar: one JsonNode per schema, the plain --json value being the
   node that allows anything), and every state it can reach has a
   completion: a prefix it accepts can always be finished into a value the
   schema allows, so the sampler never meets a step where nothing is
   allowed.

   Beyond RFC 8259, three bounds keep a model from running on forever with
   bytes that change nothing: at most JSON_MAX_WS whitespace bytes in a
   row, of them at most one line break, "\n" or "\r\n" (a carriage return
   only before a line feed), between tokens and before the value: room for
   indented output, none for blank lines or runs of "\r"; no whitespace at
   all after the value (once complete, generation ends), and numbers of at
   most JSON_MAX_NUMBER bytes. Strings must be valid UTF-8 (no overlong forms,
   no surrogates, nothing past U+10FFFF), and a \u escape of a surrogate
   must be a high one followed by a low one.

   Masking a step: the vocabulary's token texts form a trie (VocabTrie,
   built once: tokens sharing a prefix share its bytes), walked depth first
   from the current state, a whole subtree skipped at its first invalid
   byte. Text inside a string, where almost every token is allowed, is
   where the walk is longest; there the state repeats from token to token,
   and a cache of JSON_CACHE_SLOTS allowed sets keeps them, one slot per
   state's hash. */

#define JSON_GEN_DEPTH 32     /* nested arrays and objects in the output */
#define JSON_MAX_WS 16        /* whitespace bytes in a row: enough for indented output */
#define JSON_MAX_NUMBER 40    /* bytes of one number */
#define JSON_MAX_PROPS 64     /* properties of one schema object (a bit each in JsonFrame.seen) */
#define JSON_CACHE_SLOTS 16   /* remembered allowed sets */
#define JSON_NO_LIMIT (-1)    /* maxItems / maxLength absent */

/* The kinds a schema's "type" allows, a bit each. */
enum { JT_NULL = 1, JT_BOOLEAN = 2, JT_NUMBER = 4, JT_INTEGER = 8, JT_STRING = 16, JT_ARRAY = 32, JT_OBJECT = 64, JT_ANY = 127 };

/* A set of texts a value must be exactly one of (enum, const, true/false/
   null, an object's declared keys with their quotes): texts[first ..
   first + n) of the grammar, sorted bytewise, so that the texts sharing a
   prefix are a contiguous range. */
typedef struct {
    char *s;
    int len;
    int prop; /* a key: the property's index in its object; else -1 */
} JsonText;

typedef struct {
    int first, n;
} JsonSet;

/* One compiled schema (node 0: anything). */
typedef struct {
    unsigned types;            /* JT_* bits */
    int set;                   /* enum/const: the set of allowed texts (then types is unused), else -1 */
    int items;                 /* array: the node of every item */
    int min_items, max_items;  /* max JSON_NO_LIMIT: none */
    int min_len, max_len;      /* string length in characters (code points) */
    int keys;                  /* object: the set of declared keys, else -1 */
    int n_props, props;        /* object: the nodes of the declared properties are prop_node[props .. props + n_props) */
    uint64_t required;         /* object: bit i: property i must appear */
    int additional;            /* object: keys other than the declared ones are allowed, with any value */
} JsonNode;

typedef struct {
    JsonNode *nodes;
    int n_nodes;
    int *prop_node;
    int n_prop_nodes;
    JsonText *texts;
    int n_texts;
    JsonSet *sets;
    int n_sets;
    int lit_bool, lit_null, lit_both; /* the sets {false, true}, {null}, {false, null, true} */
} JsonGrammar;

/* What the automaton reads next. */
enum {
    JM_VALUE,       /* a value of schema node `node` (whitespace first is allowed) */
    JM_ARRAY_OPEN,  /* after '[': the first item or ']' */
    JM_OBJECT_OPEN, /* after '{': the first key or '}' */
    JM_KEY_NEXT,    /* after ',' in an object: a key */
    JM_KEY,         /* inside a key */
    JM_COLON,       /* after a key; node: the value's schema */
    JM_AFTER,       /* after an item or a member: ',' or the close */
    JM_STRING,      /* inside a string value */
    JM_NUMBER,
    JM_MATCH,       /* inside a fixed text: a literal, an enum or const value */
    JM_DONE         /* the value is complete: nothing may follow */
};

/* Inside a string: the byte expected next. S_HEX+k / S_LOW+k: k hex
   digits of a \u escape read (S_LOW: the low half of a surrogate pair). */
enum { S_BODY, S_ESC, S_LOW_BACKSLASH, S_LOW_U, S_HEX = 8, S_LOW = 16 };

/* Inside a number: what has been read (N_ZERO, N_INT, N_FRAC and N_EXP may end it). */
enum { N_MINUS, N_ZERO, N_INT, N_DOT, N_FRAC, N_EXP_MARK, N_EXP_SIGN, N_EXP };

typedef struct {
    uint64_t seen;   /* object: declared properties read so far (bit i) */
    uint16_t node;   /* the container's schema node */
    uint16_t count;  /* array: items read so far */
    uint8_t object;  /* 1: an object, 0: an array */
} JsonFrame;

/* The automaton's state. Everything a mode does not use stays zero, so
   that equal situations are equal bytes (the allowed-set cache compares
   them); only the first `depth` frames are in use. */
typedef struct {
    uint8_t mode, sub;     /* JM_*; S_* or N_* inside a string or number */
    uint8_t ws, lf;        /* whitespace bytes in a row; lf: 1 after their line break, 2 after a '\r' (a '\n' must follow) */
    uint8_t depth;         /* open containers */
    uint8_t u8_left;       /* UTF-8: continuation bytes still due ... */
    uint8_t u8_lo, u8_hi;  /* ... and the range of the next one */
    uint8_t key_free;      /* JM_KEY: the key may still be one not declared */
    uint16_t node;         /* the schema node of the value being read */
    uint16_t hex;          /* a \u escape's digits so far */
    uint16_t lo, hi, off;  /* JM_MATCH, JM_KEY: texts[lo .. hi) still match, their first off bytes read */
    uint32_t count;        /* JM_STRING: characters (with a length bound only); JM_NUMBER: bytes */
    JsonFrame frames[JSON_GEN_DEPTH];
} JsonState;

#define JSON_STATE_HEAD offsetof(JsonState, frames)

/* The bytes of s in use: what a copy or a comparison needs. */
static size_t json_state_size(const JsonState *s) { return JSON_STATE_HEAD + s->depth * sizeof(JsonFrame); }

static int json_is_ws(unsigned c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
static int json_is_digit(unsigned c) { return c >= '0' && c <= '9'; }
static int json_hex_value(unsigned c)
{
    return json_is_digit(c) ? (int)c - '0' : c >= 'a' && c <= 'f' ? (int)c - 'a' + 10 : c >= 'A' && c <= 'F' ? (int)c - 'A' + 10 : -1;
}

/* The state before the first byte of a value of schema node root. */
static void json_start(JsonState *s, int root)
{
    memset(s, 0, sizeof *s);
    s->mode = JM_VALUE;
    s->node = (uint16_t)root;
}

/* Enters mode `mode` with the lexer's fields cleared. */
static void json_enter(JsonState *s, int mode, int node)
{
    s->mode = (uint8_t)mode;
    s->node = (uint16_t)node;
    s->sub = s->ws = s->lf = s->u8_left = s->u8_lo = s->u8_hi = s->key_free = 0;
    s->hex = s->lo = s->hi = s->off = 0;
    s->count = 0;
}

/* A whitespace byte c where whitespace may stand. */
static int json_ws(JsonState *s, unsigned c)
{
    if (s->ws >= JSON_MAX_WS) return 0;
    if (c == '\n') {
        if (s->lf == 1) return 0;
        s->lf = 1;
    } else if (c == '\r') {
        if (s->lf || s->ws + 2 > JSON_MAX_WS) return 0; /* room for its '\n' */
        s->lf = 2;
    } else if (s->lf == 2) {
        return 0;
    }
    s->ws++;
    return 1;
}

/* A value has been read: the top-level one completes the output, an item
   or member returns to its container. */
static void json_value_done(const JsonGrammar *g, JsonState *s)
{
    if (!s->depth) { json_enter(s, JM_DONE, 0); return; }
    JsonFrame *f = &s->frames[s->depth - 1];
    const JsonNode *n = &g->nodes[f->node];
    /* items are counted only against a bound: unbounded arrays keep their
       state, and their allowed sets stay in the cache */
    if (!f->object && (n->min_items > 0 || n->max_items != JSON_NO_LIMIT)) f->count++;
    json_enter(s, JM_AFTER, f->node);
}

/* Whether the object of frame f may take one more member: a key not
   declared, or a declared one not yet read. */
static int json_more_keys(const JsonGrammar *g, const JsonFrame *f)
{
    const JsonNode *n = &g->nodes[f->node];
    return n->additional || f->seen != (n->n_props == 64 ? ~0ull : (1ull << n->n_props) - 1);
}

/* Opens an array or object of node n. */
static int json_open(JsonState *s, int node, int object)
{
    if (s->depth == JSON_GEN_DEPTH) return 0;
    s->frames[s->depth++] = (JsonFrame){0, (uint16_t)node, 0, (uint8_t)object};
    json_enter(s, object ? JM_OBJECT_OPEN : JM_ARRAY_OPEN, node);
    return 1;
}

/* ']' or '}' closing the top frame, where its counts allow. */
static int json_close(const JsonGrammar *g, JsonState *s, unsigned c)
{
    JsonFrame *f = &s->frames[s->depth - 1];
    const JsonNode *n = &g->nodes[f->node];
    if (c != (f->object ? '}' : ']')) return 0;
    if (f->object ? (f->seen & n->required) != n->required : f->count < n->min_items) return 0;
    memset(f, 0, sizeof *f);
    s->depth--;
    json_value_done(g, s);
    return 1;
}

/* Narrows the texts still matching to those whose next byte is c.
   Returns 0 when none is. */
static int json_match_byte(const JsonGrammar *g, JsonState *s, unsigned c)
{
    int lo = s->lo, hi = s->hi, off = s->off;
    while (lo < hi && (g->texts[lo].len <= off || (unsigned char)g->texts[lo].s[off] != c)) lo++;
    if (lo == hi) return 0;
    int end = lo;
    while (end < hi && g->texts[end].len > off && (unsigned char)g->texts[end].s[off] == c) end++;
    s->lo = (uint16_t)lo, s->hi = (uint16_t)end, s->off = (uint16_t)(off + 1);
    return 1;
}

/* Whether one of the matching texts has been read whole (sorted, it is the first). */
static int json_match_whole(const JsonGrammar *g, const JsonState *s) { return s->lo < s->hi && g->texts[s->lo].len == s->off; }

/* Starts matching the texts of set `set`. */
static void json_match_start(const JsonGrammar *g, JsonState *s, int set)
{
    s->lo = (uint16_t)g->sets[set].first;
    s->hi = (uint16_t)(g->sets[set].first + g->sets[set].n);
    s->off = 0;
}

/* A byte of a fixed text (JM_MATCH). A text read whole ends the value at
   once when no longer one continues it, else at the first byte that does
   not (returned as 2: the caller feeds that byte to what follows). */
static int json_match_value_byte(const JsonGrammar *g, JsonState *s, unsigned c)
{
    if (!json_match_byte(g, s, c)) return json_match_whole(g, s) ? 2 : 0;
    if (json_match_whole(g, s) && s->hi - s->lo == 1) json_value_done(g, s);
    return 1;
}

/* A byte inside a string, the closing quote excepted (the caller handles
   it in S_BODY). Counts characters in s->count when `count`; at max
   (>= 0) no more may start. With no_escape a backslash is refused. */
static int json_string_byte(JsonState *s, unsigned c, int count, int max, int no_escape)
{
    if (s->u8_left) {
        if (c < s->u8_lo || c > s->u8_hi) return 0;
        s->u8_left--;
        s->u8_lo = s->u8_left ? 0x80 : 0, s->u8_hi = s->u8_left ? 0xbf : 0;
        return 1;
    }
    int d = json_hex_value(c);
    switch (s->sub) {
    case S_BODY:
        if (c < 0x20 || (c == '\\' && no_escape)) return 0;
        if (max >= 0 && s->count >= (uint32_t)max) return 0;
        if (c >= 0x80) {
            /* the lead byte fixes how many continuation bytes follow and the
               range of the first, which rules out overlong forms,
               surrogates and code points past U+10FFFF (RFC 3629) */
            if (c >= 0xc2 && c <= 0xdf) s->u8_left = 1, s->u8_lo = 0x80, s->u8_hi = 0xbf;
            else if (c >= 0xe0 && c <= 0xef) s->u8_left = 2, s->u8_lo = c == 0xe0 ? 0xa0 : 0x80, s->u8_hi = c == 0xed ? 0x9f : 0xbf;
            else if (c >= 0xf0 && c <= 0xf4) s->u8_left = 3, s->u8_lo = c == 0xf0 ? 0x90 : 0x80, s->u8_hi = c == 0xf4 ? 0x8f : 0xbf;
            else return 0;
        }
        if (c == '\\') s->sub = S_ESC;
        if (count) s->count++;
        return 1;
    case S_ESC:
        if (c == 'u') { s->sub = S_HEX; return 1; }
        if (!strchr("\"\\/bfnrt", (int)c) || !c) return 0;
        s->sub = S_BODY;
        return 1;
    case S_LOW_BACKSLASH:
        if (c != '\\') return 0;
        s->sub = S_LOW_U;
        return 1;
    case S_LOW_U:
        if (c != 'u') return 0;
        s->sub = S_LOW;
        return 1;
    default: { /* S_HEX + k, S_LOW + k: the (k+1)th hex digit */
        int low = s->sub >= S_LOW, k = s->sub - (low ? S_LOW : S_HEX);
        if (d < 0) return 0;
        unsigned v = (unsigned)s->hex << 4 | (unsigned)d;
        /* a surrogate's first two digits decide its half: DC-DF is a low
           half, which may only follow a high one, D8-DB a high half */
        if (k == 1 && (v >> 4) == 0xd && (v & 0xf) >= 0xc && !low) return 0;
        if (low && ((k == 0 && v != 0xd) || (k == 1 && (v & 0xf) < 0xc))) return 0;
        s->hex = (uint16_t)v;
        if (k < 3) { s->sub++; return 1; }
        s->sub = !low && v >= 0xd800 && v <= 0xdbff ? S_LOW_BACKSLASH : S_BODY;
        s->hex = 0;
        return 1;
    }
    }
}

/* A byte of a number; 2: the number ended before it (the caller feeds the
   byte to what follows). The schema's integer type forbids the fraction
   and the exponent. */
static int json_number_byte(const JsonGrammar *g, JsonState *s, unsigned c)
{
    int integer = g->nodes[s->node].set < 0 && !(g->nodes[s->node].types & JT_NUMBER);
    int digit = json_is_digit(c), next = -1, sub = s->sub;
    switch (sub) {
    case N_MINUS: next = c == '0' ? N_ZERO : digit ? N_INT : -1; break;
    case N_ZERO: next = c == '.' && !integer ? N_DOT : (c == 'e' || c == 'E') && !integer ? N_EXP_MARK : -1; break;
    case N_INT: next = digit ? N_INT : c == '.' && !integer ? N_DOT : (c == 'e' || c == 'E') && !integer ? N_EXP_MARK : -1; break;
    case N_DOT: next = digit ? N_FRAC : -1; break;
    case N_FRAC: next = digit ? N_FRAC : c == 'e' || c == 'E' ? N_EXP_MARK : -1; break;
    case N_EXP_MARK: next = c == '+' || c == '-' ? N_EXP_SIGN : digit ? N_EXP : -1; break;
    case N_EXP_SIGN: case N_EXP: next = digit ? N_EXP : -1; break;
    }
    int can_end = sub == N_ZERO || sub == N_INT || sub == N_FRAC || sub == N_EXP;
    int next_ends = next == N_ZERO || next == N_INT || next == N_FRAC || next == N_EXP;
    if (next < 0) return can_end ? 2 : 0;
    /* the last byte the bound allows must leave a whole number (every
       state that cannot end becomes one that can with one more digit) */
    if (s->count + 1 == JSON_MAX_NUMBER && !next_ends) return 0;
    s->sub = (uint8_t)next;
    if (++s->count == JSON_MAX_NUMBER) json_value_done(g, s);
    return 1;
}

/* The first byte of a value of node n (not whitespace). */
static int json_value_start(const JsonGrammar *g, JsonState *s, unsigned c)
{
    int node = s->node;
    const JsonNode *n = &g->nodes[node];
    json_enter(s, JM_MATCH, node);
    if (n->set >= 0) {
        json_match_start(g, s, n->set);
        return json_match_value_byte(g, s, c) == 1;
    }
    unsigned t = n->types;
    if (c == '{' && (t & JT_OBJECT)) return json_open(s, node, 1);
    if (c == '[' && (t & JT_ARRAY)) return json_open(s, node, 0);
    if (c == '"' && (t & JT_STRING)) { s->mode = JM_STRING; return 1; }
    if ((c == '-' || json_is_digit(c)) && (t & (JT_NUMBER | JT_INTEGER))) {
        s->mode = JM_NUMBER;
        s->sub = N_MINUS; /* after a '-' a digit must follow, as at the start */
        if (c == '-') { s->count = 1; return 1; }
        return json_number_byte(g, s, c) == 1;
    }
    int lits = (t & JT_BOOLEAN) && (t & JT_NULL) ? g->lit_both : (t & JT_BOOLEAN) ? g->lit_bool : (t & JT_NULL) ? g->lit_null : -1;
    if (lits < 0) return 0;
    json_match_start(g, s, lits);
    return json_match_value_byte(g, s, c) == 1;
}

/* The opening quote of a key in the object of the top frame: its bytes are
   matched against the declared keys' texts, and, where other keys are
   allowed, read as any string without escapes (so that a key is a
   declared one exactly when its text is that key's text). */
static int json_key_start(const JsonGrammar *g, JsonState *s)
{
    const JsonNode *n = &g->nodes[s->frames[s->depth - 1].node];
    json_enter(s, JM_KEY, s->node);
    s->key_free = (uint8_t)n->additional;
    if (n->keys >= 0) {
        json_match_start(g, s, n->keys);
        if (!json_match_byte(g, s, '"')) s->lo = s->hi = 0;
    }
    return s->key_free || s->lo < s->hi;
}

/* Whether a declared key not yet read is among the matching texts. */
static int json_key_unseen(const JsonGrammar *g, const JsonState *s)
{
    uint64_t seen = s->frames[s->depth - 1].seen;
    for (int i = s->lo; i < s->hi; i++)
        if (!(seen >> g->texts[i].prop & 1)) return 1;
    return 0;
}

/* A byte of a key. The closing quote decides: a declared key's text read
   whole is that key (once only), anything else is another key. */
static int json_key_byte(const JsonGrammar *g, JsonState *s, unsigned c)
{
    JsonFrame *f = &s->frames[s->depth - 1];
    const JsonNode *n = &g->nodes[f->node];
    int free_ok = s->key_free, declared = n->keys >= 0;
    int closing = free_ok && c == '"' && s->sub == S_BODY && !s->u8_left;
    if (s->lo < s->hi && !json_match_byte(g, s, c)) s->lo = s->hi = 0;
    if (closing || (!free_ok && json_match_whole(g, s))) {
        int value_node = 0; /* another key: any value */
        if (json_match_whole(g, s)) {
            int p = g->texts[s->lo].prop;
            if (f->seen >> p & 1) return 0;
            f->seen |= 1ull << p;
            value_node = g->prop_node[n->props + p];
        } else if (!free_ok) {
            return 0;
        }
        json_enter(s, JM_COLON, value_node);
        return 1;
    }
    if (free_ok && !json_string_byte(s, c, 0, JSON_NO_LIMIT, declared)) s->key_free = free_ok = 0;
    return free_ok || (s->lo < s->hi && json_key_unseen(g, s));
}

/* Feeds one byte. Returns 1 if the output so far is still a prefix of a
   value the grammar allows, 0 if not (then s is unusable). */
static int json_feed(const JsonGrammar *g, JsonState *s, unsigned c)
{
    if (!json_is_ws(c) && s->mode != JM_STRING && s->mode != JM_KEY) {
        if (s->lf == 2) return 0; /* a '\r' not followed by '\n' */
        s->ws = s->lf = 0;
    }
    for (;;) {
        int r;
        switch (s->mode) {
        case JM_VALUE:
            return json_is_ws(c) ? json_ws(s, c) : json_value_start(g, s, c);
        case JM_ARRAY_OPEN:
            if (json_is_ws(c)) return json_ws(s, c);
            if (c == ']') return json_close(g, s, c);
            if (g->nodes[s->node].max_items == 0) return 0;
            json_enter(s, JM_VALUE, g->nodes[s->node].items);
            continue;
        case JM_OBJECT_OPEN:
        case JM_KEY_NEXT:
            if (json_is_ws(c)) return json_ws(s, c);
            if (c == '"') return json_key_start(g, s);
            return s->mode == JM_OBJECT_OPEN && json_close(g, s, c);
        case JM_KEY:
            return json_key_byte(g, s, c);
        case JM_COLON:
            if (json_is_ws(c)) return json_ws(s, c);
            if (c != ':') return 0;
            s->mode = JM_VALUE;
            return 1;
        case JM_AFTER: {
            if (json_is_ws(c)) return json_ws(s, c);
            JsonFrame *f = &s->frames[s->depth - 1];
            const JsonNode *n = &g->nodes[f->node];
            if (c != ',') return json_close(g, s, c);
            if (f->object) {
                if (!json_more_keys(g, f)) return 0;
                json_enter(s, JM_KEY_NEXT, f->node);
            } else {
                if (n->max_items != JSON_NO_LIMIT && f->count >= n->max_items) return 0;
                json_enter(s, JM_VALUE, n->items);
            }
            return 1;
        }
        case JM_STRING: {
            const JsonNode *n = &g->nodes[s->node];
            int count = n->min_len > 0 || n->max_len != JSON_NO_LIMIT;
            if (c == '"' && s->sub == S_BODY && !s->u8_left) {
                if (count && s->count < (uint32_t)n->min_len) return 0;
                json_value_done(g, s);
                return 1;
            }
            return json_string_byte(s, c, count, n->max_len, 0);
        }
        case JM_NUMBER:
            if ((r = json_number_byte(g, s, c)) != 2) return r;
            json_value_done(g, s);
            continue;
        case JM_MATCH:
            if ((r = json_match_value_byte(g, s, c)) != 2) return r;
            json_value_done(g, s);
            continue;
        default: /* JM_DONE */
            return 0;
        }
    }
}

/* Whether the bytes fed so far are a whole value: read to its end, or a
   top-level number or fixed text that may end here (the end of generation
   ends it). */
static int json_complete(const JsonGrammar *g, const JsonState *s)
{
    if (s->mode == JM_DONE) return 1;
    if (s->depth) return 0;
    if (s->mode == JM_NUMBER) return s->sub == N_ZERO || s->sub == N_INT || s->sub == N_FRAC || s->sub == N_EXP;
    return s->mode == JM_MATCH && json_match_whole(g, s);
}

/* Feeds n bytes; 0 at the first one refused. */
static int json_feed_all(const JsonGrammar *g, JsonState *s, const char *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!json_feed(g, s, (unsigned char)p[i])) return 0;
    return 1;
}

/* ----- the grammar's tables -------------------------------------------- */

static int json_add_node(JsonGrammar *g, unsigned types)
{
    g->nodes = realloc(g->nodes, (g->n_nodes + 1) * sizeof *g->nodes);
    if (!g->nodes) die(EXIT_RUNTIME, "out of memory");
    g->nodes[g->n_nodes] = (JsonNode){.types = types, .set = -1, .items = 0, .max_items = JSON_NO_LIMIT,
                                      .max_len = JSON_NO_LIMIT, .keys = -1, .additional = 1};
    return g->n_nodes++;
}

static int by_text(const void *a, const void *b)
{
    const JsonText *x = a, *y = b;
    int c = memcmp(x->s, y->s, x->len < y->len ? x->len : y->len);
    return c ? c : x->len - y->len;
}

/* Appends text[0..len) to the set being built (the last one), with its
   property index (-1: not a key). */
static void json_add_text(JsonGrammar *g, const char *text, int len, int prop)
{
    g->texts = realloc(g->texts, (g->n_texts + 1) * sizeof *g->texts);
    if (!g->texts) die(EXIT_RUNTIME, "out of memory");
    char *s = xmalloc(len + 1);
    memcpy(s, text, len);
    s[len] = 0;
    g->texts[g->n_texts++] = (JsonText){s, len, prop};
    g->sets[g->n_sets - 1].n++;
}

/* Opens a new, empty set of texts; json_add_text fills it, json_end_set sorts it. */
static int json_begin_set(JsonGrammar *g)
{
    g->sets = realloc(g->sets, (g->n_sets + 1) * sizeof *g->sets);
    if (!g->sets) die(EXIT_RUNTIME, "out of memory");
    g->sets[g->n_sets] = (JsonSet){g->n_texts, 0};
    return g->n_sets++;
}

/* Sorts the last set and drops repeated texts (enum [1, 1] is one text). */
static void json_end_set(JsonGrammar *g)
{
    JsonSet *set = &g->sets[g->n_sets - 1];
    JsonText *t = g->texts + set->first;
    qsort(t, set->n, sizeof *t, by_text);
    int k = 0;
    for (int i = 0; i < set->n; i++) {
        if (k && !by_text(&t[k - 1], &t[i])) { free(t[i].s); continue; }
        t[k++] = t[i];
    }
    g->n_texts -= set->n - k;
    set->n = k;
}

/* A set of the n texts in list. */
static int json_literal_set(JsonGrammar *g, const char *const *list, int n)
{
    int set = json_begin_set(g);
    for (int i = 0; i < n; i++) json_add_text(g, list[i], (int)strlen(list[i]), -1);
    json_end_set(g);
    return set;
}

/* The grammar of --json: node 0 allows any value (schemas add nodes). */
static void json_grammar_init(JsonGrammar *g)
{
    memset(g, 0, sizeof *g);
    json_add_node(g, JT_ANY);
    g->lit_bool = json_literal_set(g, (const char *const[]){"false", "true"}, 2);
    g->lit_null = json_literal_set(g, (const char *const[]){"null"}, 1);
    g->lit_both = json_literal_set(g, (const char *const[]){"false", "null", "true"}, 3);
}

static void json_grammar_free(JsonGrammar *g)
{
    for (int i = 0; i < g->n_texts; i++) free(g->texts[i].s);
    free(g->texts);
    free(g->sets);
    free(g->nodes);
    free(g->prop_node);
    memset(g, 0, sizeof *g);
}

/* ----- masking the vocabulary ------------------------------------------ */

/* The texts of the tokens that may stand inside a value (not control
   tokens, not empty) as a trie in depth-first order: node i is one byte at
   depth depth[i] (1: a token's first byte), its subtree is nodes i+1 ..
   end[i]-1, and tok[i] is a token whose text ends there (-1: none; tokens
   with the same text are chained by next_tok). */
typedef struct {
    int n, max_depth;
    uint8_t *byte;
    int *depth, *end, *tok;
    int *next_tok; /* [vocab] */
    int *order;    /* the tokens in trie order: node i's subtree holds order[first[i] .. first[end[i]]) */
    int *first;    /* [n + 1] */
    uint8_t *text; /* 1: every token of node i's subtree is string text (see json_walk) */
    int *eog;      /* the end-of-generation tokens: allowed once the value is complete */
    int n_eog;
} VocabTrie;

/* A token's text, for sorting the vocabulary. */
typedef struct {
    const char *p;
    size_t len;
    int id;
} Piece;

static int by_piece(const void *a, const void *b)
{
    const Piece *x = a, *y = b;
    int c = memcmp(x->p, y->p, x->len < y->len ? x->len : y->len);
    return c ? c : (x->len > y->len) - (x->len < y->len);
}

/* Whether a token's bytes, read inside a string (a value of any string,
   between characters), leave it inside the string between characters:
   then it is allowed at every such place, whatever surrounds the string. */
static int is_string_text(const char *p, size_t len)
{
    JsonGrammar g = {0};
    JsonNode any = {.types = JT_ANY, .set = -1, .max_items = JSON_NO_LIMIT, .max_len = JSON_NO_LIMIT, .keys = -1, .additional = 1};
    g.nodes = &any, g.n_nodes = 1;
    JsonState s;
    json_start(&s, 0);
    json_feed(&g, &s, '"');
    return json_feed_all(&g, &s, p, len) && s.mode == JM_STRING && s.sub == S_BODY && !s.u8_left;
}

/* The token order, and which subtrees hold only string text: the walk
   marks those whole inside a string instead of feeding their bytes. */
static void mark_text_subtrees(VocabTrie *t, const tok_tokenizer *tok)
{
    t->first = xmalloc((t->n + 1) * sizeof *t->first);
    t->order = xmalloc(((size_t)t->n + 1) * sizeof *t->order);
    t->text = xmalloc(t->n + 1);
    int k = 0;
    for (int i = 0; i < t->n; i++) {
        t->first[i] = k;
        for (int id = t->tok[i]; id >= 0; id = t->next_tok[id]) t->order[k++] = id;
    }
    t->first[t->n] = k;
    size_t len;
    for (int i = t->n - 1; i >= 0; i--) { /* children before parents */
        int text = 1;
        for (int id = t->tok[i]; id >= 0 && text; id = t->next_tok[id]) {
            const char *p = tok_piece(tok, id, &len);
            text = is_string_text(p, len);
        }
        for (int j = i + 1; j < t->end[i] && text; j = t->end[j]) text = t->text[j];
        t->text[i] = (uint8_t)text;
    }
}

/* Sorted, the token texts sharing a prefix are neighbours: each text adds
   nodes only for its bytes past the prefix it shares with the one before. */
static void build_trie(VocabTrie *t, const tok_tokenizer *tok, int vocab)
{
    memset(t, 0, sizeof *t);
    Piece *pieces = xmalloc(vocab * sizeof *pieces);
    int n = 0;
    size_t total = 0, len;
    t->next_tok = xmalloc(vocab * sizeof *t->next_tok);
    t->eog = xmalloc(vocab * sizeof *t->eog);
    for (int id = 0; id < vocab; id++) {
        const char *p = tok_piece(tok, id, &len);
        t->next_tok[id] = -1;
        if (tok_is_eog(tok, id)) t->eog[t->n_eog++] = id;
        if (tok_is_control(tok, id) || !p || !len) continue;
        pieces[n++] = (Piece){p, len, id};
        total += len;
        if ((int)len > t->max_depth) t->max_depth = (int)len;
    }
    qsort(pieces, n, sizeof *pieces, by_piece);
    t->byte = xmalloc(total + 1);
    t->depth = xmalloc((total + 1) * sizeof(int));
    t->end = xmalloc((total + 1) * sizeof(int));
    t->tok = xmalloc((total + 1) * sizeof(int));
    int *path = xmalloc((t->max_depth + 1) * sizeof *path), open = 0; /* path[d]: the open node at depth d */
    Piece prev = {"", 0, -1};
    for (int k = 0; k < n; k++) {
        Piece p = pieces[k];
        size_t common = 0;
        while (common < p.len && common < prev.len && p.p[common] == prev.p[common]) common++;
        for (; open > (int)common; open--) t->end[path[open]] = t->n; /* close the subtrees left behind */
        for (; open < (int)p.len; open++) {
            int i = t->n++;
            t->byte[i] = (uint8_t)p.p[open], t->depth[i] = open + 1, t->tok[i] = -1;
            path[open + 1] = i;
        }
        int at = path[p.len];
        t->next_tok[p.id] = t->tok[at]; /* another token with the same text, if any */
        t->tok[at] = p.id;
        prev = p;
    }
    for (; open > 0; open--) t->end[path[open]] = t->n;
    free(path);
    free(pieces);
    mark_text_subtrees(t, tok);
}

static void free_trie(VocabTrie *t)
{
    free(t->byte); free(t->depth); free(t->end); free(t->tok); free(t->next_tok); free(t->eog);
    free(t->order); free(t->first); free(t->text);
}

/* What --json / --json-schema compile once: the grammar, its start node
   and the vocabulary's trie. */
typedef struct JsonConstraint {
    JsonGrammar g;
    int root;
    VocabTrie trie;
} JsonConstraint;

/* A request's constrained-output state: where the automaton stands, and
   the allowed sets of recently seen states. */
typedef struct JsonMask {
    const JsonConstraint *jc;
    JsonState state;
    int vocab;
    JsonState *walk;                          /* [trie.max_depth + 1]: the walk's state at each depth */
    JsonState keys[JSON_CACHE_SLOTS];         /* the state each cached set belongs to */
    int used[JSON_CACHE_SLOTS];
    uint8_t *sets;                            /* [JSON_CACHE_SLOTS][vocab]: 1 where a token is allowed */
    long walks, hits;                         /* for -v: sets walked, sets from the cache ... */
    double walk_ms;                           /* ... and the time the walks took */
} JsonMask;

static void json_mask_init(JsonMask *jm, const JsonConstraint *jc, int vocab)
{
    memset(jm, 0, sizeof *jm);
    jm->jc = jc;
    jm->vocab = vocab;
    json_start(&jm->state, jc->root);
    jm->walk = xmalloc((jc->trie.max_depth + 1) * sizeof *jm->walk);
    jm->sets = xmalloc((size_t)JSON_CACHE_SLOTS * vocab);
}

static void json_mask_free(JsonMask *jm)
{
    free(jm->walk);
    free(jm->sets);
}

/* Whether s is inside a string between characters, with no length to
   count: there every token that is string text (VocabTrie.text) is
   allowed, whatever else the state holds. */
static int json_in_free_text(const JsonGrammar *g, const JsonState *s)
{
    if (s->sub != S_BODY || s->u8_left) return 0;
    if (s->mode == JM_STRING) return g->nodes[s->node].min_len == 0 && g->nodes[s->node].max_len == JSON_NO_LIMIT;
    /* a key of an object with no declared keys: any string */
    return s->mode == JM_KEY && s->key_free && g->nodes[s->frames[s->depth - 1].node].keys < 0;
}

/* The walk: every token whose bytes the automaton accepts from state s.
   A subtree of the trie is skipped at its first refused byte, and each
   node costs one state copy (the part in use) and one byte fed. Inside a
   string most tokens are allowed and the walk would visit nearly every
   node: there a subtree of string text is marked whole. Returns 1 if any
   token is allowed. */
static int json_walk(const JsonConstraint *jc, const JsonState *s, JsonState *walk, uint8_t *allowed, int vocab)
{
    int any = 0;
    const VocabTrie *t = &jc->trie;
    int text = json_in_free_text(&jc->g, s);
    memset(allowed, 0, vocab);
    memcpy(&walk[0], s, json_state_size(s));
    for (int i = 0; i < t->n;) {
        if (text && t->text[i]) {
            for (int k = t->first[i]; k < t->first[t->end[i]]; k++) allowed[t->order[k]] = 1;
            any |= t->first[i] < t->first[t->end[i]];
            i = t->end[i];
            continue;
        }
        int d = t->depth[i];
        JsonState *w = &walk[d];
        memcpy(w, &walk[d - 1], json_state_size(&walk[d - 1]));
        if (!json_feed(&jc->g, w, t->byte[i])) { i = t->end[i]; continue; }
        for (int id = t->tok[i]; id >= 0; id = t->next_tok[id]) allowed[id] = any = 1;
        i++;
    }
    if (json_complete(&jc->g, s))
        for (int k = 0; k < t->n_eog; k++) allowed[t->eog[k]] = any = 1;
    return any;
}

/* The tokens allowed next: 1 where a token keeps the output a prefix of
   a value the grammar allows (an end token only where the value is
   complete). Cached by state. */
static const uint8_t *grammar_mask_allowed(JsonMask *jm)
{
    size_t size = json_state_size(&jm->state);
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < size; i++) h = (h ^ ((const uint8_t *)&jm->state)[i]) * 1099511628211ull;
    int slot = (int)(h % JSON_CACHE_SLOTS);
    uint8_t *set = jm->sets + (size_t)slot * jm->vocab;
    if (jm->used[slot] && !memcmp(&jm->keys[slot], &jm->state, size) && jm->keys[slot].depth == jm->state.depth) {
        jm->hits++;
        return set;
    }
    double t0 = now_ms();
    /* every state has a completion, but it may need a byte no token holds */
    if (!json_walk(jm->jc, &jm->state, jm->walk, set, jm->vocab))
        die(EXIT_RUNTIME, "no token of this vocabulary can continue the JSON value here");
    jm->walk_ms += now_ms() - t0;
    memcpy(&jm->keys[slot], &jm->state, size);
    jm->used[slot] = 1;
    jm->walks++;
    return set;
}

/* ----- the schema subset ------------------------------------------------
   --json-schema compiles a JSON Schema into grammar nodes. The subset:
   type (a name or a list of names), properties, required,
   additionalProperties (true or false), items (one schema), minItems,
   maxItems, minLength, maxLength (in characters: code points), enum and
   const; title, description, $schema, $id, $comment, default and examples
   are annotations and ignored. As in JSON Schema, properties and
   required constrain only objects, items and the item counts only
   arrays, the lengths only strings. enum and const match the exact
   compact text of their values (strings escaped only where JSON must
   be); beside them only type may stand. A declared key matches only as
   its exact text; where other keys are allowed they are written without
   escapes, so that a key is a declared one exactly when it reads as one.
   Each declared key appears at most once, in any order, and '}' waits for
   the required ones. Anything else is a usage error naming the JSON path
   of the keyword. */

#define SCHEMA_MAX_BYTES (1u << 20) /* a schema file is small; more is a mistake */
#define SCHEMA_PATH_BYTES 256       /* the JSON path in an error message */

/* What compiling a schema keeps at hand for its error messages: the
   file's name, or (batch mode, a line's "schema") where a problem is
   reported instead of ending the run. */
typedef struct {
    JsonGrammar *g;
    const char *file;
    jmp_buf *fail;      /* NULL: a problem is a usage error */
    char *why;          /* [why_len]: the problem, before longjmp(*fail) */
    size_t why_len;
} SchemaCtx;

static _Noreturn void schema_error(const SchemaCtx *cx, const char *path, const char *fmt, ...)
{
    char msg[MSG_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (cx->fail) {
        snprintf(cx->why, cx->why_len, "\"schema\": %s: %s", path, msg);
        longjmp(*cx->fail, 1);
    }
    die(EXIT_USAGE, "--json-schema %s: %s: %s", cx->file, path, msg);
}

/* path + "." + key (or ["key"] when the key is not a plain name), or
   path + "[i]" when key is NULL. */
static void schema_path(char *out, const char *path, const char *key, size_t key_len, int index)
{
    int plain = key && key_len && !isdigit((unsigned char)key[0]);
    for (size_t i = 0; key && i < key_len; i++)
        plain &= isalnum((unsigned char)key[i]) || key[i] == '_' || key[i] == '$';
    if (!key) snprintf(out, SCHEMA_PATH_BYTES, "%s[%d]", path, index);
    else if (plain) snprintf(out, SCHEMA_PATH_BYTES, "%s.%.*s", path, (int)key_len, key);
    else {
        Buf b = {0};
        json_put_string(&b, key, key_len);
        snprintf(out, SCHEMA_PATH_BYTES, "%s[%s]", path, b.p ? b.p : "\"\"");
        free(b.p);
    }
}

/* The compact text of a value: the exact bytes an enum or const value
   must be written as. Strings escape only what JSON requires. */
static void json_canonical(Buf *b, const Json *v)
{
    switch (v->kind) {
    case JSON_NULL: buf_put(b, "null", 4); break;
    case JSON_BOOL: v->boolean ? buf_put(b, "true", 4) : buf_put(b, "false", 5); break;
    case JSON_NUMBER: buf_put(b, v->str, v->len); break;
    case JSON_STRING:
        buf_put(b, "\"", 1);
        for (size_t i = 0; i < v->len; i++) {
            unsigned char c = (unsigned char)v->str[i];
            if (c == '"' || c == '\\') buf_printf(b, "\\%c", c);
            else if (c < 0x20) buf_printf(b, "\\u%04x", c);
            else buf_put(b, (const char *)&c, 1);
        }
        buf_put(b, "\"", 1);
        break;
    case JSON_ARRAY:
    case JSON_OBJECT:
        buf_put(b, v->kind == JSON_ARRAY ? "[" : "{", 1);
        for (int i = 0; i < v->n; i++) {
            if (i) buf_put(b, ",", 1);
            if (v->kind == JSON_OBJECT) {
                Json key = {.kind = JSON_STRING, .str = v->keys[i], .len = v->key_lens[i]};
                json_canonical(b, &key);
                buf_put(b, ":", 1);
            }
            json_canonical(b, &v->items[i]);
        }
        buf_put(b, v->kind == JSON_ARRAY ? "]" : "}", 1);
        break;
    }
}

/* The kinds value v is of, as "type" names them (an integral number is
   both a number and an integer). */
static unsigned json_kind_types(const Json *v)
{
    switch (v->kind) {
    case JSON_NULL: return JT_NULL;
    case JSON_BOOL: return JT_BOOLEAN;
    case JSON_NUMBER: return JT_NUMBER | (isfinite(v->number) && floor(v->number) == v->number ? JT_INTEGER : 0);
    case JSON_STRING: return JT_STRING;
    case JSON_ARRAY: return JT_ARRAY;
    default: return JT_OBJECT;
    }
}

/* Adds v's text to the set being built, checked against the automaton
   itself: a text it would refuse (a number longer than it allows, nesting
   deeper) could never be generated. */
static void schema_add_value(const SchemaCtx *cx, const char *path, const Json *v, int prop)
{
    Buf b = {0};
    json_canonical(&b, v);
    JsonState s;
    json_start(&s, 0);
    if (!json_feed_all(cx->g, &s, b.p, b.len) || !json_complete(cx->g, &s))
        schema_error(cx, path, "the value cannot be generated (numbers of at most %d bytes, nesting at most %d deep)",
                     JSON_MAX_NUMBER, JSON_GEN_DEPTH);
    if (cx->g->n_texts >= UINT16_MAX) schema_error(cx, path, "too many enum values and keys (at most %d)", UINT16_MAX - 1);
    json_add_text(cx->g, b.p, (int)b.len, prop);
    free(b.p);
}

/* "type": a name or a non-empty list of names. */
static unsigned schema_types(const SchemaCtx *cx, const char *path, const Json *v)
{
    static const struct { const char *name; unsigned bit; } names[] = {
        {"null", JT_NULL}, {"boolean", JT_BOOLEAN}, {"number", JT_NUMBER | JT_INTEGER}, {"integer", JT_INTEGER},
        {"string", JT_STRING}, {"array", JT_ARRAY}, {"object", JT_OBJECT}};
    unsigned types = 0;
    int n = v->kind == JSON_ARRAY ? v->n : 1;
    if (v->kind == JSON_ARRAY && !n) schema_error(cx, path, "expects a type name or a non-empty list of them");
    for (int i = 0; i < n; i++) {
        const Json *t = v->kind == JSON_ARRAY ? &v->items[i] : v;
        unsigned bit = 0;
        for (size_t k = 0; t->kind == JSON_STRING && k < sizeof names / sizeof *names; k++)
            if (strlen(names[k].name) == t->len && !memcmp(names[k].name, t->str, t->len)) bit = names[k].bit;
        if (!bit) schema_error(cx, path, "expects null, boolean, number, integer, string, array or object (or a list of them)");
        types |= bit;
    }
    return types;
}

/* minItems and the like: an integer in [0, max]. */
static int schema_count(const SchemaCtx *cx, const char *path, const Json *v, int max)
{
    if (v->kind != JSON_NUMBER || !(json_kind_types(v) & JT_INTEGER) || v->number < 0 || v->number > max)
        schema_error(cx, path, "expects an integer in [0, %d]", max);
    return (int)v->number;
}

static int compile_schema(const SchemaCtx *cx, const Json *v, const char *path, int level);

/* properties, required and additionalProperties of node `node`. */
static void schema_object(const SchemaCtx *cx, int node, const Json *v, const char *path, int level)
{
    JsonGrammar *g = cx->g;
    const Json *props = json_get(v, "properties"), *req = json_get(v, "required"), *add = json_get(v, "additionalProperties");
    char sub[SCHEMA_PATH_BYTES], at[SCHEMA_PATH_BYTES];
    int kids[JSON_MAX_PROPS], n = 0, additional = 1;
    const char *names[JSON_MAX_PROPS];
    size_t lens[JSON_MAX_PROPS];
    if (add) {
        schema_path(at, path, "additionalProperties", 20, 0);
        if (add->kind != JSON_BOOL) schema_error(cx, at, "only true or false is supported");
        additional = add->boolean;
    }
    if (props) {
        schema_path(at, path, "properties", 10, 0);
        if (props->kind != JSON_OBJECT) schema_error(cx, at, "expects an object");
        if (props->n > JSON_MAX_PROPS) schema_error(cx, at, "more than %d properties", JSON_MAX_PROPS);
        for (int i = 0; i < props->n; i++) {
            schema_path(sub, at, props->keys[i], props->key_lens[i], 0);
            for (int k = 0; k < n; k++)
                if (lens[k] == props->key_lens[i] && !memcmp(names[k], props->keys[i], lens[k])) schema_error(cx, sub, "declared twice");
            names[n] = props->keys[i], lens[n] = props->key_lens[i];
            kids[n++] = compile_schema(cx, &props->items[i], sub, level + 1);
        }
    }
    uint64_t required = 0;
    if (req) {
        schema_path(at, path, "required", 8, 0);
        if (req->kind != JSON_ARRAY) schema_error(cx, at, "expects a list of property names");
        for (int i = 0; i < req->n; i++) {
            const Json *r = &req->items[i];
            schema_path(sub, at, NULL, 0, i);
            if (r->kind != JSON_STRING) schema_error(cx, sub, "expects a property name (a string)");
            int k = 0;
            while (k < n && !(lens[k] == r->len && !memcmp(names[k], r->str, r->len))) k++;
            if (k == n) { /* required but not declared: any value */
                if (!additional) schema_error(cx, sub, "required, but not in properties while additionalProperties is false");
                if (n == JSON_MAX_PROPS) schema_error(cx, sub, "more than %d properties", JSON_MAX_PROPS);
                names[n] = r->str, lens[n] = r->len, kids[n++] = 0;
            }
            required |= 1ull << k;
        }
    }
    int first = g->n_prop_nodes;
    g->prop_node = realloc(g->prop_node, (g->n_prop_nodes + n + 1) * sizeof *g->prop_node);
    if (!g->prop_node) die(EXIT_RUNTIME, "out of memory");
    for (int i = 0; i < n; i++) g->prop_node[g->n_prop_nodes++] = kids[i];
    int keys = -1;
    if (n) {
        keys = json_begin_set(g);
        for (int i = 0; i < n; i++) {
            Json key = {.kind = JSON_STRING, .str = (char *)names[i], .len = lens[i]};
            schema_path(sub, path, "properties", 10, 0);
            schema_add_value(cx, sub, &key, i);
        }
        json_end_set(g);
    }
    JsonNode *nd = &g->nodes[node];
    nd->keys = keys, nd->n_props = n, nd->props = first, nd->required = required, nd->additional = additional;
}

/* Compiles schema v (at JSON path `path`, inside `level` containers) into
   a node of cx->g; returns its index. */
static int compile_schema(const SchemaCtx *cx, const Json *v, const char *path, int level)
{
    static const char *const known[] = {"type", "properties", "required", "additionalProperties", "items", "minItems",
                                        "maxItems", "minLength", "maxLength", "enum", "const", "title", "description",
                                        "$schema", "$id", "$comment", "default", "examples"};
    enum { N_VALIDATING = 11 }; /* known[0 .. N_VALIDATING) validate, the rest are annotations */
    JsonGrammar *g = cx->g;
    char at[SCHEMA_PATH_BYTES];
    if (v->kind != JSON_OBJECT) schema_error(cx, path, "a schema must be a JSON object (true and false are not supported)");
    /* the value at `level` sits inside that many arrays and objects; it may be one itself only below JSON_GEN_DEPTH */
    if (level > JSON_GEN_DEPTH) schema_error(cx, path, "nested deeper than %d levels", JSON_GEN_DEPTH);
    if (g->n_nodes >= UINT16_MAX) schema_error(cx, path, "the schema is too large (at most %d schemas)", UINT16_MAX - 1);
    const Json *en = json_get(v, "enum"), *cn = json_get(v, "const");
    for (int i = 0; i < v->n; i++) {
        size_t k = 0;
        while (k < sizeof known / sizeof *known && !(strlen(known[k]) == v->key_lens[i] && !memcmp(known[k], v->keys[i], v->key_lens[i]))) k++;
        schema_path(at, path, v->keys[i], v->key_lens[i], 0);
        if (k == sizeof known / sizeof *known) schema_error(cx, at, "keyword not supported");
        if ((en || cn) && k > 0 && k < N_VALIDATING - 2)
            schema_error(cx, at, "not supported beside enum or const (only type is)");
    }
    if (en && cn) schema_path(at, path, "const", 5, 0), schema_error(cx, at, "not supported beside enum");
    const Json *t = json_get(v, "type");
    unsigned types = JT_ANY;
    if (t) schema_path(at, path, "type", 4, 0), types = schema_types(cx, at, t);
    if (level == JSON_GEN_DEPTH && !(types & ~(JT_ARRAY | JT_OBJECT)))
        schema_error(cx, path, "an array or object here would be nested deeper than %d levels", JSON_GEN_DEPTH);
    int node = json_add_node(g, types);
    if (en || cn) {
        schema_path(at, path, en ? "enum" : "const", en ? 4 : 5, 0);
        if (en && (en->kind != JSON_ARRAY || !en->n)) schema_error(cx, at, "expects a non-empty list of values");
        int set = json_begin_set(g), n = en ? en->n : 1;
        for (int i = 0; i < n; i++) {
            const Json *e = en ? &en->items[i] : cn;
            char sub[SCHEMA_PATH_BYTES];
            if (en) schema_path(sub, at, NULL, 0, i);
            if (json_kind_types(e) & types) schema_add_value(cx, en ? sub : at, e, -1);
        }
        json_end_set(g);
        if (!g->sets[set].n) schema_error(cx, at, "no value is of the schema's type");
        g->nodes[node].set = set;
        return node;
    }
    const Json *items = json_get(v, "items");
    if (items) {
        schema_path(at, path, "items", 5, 0);
        int item = compile_schema(cx, items, at, level + 1); /* moves g->nodes */
        g->nodes[node].items = item;
    }
    static const char *const bounds[] = {"minItems", "maxItems", "minLength", "maxLength"};
    int value[4] = {0, JSON_NO_LIMIT, 0, JSON_NO_LIMIT};
    for (int b = 0; b < 4; b++) {
        const Json *x = json_get(v, bounds[b]);
        if (x) schema_path(at, path, bounds[b], strlen(bounds[b]), 0), value[b] = schema_count(cx, at, x, b < 2 ? UINT16_MAX : INT32_MAX);
    }
    for (int b = 0; b < 4; b += 2)
        if (value[b + 1] != JSON_NO_LIMIT && value[b] > value[b + 1])
            schema_path(at, path, bounds[b], strlen(bounds[b]), 0), schema_error(cx, at, "greater than %s", bounds[b + 1]);
    JsonNode *nd = &g->nodes[node];
    nd->min_items = value[0], nd->max_items = value[1], nd->min_len = value[2], nd->max_len = value[3];
    schema_object(cx, node, v, path, level);
    return node;
}

/* --json-schema FILE: reads and compiles the schema in FILE into g;
   returns its node. A FILE that cannot be opened or read is a runtime
   error, as for every file a flag names (the model's, --ppl's,
   --batch's); what the schema says is the flag's value, and a problem
   there is a usage error naming the file. */
static int compile_schema_file(JsonGrammar *g, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) die(EXIT_RUNTIME, "--json-schema %s: %s", path, strerror(errno));
    char *text = xmalloc(SCHEMA_MAX_BYTES + 1);
    size_t len = fread(text, 1, SCHEMA_MAX_BYTES + 1, f);
    int failed = ferror(f), e = errno;
    fclose(f);
    if (failed) die(EXIT_RUNTIME, "--json-schema %s: %s", path, strerror(e ? e : EIO));
    if (len > SCHEMA_MAX_BYTES) die(EXIT_USAGE, "--json-schema %s: longer than %u bytes", path, SCHEMA_MAX_BYTES);
    Json v;
    char err[MSG_BYTES];
    if (json_parse(text, len, &v, err, sizeof err) != 0) die(EXIT_USAGE, "--json-schema %s: not valid JSON: %s", path, err);
    if (v.kind != JSON_OBJECT) die(EXIT_USAGE, "--json-schema %s: the schema must be a JSON object", path);
    SchemaCtx cx = {g, path, NULL, NULL, 0};
    int root = compile_schema(&cx, &v, "$", 0);
    json_free(&v);
    free(text); /* after v: its numbers' texts point into it */
    return root;
}

/* A batch line's "schema", compiled into jc (sharing the vocabulary
   trie t); -1 with the reason in why when it cannot be. */
static int compile_schema_value(JsonConstraint *jc, const Json *v, const VocabTrie *t, char *why, size_t why_len)
{
    jmp_buf fail;
    SchemaCtx cx = {&jc->g, "\"schema\"", &fail, why, why_len};
    json_grammar_init(&jc->g);
    if (setjmp(fail)) {
        json_grammar_free(&jc->g);
        return -1;
    }
    jc->root = compile_schema(&cx, v, "$", 0);
    jc->trie = *t; /* shared, not owned */
    return 0;
}

/* The generation loop's hooks' handles on a request's mask (a heap object,
   so that they need no more of this section than these names). */
static JsonMask *grammar_mask_new(const JsonConstraint *jc, int vocab)
{
    JsonMask *jm = xmalloc(sizeof *jm);
    json_mask_init(jm, jc, vocab);
    return jm;
}

/* Moves the automaton over a token's text; 0 if the text breaks the grammar. */
static int grammar_mask_take(JsonMask *jm, const char *text, size_t len) { return json_feed_all(&jm->jc->g, &jm->state, text, len); }

static int grammar_mask_done(const JsonMask *jm) { return jm->state.mode == JM_DONE; }

/* Ends a request's mask: whether its value was left unfinished, and the
   mask's statistics (allowed sets walked over the vocabulary, sets taken
   from the cache, the time walking took), into st; frees it. */
static void grammar_mask_end(JsonMask *jm, Stats *st)
{
    st->json_incomplete = !json_complete(&jm->jc->g, &jm->state);
    st->json_walks = jm->walks, st->json_hits = jm->hits, st->json_walk_ms = jm->walk_ms;
    json_mask_free(jm);
    free(jm);
}

/* --json (json) or --json-schema (schema_path): the grammar, compiled once;
   NULL for neither. The vocabulary's trie follows with the model
   (open_features). */
static JsonConstraint *build_json_constraint(int json, const char *schema_path)
{
    if (!json && !schema_path) return NULL;
    JsonConstraint *jc = xcalloc(1, sizeof *jc);
    json_grammar_init(&jc->g);
    jc->root = schema_path ? compile_schema_file(&jc->g, schema_path) : 0;
    return jc;
}

static void free_json_constraint(JsonConstraint *jc)
{
    if (!jc) return;
    json_grammar_free(&jc->g);
    free_trie(&jc->trie);
    free(jc);
}

/* ----- files read into memory of the run's own ---------------------------------
   A prompt cache is read whole and checked before use, and with
   --hugepages so is the model: a copy that the file changing on disk
   cannot touch, in 2 MiB pages. */

/* Reads n bytes of fd from offset off into buf: 0, or an errno (EIO: the
   file ended sooner). */
static int read_exactly(int fd, uint8_t *buf, size_t n, off_t off)
{
    for (size_t at = 0; at < n;) {
        ssize_t k = pread(fd, buf + at, n - at, off + at);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return k < 0 ? errno : EIO;
        at += k;
    }
    return 0;
}

/* Memory for a file's copy (NULL: none to be had; munmap(p, size) frees
   it), in huge pages where the system gives them: with 4 KiB pages (30,000
   faults for a 125 MB file) reading and checking a prompt cache took
   140-220 ms, with huge pages 65-145 (a loaded 2-core machine). It starts
   on a huge page's boundary: a huge page maps an aligned 2 MiB only. */
static uint8_t *alloc_copy(size_t size)
{
    long page = sysconf(_SC_PAGESIZE);
    size_t len = size + HUGE_PAGE_BYTES, used = (size + page - 1) / page * page;
    uint8_t *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    uint8_t *a = (uint8_t *)(((uintptr_t)p + HUGE_PAGE_BYTES - 1) & ~(uintptr_t)(HUGE_PAGE_BYTES - 1));
    if (a > p) munmap(p, a - p);
    munmap(a + used, p + len - (a + used)); /* never empty: the head cut off is less than the huge page of slack */
#ifdef MADV_HUGEPAGE
    madvise(a, size, MADV_HUGEPAGE); /* a hint: without it, 4 KiB pages */
#endif
    return a;
}

/* --hugepages: the model file at fd (size bytes) read into memory of the
   run's own (alloc_copy), or MAP_FAILED with errno set, as mmap (EIO: the
   file shrank while it was read). A mapped file's pages are the page
   cache's 4 KiB ones, and every pass streams every weight: with 4 KiB
   pages that is a TLB miss every 4 KiB, and a stop for the hardware
   prefetcher, which does not cross a page. */
static void *read_copy(int fd, size_t size)
{
    uint8_t *p = alloc_copy(size);
    int e = p ? read_exactly(fd, p, size, 0) : ENOMEM;
    if (!e) return p;
    if (p) munmap(p, size);
    errno = e;
    return MAP_FAILED;
}

/* ----- prompt cache -------------------------------------------------------------
   --prompt-cache FILE keeps on disk the KV cache of a prompt's tokens:
   scripts that ask many questions about one long prefix (a system prompt,
   a document) prefill it once. A run whose prompt begins with the file's
   tokens copies their K and V rows into its cache and prefills only the
   rest; it then writes its own prompt's rows there, unless the file holds
   them already. What the file holds is what prefill would have computed
   (the same model file, KV type, context and kernel set), so the output
   is what it would be without the file, whenever prefill from a position
   P gives the logits that prefilling the whole prompt gives.

   The file (little-endian):
     header        PCACHE_HEADER bytes: the fields of enum PC_* below; the
                   rest zero, then an XXH64 of bytes [0, PC_HEADER_SUM)
     token ids     n x i32, zero-padded to a multiple of PCACHE_ALIGN bytes
     K and V rows  for each layer, its K then its V: for each KV head, the
                   rows of positions 0..n-1 (kv_row bytes each, in the KV type)
   so its size is the header, the ids and exactly n positions' K and V in
   the KV type in use. The data after the header has a checksum: XXH64
   chained over PCACHE_BLOCK-byte blocks (the seed of each is the sum of
   the blocks before it). A file whose size, sums or identity do not fit is
   ignored (refused with --prompt-cache-ro): never read as K and V. It is
   read once, at the start, into memory the run owns and checked there, so
   a file changed, cut short or replaced during a chat or batch run is
   never read again (it stays mapped nowhere: no SIGBUS). A path holding
   anything but a prompt cache (text, the model file) is refused, never
   replaced. */

#define PCACHE_MAGIC "LLMC"
#define PCACHE_VERSION 1
#define PCACHE_HEADER 256
#define PCACHE_ALIGN 64
#define PCACHE_BLOCK 65536     /* the data checksum's unit, and the writer's buffer */
#define PCACHE_KERNELS 16      /* bytes for the kernel set's name */
#define PCACHE_TEMP_SUFFIX ".tmp-" /* + the PID: the name the file is written under, next to it */
#define MODEL_SAMPLE_STRIDE (256 << 10) /* the model's identity: 64 bytes of every 256 KiB of its tensors ... */
#define MODEL_SAMPLE_BYTES 64  /* ... (and all of its header, tokenizer and tensor table) */

enum {
    PC_MAGIC = 0, PC_VERSION = 4, PC_FILE_VERSION = 8, PC_KV_TYPE = 12, /* u32: the model file version this build reads */
    PC_MODEL_SIZE = 16, PC_MODEL_HASH = 24,                            /* u64: the model file's size and identity hash */
    PC_CTX = 32, PC_LAYERS = 36, PC_KV_HEADS = 40, PC_HEAD_DIM = 44, PC_ROW = 48, PC_TOKENS = 52, /* u32 */
    PC_KERNELS = 56,                                                   /* char[PCACHE_KERNELS] */
    PC_DATA_SUM = 72, PC_HEADER_SUM = 248                              /* u64 */
};

#define XXH_P1 0x9E3779B185EBCA87ull /* XXH64's primes (xxHash, Yann Collet) */
#define XXH_P2 0xC2B2AE3D27D4EB4Full
#define XXH_P3 0x165667B19E3779F9ull
#define XXH_P4 0x85EBCA77C2B2AE63ull
#define XXH_P5 0x27D4EB2F165667C5ull

static uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static uint64_t xxh_round(uint64_t acc, uint64_t in) { return rotl64(acc + in * XXH_P2, 31) * XXH_P1; }
static uint64_t xxh_merge(uint64_t h, uint64_t v) { return (h ^ xxh_round(0, v)) * XXH_P1 + XXH_P4; }

/* XXH64 of p[0..n): four lanes over 32-byte stripes, so it runs at memory
   speed, and every bit of the input reaches every bit of the sum (a
   flipped byte, a truncated or reordered block changes it). */
static uint64_t xxh64(const void *data, size_t n, uint64_t seed)
{
    const uint8_t *p = data, *end = p + n;
    uint64_t h;
    if (n >= 32) {
        uint64_t v[4] = {seed + XXH_P1 + XXH_P2, seed + XXH_P2, seed, seed - XXH_P1};
        for (; p + 32 <= end; p += 32)
            for (int i = 0; i < 4; i++) v[i] = xxh_round(v[i], rd_u64(p + 8 * i));
        h = rotl64(v[0], 1) + rotl64(v[1], 7) + rotl64(v[2], 12) + rotl64(v[3], 18);
        for (int i = 0; i < 4; i++) h = xxh_merge(h, v[i]);
    } else {
        h = seed + XXH_P5;
    }
    h += n;
    for (; p + 8 <= end; p += 8) h = rotl64(h ^ xxh_round(0, rd_u64(p)), 27) * XXH_P1 + XXH_P4;
    if (p + 4 <= end) h = rotl64(h ^ (rd_u32(p) * XXH_P1), 23) * XXH_P2 + XXH_P3, p += 4;
    for (; p < end; p++) h = rotl64(h ^ (*p * XXH_P5), 11) * XXH_P1;
    h ^= h >> 33, h *= XXH_P2, h ^= h >> 29, h *= XXH_P3, h ^= h >> 32;
    return h;
}

/* What identifies the model file's contents: XXH64 of its header, tokenizer
   and tensor table, whole, and of a 64-byte sample of every 256 KiB of its
   tensors. A different model, an export of other weights into the same
   shapes (a fine-tune), another quantization, changes it; the same file
   copied or re-exported does not. Hashing all the weights (1 GB for a
   1.5B model) would cost more than the prefill a cache saves for short
   prompts; a sample reads a page in 64, which the forward pass reads anyway. */
static uint64_t model_identity(const Model *m)
{
    const uint8_t *f = m->map;
    size_t data = align_up(rd_u64(f + HDR_TABLE_OFFSET) + (uint64_t)rd_u32(f + HDR_N_TENSORS) * TENSOR_ENTRY_BYTES,
                           TENSOR_ALIGN);
    uint64_t h = xxh64(f, data, 0);
    for (size_t at = data; at + MODEL_SAMPLE_BYTES <= m->map_size; at += MODEL_SAMPLE_STRIDE)
        h = xxh64(f + at, MODEL_SAMPLE_BYTES, h);
    return xxh64(f + m->map_size - MODEL_SAMPLE_BYTES, MODEL_SAMPLE_BYTES, h); /* and the file's last bytes */
}

/* The prompt cache of a run. */
typedef struct PromptCache {
    const char *path;
    int read_only;      /* --prompt-cache-ro: never written, and a file that cannot be used is an error */
    int verbose;
    uint8_t head[PCACHE_HEADER]; /* this run's identity fields: a file must carry the same */
    uint8_t *data;      /* the file as read and checked at the start, the run's own copy, while its tokens may
                           still be loaded (NULL: none) */
    size_t data_size;
    struct stat file;   /* the file read: its device, inode, size and time, to tell whether it changed since */
    const int32_t *ids; /* its tokens, n of them */
    int n;
    int saved;          /* batch mode: the first line's prompt has been written */
} PromptCache;

static void put_u32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put_u64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

/* Bytes of the K and V rows of n positions; where they start in a file of n tokens. */
static size_t pcache_kv_bytes(const Config *c, const RunState *s, size_t n) { return 2 * n * c->n_layers * c->n_kv_heads * s->kv_row; }
static size_t pcache_kv_at(size_t n) { return PCACHE_HEADER + align_up(n * sizeof(int32_t), PCACHE_ALIGN); }

/* The run of cached rows of the sequence with pages pt (NULL: the single
   cache) for layer l, K (v = 0) or V (1), KV head h, from position pos up
   to end at most, that lie next to each other in memory: returns the
   first, and their count in *len. */
static uint8_t *kv_rows(RunState *s, const PageTable *pt, int v, int l, int h, int pos, int end, int *len)
{
    s->mx->paged = pt != NULL;
    s->mx->tok_pages[0] = pt; /* cache_row finds a paged token's pages there: set before every pass, so free between them */
    int run = pt ? PAGE_TOKENS - pos % PAGE_TOKENS : s->kv_cap[l] - pos % s->kv_cap[l];
    *len = min_i(end - pos, run);
    return cache_row(s, v ? s->value_cache : s->key_cache, 0, l, h, pos);
}

/* The reason the file's header (n tokens, size bytes) does not fit this
   run, or NULL. */
static const char *pcache_mismatch(const PromptCache *pc, const Config *c, const RunState *s, const uint8_t *h, size_t size,
                                   char *why, size_t why_len)
{
    if (size < PCACHE_HEADER || memcmp(h + PC_MAGIC, PCACHE_MAGIC, 4)) return "not a prompt cache file";
    if (rd_u32(h + PC_VERSION) != PCACHE_VERSION) return "written by another version of run";
    if (rd_u64(h + PC_HEADER_SUM) != xxh64(h, PC_HEADER_SUM, 0)) return "damaged (its header's checksum does not match)";
    if (memcmp(h, pc->head, PC_TOKENS)) {
        if (memcmp(h + PC_MODEL_SIZE, pc->head + PC_MODEL_SIZE, 16)) return "made with another model file";
        uint32_t kv = rd_u32(h + PC_KV_TYPE);
        if (kv != (uint32_t)s->kv_type) {
            snprintf(why, why_len, "made with --kv %s, this run uses --kv %s", kv < N_TYPES && TYPES[kv].kv_name ? TYPES[kv].kv_name : "?",
                     TYPES[s->kv_type].kv_name);
            return why;
        }
        if (rd_u32(h + PC_CTX) != rd_u32(pc->head + PC_CTX)) {
            snprintf(why, why_len, "made with --ctx %u, this run's context is %d", rd_u32(h + PC_CTX), s->seq_len);
            return why;
        }
        return "made for another model file version or shape";
    }
    if (memcmp(h + PC_KERNELS, pc->head + PC_KERNELS, PCACHE_KERNELS)) {
        snprintf(why, why_len, "made with the %.*s kernel set, this run uses %s (their rounding differs)", PCACHE_KERNELS,
                 (const char *)h + PC_KERNELS, (const char *)pc->head + PC_KERNELS);
        return why;
    }
    size_t n = rd_u32(h + PC_TOKENS), want = pcache_kv_at(n) + pcache_kv_bytes(c, s, n);
    if (n < 1 || n > (size_t)s->seq_len) return "damaged (its token count is out of range)";
    if (size != want) {
        snprintf(why, why_len, "truncated or damaged (%zu bytes, %zu tokens take %zu)", size, n, want);
        return why;
    }
    return NULL;
}

/* A one-line reason the cache cannot be used: an error with
   --prompt-cache-ro, else a -v line (the file is replaced after prefill). */
static void pcache_unusable(const PromptCache *pc, const char *why)
{
    if (pc->read_only) die(EXIT_RUNTIME, "--prompt-cache-ro %s: %s", pc->path, why);
    if (pc->verbose) fprintf(stderr, "prompt cache: %s ignored: %s\n", pc->path, why);
}

/* Why the regular file at path must not be replaced by a prompt cache, or
   NULL: bytes that do not open one (text, a model: anything the rename
   would destroy), or a file that cannot be read to tell. An empty file, or
   one that begins with the magic however damaged or cut short after it,
   is a cache and may be replaced. */
static const char *holds_other_data(const char *path, char *why, size_t why_len)
{
    uint8_t head[sizeof PCACHE_MAGIC - 1];
    int fd = open(path, O_RDONLY | O_NONBLOCK);
    ssize_t k = fd < 0 ? -1 : pread(fd, head, sizeof head, 0);
    int e = errno;
    if (fd >= 0) close(fd);
    if (k < 0 && e == ENOENT) return NULL; /* gone since: nothing to destroy */
    if (k < 0) {
        snprintf(why, why_len, "cannot be read to check that it is a prompt cache (%s): not replaced", strerror(e));
        return why;
    }
    return k > 0 && memcmp(head, PCACHE_MAGIC, k) ? "exists and is not a prompt cache (it does not begin with " PCACHE_MAGIC
                                                    "): not replaced"
                                                  : NULL;
}

/* The file is written as path + ".tmp-PID" first: a name whose temporary
   name the file system or temp_path cannot hold is an error now, not a
   warning after the prompt's prefill. */
static void check_temp_name(const char *path)
{
    long pid = (long)getpid();
    const char *slash = strrchr(path, '/');
    size_t whole = (size_t)snprintf(NULL, 0, "%s" PCACHE_TEMP_SUFFIX "%ld", path, pid), added = whole - strlen(path);
    size_t last = strlen(slash ? slash + 1 : path) + added;
    if (last > NAME_MAX)
        die(EXIT_RUNTIME, "--prompt-cache %s: name too long: its temporary name (the name + \"" PCACHE_TEMP_SUFFIX "%ld\") would be"
            " %zu bytes, more than a file name holds (%d)", path, pid, last, NAME_MAX);
    if (whole >= sizeof temp_path)
        die(EXIT_RUNTIME, "--prompt-cache: name too long: its temporary name (the path + \"" PCACHE_TEMP_SUFFIX "%ld\") would be"
            " %zu bytes, more than this build holds (%zu): %s", pid, whole, sizeof temp_path - 1, path); /* the path last: cut short */
}

/* What is at path, before any work: something other than a regular file
   (a directory, a FIFO, a device; with write access, a symlink, which the
   new file would replace), the model file itself, and with write access a
   file that is not a prompt cache or whose temporary name is too long,
   are errors. */
static void check_cache_path(const Model *m, const char *path, int read_only)
{
    struct stat st;
    char why[MSG_BYTES];
    const char *problem;
    if ((read_only ? stat(path, &st) : lstat(path, &st)) == 0) {
        if (!S_ISREG(st.st_mode))
            die(EXIT_RUNTIME, "--prompt-cache %s: not a regular file (a directory, FIFO, device%s is neither read nor replaced)", path,
                read_only ? "" : " or symlink");
        if (st.st_dev == m->dev && st.st_ino == m->ino)
            die(EXIT_RUNTIME, "--prompt-cache %s: this is the model file, not a prompt cache: it is neither read nor replaced", path);
        if (!read_only && (problem = holds_other_data(path, why, sizeof why))) die(EXIT_RUNTIME, "--prompt-cache %s: %s", path, problem);
    }
    if (!read_only) check_temp_name(path);
}

/* This run's identity fields, which a file must carry: pc->head. */
static void pcache_identity(PromptCache *pc, const Model *m, const RunState *s)
{
    const Config *c = &m->c;
    uint8_t *h = pc->head;
    memcpy(h + PC_MAGIC, PCACHE_MAGIC, 4);
    put_u32(h + PC_VERSION, PCACHE_VERSION), put_u32(h + PC_FILE_VERSION, FILE_VERSION), put_u32(h + PC_KV_TYPE, s->kv_type);
    put_u64(h + PC_MODEL_SIZE, m->map_size), put_u64(h + PC_MODEL_HASH, model_identity(m));
    put_u32(h + PC_CTX, s->seq_len), put_u32(h + PC_LAYERS, c->n_layers), put_u32(h + PC_KV_HEADS, c->n_kv_heads);
    put_u32(h + PC_HEAD_DIM, c->head_dim), put_u32(h + PC_ROW, s->kv_row);
    strncpy((char *)h + PC_KERNELS, K.op.name, PCACHE_KERNELS - 1);
}

/* Reads the data after the header (size bytes in all) into f, block by
   block, each summed while it is still in the CPU's cache (one pass over
   memory, not two): 0 with the data checksum in *sum, or an errno. */
static int read_and_sum(int fd, uint8_t *f, size_t size, uint64_t *sum)
{
    *sum = 0;
    for (size_t at = PCACHE_HEADER; at < size; at += PCACHE_BLOCK) {
        size_t len = size - at < PCACHE_BLOCK ? size - at : PCACHE_BLOCK;
        int e = read_exactly(fd, f + at, len, at);
        if (e) return e;
        *sum = xxh64(f + at, len, *sum);
    }
    return 0;
}

/* Why the file's copy f (its header the one checked, sum its data's
   checksum) cannot be loaded, or NULL. */
static const char *pcache_verify(const Config *c, const uint8_t *f, uint64_t sum)
{
    if (sum != rd_u64(f + PC_DATA_SUM)) return "damaged (its data's checksum does not match)";
    const int32_t *ids = (const int32_t *)(f + PCACHE_HEADER); /* 4-byte aligned: the copy is page-aligned */
    for (uint32_t i = 0, n = rd_u32(f + PC_TOKENS); i < n; i++)
        if (ids[i] < 0 || ids[i] >= c->vocab_size) return "damaged (a token id outside the vocabulary)";
    return NULL;
}

/* Reads the open file fd into memory the run owns and checks that copy:
   the header first (only a file of the right size is read whole), then
   the data. Every later read is of the copy, so the file changing, shrinking
   or being replaced on disk during the run can neither fault (SIGBUS) nor
   mix another file's bytes into what was checked. Returns why it cannot be
   used, or NULL with pc->data set. */
static const char *pcache_read(PromptCache *pc, const Config *c, const RunState *s, int fd, char *why, size_t why_len)
{
    struct stat st;
    uint8_t head[PCACHE_HEADER];
    const char *problem;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return "not a regular file";
    if (st.st_size < PCACHE_HEADER || read_exactly(fd, head, PCACHE_HEADER, 0))
        return "not a prompt cache file (shorter than its header)";
    if ((problem = pcache_mismatch(pc, c, s, head, st.st_size, why, why_len))) return problem;
    uint8_t *f = alloc_copy(st.st_size);
    if (!f) return strerror(ENOMEM);
    memcpy(f, head, PCACHE_HEADER); /* the header checked is the copy's: the data's sum and count are taken from it */
    uint64_t sum;
    int e = read_and_sum(fd, f, st.st_size, &sum);
    if (e == EIO) problem = "changed while it was read (it shrank)";
    else if (e) problem = strerror(e);
    else problem = pcache_verify(c, f, sum);
    if (problem) {
        munmap(f, st.st_size);
        return problem;
    }
    pc->data = f, pc->data_size = st.st_size, pc->file = st;
    pc->ids = (const int32_t *)(f + PCACHE_HEADER), pc->n = (int)rd_u32(f + PC_TOKENS);
    return NULL;
}

/* Opens --prompt-cache path for this run (s sized and typed as it will
   run): the path is checked before any work (check_cache_path), and a
   file that fits is read, its checksums verified, and its tokens become
   loadable. */
static void pcache_open(PromptCache *pc, const Model *m, const RunState *s, const char *path, int read_only, int verbose)
{
    *pc = (PromptCache){.path = path, .read_only = read_only, .verbose = verbose};
    pcache_identity(pc, m, s);
    check_cache_path(m, path, read_only);
    double t0 = now_ms();
    int fd = open(path, O_RDONLY | O_NONBLOCK); /* O_NONBLOCK: a FIFO put there since the check must not hang the run */
    if (fd < 0) {
        int e = errno;
        if (e != ENOENT || read_only) pcache_unusable(pc, strerror(e));
        else if (verbose) fprintf(stderr, "prompt cache: %s does not exist yet: it is written after the prompt\n", path);
        return;
    }
    char why[MSG_BYTES];
    const char *problem = pcache_read(pc, &m->c, s, fd, why, sizeof why);
    close(fd);
    if (problem) {
        pcache_unusable(pc, problem);
        return;
    }
    double ms = now_ms() - t0, mb = pc->data_size / 1e6;
    if (verbose)
        fprintf(stderr, "prompt cache: %s holds %d tokens (%.1f MB), read and checked in %.1f ms (%.2f GB/s)\n", path, pc->n, mb,
                ms, mb / (ms > 0 ? ms : 1e-3));
}

static void pcache_close(PromptCache *pc)
{
    if (pc->data) munmap(pc->data, pc->data_size);
    pc->data = NULL, pc->n = 0;
}

/* The file at pc->path is no longer the one read (replaced, rewritten,
   truncated, removed): what the copy holds says nothing of it. */
static int pcache_file_changed(const PromptCache *pc)
{
    struct stat st;
    const struct stat *was = &pc->file;
    return stat(pc->path, &st) != 0 || st.st_dev != was->st_dev || st.st_ino != was->st_ino || st.st_size != was->st_size ||
           st.st_mtim.tv_sec != was->st_mtim.tv_sec || st.st_mtim.tv_nsec != was->st_mtim.tv_nsec;
}

/* Positions [0, n) of ids are in the file. */
static int pcache_holds(const PromptCache *pc, const int *ids, int n)
{
    return pc->data && n <= pc->n && !memcmp(pc->ids, ids, n * sizeof *ids);
}

/* Loads into the cache of the sequence with pages pt (NULL: the single
   cache), whose positions [0, from) hold ids[0, from) already, the rows
   of positions [from, L) from the file, L being the longest prefix of
   ids[0, n) the file holds, but at most n - 1: the last token is always
   prefilled, for its logits. Returns the positions now cached. */
static int pcache_load(PromptCache *pc, const Model *m, RunState *s, const PageTable *pt, const int *ids, int n, int from)
{
    if (!pc || !pc->data) return from;
    const Config *c = &m->c;
    int L = 0;
    while (L < pc->n && L < n - 1 && pc->ids[L] == ids[L]) L++;
    if (L <= from) {
        if (pc->verbose && !from) fprintf(stderr, "prompt cache: the prompt's first token differs from %s's\n", pc->path);
        return from;
    }
    double t0 = now_ms();
    const uint8_t *kv = pc->data + pcache_kv_at(pc->n);
    size_t seg = (size_t)pc->n * s->kv_row; /* one KV head's rows of one layer, K or V */
    for (int l = 0; l < c->n_layers; l++)
        for (int v = 0; v < 2; v++)
            for (int h = 0; h < c->n_kv_heads; h++, kv += seg)
                for (int pos = from, len; pos < L; pos += len) {
                    uint8_t *dst = kv_rows(s, pt, v, l, h, pos, L, &len);
                    memcpy(dst, kv + (size_t)pos * s->kv_row, (size_t)len * s->kv_row);
                }
    double ms = now_ms() - t0, mb = pcache_kv_bytes(c, s, L - from) / 1e6;
    if (pc->verbose)
        fprintf(stderr, "prompt cache: %d of the prompt's %d tokens loaded (%.1f MB of K and V) in %.1f ms (%.2f GB/s)\n", L - from,
                n, mb, ms, mb / 1e3 / (ms > 0 ? ms / 1e3 : 1e-6));
    return L;
}

/* Bytes into a file under construction, in PCACHE_BLOCK blocks, each
   added to the data checksum as it is written. */
typedef struct {
    int fd, err;        /* err: the first write's errno (0: all written) */
    uint8_t *buf;
    size_t len;
    uint64_t sum;
} CacheWriter;

static void cw_flush(CacheWriter *w)
{
    w->sum = xxh64(w->buf, w->len, w->sum);
    for (size_t at = 0; at < w->len && !w->err;) {
        ssize_t k = write(w->fd, w->buf + at, w->len - at);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) w->err = k < 0 ? errno : EIO;
        else at += k;
    }
    w->len = 0;
}

static void cw_put(CacheWriter *w, const void *p, size_t n)
{
    for (const uint8_t *q = p; n && !w->err;) {
        size_t k = PCACHE_BLOCK - w->len < n ? PCACHE_BLOCK - w->len : n;
        memcpy(w->buf + w->len, q, k);
        w->len += k, q += k, n -= k;
        if (w->len == PCACHE_BLOCK) cw_flush(w);
    }
}

/* Writes the file's bytes (header placeholder, ids, rows) into fd; returns 0 or an errno. */
static int pcache_write(CacheWriter *w, PromptCache *pc, const Model *m, RunState *s, const PageTable *pt, const int *ids, int n)
{
    const Config *c = &m->c;
    uint8_t *h = pc->head, zero[PCACHE_HEADER] = {0};
    if (write(w->fd, zero, PCACHE_HEADER) != PCACHE_HEADER) return errno ? errno : EIO; /* the header goes in last */
    for (int i = 0; i < n; i++) {
        int32_t id = ids[i];
        cw_put(w, &id, sizeof id);
    }
    cw_put(w, zero, pcache_kv_at(n) - PCACHE_HEADER - n * sizeof(int32_t));
    for (int l = 0; l < c->n_layers; l++)
        for (int v = 0; v < 2; v++)
            for (int hd = 0; hd < c->n_kv_heads; hd++)
                for (int pos = 0, len; pos < n; pos += len) {
                    const uint8_t *rows = kv_rows(s, pt, v, l, hd, pos, n, &len);
                    cw_put(w, rows, (size_t)len * s->kv_row);
                }
    if (w->len && !w->err) cw_flush(w);
    if (w->err) return w->err;
    put_u32(h + PC_TOKENS, n), put_u64(h + PC_DATA_SUM, w->sum), put_u64(h + PC_HEADER_SUM, xxh64(h, PC_HEADER_SUM, 0));
    if (pwrite(w->fd, h, PCACHE_HEADER, 0) != PCACHE_HEADER) return errno ? errno : EIO;
    return fsync(w->fd) ? errno : 0;
}

/* The rename of a file into path reaches the disk with its directory. */
static void sync_dir_of(const char *path)
{
    char dir[MSG_BYTES];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (!slash) strcpy(dir, ".");
    else slash[slash == dir] = 0; /* "/f" keeps "/" */
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

/* Writes the file under its temporary name, synced, and renames it over
   pc->path: 0, or an errno (temp_path removed). */
static int pcache_replace(PromptCache *pc, const Model *m, RunState *s, const PageTable *pt, const int *ids, int n)
{
    int e = 0;
    if (snprintf(temp_path, sizeof temp_path, "%s" PCACHE_TEMP_SUFFIX "%ld", pc->path, (long)getpid()) >= (int)sizeof temp_path)
        e = ENAMETOOLONG;
    CacheWriter w = {.fd = e ? -1 : open(temp_path, O_WRONLY | O_CREAT | O_EXCL, 0666)};
    if (!e && w.fd < 0) e = errno;
    else if (!e) {
        w.buf = xmalloc(PCACHE_BLOCK);
        e = pcache_write(&w, pc, m, s, pt, ids, n);
        free(w.buf);
        if (close(w.fd) != 0 && !e) e = errno;
        if (!e && rename(temp_path, pc->path) != 0) e = errno;
        if (e) unlink(temp_path);
    }
    temp_path[0] = 0;
    return e;
}

/* After prefill: the K and V rows of ids[0, n), cached for the sequence with
   pages pt (NULL: the single cache), become the file, unless the file read
   at the start holds them already and is still there unchanged (or the
   cache is read-only). Written under a temporary name in the same
   directory, synced and renamed over it: the file is the old one or the
   new one, whole, whatever happens (a full disk, a signal: temp_path is
   removed). A file put at the path since the start that is not a prompt
   cache is left as it is. A failure is a warning: the answer does not
   need the file. */
static void pcache_save(PromptCache *pc, const Model *m, RunState *s, const PageTable *pt, const int *ids, int n)
{
    if (!pc || pc->read_only || n < 1) return;
    int changed = pc->data && pcache_file_changed(pc);
    if (pcache_holds(pc, ids, n) && !changed) {
        if (pc->verbose) fprintf(stderr, "prompt cache: %s holds this prompt already: not rewritten\n", pc->path);
        return;
    }
    if (changed && pc->verbose) fprintf(stderr, "prompt cache: %s changed on disk since it was read: rewritten\n", pc->path);
    double t0 = now_ms();
    char why[MSG_BYTES];
    const char *problem = holds_other_data(pc->path, why, sizeof why);
    int e = problem ? 0 : pcache_replace(pc, m, s, pt, ids, n);
    if (problem || e) {
        char msg[LINE_BYTES];
        format_line(msg, "warning: cannot write the prompt cache %s: %s (the answer goes on without it)", pc->path,
                    problem ? problem : strerror(e));
        fputs(msg, stderr);
        return;
    }
    sync_dir_of(pc->path);
    pcache_close(pc); /* the file now holds no more than this run has: nothing further to load */
    if (pc->verbose)
        fprintf(stderr, "prompt cache: saved %d tokens (%.1f MB) to %s in %.1f ms\n", n,
                (pcache_kv_at(n) + pcache_kv_bytes(&m->c, s, n)) / 1e6, pc->path, now_ms() - t0);
}

/* With a prompt cache, a sliding-window layer keeps every position, as
   batch mode's pages do, instead of a ring of its last window +
   CHUNK_TOKENS: the file stores every position's rows, so that a later
   prompt can share any prefix of this one. Attention reads a layer's rows
   by position (cache_row), so nothing it computes changes; the memory is
   committed only as positions are written. */
static void keep_every_position(RunState *s, const Config *c)
{
    if (!c->window) return;
    free(s->key_cache);
    free(s->value_cache);
    for (int l = 0; l < c->n_layers; l++) {
        s->kv_cap[l] = s->seq_len;
        if (l + 1 < c->n_layers) s->kv_off[l + 1] = s->kv_off[l] + (size_t)c->n_kv_heads * s->seq_len;
    }
    s->key_cache = xcalloc(kv_cache_bytes(c, s->seq_len, s->kv_type, 1) / 2, 1);
    s->value_cache = xcalloc(kv_cache_bytes(c, s->seq_len, s->kv_type, 1) / 2, 1);
}

/* ----- lookup decoding --------------------------------------------------------
   Decode reads every weight once per token, but checking k guessed tokens
   costs about the same weight reads as producing one (verify_step). Text
   that copies from its input (summaries, extractions, edits, code) often
   continues with tokens the context already holds, so the guesses come
   from the context itself: a copy pointer into it. Where the end of the
   text matches an earlier stretch (the longest match, the latest of equal
   ones), the tokens that followed that stretch are the guesses, and the
   pointer then moves along with every token that matches, so a long copy
   (a function body) keeps drafting from the same place instead of
   searching again; a token that does not match drops it, and the next
   search starts from the text as it now ends. Greedy output stays byte for
   byte what plain decoding gives, because the verification pass computes
   each position exactly as a decode step; sampled output is drawn exactly
   as without lookup (see accept_drafts).

   How many to guess is a trade: a pass of m tokens costs more than a decode
   step wherever decode is not purely bound by memory (lookup_cost), and a
   guess only pays if it stands, which grows likelier the longer the match
   has held (lookup_odds). Both are measured while generating, the costs
   from the passes' own times, the odds from every token that met a
   pointer, drafted or not; lookup_plan then picks the guesses that give
   the most tokens per unit of time. */

#define LOOKUP_MATCH_MAX 32 /* tokens of the text's end compared when looking for a source */
#define LOOKUP_CLASSES 6    /* the odds are kept per class of run length: 1, 2-3, 4-7, 8-15, 16-31, 32+ */
#define LOOKUP_ANCHOR_RUN 4       /* a copy that held this many tokens leaves an anchor where it breaks off ... */
#define LOOKUP_RESYNC_WINDOW 16   /* ... to whose next tokens the answer may return after an edit ... */
#define LOOKUP_RESYNC_BEAT 4      /* ... unless a search finds a match of this many tokens elsewhere */
#define LOOKUP_PRIOR 2.0    /* weight, in observations, of a class's prior guess r / (r + 2) for a run of r */
#define LOOKUP_MEMORY 32.0  /* a class's counts fade by 1/this per observation: it follows the text */
#define LOOKUP_EMA 0.125    /* weight of a new pass in the measured pass costs ... */
#define LOOKUP_SPIKE 2.0    /* ... which count a pass at most this many times their average (a descheduled thread) */
#define LOOKUP_MARGIN 0.05  /* drafts must promise this much more speed than none: smaller gains drown in the costs' noise */
#define LOOKUP_DEFAULT (VERIFY_MAX_TOKENS - 1) /* --lookup: the longest draft */

/* What forward passes cost here, measured: the time of a pass of m
   tokens, per m. It is not proportional to m. A decode step's time goes to
   reading every weight once, which a few more tokens share at little cost
   while decode waits on memory; past that every token adds its arithmetic,
   in steps of the kernels' token tiles (on AVX2 a third token costs about
   what a fourth does). A size not timed yet is taken to cost what the
   cheapest token seen so far (a prefill chunk's, usually) would cost in it:
   a hopeful guess, which its first timing then corrects. */
typedef struct {
    double ms[CHUNK_TOKENS + 1]; /* ms[m]: a pass of m tokens, fading average (0: not timed yet) */
    double tok_ms;               /* the least time per token of any pass of several */
    int fixed; /* --lookup-fixed: every pass is planned as costing what one token's does, as where decode waits
                  on memory alone, so the drafts depend on the text only: the same on every machine and load (the
                  times are still taken, for -v) */
} PassCost;

typedef struct {
    int max;      /* --lookup: longest draft (0 = off) */
    int src, run; /* the copy pointer: ids[src] is the guess for the next token, after `run` matched tokens (src < 0: none) */
    int anchor;   /* where the last copy of LOOKUP_ANCHOR_RUN tokens or more broke off (0: none yet; it lies past
                     the text's first tokens), for lookup_resync */
    double seen[LOOKUP_CLASSES], stood[LOOKUP_CLASSES]; /* guesses met and guesses that stood, per run class, fading */
    PassCost cost; /* single-request mode's passes (batch mode keeps one for all its sequences) */
} Lookup;

/* Takes the time of a pass of m tokens into pc (a prefill of several
   chunks counts as chunks of CHUNK_TOKENS). */
static void lookup_time(PassCost *pc, int m, double ms)
{
    if (m > CHUNK_TOKENS) ms *= (double)CHUNK_TOKENS / m, m = CHUNK_TOKENS;
    pc->ms[m] = pc->ms[m] > 0 ? pc->ms[m] + LOOKUP_EMA * (fmin(ms, LOOKUP_SPIKE * pc->ms[m]) - pc->ms[m]) : ms;
    if (m > 1) pc->tok_ms = pc->tok_ms > 0 ? fmin(pc->tok_ms, ms / m) : ms / m;
}

/* The expected time of a pass of m tokens: its measured time, or the
   guess, kept between the times measured for fewer tokens and for more (a
   pass never costs less than a shorter one nor more than a longer one: a
   slow outlier at one size would otherwise keep the planner from ever
   timing it again). */
static double lookup_cost(const PassCost *pc, int m)
{
    if (pc->fixed) return 1;
    double t = pc->ms[m] > 0 ? pc->ms[m] : m * pc->tok_ms;
    for (int j = 1; j < m; j++) t = fmax(t, pc->ms[j]);
    for (int j = m + 1; j <= CHUNK_TOKENS; j++)
        if (pc->ms[j] > 0) t = fmin(t, pc->ms[j]);
    return t;
}

static int lookup_class(int run)
{
    int c = 0;
    while (run > 1 && c < LOOKUP_CLASSES - 1) run >>= 1, c++;
    return c;
}

/* The probability that the guess after a match of `run` tokens stands:
   what its class has seen, starting from r / (r + 2). */
static double lookup_odds(const Lookup *lk, int run)
{
    int c = lookup_class(run);
    return (lk->stood[c] + LOOKUP_PRIOR * run / (run + 2.0)) / (lk->seen[c] + LOOKUP_PRIOR);
}

/* How many tokens ending at ids[i] equal those ending at ids[n - 1] (at
   most LOOKUP_MATCH_MAX; i < n - 1). */
static int lookup_match(const int *ids, int i, int n)
{
    int g = 0;
    while (g < LOOKUP_MATCH_MAX && g <= i && ids[i - g] == ids[n - 1 - g]) g++;
    return g;
}

/* Where to copy from when ids[0..n) ends as it does: the earlier position
   whose preceding tokens match the longest end of the text (at most
   LOOKUP_MATCH_MAX tokens; of equal ones the latest). Sets *src to the
   index of the token that followed it and returns the match's length, 0
   when the last token never occurred before. */
static int lookup_draft(const int *ids, int n, int *src)
{
    int best = 0;
    for (int i = n - 2; i >= 0 && best < LOOKUP_MATCH_MAX; i--) {
        int g = lookup_match(ids, i, n);
        if (g > best) best = g, *src = i + 1;
    }
    return best;
}

/* After an edit the answer usually goes back to the copy it left a few
   tokens on: a replaced name, an inserted type hint or argument. The
   longest match misses that, since the edit's tokens are in the end it
   compares, and a short match elsewhere (a bracket, a newline) wins. So
   when the search found no match of LOOKUP_RESYNC_BEAT tokens, the first
   of the LOOKUP_RESYNC_WINDOW tokens at the anchor (where the last long
   copy broke off) that equals the last token becomes the source instead.
   Its run counts one more than its match: the copy it continues vouches
   for it (measured on code edits: a one-token match there stood about as
   often as a two-token match found by search). */
static void lookup_resync(Lookup *lk, const int *ids, int n)
{
    for (int a = lk->anchor; a < n - 1 && a < lk->anchor + LOOKUP_RESYNC_WINDOW; a++)
        if (ids[a] == ids[n - 1]) {
            lk->run = lookup_match(ids, a, n) + 1, lk->src = a + 1;
            return;
        }
}

/* After ids[n - 1] joined the text: with a pointer, that token is one
   observation of its run class (did the guess stand, drafted or not) and
   moves the pointer on, or drops it (where a long copy broke off becomes
   the anchor); without one, a new source is looked for, and back at the
   anchor when nothing long matches (lookup_resync). */
static void lookup_adapt(Lookup *lk, const int *ids, int n)
{
    if (!lk->max) return;
    if (lk->src >= 0) {
        int c = lookup_class(lk->run), hit = ids[lk->src] == ids[n - 1];
        lk->seen[c] = lk->seen[c] * (1 - 1 / LOOKUP_MEMORY) + 1;
        lk->stood[c] = lk->stood[c] * (1 - 1 / LOOKUP_MEMORY) + hit;
        if (hit) {
            lk->src++, lk->run++;
            return;
        }
        if (lk->run >= LOOKUP_ANCHOR_RUN) lk->anchor = lk->src;
    }
    lk->run = lookup_draft(ids, n, &lk->src);
    if (lk->run < LOOKUP_RESYNC_BEAT && lk->anchor > 0) lookup_resync(lk, ids, n);
    if (!lk->run) lk->src = -1;
}

/* The drafts of one forward pass shared by n sequences (one in the
   single-request mode; every sequence decoding in batch mode), each
   feeding one token: sequence i may guess up to room[i] tokens from its
   pointer. Whatever the pass's size, the guesses worth making are the
   likeliest to stand (the j-th guess of a sequence stands only if the
   j - 1 before it do), so they are ranked so, and the pass takes as many
   as give the most expected tokens per unit of time (none: plain decode
   steps, unless drafts promise LOOKUP_MARGIN more), at most max_rows tokens
   in all. Until a pass of the n tokens alone has been timed, none: that is
   the time the drafts must beat. Sets k[i]; returns the pass's tokens. */
static int lookup_plan(Lookup *const *lk, const int *room, int n, const PassCost *pc, int max_rows, int *k)
{
    double odds[BATCH_MAX], yield = n, best_rate = pc->fixed || pc->ms[n] > 0 ? n / lookup_cost(pc, n) * (1 + LOOKUP_MARGIN) : INFINITY;
    int pick[BATCH_MAX], best_rows = n;
    for (int i = 0; i < n; i++) {
        k[i] = 0;
        odds[i] = room[i] > 0 ? lookup_odds(lk[i], lk[i]->run) : 0;
    }
    for (int rows = n; rows < max_rows; rows++) {
        int best = -1;
        for (int i = 0; i < n; i++)
            if (k[i] < room[i] && (best < 0 || odds[i] > odds[best])) best = i;
        if (best < 0) break;
        pick[rows - n] = best;
        yield += odds[best];
        odds[best] *= lookup_odds(lk[best], lk[best]->run + ++k[best]);
        if (yield / lookup_cost(pc, rows + 1) > best_rate) best_rate = yield / lookup_cost(pc, rows + 1), best_rows = rows + 1;
    }
    for (int i = 0; i < n; i++) k[i] = 0;
    for (int j = 0; j < best_rows - n; j++) k[pick[j]]++;
    return best_rows;
}

/* -v: what a pass of one token and one of VERIFY_MAX_TOKENS cost on this
   machine, as timed during the run (their fading averages): the ratio
   bounds what lookup can gain, whatever the drafts. */
static void lookup_report(const PassCost *pc)
{
    double one = pc->ms[1], full = pc->ms[VERIFY_MAX_TOKENS];
    if (one <= 0) return; /* no decode step yet */
    if (full > 0)
        fprintf(stderr, "lookup cost: a pass of 1 token %.2f ms, of %d tokens %.2f ms (%.2fx)\n", one, VERIFY_MAX_TOKENS,
                full, full / one);
    else
        fprintf(stderr, "lookup cost: a pass of 1 token %.2f ms, of %d tokens not timed\n", one, VERIFY_MAX_TOKENS);
}

/* How many guesses the pointer has for text t: what the source holds,
   at most --lookup and `limit`. */
static int lookup_room(const Lookup *lk, const Tokens *t, int limit)
{
    return lk->src >= 0 ? max_i(0, min_i(min_i(lk->max, limit), t->n - lk->src)) : 0;
}

/* ----- the generation loop's hooks ------------------------------------------------
   How the features above enter Part I's generation loop (take_token,
   decode_next, generate), which batch mode runs too: the JSON mask on the
   draws and on the text, lookup decoding's passes, the prompt cache after
   the prompt, the --logprobs records. Each pointer is NULL when its
   feature is off. */
struct Hooks {
    JsonMask *jm;       /* --json: the grammar's mask (NULL: free text) */
    Lookup *lk;         /* lookup decoding's pointer into the context (NULL: off; batch mode plans its own passes) */
    PromptCache *cache; /* --prompt-cache: where the prompt's K and V go once prefilled (NULL: nowhere) */
    Buf *records;       /* --logprobs: the records, comma-separated (NULL: each a line of stdout) */
    StopMatch stop;     /* --stop: the matcher the text goes through (stop.stops NULL: none) */
    int verbose;        /* -v */
    Lookup own_lk;      /* single-request mode's: lk points here */
    Logprobs lp;        /* single-request mode's: the draws report here */
};

/* A single request's hooks, from the command line, and r's share of the
   loop's state. */
static void hooks_open(Request *r, const Model *m, RunState *s, Sampler *sm, const GenOpts *o)
{
    Hooks *h = xcalloc(1, sizeof *h);
    h->lp = (Logprobs){.want = o->logprobs};
    sm->report = o->logprobs >= 0 ? &h->lp : NULL;
    h->jm = o->json ? grammar_mask_new(o->json, m->c.vocab_size) : NULL;
    h->own_lk = (Lookup){.max = o->lookup, .src = -1, .cost.fixed = o->lookup_fixed};
    h->lk = o->lookup ? &h->own_lk : NULL;
    h->cache = o->cache, h->verbose = o->verbose, h->stop.stops = o->stops;
    r->m = m, r->s = s, r->sm = sm, r->h = h;
    r->cand = xmalloc((size_t)m->c.vocab_size * sizeof(Candidate));
    r->ignore_eos = o->ignore_eos && !h->jm; /* the mask allows an end token only once the value is complete */
}

/* The tokens the next draw may take: the JSON mask's, or NULL for all. */
static const uint8_t *hook_allowed(Request *r) { return r->h->jm ? grammar_mask_allowed(r->h->jm) : NULL; }

/* A token's --logprobs record: a line of stdout, or into the records. */
static void hook_logprobs(Request *r, int token)
{
    Buf *b = r->h->records;
    if (!b) { put_logprobs_line(r->m, token, r->sm->report); return; }
    if (b->len) buf_put(b, ", ", 2);
    logprobs_record(b, r->m, token, r->sm->report);
}

/* A token taken: its text (NULL for an end or control token: no text)
   moves the JSON automaton and goes out through the stop matcher. Returns
   STOP_STRING or STOP_JSON_DONE when that ends the answer, else -1. */
static int hook_text(Request *r, int token, const char *text, size_t len)
{
    JsonMask *jm = r->h->jm;
    if (jm && !grammar_mask_take(jm, text, len))
        die(EXIT_RUNTIME, "internal error: token %d broke the JSON output's grammar", token);
    if (text && stop_put(&r->h->stop, r->out, text, len)) return STOP_STRING;
    if (jm && grammar_mask_done(jm)) return STOP_JSON_DONE;
    return -1;
}

/* The draft-acceptance loop, in both modes: after a pass that fed r's last
   token (at r->pos) and k drafts after it, logits holding the k + 1 rows,
   each row is sampled as a decode step's would be, the same draw from the
   same generator, and the token drawn is taken; a draft stands when the
   draw equals it, and then the next row follows. For a draft of one token
   that is exact speculative sampling: it stands with probability p(d),
   and when it falls the token is distributed as p without d,
   renormalized. And since the draws are those of plain decoding, a seed
   gives the same text with or without lookup, whatever number of drafts
   the plan chose. The cache rows of drafts that fell lie past r->pos, and
   the next pass writes them again before any query reads them. Returns
   STOP_* or -1; *taken gets the number of tokens taken. */
static int accept_drafts(Request *r, float *logits, const int *drafts, int k, int *taken)
{
    int vocab = r->m->c.vocab_size;
    r->pos++;
    for (int i = 0;; i++) {
        int next = sample_next(r, logits + (size_t)i * vocab);
        int stood = i < k && next == drafts[i];
        r->st.accepted += stood;
        *taken = i + 1;
        int why = take_token(r, next);
        if (!stood || why >= 0) return why;
        push(r->conv, next);
        r->pos++;
        lookup_adapt(r->h->lk, r->conv->ids, r->conv->n);
    }
}

/* Single-request mode's decode step with lookup decoding (returns 0 when
   it is off: the plain step runs): after the token fed, the pointer's
   drafts, as many as lookup_plan finds worth their cost, in one
   verification pass, and accept_drafts takes the tokens. */
static int hook_decode(Request *r, int *why, int *yielded)
{
    Lookup *lk = r->h->lk;
    if (!lk) return 0;
    Tokens *conv = r->conv;
    int batch[VERIFY_MAX_TOKENS], k;
    lookup_adapt(lk, conv->ids, conv->n);
    int room = lookup_room(lk, conv, min_i(r->s->seq_len - r->pos - 1, r->n_predict - r->st.n_gen));
    lookup_plan(&lk, &room, 1, &lk->cost, VERIFY_MAX_TOKENS, &k);
    double t0 = now_ms();
    batch[0] = r->last;
    if (k == 0) decode_step(r->m, r->s, r->last, r->pos);
    else memcpy(batch + 1, conv->ids + lk->src, k * sizeof *batch), verify_step(r->m, r->s, batch, k + 1, r->pos);
    lookup_time(&lk->cost, k + 1, now_ms() - t0);
    r->st.drafted += k;
    *why = accept_drafts(r, r->s->logits, batch + 1, k, yielded);
    return 1;
}

/* After the prefill of n tokens: its time per token is lookup's guess at
   the cost of a large pass. */
static void hook_prefilled(Request *r, int n, double ms)
{
    if (r->h->lk && n > 0) lookup_time(&r->h->lk->cost, n, ms);
}

/* The prompt's first n tokens are cached (and its first token is out):
   their K and V go to --prompt-cache. */
static void hook_prompt(Request *r, int n)
{
    if (r->h->cache) pcache_save(r->h->cache, r->m, r->s, NULL, r->conv->ids, n);
}

/* What ended an answer whose JSON value is incomplete (generate's why),
   for the message: "-n", "the end of the context", "Ctrl-C" or the stop
   string, e.g. "stop string 2 (',')". */
static const char *stop_cause(int why, const StopMatch *m, char *buf, size_t len)
{
    if (why == STOP_STRING) {
        int k = m->hit - 1;
        snprintf(buf, len, "stop string %d ('%.*s')", k + 1, m->stops->len[k], m->stops->text[k]);
        return buf;
    }
    return why == STOP_CONTEXT ? "the end of the context" : why == STOP_INTERRUPT ? "Ctrl-C" : "-n";
}

/* The end of a single request's answer (generate's last step before the
   prompt cache's): what the stop matcher held, the unfinished character,
   the JSON mask's verdict and statistics into r->st. */
static void hook_answer_end(Request *r)
{
    Hooks *h = r->h;
    stop_end(&h->stop, r->out);
    text_end(r->out);
    if (h->verbose && h->stop.hit) fprintf(stderr, "stopped at stop string %d\n", h->stop.hit);
    if (h->verbose && h->lk) lookup_report(&h->lk->cost);
    r->sm->report = NULL;
    if (h->jm) grammar_mask_end(h->jm, &r->st);
}

/* After a single request, its statistics reported: whether its JSON value
   was left incomplete (what stopped generation then goes to stderr, as a
   warning, or with fatal as the run's error); the hooks are freed. */
static int hooks_close(Request *r, int why, int fatal)
{
    Hooks *h = r->h;
    int incomplete = r->st.json_incomplete;
    char cause[STOP_MAX_BYTES + 32], msg[LINE_BYTES];
    if (incomplete && fatal)
        die(EXIT_RUNTIME, "the JSON value is incomplete: generation stopped at %s", stop_cause(why, &h->stop, cause, sizeof cause));
    if (incomplete) {
        format_line(msg, "this answer is not a complete JSON value: generation stopped at %s", stop_cause(why, &h->stop, cause, sizeof cause));
        fputs(msg, stderr);
    }
    free(r->cand);
    free(h);
    r->h = NULL;
    return incomplete;
}

/* Before a single request's prefill: how many of t's first tokens the KV
   cache holds, pos or, from --prompt-cache, more. */
static int cached_prefix(const GenOpts *o, const Model *m, RunState *s, const Tokens *t, int pos)
{
    return pcache_load(o->cache, m, s, NULL, t->ids, t->n, pos);
}

/* ----- input ------------------------------------------------------------------ */

#define BYTE_VALUES 256

/* Whether text[0..len) holds a byte the vocabulary has no token for, and
   if so the reason, naming `what`, the byte and its offset, in why. A
   byte-level BPE vocabulary may lack some byte values (SmolLM2 lacks 21
   that UTF-8 text hardly uses, e.g. 0xff); tok_encode drops them, as
   llama.cpp does, so the model would read another text than the one
   given: every prompt text (-i, stdin, -y, chat messages, batch lines) is
   refused instead, in --tokenize too. A byte value has no token when it alone
   encodes to nothing; only the values the text holds are tried. */
static int has_untokenizable_byte(const Model *m, const char *what, const char *text, size_t len, char *why, size_t why_len)
{
    uint8_t seen[BYTE_VALUES] = {0}, lacks[BYTE_VALUES] = {0};
    const unsigned char *u = (const unsigned char *)text;
    for (size_t i = 0; i < len; i++) {
        if (!seen[u[i]]) {
            int *ids;
            size_t n;
            if (tok_encode(m->tok, text + i, 1, 0, &ids, &n) != 0) die(EXIT_RUNTIME, "out of memory tokenizing");
            free(ids);
            seen[u[i]] = 1, lacks[u[i]] = n == 0;
        }
        if (lacks[u[i]]) {
            snprintf(why, why_len, "%s has a byte 0x%02x (at offset %zu) that no token of this model's vocabulary holds "
                     "(is the text UTF-8?)", what, u[i], i);
            return 1;
        }
    }
    return 0;
}


/* Whether the prompt text, or with ch its system text, has a byte without
   a token (why gets the reason). */
static int prompt_text_problem(const Model *m, const char *text, size_t len, const Chat *ch, char *why, size_t why_len)
{
    return has_untokenizable_byte(m, "the prompt", text, len, why, why_len) ||
           (ch && has_untokenizable_byte(m, "the system prompt", ch->system, ch->system_len, why, why_len));
}


/* Reads f up to its end, or with `line` up to the next newline (dropped),
   into a malloc'd, NUL-terminated buffer; *len gets its length. Returns
   NULL at the end of input when a line was asked and nothing was read. A
   read error, running out of memory, or more than max bytes (why_max says
   where that bound comes from) ends the run with a message naming `what`:
   /dev/zero must not fill the memory. */
static char *read_stream(FILE *f, const char *what, int line, size_t max, const char *why_max, size_t *len)
{
    size_t cap = 4096, n = 0;
    char *buf = xmalloc(cap);
    int c;
    errno = 0;
    while ((c = getc(f)) != EOF && !(line && c == '\n')) {
        if (n == max) die(EXIT_RUNTIME, "%s is longer than %zu bytes: %s", what, max, why_max);
        if (n + 1 == cap && !(buf = realloc(buf, cap *= 2))) die(EXIT_RUNTIME, "out of memory reading %s", what);
        buf[n++] = (char)c;
    }
    if (ferror(f)) die(EXIT_RUNTIME, "cannot read %s: %s", what, strerror(errno ? errno : EIO));
    if (line && c == EOF && n == 0) { free(buf); return NULL; }
    buf[n] = 0;
    *len = n;
    return buf;
}

/* The most bytes of text that can fit in ctx tokens: a token stands for
   at most as many input bytes as its text holds (BOS and EOS for none,
   bytes without a token for none, but those make no prompt). Reading
   stops there; why gets the reason, for the error message. */
static size_t text_limit(const Model *m, int ctx, char *why, size_t why_len)
{
    size_t longest = 1, len;
    for (int id = 0; id < tok_get_info(m->tok)->n_vocab; id++)
        if (tok_piece(m->tok, id, &len) && len > longest) longest = len;
    snprintf(why, why_len, "more cannot fit in a context of %d tokens (the longest token is %zu bytes)", ctx, longest);
    return (size_t)ctx * longest;
}

/* ----- chat mode ---------------------------------------------------------------
   -m chat: a conversation on stdin, one answer per message, through the
   generation loop of Part I (generate); earlier turns stay in the KV cache. */

/* After an answer: the last sampled token, if it was text, goes into the
   conversation, then the turn is closed (the template's end token, e.g.
   <|im_end|>\n). After a stop string the token whose text completed it
   is left out: the conversation
   continues from the tokens fed so far, which may hold the stop string's
   beginning (when it spans tokens) though it was not printed, and lack
   the printed text that shared the last token with it. */
static void chat_close_answer(const Chat *ch, const Model *m, Tokens *conv, int why, int last)
{
    if (why != STOP_END && why != STOP_STRING && last >= 0) push(conv, last);
    chat_turn_close(ch, m, conv);
}


/* When the conversation plus room for an answer no longer fits, drops the
   oldest exchanges (keeping the opening: BOS and system turn) until it fits
   in half the context, or at least fits, so that the next turns can reuse
   the cache again; everything is then re-prefilled. Returns 0 when even the
   newest message alone does not fit. exch[] holds the offset in conv where
   each exchange starts. */
static int chat_fit(Tokens *conv, int *pos, Tokens *exch, int n_open, int need, int seq_len)
{
    if (conv->n + need <= seq_len) return 1;
    int k = 0, *at = exch->ids;
    while (k < exch->n - 1 && n_open + conv->n - at[k] + need > seq_len / 2) k++;
    while (k > 0 && n_open + conv->n - at[k - 1] + need <= seq_len / 2) k--;
    if (n_open + conv->n - at[k] + need > seq_len) return 0;
    int drop = at[k] - n_open;
    memmove(conv->ids + n_open, conv->ids + at[k], (conv->n - at[k]) * sizeof(int));
    conv->n -= drop;
    for (int i = k; i < exch->n; i++) at[i - k] = at[i] - drop;
    exch->n -= k;
    *pos = 0;
    return 1;
}

static void on_sigint(int sig)
{
    (void)sig;
    if (answering && !interrupted) interrupted = 1;
    else {
        if (temp_path[0]) unlink(temp_path); /* a prompt cache being written */
        _exit(130);
    }
}

/* A refused chat message (line: its text, freed) gets an empty answer,
   which keeps answers and messages line for line. */
static void refuse_message(char *line)
{
    free(line);
    fputc('\n', stdout);
    check_stdout();
}

/* After a message did not fit: when not even an empty one would (the
   opening's n_open tokens, an empty user turn and the assistant's opening,
   with the system text when the template folds it into the message, and
   the answer's room), every message would be refused, so the chat ends
   with an error, as -c does with such a system prompt. */
static void check_room_for_a_message(const Chat *ch, const Model *m, int n_open, int reserve, int seq_len)
{
    Chat c = *ch;
    Tokens t = {0};
    chat_user_turn(&c, m, &t, "", 0);
    int least = n_open + t.n;
    free(t.ids);
    if (least + reserve > seq_len)
        die(EXIT_RUNTIME, "the system prompt leaves no room for a message: the template's turns (%d tokens, the system "
            "text's included) + room for the answer (%d) = %d tokens, but the context holds %d", least, reserve,
            least + reserve, seq_len);
}

/* The conversation: one user message per line of stdin (a terminal shows a
   "> " prompt on stderr); each answer is streamed and ends with a newline.
   Each turn prefills only its new tokens: earlier turns stay in the cache.
   Ctrl-C stops an answer; Ctrl-C at the prompt, or end of input, exits,
   with an error if a --json answer was cut short before its value ended. */
static void chat_loop(const Model *m, RunState *s, Sampler *sm, const GenOpts *o, const Machine *mc)
{
    int incomplete = 0; /* --json: answers cut short before their value was complete */
    Chat ch;
    build_chat(&ch, m, o->system, o->system ? strlen(o->system) : 0);
    ch.special = o->special;
    Tokens conv = {0};
    chat_open(&ch, m, &conv);
    int n_open = conv.n, pos = 0, tty = isatty(STDIN_FILENO), turn = 0;
    Tokens exch = {0}; /* where each exchange (a message and its answer) starts in conv */
    char why_max[ERR_BYTES];
    size_t len, max_line = text_limit(m, s->seq_len, why_max, sizeof why_max);
    struct sigaction sa = {0};
    sa.sa_handler = on_sigint;
    sigaction(SIGINT, &sa, NULL);
    int reserve = o->n_predict < s->seq_len / 4 ? o->n_predict : s->seq_len / 4;
    char why[ERR_BYTES];
    if (has_untokenizable_byte(m, "the system prompt", ch.system, ch.system_len, why, sizeof why)) die(EXIT_RUNTIME, "%s", why);
    while (1) {
        if (tty) fputs("> ", stderr);
        char *line = read_stream(stdin, "a chat message on stdin", 1, max_line, why_max, &len);
        if (!line) break;
        while (len && line[len - 1] == '\r') line[--len] = 0;
        if (!len) { free(line); continue; }
        if (has_untokenizable_byte(m, "message refused: it", line, len, why, sizeof why)) {
            fprintf(stderr, "run: %s\n", why);
            refuse_message(line);
            continue;
        }
        int before = conv.n, system_pending = ch.system_pending;
        push(&exch, conv.n);
        chat_user_turn(&ch, m, &conv, line, len);
        free(line);
        if (!chat_fit(&conv, &pos, &exch, n_open, reserve, s->seq_len)) {
            int msg = conv.n - before;
            conv.n = before;
            exch.n--;
            ch.system_pending = system_pending;
            check_room_for_a_message(&ch, m, n_open, reserve, s->seq_len);
            fprintf(stderr, "run: message too long: the conversation's opening (%d tokens) + this message (%d) + room for the answer (%d)"
                    " = %d tokens, but the context holds %d\n", n_open, msg, reserve, n_open + msg + reserve, s->seq_len);
            refuse_message(NULL);
            continue;
        }
        pos = cached_prefix(o, m, s, &conv, pos); /* what an earlier run's conversation holds */
        if (o->verbose)
            fprintf(stderr, "turn %d: prefill %d new tokens (%d already cached)\n", ++turn, conv.n - pos, pos);
        interrupted = 0;
        answering = 1;
        TextOut out;
        text_open(&out, o->logprobs >= 0 ? NULL : stdout, NULL);
        Request r = {.conv = &conv, .pos = pos, .n_predict = o->n_predict, .out = &out};
        int why = generate(m, s, sm, o, &r);
        pos = r.pos;
        answering = 0;
        fputc('\n', stdout);
        check_stdout();
        if (why == STOP_CONTEXT && !r.st.json_incomplete) /* else hooks_close's line names the cause */
            fprintf(stderr, "run: answer stopped at the context limit (%d tokens)\n", s->seq_len);
        incomplete += hooks_close(&r, why, 0);
        if (o->verbose) report_stats(m, s, mc, &r.st);
        free(r.st.itl);
        chat_close_answer(&ch, m, &conv, why, r.last);
    }
    free(exch.ids);
    free(conv.ids);
    if (incomplete) die(EXIT_RUNTIME, "%d answer%s not a complete JSON value", incomplete, incomplete > 1 ? "s were" : " was");
}


/* ----- batch mode ---------------------------------------------------------------
   --batch FILE: one request per input line, answered as one JSON record per
   line, in input order. Decode reads every weight once per token; one
   pass that decodes a token for each of B sequences still reads them once,
   so while decode is bound by memory rather than arithmetic, B sequences
   cost little more than one (continuous batching). A finished sequence
   leaves at once and the next line takes its place; a new prompt is
   prefilled a chunk at a time between decode steps, so the sequences in
   flight never stall for a whole long prompt.

   The KV cache is one pool of pages (vLLM's paged attention): a sequence
   holds a table of the pages its prompt and answer can fill, all reserved
   when it is admitted, so it never runs out of room halfway; when the
   pool is short, admission waits for sequences to finish. Whole pages of
   a prompt prefix that a sequence in flight already holds (a shared system
   prompt, a few-shot header) are shared by reference, not computed and
   stored again.

   Each record's text is what the same prompt gives alone: a token's
   numbers do not depend on the pass that computes it or on what else is
   in it (a decode step computes each sequence's token exactly as
   decode_step would, see decode_batch; a prompt's pieces may start
   anywhere). Sampling draws from a generator seeded by -s and the line
   number, so a record does not depend on what else is in the batch. */

/* A sequence's KV cache in batch mode: its positions in pages of
   PAGE_TOKENS, each page one slab per layer: slab[i * n_layers + l] is the
   pool slab holding layer l's rows of positions [i * PAGE_TOKENS, (i + 1) *
   PAGE_TOKENS). A slab of a prompt prefix that several sequences share is
   one pool slab in each of their tables. A sliding-window layer's slabs are
   taken as the sequence's passes reach them and given back once no later
   query can see them (page_window); the first `released` pages' local
   entries then name the pool's spare slab, which only masked keys are
   ever read from. */
typedef struct PageTable {
    int *slab;    /* [n * n_layers] pool slab ids; -1: a local layer's, not taken yet */
    int n;        /* pages reserved */
    int released; /* pages whose local layers' slabs were given back */
    int budget;   /* local slabs admission counted for it: the most it holds at once */
    int freed;    /* local slabs it gave back that went back to the pool (for -v) */
} PageTable;

/* cache_row in a paged cache: the slab that token t's sequence's page
   table names for layer l at position pos. */
static uint8_t *paged_row(const RunState *s, uint8_t *cache, int t, int l, int h, int pos)
{
    const Config *c = s->c;
    if (!s->mx->paged) return NULL;
    size_t slab = s->mx->tok_pages[t]->slab[(size_t)(pos / PAGE_TOKENS) * c->n_layers + l];
    return cache + ((slab * c->n_kv_heads + h) * PAGE_TOKENS + pos % PAGE_TOKENS) * s->kv_row;
}

#define BATCH_KV_MB 1024     /* --kv-mem default: the page pool, MB */
#define BATCH_DEFAULT_MAX 32 /* --parallel default at most */
#define BATCH_JSON_SLACK 6   /* a JSON line may spell each byte of its prompt as \u00XX */
#define UTF8_BOM "\xef\xbb\xbf"  /* a byte order mark, which some editors put first in a file */
#define PROGRESS_MS 250      /* the progress line on a terminal is redrawn at most this often */
#define PROGRESS_LOG_MS 2000 /* -v without a terminal: a progress line this often */
#define MAX_POOL_PAGES (1 << 22)
#define MAX_POOL_SLABS (1 << 24) /* the free stack is committed: 64 MB at most */

_Static_assert(BATCH_MAX <= CHUNK_TOKENS, "one decode step of every sequence in flight is one pass");

/* n tokens at positions pos0.. of the sequence whose KV pages are pt: a
   prefill chunk of batch mode (forward_at's twin for a paged cache). */
static void forward_pages(const Model *m, RunState *s, const PageTable *pt, const int *tokens, int n, int pos0, int first_logit)
{
    s->mx->paged = 1;
    for (int t = 0; t < n; t++) s->tok_pos[t] = pos0 + t, s->mx->tok_pages[t] = pt;
    forward_on_pool(m, s, tokens, n, first_logit);
}

/* Batch mode's decode step: one token of each of n sequences (token t at
   position pos[t] of the sequence whose pages are pages[t]), the logits of
   tokens [first_logit, n) in s->logits rows 0..; the tokens before
   first_logit are prompt tokens that ride along and need none. Like verify_step, every token is computed as a
   decode step would compute it alone, so a sequence's text does not
   depend on what else is in the batch; the weights are read once for all n. */
static void decode_batch(const Model *m, RunState *s, const int *tokens, const int *pos, const PageTable *const *pages, int n,
                         int first_logit)
{
    s->mx->paged = 1;
    for (int t = 0; t < n; t++) s->tok_pos[t] = pos[t], s->mx->tok_pages[t] = pages[t];
    s->mx->scattered = 1;
    forward_on_pool(m, s, tokens, n, first_logit);
    s->mx->scattered = 0;
}

/* The KV cache's slabs: free ones, and how many page tables hold each.
   Admission never promises more than the pool holds: `committed` counts
   the global layers' slabs in use (taken when a sequence is admitted) and,
   for every sequence in flight, the most slabs its sliding-window layers
   hold at once (taken and given back as it goes). Slabs in use are at most
   that: each local slab is held by some sequence within its budget. */
typedef struct {
    int n_pages;           /* the pool in pages of every layer: what --kv-mem holds */
    int n_slabs;           /* n_pages * n_layers; slab n_slabs is the spare */
    int *free_ids, n_free; /* a stack: the slab freed last is reused first, its memory already resident */
    int *refs;             /* [n_slabs] */
    int committed;         /* slabs promised: see above */
    int spare;             /* what released local pages point to: never written, its (zero) keys read only masked */
    int n_local;           /* sliding-window layers whose pages go back to the pool (0: none; see pool_local) */
    int local_pages;       /* the most pages a sequence's sliding-window layers hold at once */
    int peak;              /* most slabs in use at once */
    int live_freed;        /* local slabs given back by sequences still in flight ... */
    int peak_kept;         /* ... and the most slabs in use at once had they been kept to the end (-v) */
} PagePool;

enum { SEQ_IDLE, SEQ_PREFILL, SEQ_DECODE };
/* A record's "finish", by STOP_*: an end token, a stop string and a complete JSON value are all "stop". */
static const char *const FINISH[] = {[STOP_END] = "stop", [STOP_LIMIT] = "length", [STOP_CONTEXT] = "context",
                                     [STOP_INTERRUPT] = "interrupted", [STOP_STRING] = "stop", [STOP_JSON_DONE] = "stop"};

/* One request: a line of input, then a sequence in flight. */
typedef struct {
    int state;         /* SEQ_* */
    long line;         /* 1-based input line: the record's place in the output */
    long order;        /* admission order: prompts are prefilled first come, first served */
    Buf id;            /* the record's "id" as JSON text */
    Tokens toks;       /* the prompt, then every token fed */
    int n_prompt;      /* prompt tokens */
    Request r;         /* the answer: r.pos positions cached, r.n_predict (r.capped: cut to what the context or the
                          pool holds), r.last the token sampled and not yet fed, r.st.n_gen tokens generated */
    Hooks hk;          /* r's hooks: into jm, lk, logprobs */
    int json_incomplete; /* with jc: the answer ended before its value was complete */
    Sampler sm;
    Logprobs lp;       /* the last draw's log-probabilities, with lp.want >= 0 ("logprobs") */
    Buf logprobs;      /* the records of every token drawn, comma-separated */
    PageTable pt;
    Stops stops;       /* "stop", or --stop */
    const JsonConstraint *jc; /* "json", "schema", or --json / --json-schema: the grammar of the answer (NULL: none) */
    int own_jc;        /* jc is this line's "schema", freed with it */
    JsonMask jm;       /* with jc: where the automaton stands */
    TextOut out;       /* the answer's text goes through the stop matcher into text */
    Buf text;
    Lookup lk;         /* lookup decoding's pointer into toks, and its odds */
    double t_admit, t_first, t_prev;
} Seq;

/* The records, kept until every earlier line's record is out. */
typedef struct {
    Buf *rec;          /* [cap] by line - first, ring-free: shifted as records go out */
    char *ready;
    long first, cap;   /* the first line not yet written; slots */
} Records;

/* The input, read with read(2) rather than stdio so that the scheduler
   can tell whether a whole line has arrived without blocking: while
   sequences are in flight, a slow producer (`tail -f requests | run
   --batch -`) must not stall them. */
typedef struct {
    int fd;
    const char *name;   /* the input, for messages: its path, or "the --batch input on stdin" */
    char *buf;          /* bytes read and not yet taken: [start, end) */
    size_t start, end, cap, scanned; /* scanned: bytes after start known to hold no newline */
    int eof;
    int dropping;       /* the line being read is too long: its bytes are dropped up to its newline */
    size_t dropped;     /* ... this many so far */
    int endless;        /* a too long line ran on past BATCH_SKIP_MAX bytes: the input was given up */
} LineReader;

#define READ_CHUNK 65536
#define BATCH_SKIP_MAX (64u << 20) /* bytes of a too long line skipped to find the next line; past them the
                                      input is given up (/dev/zero has no next line) */

typedef struct {
    const Model *m;
    RunState *s;
    const GenOpts *o;
    Sampler defaults;  /* the command line's sampler (-t, -p, -k, --min-p, the penalties) */
    unsigned long long seed;
    int chat, special; /* -c, --special: the defaults of "chat" */
    const char *no_chat; /* why this model cannot take "chat" lines, or NULL (checked once) */
    LineReader in;
    size_t max_line;
    long lines, total; /* lines read; lines in the file (-1: unknown) */
    int eof;
    long failed;       /* records that are errors or JSON answers left incomplete: exit status 1 */
    Seq *seq;
    int parallel, in_flight;
    long admitted;
    Seq pending;       /* a request read but not yet admitted (line 0: none) */
    VocabTrie trie;    /* the vocabulary's trie, built when a line first asks for JSON */
    int have_trie;
    JsonConstraint plain; /* "json": true: any JSON value */
    int have_plain;
    PagePool pool;
    Records out;
    Candidate *cand;
    int progress_shown; /* the progress line is on the terminal, unfinished: erase it before writing there */
    /* statistics */
    double t0, last_progress, prefill_ms;
    long done, gen_tokens, prefill_tokens;
    PassCost cost;     /* the passes' times, for lookup_plan */
    long steps, rows, drafted, accepted; /* decode steps, the tokens they fed, guesses among them, guesses that stood */
    long ride_rows;    /* prompt tokens that rode along in decode steps */
    double chunk_ms;   /* prefill passes of their own (prefill_ms also counts the riders' share of the steps) */
    double plan_ms, pass_ms, take_ms; /* decode steps: before the pass (lookup's plan, pages), the pass, after it
                                         (sampling, taking the tokens, finishing sequences) */
    long full_steps, full_tokens; /* steps in which every slot decoded and no prompt rode along, their tokens */
    double full_ms;    /* and their time: the batch's own speed, apart from the prompts coming in and the slots
                          emptying at the end of the input */
    double *itl;       /* gaps between one sequence's tokens, every sequence */
    long n_itl, cap_itl;
} Batch;

static size_t page_bytes(const Config *c, const RunState *s)
{
    return (size_t)c->n_layers * c->n_kv_heads * PAGE_TOKENS * s->kv_row;
}

/* Turns s's cache into a pool of n_pages pages of every layer (both K
   and V), in slabs of one layer, and one spare slab. A sliding-window
   layer's query at position pos sees keys from pos - window + 1 on; a pass
   of up to CHUNK_TOKENS tokens from pos holds the pages from that key's to
   its last token's: at most local_pages. With keep_all (a prompt cache,
   whose file stores every position so that a later prompt can share any
   prefix) no layer gives pages back: all are treated as global. */
static void build_pool(PagePool *p, RunState *s, const Config *c, int n_pages, int keep_all)
{
    free(s->key_cache);
    free(s->value_cache);
    *p = (PagePool){.n_pages = n_pages, .n_slabs = n_pages * c->n_layers};
    size_t slab = page_bytes(c, s) / c->n_layers;
    s->key_cache = calloc((size_t)p->n_slabs + 1, slab);
    s->value_cache = calloc((size_t)p->n_slabs + 1, slab);
    if (!s->key_cache || !s->value_cache) /* the pool's size is the user's: say which flag asked for it */
        die(EXIT_RUNTIME, "--kv-mem: cannot allocate a KV page pool of %.0f MB (out of memory): give a smaller --kv-mem",
            2.0 * ((size_t)p->n_slabs + 1) * slab / 1e6);
    p->n_free = p->n_slabs;
    p->spare = p->n_slabs;
    p->free_ids = xmalloc(p->n_slabs * sizeof(int));
    p->refs = xcalloc(p->n_slabs + 1, sizeof(int));
    for (int i = 0; i < p->n_slabs; i++) p->free_ids[i] = p->n_slabs - 1 - i;
    for (int l = 0; l < c->n_layers && !keep_all; l++) p->n_local += is_local(c, l);
    if (p->n_local) p->local_pages = (c->window + CHUNK_TOKENS - 2) / PAGE_TOKENS + 2;
}

static void free_pool(PagePool *p) { free(p->free_ids); free(p->refs); }

/* Whether layer l's pages are taken and given back with the window. */
static int pool_local(const PagePool *p, const Config *c, int l) { return p->n_local && is_local(c, l); }

/* A free slab, held once. Admission promised it (see PagePool). */
static int slab_take(PagePool *p)
{
    if (!p->n_free) die(EXIT_RUNTIME, "internal error: the KV page pool ran out of slabs it had promised");
    int id = p->free_ids[--p->n_free];
    p->refs[id] = 1;
    int used = p->n_slabs - p->n_free;
    p->peak = max_i(p->peak, used);
    p->peak_kept = max_i(p->peak_kept, used + p->live_freed);
    return id;
}

/* Lets go of one hold on slab id; returns 1 when that freed it. */
static int slab_drop(PagePool *p, int id)
{
    if (--p->refs[id]) return 0;
    p->free_ids[p->n_free++] = id;
    return 1;
}

/* The first page a query at position pos or later can see on a sliding-window layer. */
static int window_page(const Config *c, int pos) { return max_i(0, pos - c->window + 1) / PAGE_TOKENS; }

/* Slabs admission counts for a sequence of `pages` pages whose first
   `shared` are a donor's: the global layers' slabs of its own pages, and
   the most its local layers hold at once (from the first page its first
   query sees). */
static int slabs_needed(const PagePool *p, const Config *c, int pages, int shared)
{
    int first = p->n_local ? window_page(c, shared * PAGE_TOKENS) : 0;
    return (c->n_layers - p->n_local) * (pages - shared) + p->n_local * min_i(pages - first, p->local_pages);
}

/* Before a pass over a sequence's positions [pos, pos + m): its
   sliding-window layers give back the slabs of the pages no query from pos
   on can see (freed when no other sequence holds them), and take slabs
   for the pages the pass writes. */
static void page_window(PagePool *p, const Config *c, PageTable *pt, int pos, int m)
{
    if (!p->n_local) return;
    for (int first = window_page(c, pos); pt->released < first; pt->released++)
        for (int l = 0; l < c->n_layers; l++) {
            int *e = &pt->slab[(size_t)pt->released * c->n_layers + l];
            if (!pool_local(p, c, l) || *e == p->spare) continue;
            if (*e >= 0 && slab_drop(p, *e)) pt->freed++, p->live_freed++;
            *e = p->spare;
        }
    for (int i = pos / PAGE_TOKENS; i <= (pos + m - 1) / PAGE_TOKENS; i++)
        for (int l = 0; l < c->n_layers; l++)
            if (pool_local(p, c, l) && pt->slab[(size_t)i * c->n_layers + l] < 0) pt->slab[(size_t)i * c->n_layers + l] = slab_take(p);
}

/* A finished sequence lets go of every slab it holds, and of its promise. */
static void page_release(PagePool *p, const Config *c, PageTable *pt)
{
    for (size_t i = 0; i < (size_t)pt->n * c->n_layers; i++) {
        int id = pt->slab[i];
        if (id >= 0 && id != p->spare && slab_drop(p, id) && !pool_local(p, c, (int)(i % c->n_layers))) p->committed--;
    }
    p->committed -= pt->budget;
    p->live_freed -= pt->freed;
    pt->n = 0;
}

/* ----- records ----- */

static Buf *record_slot(Records *r, long line)
{
    if (line - r->first >= r->cap) {
        long cap = 2 * (line - r->first + 1);
        r->rec = realloc(r->rec, cap * sizeof *r->rec);
        r->ready = realloc(r->ready, cap);
        if (!r->rec || !r->ready) die(EXIT_RUNTIME, "out of memory");
        memset(r->rec + r->cap, 0, (cap - r->cap) * sizeof *r->rec);
        memset(r->ready + r->cap, 0, cap - r->cap);
        r->cap = cap;
    }
    r->ready[line - r->first] = 1;
    return &r->rec[line - r->first];
}

/* Writes the records that are ready, in line order, up to the first line still in flight. */
static void flush_records(Records *r)
{
    long k = 0;
    while (k < r->cap && r->ready[k]) {
        fwrite(r->rec[k].p, 1, r->rec[k].len, stdout);
        free(r->rec[k].p);
        k++;
    }
    if (!k) return;
    memmove(r->rec, r->rec + k, (r->cap - k) * sizeof *r->rec);
    memmove(r->ready, r->ready + k, r->cap - k);
    memset(r->rec + r->cap - k, 0, k * sizeof *r->rec);
    memset(r->ready + r->cap - k, 0, k);
    r->first += k;
    check_stdout();
}

/* A line's record when it cannot run: {"id": ..., "error": "line N: reason"}. */
static void record_error(Batch *b, long line, const Buf *id, const char *fmt, ...)
{
    char msg[MSG_BYTES];
    int k = snprintf(msg, sizeof msg, "line %ld: ", line);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg + k, sizeof msg - k, fmt, ap);
    va_end(ap);
    Buf *r = record_slot(&b->out, line);
    if (id && id->len) buf_printf(r, "{\"id\": %s, \"error\": ", id->p);
    else buf_printf(r, "{\"id\": %ld, \"error\": ", line);
    json_put_string(r, msg, strlen(msg));
    buf_put(r, "}\n", 2);
    b->failed++;
    b->done++;
}

static void record_answer(Batch *b, const Seq *q, int finish, double now)
{
    Buf *r = record_slot(&b->out, q->line);
    buf_printf(r, "{\"id\": %s, \"text\": ", q->id.p);
    json_put_string(r, q->text.p ? q->text.p : "", q->text.len);
    buf_printf(r, ", \"prompt_tokens\": %d, \"tokens\": %d, \"finish\": \"%s\", \"ttft_ms\": %.1f, \"total_ms\": %.1f",
               q->n_prompt, q->r.st.n_gen, FINISH[finish], q->r.st.n_gen || finish == STOP_END ? q->t_first - q->t_admit : 0.0,
               now - q->t_admit);
    if (q->json_incomplete) buf_printf(r, ", \"json_complete\": false");
    if (q->lp.want >= 0) buf_printf(r, ", \"logprobs\": [%s]", q->logprobs.p ? q->logprobs.p : "");
    buf_put(r, "}\n", 2);
    b->done++;
}

/* ----- requests ----- */

/* More input into r's buffer: returns 0 when nothing came because !wait
   and none was ready, or a signal (Ctrl-C) came first. */
static int read_more(LineReader *r, int wait)
{
    if (!wait) {
        struct pollfd p = {r->fd, POLLIN, 0};
        if (poll(&p, 1, 0) == 0) return 0;
    }
    if (r->start) {
        memmove(r->buf, r->buf + r->start, r->end - r->start);
        r->end -= r->start, r->start = 0;
    }
    if (r->cap - r->end < READ_CHUNK && !(r->buf = realloc(r->buf, r->cap = 2 * r->cap + READ_CHUNK)))
        die(EXIT_RUNTIME, "out of memory reading the --batch input");
    ssize_t got = read(r->fd, r->buf + r->end, r->cap - r->end);
    if (got < 0 && errno == EINTR) return 0;
    if (got < 0) die(EXIT_RUNTIME, "cannot read %s: %s", r->name, strerror(errno));
    if (got == 0) r->eof = 1;
    r->end += got;
    return 1;
}

/* The next line of input (without its newline and trailing CRs), in a
   malloc'd buffer. A line longer than max comes back empty with *too_long
   set as soon as that is known, without waiting for its end; the rest of
   it is then skipped up to its newline, and if none comes within
   BATCH_SKIP_MAX bytes the input is given up (r->endless, r->eof). NULL
   when no whole line is there yet (!wait, or Ctrl-C) or at the end of
   the input (then r->eof). */
static char *next_line(LineReader *r, size_t max, int wait, size_t *len, int *too_long)
{
    while (1) {
        char *nl = r->buf ? memchr(r->buf + r->start + r->scanned, '\n', r->end - r->start - r->scanned) : NULL;
        if (r->dropping) { /* the rest of a too long line */
            size_t n = nl ? (size_t)(nl - (r->buf + r->start)) + 1 : r->end - r->start;
            r->start += n, r->scanned = 0, r->dropped += n;
            if (nl) r->dropping = 0;
            else if (r->dropped > BATCH_SKIP_MAX) { r->endless = r->eof = 1; return NULL; }
            else if (r->eof || !read_more(r, wait)) return NULL;
            continue;
        }
        size_t n = nl ? (size_t)(nl - (r->buf + r->start)) : r->end - r->start;
        *too_long = n > max;
        if (nl || *too_long || (r->eof && r->end > r->start)) {
            char *line = xmalloc(*too_long ? 1 : n + 1);
            if (*too_long) r->dropping = 1, r->dropped = 0, n = 0; /* its bytes are skipped above, from the next call */
            else memcpy(line, r->buf + r->start, n), r->start += nl ? n + 1 : n;
            r->scanned = 0;
            while (n && line[n - 1] == '\r') n--;
            line[n] = 0;
            *len = n;
            return line;
        }
        r->scanned = n;
        if (r->eof || !read_more(r, wait)) return NULL;
    }
}

/* Frees the grammar compiled from q's own "schema" (a shared one stays). */
static void free_line_grammar(Seq *q)
{
    if (!q->own_jc) return;
    json_grammar_free(&((JsonConstraint *)q->jc)->g);
    free((JsonConstraint *)q->jc);
    q->own_jc = 0;
}

/* Forgets a request read but never admitted (its record is out). */
static void drop_request(Seq *q)
{
    free(q->toks.ids);
    free(q->id.p);
    free_line_grammar(q);
    q->line = 0;
}

/* The vocabulary's trie, built once when the first line asks for JSON
   (--json / --json-schema brought theirs). */
static const VocabTrie *batch_trie(Batch *b)
{
    if (b->o->json) return &b->o->json->trie;
    if (!b->have_trie) build_trie(&b->trie, b->m->tok, b->m->c.vocab_size), b->have_trie = 1;
    return &b->trie;
}

/* Sets q's answer grammar from its "json" (1, 0, -1: absent) and
   "schema" fields, or the command line's; NULL or the reason the line's
   schema cannot be used. */
static const char *answer_grammar(Batch *b, Seq *q, int json, const Json *schema, char *why, size_t why_len)
{
    q->jc = json == 0 ? NULL : b->o->json;
    if (schema && json == 0) return "\"schema\" asks for a JSON answer and \"json\": false for none: give one of them";
    if (schema) {
        JsonConstraint *jc = xcalloc(1, sizeof *jc);
        if (compile_schema_value(jc, schema, batch_trie(b), why, why_len)) {
            free(jc);
            q->jc = NULL;
            return why;
        }
        q->jc = jc, q->own_jc = 1;
    } else if (json == 1) {
        if (!b->have_plain) {
            json_grammar_init(&b->plain.g);
            b->plain.root = 0;
            b->plain.trie = *batch_trie(b);
            b->have_plain = 1;
        }
        q->jc = &b->plain;
    }
    return NULL;
}

/* A JSON number that is a whole number in [lo, hi], into *out. */
static int json_int(const Json *v, long lo, long hi, long *out)
{
    if (v->kind != JSON_NUMBER || v->number != floor(v->number) || v->number < lo || v->number > hi) return -1;
    *out = (long)v->number;
    return 0;
}

/* Whether number v's text has a nonzero digit before its exponent (0.1e-999
   has, though it reads as 0). */
static int written_nonzero(const Json *v)
{
    for (size_t i = 0; i < v->len && (v->str[i] | 0x20) != 'e'; i++)
        if (v->str[i] >= '1' && v->str[i] <= '9') return 1;
    return 0;
}

/* A line's "stop": a string or an array of up to STOP_MAX strings, each
   of 1 to STOP_MAX_BYTES bytes (JSON's own escapes, no others). */
static const char *read_stops(const Json *x, Stops *st, char *why, size_t why_len)
{
    int n = x->kind == JSON_ARRAY ? x->n : 1;
    const Json *items = x->kind == JSON_ARRAY ? x->items : x;
    if ((x->kind != JSON_STRING && x->kind != JSON_ARRAY) || n > STOP_MAX) {
        snprintf(why, why_len, "\"stop\" must be a string or an array of at most %d strings", STOP_MAX);
        return why;
    }
    st->n = 0;
    for (int i = 0; i < n; i++) {
        if (items[i].kind != JSON_STRING || items[i].len < 1 || items[i].len > STOP_MAX_BYTES) {
            snprintf(why, why_len, "\"stop\" strings must be strings of 1 to %d bytes", STOP_MAX_BYTES);
            return why;
        }
        memcpy(st->text[i], items[i].str, items[i].len);
        st->len[st->n++] = (int)items[i].len;
    }
    return NULL;
}

/* A line's sampling fields, with the command line's names and bounds:
   "t", "top_k" (an integer), "top_p", "min_p", "repeat_penalty",
   "repeat_last_n" (an integer), "presence_penalty", "frequency_penalty". */
typedef struct {
    const char *key;
    size_t at;       /* offsetof the Sampler field */
    double lo, hi;
    int lo_open;     /* lo itself is out of range (also what rounds to it as a float) */
    int integer;     /* an int field (else a float) */
} SamplingField;

static const SamplingField SAMPLING_FIELDS[] = {
    {"t", offsetof(Sampler, temperature), 0, TEMP_MAX, 0, 0},
    {"top_k", offsetof(Sampler, top_k), 0, MAX_VOCAB, 0, 1},
    {"top_p", offsetof(Sampler, top_p), 0, 1, 1, 0},
    {"min_p", offsetof(Sampler, min_p), 0, 1, 0, 0},
    {"repeat_penalty", offsetof(Sampler, repeat), REPEAT_PENALTY_MIN, PENALTY_MAX, 0, 0},
    {"repeat_last_n", offsetof(Sampler, repeat_last_n), 0, MAX_SEQ, 0, 1},
    {"presence_penalty", offsetof(Sampler, presence), 0, PENALTY_MAX, 0, 0},
    {"frequency_penalty", offsetof(Sampler, frequency), 0, PENALTY_MAX, 0, 0},
};

/* Whether key is one of SAMPLING_FIELDS; if so, x's value goes into sm,
   or, out of its range, the reason into why (else why is ""). */
static int sampling_field(const char *key, const Json *x, Sampler *sm, char *why, size_t why_len)
{
    *why = 0;
    for (size_t i = 0; i < sizeof SAMPLING_FIELDS / sizeof *SAMPLING_FIELDS; i++) {
        const SamplingField *f = &SAMPLING_FIELDS[i];
        if (strcmp(key, f->key)) continue;
        double v = x->number;
        if (x->kind != JSON_NUMBER || !(v >= f->lo && v <= f->hi) || (f->lo_open && (float)v == f->lo) ||
            (f->integer && v != floor(v)))
            snprintf(why, why_len, "\"%s\" must be %s in %c%.15g, %.15g]", key, f->integer ? "an integer" : "a number",
                     f->lo_open ? '(' : '[', f->lo, f->hi);
        else if (f->integer) *(int *)((char *)sm + f->at) = (int)v;
        else *(float *)((char *)sm + f->at) = (float)v;
        return 1;
    }
    return 0;
}

/* The fields of a JSON line: prompt (required), id, n, the sampling
   fields, chat, system, stop, json, schema, logprobs. Fills q's prompt text (*text, *len:
   pointers into v), id and settings, *json (1, 0; -1 when absent) and
   *schema; returns NULL or the reason the line is refused. */
static const char *read_fields(const Json *v, Seq *q, const char **text, size_t *len, int *chat, const char **system,
                               size_t *system_len, int *json, const Json **schema, char *why, size_t why_len)
{
    if (v->kind != JSON_OBJECT) return "a JSON line must be an object with a \"prompt\"";
    *text = NULL;
    for (int i = 0; i < v->n; i++) {
        const char *k = v->keys[i];
        const Json *x = &v->items[i];
        long n;
        if (v->key_lens[i] != strlen(k)) return "a field name holds a NUL byte";
        if (!strcmp(k, "prompt")) {
            if (x->kind != JSON_STRING) return "\"prompt\" must be a string";
            *text = x->str, *len = x->len;
        } else if (!strcmp(k, "id")) {
            if (x->kind == JSON_ARRAY || x->kind == JSON_OBJECT) return "\"id\" must be a string, a number, a boolean or null";
            q->id.len = 0;
            if (x->kind == JSON_STRING) json_put_string(&q->id, x->str, x->len);
            else if (x->kind == JSON_NULL) buf_put(&q->id, "null", 4);
            else if (x->kind == JSON_BOOL) buf_printf(&q->id, "%s", x->boolean ? "true" : "false");
            else if (x->number == 0 && written_nonzero(x)) {
                /* the reader refuses one beyond the double range; one that reads as 0 but is not 0 is refused too */
                snprintf(why, why_len, "\"id\" %.*s is too small for a double: a reader would take it as 0 (an id number must "
                         "lie within the double range)", (int)(x->len < JSON_QUOTE_MAX ? x->len : JSON_QUOTE_MAX), x->str);
                return why;
            } else buf_put(&q->id, x->str, x->len); /* a number exactly as written */
        } else if (!strcmp(k, "n")) {
            if (json_int(x, 0, MAX_SEQ, &n)) { snprintf(why, why_len, "\"n\" must be an integer in [0, %d]", MAX_SEQ); return why; }
            q->r.n_predict = (int)n;
        } else if (sampling_field(k, x, &q->sm, why, why_len)) {
            if (*why) return why;
        } else if (!strcmp(k, "chat")) {
            if (x->kind != JSON_BOOL) return "\"chat\" must be true or false";
            *chat = x->boolean;
        } else if (!strcmp(k, "logprobs")) {
            if (json_int(x, 0, LOGPROBS_MAX, &n)) { snprintf(why, why_len, "\"logprobs\" must be an integer in [0, %d]", LOGPROBS_MAX); return why; }
            q->lp.want = (int)n;
        } else if (!strcmp(k, "stop")) {
            const char *problem = read_stops(x, &q->stops, why, why_len);
            if (problem) return problem;
        } else if (!strcmp(k, "json")) {
            if (x->kind != JSON_BOOL) return "\"json\" must be true or false";
            *json = x->boolean ? 1 : 0;
        } else if (!strcmp(k, "schema")) {
            if (x->kind != JSON_OBJECT) return "\"schema\" must be a JSON object (a JSON Schema)";
            *schema = x;
        } else if (!strcmp(k, "system")) {
            if (x->kind != JSON_STRING) return "\"system\" must be a string";
            *system = x->str, *system_len = x->len;
        } else {
            snprintf(why, why_len, "unknown field \"%.64s\" (known: prompt, id, n, t, top_k, top_p, min_p, repeat_penalty, "
                     "repeat_last_n, presence_penalty, frequency_penalty, chat, system, stop, json, schema, logprobs)", k);
            return why;
        }
    }
    return *text ? NULL : "the line has no \"prompt\"";
}

/* Takes the progress line off the terminal (show_progress draws it again
   at once), so that what is written next starts a line of its own. */
static void progress_erase(Batch *b)
{
    if (!b->progress_shown) return;
    fputs("\r\033[K", stderr);
    b->progress_shown = 0;
    b->last_progress = 0;
}

/* Reads input lines until one makes a request (into b->pending) or the
   input ends, or, unless wait, until no whole line is there yet; lines
   that cannot run get their error record on the way, and a request for no
   tokens its (empty) answer. */
static void read_request(Batch *b, int wait)
{
    char err[ERR_BYTES], why[ERR_BYTES + 32];
    while (!b->eof && !b->pending.line) {
        size_t len;
        int too_long;
        char *line = next_line(&b->in, b->max_line, wait, &len, &too_long);
        b->eof = b->in.eof && !line;
        if (!line) break;
        long no = ++b->lines;
        Seq *q = &b->pending;
        Buf id = {0};
        buf_printf(&id, "%ld", no);
        *q = (Seq){.line = no, .id = id, .r.n_predict = b->o->n_predict, .sm = b->defaults, .lp = {.want = b->o->logprobs}};
        if (b->o->stops) q->stops = *b->o->stops;
        const char *text = line, *system = b->o->system, *problem = NULL;
        size_t text_len = len, system_len = system ? strlen(system) : 0;
        if (no == 1 && len >= sizeof UTF8_BOM - 1 && !memcmp(line, UTF8_BOM, sizeof UTF8_BOM - 1)) /* an editor's mark, not text */
            text += sizeof UTF8_BOM - 1, text_len -= sizeof UTF8_BOM - 1;
        size_t lead = 0;
        while (lead < text_len && (text[lead] == ' ' || text[lead] == '\t' || text[lead] == '\r')) lead++;
        int chat = b->chat, json = -1;
        const Json *schema = NULL;
        Json v = {0};
        if (too_long) problem = "the line is longer than the context can hold";
        else if (lead < text_len && text[lead] == '{') {
            if (json_parse(text, text_len, &v, err, sizeof err)) snprintf(why, sizeof why, "not valid JSON: %s", err), problem = why;
            else problem = read_fields(&v, q, &text, &text_len, &chat, &system, &system_len, &json, &schema, why, sizeof why);
        }
        if (!problem && json == 1 && schema) problem = "\"json\" and \"schema\" cannot be used together";
        if (!problem) problem = answer_grammar(b, q, json, schema, why, sizeof why);
        if (!problem && !text_len) problem = "the prompt is empty";
        if (!problem && chat) problem = b->no_chat;
        if (!problem && !chat && system != b->o->system) /* the line's own "system" would be ignored */
            problem = "\"system\" applies only to chat lines: add \"chat\": true (or run with -c)";
        if (!problem) {
            Chat ch;
            if (chat) build_chat(&ch, b->m, system, system_len);
            if (prompt_text_problem(b->m, text, text_len, chat ? &ch : NULL, why, sizeof why)) problem = why;
            else tokenize_prompt(b->m, text, text_len, chat ? &ch : NULL, b->special, &q->toks);
            q->n_prompt = q->toks.n;
            if (!problem && !q->n_prompt) problem = "the prompt tokenizes to no token"; /* a sequence needs one to start */
            else if (!problem && q->n_prompt > b->s->seq_len)
                snprintf(why, sizeof why, "the prompt has %d tokens but the context holds %d", q->n_prompt, b->s->seq_len),
                    problem = why;
        }
        if (!problem && b->o->print_ids) {
            progress_erase(b);
            fprintf(stderr, "ids (line %ld):", no);
            for (int i = 0; i < q->n_prompt; i++) fprintf(stderr, " %d", q->toks.ids[i]);
            fputc('\n', stderr);
        }
        if (problem) record_error(b, no, &q->id, "%s", problem);
        else if (q->r.n_predict == 0) { /* nothing to generate: a JSON answer is left incomplete */
            q->json_incomplete = q->jc != NULL;
            b->failed += q->json_incomplete;
            q->t_admit = now_ms(), record_answer(b, q, STOP_LIMIT, q->t_admit);
        }
        json_free(&v);
        free(line);
        if (problem || q->r.n_predict == 0) drop_request(q);
    }
}

/* The sequence in flight whose prompt shares the most whole pages with
   q's (at most all but q's last prompt token: q must prefill one token to
   get its first logits); their count goes to *shared. With sliding-window
   layers, a donor that has given back the local slabs of a page q's first
   queries would see cannot be one. */
static Seq *prefix_donor(Batch *b, const Seq *q, int *shared)
{
    Seq *best = NULL;
    *shared = 0;
    for (int i = 0; i < b->parallel; i++) {
        const Seq *d = &b->seq[i];
        if (d->state == SEQ_IDLE) continue;
        int n = min_i(d->n_prompt, q->n_prompt - 1), k = 0;
        while (k < n && d->toks.ids[k] == q->toks.ids[k]) k++;
        k /= PAGE_TOKENS;
        if (b->pool.n_local && d->pt.released > window_page(&b->m->c, k * PAGE_TOKENS)) continue;
        if (k > *shared) *shared = k, best = &b->seq[i];
    }
    return best;
}

/* Fills the page table of q, admitted with `need` pages, the first `shared`
   of them the donor's: the global layers' slabs taken (or the donor's held
   again), the local layers' of shared pages its first queries see held
   again too, taken now for both when the donor's passes have not reached
   them yet; the rest of the local slabs are taken as q's passes reach them. */
static void page_admit(PagePool *p, const Config *c, PageTable *pt, int need, PageTable *donor, int shared)
{
    int layers = c->n_layers, first = p->n_local ? window_page(c, shared * PAGE_TOKENS) : 0;
    *pt = (PageTable){.slab = xmalloc((size_t)need * layers * sizeof(int)), .n = need, .released = first,
                      .budget = p->n_local * min_i(need - first, p->local_pages)};
    p->committed += pt->budget;
    for (int i = 0; i < need; i++)
        for (int l = 0; l < layers; l++) {
            int *e = &pt->slab[(size_t)i * layers + l], *from = i < shared ? &donor->slab[(size_t)i * layers + l] : NULL;
            if (pool_local(p, c, l) && i < first) *e = p->spare;
            else if (from && *from >= 0) p->refs[*e = *from]++;
            else if (from) p->refs[*e = *from = slab_take(p)]++; /* local, not reached by the donor yet */
            else if (pool_local(p, c, l)) *e = -1;
            else *e = slab_take(p), p->committed++;
        }
}

/* Admits the pending request into free slot `slot` when the pool has its
   pages: the positions of its prompt and of every answer token but the last
   (which is sampled, never fed), at most the context. A request the
   empty pool cannot hold is cut to what it holds (finish "context"), or
   refused when not even its prompt fits. Returns 1 when admitted. */
static int admit(Batch *b, Seq *slot)
{
    Seq *q = &b->pending;
    int seq_len = b->s->seq_len;
    if (q->r.n_predict > seq_len - q->n_prompt + 1) q->r.n_predict = seq_len - q->n_prompt + 1, q->r.capped = 1;
    int shared, need = (q->n_prompt + q->r.n_predict - 1 + PAGE_TOKENS - 1) / PAGE_TOKENS;
    const Config *c = &b->m->c;
    PagePool *p = &b->pool;
    Seq *donor = prefix_donor(b, q, &shared);
    if (p->committed + slabs_needed(p, c, need, shared) > p->n_slabs) {
        if (b->in_flight) return 0; /* wait for pages */
        int most = need; /* alone in the pool (no donor): the pages it holds */
        while (most > 0 && slabs_needed(p, c, most, 0) > p->n_slabs) most--;
        if (q->n_prompt > most * PAGE_TOKENS) {
            record_error(b, q->line, &q->id, "the prompt needs %d KV cache pages of %d tokens but --kv-mem holds %d",
                         (q->n_prompt + PAGE_TOKENS - 1) / PAGE_TOKENS, PAGE_TOKENS, most);
            drop_request(q);
            return 0;
        }
        q->r.n_predict = most * PAGE_TOKENS - q->n_prompt + 1, q->r.capped = 1;
        need = most;
    }
    *slot = *q;
    q->line = 0;
    page_admit(p, c, &slot->pt, need, donor ? &donor->pt : NULL, shared);
    slot->r.pos = pcache_load(b->o->cache, b->m, b->s, &slot->pt, slot->toks.ids, slot->n_prompt, shared * PAGE_TOKENS);
    slot->state = SEQ_PREFILL;
    slot->order = b->admitted++;
    /* each line its own stream of random numbers, from -s and the line
       number (spread by another odd constant before the xor) */
    slot->sm.rng = seed_state(b->seed ^ (unsigned long long)slot->line * 0xD1B54A32D192ED03ull);
    slot->sm.report = slot->lp.want >= 0 ? &slot->lp : NULL;
    slot->lk = (Lookup){.max = b->o->lookup, .src = -1};
    text_open(&slot->out, NULL, &slot->text);
    if (slot->jc) json_mask_init(&slot->jm, slot->jc, b->m->c.vocab_size);
    slot->hk = (Hooks){.jm = slot->jc ? &slot->jm : NULL, .lk = &slot->lk, .records = slot->sm.report ? &slot->logprobs : NULL,
                       .stop.stops = slot->stops.n ? &slot->stops : NULL};
    Request *r = &slot->r;
    r->conv = &slot->toks, r->out = &slot->out, r->m = b->m, r->s = b->s, r->sm = &slot->sm, r->cand = b->cand, r->h = &slot->hk;
    r->ignore_eos = b->o->ignore_eos && !slot->jc; /* the mask allows an end token only once the value is complete */
    slot->t_admit = now_ms();
    b->in_flight++;
    return 1;
}

static void finish_seq(Batch *b, Seq *q, int finish)
{
    double now = now_ms();
    stop_end(&q->hk.stop, &q->out);
    text_end(&q->out);
    if (q->jc) {
        q->json_incomplete = !json_complete(&q->jc->g, &q->jm.state);
        b->failed += q->json_incomplete;
        json_mask_free(&q->jm);
    }
    record_answer(b, q, finish, now);
    free_line_grammar(q);
    page_release(&b->pool, &b->m->c, &q->pt);
    free(q->pt.slab);
    free(q->toks.ids);
    free(q->text.p);
    free(q->logprobs.p);
    free(q->id.p);
    *q = (Seq){.state = SEQ_IDLE};
    b->in_flight--;
}

/* After the last prompt token of q has been through a pass (logits: its
   row): the first prompt prefilled goes to --prompt-cache, and the first
   token is sampled and taken. */
static void prompt_done(Batch *b, Seq *q, float *logits)
{
    if (b->o->cache && !b->o->cache->saved) {
        pcache_save(b->o->cache, b->m, b->s, &q->pt, q->toks.ids, q->n_prompt);
        b->o->cache->saved = 1;
    }
    q->state = SEQ_DECODE;
    int token = sample_next(&q->r, logits);
    q->t_first = q->t_prev = now_ms();
    int why = take_token(&q->r, token);
    b->gen_tokens += q->r.st.n_gen;
    if (why >= 0) finish_seq(b, q, why);
}

/* One chunk of the prompt of the sequence admitted first among those
   still prefilling (when no sequence decodes: otherwise prompts ride
   along in the decode steps: decode_some, ride_plan); after its last
   chunk the first token is sampled. */
static void prefill_some(Batch *b)
{
    Seq *q = NULL;
    for (int i = 0; i < b->parallel; i++)
        if (b->seq[i].state == SEQ_PREFILL && (!q || b->seq[i].order < q->order)) q = &b->seq[i];
    if (!q) return;
    int k = min_i(q->n_prompt - q->r.pos, CHUNK_TOKENS), last = q->r.pos + k == q->n_prompt;
    page_window(&b->pool, &b->m->c, &q->pt, q->r.pos, k);
    double t0 = now_ms();
    forward_pages(b->m, b->s, &q->pt, q->toks.ids + q->r.pos, k, q->r.pos, last ? k - 1 : k);
    lookup_time(&b->cost, k, now_ms() - t0);
    b->prefill_ms += now_ms() - t0, b->chunk_ms += now_ms() - t0;
    b->prefill_tokens += k;
    q->r.pos += k;
    if (last) prompt_done(b, q, b->s->logits);
}

/* Prompt tokens riding along in a decode step: the weights a step reads
   serve them too, where a prefill pass of their own would read them all
   again (on the 1.5B a pass costs about a one-token step's time plus each
   row's arithmetic, so that read is worth ~15 rows). Every token of a pass
   is computed as it would be alone (see decode_batch), so where a prompt's
   pieces start does not change its numbers. */
#define RIDE_MIN (CHUNK_TOKENS / 4) /* a step with fewer rows to spare leaves the prompt a pass of its own, as
                                       the rows would cut it into more than 4 times as many passes */

typedef struct {
    int n;              /* pieces, one per sequence */
    Seq *seq[BATCH_MAX];
    int len[BATCH_MAX]; /* its next prompt tokens in this step */
    int rows, ends;     /* prompt rows in all; pieces that end their prompt (their last token needs logits) */
} Riders;

/* The prompt pieces that fill `room` rows of a step: the sequences still
   prefilling, first admitted first, each as many of its next prompt tokens
   as fit. Only the last piece can stop short of its prompt's end (it
   takes the rows left), so every prompt admitted before a rider's is
   complete once the pass has written its K and V, which comes before any
   token of the pass attends: a later sequence that shares a prompt's prefix
   pages (prefix_donor) reads them whole, as after the prefill passes,
   which take prompts one after another. */
static void ride_plan(Batch *b, Riders *rd, int room)
{
    *rd = (Riders){0};
    for (Seq *q = NULL; room > 0; q = NULL) {
        for (int i = 0; i < b->parallel; i++) {
            Seq *c = &b->seq[i];
            int planned = 0;
            for (int j = 0; j < rd->n; j++) planned |= rd->seq[j] == c;
            if (c->state == SEQ_PREFILL && !planned && (!q || c->order < q->order)) q = c;
        }
        if (!q) break;
        int len = min_i(room, q->n_prompt - q->r.pos);
        rd->seq[rd->n] = q, rd->len[rd->n++] = len;
        rd->rows += len, rd->ends += q->r.pos + len == q->n_prompt;
        room -= len;
    }
}

/* The riders' rows of the pass, and their pages: the tokens that end a
   prompt (which need logits, computed for the pass's last rows) after
   the others, from row rows - ends. */
static void ride_rows(Batch *b, const Riders *rd, int *tokens, int *pos, const PageTable **pages)
{
    for (int i = 0, r = 0, e = rd->rows - rd->ends; i < rd->n; i++) {
        Seq *q = rd->seq[i];
        page_window(&b->pool, &b->m->c, &q->pt, q->r.pos, rd->len[i]);
        for (int j = 0; j < rd->len[i]; j++) {
            int p = q->r.pos + j, at = p == q->n_prompt - 1 ? e++ : r++;
            tokens[at] = q->toks.ids[p], pos[at] = p, pages[at] = &q->pt;
        }
    }
}

/* After the pass (pass_ms for rows in all): the riders' positions are
   cached, their share of the time counts as prefill, and a prompt that
   ended samples its first token (logits rows 0..ends - 1, in order). */
static void ride_done(Batch *b, const Riders *rd, double pass_ms, int rows)
{
    b->prefill_ms += pass_ms * rd->rows / rows;
    b->prefill_tokens += rd->rows, b->ride_rows += rd->rows;
    for (int i = 0, e = 0; i < rd->n; i++) {
        Seq *q = rd->seq[i];
        q->r.pos += rd->len[i];
        if (q->r.pos == q->n_prompt) prompt_done(b, q, b->s->logits + (size_t)e++ * b->m->c.vocab_size);
    }
}

/* One token's latency, for the -v percentiles. */
static void add_latency(Batch *b, double ms)
{
    if (b->n_itl == b->cap_itl && !(b->itl = realloc(b->itl, (b->cap_itl = 2 * b->cap_itl + 1024) * sizeof(double))))
        die(EXIT_RUNTIME, "out of memory");
    b->itl[b->n_itl++] = ms;
}

/* One decode step: the last sampled token of every decoding sequence, and
   after it the guesses of lookup decoding that lookup_plan finds worth
   their rows, fed in one pass (a sequence's rows at consecutive positions
   of its own pages). Each sequence then takes its rows with accept_drafts,
   as a single request does: a guess stands when the token sampled before
   it equals it, and is taken; the first that does not is replaced by that
   token. Guesses stay before the
   position of the last answer token (never fed), so they fall in pages
   the sequence reserved. A token's latency is the time since the
   sequence's previous step, shared by the tokens this step gave it.
   Prompts still prefilling fill the rows left (ride_plan). Returns those
   rows, 0 when no sequence decodes. */
static int decode_some(Batch *b)
{
    double t_plan = now_ms();
    int tokens[BATCH_MAX], pos[BATCH_MAX], room[BATCH_MAX], k[BATCH_MAX], n = 0, vocab = b->m->c.vocab_size;
    long gen0 = b->gen_tokens;
    const PageTable *pages[BATCH_MAX];
    Seq *who[BATCH_MAX];
    Lookup *lks[BATCH_MAX];
    for (int i = 0; i < b->parallel; i++) {
        Seq *q = &b->seq[i];
        if (q->state != SEQ_DECODE) continue;
        push(&q->toks, q->r.last);
        lookup_adapt(&q->lk, q->toks.ids, q->toks.n);
        room[n] = lookup_room(&q->lk, &q->toks, min_i(b->s->seq_len - q->r.pos - 1, q->r.n_predict - q->r.st.n_gen - 1));
        lks[n] = &q->lk, who[n++] = q;
    }
    if (!n) return 0;
    int rows = lookup_plan(lks, room, n, &b->cost, BATCH_MAX, k);
    Riders rd;
    ride_plan(b, &rd, BATCH_MAX - rows);
    ride_rows(b, &rd, tokens, pos, pages);
    for (int t = 0, r = rd.rows; t < n; t++) {
        page_window(&b->pool, &b->m->c, &who[t]->pt, who[t]->r.pos, k[t] + 1);
        for (int j = 0; j <= k[t]; j++, r++) {
            tokens[r] = j ? who[t]->toks.ids[who[t]->lk.src + j - 1] : who[t]->r.last;
            pos[r] = who[t]->r.pos + j, pages[r] = &who[t]->pt;
        }
    }
    double t0 = now_ms();
    pass_prof.on = pass_prof.th != NULL;
    decode_batch(b->m, b->s, tokens, pos, pages, rd.rows + rows, rd.rows - rd.ends);
    pass_prof.on = 0;
    double t1 = now_ms();
    lookup_time(&b->cost, rd.rows + rows, t1 - t0);
    b->plan_ms += t0 - t_plan, b->pass_ms += t1 - t0;
    b->steps++, b->rows += rows, b->drafted += rows - n;
    ride_done(b, &rd, t1 - t0, rd.rows + rows);
    for (int t = 0, r = 0; t < n; r += k[t++] + 1) {
        Seq *q = who[t];
        double prev = q->t_prev;
        int taken, n_gen = q->r.st.n_gen, accepted = q->r.st.accepted;
        /* logits row rd.ends + r + i: after the sequence's token and its first i guesses */
        int why = accept_drafts(&q->r, b->s->logits + (size_t)(rd.ends + r) * vocab, tokens + rd.rows + r + 1, k[t], &taken);
        b->accepted += q->r.st.accepted - accepted;
        b->gen_tokens += q->r.st.n_gen - n_gen;
        for (int i = 0; i < taken; i++) add_latency(b, (t1 - prev) / taken);
        if (why >= 0) finish_seq(b, q, why);
        else q->t_prev = t1;
    }
    double t2 = now_ms();
    b->take_ms += t2 - t1;
    if (n == b->parallel && !rd.rows) b->full_steps++, b->full_tokens += b->gen_tokens - gen0, b->full_ms += t2 - t_plan;
    return BATCH_MAX - rows;
}

/* The progress line on a terminal (or, with -v, a line now and then). */
static void show_progress(Batch *b, int final)
{
    double now = now_ms();
    int tty = isatty(STDERR_FILENO);
    if (!tty && !b->o->verbose) return;
    if (!final && now - b->last_progress < (tty ? PROGRESS_MS : PROGRESS_LOG_MS)) return;
    b->last_progress = now;
    char total[32] = "";
    if (b->total >= 0) snprintf(total, sizeof total, "/%ld", b->total);
    fprintf(stderr, "%sbatch: %ld%s done, %d in flight, %.1f tok/s%s", tty ? "\r" : "", b->done, total, b->in_flight,
            b->gen_tokens / ((now - b->t0) / 1e3), tty && !final ? "\033[K" : "\n");
    b->progress_shown = tty && !final;
}

/* Lines in a regular file (for the progress line), -1 for anything else. */
static long count_lines(int fd)
{
    struct stat st;
    off_t at = lseek(fd, 0, SEEK_CUR);
    if (fstat(fd, &st) || !S_ISREG(st.st_mode) || at < 0) return -1;
    char buf[READ_CHUNK];
    long n = 0;
    ssize_t got;
    int last = '\n';
    while ((got = read(fd, buf, sizeof buf)) > 0) {
        for (ssize_t i = 0; i < got; i++) n += buf[i] == '\n';
        last = buf[got - 1];
    }
    lseek(fd, at, SEEK_SET);
    return n + (last != '\n');
}

/* Slabs as pages of every layer, rounded up. */
static int pages_of(const Batch *b, int slabs) { return (slabs + b->m->c.n_layers - 1) / b->m->c.n_layers; }

/* -v's breakdown of the decode steps: where a step's time went, per step.
   Inside the pass, the average thread's time in each kind of work (so the
   parts add up to the pass); around it, what the batch loop does on one
   thread while the team sleeps. */
static void report_steps(const Batch *b, double wall_ms)
{
    if (!b->steps || !pass_prof.th || pass_prof.pass_ms <= 0) return;
    double sum[PT_N] = {0}, steps = (double)b->steps, team = pass_prof.thread_ms / pass_prof.pass_ms, inside = 0;
    for (int t = 0; t < b->s->mx->n_threads; t++)
        for (int k = 0; k < PT_N; k++) sum[k] += pass_prof.th[t].ms[k];
    for (int k = 0; k < PT_N; k++) inside += sum[k] /= team * steps;
    double pass = b->pass_ms / steps, rest = wall_ms - b->chunk_ms - b->plan_ms - b->pass_ms - b->take_ms;
    fprintf(stderr, "batch steps: %ld of %.1f rows (and %.1f prompt rows riding along), %.1f ms each: the pass %.1f ms (a thread's matmuls %.1f, output head %.1f, "
            "attention %.1f, other steps %.1f, waiting at barriers %.1f), before it %.2f ms (lookup's plan, pages), "
            "after it %.2f ms (sampling, taking tokens); besides, per step: prefill passes of their own %.1f ms, the loop's rest %.2f ms\n",
            b->steps, b->rows / steps, b->ride_rows / steps, (b->plan_ms + b->pass_ms + b->take_ms) / steps, pass, sum[PT_MATMUL], sum[PT_HEAD],
            sum[PT_ATTN], pass - inside, sum[PT_WAIT], b->plan_ms / steps, b->take_ms / steps, b->chunk_ms / steps,
            rest / steps);
    if (b->full_steps)
        fprintf(stderr, "batch steps with all %d slots decoding and no prompt rows: %ld, %.2f ms each, %.1f tok/s\n", b->parallel,
                b->full_steps, b->full_ms / b->full_steps, b->full_tokens / (b->full_ms / 1e3));
}

/* The -v summary of a batch: aggregate speed and the per-token latency. */
static void report_batch(Batch *b)
{
    double sec = (now_ms() - b->t0) / 1e3;
    report_steps(b, sec * 1e3);
    qsort(b->itl, b->n_itl, sizeof(double), by_double);
    fprintf(stderr, "batch: %ld records, %ld tokens in %.3f s: %.1f tok/s aggregate; prefill %ld tokens, %.0f tok/s; "
            "per-token latency p50 %.2f ms, p90 %.2f ms; KV pages: %d of %d used at most (%.1f MB each)\n",
            b->done, b->gen_tokens, sec, b->gen_tokens / sec, b->prefill_tokens,
            b->prefill_ms > 0 ? b->prefill_tokens / (b->prefill_ms / 1e3) : 0.0, b->n_itl ? b->itl[(b->n_itl - 1) / 2] : 0.0,
            b->n_itl ? b->itl[(long)(0.9 * (b->n_itl - 1))] : 0.0, pages_of(b, b->pool.peak), b->pool.n_pages,
            2 * page_bytes(&b->m->c, b->s) / 1e6);
    if (b->pool.n_local)
        fprintf(stderr, "sliding-window layers: %d of %d layers give back their pages out of the window; pages in use "
                "at most %d, %d had they kept them\n", b->pool.n_local, b->m->c.n_layers, pages_of(b, b->pool.peak),
                pages_of(b, b->pool.peak_kept));
    if (b->drafted)
        fprintf(stderr, "lookup: %ld drafted, %ld accepted (%.0f%%), %.2f tokens per sequence per step\n", b->drafted,
                b->accepted, 100.0 * b->accepted / b->drafted, (double)(b->rows - b->drafted + b->accepted) / (b->rows - b->drafted));
}

/* Ctrl-C: what is in flight ends as it stands, a line read and waiting
   is not begun (its record says so). */
static void end_interrupted(Batch *b)
{
    for (int i = 0; i < b->parallel; i++)
        if (b->seq[i].state != SEQ_IDLE) finish_seq(b, &b->seq[i], STOP_INTERRUPT);
    if (b->pending.line) {
        b->pending.json_incomplete = b->pending.jc != NULL; /* nothing was generated */
        b->pending.t_admit = now_ms();
        record_answer(b, &b->pending, STOP_INTERRUPT, b->pending.t_admit);
        drop_request(&b->pending);
    }
}

static int run_batch(const Model *m, RunState *s, const Sampler *sm, const GenOpts *o, const BatchOpts *bo)
{
    Batch b = {.m = m, .s = s, .o = o, .defaults = *sm, .seed = sm->rng, .chat = bo->chat, .special = bo->special,
               .out = {.first = 1}, .cost.fixed = o->lookup_fixed};
    int on_stdin = !strcmp(bo->path, "-");
    b.in.fd = on_stdin ? STDIN_FILENO : open(bo->path, O_RDONLY);
    b.in.name = on_stdin ? "the --batch input on stdin" : bo->path;
    if (b.in.fd < 0) die(EXIT_RUNTIME, "cannot open %s: %s", bo->path, strerror(errno));
    struct stat st;
    if (fstat(b.in.fd, &st) != 0) die(EXIT_RUNTIME, "cannot read %s: %s", b.in.name, strerror(errno)); /* a closed stdin */
    if (S_ISDIR(st.st_mode)) die(EXIT_RUNTIME, "cannot read %s: %s", b.in.name, strerror(EISDIR));
    char why[ERR_BYTES];
    b.max_line = text_limit(m, s->seq_len, why, sizeof why) * BATCH_JSON_SLACK;
    Chat ch;
    b.no_chat = chat_problem(&ch, m);
    b.total = count_lines(b.in.fd);
    int kv_mb = bo->kv_mb ? bo->kv_mb : BATCH_KV_MB;
    double fit = (double)kv_mb * 1e6 / (2 * page_bytes(&m->c, s));
    int pages = (int)fmin(fit, fmin(MAX_POOL_PAGES, MAX_POOL_SLABS / m->c.n_layers));
    if (pages < 1) die(EXIT_USAGE, "--kv-mem %d MB holds no KV cache page (one page is %.1f MB)", kv_mb, 2 * page_bytes(&m->c, s) / 1e6);
    build_pool(&b.pool, s, &m->c, pages, o->cache != NULL);
    /* by default as many sequences as the pool holds at a typical size: -n answer tokens after a page of prompt */
    int typical = (o->n_predict + 2 * PAGE_TOKENS - 1) / PAGE_TOKENS;
    b.parallel = bo->parallel ? bo->parallel : max_i(1, min_i(BATCH_DEFAULT_MAX, b.pool.n_slabs / slabs_needed(&b.pool, &m->c, typical, 0)));
    b.seq = xcalloc(b.parallel, sizeof *b.seq);
    b.cand = xmalloc((size_t)m->c.vocab_size * sizeof *b.cand);
    if (o->verbose) {
        pass_prof.th = xcalloc(s->mx->n_threads, sizeof *pass_prof.th);
        pass_prof.head = &m->output;
        fprintf(stderr, "batch: up to %d sequences in flight, KV pool of %d pages of %d positions (%.1f MB)", b.parallel, pages,
                PAGE_TOKENS, pages * 2 * page_bytes(&m->c, s) / 1e6);
        if (b.pool.n_local)
            fprintf(stderr, "; the %d sliding-window layers of a sequence hold at most %d pages", b.pool.n_local, b.pool.local_pages);
        fputc('\n', stderr);
    }
    struct sigaction sa = {0};
    sa.sa_handler = on_sigint;
    sigaction(SIGINT, &sa, NULL);
    answering = 1;
    b.t0 = now_ms();
    while (1) {
        if (interrupted) end_interrupted(&b);
        for (int i = 0; i < b.parallel && !interrupted; i++) {
            if (b.seq[i].state != SEQ_IDLE) continue;
            read_request(&b, !b.in_flight); /* block for input only when there is nothing else to do */
            if (!b.pending.line || !admit(&b, &b.seq[i])) break;
        }
        if (!b.in_flight && (b.eof || interrupted)) break;
        if (decode_some(&b) < RIDE_MIN) prefill_some(&b);
        if (b.out.cap && b.out.ready[0]) progress_erase(&b); /* a record is due: not after the progress text */
        flush_records(&b.out);
        show_progress(&b, 0);
    }
    progress_erase(&b);
    flush_records(&b.out);
    show_progress(&b, 1);
    if (b.in.endless) {
        char msg[LINE_BYTES];
        format_line(msg, "line %ld of %s runs on past %u bytes without a newline: the input after it was not read", b.lines,
                    b.in.name, BATCH_SKIP_MAX);
        fputs(msg, stderr);
    } else if (b.failed && !interrupted) { /* the records say why; stderr says that the exit status is theirs */
        char msg[LINE_BYTES];
        format_line(msg, "%ld of %ld records are errors or incomplete JSON answers (their reasons are on stdout)", b.failed, b.done);
        fputs(msg, stderr);
    }
    if (o->verbose) report_batch(&b);
    if (b.in.fd != STDIN_FILENO) close(b.in.fd);
    free(b.in.buf);
    free(b.seq); free(b.cand); free(b.itl); free(b.out.rec); free(b.out.ready); free(pass_prof.th);
    pass_prof.th = NULL;
    free_pool(&b.pool);
    if (b.have_trie) free_trie(&b.trie);
    if (b.have_plain) json_grammar_free(&b.plain.g);
    return interrupted ? 130 : b.failed || b.in.endless ? EXIT_RUNTIME : EXIT_SUCCESS;
}

/* ----- all logits --------------------------------------------------------------- */

/* Receives the logits of positions off .. off+k-1, rows 0 .. k-1 of s->logits. */
typedef void (*LogitsFn)(void *ctx, const RunState *s, int off, int k);

/* Runs ids[0, n) through the model from position 0, CHUNK_TOKENS at a time
   (batched prefill, exact = 0), or exact tokens at a time computed as
   decode steps would compute them (1: decode steps; more: lookup
   decoding's verification passes), computing the logits of every position
   and handing each block to use. */
static void each_logits(const Model *m, RunState *s, const int *ids, int n, int exact, LogitsFn use, void *ctx)
{
    for (int off = 0; off < n;) {
        int k = min_i(n - off, exact ? exact : CHUNK_TOKENS);
        if (exact == 1) decode_step(m, s, ids[off], off);
        else if (exact) verify_step(m, s, ids + off, k, off);
        else prefill(m, s, ids + off, k, off, 1);
        use(ctx, s, off, k);
        off += k;
    }
}

/* ----- perplexity ------------------------------------------------------------ */

#define PPL_MAX_BYTES (64u << 20) /* the text --ppl reads: ~16M tokens, hours of prefill */

/* One window's score: the negative log-likelihood of each token at
   positions [first + 1, ctx) given those before it. */
typedef struct {
    const int *win;
    int first, ctx, vocab;
    double nll;
    long scored;
} Score;

static void score_block(void *ctx, const RunState *s, int off, int k)
{
    Score *sc = ctx;
    for (int t = 0; t < k; t++) {
        int p = off + t;
        if (p < sc->first || p >= sc->ctx - 1) continue;
        const float *lg = s->logits + (size_t)t * sc->vocab;
        check_logits(lg, sc->vocab); /* damaged weights: an error, not a perplexity of nan */
        float mx = lg[0];
        for (int i = 1; i < sc->vocab; i++) mx = fmaxf(mx, lg[i]);
        double sum = 0;
        for (int i = 0; i < sc->vocab; i++) sum += exp(lg[i] - mx);
        sc->nll += mx + log(sum) - lg[sc->win[p + 1]];
        sc->scored++;
    }
}

/* Perplexity of a text file. The tokens are cut into windows of ctx tokens
   (no overlap); each window is prefilled from position 0 (batched, logits
   for every position) and only its second half is scored, so every scored
   token sees at least ctx/2 tokens of context — llama.cpp's scheme, so the
   numbers compare. With add-BOS models the text is tokenized with BOS in
   front and each window's first token is replaced by BOS. */
static void perplexity(const Model *m, RunState *s, const char *path, int ctx)
{
    FILE *f = fopen(path, "rb");
    if (!f) die(EXIT_RUNTIME, "cannot open %s: %s", path, strerror(errno));
    size_t n;
    char *buf = read_stream(f, path, 0, PPL_MAX_BYTES, "--ppl reads at most 64 MiB (score a part of the text)", &n);
    fclose(f);
    Tokens text = {0};
    push_encoded(m, &text, buf, n, TOK_ADD_SPECIAL); /* with BOS in front for add-BOS models, as llama.cpp tokenizes it */
    free(buf);
    const tok_info *ti = tok_get_info(m->tok);
    int n_win = text.n / ctx;
    if (n_win < 1) die(EXIT_RUNTIME, "%s has %d tokens, fewer than one window of %d (lower --ctx)", path, text.n, ctx);
    Score sc = {.first = ctx / 2, .ctx = ctx, .vocab = m->c.vocab_size};
    double t0 = now_ms();
    for (int w = 0; w < n_win; w++) {
        int *win = text.ids + (size_t)w * ctx, saved = win[0];
        if (ti->add_bos && ti->bos >= 0) win[0] = ti->bos;
        sc.win = win;
        each_logits(m, s, win, ctx, 0, score_block, &sc);
        win[0] = saved;
        if (isatty(STDERR_FILENO)) fprintf(stderr, "\r[%d/%d] ppl %.4f", w + 1, n_win, exp(sc.nll / sc.scored));
    }
    double sec = (now_ms() - t0) / 1e3;
    if (isatty(STDERR_FILENO)) fputc('\n', stderr);
    printf("perplexity: %.4f over %ld tokens (%d windows of %d, second half scored), %.0f tok/s\n",
           exp(sc.nll / sc.scored), sc.scored, n_win, ctx, (double)n_win * ctx / sec);
    free(text.ids);
}



/* ----- the command line ------------------------------------------------------
   -h's text, the flags' parsing and checks (usage errors exit 2), the
   prompt's sources (-i, stdin, --ids), --dump-logits and --prompt-cache's
   opening. */

static void usage(FILE *f)
{
    fprintf(f,
        "usage: run MODEL [options]\n"
        "Generates text with a model file written by export.py. The prompt comes\n"
        "from -i, or from stdin when stdin is not a terminal (one trailing newline,\n"
        "\\n or \\r\\n, is dropped; reading stops with an error past what the\n"
        "context can hold: ctx x the longest token's bytes). Only generated text\n"
        "goes to stdout; errors and -v go to stderr.\n"
        "\n"
        "Generation\n"
        "  -i PROMPT      prompt text (an empty prompt is an error; so is a byte that no\n"
        "                 token of the vocabulary holds, in any prompt text: -i, stdin,\n"
        "                 -y, chat messages, batch lines; --tokenize too)\n"
        "  -n N           tokens to generate, >= 0 (default 256; stops earlier at the\n"
        "                 end-of-turn token or the end of the context)\n"
        "  -t TEMP        temperature, in [0, 100]; 0 = greedy (default 0.8)\n"
        "  -p TOPP        top-p nucleus, in (0, 1] (default 0.95)\n"
        "  -k TOPK        top-k, >= 0; 0 = off (default 40)\n"
        "  --min-p P      keep the tokens whose probability is at least P x the most\n"
        "                 likely one's, P in [0, 1] (default 0: off)\n"
        "  --repeat-penalty R  each token among the last N of the context (the\n"
        "                 prompt's included) has its logit divided by R (multiplied\n"
        "                 when it is not positive), R in [0.01, 100] (default 1: off)\n"
        "  --repeat-last-n N  the penalties' window, N >= 0; 0 = no penalties (default 64)\n"
        "  --presence-penalty X  lowers the logit of each token in that window by X,\n"
        "                 X in [0, 100] (default 0)\n"
        "  --frequency-penalty X  ... and by X times its count there, X in [0, 100]\n"
        "                 (default 0)\n"
        "                 The chain: penalties, then -t, then -k, -p and --min-p\n"
        "                 (README \"Sampling\")\n"
        "  -s SEED        random seed, >= 0 (default: from the clock)\n"
        "  -c             wrap the prompt in the model's chat template (one user turn)\n"
        "  -m MODE        generate (default) or chat\n"
        "  -y TEXT        system prompt for -c, chat and batch chat lines (default: the\n"
        "                 template's own; without any of them a usage error)\n"
        "  --stop STR     end the text (each chat answer) just before the first\n"
        "                 occurrence of STR, which is not printed; repeatable, up to\n"
        "                 %d strings of at most %d bytes; escapes \\n, \\t, \\\\ (any\n"
        "                 other backslash is an error). Text that could begin a stop\n"
        "                 string is held back until it cannot\n"
        "  --special      parse control-token texts such as <|im_start|> in the prompt,\n"
        "                 with -c and -y, in chat messages and batch lines too (by\n"
        "                 default they are plain text and cannot inject tokens)\n"
        "  --logprobs N   stdout becomes JSON Lines, one record per generated token:\n"
        "                 {\"id\", \"text\", \"logprob\", \"top\": [{\"id\", \"text\", \"logprob\"},\n"
        "                 ...]}, top the N (0-20) most likely tokens. Log-probabilities\n"
        "                 (natural log) of the distribution sampled from: after the\n"
        "                 whole chain (tokens it drops have no entry); with -t 0 the\n"
        "                 full softmax of the penalized logits at temperature 1. The\n"
        "                 end-of-turn token that stops generation gets a record too.\n"
        "                 Chat: an empty line after each answer's records\n"
        "  --json         the output is exactly one JSON value (RFC 8259): tokens that\n"
        "                 would break it are never sampled, and generation ends when\n"
        "                 the value is complete (with -m chat: each answer). At most\n"
        "                 16 whitespace bytes in a row (one line break), none after the\n"
        "                 value; numbers of at most 40 bytes; nesting depth at most\n"
        "                 32. An end token (even with --ignore-eos) is allowed only\n"
        "                 once the value is complete. If -n or the context runs out\n"
        "                 first, stdout keeps the text and the exit status is 1\n"
        "  --json-schema FILE  the same, and the value matches the JSON Schema in FILE\n"
        "                 (the subset the README's \"Structured output\" lists; any\n"
        "                 other keyword is an error naming its path)\n"
        "Numbers are plain decimals: no hex (0x10), no spaces, no inf or nan.\n"
        "\n"
        "Chat (-m chat): one user message per line of stdin; each answer is printed\n"
        "followed by a newline (-n 0: an empty line). Each turn prefills only its new\n"
        "tokens. When the conversation plus min(-n, ctx/4) answer tokens would\n"
        "overflow the context, the oldest exchanges are dropped (the system turn is\n"
        "kept) until it fills at most half the context, and the rest is prefilled\n"
        "again. A message too long to fit alone is refused (stderr) and answered with\n"
        "an empty line; a system prompt (-y) that leaves no room for any message, a\n"
        "line longer than the context could ever hold, or a read error, ends the chat\n"
        "with an error (exit 1).\n"
        "Ctrl-C stops an answer; Ctrl-C at the prompt or Ctrl-D exits.\n"
        "\n"
        "Engine\n"
        "  --threads N    worker threads, >= 1 (default and maximum: the CPUs this\n"
        "                 process may use, from its affinity mask and cgroup CPU quota;\n"
        "                 while other programs take those cores, passes run with fewer)\n"
        "  --ctx N        context length in tokens (default: the model's; for --ppl 512,\n"
        "                 at least 3)\n"
        "  --kv TYPE      KV cache precision: f32, f16, q8 or q4 (default f16)\n"
        "  --lookup N     lookup decoding: guess up to N (0-15) next tokens from the\n"
        "                 context and check them in one pass, as many as the passes'\n"
        "                 measured costs make worth it; 0 turns it off (default 15).\n"
        "                 The output is the same as without it (with -s, the same text)\n"
        "  --lookup-fixed plan the guesses as if every pass cost one decode step, not by\n"
        "                 measured times: the same guesses on any machine and load\n"
        "  -v             stderr: model summary, then per request prompt tokens,\n"
        "                 TTFT, prefill tok/s and GFLOP/s, decode tok/s and GB/s, mean,\n"
        "                 p50 and p90 inter-token latency\n"
        "  --prompt-cache FILE  keep the prompt's K and V in FILE: a run whose prompt\n"
        "                 begins with FILE's tokens loads them and prefills only the\n"
        "                 rest (the output does not change), then stores its own\n"
        "                 prompt's there (chat: the conversation at each turn; batch:\n"
        "                 every line starts from FILE, the first line's prompt is\n"
        "                 stored). A FILE made with another model, --kv, --ctx or\n"
        "                 kernel set, or damaged, is ignored (-v says why) and replaced;\n"
        "                 a FILE that is not a prompt cache (or the model) is an error\n"
        "  --prompt-cache-ro  with --prompt-cache: never write FILE, and a FILE that\n"
        "                 cannot be used is an error\n"
        "  --probe        measure this machine's DRAM and last-level cache read bandwidth\n"
        "                 and f32/int8 peaks first (~0.5 s); with -v each phase is shown\n"
        "                 against its roofline (decode: the level its bytes stream from)\n"
        "\n"
        "Tools (each a mode of its own: --ppl, --dump-logits, --tokenize and -m chat\n"
        "do not combine, and --ppl takes no prompt; such a combination is an error)\n"
        "  --tokenize     print the prompt's token ids on one line and exit (an empty\n"
        "                 prompt too: the line holds what the model adds, BOS or nothing)\n"
        "  --ppl FILE     perplexity of a text file (at most 64 MiB) in windows of\n"
        "                 --ctx tokens\n"
        "  --ids \"1 2 3\"  give the prompt as token ids instead of text (not with -c)\n"
        "  --dump-logits FILE  write float32 logits [prompt tokens, vocab] of every\n"
        "                 prompt position (batched prefill) to FILE and exit; written\n"
        "                 under a temporary name and renamed when complete, so FILE\n"
        "                 is whole or untouched; FILE must be a regular file if it exists\n"
        "  --no-batch     with --dump-logits: feed the prompt one token at a time\n"
        "  --exact-batch N  with --dump-logits: N tokens per pass, each computed exactly\n"
        "                 as a decode step (lookup decoding's verification pass)\n"
        "  --kernels NAME the kernel set: scalar (the plain reference kernels; slow, for\n"
        "                 checking), avx2, avxvnni (x86-64 with AVX-VNNI) or avx512 (with\n"
        "                 AVX-512 VNNI), neon or neon-dot (aarch64 with sdot): one this\n"
        "                 CPU runs (default: $RUN_KERNELS if set, else the best; -v\n"
        "                 names it)\n"
        "  --scalar       the same as --kernels scalar\n"
        "  --ignore-eos   keep generating past end tokens until -n (benchmarks)\n"
        "  --hugepages    read the model into memory of this run's own, in 2 MiB pages\n"
        "                 where the system gives them (transparent huge pages), instead\n"
        "                 of mapping the file: loading reads it all (a 1 GB file: 0.18\n"
        "                 s from the page cache, against 0.02) and the weights are not\n"
        "                 shared with other runs, but every pass is faster (fewer TLB\n"
        "                 misses; README \"Huge pages\")\n"
        "  --batch FILE   batch mode: one request per line of FILE (- for stdin), plain\n"
        "                 text or a JSON object {\"prompt\", \"id\", \"n\", \"t\", \"top_k\",\n"
        "                 \"top_p\", \"min_p\", \"repeat_penalty\", \"repeat_last_n\",\n"
        "                 \"presence_penalty\", \"frequency_penalty\", \"chat\", \"system\",\n"
        "                 \"stop\", \"json\", \"schema\", \"logprobs\"}; one JSON record per\n"
        "                 line on stdout, in input order (README \"Batch\"); exit 1 if a\n"
        "                 line failed\n"
        "  --parallel B   batch mode: sequences in flight, 1-64 (default: what the KV\n"
        "                 page pool holds at -n tokens each, at most 32)\n"
        "  --kv-mem MB    batch mode: the KV cache page pool (default 1024)\n"
        "  --print-prompt-ids  print each prefilled block's token ids to stderr\n"
        "                 (\"ids: 1 2 3\"; shows what a chat template built)\n"
        "  -h, --help     this help; --version prints the version\n"
        "\n"
        "Exit status: 0 success (also when the reader of stdout goes away early),\n"
        "1 runtime error (damaged model file, prompt longer than the context, a\n"
        "file that cannot be opened or read, for any flag that names one, or\n"
        "cannot be written, ...), 2 usage error (a bad flag or flag value),\n"
        "130 interrupted at the chat prompt or in batch mode.\n", STOP_MAX, STOP_MAX_BYTES);
}

/* Flag values are plain decimal numbers: strtol and strtod would also take
   leading spaces, and strtod hex floats, inf and nan. */
static int is_decimal(const char *v, const char *chars) { return *v && !v[strspn(v, chars)]; }

static long parse_long(const char *flag, const char *v, long lo, long hi)
{
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (!is_decimal(v, "+-0123456789") || errno || end == v || *end || x < lo || x > hi)
        die(EXIT_USAGE, "%s expects an integer in [%ld, %ld], got '%s'", flag, lo, hi, v);
    return x;
}

/* A number in [lo, hi] ((lo, hi] with lo_open). Parsed as a double: a
   float's subnormals (-t 1e-38) are numbers like any other. */
static float parse_float(const char *flag, const char *v, float lo, float hi, int lo_open)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (!is_decimal(v, "+-.0123456789eE") || end == v || *end || !isfinite(x) || x > hi || x < lo || (lo_open && x == lo))
        die(EXIT_USAGE, "%s expects a decimal number in %c%g, %g], got '%s'", flag, lo_open ? '(' : '[', lo, hi, v);
    if (lo_open && (float)x == lo)
        die(EXIT_USAGE, "%s %s is too small: it is %g as a 32-bit float", flag, v, lo);
    return (float)x;
}

/* A command line that cannot run: its problem and where to read more, on
   one line (a script reads the last line of stderr for the reason). */
static _Noreturn void usage_error(const char *fmt, ...)
{
    char msg[MSG_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    die(EXIT_USAGE, "%s (run -h for every option)", msg);
}

/* -h and --version: their text must reach stdout too. */
static _Noreturn void exit_after_stdout(void)
{
    close_stdout();
    exit(EXIT_SUCCESS);
}

/* The KV cache type --kv names: a row of the type table with a kv_name. */
static int kv_type_named(const char *v)
{
    char names[MSG_BYTES] = "";
    for (int t = 0; t < N_TYPES; t++) {
        if (!TYPES[t].kv_name) continue;
        if (!strcmp(v, TYPES[t].kv_name)) return t;
        snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", *names ? ", " : "", TYPES[t].kv_name);
    }
    usage_error("--kv expects one of %s, got '%s'", names, v);
}

/* The kernel set that `what` (--kernels or RUN_KERNELS) names; one this CPU
   cannot run, or an unknown name, is a usage error listing the sets it can. */
static int kernel_set_named(const char *v, const char *what)
{
    char names[MSG_BYTES] = "";
    for (int k = 0; k < N_KSETS; k++) {
        if (!kernel_set_available(k)) continue;
        if (!strcmp(v, SETS[k]->op.name)) return k;
        snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", *names ? ", " : "", SETS[k]->op.name);
    }
    usage_error("%s '%s' is not a kernel set this build runs on this CPU (available: %s)", what, v, names);
}

/* --stop STR: STR with the escapes \n, \t and \\ decoded, as one more stop
   string. Any other backslash (a lone one at the end too), an empty string,
   one longer than STOP_MAX_BYTES or more than STOP_MAX of them is a usage
   error naming it. */
static void parse_stop(const Stops **stops, const char *v)
{
    static Stops st_cli; /* the command line's, one per run */
    Stops *st = &st_cli;
    *stops = st;
    if (st->n == STOP_MAX) die(EXIT_USAGE, "--stop given more than %d times (at most %d stop strings)", STOP_MAX, STOP_MAX);
    if (!*v) die(EXIT_USAGE, "--stop expects a non-empty string (an empty one matches before any text)");
    char *out = st->text[st->n];
    int n = 0;
    for (const char *p = v; *p; p++) {
        char c = *p;
        if (c == '\\') {
            c = p[1] == 'n' ? '\n' : p[1] == 't' ? '\t' : p[1] == '\\' ? '\\' : 0;
            if (!p[1]) die(EXIT_USAGE, "--stop '%s' ends in a lone backslash (write \\\\ for a backslash)", v);
            if (!c) /* the escape named whole, even when a multi-byte character follows the backslash */
                die(EXIT_USAGE, "--stop '%s': unknown escape '\\%.*s' (known: \\n, \\t, \\\\)", v,
                    (int)strnlen(p + 1, utf8_len((unsigned char)p[1])), p + 1);
            p++;
        }
        if (n == STOP_MAX_BYTES) die(EXIT_USAGE, "--stop: a stop string is at most %d bytes, '%.40s...' is longer", STOP_MAX_BYTES, v);
        out[n++] = c;
    }
    st->len[st->n++] = n;
}

/* --prompt-cache FILE for the run, not yet opened (open_features). */
static PromptCache *new_prompt_cache(const char *path, int read_only)
{
    PromptCache *pc = xcalloc(1, sizeof *pc);
    pc->path = path, pc->read_only = read_only;
    return pc;
}

/* Once the model and the state are there: the JSON grammar learns the
   vocabulary's token texts, and the prompt cache is opened (its file read
   and checked); a file being written is then removed on a fatal signal
   (chat and batch mode take SIGINT over). */
static void open_features(GenOpts *o, const Model *m, const RunState *s)
{
    if (o->json) build_trie(&o->json->trie, m->tok, m->c.vocab_size);
    if (!o->cache) return;
    pcache_open(o->cache, m, s, o->cache->path, o->cache->read_only, o->verbose);
    int sigs[] = {SIGINT, SIGTERM, SIGHUP};
    for (size_t i = 0; i < sizeof sigs / sizeof *sigs; i++) signal(sigs[i], on_fatal_signal);
}

static void close_features(GenOpts *o)
{
    if (o->cache) pcache_close(o->cache);
    free(o->cache);
    free_json_constraint(o->json);
}


/* What the command line gives Part II's features (--json, --json-schema,
   --prompt-cache): parse_args makes GenOpts' objects of them. */
typedef struct {
    int json;                /* --json */
    const char *json_schema; /* --json-schema FILE */
    const char *cache;       /* --prompt-cache FILE */
    int cache_ro;            /* --prompt-cache-ro */
} FeatureArgs;

/* One flag f with its value v (NULL for a flag without one) into a or x;
   returns 0 for a flag this program does not know. */
static int parse_flag(Args *a, FeatureArgs *x, const char *f, const char *v)
{
    if (!strcmp(f, "-i")) a->prompt = v;
    else if (!strcmp(f, "-n")) a->gen.n_predict = parse_long(f, v, 0, MAX_SEQ);
    else if (!strcmp(f, "-t")) a->sampling.temperature = parse_float(f, v, 0, TEMP_MAX, 0);
    else if (!strcmp(f, "-p")) a->sampling.top_p = parse_float(f, v, 0, 1, 1);
    else if (!strcmp(f, "-k")) a->sampling.top_k = parse_long(f, v, 0, MAX_VOCAB);
    else if (!strcmp(f, "--min-p")) a->sampling.min_p = parse_float(f, v, 0, 1, 0);
    else if (!strcmp(f, "--repeat-penalty")) a->sampling.repeat = parse_float(f, v, REPEAT_PENALTY_MIN, PENALTY_MAX, 0);
    else if (!strcmp(f, "--repeat-last-n")) a->sampling.repeat_last_n = parse_long(f, v, 0, MAX_SEQ);
    else if (!strcmp(f, "--presence-penalty")) a->sampling.presence = parse_float(f, v, 0, PENALTY_MAX, 0);
    else if (!strcmp(f, "--frequency-penalty")) a->sampling.frequency = parse_float(f, v, 0, PENALTY_MAX, 0);
    else if (!strcmp(f, "-s")) { a->seed = parse_long(f, v, 0, 0x7fffffffL); a->seed_set = 1; }
    else if (!strcmp(f, "-m")) a->mode = v;
    else if (!strcmp(f, "-y")) a->gen.system = v;
    else if (!strcmp(f, "--stop")) parse_stop(&a->gen.stops, v);
    else if (!strcmp(f, "--threads")) a->threads = parse_long(f, v, 1, 1024);
    else if (!strcmp(f, "--logprobs")) a->gen.logprobs = parse_long(f, v, 0, LOGPROBS_MAX);
    else if (!strcmp(f, "--lookup")) a->gen.lookup = parse_long(f, v, 0, VERIFY_MAX_TOKENS - 1);
    else if (!strcmp(f, "--exact-batch")) a->exact_batch = parse_long(f, v, 1, VERIFY_MAX_TOKENS);
    else if (!strcmp(f, "--ctx")) a->ctx = parse_long(f, v, 1, MAX_SEQ);
    else if (!strcmp(f, "--ids")) a->ids = v;
    else if (!strcmp(f, "--dump-logits")) a->dump_logits = v;
    else if (!strcmp(f, "--ppl")) a->ppl = v;
    else if (!strcmp(f, "--kv")) a->kv_type = kv_type_named(v);
    else if (!strcmp(f, "-c")) a->chat_wrap = 1;
    else if (!strcmp(f, "-v")) a->gen.verbose = 1;
    else if (!strcmp(f, "--special")) a->gen.special = 1;
    else if (!strcmp(f, "--tokenize")) a->tokenize = 1;
    else if (!strcmp(f, "--no-batch")) a->no_batch = 1;
    else if (!strcmp(f, "--hugepages")) a->hugepages = 1;
    else if (!strcmp(f, "--scalar")) a->kernels = SET_SCALAR.op.name;
    else if (!strcmp(f, "--kernels")) a->kernels = v;
    else if (!strcmp(f, "--print-prompt-ids")) a->gen.print_ids = 1;
    else if (!strcmp(f, "--probe")) a->probe = 1;
    else if (!strcmp(f, "--ignore-eos")) a->gen.ignore_eos = 1;
    else if (!strcmp(f, "--lookup-fixed")) a->gen.lookup_fixed = 1;
    else if (!strcmp(f, "--batch")) a->batch.path = v;
    else if (!strcmp(f, "--parallel")) a->batch.parallel = parse_long(f, v, 1, BATCH_MAX);
    else if (!strcmp(f, "--kv-mem")) a->batch.kv_mb = parse_long(f, v, 1, 1 << 24);
    else if (!strcmp(f, "--json")) x->json = 1;
    else if (!strcmp(f, "--json-schema")) x->json_schema = v;
    else if (!strcmp(f, "--prompt-cache")) x->cache = v;
    else if (!strcmp(f, "--prompt-cache-ro")) x->cache_ro = 1;
    else return 0;
    return 1;
}

/* Pairs of options where one would be ignored, or contradicts the other. */
static void check_conflicts(const Args *a, const FeatureArgs *x)
{
    int chat = !strcmp(a->mode, "chat");
    const struct { int both; const char *x, *y; } conflict[] = {
        {a->prompt && a->ids, "-i", "--ids"},
        {chat && a->prompt, "-m chat", "-i"},
        {chat && a->ids, "-m chat", "--ids"},
        {chat && a->tokenize, "-m chat", "--tokenize"},
        {chat && a->dump_logits, "-m chat", "--dump-logits"},
        {a->ppl && chat, "--ppl", "-m chat"},
        {a->ppl && a->prompt, "--ppl", "-i"},
        {a->ppl && a->ids, "--ppl", "--ids"},
        {a->ppl && a->chat_wrap, "--ppl", "-c"},
        {a->ppl && a->tokenize, "--ppl", "--tokenize"},
        {a->ppl && a->dump_logits, "--ppl", "--dump-logits"},
        {a->tokenize && a->dump_logits, "--tokenize", "--dump-logits"},
        {a->chat_wrap && a->ids, "-c", "--ids"},
        {a->batch.path && a->prompt, "--batch", "-i"},
        {a->batch.path && a->ids, "--batch", "--ids"},
        {a->batch.path && chat, "--batch", "-m chat"},
        {a->batch.path && a->ppl, "--batch", "--ppl"},
        {a->batch.path && a->dump_logits, "--batch", "--dump-logits"},
        {a->batch.path && a->tokenize, "--batch", "--tokenize"},
        {a->batch.parallel && !a->batch.path, "--parallel", "no --batch"},
        {a->batch.kv_mb && !a->batch.path, "--kv-mem", "no --batch"},
        {a->gen.system && !a->chat_wrap && !chat && !a->batch.path, "-y", "no -c, -m chat or --batch"},
        {a->gen.logprobs >= 0 && a->ppl, "--logprobs", "--ppl"},
        {a->gen.logprobs >= 0 && a->dump_logits, "--logprobs", "--dump-logits"},
        {a->gen.logprobs >= 0 && a->tokenize, "--logprobs", "--tokenize"},
        {a->gen.stops && a->ppl, "--ppl", "--stop"},
        {a->gen.stops && a->tokenize, "--tokenize", "--stop"},
        {a->gen.stops && a->dump_logits, "--dump-logits", "--stop"},
        {x->json && x->json_schema, "--json", "--json-schema"},
        {(x->json || x->json_schema) && a->ppl, x->json ? "--json" : "--json-schema", "--ppl"},
        {(x->json || x->json_schema) && a->dump_logits, x->json ? "--json" : "--json-schema", "--dump-logits"},
        {(x->json || x->json_schema) && a->tokenize, x->json ? "--json" : "--json-schema", "--tokenize"},
        {x->cache_ro && !x->cache, "--prompt-cache-ro", "no --prompt-cache"},
        {x->cache && a->ppl, "--prompt-cache", "--ppl"},
        {x->cache && a->dump_logits, "--prompt-cache", "--dump-logits"},
        {x->cache && a->tokenize, "--prompt-cache", "--tokenize"},
        {a->no_batch && a->exact_batch, "--no-batch", "--exact-batch"},
        {(a->no_batch || a->exact_batch) && !a->dump_logits, a->no_batch ? "--no-batch" : "--exact-batch", "no --dump-logits"},
    };
    for (size_t i = 0; i < sizeof conflict / sizeof *conflict; i++)
        if (conflict[i].both) usage_error("%s and %s cannot be used together", conflict[i].x, conflict[i].y);
}

static void parse_args(Args *a, int argc, char **argv)
{
    FeatureArgs x = {0};
    *a = (Args){.sampling = SAMPLING_DEFAULTS, .mode = "generate", .kv_type = T_F16,
                .gen = {.n_predict = 256, .lookup = LOOKUP_DEFAULT, .logprobs = -1}};
    static const char *with_value[] = {"-i", "-n", "-t", "-p", "-k", "-s", "-m", "-y", "--threads", "--ctx",
                                       "--ids", "--dump-logits", "--ppl", "--kv", "--lookup", "--exact-batch", "--kernels",
                                       "--batch", "--parallel", "--kv-mem",
                                       "--logprobs", "--stop", "--json-schema", "--min-p", "--repeat-penalty",
                                       "--repeat-last-n", "--presence-penalty", "--frequency-penalty", "--prompt-cache", NULL};
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i], *v = NULL;
        if (!strcmp(f, "-h") || !strcmp(f, "--help")) { usage(stdout); exit_after_stdout(); }
        if (!strcmp(f, "--version")) { printf("run %s\n", VERSION); exit_after_stdout(); }
        if (f[0] != '-' || !f[1]) {
            if (a->model_path) usage_error("unexpected argument '%s'", f);
            a->model_path = f;
            continue;
        }
        for (int j = 0; with_value[j]; j++)
            if (!strcmp(f, with_value[j])) {
                if (i + 1 >= argc) usage_error("%s needs a value", f);
                v = argv[++i];
            }
        if (!parse_flag(a, &x, f, v)) usage_error("unknown option '%s'", f);
    }
    if (!a->model_path) usage_error("%s", "no model file given");
    if (!a->model_path[0]) usage_error("%s", "the model file name is empty");
    const struct { const char *flag, *path; } files[] = {{"--prompt-cache", x.cache}, {"--dump-logits", a->dump_logits},
        {"--ppl", a->ppl}, {"--batch", a->batch.path}, {"--json-schema", x.json_schema}};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++)
        if (files[i].path && !files[i].path[0]) usage_error("%s expects a file name, got ''", files[i].flag);
    if (strcmp(a->mode, "generate") && strcmp(a->mode, "chat")) usage_error("-m expects generate or chat, got '%s'", a->mode);
    check_conflicts(a, &x);
    if (a->no_batch) a->exact_batch = 1;
    int answers = strcmp(a->mode, "chat") && !a->batch.path && !a->ppl && !a->dump_logits && !a->tokenize;
    a->gen.json = build_json_constraint(x.json, x.json_schema); /* a bad schema is refused before the model loads */
    if (a->gen.json && answers && a->gen.n_predict == 0) die(EXIT_RUNTIME, "the JSON value is incomplete: -n 0 generates nothing");
    a->gen.cache = x.cache ? new_prompt_cache(x.cache, x.cache_ro) : NULL;
    a->batch.chat = a->chat_wrap, a->batch.special = a->gen.special;
}

/* Parses "--ids" text: whitespace- or comma-separated token ids, each
   < vocab. */
static void parse_ids(Tokens *t, const char *text, int vocab)
{
    for (const char *p = text; *p;) {
        if (*p == ' ' || *p == '\t' || *p == '\n' || *p == ',') { p++; continue; }
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p) usage_error("--ids: '%s' is not a list of token ids", text);
        if (errno || v < 0 || v >= vocab)
            die(EXIT_USAGE, "--ids: token id %.*s is outside the vocabulary [0, %d)", (int)(end - p), p, vocab);
        push(t, (int)v);
        p = end;
    }
}

/* The prompt as tokens, from --ids, -i or stdin (at most what ctx tokens
   can hold); with -c wrapped in the chat template. Returns the prompt's
   length in bytes (0 for --ids). */
static size_t prompt_tokens(const Model *m, const Args *a, int ctx, Tokens *t)
{
    if (a->ids) { parse_ids(t, a->ids, m->c.vocab_size); return 0; }
    size_t len;
    char *text;
    if (a->prompt) text = strdup(a->prompt), len = strlen(a->prompt);
    else if (!isatty(STDIN_FILENO)) {
        char why[ERR_BYTES];
        size_t max = text_limit(m, ctx, why, sizeof why) + 2; /* + the newline dropped below */
        text = read_stream(stdin, "the prompt on stdin", 0, max, why, &len);
        if (len && text[len - 1] == '\n') len -= len > 1 && text[len - 2] == '\r' ? 2 : 1; /* "\n" or "\r\n" */
    }
    else usage_error("%s", "no prompt: give -i PROMPT or pipe it on stdin");
    if (!text) die(EXIT_RUNTIME, "out of memory");
    if (!len && a->chat_wrap) die(EXIT_RUNTIME, "the prompt is empty");
    Chat ch;
    if (a->chat_wrap) build_chat(&ch, m, a->gen.system, a->gen.system ? strlen(a->gen.system) : 0);
    char why[ERR_BYTES];
    if (prompt_text_problem(m, text, len, a->chat_wrap ? &ch : NULL, why, sizeof why)) die(EXIT_RUNTIME, "%s", why);
    tokenize_prompt(m, text, len, a->chat_wrap ? &ch : NULL, a->gen.special, t);
    free(text);
    return len;
}

/* --dump-logits: where the logits go, a pass's rows at a time (CHUNK_TOKENS,
   or --exact-batch's N). */
typedef struct {
    FILE *f;
    const char *path;
    size_t vocab;
} Dump;

static void write_logits(void *ctx, const RunState *s, int off, int k)
{
    Dump *d = ctx;
    (void)off;
    for (int t = 0; t < k; t++) check_logits(s->logits + (size_t)t * d->vocab, d->vocab); /* damaged weights: an error, not nan */
    if (fwrite(s->logits, sizeof(float) * d->vocab, k, d->f) != (size_t)k)
        die(EXIT_RUNTIME, "cannot write %s: %s", d->path, strerror(errno));
}

/* Logits of every prompt position, batched (or one token at a time with
   --no-batch, N with --exact-batch N), written under a temporary name in
   FILE's directory and renamed over FILE when complete: a full disk, a
   file-size limit or a signal leaves FILE as it was. Something other than
   a regular file at FILE (a device, a FIFO, a symlink) is refused, not
   replaced. */
static void dump_logits(const Model *m, RunState *s, const Tokens *p, const Args *a)
{
    const char *path = a->dump_logits;
    struct stat st;
    if (lstat(path, &st) == 0) {
        if (!S_ISREG(st.st_mode))
            die(EXIT_RUNTIME, "--dump-logits %s: not a regular file (a device, FIFO, directory or symlink is not replaced)", path);
        if (st.st_dev == m->dev && st.st_ino == m->ino) die(EXIT_RUNTIME, "--dump-logits %s: this is the model file: it is not replaced", path);
    }
    if (snprintf(temp_path, sizeof temp_path, "%s.tmp-%ld", path, (long)getpid()) >= (int)sizeof temp_path)
        temp_path[0] = 0, die(EXIT_RUNTIME, "cannot write %s: File name too long", path);
    int sigs[] = {SIGINT, SIGTERM, SIGHUP};
    for (size_t i = 0; i < sizeof sigs / sizeof *sigs; i++) signal(sigs[i], on_fatal_signal);
    int fd = open(temp_path, O_WRONLY | O_CREAT | O_EXCL, 0666);
    if (fd < 0) {
        int e = errno;
        temp_path[0] = 0; /* not ours to remove */
        die(EXIT_RUNTIME, "cannot write %s: %s", path, strerror(e));
    }
    Dump d = {fdopen(fd, "wb"), path, m->c.vocab_size};
    if (!d.f) die(EXIT_RUNTIME, "cannot write %s: %s", path, strerror(errno));
    each_logits(m, s, p->ids, p->n, a->exact_batch, write_logits, &d);
    if (fclose(d.f) != 0) die(EXIT_RUNTIME, "cannot write %s: %s", path, strerror(errno));
    if (rename(temp_path, path) != 0) die(EXIT_RUNTIME, "cannot write %s: %s", path, strerror(errno));
    temp_path[0] = 0;
}

/* Points stdin, stdout or stderr at /dev/null when it is closed, so that
   no file this run opens takes its number (the text meant for stdout
   would go into it). Opened for the other direction, it fails every use
   as the closed descriptor did: a closed stdout is still an error. */
static void reserve_std_fds(void)
{
    for (int fd = STDIN_FILENO; fd <= STDERR_FILENO; fd++)
        if (fcntl(fd, F_GETFD) < 0 && errno == EBADF) {
            int r = open("/dev/null", fd == STDIN_FILENO ? O_WRONLY : O_RDONLY);
            if (r >= 0 && r != fd) { dup2(r, fd); close(r); }
        }
}

/* The CPUs this process may use: the online ones, limited by its affinity
   mask (taskset, cpusets) and by a cgroup v2 CPU quota (cpu.max "QUOTA
   PERIOD" grants QUOTA/PERIOD CPUs' worth of time, rounded up). Threads
   beyond them only wait at the barriers: under `taskset -c 0` two threads
   decoded 8x slower than one. */
static int usable_cpus(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0 && CPU_COUNT(&set) < n) n = CPU_COUNT(&set);
    /* this process's cgroup is the "0::PATH" line of /proc/self/cgroup; in a
       container the namespace's root holds the limit */
    char line[MSG_BYTES], path[MSG_BYTES + 64] = "/sys/fs/cgroup/cpu.max";
    FILE *f = fopen("/proc/self/cgroup", "r");
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "0::/", 4)) {
            line[strcspn(line, "\n")] = 0;
            snprintf(path, sizeof path, "/sys/fs/cgroup%s/cpu.max", line + 3);
        }
    if (f) fclose(f);
    long quota, period;
    if (!(f = fopen(path, "r"))) f = fopen("/sys/fs/cgroup/cpu.max", "r");
    if (f && fscanf(f, "%ld %ld", &quota, &period) == 2 && quota > 0 && period > 0 && (quota + period - 1) / period < n)
        n = (quota + period - 1) / period; /* "max PERIOD" (no quota) does not scan */
    if (f) fclose(f);
    return n > 0 ? (int)n : 1;
}


/* The least stack each thread may have. A stack overflow is a crash with
   no message, so a smaller one is refused up front. Measured (2026-12-07,
   x86-64, GCC): the main thread needs under 128 KB (a 30-deep JSON schema,
   a deeply nested batch line); a worker 17-18 KB (the wide products'
   frames, ~7 KB, under the pass's calls). Each minimum is about 4x that. */
#define STACK_MIN_MAIN (512 << 10)
#define STACK_MIN_WORKER (64 << 10)

#ifdef _OPENMP
/* OpenMP's worker stack size in bytes, from OMP_STACKSIZE (else libgomp's
   GOMP_STACKSIZE) in the OpenMP form: a number and an optional unit B, K
   (the default), M or G, spaces allowed around them. -1 when unset or
   not of that form (libgomp then ignores it too, with its own warning). */
static long long omp_stack_bytes(const char **name)
{
    static const char UNITS[] = "BKMG"; /* bytes, and 2^10, 2^20, 2^30 of them */
    const char *v = getenv(*name = "OMP_STACKSIZE");
    if (!v) v = getenv(*name = "GOMP_STACKSIZE");
    if (!v) return -1;
    while (isspace((unsigned char)*v)) v++;
    if (!isdigit((unsigned char)*v)) return -1;
    long long n = 0, most = 1LL << 32; /* past any minimum, and no overflow once scaled */
    for (; isdigit((unsigned char)*v); v++)
        if ((n = n * 10 + (*v - '0')) > most) n = most;
    while (isspace((unsigned char)*v)) v++;
    int shift = 10; /* K, the default */
    if (*v) {
        const char *u = strchr(UNITS, toupper((unsigned char)*v++));
        if (!u) return -1;
        shift = 10 * (int)(u - UNITS);
    }
    while (isspace((unsigned char)*v)) v++;
    return *v ? -1 : n << shift;
}
#endif

/* Refuses stacks smaller than the run needs: the process's stack limit
   (the main thread's) and, with a team of several, OpenMP's workers'. */
static void check_stacks(int threads)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_STACK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < STACK_MIN_MAIN)
        die(EXIT_RUNTIME, "the stack size limit is %llu KB (ulimit -s); run needs at least %d KB",
            (unsigned long long)rl.rlim_cur >> 10, STACK_MIN_MAIN >> 10);
#ifdef _OPENMP
    /* a size under the threads' minimum is not applied: libgomp warns and
       keeps its default */
    const char *name = "";
    long long omp = threads > 1 ? omp_stack_bytes(&name) : -1, least = sysconf(_SC_THREAD_STACK_MIN);
    if (omp >= 0 && omp >= least && omp < STACK_MIN_WORKER)
        die(EXIT_RUNTIME, "%s=%s gives the worker threads %lld KB of stack; run needs at least %d KB (or --threads 1)",
            name, getenv(name), omp >> 10, STACK_MIN_WORKER >> 10);
#else
    (void)threads; /* no workers */
#endif
}


/* ============================================================================
   APPENDIX A: THE AVX2 KERNEL SET
   Each function computes what its scalar definition in Part I computes
   (tests/test_kernels.c checks every one against it): the packed
   products, the row conversions, the activation quantizers and the f16
   row writer bit for bit; the exponentials, softmax steps and gates
   within float rounding. Compiled into every x86-64 build for AVX2,
   FMA and F16C; used when the CPU has them (cpu_has_avx2) and no other
   set is chosen (--kernels).
   ========================================================================= */
#ifdef HAVE_X86_SETS
TARGET_BEGIN(ISA_AVX2)
/* Does this CPU stream the weights faster when decode_prefetch asks with
   the non-temporal hint? AMD's family 1Ah (Zen 5) does: on an EPYC of
   model 2, 2 threads, interleaved runs, one stream's decode of the 1.5B
   went from 54.5 to 69.5-72.0 tok/s (AVX2 set 53.7 -> 70.2: 70 GB/s, near
   the 72-78 that --probe's plain loop read then), SmolLM2's 581 -> 646, 4
   in flight on the 1.5B +28 %, while prefill and 16 in flight, bound by
   arithmetic, did not move; prefetcht0 there read 67 tok/s. Older CPUs
   keep prefetcht2: on a Zen 4, prefetcht0 had been 30 % slower
   (decode_prefetch), and the non-temporal hint has not been measured on
   one. */
#define CPUID_AMD_EBX 0x68747541 /* "Auth" of "AuthenticAMD" (EBX, EDX, ECX) */
#define CPUID_AMD_EDX 0x69746e65 /* "enti" */
#define CPUID_AMD_ECX 0x444d4163 /* "cAMD" */
#define CPUID_EXTENDED_FAMILY 0xf /* a base family of 0xf adds the extended family field */
#define AMD_FAMILY_ZEN5 0x1a
static int streams_nta(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d) || b != CPUID_AMD_EBX || d != CPUID_AMD_EDX || c != CPUID_AMD_ECX) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    unsigned base = a >> 8 & 0xf, family = base == CPUID_EXTENDED_FAMILY ? base + (a >> 20 & 0xff) : base;
    return family >= AMD_FAMILY_ZEN5;
}

/* max |x| over n (a multiple of 8) floats; NaN if one of them is NaN, as
   quantize_i8 has it. */
static float amax_avx2(const float *x, int n)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        __m256 v = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
        mx = _mm256_max_ps(mx, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) return NAN;
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}

/* 32 floats times id rounded to int8 into q exactly as round_i8 does:
   NaN to 0, clamped to +-127, then roundf's half-away-from-zero rebuilt
   from truncation. Returns the sum of the 32 integers (at most 32 * 127
   in size: an unclamped NaN or inf would convert to INT_MIN). */
static int round_i8x32_avx2(int8_t *q, const float *x, float id)
{
    const __m256 sign = _mm256_set1_ps(-0.0f), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    const __m256 lim = _mm256_set1_ps(127.0f);
    __m256i v[4];
    for (int j = 0; j < 4; j++) {
        __m256 y = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), _mm256_set1_ps(id));
        y = _mm256_and_ps(y, _mm256_cmp_ps(y, y, _CMP_ORD_Q));
        y = _mm256_max_ps(_mm256_min_ps(y, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim));
        __m256 t = _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(y, t)), half, _CMP_GE_OQ);
        t = _mm256_add_ps(t, _mm256_and_ps(up, _mm256_or_ps(one, _mm256_and_ps(sign, y))));
        v[j] = _mm256_cvtps_epi32(t);
    }
    __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    /* the packs interleave 128-bit lanes: restore element order */
    q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, q8);
    __m256i s32 = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    return _mm_cvtsi128_si32(s4);
}

/* Same results as the scalar versions, bit for bit: the scale is computed
   in scalar from the same maximum. */
static void quantize_act_avx2(void *blocks, const float *x, int n)
{
    BlockQ8A *out = blocks;
    for (int b = 0; b < n / QK; b++, x += QK) {
        float d = amax_avx2(x, QK) / 127, id = d ? 1 / d : 0;
        out[b].d = d;
        out[b].sum = round_i8x32_avx2(out[b].qs, x, id);
        out[b].s = d * out[b].sum;
    }
}

/* q8k_bsums on vectors: per 32 bytes, pair sums (maddubs against ones),
   sums of 4 (madd), then of 16 (two horizontal adds); exact integers. */
static void q8k_bsums_avx2(BlockQ8K *b)
{
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int j = 0; j < QK_K; j += QK) {
        __m256i s4 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, _mm256_loadu_si256((const __m256i *)(b->qs + j))), ones16);
        __m256i h = _mm256_hadd_epi32(s4, s4);
        h = _mm256_hadd_epi32(h, h); /* lane 0: the sum of elements 0-15, lane 4: of 16-31 */
        b->bsums[j / 16] = (int16_t)_mm256_extract_epi32(h, 0);
        b->bsums[j / 16 + 1] = (int16_t)_mm256_extract_epi32(h, 4);
    }
}

static void quantize_act_k_avx2(void *blocks, const float *x, int n)
{
    BlockQ8K *out = blocks;
    for (int b = 0; b < n / QK_K; b++, x += QK_K) {
        float d = amax_avx2(x, QK_K) / 127, id = d ? 1 / d : 0;
        out[b].d = d;
        for (int j = 0; j < QK_K; j += QK) round_i8x32_avx2(out[b].qs + j, x + j, id);
        q8k_bsums_avx2(&out[b]);
    }
}

static float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* --- the 32-element integer types' rows ------------------------------------
   Per block, every 32-element type is 32 small integers q, a scale d and,
   for the types with a minimum, m: value = q * d + m. A type's unpacker
   returns q as 32 bytes in element order with d and m; to_float32 turns
   a row into floats (the KV cache's reads, an embedding row). */
#define INLINE static inline __attribute__((always_inline))
#if defined(__clang__)
#define UNROLL(n) _Pragma(PRAGMA_STR(clang loop unroll_count(n)))
#elif defined(__GNUC__)
#define UNROLL(n) _Pragma(PRAGMA_STR(GCC unroll n))
#else
#define UNROLL(n)
#endif
typedef __m256i (*Unpack32Fn)(const uint8_t *block, float *d, float *m);

/* A row as floats, 32 at a time: q * d (+ m) as the scalar version rounds
   it. For the KV cache's types, attention's inner loop at long context. */
INLINE void to_float32(float *out, const uint8_t *row, int n, size_t bb, Unpack32Fn unpack, int has_min)
{
    for (int i = 0; i < n; i += QK) {
        float d, m;
        __m256i q = unpack(row + i / QK * bb, &d, &m);
        for (int j = 0; j < QK; j += 8) {
            __m256i q8 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)&q + j)));
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(q8), _mm256_set1_ps(d));
            _mm256_storeu_ps(out + i + j, has_min ? _mm256_add_ps(v, _mm256_set1_ps(m)) : v); /* no -0 + 0 */
        }
    }
}

/* A 32-element type's AVX2 row conversion, from its unpacker unpack_<name>. */
#define INT32_KERNELS(name, Block, has_min)                                \
    static void to_float_##name##_avx2(float *out, const void *row, int n) \
    {                                                                      \
        to_float32(out, row, n, sizeof(Block), unpack_##name, has_min);    \
    }

/* The 32 nibbles of a 4-bit block's 16 bytes as bytes, in element order
   (byte j holds element j low, j+16 high). */
static __m256i nibbles_32(const uint8_t *qs)
{
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0xf));
}

static __m256i unpack_q8_0(const uint8_t *block, float *d, float *m)
{
    const BlockQ8_0 *b = (const BlockQ8_0 *)block;
    *d = _cvtsh_ss(b->d), *m = 0;
    return _mm256_loadu_si256((const __m256i *)b->qs);
}
INT32_KERNELS(q8_0, BlockQ8_0, 0)

static __m256i unpack_q4_1(const uint8_t *block, float *d, float *m)
{
    const BlockQ4_1 *b = (const BlockQ4_1 *)block;
    *d = _cvtsh_ss(b->d), *m = _cvtsh_ss(b->m);
    return nibbles_32(b->qs);
}
INT32_KERNELS(q4_1, BlockQ4_1, 1)

/* nibbles 0..15 become the signed values -8..7 */
static __m256i unpack_q4_0(const uint8_t *block, float *d, float *m)
{
    const BlockQ4_0 *b = (const BlockQ4_0 *)block;
    *d = _cvtsh_ss(b->d), *m = 0;
    return _mm256_sub_epi8(nibbles_32(b->qs), _mm256_set1_epi8(8));
}
INT32_KERNELS(q4_0, BlockQ4_0, 0)

/* The 5-bit types' bit 4 of each element: byte i = 0x10 where bit i of
   qh is set. Byte i first takes byte i/8 of qh, then keeps its bit i%8. */
static __m256i high_bits_32(const uint8_t *qh)
{
    uint32_t h;
    memcpy(&h, qh, 4);
    __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h),
                                         _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

/* q = 0..31 becomes the signed value q - 16 */
static __m256i unpack_q5_0(const uint8_t *block, float *d, float *m)
{
    const BlockQ5_0 *b = (const BlockQ5_0 *)block;
    *d = _cvtsh_ss(b->d), *m = 0;
    return _mm256_sub_epi8(_mm256_or_si256(nibbles_32(b->qs), high_bits_32(b->qh)), _mm256_set1_epi8(16));
}
INT32_KERNELS(q5_0, BlockQ5_0, 0)

static __m256i unpack_q5_1(const uint8_t *block, float *d, float *m)
{
    const BlockQ5_1 *b = (const BlockQ5_1 *)block;
    *d = _cvtsh_ss(b->d), *m = _cvtsh_ss(b->m);
    return _mm256_or_si256(nibbles_32(b->qs), high_bits_32(b->qh));
}
INT32_KERNELS(q5_1, BlockQ5_1, 1)

/* GCC likes to fold a loaded vector into every FMA that uses it as a memory
   operand, which costs one load per FMA and makes the tile load-bound, and
   to regroup a chain of adds into a tree that spills; an empty asm that
   "changes" the value pins it in a register, in the order written. */
#if defined(__GNUC__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define KEEP_IN_REGISTER(v) (void)0
#endif

/* 8 floats from element i of a row of f32 or f16 values. */
static __m256 load8_f32(const uint8_t *row, int i) { return _mm256_loadu_ps((const float *)row + i); }
static __m256 load8_f16(const uint8_t *row, int i) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i))); }

/* exp(x), 8 at a time, within 2 ulp of expf on [-87.3, 88.3]: x = n ln2 + r
   with |r| <= ln2/2 (ln2 split in two so that n ln2 is exact), exp(r) from
   a minimax polynomial (Cephes' coefficients), times 2^n built in the
   exponent bits. Below -87.3 the result is 0 (expf gives a denormal, which
   no softmax weight notices); above 88.3 it is +inf (expf overflows at
   88.7). The AVX-512 set's exp_512 takes the same steps. */
#define EXP_LO (-87.33654f)
#define EXP_HI 88.3762626647949f
#define EXP_LOG2E 1.44269504f
#define EXP_LN2_HI 0.693359375f     /* ln 2 = EXP_LN2_HI - EXP_LN2_LO, the first exact in few bits */
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_POLY_N 6
#define F32_EXP_BIAS 127 /* 2^n is the float with exponent field n + F32_EXP_BIAS, */
#define F32_MANT_BITS 23 /* above the mantissa's bits */
static const float EXP_POLY[EXP_POLY_N] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                           4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
static __m256 exp_avx2(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(EXP_LO), hi = _mm256_set1_ps(EXP_HI);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 y = _mm256_set1_ps(EXP_POLY[0]);
    for (int k = 1; k < EXP_POLY_N; k++) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_POLY[k]));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(F32_EXP_BIAS)), F32_MANT_BITS);
    __m256 e = _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n)));
    return _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), over);
}

/* (1 + tanh(y)) / 2 = 1 / (1 + exp(-2y)): GELU as x times a sigmoid, so
   it shares SwiGLU's exp; both ends saturate correctly (exp gives inf or 0). */
static void geglu_avx2(float *g, const float *u, int n)
{
    const __m256 one = _mm256_set1_ps(1.0f), c = _mm256_set1_ps(-2 * GELU_C), a = _mm256_set1_ps(GELU_A);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i), inner = _mm256_fmadd_ps(_mm256_mul_ps(a, x), _mm256_mul_ps(x, x), x);
        __m256 e = exp_avx2(_mm256_mul_ps(c, inner));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
    geglu_scalar(g + i, u + i, n - i);
}

static void swiglu_avx2(float *g, const float *u, int n)
{
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i), e = exp_avx2(_mm256_xor_ps(x, sign));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
    swiglu_scalar(g + i, u + i, n - i);
}

static float hmax256(__m256 v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* max_ps(score, mx) keeps mx when a score is NaN, as the scalar compare does. */
static float att_softmax_avx2(float *sc, int n, float scale, float *m)
{
    __m256 vmax = _mm256_set1_ps(*m), vs = _mm256_set1_ps(scale), vsum = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(sc + j), vs);
        _mm256_storeu_ps(sc + j, v);
        vmax = _mm256_max_ps(v, vmax);
    }
    float mx = hmax256(vmax), sum = 0;
    for (int i = j; i < n; i++) {
        sc[i] *= scale;
        mx = sc[i] > mx ? sc[i] : mx;
    }
    __m256 vm = _mm256_set1_ps(mx);
    for (int i = 0; i < j; i += 8) {
        __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(sc + i), vm));
        _mm256_storeu_ps(sc + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    for (int i = j; i < n; i++) sum += sc[i] = expf(sc[i] - mx);
    *m = mx;
    return hsum256(vsum) + sum;
}


/* The horizontal sums of eight vectors, as lanes 0..7 of one: a tree of
   horizontal adds instead of eight separate reductions. */
INLINE __m256 sum8_avx2(const __m256 a[8])
{
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}



/* Prefill's multi-query kernels (contracts at att_qk_scalar). A row of
   the cache comes in as floats through load8_f32 or load8_f16, so an f16
   cache is converted in registers, and each loaded K or V vector serves a
   tile of queries. f16 is a constant in every caller of the INLINE tiles,
   so each type gets its own loop. */

/* Scores of ATT_QK_Q queries times ATT_QK_K keys from query a0 and key j0:
   each key vector is loaded once for all the tile's queries, each query
   vector once for all its keys, and the eight sums are reduced together by
   one tree of horizontal adds. A tile short of queries or keys repeats the
   last one and drops those sums, which keeps one straight-line body. */
INLINE void att_qk_tile_avx2(float *s, const float *q, int nq, int a0, const void *const *k, int nk, int j0, int hd, int f16)
{
    const float *qa[ATT_QK_Q];
    const uint8_t *kb[ATT_QK_K];
    for (int a = 0; a < ATT_QK_Q; a++) qa[a] = q + (size_t)min_i(a0 + a, nq - 1) * hd;
    for (int b = 0; b < ATT_QK_K; b++) kb[b] = k[min_i(j0 + b, nk - 1)];
    __m256 acc[ATT_QK_Q * ATT_QK_K];
    for (int r = 0; r < ATT_QK_Q * ATT_QK_K; r++) acc[r] = _mm256_setzero_ps();
    int vec = hd / 8 * 8;
    for (int i = 0; i < vec; i += 8) {
        __m256 kv[ATT_QK_K];
        for (int b = 0; b < ATT_QK_K; b++) kv[b] = f16 ? load8_f16(kb[b], i) : load8_f32(kb[b], i);
        for (int a = 0; a < ATT_QK_Q; a++) {
            __m256 qv = _mm256_loadu_ps(qa[a] + i);
            for (int b = 0; b < ATT_QK_K; b++) acc[a * ATT_QK_K + b] = _mm256_fmadd_ps(qv, kv[b], acc[a * ATT_QK_K + b]);
        }
    }
    __m256 sum = sum8_avx2(acc);
    if (vec == hd && a0 + ATT_QK_Q <= nq && j0 + ATT_QK_K <= nk) { /* a whole tile: a pair of scores per query */
        for (int a = 0; a < ATT_QK_Q; a++) {
            __m128 half = a < 2 ? _mm256_castps256_ps128(sum) : _mm256_extractf128_ps(sum, 1);
            if (a % 2) _mm_storeh_pi((__m64 *)(s + (a0 + a) * ATT_KTILE + j0), half);
            else _mm_storel_pi((__m64 *)(s + (a0 + a) * ATT_KTILE + j0), half);
        }
        return;
    }
    float sums[ATT_QK_Q * ATT_QK_K];
    _mm256_storeu_ps(sums, sum);
    for (int a = 0; a < ATT_QK_Q && a0 + a < nq; a++)
        for (int b = 0; b < ATT_QK_K && j0 + b < nk; b++) {
            float sum = sums[a * ATT_QK_K + b];
            for (int i = vec; i < hd; i++) sum += qa[a][i] * kv_elem(kb[b], f16 ? T_F16 : T_F32, i);
            s[(a0 + a) * ATT_KTILE + j0 + b] = sum;
        }
}

INLINE void att_qk_type_avx2(float *s, const float *q, int nq, const void *const *k, int hd, int nk, int f16)
{
    for (int a0 = 0; a0 < nq; a0 += ATT_QK_Q)
        for (int j0 = 0; j0 < nk; j0 += ATT_QK_K) att_qk_tile_avx2(s, q, nq, a0, k, nk, j0, hd, f16);
}

static void att_qk_avx2(float *s, const float *q, int nq, const void *const *k, int type, int hd, int nk)
{
    if (type == T_F16) att_qk_type_avx2(s, q, nq, k, hd, nk, 1);
    else att_qk_type_avx2(s, q, nq, k, hd, nk, 0);
}

/* Outputs [i, i + 8 * nv) of queries a0 .. a0 + qt - 1: qt * nv sums kept
   in registers over all nk rows, each V vector loaded once for the qt
   queries. */
INLINE void att_pv_tile_avx2(float *o, int os, const float *p, int a0, int qt, const void *const *v, int nk, int i, int nv, int f16)
{
    __m256 acc[ATT_PV_Q][ATT_PV_V];
    for (int a = 0; a < qt; a++)
        for (int c = 0; c < nv; c++) acc[a][c] = _mm256_loadu_ps(o + (size_t)(a0 + a) * os + i + 8 * c);
    for (int j = 0; j < nk; j++) {
        __m256 vv[ATT_PV_V];
        for (int c = 0; c < nv; c++) vv[c] = f16 ? load8_f16(v[j], i + 8 * c) : load8_f32(v[j], i + 8 * c);
        for (int a = 0; a < qt; a++) {
            __m256 pj = _mm256_broadcast_ss(p + (a0 + a) * ATT_KTILE + j);
            for (int c = 0; c < nv; c++) acc[a][c] = _mm256_fmadd_ps(pj, vv[c], acc[a][c]);
        }
    }
    for (int a = 0; a < qt; a++)
        for (int c = 0; c < nv; c++) _mm256_storeu_ps(o + (size_t)(a0 + a) * os + i + 8 * c, acc[a][c]);
}

/* qt (a constant) queries from a0: the head's outputs in tiles of
   ATT_PV_V vectors, then single vectors, then a scalar tail. */
INLINE void att_pv_rows_avx2(float *o, int os, const float *p, int a0, int qt, const void *const *v, int hd, int nk, int f16)
{
    int i = 0;
    for (; i + 8 * ATT_PV_V <= hd; i += 8 * ATT_PV_V) att_pv_tile_avx2(o, os, p, a0, qt, v, nk, i, ATT_PV_V, f16);
    for (; i + 8 <= hd; i += 8) att_pv_tile_avx2(o, os, p, a0, qt, v, nk, i, 1, f16);
    for (int a = a0; a < a0 + qt; a++)
        for (int j = 0; j < nk; j++)
            for (int e = i; e < hd; e++) o[(size_t)a * os + e] += p[a * ATT_KTILE + j] * kv_elem(v[j], f16 ? T_F16 : T_F32, e);
}

INLINE void att_pv_type_avx2(float *o, int os, const float *p, int nq, const void *const *v, int hd, int nk, int f16)
{
    _Static_assert(ATT_PV_Q == 4, "the tail below covers 1 to 3 queries");
    int a0 = 0;
    for (; a0 + ATT_PV_Q <= nq; a0 += ATT_PV_Q) att_pv_rows_avx2(o, os, p, a0, ATT_PV_Q, v, hd, nk, f16);
    switch (nq - a0) {
    case 3: att_pv_rows_avx2(o, os, p, a0, 3, v, hd, nk, f16); break;
    case 2: att_pv_rows_avx2(o, os, p, a0, 2, v, hd, nk, f16); break;
    case 1: att_pv_rows_avx2(o, os, p, a0, 1, v, hd, nk, f16); break;
    }
}

static void att_pv_avx2(float *o, int os, const float *p, int nq, const void *const *v, int type, int hd, int nk)
{
    if (type == T_F16) att_pv_type_avx2(o, os, p, nq, v, hd, nk, 1);
    else att_pv_type_avx2(o, os, p, nq, v, hd, nk, 0);
}

/* The KV cache's types, 8 elements per step: attention converts every
   cached row it reads, so at long context this is decode's inner loop. */
static void to_float_f16_avx2(float *out, const void *row, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i))));
    to_float_f16_scalar(out + i, (const uint16_t *)row + i, n - i);
}

static void from_float_f16_avx2(void *row, const float *x, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)((uint16_t *)row + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    from_float_f16_scalar((uint16_t *)row + i, x + i, n - i);
}

/* --- packed products on 256-bit vectors (Part II, "the packed layout") --
   A group's 16 rows are two halves of 8 lanes: of every 64 bytes of
   integers, 32 belong to each half. Up to 4 tokens take both halves at
   each step, the K types' 5 to 8 one half at a time (PACKED_PASSES). A
   kernel computes exactly its scalar definition: exact integer sums,
   then the same float steps on 8 lanes at once, so
   the results are bit for bit the scalar set's. dot4 adds the products of
   four unsigned bytes by four signed ones into each int32 lane: vpdpbusd
   with AVX-VNNI; on plain AVX2 maddubs then madd, exact while a pair of
   products fits int16 (integers of up to 6 bits); q8_0's bytes go back to
   signed and take the sign trick. The K kernels, and plain AVX2's 4- and
   5-bit types, keep maddubs's int16 sums as long as they cannot overflow
   and widen them with one madd (the K types' with the sub-block scale). */
#define PACK_TOKS_256 4 /* integer types: tokens per pass over both halves of a group (an int16 and int32 sum per token and half) */
#define PACK_TOKS_KH 8  /* K types: ... over one half, 5 or more tokens (PACKED_PASSES) */
#define PACK_TOKS_F256 6  /* float types: tokens per pass over both halves (a sum per half per token, 12 of 16 registers) */
typedef __m256i (*Dot4Fn)(__m256i acc, __m256i u, __m256i a);

INLINE __m256i dot4_avx2(__m256i acc, __m256i u, __m256i a)
{
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)));
}

/* q8_0 on AVX2: the stored q + 128 back to q, then |q| times a with q's
   sign (maddubs's unsigned side): the sum of q * a, offset included. */
INLINE __m256i dot4_q8_avx2(__m256i acc, __m256i u, __m256i a)
{
    __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));
    __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(a, q));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

/* Integers 4g .. 4g + 3 (g = 0..7) of the 8 rows of half `half` in a
   stretch of `bits`-bit integers: a load and an and or a shift, and for 5
   or 6 bits the high plane's bits moved to bit 4 (packed_row_ints). */
INLINE __m256i stretch_u256(const uint8_t *stretch, int g, int bits, int half)
{
    const uint8_t *p = stretch + 32 * half;
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)(p + 64 * g));
    int extra = bits - 4, j = g / 2;
    __m256i v = _mm256_loadu_si256((const __m256i *)(p + PACK_ROWS * STRETCH / 8 * extra + 64 * j));
    __m256i u = _mm256_and_si256(g & 1 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0f));
    if (!extra) return u;
    int per_byte = 8 / extra, at = g % per_byte * extra; /* field k = g of the plane bytes */
    __m256i pl = _mm256_loadu_si256((const __m256i *)(p + 64 * (g / per_byte)));
    __m256i hi = at <= 4 ? _mm256_slli_epi16(pl, 4 - at) : _mm256_srli_epi16(pl, at - 4);
    return _mm256_or_si256(u, _mm256_and_si256(hi, _mm256_set1_epi8((char)(((1 << extra) - 1) << 4))));
}

/* Four activation bytes of token row x, broadcast. */
INLINE __m256i act4_256(const int8_t *qs) { int32_t a4; memcpy(&a4, qs, 4); return _mm256_set1_epi32(a4); }

/* The 32-element types for T tokens over H halves from half h0 (the
   passes take both halves, T <= PACK_TOKS_256: one activation broadcast
   serves 16 rows). With sum16 (plain AVX2 and integers of at
   most 5 bits) maddubs's int16 sums are added as int16 for sum16 steps,
   whose bound they keep (8 for 4 bits: 8 x 2 x 15 x 128 < 2^15), and
   widened by one madd; else each step is a dot4. */
INLINE void packed32_256(const uint8_t *group, int n, const uint8_t *x, size_t xs, int T, float *out, int bits, int offset,
                         int has_min, Dot4Fn dot4, int sum16, int h0, int H)
{
    const PackForm f = {PACK_BLOCK32, bits, offset, has_min};
    const size_t hb = packed_head_bytes(&f), rb = packed_record_bytes(&f);
    __m256 acc[PACK_TOKS_256][2];
    for (int t = 0; t < T; t++)
        for (int i = 0; i < H; i++) acc[t][i] = _mm256_setzero_ps();
    for (int k = 0; k < n / QK; k++) {
        const uint8_t *rec = group + k * rb;
        __m256i isum[PACK_TOKS_256][2], s16[PACK_TOKS_256][2];
        for (int t = 0; t < T; t++)
            for (int i = 0; i < H; i++) isum[t][i] = s16[t][i] = _mm256_setzero_si256();
        for (size_t b = 0; b < rb; b += CACHE_LINE) decode_prefetch(rec + b);
        UNROLL(8)
        for (int g = 0; g < QK / 4; g++) {
            __m256i u[2];
            for (int i = 0; i < H; i++) u[i] = stretch_u256(rec + hb, g, bits, h0 + i);
            for (int t = 0; t < T; t++) {
                __m256i a = act4_256(((const BlockQ8A *)(x + t * xs) + k)->qs + 4 * g);
                for (int i = 0; i < H; i++) {
                    if (sum16) {
                        s16[t][i] = _mm256_add_epi16(s16[t][i], _mm256_maddubs_epi16(u[i], a));
                        KEEP_IN_REGISTER(s16[t][i]); /* one chain per sum: see packedk_256 */
                    } else {
                        isum[t][i] = dot4(isum[t][i], u[i], a);
                        KEEP_IN_REGISTER(isum[t][i]);
                    }
                }
            }
            if (!sum16 || (g + 1) % sum16) continue;
            for (int t = 0; t < T; t++)
                for (int i = 0; i < H; i++) {
                    isum[t][i] = _mm256_add_epi32(isum[t][i], _mm256_madd_epi16(s16[t][i], _mm256_set1_epi16(1)));
                    s16[t][i] = _mm256_setzero_si256();
                }
        }
        for (int i = 0; i < H; i++) {
            int h = h0 + i;
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rec + h));
            __m256 m = has_min ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rec + 2 + h)) : _mm256_setzero_ps();
            for (int t = 0; t < T; t++) {
                const BlockQ8A *a = (const BlockQ8A *)(x + t * xs) + k;
                __m256i s = offset ? _mm256_sub_epi32(isum[t][i], _mm256_set1_epi32(offset * a->sum)) : isum[t][i];
                acc[t][i] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(a->d)), d, acc[t][i]);
                if (has_min) acc[t][i] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->s), acc[t][i]);
            }
        }
    }
    for (int t = 0; t < T; t++)
        for (int i = 0; i < H; i++) _mm256_storeu_ps(out + t * PACK_ROWS + 8 * (h0 + i), acc[t][i]);
}

/* Any number of tokens, in passes whose token count is a constant so
   that the sums stay in registers (or, past 16 of them, in L1). A pass
   over both halves takes two products per activation broadcast, one over
   a half as many products per unpacked weight vector as tokens: the
   unpacking and the broadcasts share the vector ports with the products.
   Both halves up to PACK_TOKS_256 tokens a pass; with per_half (the K
   types, whose record scales are unpacked once per pass) more than that
   go a half at a time, up to PACK_TOKS_KH a pass. One thread, AMD EPYC
   Zen 3 (tests/bench_kernels.c, 256 x 1536, best of 3), GOP/s at 4 and 8
   tokens, from passes of 4 over a half: q4_k 166 -> 193 and 164 -> 181,
   q6_k 111 -> 129 and 110 -> 130, q4_0 175 -> 208 and 170 -> 211. */
#define PACKED_PASS(impl, toks, h, H, ...) impl(group, n, x + t0 * xs, xs, toks, out + t0 * PACK_ROWS, __VA_ARGS__, h, H)
#define PACKED_PASSES(impl, T, per_half, ...)                                                                    \
    do {                                                                                                         \
        _Static_assert(PACK_TOKS_256 == 4 && PACK_TOKS_KH == 8, "passes of 5 to 8 tokens a half, of 1 to 4 both"); \
        int t0 = 0;                                                                                              \
        while (per_half && T - t0 > PACK_TOKS_256) {                                                             \
            int toks = min_i(T - t0, PACK_TOKS_KH);                                                              \
            for (int h = 0; h < 2; h++) switch (toks) {                                                          \
                case 8: PACKED_PASS(impl, 8, h, 1, __VA_ARGS__); break;                                          \
                case 7: PACKED_PASS(impl, 7, h, 1, __VA_ARGS__); break;                                          \
                case 6: PACKED_PASS(impl, 6, h, 1, __VA_ARGS__); break;                                          \
                case 5: PACKED_PASS(impl, 5, h, 1, __VA_ARGS__); break;                                          \
                }                                                                                                \
            t0 += toks;                                                                                          \
        }                                                                                                        \
        for (; t0 + PACK_TOKS_256 <= T; t0 += PACK_TOKS_256) PACKED_PASS(impl, PACK_TOKS_256, 0, 2, __VA_ARGS__); \
        switch (T - t0) {                                                                                        \
        case 3: PACKED_PASS(impl, 3, 0, 2, __VA_ARGS__); break;                                                  \
        case 2: PACKED_PASS(impl, 2, 0, 2, __VA_ARGS__); break;                                                  \
        case 1: PACKED_PASS(impl, 1, 0, 2, __VA_ARGS__); break;                                                  \
        }                                                                                                        \
    } while (0)

INLINE void packed32_avx2(const uint8_t *group, int n, const uint8_t *x, size_t xs, int T, float *out, int bits, int offset,
                          int has_min, Dot4Fn dot4, int sum16)
{
    PACKED_PASSES(packed32_256, T, 0, bits, offset, has_min, dot4, sum16);
}

/* 8 bytes of half h's rows from a [byte][row] plane, as int32 lanes. */
INLINE __m256i plane8_u(const uint8_t *p, int h) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h))); }
INLINE __m256i plane8_s(const uint8_t *p, int h) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h))); }
/* An int32 lane's low 16 bits in both halves: madd's scale operand. */
INLINE __m256i twice16(__m256i v) { return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v, 16)); }
/* Two int16 values in one lane: madd's pair operand. */
INLINE __m256i pair16(__m256i lo, __m256i hi) { return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(hi, 16)); }

/* A K record's sub-block scales for half h (madd form: twice16), and
   q4_k/q5_k's minimums paired for madd (pair16 of sub-blocks 2p, 2p + 1;
   q6_k: its scales paired, for the offset's term); q4_k/q5_k's unpacked
   from ggml's 12 bytes as k4_scale_min does, 8 rows at once. */
INLINE void k_scales_256(const uint8_t *rec, int h, int k6, __m256i sc[QK_K / 16], __m256i pairs[QK_K / 32])
{
    if (k6) {
        __m256i s[QK_K / 16];
        for (int g = 0; g < QK_K / 16; g++) s[g] = plane8_s(rec + PACK_ROWS * (2 + g), h), sc[g] = twice16(s[g]);
        for (int p = 0; p < QK_K / 32; p++) pairs[p] = pair16(s[2 * p], s[2 * p + 1]);
        return;
    }
    __m256i B[12], mn[QK_K / 32];
    for (int b = 0; b < 12; b++) B[b] = plane8_u(rec + PACK_ROWS * (4 + b), h);
    const __m256i low6 = _mm256_set1_epi32(63), low4 = _mm256_set1_epi32(15);
    for (int j = 0; j < 4; j++) {
        sc[j] = twice16(_mm256_and_si256(B[j], low6));
        mn[j] = _mm256_and_si256(B[j + 4], low6);
        sc[j + 4] = twice16(_mm256_or_si256(_mm256_and_si256(B[j + 8], low4), _mm256_slli_epi32(_mm256_srli_epi32(B[j], 6), 4)));
        mn[j + 4] = _mm256_or_si256(_mm256_srli_epi32(B[j + 8], 4), _mm256_slli_epi32(_mm256_srli_epi32(B[j + 4], 6), 4));
    }
    for (int p = 0; p < 4; p++) pairs[p] = pair16(mn[2 * p], mn[2 * p + 1]);
}

/* Part p of `parts` of the bytes at next asked into L2: a wide product
   asks for the record WIDE_AHEAD further on in memory while it computes
   this one, a part before each pass (all at once, the requests wait for
   fill buffers). A group's records lie one after another and the groups
   too, so that is one stream, the next group's first records past the
   end of one. Asking instead for the next group's same record (6 to 35
   records ahead) was slower: on AMD Zen 5, 2 threads, interleaved
   medians, 3 ahead made the 1.5B's 16 in flight 5-7 % faster (avx2 set
   6.5 %) and its prefill 512 2.3-3.6 % (avx2 2.7 %); 2 and 5 ahead read
   the same as 3. */
INLINE void prefetch_part(const uint8_t *next, size_t bytes, int p, int parts)
{
    size_t lines = bytes / CACHE_LINE;
    for (size_t i = p * lines / parts; i < (p + 1) * lines / parts; i++) __builtin_prefetch(next + i * CACHE_LINE, 0, 2);
}

/* A Q8_K block's sums of 32 (sub-block j: bsums 2j and 2j + 1) as int16
   pairs (j = 2p low, 2p + 1 high): pair p at out[p % 2 + p / 2 * 4] (the
   pack works within 128-bit halves). In vectors: per token and super-block
   three instructions where scalar code takes some twenty, on ports the
   vector instructions share. */
INLINE void bsum_pairs(int32_t out[QK_K / 32], const int16_t *bsums)
{
    __m256i s = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)bsums), _mm256_set1_epi16(1));
    _mm256_storeu_si256((__m256i *)out, _mm256_packs_epi32(s, s));
}

/* x's int16 pair p for madd against a K record's pairs (k_scales_256),
   broadcast: q6_k's sums of 16 (bsums 2p, 2p + 1) as they lie; q4_k and
   q5_k's sums of 32 (bsum_pairs's, in b32). */
INLINE __m256i bsum_pair_256(const int16_t *bsums, const int32_t *b32, int k6, int p)
{
    int32_t pair;
    if (k6) memcpy(&pair, bsums + 2 * p, sizeof pair);
    else pair = b32[p % 2 + p / 2 * 4];
    return _mm256_set1_epi32(pair);
}

/* A K record unpacked once for all the tokens of a wide product. */
typedef struct {
    __m256i u[2][QK_K / 4];     /* per half: element group g of stretch j at 8j + g (stretch_u256) */
    __m256i sc[2][QK_K / 16];   /* per half: k_scales_256's */
    __m256i pairs[2][QK_K / 32];
} KRecord256;

/* Super-block k of a K type for T tokens over H halves from half h0 (T
   <= PACK_TOKS_256 with both halves, so that one activation broadcast
   serves 16 rows; T <= PACK_TOKS_KH with one, so that one unpacked vector
   serves T tokens and the record's scales are unpacked once for them):
   the maddubs products summed in int16 while bounded (8 for 4-bit
   integers, 4 for 5-bit, 2 for 6-bit), then one madd with the sub-block's
   scale; the minimums' (q6_k: the offset's) sums against x's sums of
   sub-blocks as int16 pairs, into acc. The record's integers and scales
   are unpacked here, or taken from b. */
INLINE void k_super_256(const uint8_t *rec, const KRecord256 *b, const uint8_t *x, size_t xs, int k, int T, int bits,
                        int kind, int h0, int H, __m256 acc[][2])
{
    const PackForm f = {kind, bits, kind == PACK_K6 ? 32 : 0, kind == PACK_K4};
    const size_t hb = packed_head_bytes(&f), rb = packed_record_bytes(&f), sb = packed_stretch_bytes(&f);
    const int per16 = bits == 4 ? 8 : bits == 5 ? 4 : 2, g_sub = kind == PACK_K4 ? 8 : 4, k6 = kind == PACK_K6;
    __m256i own_sc[2][QK_K / 16], own_pairs[2][QK_K / 32];
    const __m256i(*sc)[QK_K / 16] = own_sc, (*pairs)[QK_K / 32] = own_pairs;
    if (b) sc = b->sc + h0, pairs = b->pairs + h0;
    else {
        for (int i = 0; i < H; i++) k_scales_256(rec, h0 + i, k6, own_sc[i], own_pairs[i]);
        for (size_t l = 0; l < rb; l += CACHE_LINE) decode_prefetch(rec + l);
    }
    __m256i isum[PACK_TOKS_KH][2];
    for (int t = 0; t < T; t++)
        for (int i = 0; i < H; i++) isum[t][i] = _mm256_setzero_si256();
    for (int j = 0; j < QK_K / STRETCH; j++) {
        const uint8_t *st = rec + hb + j * sb;
        __m256i s16[PACK_TOKS_KH][2];
        for (int t = 0; t < T; t++)
            for (int i = 0; i < H; i++) s16[t][i] = _mm256_setzero_si256();
        UNROLL(8) /* g a constant: every shift an immediate, every load address fixed */
        for (int g = 0; g < STRETCH / 4; g++) {
            __m256i u[2];
            for (int i = 0; i < H; i++) {
                u[i] = b ? b->u[h0 + i][8 * j + g] : stretch_u256(st, g, bits, h0 + i);
                /* Taken from b, GCC loads u again for every token rather
                   than hold it, the sums of 4 tokens over both halves
                   filling the registers: 1.5 vector loads a product where
                   Zen 3 has two a cycle. Held, the int32 sums spill
                   instead, touched once a sub-block: one thread, 72
                   tokens, q4_k 198 -> 224 GOP/s, q5_k 201 -> 209. */
                if (b) KEEP_IN_REGISTER(u[i]);
            }
            for (int t = 0; t < T; t++) {
                __m256i a = act4_256(((const BlockQ8K *)(x + t * xs) + k)->qs + STRETCH * j + 4 * g);
                for (int i = 0; i < H; i++) {
                    s16[t][i] = _mm256_add_epi16(s16[t][i], _mm256_maddubs_epi16(u[i], a));
                    /* Left alone, GCC regroups the unrolled chain of
                       adds into a tree whose partial sums no longer fit
                       the 16 registers: a spill per product, about 0.6
                       products a cycle where Zen 3 issues 2. */
                    KEEP_IN_REGISTER(s16[t][i]);
                }
            }
            if ((g + 1) % per16) continue;
            int sub = (STRETCH * j + 4 * g) / (4 * g_sub);
            for (int t = 0; t < T; t++)
                for (int i = 0; i < H; i++) {
                    isum[t][i] = _mm256_add_epi32(isum[t][i], _mm256_madd_epi16(s16[t][i], sc[i][sub]));
                    s16[t][i] = _mm256_setzero_si256();
                }
        }
    }
    __m256 d[2], negdmin[2];
    for (int i = 0; i < H; i++) {
        d[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rec + h0 + i));
        negdmin[i] = k6 ? d[i] : _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)rec + 2 + h0 + i)));
    }
    for (int t = 0; t < T; t++) {
        const BlockQ8K *a = (const BlockQ8K *)(x + t * xs) + k;
        int32_t b32[QK_K / 32];
        if (!k6) bsum_pairs(b32, a->bsums);
        __m256i msum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int p = 0; p < (k6 ? 8 : 4); p++) {
            __m256i xp = bsum_pair_256(a->bsums, b32, k6, p);
            for (int i = 0; i < H; i++) msum[i] = _mm256_add_epi32(msum[i], _mm256_madd_epi16(pairs[i][p], xp));
        }
        __m256 xd = _mm256_set1_ps(a->d);
        for (int i = 0; i < H; i++) {
            __m256i is = k6 ? _mm256_sub_epi32(isum[t][i], _mm256_slli_epi32(msum[i], 5)) : isum[t][i]; /* - 32 * sum sc_g * x's sum of g */
            acc[t][i] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(is), xd), d[i], acc[t][i]);
            if (!k6) acc[t][i] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(msum[i]), xd), negdmin[i], acc[t][i]);
        }
    }
}

/* The K types for T tokens over H halves from half h0, super-block by
   super-block with the sums in registers (k_super_256). */
INLINE void packedk_256(const uint8_t *group, int n, const uint8_t *x, size_t xs, int T, float *out, int bits, int kind,
                        int h0, int H)
{
    const PackForm f = {kind, bits, kind == PACK_K6 ? 32 : 0, kind == PACK_K4};
    const size_t rb = packed_record_bytes(&f);
    __m256 acc[PACK_TOKS_KH][2];
    for (int t = 0; t < T; t++)
        for (int i = 0; i < H; i++) acc[t][i] = _mm256_setzero_ps();
    for (int k = 0; k < n / QK_K; k++) k_super_256(group + k * rb, NULL, x, xs, k, T, bits, kind, h0, H, acc);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < H; i++) _mm256_storeu_ps(out + t * PACK_ROWS + 8 * (h0 + i), acc[t][i]);
}

/* Any number of tokens, a half at a time past PACK_TOKS_256 (PACKED_PASSES). */
INLINE void packedk_avx2(const uint8_t *group, int n, const uint8_t *x, size_t xs, int T, float *out, int bits, int kind,
                         int unused, Dot4Fn unused_dot4, int unused_sum16)
{
    (void)unused, (void)unused_dot4, (void)unused_sum16;
    PACKED_PASSES(packedk_256, T, 1, bits, kind);
}

/* A wide product's pass: T (a constant) tokens over both halves of
   super-block k, unpacked in b, their sums carried in out from super-block
   k - 1. */
INLINE void k_wide_pass_256(const uint8_t *rec, const KRecord256 *b, const uint8_t *x, size_t xs, int k, int T, float *out,
                            int bits, int kind)
{
    __m256 acc[PACK_TOKS_256][2];
    for (int t = 0; t < T; t++)
        for (int h = 0; h < 2; h++) acc[t][h] = k ? _mm256_loadu_ps(out + t * PACK_ROWS + 8 * h) : _mm256_setzero_ps();
    k_super_256(rec, b, x, xs, k, T, bits, kind, 0, 2, acc);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + t * PACK_ROWS + 8 * h, acc[t][h]);
}

/* The K types for a whole prefill chunk (the set's wide product): each
   super-block's integers and scales unpacked once for every token, which
   then take it PACK_TOKS_256 a pass over both halves, while the record
   WIDE_AHEAD further on is asked into L2 (prefetch_part). The unpacking
   and the scales are the work a call of PACK_TOKS tokens repeats per
   pass; with them done, one
   activation broadcast serving 16 rows beats one unpacked vector serving
   8 tokens (passes of 8 over a half: q4_k 197 -> 204 GOP/s, q6_k 154 ->
   161; of 3 over both, whose sums all fit the registers: 189, 152). One
   thread, AMD EPYC Zen 3, 72 tokens (tests/bench_kernels.c, best of 3,
   GOP/s, against calls of PACK_TOKS): the 1.5B's ffn_up shape q4_k 176 ->
   185, q6_k 125 -> 154, q5_k 144 -> 152; its ffn_down shape q6_k 125 ->
   147 (q6_k's integers take six instructions to unpack, q4_k's one or
   two), all before the passes of 4. */
#define WIDE_MIN_256 PACK_TOKS /* below it the unpacked record's 4 KB of stores cost more than they save: one
                                  thread, q4_k/q6_k GOP/s at 6 tokens 172/118 -> 164/116, at 8 175/129 -> 190/134,
                                  at 9 161/111 -> 190/134, at 12 179/128 -> 205/144 against the PACK_TOKS product */
INLINE void packedk_wide_256(const uint8_t *group, int n, const uint8_t *x, size_t xs, int toks, float *out, int bits, int kind,
                             PackedFn narrow)
{
    const PackForm f = {kind, bits, kind == PACK_K6 ? 32 : 0, kind == PACK_K4};
    const size_t hb = packed_head_bytes(&f), rb = packed_record_bytes(&f), sb = packed_stretch_bytes(&f);
    const int passes = toks / PACK_TOKS_256;
    _Static_assert(WIDE_MIN_256 >= PACK_TOKS_256, "every call past the fallback has a pass to prefetch in");
    if (toks < WIDE_MIN_256) { /* too few tokens to repay storing the unpacked record */
        for (int t0 = 0; t0 < toks; t0 += PACK_TOKS) narrow(group, n, x + t0 * xs, xs, min_i(PACK_TOKS, toks - t0), out + t0 * PACK_ROWS);
        return;
    }
    if (n < QK_K) memset(out, 0, sizeof(float) * PACK_ROWS * toks); /* no super-block to start the sums */
    for (int k = 0; k < n / QK_K; k++) {
        const uint8_t *rec = group + k * rb;
        KRecord256 b;
        for (int h = 0; h < 2; h++) {
            k_scales_256(rec, h, kind == PACK_K6, b.sc[h], b.pairs[h]);
            for (int j = 0; j < QK_K / STRETCH; j++)
                UNROLL(8) /* g a constant: every shift an immediate */
                for (int g = 0; g < STRETCH / 4; g++) b.u[h][8 * j + g] = stretch_u256(rec + hb + j * sb, g, bits, h);
        }
        /* PACKED_PASSES's shape, written out: its impl does not learn the
           pass, and the next record asked for all at once before the
           passes cost one thread at 72 tokens q4_k 222 -> 217 GOP/s,
           q6_k 166 -> 156 (the requests wait for fill buffers). */
        int t0 = 0;
        for (; t0 + PACK_TOKS_256 <= toks; t0 += PACK_TOKS_256) {
            prefetch_part(rec + WIDE_AHEAD * rb, rb, t0 / PACK_TOKS_256, passes);
            k_wide_pass_256(rec, &b, x + t0 * xs, xs, k, PACK_TOKS_256, out + t0 * PACK_ROWS, bits, kind);
        }
        const uint8_t *xt = x + t0 * xs;
        float *o = out + t0 * PACK_ROWS;
        _Static_assert(PACK_TOKS_256 == 4, "a rest of 1 to 3 tokens");
        switch (toks - t0) {
        case 3: k_wide_pass_256(rec, &b, xt, xs, k, 3, o, bits, kind); break;
        case 2: k_wide_pass_256(rec, &b, xt, xs, k, 2, o, bits, kind); break;
        case 1: k_wide_pass_256(rec, &b, xt, xs, k, 1, o, bits, kind); break;
        }
    }
}

/* Element e's 8 rows of half h of a packed float group. */
INLINE __m256 packed_floats_256(const uint8_t *group, int e, int type, int h)
{
    if (type == T_F32) return _mm256_loadu_ps((const float *)group + (size_t)e * PACK_ROWS + 8 * h);
    __m128i v = _mm_loadu_si128((const __m128i *)((const uint16_t *)group + (size_t)e * PACK_ROWS + 8 * h));
    if (type == T_F16) return _mm256_cvtph_ps(v);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)); /* bf16: the high half of an f32 */
}

/* The float types for T <= PACK_TOKS_F256 tokens, both halves at each
   element: a sum per half and token, element by element (dot_float). */
INLINE void packedf_256(const uint8_t *group, int n, const uint8_t *x, size_t xs, int T, float *out, int type)
{
    const size_t eb = (size_t)PACK_ROWS * (type == T_F32 ? 4 : 2);
    __m256 acc[PACK_TOKS_F256][2];
    for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int e = 0; e < n; e++) {
        if (T == 1 && e * eb % CACHE_LINE == 0) decode_prefetch(group + e * eb);
        __m256 w0 = packed_floats_256(group, e, type, 0), w1 = packed_floats_256(group, e, type, 1);
        for (int t = 0; t < T; t++) {
            __m256 a = _mm256_set1_ps(((const float *)(x + t * xs))[e]);
            acc[t][0] = _mm256_fmadd_ps(w0, a, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(w1, a, acc[t][1]);
        }
    }
    for (int t = 0; t < T; t++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + t * PACK_ROWS + 8 * h, acc[t][h]);
}

INLINE void packedf_avx2(const uint8_t *group, int n, const uint8_t *x, size_t xs, int T, float *out, int type, int unused1,
                         int unused2, Dot4Fn unused_dot4)
{
    (void)unused1, (void)unused2, (void)unused_dot4;
    _Static_assert(PACK_TOKS_F256 == 6, "PACK_TOKS tokens are one pass and a rest of 2");
    int t0 = 0; /* every pass's token count a constant, so the sums stay in registers */
    for (; t0 + PACK_TOKS_F256 <= T; t0 += PACK_TOKS_F256)
        packedf_256(group, n, x + t0 * xs, xs, PACK_TOKS_F256, out + t0 * PACK_ROWS, type);
    switch (T - t0) {
    case 5: packedf_256(group, n, x + t0 * xs, xs, 5, out + t0 * PACK_ROWS, type); break;
    case 4: packedf_256(group, n, x + t0 * xs, xs, 4, out + t0 * PACK_ROWS, type); break;
    case 3: packedf_256(group, n, x + t0 * xs, xs, 3, out + t0 * PACK_ROWS, type); break;
    case 2: packedf_256(group, n, x + t0 * xs, xs, 2, out + t0 * PACK_ROWS, type); break;
    case 1: packedf_256(group, n, x + t0 * xs, xs, 1, out + t0 * PACK_ROWS, type); break;
    }
}

PACKED_KERNEL(q4_0, avx2, packed32_avx2, 4, 8, 0, dot4_avx2, 8)
PACKED_KERNEL(q4_1, avx2, packed32_avx2, 4, 0, 1, dot4_avx2, 8)
PACKED_KERNEL(q5_0, avx2, packed32_avx2, 5, 16, 0, dot4_avx2, 4)
PACKED_KERNEL(q5_1, avx2, packed32_avx2, 5, 0, 1, dot4_avx2, 4)
PACKED_KERNEL(q8_0, avx2, packed32_avx2, 8, 0, 0, dot4_q8_avx2, 0) /* offset: taken in dot4 */
PACKED_KERNEL(q4_k, avx2, packedk_avx2, 4, PACK_K4, 0, NULL, 0)
PACKED_KERNEL(q5_k, avx2, packedk_avx2, 5, PACK_K4, 0, NULL, 0)
PACKED_KERNEL(q6_k, avx2, packedk_avx2, 6, PACK_K6, 0, NULL, 0)
PACKED_KERNEL(f32, avx2, packedf_avx2, T_F32, 0, 0, NULL)
PACKED_KERNEL(f16, avx2, packedf_avx2, T_F16, 0, 0, NULL)
PACKED_KERNEL(bf16, avx2, packedf_avx2, T_BF16, 0, 0, NULL)

/* The wide products, each falling back on its PACK_TOKS product. */
static void wide_q4_k_avx2(const uint8_t *group, int n, const uint8_t *x, size_t xs, int toks, float *out)
{
    packedk_wide_256(group, n, x, xs, toks, out, 4, PACK_K4, packed_q4_k_avx2);
}

static void wide_q5_k_avx2(const uint8_t *group, int n, const uint8_t *x, size_t xs, int toks, float *out)
{
    packedk_wide_256(group, n, x, xs, toks, out, 5, PACK_K4, packed_q5_k_avx2);
}

static void wide_q6_k_avx2(const uint8_t *group, int n, const uint8_t *x, size_t xs, int toks, float *out)
{
    packedk_wide_256(group, n, x, xs, toks, out, 6, PACK_K6, packed_q6_k_avx2);
}

/* --probe's f32 peak for a set: 8 independent chains of FMAs on vectors V
   of `width` floats. */
#define PEAK_F32(set, V, width, set1, fmadd, hsum)                                \
    static double peak_f32_##set(float *sink)                                     \
    {                                                                             \
        V acc[8], x = set1(0.999f), y = set1(1e-3f);                              \
        for (int j = 0; j < 8; j++) acc[j] = set1((float)j);                      \
        for (long i = 0; i < PROBE_ITERS / 8; i++)                                \
            for (int j = 0; j < 8; j++) acc[j] = fmadd(acc[j], x, y);             \
        for (int j = 0; j < 8; j++) *sink += hsum(acc[j]);                        \
        return (double)PROBE_ITERS / 8 * 8 * (width) * 2;                         \
    }
PEAK_F32(avx2, __m256, 8, _mm256_set1_ps, _mm256_fmadd_ps, hsum256)

/* --probe's int8 peak: chains of 32 int8 multiply-adds (maddubs) summed in
   int16 for 8 steps and widened by one madd, as the kernels of 4- and 5-bit
   and K types do. 10 chains: maddubs takes 3 cycles and Zen 3 issues two a
   cycle; with 8 chains of maddubs, madd and an int32 add each step (the old
   probe) the kernels outran it on one thread (166 against 130 GOP/s), as
   they can with one madd per 8 steps. The operand is pinned in each step:
   constant ones let the compiler hoist the products out of the loop and
   time only the adds (it reported 1,100-1,250 GOP/s on 2 cores). */
#define PEAK_I8_CHAINS_256 10
#define PEAK_I8_SUM16 8 /* int16 steps per madd: 8 steps of two products 3 x -2 sum to -96 */
static double peak_i8_avx2(unsigned *sink)
{
    enum { C = PEAK_I8_CHAINS_256, S = PEAK_I8_SUM16 };
    __m256i acc[C], s16[C], a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2), one = _mm256_set1_epi16(1);
    for (int j = 0; j < C; j++) acc[j] = _mm256_set1_epi32(j);
    const long rounds = PROBE_ITERS / (C * S);
    for (long i = 0; i < rounds; i++) {
        UNROLL(PEAK_I8_CHAINS_256)
        for (int j = 0; j < C; j++) s16[j] = _mm256_setzero_si256();
        UNROLL(PEAK_I8_SUM16)
        for (int g = 0; g < S; g++) {
            UNROLL(PEAK_I8_CHAINS_256)
            for (int j = 0; j < C; j++) {
                KEEP_IN_REGISTER(a);
                s16[j] = _mm256_add_epi16(s16[j], _mm256_maddubs_epi16(a, b));
                KEEP_IN_REGISTER(s16[j]);
            }
        }
        UNROLL(PEAK_I8_CHAINS_256)
        for (int j = 0; j < C; j++) acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(s16[j], one));
    }
    for (int j = 0; j < C; j++) *sink += (unsigned)_mm256_extract_epi32(acc[j], 0);
    return (double)rounds * C * S * 32 * 2;
}
TARGET_END

/* AVX2, FMA and F16C, and an OS that saves the YMM registers (cpuid leaves
   1 and 7, xgetbv): what the AVX2 set's instructions need. Like every set's
   check, it stands outside the set's target region: it runs on CPUs that
   lack the set, so it must not be compiled to use the set's instructions
   (gcc did: at -O0 under ASan, cpu_has_avx512_vnni inside AVX-512's region
   set up its stack with an AVX-512 store and died of SIGILL on AVX2-only
   CPUs). */
static int cpu_has_avx2(void)
{
    unsigned a, b, c, d, xcr0_lo, xcr0_hi;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    int fma = c >> 12 & 1, osxsave = c >> 27 & 1, avx = c >> 28 & 1, f16c = c >> 29 & 1;
    if (!(fma && osxsave && avx && f16c)) return 0;
    __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0_lo & 6) != 6 || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return b >> 5 & 1;
}

/* The AVX2 set's row of the kernel tables. */
static const KernelSet SET_AVX2 = {
    {"avx2", cpu_has_avx2, KSET_SCALAR, {[ACT_Q8] = quantize_act_avx2, [ACT_Q8K] = quantize_act_k_avx2}, att_softmax_avx2,
     att_qk_avx2, att_pv_avx2, swiglu_avx2, geglu_avx2, peak_f32_avx2, peak_i8_avx2, attend_in_chunks},
    {[T_F32] = {.packed = packed_f32_avx2},
     [T_F16] = {.to_float = to_float_f16_avx2, .from_float = from_float_f16_avx2, .packed = packed_f16_avx2},
     [T_BF16] = {.packed = packed_bf16_avx2},
     [T_Q4_0] = {.to_float = to_float_q4_0_avx2, .packed = packed_q4_0_avx2},
     [T_Q4_1] = {.to_float = to_float_q4_1_avx2, .packed = packed_q4_1_avx2},
     [T_Q5_0] = {.to_float = to_float_q5_0_avx2, .packed = packed_q5_0_avx2},
     [T_Q5_1] = {.to_float = to_float_q5_1_avx2, .packed = packed_q5_1_avx2},
     [T_Q8_0] = {.to_float = to_float_q8_0_avx2, .packed = packed_q8_0_avx2},
     [T_Q4_K] = {.packed = packed_q4_k_avx2, .wide = wide_q4_k_avx2},
     [T_Q5_K] = {.packed = packed_q5_k_avx2, .wide = wide_q5_k_avx2},
     [T_Q6_K] = {.packed = packed_q6_k_avx2, .wide = wide_q6_k_avx2}},
};
#endif /* HAVE_X86_SETS */

/* ============================================================================
   APPENDIX B: THE AVX-VNNI KERNEL SET
   AVX-VNNI is vpdpbusd in its 256-bit VEX form, on CPUs without AVX-512
   (Intel Alder Lake and later client cores, AMD Zen 5 client parts): the
   packed int8 products of appendix A with one vpdpbusd per four elements
   instead of maddubs, madd and add, and q8_0 packed as well (no int16 step
   to saturate). The rest is the AVX2 set's. Used when the CPU reports
   AVX-VNNI (cpuid leaf 7, subleaf 1, EAX bit 4) besides AVX2.
   ========================================================================= */
#ifdef HAVE_AVXVNNI_SET
TARGET_BEGIN(ISA_AVXVNNI)
INLINE __m256i dot4_vnni(__m256i acc, __m256i u, __m256i s) { return DPBUSD_256(acc, u, s); }

PACKED_KERNEL(q4_0, avxvnni, packed32_avx2, 4, 8, 0, dot4_vnni, 0)
PACKED_KERNEL(q4_1, avxvnni, packed32_avx2, 4, 0, 1, dot4_vnni, 0)
PACKED_KERNEL(q5_0, avxvnni, packed32_avx2, 5, 16, 0, dot4_vnni, 0)
PACKED_KERNEL(q5_1, avxvnni, packed32_avx2, 5, 0, 1, dot4_vnni, 0)
PACKED_KERNEL(q8_0, avxvnni, packed32_avx2, 8, 128, 0, dot4_vnni, 0) /* q + 128 as stored: its offset through x's sum */

/* --probe's int8 peak for this set: 12 chains of 256-bit vpdpbusd (32 int8
   multiply-adds each; 8 chains were latency-bound, as in the AVX-512 set),
   pinned in registers as there. */
static double peak_i8_avxvnni(unsigned *sink)
{
    __m256i acc[12], a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
    UNROLL(12)
    for (int j = 0; j < 12; j++) acc[j] = _mm256_set1_epi32(j);
    for (long i = 0; i < PROBE_ITERS / 12; i++)
        UNROLL(12)
        for (int j = 0; j < 12; j++) {
            acc[j] = DPBUSD_256(acc[j], a, b);
            KEEP_IN_REGISTER(acc[j]);
        }
    UNROLL(12)
    for (int j = 0; j < 12; j++) *sink += (unsigned)_mm256_extract_epi32(acc[j], 0);
    return (double)PROBE_ITERS / 12 * 12 * 32 * 2;
}
TARGET_END

#ifdef AVXVNNI_TWIN
static int cpu_has_avx512_vnni(void); /* appendix C */
#endif

static int cpu_has_avxvnni(void)
{
#ifdef AVXVNNI_TWIN
    return cpu_has_avx512_vnni(); /* the tests' build: the EVEX twin runs where AVX-512 VNNI does */
#else
    unsigned a, b, c, d;
    return cpu_has_avx2() && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1);
#endif
}

/* The AVX-VNNI set's row: the 32-element types' packed products and the
   int8 probe; the rest is AVX2's. */
static const KernelSet SET_AVXVNNI = {
    {.name = "avxvnni", .available = cpu_has_avxvnni, .inherits = KSET_AVX2, .peak_i8 = peak_i8_avxvnni},
    {[T_Q4_0] = {.packed = packed_q4_0_avxvnni}, [T_Q4_1] = {.packed = packed_q4_1_avxvnni},
     [T_Q5_0] = {.packed = packed_q5_0_avxvnni}, [T_Q5_1] = {.packed = packed_q5_1_avxvnni},
     [T_Q8_0] = {.packed = packed_q8_0_avxvnni}},
};
#endif /* HAVE_AVXVNNI_SET */

/* ============================================================================
   APPENDIX C: THE AVX-512 KERNEL SET
   What AVX-512 with VNNI improves over AVX2, and nothing else: the set
   inherits every kernel it leaves out from the AVX2 set (its inherits field).
   The int8 matrix products take two 32-element blocks per 512-bit vector
   and one vpdpbusd per 64 products, where AVX2 needs maddubs and madd per
   32; the float tiles take 16 floats per FMA. The integer types' register
   tile is 16 rows x 8 tokens, and the K types' wide products take a whole
   prefill chunk a call, unpacking each super-block once for all its tokens: at
   two vpdpbusd a cycle on both vector ports, every other instruction
   (unpacking, scales, float steps) takes a product's place, so what is
   left per product is what decides the speed. Same contracts as the AVX2
   kernels (tests/test_kernels.c checks each against the scalar set).
   Used when the CPU has AVX-512 F/BW/VL/DQ and VNNI and the OS saves the
   ZMM registers (cpu_has_avx512_vnni).
   ========================================================================= */
#ifdef HAVE_AVX512_SET
TARGET_BEGIN(ISA_AVX512)

/* Element e's 16 rows of a packed float group (see "packed floats"). */
INLINE __m512 packed_floats_512(const uint8_t *group, int e, int type)
{
    if (type == T_F32) return _mm512_loadu_ps((const float *)group + (size_t)e * PACK_ROWS);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)group + (size_t)e * PACK_ROWS));
    if (type == T_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); /* bf16: the high half of an f32 */
}

/* The float types for T <= PACK_TOKS_F tokens: per element one vector of
   16 rows times each token's element broadcast, a sum per token
   (dot_float). */
#define PACK_TOKS_F 8
INLINE void packed_f_512(const uint8_t *group, int n, const uint8_t *x, size_t xs, int T, float *out, int type, int unused1,
                         int unused2)
{
    (void)unused1, (void)unused2;
    const size_t rb = (size_t)PACK_ROWS * (type == T_F32 ? 4 : 2);
    __m512 acc[PACK_TOKS_F];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int e = 0; e < n; e++) {
        if (T == 1 && e * rb % CACHE_LINE == 0) decode_prefetch(group + e * rb);
        __m512 w = packed_floats_512(group, e, type);
        for (int t = 0; t < T; t++) acc[t] = _mm512_fmadd_ps(w, _mm512_set1_ps(((const float *)(x + t * xs))[e]), acc[t]);
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out + t * PACK_ROWS, acc[t]);
}
_Static_assert(PACK_TOKS_F == PACK_TOKS, "one pass takes a call's tokens");

PACKED_KERNEL(f32, avx512, packed_f_512, T_F32, 0, 0)
PACKED_KERNEL(f16, avx512, packed_f_512, T_F16, 0, 0)
PACKED_KERNEL(bf16, avx512, packed_f_512, T_BF16, 0, 0)

/* --- packed products on 512-bit vectors (Part II, "the packed layout") --
   A group's 16 rows are one vector's 16 lanes: four activation bytes
   broadcast meet four integers of each row in one vpdpbusd. Integers are
   unsigned as stored (q8_0's q + 128, whose offset leaves through the
   activation's sum like q4_0's 8), so no conversion precedes the product.
   The float steps are the scalar definitions', on 16 lanes. */

/* Integers 4g .. 4g + 3 (g = 0..7) of the 16 rows in a stretch (stretch_u256 on one vector). */
INLINE __m512i stretch_u512(const uint8_t *stretch, int g, int bits)
{
    if (bits == 8) return _mm512_loadu_si512(stretch + 64 * g);
    int extra = bits - 4, j = g / 2;
    __m512i v = _mm512_loadu_si512(stretch + PACK_ROWS * STRETCH / 8 * extra + 64 * j);
    __m512i u = _mm512_and_si512(g & 1 ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0f));
    if (!extra) return u;
    int per_byte = 8 / extra, at = g % per_byte * extra;
    __m512i pl = _mm512_loadu_si512(stretch + 64 * (g / per_byte));
    __m512i hi = at <= 4 ? _mm512_slli_epi16(pl, 4 - at) : _mm512_srli_epi16(pl, at - 4);
    return _mm512_or_si512(u, _mm512_and_si512(hi, _mm512_set1_epi8((char)(((1 << extra) - 1) << 4))));
}

INLINE __m512i act4_512(const int8_t *qs) { int32_t a4; memcpy(&a4, qs, 4); return _mm512_set1_epi32(a4); }

/* acc + u . (qs[0..3] in every lane): vpdpbusd with the activations'
   four bytes as its broadcast memory operand, one fused instruction (GCC
   12 loads the broadcast apart, a second instruction per product, and at
   two products a cycle the front end is then what limits a tile). */
INLINE __m512i dpbusd4_512(__m512i acc, __m512i u, const int8_t *qs)
{
#if defined(__GNUC__) && !defined(__clang__)
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)qs));
    return acc;
#else
    return _mm512_dpbusd_epi32(acc, u, act4_512(qs));
#endif
}

/* The 32-element types for T <= PACK_TOKS tokens (packed_dot_block32).
   They have no wide product: a call of 8 tokens keeps each token's sums in
   a register across the whole group, where a wide product that unpacked
   each block once for a chunk's passes loaded and stored them every block
   (per 8 vpdpbusd a load, a store and a sum of two chains). On AMD Zen 5
   the passes of 8 were 2-19 % faster (bench_kernels, 16 and 72 tokens,
   q4_0 q4_1 q5_0 q8_0) and SmolLM2's prefill 7.5-10 % faster. */
INLINE void packed32_512(const uint8_t *group, int n, const uint8_t *x, size_t xs, int T, float *out, int bits, int offset,
                         int has_min)
{
    const PackForm f = {PACK_BLOCK32, bits, offset, has_min};
    const size_t hb = packed_head_bytes(&f), rb = packed_record_bytes(&f);
    const int chains = T == 1 ? PACK_CHAINS : T == 2 ? 2 : 1;
    __m512 acc[PACK_TOKS];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int k = 0; k < n / QK; k++) {
        const uint8_t *rec = group + k * rb;
        __m512i isum[PACK_TOKS][PACK_CHAINS];
        for (int t = 0; t < T; t++) for (int c = 0; c < chains; c++) isum[t][c] = _mm512_setzero_si512();
        for (size_t b = 0; b < rb; b += CACHE_LINE) decode_prefetch(rec + b);
        for (int g = 0; g < QK / 4; g++) {
            __m512i u = stretch_u512(rec + hb, g, bits);
            for (int t = 0; t < T; t++)
                isum[t][g % chains] = _mm512_dpbusd_epi32(isum[t][g % chains], u, act4_512(((const BlockQ8A *)(x + t * xs) + k)->qs + 4 * g));
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rec));
        __m512 m = has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rec + 1)) : _mm512_setzero_ps();
        for (int t = 0; t < T; t++) {
            const BlockQ8A *a = (const BlockQ8A *)(x + t * xs) + k;
            __m512i s = isum[t][0];
            for (int c = 1; c < chains; c++) s = _mm512_add_epi32(s, isum[t][c]);
            if (offset) s = _mm512_sub_epi32(s, _mm512_set1_epi32(offset * a->sum));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(a->d)), d, acc[t]);
            if (has_min) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->s), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out + t * PACK_ROWS, acc[t]);
}

/* 16 bytes of a [byte][row] plane as int32 lanes. */
INLINE __m512i plane16_u(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
INLINE __m512i plane16_s(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
INLINE __m512i pair16_512(__m512i lo, __m512i hi) { return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(hi, 16)); }

/* q4_k's 8 scales of 16 rows as int32 lanes, and its 8 minimums as 4
   vectors of int16 pairs (minimum 2p low, 2p + 1 high): k4_scale_min on
   16 rows at once. A scale (0..63) in an int32 lane is also the int16
   pair (scale, 0). */
INLINE void k4_scales_512(const uint8_t *rec, __m512i sc[QK_K / 32], __m512i mnp[QK_K / 64])
{
    __m512i B[12], mn[QK_K / 32];
    for (int b = 0; b < 12; b++) B[b] = plane16_u(rec + PACK_ROWS * (4 + b));
    const __m512i low6 = _mm512_set1_epi32(63), low4 = _mm512_set1_epi32(15);
    for (int j = 0; j < 4; j++) {
        sc[j] = _mm512_and_si512(B[j], low6);
        mn[j] = _mm512_and_si512(B[j + 4], low6);
        sc[j + 4] = _mm512_or_si512(_mm512_and_si512(B[j + 8], low4), _mm512_slli_epi32(_mm512_srli_epi32(B[j], 6), 4));
        mn[j + 4] = _mm512_or_si512(_mm512_srli_epi32(B[j + 8], 4), _mm512_slli_epi32(_mm512_srli_epi32(B[j + 4], 6), 4));
    }
    for (int p = 0; p < QK_K / 64; p++) mnp[p] = pair16_512(mn[2 * p], mn[2 * p + 1]);
}

/* The K types for T <= PACK_TOKS_K512 tokens (packed_dot_k): per
   sub-block one int32 sum per row (vpdpbusd), times the sub-block's scale
   (vpmulld); the minimums' (q6_k: the offset's) sums as int16 pairs
   (vpdpwssd). */
#define PACK_TOKS_K512 4
INLINE void packedk_512_part(const uint8_t *group, int n, const uint8_t *x, size_t xs, int T, float *out, int bits, int kind)
{
    const PackForm f = {kind, bits, kind == PACK_K6 ? 32 : 0, kind == PACK_K4};
    const size_t hb = packed_head_bytes(&f), rb = packed_record_bytes(&f), sb = packed_stretch_bytes(&f);
    const int g_sub = kind == PACK_K4 ? 8 : 4, k6 = kind == PACK_K6;
    __m512 acc[PACK_TOKS_K512];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int k = 0; k < n / QK_K; k++) {
        const uint8_t *rec = group + k * rb;
        __m512i sc[QK_K / 16], mnp[QK_K / 64];
        if (k6) {
            for (int g = 0; g < QK_K / 16; g++) sc[g] = plane16_s(rec + PACK_ROWS * (2 + g));
        } else {
            k4_scales_512(rec, sc, mnp);
        }
        __m512i isum[PACK_TOKS_K512], msum[PACK_TOKS_K512];
        for (int t = 0; t < T; t++) isum[t] = msum[t] = _mm512_setzero_si512();
        for (size_t b = 0; b < rb; b += CACHE_LINE) decode_prefetch(rec + b);
        for (int j = 0; j < QK_K / STRETCH; j++) {
            const uint8_t *st = rec + hb + j * sb;
            __m512i s[PACK_TOKS_K512];
            for (int t = 0; t < T; t++) s[t] = _mm512_setzero_si512();
            for (int g = 0; g < STRETCH / 4; g++) {
                __m512i u = stretch_u512(st, g, bits);
                for (int t = 0; t < T; t++)
                    s[t] = _mm512_dpbusd_epi32(s[t], u, act4_512(((const BlockQ8K *)(x + t * xs) + k)->qs + STRETCH * j + 4 * g));
                if ((g + 1) % g_sub) continue;
                __m512i scale = sc[(STRETCH * j + 4 * g) / (4 * g_sub)];
                for (int t = 0; t < T; t++) {
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(s[t], scale));
                    s[t] = _mm512_setzero_si512();
                }
            }
        }
        for (int t = 0; t < T; t++) {
            const int16_t *bs = ((const BlockQ8K *)(x + t * xs) + k)->bsums;
            for (int p = 0; p < (k6 ? 8 : 4); p++) {
                __m512i w = k6 ? pair16_512(sc[2 * p], sc[2 * p + 1]) : mnp[p];
                int lo = k6 ? bs[2 * p] : bs[4 * p] + bs[4 * p + 1], hi = k6 ? bs[2 * p + 1] : bs[4 * p + 2] + bs[4 * p + 3];
                msum[t] = _mm512_dpwssd_epi32(msum[t], w, _mm512_set1_epi32((int)((uint32_t)(uint16_t)lo | (uint32_t)(uint16_t)hi << 16)));
            }
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rec));
        __m512 negdmin = k6 ? d : _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rec + 1)));
        for (int t = 0; t < T; t++) {
            __m512 xd = _mm512_set1_ps(((const BlockQ8K *)(x + t * xs) + k)->d);
            if (k6) isum[t] = _mm512_sub_epi32(isum[t], _mm512_slli_epi32(msum[t], 5));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum[t]), xd), d, acc[t]);
            if (!k6) acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(msum[t]), xd), negdmin, acc[t]);
        }
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(out + t * PACK_ROWS, acc[t]);
}

INLINE void packedk_512(const uint8_t *group, int n, const uint8_t *x, size_t xs, int T, float *out, int bits, int kind, int unused)
{
    (void)unused;
    _Static_assert(PACK_TOKS_K512 == 4, "1 to 3 tokens are left at most");
    int t0 = 0; /* every pass's token count a constant, so the sums stay in registers */
    for (; t0 + PACK_TOKS_K512 <= T; t0 += PACK_TOKS_K512)
        packedk_512_part(group, n, x + t0 * xs, xs, PACK_TOKS_K512, out + t0 * PACK_ROWS, bits, kind);
    switch (T - t0) {
    case 3: packedk_512_part(group, n, x + t0 * xs, xs, 3, out + t0 * PACK_ROWS, bits, kind); break;
    case 2: packedk_512_part(group, n, x + t0 * xs, xs, 2, out + t0 * PACK_ROWS, bits, kind); break;
    case 1: packedk_512_part(group, n, x + t0 * xs, xs, 1, out + t0 * PACK_ROWS, bits, kind); break;
    }
}


/* Super-block k of a q4_k or q6_k group unpacked once for every token of
   a call: the integers, one vector per group of four elements of the 16
   rows (q4_k: stretch j's nibble vector v as u[8j + 2v], low nibbles, and
   u[8j + 2v + 1], high; q6_k: stretch j's element group g as u[8j + g]),
   the sub-block scales as int32 lanes, int16 pairs (q4_k: the minimums
   2p low and 2p + 1 high, k4_scales_512; q6_k: the scales) and the fp16
   planes. */
typedef struct {
    __m512i u[QK_K / 4], sc[QK_K / 16], pairs[QK_K / 32];
    __m512 d, negdmin;
} KBlock512;

INLINE void q4k_unpack_512(const uint8_t *rec, KBlock512 *b, int nibbles)
{
    const PackForm f = {PACK_K4, 4, 0, 1};
    const size_t hb = packed_head_bytes(&f), sb = packed_stretch_bytes(&f);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    for (int j = 0; j < QK_K / STRETCH && nibbles; j++)
        for (int v = 0; v < STRETCH / 8; v++) {
            __m512i raw = _mm512_loadu_si512(rec + hb + j * sb + PACK_VECTOR * v);
            b->u[8 * j + 2 * v] = _mm512_and_si512(raw, low4);
            b->u[8 * j + 2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
        }
    k4_scales_512(rec, b->sc, b->pairs);
    b->d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rec));
    b->negdmin = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rec + 1)));
}

/* T <= PACK_TOKS tokens (the register tile: 16 rows x T tokens) times
   super-block k, added to acc (token t's 16 sums at acc + 16 t). A
   sub-block's 32 products go into two int32 chains (the low nibbles, the
   high ones: 16 chains for 8 tokens hide vpdpbusd's latency), added, then
   times the sub-block's scale by one vpmulld. A vpdpwssd per chain against
   the pair (scale, 0), exact since each chain is within int16, takes two
   slots of vpdpbusd's two ports where vpmulld takes one (bench_kernels
   ports, AMD Zen 5): bench_kernels' q4_k at 64 tokens went 651 -> 683 and
   624 -> 683 GOP/s (one thread, best of 5). The minimums: one vpdpwssd
   per two sub-blocks against the activations' sums of 32. Per super-block
   and token that is 64 vpdpbusd, 8 vpmulld, 4 vpdpwssd and 4 float
   multiplies on those two ports: at most 80 % of the int8 peak. Same
   integers and float steps as dot_k. */
INLINE void q4k_tokens_512(const KBlock512 *b, const uint8_t *st0, int direct, const uint8_t *x, size_t xs, int k, int T, float *acc)
{
    const size_t sb = (size_t)PACK_ROWS * STRETCH / 2; /* a stretch's nibbles */
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    int32_t bsum32[PACK_TOKS][QK_K / 32]; /* pairs of sums of 32, per token (bsum_pairs) */
    for (int t = 0; t < T; t++) bsum_pairs(bsum32[t], ((const BlockQ8K *)(x + t * xs) + k)->bsums);
    __m512i isum[PACK_TOKS];
    for (int t = 0; t < T; t++) isum[t] = _mm512_setzero_si512();
    for (int j = 0; j < QK_K / STRETCH; j++) {
        __m512i slo[PACK_TOKS], shi[PACK_TOKS];
        for (int t = 0; t < T; t++) slo[t] = shi[t] = _mm512_setzero_si512();
        for (int v = 0; v < STRETCH / 8; v++) {
            __m512i lo, hi;
            if (direct) { /* one pass: unpacked here */
                __m512i raw = _mm512_loadu_si512(st0 + j * sb + PACK_VECTOR * v);
                lo = _mm512_and_si512(raw, low4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            } else {
                lo = b->u[8 * j + 2 * v], hi = b->u[8 * j + 2 * v + 1];
            }
            for (int t = 0; t < T; t++) {
                const int8_t *q = ((const BlockQ8K *)(x + t * xs) + k)->qs + STRETCH * j + 8 * v;
                slo[t] = dpbusd4_512(slo[t], lo, q);
                shi[t] = dpbusd4_512(shi[t], hi, q + 4);
            }
        }
        for (int t = 0; t < T; t++) isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(_mm512_add_epi32(slo[t], shi[t]), b->sc[j]));
    }
    for (int t = 0; t < T; t++) {
        __m512i msum = _mm512_setzero_si512();
        for (int p = 0; p < QK_K / 64; p++) msum = _mm512_dpwssd_epi32(msum, b->pairs[p], _mm512_set1_epi32(bsum32[t][p % 2 + p / 2 * 4]));
        __m512 xd = _mm512_set1_ps(((const BlockQ8K *)(x + t * xs) + k)->d);
        __m512 a = k ? _mm512_loadu_ps(acc + t * PACK_ROWS) : _mm512_setzero_ps(); /* super-block 0 starts the sums */
        a = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum[t]), xd), b->d, a);
        _mm512_storeu_ps(acc + t * PACK_ROWS, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(msum), xd), b->negdmin, a));
    }
}

PACKED_KERNEL(q5_k, avx512, packedk_512, 5, PACK_K4, 0)
/* Element group k (0..7, four elements of each row) of a q6_k stretch:
   the nibbles n4 (masked) with their two high bits from plane k / 4,
   shifted into bits 4-5 and merged by one vpternlogd (n4 | (s & 0x30)). */
INLINE __m512i q6_group_512(__m512i n4, __m512i plane, int k)
{
    int at = k % 4 * 2; /* the field's bit in its plane byte */
    __m512i s = at <= 4 ? _mm512_slli_epi16(plane, 4 - at) : _mm512_srli_epi16(plane, at - 4);
    return _mm512_ternarylogic_epi32(n4, s, _mm512_set1_epi8(0x30), 0xf8); /* a | (b & c) */
}

/* Element group 4 h + i (i = 0..3: a constant where inlined) of stretch
   st of a q6_k record (q6_group_512). */
INLINE __m512i q6_unpack_512(const uint8_t *st, int h, int i)
{
    const size_t planes = (size_t)PACK_ROWS * STRETCH / 8 * 2; /* the two high bits' planes before the nibbles */
    __m512i raw = _mm512_loadu_si512(st + planes + PACK_VECTOR * (2 * h + i / 2));
    __m512i n4 = _mm512_and_si512(i & 1 ? _mm512_srli_epi16(raw, 4) : raw, _mm512_set1_epi8(0x0f));
    return q6_group_512(n4, _mm512_loadu_si512(st + PACK_VECTOR * h), i);
}

INLINE void q6k_unpack_512(const uint8_t *rec, KBlock512 *b, int ints)
{
    const PackForm f = {PACK_K6, 6, 32, 0};
    const size_t hb = packed_head_bytes(&f), sb = packed_stretch_bytes(&f);
    for (int j = 0; j < QK_K / STRETCH && ints; j++) {
        UNROLL(8) /* g a constant: every shift an immediate */
        for (int g = 0; g < STRETCH / 4; g++) b->u[8 * j + g] = q6_unpack_512(rec + hb + j * sb, g / 4, g % 4);
    }
    for (int g = 0; g < QK_K / 16; g++) b->sc[g] = plane16_s(rec + PACK_ROWS * (2 + g));
    for (int p = 0; p < QK_K / 32; p++) b->pairs[p] = pair16_512(b->sc[2 * p], b->sc[2 * p + 1]);
    b->d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)rec));
}

/* T <= PACK_TOKS tokens (the register tile: 16 rows x T tokens) times
   super-block k, added to acc (token t's sums at acc + 16 t); the groups
   from b, or unpacked here from the record's integers at ints: per
   sub-block of 16 one int32 sum per token (vpdpbusd), times its scale
   (vpmulld: the sum of 16 six-bit products exceeds int16); the offset's
   sums as int16 pairs (vpdpwssd), the activations' pairs of sums of 16
   read as they lie. Per super-block and token: 64 vpdpbusd, 16 vpmulld, 8
   vpdpwssd and 2 float multiplies on vpdpbusd's two ports, at most 71 % of
   the int8 peak (q4k_tokens_512). Same integers and float steps as dot_k. */
INLINE void q6k_tokens_512(const KBlock512 *b, const uint8_t *ints, int direct, const uint8_t *x, size_t xs, int k, int T, float *acc)
{
    const size_t sb = (size_t)PACK_ROWS * STRETCH * 6 / 8;
    __m512i isum[PACK_TOKS];
    for (int t = 0; t < T; t++) isum[t] = _mm512_setzero_si512();
    for (int j = 0; j < QK_K / STRETCH; j++)
        for (int h2 = 0; h2 < 2; h2++) { /* sub-block 2j + h2: element groups 4 h2 .. 4 h2 + 3 */
            __m512i s[PACK_TOKS];
            for (int t = 0; t < T; t++) s[t] = _mm512_setzero_si512();
            UNROLL(4) /* i a constant: every shift an immediate */
            for (int i = 0; i < 4; i++) {
                int g = 4 * h2 + i;
                __m512i u = direct ? q6_unpack_512(ints + j * sb, h2, i) : b->u[8 * j + g];
                for (int t = 0; t < T; t++)
                    s[t] = dpbusd4_512(s[t], u, ((const BlockQ8K *)(x + t * xs) + k)->qs + STRETCH * j + 4 * g);
            }
            for (int t = 0; t < T; t++) isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(s[t], b->sc[2 * j + h2]));
        }
    for (int t = 0; t < T; t++) {
        const BlockQ8K *a = (const BlockQ8K *)(x + t * xs) + k;
        __m512i msum = _mm512_setzero_si512();
        for (int p = 0; p < QK_K / 32; p++) {
            int32_t pair;
            memcpy(&pair, a->bsums + 2 * p, sizeof pair); /* bsums 2p, 2p + 1: an int16 pair as it lies */
            msum = _mm512_dpwssd_epi32(msum, b->pairs[p], _mm512_set1_epi32(pair));
        }
        __m512i is = _mm512_sub_epi32(isum[t], _mm512_slli_epi32(msum, 5));
        __m512 prev = k ? _mm512_loadu_ps(acc + t * PACK_ROWS) : _mm512_setzero_ps(); /* super-block 0 starts the sums */
        __m512 sum = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(is), _mm512_set1_ps(a->d)), b->d, prev);
        _mm512_storeu_ps(acc + t * PACK_ROWS, sum);
    }
}

/* A K type's tile (kind PACK_K4: q4_k, PACK_K6: q6_k) with T (1 ..
   PACK_TOKS) a constant in each instance. */
INLINE void k_tokens_512(const KBlock512 *b, const uint8_t *ints, int direct, const uint8_t *x, size_t xs, int k, int T, float *acc,
                         int kind)
{
    if (kind == PACK_K6) q6k_tokens_512(b, ints, direct, x, xs, k, T, acc);
    else q4k_tokens_512(b, ints, direct, x, xs, k, T, acc);
}

INLINE void k_tokens_any_512(const KBlock512 *b, const uint8_t *ints, int direct, const uint8_t *x, size_t xs, int k, int T, float *acc,
                             int kind)
{
    _Static_assert(PACK_TOKS == 8, "a case per token count");
    switch (T) {
    case 1: k_tokens_512(b, ints, direct, x, xs, k, 1, acc, kind); break;
    case 2: k_tokens_512(b, ints, direct, x, xs, k, 2, acc, kind); break;
    case 3: k_tokens_512(b, ints, direct, x, xs, k, 3, acc, kind); break;
    case 4: k_tokens_512(b, ints, direct, x, xs, k, 4, acc, kind); break;
    case 5: k_tokens_512(b, ints, direct, x, xs, k, 5, acc, kind); break;
    case 6: k_tokens_512(b, ints, direct, x, xs, k, 6, acc, kind); break;
    case 7: k_tokens_512(b, ints, direct, x, xs, k, 7, acc, kind); break;
    default: k_tokens_512(b, ints, direct, x, xs, k, 8, acc, kind); break;
    }
}

/* q4_k or q6_k for any number of tokens (the set's packed and wide
   product). Up to K512_DIRECT_PASSES passes of PACK_TOKS (q6_k: one) unpack
   the integers as each pass uses them; more tokens go in passes over each
   super-block unpacked once for all of them into b, while the record
   WIDE_AHEAD further on is asked into L2 (prefetch_part). Unpacking into b
   stores 64 vectors a super-block, and a 64-byte store costs about the
   time of two vpdpbusd (AMD Zen 5: four stores beside 16 vpdpbusd chains
   took them from 8.2 to 5.5 G/s); q4_k's unpacking (an and and a shift a
   vector) runs beside vpdpbusd, q6_k's (four instructions) does not.
   bench_kernels at 16 tokens, one thread, three runs: q4_k 1536x1536
   59 -> 63 % of the int8 peak, 8960x1536 57-58 -> 60-61 %; at 24 tokens
   even; q6_k as two direct passes 44 -> 40 % (the output head's shape). */
#define K512_DIRECT_PASSES 2
INLINE void packed_k_512(const uint8_t *group, int n, const uint8_t *x, size_t xs, int toks, float *out, int kind)
{
    const PackForm f = kind == PACK_K6 ? (PackForm){PACK_K6, 6, 32, 0} : (PackForm){PACK_K4, 4, 0, 1};
    const size_t rb = packed_record_bytes(&f);
    const int direct = toks <= (kind == PACK_K6 ? 1 : K512_DIRECT_PASSES) * PACK_TOKS;
    if (n < QK_K) memset(out, 0, sizeof(float) * PACK_ROWS * toks); /* no super-block to start the sums */
    for (int k = 0; k < n / QK_K; k++) {
        const uint8_t *rec = group + k * rb;
        KBlock512 b;
        for (size_t i = 0; direct && i < rb; i += CACHE_LINE) decode_prefetch(rec + i); /* a wide call: prefetch_part */
        if (kind == PACK_K6) q6k_unpack_512(rec, &b, !direct);
        else q4k_unpack_512(rec, &b, !direct);
        if (direct) {
            for (int t0 = 0; t0 < toks; t0 += PACK_TOKS)
                k_tokens_any_512(&b, rec + packed_head_bytes(&f), 1, x + t0 * xs, xs, k, min_i(PACK_TOKS, toks - t0), out + t0 * PACK_ROWS,
                                 kind);
            continue;
        }
        int t0 = 0, passes = (toks + PACK_TOKS - 1) / PACK_TOKS;
        for (; t0 + PACK_TOKS <= toks; t0 += PACK_TOKS) {
            prefetch_part(rec + WIDE_AHEAD * rb, rb, t0 / PACK_TOKS, passes);
            k_tokens_512(&b, NULL, 0, x + t0 * xs, xs, k, PACK_TOKS, out + t0 * PACK_ROWS, kind);
        }
        if (t0 < toks) {
            prefetch_part(rec + WIDE_AHEAD * rb, rb, passes - 1, passes);
            k_tokens_any_512(&b, NULL, 0, x + t0 * xs, xs, k, toks - t0, out + t0 * PACK_ROWS, kind);
        }
    }
}

static void packed_q4_k_avx512(const uint8_t *group, int n, const uint8_t *x, size_t xs, int toks, float *out)
{
    packed_k_512(group, n, x, xs, toks, out, PACK_K4);
}

static void packed_q6_k_avx512(const uint8_t *group, int n, const uint8_t *x, size_t xs, int toks, float *out)
{
    packed_k_512(group, n, x, xs, toks, out, PACK_K6);
}

PACKED_KERNEL(q4_0, avx512, packed32_512, 4, 8, 0)
PACKED_KERNEL(q4_1, avx512, packed32_512, 4, 0, 1)
PACKED_KERNEL(q5_0, avx512, packed32_512, 5, 16, 0)
PACKED_KERNEL(q5_1, avx512, packed32_512, 5, 0, 1)
PACKED_KERNEL(q8_0, avx512, packed32_512, 8, 128, 0)

/* Prefill's multi-query attention kernels (contracts at att_qk_scalar)
   with 16 floats per vector and 32 registers: a 4 x 4 tile of scores and
   4 queries x 64 outputs of the V sum, a head's last partial vector taken
   with a mask instead of a scalar tail. Zen 4 splits a 512-bit FMA in two,
   so the gain over AVX2 is in the instructions around it: an f16 row is
   loaded and converted 16 elements per instruction, a vector feeds four
   FMAs, and a 4 x 4 tile reads half the bytes per score of AVX2's 4 x 2.
   Measured on one layer's prefill attention over 2048 tokens (f16 cache,
   one thread), against the same code with AVX2's score tile: head_dim 64
   79 against 83 ms, 128 241 against 272, 256 107 against 125. */
INLINE __mmask16 lanes_512(int n) { return (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1); }
INLINE __m512 load16_kv(const void *row, int i, __mmask16 live, int f16)
{
    if (f16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, (const uint16_t *)row + i));
    return _mm512_maskz_loadu_ps(live, (const float *)row + i);
}

/* ATT_QK_Q32 queries from a0 times ATT_QK_K32 keys from j0, short
   tiles repeating their last query or key as in att_qk_tile_avx2; the 16
   sums are halved to 256 bits and reduced by two sum8_avx2 trees. */
INLINE void att_qk_tile_avx512(float *s, const float *q, int nq, int a0, const void *const *k, int nk, int j0, int hd, int f16)
{
    const float *qa[ATT_QK_Q32];
    const void *kb[ATT_QK_K32];
    for (int a = 0; a < ATT_QK_Q32; a++) qa[a] = q + (size_t)min_i(a0 + a, nq - 1) * hd;
    for (int b = 0; b < ATT_QK_K32; b++) kb[b] = k[min_i(j0 + b, nk - 1)];
    __m512 acc[ATT_QK_Q32 * ATT_QK_K32];
    for (int r = 0; r < ATT_QK_Q32 * ATT_QK_K32; r++) acc[r] = _mm512_setzero_ps();
    for (int i = 0; i < hd; i += 16) {
        __mmask16 live = lanes_512(hd - i);
        __m512 kv[ATT_QK_K32];
        for (int b = 0; b < ATT_QK_K32; b++) kv[b] = load16_kv(kb[b], i, live, f16);
        for (int a = 0; a < ATT_QK_Q32; a++) {
            __m512 qv = _mm512_maskz_loadu_ps(live, qa[a] + i);
            for (int b = 0; b < ATT_QK_K32; b++) acc[a * ATT_QK_K32 + b] = _mm512_fmadd_ps(qv, kv[b], acc[a * ATT_QK_K32 + b]);
        }
    }
    __m256 half[ATT_QK_Q32 * ATT_QK_K32];
    for (int r = 0; r < ATT_QK_Q32 * ATT_QK_K32; r++)
        half[r] = _mm256_add_ps(_mm512_castps512_ps256(acc[r]), _mm512_extractf32x8_ps(acc[r], 1));
    float sums[ATT_QK_Q32 * ATT_QK_K32];
    _mm256_storeu_ps(sums, sum8_avx2(half));     /* queries 0, 1: four keys each */
    _mm256_storeu_ps(sums + 8, sum8_avx2(half + 8)); /* queries 2, 3 */
    for (int a = 0; a < ATT_QK_Q32 && a0 + a < nq; a++) {
        float *dst = s + (a0 + a) * ATT_KTILE + j0;
        if (j0 + ATT_QK_K32 <= nk) _mm_storeu_ps(dst, _mm_loadu_ps(sums + a * ATT_QK_K32));
        else for (int b = 0; j0 + b < nk; b++) dst[b] = sums[a * ATT_QK_K32 + b];
    }
}

static void att_qk_avx512(float *s, const float *q, int nq, const void *const *k, int type, int hd, int nk)
{
    for (int a0 = 0; a0 < nq; a0 += ATT_QK_Q32)
        for (int j0 = 0; j0 < nk; j0 += ATT_QK_K32) {
            if (type == T_F16) att_qk_tile_avx512(s, q, nq, a0, k, nk, j0, hd, 1);
            else att_qk_tile_avx512(s, q, nq, a0, k, nk, j0, hd, 0);
        }
}

/* Outputs [i, i + 16 * nv) of queries a0 .. a0 + qt - 1 (the last vector
   masked to the head's end), summed in registers over all nk rows. */
INLINE void att_pv_tile_avx512(float *o, int os, const float *p, int a0, int qt, const void *const *v, int nk, int hd, int i,
                               int nv, int f16)
{
    __m512 acc[ATT_PV_Q][ATT_PV_V32];
    __mmask16 live[ATT_PV_V32];
    for (int c = 0; c < nv; c++) live[c] = lanes_512(hd - i - 16 * c);
    for (int a = 0; a < qt; a++)
        for (int c = 0; c < nv; c++) acc[a][c] = _mm512_maskz_loadu_ps(live[c], o + (size_t)(a0 + a) * os + i + 16 * c);
    for (int j = 0; j < nk; j++) {
        __m512 vv[ATT_PV_V32];
        for (int c = 0; c < nv; c++) vv[c] = load16_kv(v[j], i + 16 * c, live[c], f16);
        for (int a = 0; a < qt; a++) {
            __m512 pj = _mm512_set1_ps(p[(a0 + a) * ATT_KTILE + j]);
            for (int c = 0; c < nv; c++) acc[a][c] = _mm512_fmadd_ps(pj, vv[c], acc[a][c]);
        }
    }
    for (int a = 0; a < qt; a++)
        for (int c = 0; c < nv; c++) _mm512_mask_storeu_ps(o + (size_t)(a0 + a) * os + i + 16 * c, live[c], acc[a][c]);
}

INLINE void att_pv_rows_avx512(float *o, int os, const float *p, int a0, int qt, const void *const *v, int hd, int nk, int f16)
{
    int i = 0;
    for (; i + 16 * ATT_PV_V32 <= hd; i += 16 * ATT_PV_V32) att_pv_tile_avx512(o, os, p, a0, qt, v, nk, hd, i, ATT_PV_V32, f16);
    for (; i < hd; i += 16) att_pv_tile_avx512(o, os, p, a0, qt, v, nk, hd, i, 1, f16);
}

INLINE void att_pv_type_avx512(float *o, int os, const float *p, int nq, const void *const *v, int hd, int nk, int f16)
{
    int a0 = 0;
    for (; a0 + ATT_PV_Q <= nq; a0 += ATT_PV_Q) att_pv_rows_avx512(o, os, p, a0, ATT_PV_Q, v, hd, nk, f16);
    switch (nq - a0) { /* ATT_PV_Q is 4 (att_pv_type_avx2) */
    case 3: att_pv_rows_avx512(o, os, p, a0, 3, v, hd, nk, f16); break;
    case 2: att_pv_rows_avx512(o, os, p, a0, 2, v, hd, nk, f16); break;
    case 1: att_pv_rows_avx512(o, os, p, a0, 1, v, hd, nk, f16); break;
    }
}

static void att_pv_avx512(float *o, int os, const float *p, int nq, const void *const *v, int type, int hd, int nk)
{
    if (type == T_F16) att_pv_type_avx512(o, os, p, nq, v, hd, nk, 1);
    else att_pv_type_avx512(o, os, p, nq, v, hd, nk, 0);
}

/* exp_avx2 (see it) 16 at a time: the same steps lane by lane, with
   masks where AVX2 compares into vectors, so every lane's result is the
   one exp_avx2 gives, and the FFN gates below the AVX2 set's numbers. */
static __m512 exp_512(__m512 x)
{
    const __m512 lo = _mm512_set1_ps(EXP_LO), hi = _mm512_set1_ps(EXP_HI);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 y = _mm512_set1_ps(EXP_POLY[0]);
    for (int k = 1; k < EXP_POLY_N; k++) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_POLY[k]));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(F32_EXP_BIAS)), F32_MANT_BITS);
    __m512 e = _mm512_maskz_mul_ps((__mmask16)~under, y, _mm512_castsi512_ps(pow2n));
    return _mm512_mask_blend_ps(over, e, _mm512_set1_ps(INFINITY));
}

/* The gates as swiglu_avx2 and geglu_avx2 compute them, 16 at a time; the
   last n % 16 elements through the AVX2 version, whose own tail is scalar. */
static void swiglu_avx512(float *g, const float *u, int n)
{
    const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(g + i), e = exp_512(_mm512_xor_ps(x, sign));
        _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
    }
    swiglu_avx2(g + i, u + i, n - i);
}

static void geglu_avx512(float *g, const float *u, int n)
{
    const __m512 one = _mm512_set1_ps(1.0f), c = _mm512_set1_ps(-2 * GELU_C), a = _mm512_set1_ps(GELU_A);
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 x = _mm512_loadu_ps(g + i), inner = _mm512_fmadd_ps(_mm512_mul_ps(a, x), _mm512_mul_ps(x, x), x);
        __m512 e = exp_512(_mm512_mul_ps(c, inner));
        _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
    }
    geglu_avx2(g + i, u + i, n - i);
}

/* --probe's peaks for this set: 16-float FMAs, and 16 chains of vpdpbusd
   (64 int8 multiply-adds each): a core with two vpdpbusd ports and a
   latency of 5 needs 10 in flight; 8 chains read 1,180 GOP/s on 2 cores of
   an Emerald Rapids Xeon, 16 chains 1,670, the ports' rate. Every chain is
   pinned in a register and every loop unrolled: GCC 12 otherwise kept two
   chains on the stack, and on a core that issues two 512-bit vpdpbusd a
   cycle (AMD Zen 5) the store and reload of each pass became the critical
   path: the probe read 1,100 GOP/s on 2 cores of an EPYC Zen 5, 2,050 with
   the chains in registers (both threads' rate of two a cycle). */
PEAK_F32(avx512, __m512, 16, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps)

static double peak_i8_avx512(unsigned *sink)
{
    __m512i acc[16], a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
    UNROLL(16)
    for (int j = 0; j < 16; j++) acc[j] = _mm512_set1_epi32(j);
    for (long i = 0; i < PROBE_ITERS / 16; i++)
        UNROLL(16)
        for (int j = 0; j < 16; j++) {
            acc[j] = _mm512_dpbusd_epi32(acc[j], a, b);
            KEEP_IN_REGISTER(acc[j]);
        }
    UNROLL(16)
    for (int j = 0; j < 16; j++) *sink += (unsigned)_mm_cvtsi128_si32(_mm512_castsi512_si128(acc[j])); /* lane 0: a sum could overflow */
    return (double)PROBE_ITERS / 16 * 16 * 64 * 2;
}

/* The activation quantizers on 16 lanes: the same steps as AVX2's
   (amax_avx2, round_i8x32_avx2) with a mask for NaN and the round-up,
   vpmovsdb for the narrowing (no packs to reorder), and q8_K's sums of 16
   taken from the int32 lanes the rounding already holds. Bit for bit the
   scalar set's. AVX2's took 4 % of the 1.5B's prefill on AMD Zen 5. */
static float amax_512(const float *x, int n)
{
    __m512 mx = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int i = 0; i < n; i += 16) {
        __m512 v = _mm512_abs_ps(_mm512_loadu_ps(x + i));
        mx = _mm512_max_ps(mx, v);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    return nan ? NAN : _mm512_reduce_max_ps(mx);
}

/* 16 floats times id rounded to int8 into q as round_i8 does; returns them as int32 lanes. */
static __m512i round_i8x16_512(int8_t *q, const float *x, float id)
{
    const __m512 lim = _mm512_set1_ps(127.0f), half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    __m512 y = _mm512_mul_ps(_mm512_loadu_ps(x), _mm512_set1_ps(id));
    y = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(y, y, _CMP_ORD_Q), y); /* NaN to 0 */
    y = _mm512_max_ps(_mm512_min_ps(y, lim), _mm512_sub_ps(_mm512_setzero_ps(), lim));
    __m512 t = _mm512_roundscale_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __mmask16 up = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(y, t)), half, _CMP_GE_OQ);
    t = _mm512_mask_add_ps(t, up, t, _mm512_or_ps(one, _mm512_and_ps(_mm512_set1_ps(-0.0f), y)));
    __m512i v = _mm512_cvtps_epi32(t);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(v));
    return v;
}

/* Lane j: the reduction of v[j]'s 16 lanes, for 16 vectors at once. Four
   rounds of shuffles (128-bit quarters, halves of them, 64-bit pairs,
   32-bit pairs), each combining two vectors' partial results; the rounds
   leave vector j's result in lane 4 (j % 4) + j / 4, so v is read in that
   order; the result in r[0] (r: eight vectors of scratch). 16 separate
   reductions take four times the instructions. */
#define REDUCE16_512(op, cast_i, cast_f, v, r)                                                                     \
    do {                                                                                                           \
        static const int at_[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};                         \
        for (int i_ = 0; i_ < 8; i_++) {                                                                           \
            __m512i a_ = cast_i(v[at_[2 * i_]]), b_ = cast_i(v[at_[2 * i_ + 1]]);                                \
            r[i_] = op(cast_f(_mm512_shuffle_i32x4(a_, b_, 0x44)), cast_f(_mm512_shuffle_i32x4(a_, b_, 0xee))); \
        }                                                                                                          \
        for (int i_ = 0; i_ < 4; i_++) {                                                                           \
            __m512i a_ = cast_i(r[2 * i_]), b_ = cast_i(r[2 * i_ + 1]);                                        \
            r[i_] = op(cast_f(_mm512_shuffle_i32x4(a_, b_, 0x88)), cast_f(_mm512_shuffle_i32x4(a_, b_, 0xdd))); \
        }                                                                                                          \
        for (int i_ = 0; i_ < 2; i_++) {                                                                           \
            __m512i a_ = cast_i(r[2 * i_]), b_ = cast_i(r[2 * i_ + 1]);                                        \
            r[i_] = op(cast_f(_mm512_unpacklo_epi64(a_, b_)), cast_f(_mm512_unpackhi_epi64(a_, b_)));           \
        }                                                                                                          \
        __m512 x_ = _mm512_castsi512_ps(cast_i(r[0])), y_ = _mm512_castsi512_ps(cast_i(r[1]));                \
        r[0] = op(cast_f(_mm512_castps_si512(_mm512_shuffle_ps(x_, y_, 0x88))),                                  \
                    cast_f(_mm512_castps_si512(_mm512_shuffle_ps(x_, y_, 0xdd))));                                 \
    } while (0)
INLINE __m512i same_512i(__m512i v) { return v; }
INLINE __m512i sum16_512(const __m512i v[16])
{
    __m512i r[8];
    REDUCE16_512(_mm512_add_epi32, same_512i, same_512i, v, r);
    return r[0];
}
INLINE __m512 max16_512(const __m512 v[16]) /* a NaN in v[j] changes lane j alone: the caller sets those lanes */
{
    __m512 r[8];
    REDUCE16_512(_mm512_max_ps, _mm512_castps_si512, _mm512_castsi512_ps, v, r);
    return r[0];
}

/* One block of 32 (quantize_act_avx512's rest). */
static void quantize_block_512(BlockQ8A *out, const float *x)
{
    float d = amax_512(x, QK) / 127, id = d ? 1 / d : 0;
    out->d = d;
    __m512i lo = round_i8x16_512(out->qs, x, id), hi = round_i8x16_512(out->qs + 16, x + 16, id);
    out->sum = _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi));
    out->s = d * out->sum;
}

/* Blocks of 32, 16 at a time: their maximums, scales and sums in one
   vector each (max16_512, sum16_512; one division for 16 scales), the
   same float steps per lane as quantize_block_512's. */
static void quantize_act_avx512(void *blocks, const float *x, int n)
{
    BlockQ8A *out = blocks;
    int b = 0;
    for (; b + 16 <= n / QK; b += 16) {
        const float *xb = x + (size_t)b * QK;
        __m512 m[16];
        __mmask16 nan = 0;
        for (int i = 0; i < 16; i++) {
            __m512 v0 = _mm512_abs_ps(_mm512_loadu_ps(xb + QK * i)), v1 = _mm512_abs_ps(_mm512_loadu_ps(xb + QK * i + 16));
            m[i] = _mm512_max_ps(v0, v1);
            nan |= (__mmask16)(((_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) != 0) << i);
        }
        /* lane i depends on m[i] alone: a block with a NaN gets NaN for its maximum, as amax_512 gives */
        __m512 amax = _mm512_mask_mov_ps(max16_512(m), nan, _mm512_set1_ps(NAN));
        __m512 d = _mm512_div_ps(amax, _mm512_set1_ps(127));
        __m512 id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_UQ), _mm512_set1_ps(1), d); /* d ? 1 / d : 0 */
        float ds[16], ids[16], ss[16];
        int32_t sums[16];
        __m512i part[16];
        _mm512_storeu_ps(ds, d);
        _mm512_storeu_ps(ids, id);
        for (int i = 0; i < 16; i++)
            part[i] = _mm512_add_epi32(round_i8x16_512(out[b + i].qs, xb + QK * i, ids[i]), round_i8x16_512(out[b + i].qs + 16, xb + QK * i + 16, ids[i]));
        __m512i sum = sum16_512(part);
        _mm512_storeu_si512(sums, sum);
        _mm512_storeu_ps(ss, _mm512_mul_ps(d, _mm512_cvtepi32_ps(sum)));
        for (int i = 0; i < 16; i++) out[b + i].d = ds[i], out[b + i].sum = sums[i], out[b + i].s = ss[i];
    }
    for (; b < n / QK; b++) quantize_block_512(&out[b], x + (size_t)b * QK);
}

static void quantize_act_k_avx512(void *blocks, const float *x, int n)
{
    BlockQ8K *out = blocks;
    for (int b = 0; b < n / QK_K; b++, x += QK_K) {
        float d = amax_512(x, QK_K) / 127, id = d ? 1 / d : 0;
        out[b].d = d;
        __m512i v[QK_K / 16];
        for (int j = 0; j < QK_K / 16; j++) v[j] = round_i8x16_512(out[b].qs + 16 * j, x + 16 * j, id);
        _mm256_storeu_si256((__m256i *)out[b].bsums, _mm512_cvtepi32_epi16(sum16_512(v))); /* |sum| <= 16 * 127: exact */
    }
}

TARGET_END

/* AVX2's requirements, AVX-512 F/DQ/BW/VL and VNNI (cpuid leaf 7), and an
   OS that saves the opmask and all 32 ZMM registers (XCR0 bits 5-7). */
static int cpu_has_avx512_vnni(void)
{
    unsigned a, b, c, d, xcr0_lo, xcr0_hi;
    const unsigned zmm_state = 0xe6; /* XMM, YMM, opmask, ZMM_Hi256, Hi16_ZMM */
    if (!cpu_has_avx2()) return 0;
    __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0_lo & zmm_state) != zmm_state || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    int f = b >> 16 & 1, dq = b >> 17 & 1, bw = b >> 30 & 1, vl = b >> 31 & 1, vnni = c >> 11 & 1;
    return f && dq && bw && vl && vnni;
}

/* The AVX-512 set's row: the packed products, the activation quantizers,
   prefill's attention and the FFN gates; the rest is AVX2's. */
static const KernelSet SET_AVX512 = {
    {.name = "avx512", .available = cpu_has_avx512_vnni, .inherits = KSET_AVX2,
     .quantize = {[ACT_Q8] = quantize_act_avx512, [ACT_Q8K] = quantize_act_k_avx512}, .att_qk = att_qk_avx512,
     .att_pv = att_pv_avx512, .swiglu = swiglu_avx512, .geglu = geglu_avx512, .peak_f32 = peak_f32_avx512,
     .peak_i8 = peak_i8_avx512},
    {[T_F32] = {.packed = packed_f32_avx512}, [T_F16] = {.packed = packed_f16_avx512}, [T_BF16] = {.packed = packed_bf16_avx512},
     [T_Q4_0] = {.packed = packed_q4_0_avx512}, [T_Q4_1] = {.packed = packed_q4_1_avx512},
     [T_Q5_0] = {.packed = packed_q5_0_avx512}, [T_Q5_1] = {.packed = packed_q5_1_avx512},
     [T_Q8_0] = {.packed = packed_q8_0_avx512}, [T_Q4_K] = {.packed = packed_q4_k_avx512, .wide = packed_q4_k_avx512},
     [T_Q5_K] = {.packed = packed_q5_k_avx512}, [T_Q6_K] = {.packed = packed_q6_k_avx512, .wide = packed_q6_k_avx512}},
};
#endif /* HAVE_AVX512_SET */

/* ============================================================================
   APPENDIX D: THE NEON KERNEL SET (aarch64)
   The 32-element types' int8 matrix products with 128-bit NEON: widening
   int8 multiplies (vmull_s8, vmlal_s8) summed pairwise into 32 bits, the
   same integers as the scalar set's, scaled per block in float; and
   prefill's multi-query attention. Every other kernel is the scalar set's
   (its inherits field). Checked against the
   scalar set by tests/test_kernels.c, cross-compiled and run under
   qemu-aarch64 (tests/test_kernels.py).
   ========================================================================= */
#ifdef HAVE_NEON_SET
#define NEON_INLINE static inline __attribute__((always_inline))

/* --- packed products on 128-bit vectors (Part II, "the packed layout") --
   A group's 16 rows are four quarters of 4 lanes: of every 64 bytes of
   integers, 16 belong to each quarter. The integers go in as signed bytes
   (nibbles and 5-bit ones as they are, q8_0's q + 128 back to q), so a
   lane's four products are one sdot, or without it two widening
   multiplies and two pairwise adds (|q a| <= 128 * 127: a pair fits
   int16). Then the scalar definitions' float steps on 4 lanes. */
#define PACK_TOKS_128 4 /* tokens per pass over a quarter group */
typedef int32x4_t (*Dot4NeonFn)(int32x4_t acc, int8x16_t w, int8x16_t a);

NEON_INLINE int32x4_t dot4_neon(int32x4_t acc, int8x16_t w, int8x16_t a)
{
    int16x8_t p = vpaddq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(a)), vmull_high_s8(w, a));
    return vpadalq_s16(acc, p);
}

/* Integers 4g .. 4g + 3 (g = 0..7) of the quarter's 4 rows in a stretch, as signed bytes. */
NEON_INLINE int8x16_t stretch_s128(const uint8_t *stretch, int g, int bits, int quarter)
{
    const uint8_t *p = stretch + 16 * quarter;
    if (bits == 8) return vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p + 64 * g), vdupq_n_u8(0x80)));
    int extra = bits - 4;
    uint8x16_t v = vld1q_u8(p + PACK_ROWS * STRETCH / 8 * extra + 64 * (g / 2));
    uint8x16_t u = g & 1 ? vshrq_n_u8(v, 4) : vandq_u8(v, vdupq_n_u8(0x0f));
    if (extra) {
        int per_byte = 8 / extra, at = g % per_byte * extra;
        uint8x16_t hi = vshlq_u8(vld1q_u8(p + 64 * (g / per_byte)), vdupq_n_s8((int8_t)(4 - at)));
        u = vorrq_u8(u, vandq_u8(hi, vdupq_n_u8((uint8_t)(((1 << extra) - 1) << 4))));
    }
    return vreinterpretq_s8_u8(u);
}

NEON_INLINE float32x4_t halves4_neon(const uint8_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p))); }

/* Rows 4 quarter .. 4 quarter + 3 for T <= PACK_TOKS_128 tokens (packed_dot_block32). */
NEON_INLINE void packed32_128(const uint8_t *group, int n, const uint8_t *x, size_t xs, int T, float *out, int quarter,
                              int bits, int offset, int has_min, Dot4NeonFn dot4)
{
    const PackForm f = {PACK_BLOCK32, bits, offset, has_min};
    const size_t hb = packed_head_bytes(&f), rb = packed_record_bytes(&f);
    float32x4_t acc[PACK_TOKS_128];
    for (int t = 0; t < T; t++) acc[t] = vdupq_n_f32(0);
    for (int k = 0; k < n / QK; k++) {
        const uint8_t *rec = group + k * rb;
        int32x4_t isum[PACK_TOKS_128];
        for (int t = 0; t < T; t++) isum[t] = vdupq_n_s32(0);
        for (int g = 0; g < QK / 4; g++) {
            int8x16_t w = stretch_s128(rec + hb, g, bits, quarter);
            for (int t = 0; t < T; t++) {
                int32_t a4;
                memcpy(&a4, ((const BlockQ8A *)(x + t * xs) + k)->qs + 4 * g, 4);
                isum[t] = dot4(isum[t], w, vreinterpretq_s8_s32(vdupq_n_s32(a4)));
            }
        }
        float32x4_t d = halves4_neon(rec + 8 * quarter), m = has_min ? halves4_neon(rec + 2 * PACK_ROWS + 8 * quarter) : d;
        for (int t = 0; t < T; t++) {
            const BlockQ8A *a = (const BlockQ8A *)(x + t * xs) + k;
            int32x4_t s = offset ? vsubq_s32(isum[t], vdupq_n_s32(offset * a->sum)) : isum[t];
            acc[t] = vfmaq_f32(acc[t], vmulq_n_f32(vcvtq_f32_s32(s), a->d), d);
            if (has_min) acc[t] = vfmaq_n_f32(acc[t], m, a->s);
        }
    }
    for (int t = 0; t < T; t++) vst1q_f32(out + t * PACK_ROWS + 4 * quarter, acc[t]);
}

NEON_INLINE void packed32_neon(const uint8_t *group, int n, const uint8_t *x, size_t xs, int T, float *out, int bits, int offset,
                               int has_min, Dot4NeonFn dot4)
{
    _Static_assert(PACK_TOKS_128 == 4, "1 to 3 tokens are left at most");
    for (int quarter = 0; quarter < 4; quarter++) {
        int t0 = 0; /* every pass's token count a constant, so the sums stay in registers */
        for (; t0 + PACK_TOKS_128 <= T; t0 += PACK_TOKS_128)
            packed32_128(group, n, x + t0 * xs, xs, PACK_TOKS_128, out + t0 * PACK_ROWS, quarter, bits, offset, has_min, dot4);
        switch (T - t0) {
        case 3: packed32_128(group, n, x + t0 * xs, xs, 3, out + t0 * PACK_ROWS, quarter, bits, offset, has_min, dot4); break;
        case 2: packed32_128(group, n, x + t0 * xs, xs, 2, out + t0 * PACK_ROWS, quarter, bits, offset, has_min, dot4); break;
        case 1: packed32_128(group, n, x + t0 * xs, xs, 1, out + t0 * PACK_ROWS, quarter, bits, offset, has_min, dot4); break;
        }
    }
}

/* q8_0's offset is taken where its bytes become signed: 0 here. */
PACKED_KERNEL(q4_0, neon, packed32_neon, 4, 8, 0, dot4_neon)
PACKED_KERNEL(q4_1, neon, packed32_neon, 4, 0, 1, dot4_neon)
PACKED_KERNEL(q5_0, neon, packed32_neon, 5, 16, 0, dot4_neon)
PACKED_KERNEL(q5_1, neon, packed32_neon, 5, 0, 1, dot4_neon)
PACKED_KERNEL(q8_0, neon, packed32_neon, 8, 0, 0, dot4_neon)

/* Prefill's multi-query attention kernels (contracts at att_qk_scalar)
   with 4 floats per vector and 32 registers: 4 x 4 scores, each summed
   across its vector once at the end, and 4 queries x 4 vectors of outputs;
   an f16 row is widened 4 elements per instruction (not measured on
   hardware: tests/test_kernels.py checks them under qemu). Without them the set would inherit the
   scalar ones, which convert every f16 element once per query. */
NEON_INLINE float32x4_t load4_kv_neon(const void *row, int i, int f16)
{
    if (f16) return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)row + i)));
    return vld1q_f32((const float *)row + i);
}

NEON_INLINE void att_qk_tile_neon(float *s, const float *q, int nq, int a0, const void *const *k, int nk, int j0, int hd, int f16)
{
    const float *qa[ATT_QK_NEON];
    const void *kb[ATT_QK_NEON];
    for (int a = 0; a < ATT_QK_NEON; a++) qa[a] = q + (size_t)min_i(a0 + a, nq - 1) * hd;
    for (int b = 0; b < ATT_QK_NEON; b++) kb[b] = k[min_i(j0 + b, nk - 1)];
    float32x4_t acc[ATT_QK_NEON * ATT_QK_NEON];
    for (int r = 0; r < ATT_QK_NEON * ATT_QK_NEON; r++) acc[r] = vdupq_n_f32(0);
    int vec = hd / 4 * 4;
    for (int i = 0; i < vec; i += 4) {
        float32x4_t kv[ATT_QK_NEON];
        for (int b = 0; b < ATT_QK_NEON; b++) kv[b] = load4_kv_neon(kb[b], i, f16);
        for (int a = 0; a < ATT_QK_NEON; a++) {
            float32x4_t qv = vld1q_f32(qa[a] + i);
            for (int b = 0; b < ATT_QK_NEON; b++) acc[a * ATT_QK_NEON + b] = vfmaq_f32(acc[a * ATT_QK_NEON + b], qv, kv[b]);
        }
    }
    for (int a = 0; a < ATT_QK_NEON && a0 + a < nq; a++)
        for (int b = 0; b < ATT_QK_NEON && j0 + b < nk; b++) {
            float sum = vaddvq_f32(acc[a * ATT_QK_NEON + b]);
            for (int i = vec; i < hd; i++) sum += qa[a][i] * kv_elem(kb[b], f16 ? T_F16 : T_F32, i);
            s[(a0 + a) * ATT_KTILE + j0 + b] = sum;
        }
}

static void att_qk_neon(float *s, const float *q, int nq, const void *const *k, int type, int hd, int nk)
{
    for (int a0 = 0; a0 < nq; a0 += ATT_QK_NEON)
        for (int j0 = 0; j0 < nk; j0 += ATT_QK_NEON) {
            if (type == T_F16) att_qk_tile_neon(s, q, nq, a0, k, nk, j0, hd, 1);
            else att_qk_tile_neon(s, q, nq, a0, k, nk, j0, hd, 0);
        }
}

NEON_INLINE void att_pv_tile_neon(float *o, int os, const float *p, int a0, int qt, const void *const *v, int nk, int i, int nv, int f16)
{
    float32x4_t acc[ATT_PV_Q][ATT_PV_V32];
    for (int a = 0; a < qt; a++)
        for (int c = 0; c < nv; c++) acc[a][c] = vld1q_f32(o + (size_t)(a0 + a) * os + i + 4 * c);
    for (int j = 0; j < nk; j++) {
        float32x4_t vv[ATT_PV_V32];
        for (int c = 0; c < nv; c++) vv[c] = load4_kv_neon(v[j], i + 4 * c, f16);
        for (int a = 0; a < qt; a++) {
            float pj = p[(a0 + a) * ATT_KTILE + j];
            for (int c = 0; c < nv; c++) acc[a][c] = vfmaq_n_f32(acc[a][c], vv[c], pj);
        }
    }
    for (int a = 0; a < qt; a++)
        for (int c = 0; c < nv; c++) vst1q_f32(o + (size_t)(a0 + a) * os + i + 4 * c, acc[a][c]);
}

NEON_INLINE void att_pv_rows_neon(float *o, int os, const float *p, int a0, int qt, const void *const *v, int hd, int nk, int f16)
{
    int i = 0;
    for (; i + 4 * ATT_PV_V32 <= hd; i += 4 * ATT_PV_V32) att_pv_tile_neon(o, os, p, a0, qt, v, nk, i, ATT_PV_V32, f16);
    for (; i + 4 <= hd; i += 4) att_pv_tile_neon(o, os, p, a0, qt, v, nk, i, 1, f16);
    for (int a = a0; a < a0 + qt; a++)
        for (int j = 0; j < nk; j++)
            for (int e = i; e < hd; e++) o[(size_t)a * os + e] += p[a * ATT_KTILE + j] * kv_elem(v[j], f16 ? T_F16 : T_F32, e);
}

NEON_INLINE void att_pv_type_neon(float *o, int os, const float *p, int nq, const void *const *v, int hd, int nk, int f16)
{
    int a0 = 0;
    for (; a0 + ATT_PV_Q <= nq; a0 += ATT_PV_Q) att_pv_rows_neon(o, os, p, a0, ATT_PV_Q, v, hd, nk, f16);
    switch (nq - a0) { /* ATT_PV_Q is 4 (att_pv_type_avx2) */
    case 3: att_pv_rows_neon(o, os, p, a0, 3, v, hd, nk, f16); break;
    case 2: att_pv_rows_neon(o, os, p, a0, 2, v, hd, nk, f16); break;
    case 1: att_pv_rows_neon(o, os, p, a0, 1, v, hd, nk, f16); break;
    }
}

static void att_pv_neon(float *o, int os, const float *p, int nq, const void *const *v, int type, int hd, int nk)
{
    if (type == T_F16) att_pv_type_neon(o, os, p, nq, v, hd, nk, 1);
    else att_pv_type_neon(o, os, p, nq, v, hd, nk, 0);
}

/* The dot-product extension: sdot sums four int8 products into each 32-bit
   lane, one instruction per 16 bytes where NEON takes a widening multiply,
   a multiply-add and a pairwise add. */
TARGET_BEGIN(ISA_DOTPROD)
#if defined(__clang__) && !defined(__ARM_FEATURE_DOTPROD)
/* clang's arm_neon.h (14) declares vdotq_s32 only when the whole file
   targets the extension: the instruction itself, for this function. */
NEON_INLINE int32x4_t sdot_asm(int32x4_t acc, int8x16_t a, int8x16_t b)
{
    __asm__("sdot %0.4s, %1.16b, %2.16b" : "+w"(acc) : "w"(a), "w"(b));
    return acc;
}
#define vdotq_s32 sdot_asm
#endif
NEON_INLINE int32x4_t dot4_sdot(int32x4_t acc, int8x16_t w, int8x16_t a) { return vdotq_s32(acc, w, a); }

PACKED_KERNEL(q4_0, sdot, packed32_neon, 4, 8, 0, dot4_sdot)
PACKED_KERNEL(q4_1, sdot, packed32_neon, 4, 0, 1, dot4_sdot)
PACKED_KERNEL(q5_0, sdot, packed32_neon, 5, 16, 0, dot4_sdot)
PACKED_KERNEL(q5_1, sdot, packed32_neon, 5, 0, 1, dot4_sdot)
PACKED_KERNEL(q8_0, sdot, packed32_neon, 8, 0, 0, dot4_sdot)
TARGET_END

/* The dot-product instructions, as the kernel reports them (HWCAP_ASIMDDP). */
static int cpu_has_sdot(void)
{
    const unsigned long asimddp = 1ul << 20;
    return (getauxval(AT_HWCAP) & asimddp) != 0;
}

/* The NEON sets' rows: the 32-element types' packed products and (NEON)
   prefill's attention; the rest is the scalar set's, and with sdot NEON's. */
static const KernelSet SET_NEON = {
    {.name = "neon", .available = always, .inherits = KSET_SCALAR, .att_qk = att_qk_neon, .att_pv = att_pv_neon,
     .attention = attend_in_chunks},
    {[T_Q4_0] = {.packed = packed_q4_0_neon}, [T_Q4_1] = {.packed = packed_q4_1_neon}, [T_Q5_0] = {.packed = packed_q5_0_neon},
     [T_Q5_1] = {.packed = packed_q5_1_neon}, [T_Q8_0] = {.packed = packed_q8_0_neon}},
};
static const KernelSet SET_NEON_DOT = {
    {.name = "neon-dot", .available = cpu_has_sdot, .inherits = KSET_NEON},
    {[T_Q4_0] = {.packed = packed_q4_0_sdot}, [T_Q4_1] = {.packed = packed_q4_1_sdot}, [T_Q5_0] = {.packed = packed_q5_0_sdot},
     [T_Q5_1] = {.packed = packed_q5_1_sdot}, [T_Q8_0] = {.packed = packed_q8_0_sdot}},
};
#endif /* HAVE_NEON_SET */
