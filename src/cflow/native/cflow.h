/* cflow.h — the C core's shared definitions: block formats, tile geometry, the kernel table,
 * the thread pool. Every kernel has a scalar `_ref` version (kernels_ref.c) and may have ISA
 * versions (kernels_avx2.inc, ...); dispatch.c fills `cf_kernels` once from a CPU-feature probe.
 * The table holds exactly the kernels the engine calls (engine_build.c checks they are all there);
 * the bindings reach nothing else through it (the K-quant and Q5_x entries and quantize_act_k
 * included: K-quant files run on them, docs/kquants.md).
 *
 * Layout contracts are described in docs/DESIGN.md ("Tile layout"); the Python twin is
 * cflow/quant.py. Keep both in step: tests check one against the other.
 *
 * Conventions of every kernel below:
 *   - no allocation, no locks, no I/O; buffers belong to the caller;
 *   - a kernel that threads share takes a range ([g0, g1), [p0, p1), [h0, h1)) and writes only
 *     the outputs of that range, so a thread pool can split one call without synchronisation;
 *   - `n` counts elements, never bytes.
 */
#ifndef CFLOW_H
#define CFLOW_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- block formats (GGML semantics, GGML type ids) -------------------------------------- */
#define CF_QK 32   /* weights per block of the 32-block formats (and per activation block) */
#define CF_QK_K 256 /* weights per super-block of the K-quants (Q4_K, Q5_K, Q6_K) */

enum cf_dtype {
    CF_F32 = 0,
    CF_F16 = 1,
    CF_Q4_0 = 2,
    CF_Q4_1 = 3,
    CF_Q5_0 = 6,
    CF_Q5_1 = 7,
    CF_Q8_0 = 8,
    CF_Q4_K = 12,
    CF_Q5_K = 13,
    CF_Q6_K = 14,
    CF_MXFP4 = 39, /* gpt-oss's experts: E8M0 scale + 32 E2M1 nibbles (cflow.kquant, docs/kquants.md) */
    CF_DTYPE_IDS, /* one past the largest id: the size of tables indexed by dtype */
};
/* cf_dtype_names[id]: "f32", "f16", "q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q4_k", "q5_k",
 * "q6_k", "mxfp4"; NULL for GGML ids the core does not run. Exported to Python as _native.DTYPE_IDS, and
 * with cf_block_weights / cf_block_bytes as _native.DTYPE_TABLE, which cflow.runtime.abi holds
 * against the Python table (cflow/dtypes.py) when it loads the core (formats.c). The layouts of
 * the K-quant dtypes and their tiles: docs/kquants.md, Python twin cflow/kquant.py. */
extern const char *const cf_dtype_names[CF_DTYPE_IDS];

/* The K-quants (256-weight super-blocks, read with the 256-block activation fields below). */
static inline int cf_is_kquant(int dtype) {
    return dtype == CF_Q4_K || dtype == CF_Q5_K || dtype == CF_Q6_K;
}
/* Weights per block of `dtype`: 256 for the K-quants, 32 otherwise (F32/F16 count in 32s). */
static inline int cf_block_weights(int dtype) { return cf_is_kquant(dtype) ? CF_QK_K : CF_QK; }

typedef uint16_t cf_half;
/* fp16 <-> fp32 one value at a time (formats.c). */
float cf_half_to_float(cf_half h);
cf_half cf_float_to_half(float f); /* round to nearest even, like F16C */

/* Tile geometry: row groups of CF_G rows are interleaved inside a tile (see DESIGN.md). */
#define CF_G 8

/* An activation vector quantized to int8, in one or both of two formats. Buffers are owned by
 * the caller (no allocation in kernels).
 *   32-block (quantize_act): x[i] ~= d[b] * qs[i], s[b] = d[b] * sum(qs in block b), b = i / 32.
 *     Read by the Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and MXFP4 kernels.
 *   256-block (quantize_act_k; n a multiple of 256): x[i] ~= dk[b] * qk[i], b = i / 256, and
 *     bsums[j] = sum(qk[16j .. 16j+15]) (cflow.kquant.quantize_act_k, docs/kquants.md). Read by
 *     the Q4_K, Q5_K and Q6_K kernels.
 * A kernel reads only its dtype's fields; the others may be NULL. A caller quantizes x once per
 * format that the matrices it feeds need. */
typedef struct {
    int8_t *qs; /* [n] */
    float *d;   /* [n / 32] */
    float *s;   /* [n / 32] */
    int n;      /* multiple of 32 (of 256 for the 256-block fields) */
    int8_t *qk;     /* [n] */
    float *dk;      /* [n / 256] */
    int16_t *bsums; /* [n / 16] */
} cf_act_q8;

/* A tiled weight matrix W[rows, cols] living in caller-owned memory (usually an mmap). */
typedef struct {
    const uint8_t *data;
    int dtype;     /* CF_Q4_0, CF_Q4_1, CF_Q5_0, CF_Q5_1, CF_Q8_0, CF_Q4_K, CF_Q5_K, CF_Q6_K or CF_MXFP4 */
    int rows;
    int cols;      /* multiple of cf_block_weights(dtype) */
    int tile_rows; /* TR, multiple of CF_G (default 128) */
    int tile_cols; /* TK, multiple of cf_block_weights(dtype) (default 256) */
} cf_tiled;

/* Bytes of one block of `dtype` (cf_block_weights weights) for one row: 18, 20, 22, 24, 34, 17 for
 * Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4; 144, 176, 210 for Q4_K, Q5_K, Q6_K; 128 for F32 and 64 for F16
 * (per 32 weights); 0 if the dtype is unknown (formats.c). */
size_t cf_block_bytes(int dtype);
/* Total bytes of a tiled matrix (formats.c). */
size_t cf_tiled_bytes(const cf_tiled *w);
/* Number of row groups of a tiled matrix: ceil(rows / CF_G). */
static inline int cf_n_groups(const cf_tiled *w) { return (w->rows + CF_G - 1) / CF_G; }

/* One query's attention over a KV cache.
 * Cache layout (fp16, F16C-convertible): k, v [n_kv_heads][max_seq][head_dim]; positions
 * [0, n_pos) are valid. Query head h reads kv head h / (n_heads / n_kv_heads) (GQA).
 *
 * The 8-bit KV cache (cache type CF_Q8_0, llama.cpp's `-ctk/-ctv q8_0`): the same
 * [n_kv_heads][max_seq] rows, each row (one position of one kv head) head_dim / 32 GGML q8_0 blocks
 * {fp16 d; int8 qs[32]} of cf_block_bytes(CF_Q8_0) = 34 bytes, value j = d * qs[j]; head_dim must
 * be a multiple of 32 (the engine refuses other models at load). A row is written with d =
 * max|x| / 127, qs = roundf(x * (1/d)): ggml's quantize_row_q8_0_ref and the Python twin
 * cflow.quant.quantize(row, "q8_0"), byte for byte. The scale is fp16, as in GGML: 2 bytes per 32
 * values (1.0625 bytes a value, 53% of fp16) where f32 would take 1.125, and the scale's own
 * rounding (2^-11 relative) is far below the int8 step (1/254 of the block's max); d * qs is then
 * exact in fp32 (11 + 8 significant bits), so a dequantized value has no rounding of its own.
 * K and V choose their type independently (cf_kernel_table.attention_q8kv). */
static inline size_t cf_kv_row_bytes(int type, int head_dim) {
    return type == CF_Q8_0 ? (size_t)head_dim / CF_QK * (2 + CF_QK) : (size_t)head_dim * sizeof(cf_half);
}
typedef struct {
    int n_heads;
    int n_kv_heads; /* divides n_heads */
    int head_dim;
    int max_seq;    /* the cache's second dimension (stride between kv heads) */
    int n_pos;      /* positions to attend over, 1..max_seq */
    float scale;    /* usually 1/sqrt(head_dim) */
    /* NULL, or attention sinks (gpt-oss): [n_heads] logits, one per query head, that join that
     * head's softmax as one more (scaled) score with no value: the softmax's max and denominator
     * include exp(sinks[h] - max), its weights over the positions then sum to less than 1. */
    const float *sinks;
} cf_attn_shape;

/* A block of consecutive queries of one sequence (a prefill chunk) against that sequence's cache.
 * Query i of the block sits at position pos0 + i and attends to positions [cf_attn_lo(s, i),
 * pos0 + i]: the whole prefix, or with a sliding window W > 0 the last W of it. */
typedef struct {
    int n_heads;
    int n_kv_heads; /* divides n_heads */
    int head_dim;
    int max_seq;    /* the cache's second dimension; pos0 + n_q <= max_seq */
    float scale;    /* usually 1/sqrt(head_dim) */
    int pos0;       /* position of the block's first query */
    int n_q;        /* queries in the block, >= 1 */
    int window;     /* 0: the whole prefix; W > 0: a query at p sees [max(0, p - W + 1), p] */
    int ldq, ldo;   /* floats between consecutive queries' rows of q and of out */
    const float *sinks; /* NULL, or [n_heads] attention sinks (cf_attn_shape) */
} cf_attn_block_shape;

/* First position query i of a block attends to (the engine's attn_first for the same window). */
static inline int cf_attn_lo(const cf_attn_block_shape *s, int i) {
    int p = s->pos0 + i;
    return s->window > 0 && p >= s->window ? p - s->window + 1 : 0;
}

/* ---- kernels ----------------------------------------------------------------------------- */
/* y[r] = sum_k W[r,k] * x[k] for row groups [g0, g1) (rows g0*CF_G .. min(g1*CF_G, rows)).
 * Threads split a mat-vec by row-group ranges; each writes only its rows of y. */
typedef void (*cf_matvec_fn)(const cf_tiled *w, const cf_act_q8 *x, float *y, int g0, int g1);

/* Fused SwiGLU front half over an interleaved gate/up matrix (DESIGN.md: rows gate[0:8],
 * up[0:8], gate[8:16], ...; w->rows = 2*d_ff, d_ff a multiple of 8). For group pairs [p0, p1)
 * (pair p = gate group 2p and up group 2p+1) writes y[8p .. 8p+8) = silu(gate) * up, so y has
 * d_ff entries. */
typedef void (*cf_gate_up_fn)(const cf_tiled *w, const cf_act_q8 *x, float *y, int p0, int p1);

/* The batched (prefill) forms: B activations xs[0..B) against the same rows, so each weight block
 * is unpacked once and used B times. y[b*ldy + r] equals what matvec (gate_up) writes to y[r]
 * for xs[b] — bit for bit within one table — for the same ranges; other entries are untouched. */
typedef void (*cf_matmat_fn)(const cf_tiled *w, const cf_act_q8 *xs, int B, float *y, int ldy,
                             int g0, int g1);
typedef void (*cf_gate_up_mm_fn)(const cf_tiled *w, const cf_act_q8 *xs, int B, float *y,
                                 int ldy, int p0, int p1);

typedef struct {
    const char *name; /* "ref", "avx2", ... */
    void (*quantize_act)(const float *x, cf_act_q8 *out);      /* out->n must be set */
    cf_matvec_fn matvec[CF_DTYPE_IDS];                         /* indexed by cf_dtype */
    void (*rmsnorm)(float *out, const float *x, const float *w, int n, float eps);
    void (*matvec_f32)(float *y, const float *W, const float *x, int rows, int cols); /* row-major */

    cf_gate_up_fn gate_up[CF_DTYPE_IDS]; /* indexed by cf_dtype */
    /* x[0..n) = softmax(x), in place (max-subtracted). */
    void (*softmax)(float *x, int n);
    /* Rotary embedding, "half" convention, in place on n_heads heads of head_dim each:
     * (x[j], x[j+hd/2]) rotate by angle_j whose cos/sin come from cf_rope_table. */
    void (*rope)(float *x, int n_heads, int head_dim, const float *cos, const float *sin);
    /* out[h*hd ..] for query heads [h0, h1); att is scratch of (h1-h0)*n_pos floats. */
    void (*attention)(float *out, const float *q, const cf_half *k, const cf_half *v,
                      float *att, const cf_attn_shape *shape, int h0, int h1);
    /* Prefill attention: query heads [h0, h1) of the n_q queries of a block (cf_attn_block_shape)
     * at once. q[i*ldq + h*hd ..] is query i's head h, out[i*ldo + h*hd ..] its output; k, v are
     * the sequence's cache from position 0 ([n_kv_heads][max_seq][head_dim]); att is scratch of
     * (h1-h0) * n_q * n_last floats, n_last = positions the last query sees. Each K and V row is
     * converted once per tile and used by every query and head of the block that sees it (the
     * heads of one kv head and the block's queries). Outputs equal, bit for bit, what this
     * table's `attention` writes for each query alone (cache from cf_attn_lo, n_pos up to its
     * position): the same per-score and per-output summation order, so a prompt run in blocks
     * and the same tokens run one step at a time give the same logits. */
    void (*attention_block)(float *out, const float *q, const cf_half *k, const cf_half *v,
                            float *att, const cf_attn_block_shape *s, int h0, int h1);
    /* Row r of a tiled matrix, dequantized to fp32 (the embedding lookup): out[cols]. */
    void (*embed_row)(const cf_tiled *w, int r, float *out);
    /* K and V into the fp16 cache; round to nearest even (cf_float_to_half is the reference). */
    void (*f32_to_f16)(cf_half *out, const float *x, int n);

    cf_matmat_fn matmat[CF_DTYPE_IDS];         /* indexed by cf_dtype */
    cf_gate_up_mm_fn gate_up_mm[CF_DTYPE_IDS]; /* indexed by cf_dtype */
    /* The k largest of x[0..n), largest first (ties: lower index first); 1 <= k <= n; x has no
     * NaN. The router's expert choice; cf_topk is the reference. */
    void (*topk)(const float *x, int n, int k, int *idx, float *val);
    /* The 256-block activation fields: out->qk, out->dk, out->bsums from x[0..out->n), n a
     * multiple of 256; bit for bit cflow.kquant.quantize_act_k. The K-quant kernels' input. */
    void (*quantize_act_k)(const float *x, cf_act_q8 *out);

    /* The 8-bit KV cache (cf_kv_row_bytes above). k_type and v_type are each CF_F16 or CF_Q8_0;
     * k and v point at rows of that type, laid out as for `attention` (kv head stride max_seq
     * rows of cf_kv_row_bytes(type, head_dim) bytes). Both read a q8_0 value as the fp32 d * qs,
     * so they compute what `attention` / `attention_block` compute over a cache holding those
     * values: with k_type = v_type = CF_F16 the bits of `attention` / `attention_block`, and
     * attention_block_q8kv gives attention_q8kv's bits per query (the same contract as above). */
    void (*attention_q8kv)(float *out, const float *q, const void *k, const void *v, int k_type, int v_type,
                           float *att, const cf_attn_shape *shape, int h0, int h1);
    void (*attention_block_q8kv)(float *out, const float *q, const void *k, const void *v, int k_type,
                                 int v_type, float *att, const cf_attn_block_shape *s, int h0, int h1);
    /* One cache row x[0..n) (n a multiple of 32) into n / 32 q8_0 blocks, bit for bit ggml's
     * quantize_row_q8_0_ref (the reference is kernels_ref.c's). */
    void (*f32_to_q8_0)(uint8_t *out, const float *x, int n);
    /* GeGLU's product (Gemma's FFN) over the rows of an interleaved gate/up matrix: for pair
     * p < n_pairs, h[8p + j] = gelu_tanh(gu[16p + j]) * gu[16p + 8 + j] (j < CF_G), with
     * gelu_tanh(x) = 0.5 x (1 + tanh(c (x + 0.044715 x^3))), c = sqrt(2/pi), which the reference
     * computes so (as PyTorch's and ggml's formula); the vector tables as the same function
     * x / (1 + exp(-2c (x + 0.044715 x^3))). */
    void (*geglu)(float *h, const float *gu, int n_pairs);
    /* OpenAI's SwiGLU (gpt-oss's experts, llama.cpp's swiglu_oai) over the same pairs, after the
     * gate and up biases: x = min(gate, limit), y = clamp(up, -limit, limit),
     * h = x / (1 + exp(-alpha x)) * (y + 1) (gpt-oss: alpha 1.702, limit 7; engine.h CF_ACT_*). */
    void (*swiglu_oai)(float *h, const float *gu, int n_pairs, float alpha, float limit);
    /* One Gated DeltaNet head for one token (Qwen3.5; deltanet.h, cf_deltanet_head_ref is the
     * reference): S [dh][dh] (key dim, value dim) *= decay; S += k (beta (v - S^T k))^T; o = S^T q.
     * q and k are L2-normalised; dh any size (the vector tables finish with a scalar tail). */
    void (*deltanet_head)(float *S, const float *q, const float *k, const float *v, float decay, float beta,
                          float *o, int dh);
} cf_kernel_table;

/* The table chosen for this CPU (set up on first use; CFLOW_ISA=ref|avx2 overrides). */
const cf_kernel_table *cf_kernels(void);
/* The scalar reference table, and a specific one by name (NULL if unavailable here). */
const cf_kernel_table *cf_kernels_ref(void);
const cf_kernel_table *cf_kernels_by_name(const char *name);
/* Names of the tables this CPU can run, best last, NULL-terminated ("ref", "avx2", ...). */
const char *const *cf_available_isas(void);
/* CPU features the dispatcher looked at, as a bit set of CF_CPU_* (0 off x86). */
enum {
    CF_CPU_AVX = 1 << 0,
    CF_CPU_AVX2 = 1 << 1,
    CF_CPU_FMA = 1 << 2,
    CF_CPU_F16C = 1 << 3,
    CF_CPU_AVXVNNI = 1 << 4,
    CF_CPU_AVX512F = 1 << 5,
    CF_CPU_AVX512BW = 1 << 6,
    CF_CPU_AVX512VL = 1 << 7,
    CF_CPU_AVX512VNNI = 1 << 8,
};
unsigned cf_cpu_features(void);

/* Explicit software prefetch in the kernels that stream weights (claim C6). One process-wide
 * mode, read by every weight-streaming kernel of the fast tables at each call:
 *   CF_PREFETCH_DEFAULT (-1, the initial mode): each kernel's built-in choice: the one-row
 *     mat-vec and gate/up of every dtype cf_matvec_default_ahead(dtype) bytes ahead (8 KiB, measured
 *     +16% to +34% decode on a Zen 5; none on Zen 4, where it measured 25-40% slower; 2 KiB on
 *     Intel, where 4 KiB and more measured up to 1.9x slower on a Xeon: dispatch.c),
 *     the avx512 batched kernels 4 KiB ahead (MM5_AHEAD, kernels_avx512.c); the other batched
 *     kernels do not prefetch.
 *   CF_PREFETCH_OFF (0): no software prefetch anywhere, Q6_K's included.
 *   N > 0 (at most CF_PREFETCH_MAX): every weight-streaming kernel (mat-vec, gate/up, matmat,
 *     gate_up_mm of the avx2, avxvnni and avx512 tables, all dtypes, dense and expert weights
 *     alike, and the f32 router mat-vec) issues one PREFETCHT0 per cache line of the weight bytes
 *     N bytes ahead of those it is about to read, never past the end of the tensor.
 * Prefetching never changes a result (tests/test_prefetch.py checks bit-identity). The `_ref`
 * kernels never prefetch: they define the semantics, not the speed. The engine sets its own mode
 * at the entry of every step (cf_engine_set_prefetch), so the mode is per engine for the engine's
 * calls; a direct kernel call uses whatever was set last. cf_set_prefetch returns 0, or -1 (mode
 * unchanged) for a value below -1 or above CF_PREFETCH_MAX. */
enum { CF_PREFETCH_DEFAULT = -1, CF_PREFETCH_OFF = 0, CF_PREFETCH_MAX = 1 << 20 };
int cf_set_prefetch(int mode);
int cf_matvec_default_ahead(int dtype); /* the default mode's one-row mat-vec distance on this CPU */
int cf_avx512_q6k_streams(void);        /* the avx512 table runs its own Q6_K kernels on this CPU (dispatch.c) */
int cf_avx512_small_batch_groups(void); /* its 2-16 token Q4/Q8 batches read one group per ymm (dispatch.c) */
int cf_get_prefetch(void);

/* Small scalar routines that need no table. */
/* cos/sin[j] = cos/sin(pos * theta^(-2j/head_dim)) for j < head_dim/2 (computed in double). */
/* factors: NULL, or head_dim/2 divisors of the pairs' frequencies (Llama 3's rope_freqs, YaRN's
 * interpolation); mscale multiplies both tables (YaRN; 1: none) */
void cf_rope_table(float *cos, float *sin, int head_dim, int pos, float theta, const float *factors,
                   float mscale);
/* The k largest of x[0..n), largest first (ties: lower index first); k <= n. The reference
 * of the table's topk (kernels_ref.c). */
void cf_topk(const float *x, int n, int k, int *idx, float *val);

/* ---- thread pool ------------------------------------------------------------------------- */
typedef struct cf_pool cf_pool;
typedef void (*cf_task_fn)(void *ctx, int ith, int nth);

cf_pool *cf_pool_create(int n_threads); /* the caller counts as thread 0; NULL on failure */
void cf_pool_free(cf_pool *pool);
int cf_pool_size(const cf_pool *pool);
/* Run the nth = cf_pool_size() shares fn(ctx, ith, nth), ith in [0, nth), and wait for all
 * (spin, then sleep when idle long). Each share runs exactly once, on the caller or a worker
 * (ith is the share, not a fixed OS thread: the caller takes over shares that no worker has
 * picked up yet). Shares may synchronise with each other (barriers). One caller at a time;
 * fn must not call cf_pool_run on the same pool. */
void cf_pool_run(cf_pool *pool, cf_task_fn fn, void *ctx);

#ifndef __cplusplus
#include <stdatomic.h>
/* Sleep while *addr == val, and wake up to n sleepers of addr: a futex on Linux. Elsewhere the
 * wait only yields, so callers re-check in a loop (the pool and the engine's barrier both do). */
void cf_word_wait(_Atomic uint32_t *addr, uint32_t val);
void cf_word_wake(_Atomic uint32_t *addr, int n);
/* Wait while *word == val: spin `spin` rounds (cheap when the wait is short), then sleep on the
 * word, counted in *sleepers so that a waker makes the system call only when someone sleeps. */
void cf_word_wait_spin(_Atomic uint32_t *word, uint32_t val, int spin, _Atomic uint32_t *sleepers);

/* A phase-counting barrier for the shares of one cf_pool_run: spin, then sleep on a futex.
 * Spinning keeps the wake-up latency in the 100 ns range, which matters with ~150 barriers per
 * token (the engine meets at one between phases). A waiter whose peer has not come
 * within ~BARRIER_SPIN pauses sleeps instead of spinning or yielding: when other processes take
 * cores, two of our threads can end up on one core's run queue, and a waiter that stays runnable
 * (spinning, or sched_yield, which CFS does not honour across priorities) steals the time slice
 * of the very thread it waits for — measured: 3.6 tok/s instead of ~190 on SmolLM2 with two
 * busy processes beside a 2-thread decode. The last arriver wakes sleepers only when there are
 * any, so the uncontended path makes no system call. */
typedef struct {
    atomic_int count;
    _Atomic uint32_t phase;
    _Atomic uint32_t sleepers;
    int n;
} cf_barrier;

/* Wait until all n parties have arrived (n <= 1: return at once). */
void cf_barrier_wait(cf_barrier *b);
#endif

/* ---- probe.c ----------------------------------------------------------------------------- */
/* Best-of-`reps` read bandwidth in GB/s over `nbytes`; negative if it cannot allocate. */
double cf_read_bandwidth(size_t nbytes, int n_threads, int reps);
/* int8 multiply-add peak in GOP/s of one kernel table's instruction form; -1 if not compiled in. */
double cf_int8_peak(const char *isa, int n_threads, int reps);

#ifdef __cplusplus
}
#endif
#endif /* CFLOW_H */
