// bindings.cpp — cflow._native: thin, zero-copy nanobind wrappers over the kernel table, the
// thread pool and the bandwidth probe (the engine's bindings live in bind_engine.cpp).
//
// Each wrapper checks shapes and sizes, then calls one C kernel on the numpy buffers as they
// are (read-only arrays such as a file's mmap are fine); results come back as new numpy arrays.
// Bad input raises cflow._native.KernelInputError (a CflowError and a ValueError). `isa=None`
// uses the table dispatch.c chose (CFLOW_ISA honoured); a name picks one table, for tests and
// benchmarks. Long calls release the GIL. This module is for tests, benchmarks and tools; the
// per-token path runs inside engine.c and never comes back through here.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cflow.h"
#include "util.h"

namespace nb = nanobind;

void cf_bind_engine(nb::module_ &m); // bind_engine.cpp
void cf_bind_deltanet(nb::module_ &m); // bind_deltanet.cpp

namespace {

// ---- arrays ----------------------------------------------------------------------------------

template <typename T> using In1 = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
template <typename T> using In2 = nb::ndarray<const T, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using AnyIn = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;
template <typename T> using Out = nb::ndarray<nb::numpy, T>;

// A new zero-filled numpy array of n elements, freed by Python.
template <typename T> Out<T> new_array(size_t n) {
    T *data = new T[n > 0 ? n : 1]();
    nb::capsule owner(data, [](void *p) noexcept { delete[] static_cast<T *>(p); });
    return Out<T>(data, {n}, owner);
}

PyObject *g_input_error = nullptr; // cflow._native.KernelInputError

[[noreturn]] void bad_input(const std::string &msg) {
    PyErr_SetString(g_input_error, msg.c_str());
    throw nb::python_error();
}

std::string available_list() {
    std::string s;
    for (const char *const *n = cf_available_isas(); *n; n++) s += std::string(s.empty() ? "" : ", ") + *n;
    return s;
}

const cf_kernel_table *table(const std::optional<std::string> &isa) {
    if (!isa) return cf_kernels();
    const cf_kernel_table *t = cf_kernels_by_name(isa->c_str());
    if (!t) bad_input("kernel table '" + *isa + "' is not available on this CPU/build; use one of: " + available_list());
    return t;
}

void check_len(size_t got, size_t want, const char *what) {
    if (got != want)
        bad_input(std::string(what) + " has " + std::to_string(got) + " elements, expected " + std::to_string(want));
}

// A cf_tiled view of a numpy byte buffer, after checking the geometry against DESIGN.md (and
// docs/kquants.md: the K-quants' blocks, rows and tiles are 256 weights wide).
cf_tiled tiled_view(const uint8_t *data, size_t size, int dtype, int rows, int cols, int tile_rows, int tile_cols) {
    if (dtype < 0 || dtype >= CF_DTYPE_IDS || dtype == CF_F32 || dtype == CF_F16 || !cf_dtype_names[dtype])
        bad_input("tiled dtype id " + std::to_string(dtype) + " is not a quantized type; use 2 (q4_0), 3 (q4_1), "
                  "6 (q5_0), 7 (q5_1), 8 (q8_0), 12 (q4_k), 13 (q5_k), 14 (q6_k) or 39 (mxfp4)");
    int qb = cf_block_weights(dtype);
    std::string qbs = std::to_string(qb);
    if (rows < 1 || cols < 1 || cols % qb)
        bad_input("matrix shape [" + std::to_string(rows) + ", " + std::to_string(cols) + "] is invalid for " +
                  cf_dtype_names[dtype] + "; rows >= 1 and cols a positive multiple of " + qbs);
    if (tile_rows < CF_G || tile_rows % CF_G || tile_cols < qb || tile_cols % qb)
        bad_input("tile " + std::to_string(tile_rows) + "x" + std::to_string(tile_cols) + " is invalid for " +
                  cf_dtype_names[dtype] + "; rows a multiple of 8, cols a multiple of " + qbs);
    cf_tiled w{data, dtype, rows, cols, tile_rows, tile_cols};
    if (size != cf_tiled_bytes(&w))
        bad_input("tiled buffer has " + std::to_string(size) + " bytes; a [" + std::to_string(rows) + ", " +
                  std::to_string(cols) + "] matrix of dtype " + std::to_string(dtype) + " needs " + std::to_string(cf_tiled_bytes(&w)));
    return w;
}

// The table's kernel for a dtype, or KernelInputError if that table has none (never a NULL call).
template <typename Fn> Fn kernel(const cf_kernel_table *t, Fn const (&fns)[CF_DTYPE_IDS], int dtype, const char *what) {
    if (!fns[dtype])
        bad_input(std::string("kernel table '") + t->name + "' has no " + what + " kernel for " + cf_dtype_names[dtype]);
    return fns[dtype];
}

// Owned buffers of a quantized activation vector: the 32-block fields, and the 256-block ones
// when n allows them (n % 256 == 0).
struct ActQ8 {
    std::vector<int8_t> qs, qk;
    std::vector<float> d, s, dk;
    std::vector<int16_t> bsums;
    cf_act_q8 view;
    explicit ActQ8(int n)
        : qs(n), qk(n % CF_QK_K ? 0 : n), d(n / CF_QK), s(n / CF_QK), dk(n % CF_QK_K ? 0 : n / CF_QK_K),
          bsums(n % CF_QK_K ? 0 : n / 16),
          view{qs.data(), d.data(), s.data(), n, qk.data(), dk.data(), bsums.data()} {}
    // x in the format the kernels of `dtype` read (cflow.h, cf_act_q8), as the engine will
    void quantize(const cf_kernel_table *t, int dtype, const float *x) {
        if (cf_is_kquant(dtype)) t->quantize_act_k(x, &view);
        else t->quantize_act(x, &view);
    }
};

const cf_half *half_data(const AnyIn &a, const char *what) {
    if (a.dtype().bits != 16 || a.dtype().lanes != 1 ||
        (a.dtype().code != (uint8_t)nb::dlpack::dtype_code::Float && a.dtype().code != (uint8_t)nb::dlpack::dtype_code::UInt))
        bad_input(std::string(what) + " must be float16 (or its uint16 bits)");
    return static_cast<const cf_half *>(a.data());
}

// ---- thread pool -----------------------------------------------------------------------------

struct Pool {
    cf_pool *p;
    explicit Pool(int n) : p(nullptr) {
        if (n < 1 || n > 1024) bad_input("thread count " + std::to_string(n) + " is out of range; use 1..1024");
        p = cf_pool_create(n);
        if (!p) throw std::runtime_error("could not start " + std::to_string(n) + " threads");
    }
    ~Pool() { cf_pool_free(p); }
    Pool(const Pool &) = delete;
    Pool &operator=(const Pool &) = delete;
    int size() const { return cf_pool_size(p); }
};

// Split [0, n) over the pool (or run it all on the caller) and call fn(lo, hi) per thread.
template <typename F> void parallel_ranges(Pool *pool, int n, F &&fn) {
    if (!pool) {
        fn(0, n);
        return;
    }
    struct Ctx {
        F *fn;
        int n;
    } ctx{&fn, n};
    cf_pool_run(pool->p, [](void *c, int ith, int nth) {
        Ctx *x = static_cast<Ctx *>(c);
        int lo, hi;
        cf_split_range(x->n, ith, nth, 1, &lo, &hi);
        if (lo < hi) (*x->fn)(lo, hi);
    }, &ctx);
}

// Every thread bumps its own counter once per run; after each run the caller checks that all
// counters moved exactly once (so none ran twice, none was skipped, and its write is visible).
std::tuple<Out<int64_t>, int64_t> pool_selftest(Pool &pool, int n_calls) {
    int n = pool.size();
    auto counts = new_array<int64_t>(n);
    int64_t *c = counts.data();
    int64_t violations = 0;
    {
        nb::gil_scoped_release rel;
        struct Ctx {
            int64_t *c;
            int n;
            int64_t bad_nth;
        } ctx{c, n, 0};
        for (int call = 0; call < n_calls; call++) {
            cf_pool_run(pool.p, [](void *p, int ith, int nth) {
                Ctx *x = static_cast<Ctx *>(p);
                if (nth != x->n || ith < 0 || ith >= nth) __atomic_fetch_add(&x->bad_nth, 1, __ATOMIC_RELAXED);
                else x->c[ith]++;
            }, &ctx);
            for (int i = 0; i < n; i++) violations += c[i] != call + 1;
        }
        violations += ctx.bad_nth;
    }
    return {counts, violations};
}

double pool_run_latency(Pool &pool, int n_calls) {
    nb::gil_scoped_release rel;
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n_calls; i++) cf_pool_run(pool.p, [](void *, int, int) {}, nullptr);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n_calls;
}

// ---- kernels ---------------------------------------------------------------------------------

// The K-quant kernels' activation: (qk int8 [n], dk float32 [n/256], bsums int16 [n/16]).
std::tuple<Out<int8_t>, Out<float>, Out<int16_t>> quantize_act_k(In1<float> x, std::optional<std::string> isa) {
    const cf_kernel_table *t = table(isa);
    if (x.size() % CF_QK_K) bad_input("K-quant activation length " + std::to_string(x.size()) + " is not a multiple of 256");
    int n = (int)x.size();
    auto qk = new_array<int8_t>(n);
    auto dk = new_array<float>(n / CF_QK_K);
    auto bsums = new_array<int16_t>(n / 16);
    cf_act_q8 a{};
    a.n = n;
    a.qk = qk.data();
    a.dk = dk.data();
    a.bsums = bsums.data();
    t->quantize_act_k(x.data(), &a);
    return {qk, dk, bsums};
}

std::tuple<Out<int8_t>, Out<float>, Out<float>> quantize_act(In1<float> x, std::optional<std::string> isa) {
    const cf_kernel_table *t = table(isa);
    if (x.size() % CF_QK) bad_input("activation length " + std::to_string(x.size()) + " is not a multiple of 32");
    int n = (int)x.size();
    auto qs = new_array<int8_t>(n);
    auto d = new_array<float>(n / CF_QK), s = new_array<float>(n / CF_QK);
    cf_act_q8 a{qs.data(), d.data(), s.data(), n};
    t->quantize_act(x.data(), &a);
    return {qs, d, s};
}

// [lo, hi) of n units (hi < 0: up to n), or KernelInputError naming the unit.
void check_range(int &lo, int &hi, int n, const char *unit) {
    if (hi < 0) hi = n;
    if (lo < 0 || lo > hi || hi > n)
        bad_input(std::string(unit) + " range [" + std::to_string(lo) + ", " + std::to_string(hi) + ") is outside [0, " +
                  std::to_string(n) + "]");
}

// Pairs of row groups (gate group, up group) of an interleaved gate/up matrix of `rows` rows.
int gate_up_pairs(int rows) {
    if (rows % (2 * CF_G)) bad_input("gate/up matrix has " + std::to_string(rows) + " rows; it needs 2*d_ff rows with d_ff a multiple of 8");
    return rows / (2 * CF_G);
}

// y[n_out] from a one-activation tiled kernel (matvec and gate_up share a signature) over units
// [u0, u1), split over the pool; x is quantized first, as the engine does.
Out<float> run_matvec(const cf_kernel_table *t, cf_matvec_fn fn, const cf_tiled &w, const float *x, size_t n_out,
                      Pool *pool, int u0, int u1) {
    auto y = new_array<float>(n_out);
    float *yp = y.data();
    {
        nb::gil_scoped_release rel;
        ActQ8 a(w.cols);
        a.quantize(t, w.dtype, x);
        parallel_ranges(pool, u1 - u0, [&](int lo, int hi) { fn(&w, &a.view, yp, u0 + lo, u0 + hi); });
    }
    return y;
}

Out<float> matvec(In1<uint8_t> tiled, int dtype, int rows, int cols, In1<float> x, int tile_rows, int tile_cols,
                  std::optional<std::string> isa, Pool *pool, int g0, int g1) {
    const cf_kernel_table *t = table(isa);
    cf_tiled w = tiled_view(tiled.data(), tiled.size(), dtype, rows, cols, tile_rows, tile_cols);
    check_len(x.size(), cols, "x");
    check_range(g0, g1, cf_n_groups(&w), "row-group");
    return run_matvec(t, kernel(t, t->matvec, dtype, "matvec"), w, x.data(), rows, pool, g0, g1);
}

Out<float> gate_up(In1<uint8_t> tiled, int dtype, int rows, int cols, In1<float> x, int tile_rows, int tile_cols,
                   std::optional<std::string> isa, Pool *pool, int p0, int p1) {
    const cf_kernel_table *t = table(isa);
    cf_tiled w = tiled_view(tiled.data(), tiled.size(), dtype, rows, cols, tile_rows, tile_cols);
    check_len(x.size(), cols, "x");
    check_range(p0, p1, gate_up_pairs(rows), "pair");
    return run_matvec(t, kernel(t, t->gate_up, dtype, "gate_up"), w, x.data(), rows / 2, pool, p0, p1);
}

// Quantized copies of the rows of X [B, cols], and the table's views of them.
struct ActQ8Batch {
    std::vector<ActQ8> rows;
    std::vector<cf_act_q8> views;
    ActQ8Batch(const cf_kernel_table *t, int dtype, const float *X, int B, int cols) {
        rows.reserve(B);
        for (int b = 0; b < B; b++) {
            rows.emplace_back(cols);
            rows.back().quantize(t, dtype, X + (size_t)b * cols);
            views.push_back(rows.back().view);
        }
    }
};

// Y [B, n_out] from a batched tiled kernel (matmat and gate_up_mm share a signature) over units
// [u0, u1), split over the pool.
Out<float> run_matmat(const cf_kernel_table *t, cf_matmat_fn fn, const cf_tiled &w, const In2<float> &X,
                      size_t n_out, Pool *pool, int u0, int u1) {
    size_t B = X.shape(0);
    if (B < 1) bad_input("X has no rows; pass at least one activation");
    float *data = new float[B * n_out > 0 ? B * n_out : 1]();
    nb::capsule owner(data, [](void *p) noexcept { delete[] static_cast<float *>(p); });
    Out<float> y(data, {B, n_out}, owner);
    const float *xp = X.data();
    {
        nb::gil_scoped_release rel;
        ActQ8Batch a(t, w.dtype, xp, (int)B, w.cols);
        parallel_ranges(pool, u1 - u0, [&](int lo, int hi) { fn(&w, a.views.data(), (int)B, data, (int)n_out, u0 + lo, u0 + hi); });
    }
    return y;
}

Out<float> matmat(In1<uint8_t> tiled, int dtype, int rows, int cols, In2<float> X, int tile_rows, int tile_cols,
                  std::optional<std::string> isa, Pool *pool, int g0, int g1) {
    const cf_kernel_table *t = table(isa);
    cf_tiled w = tiled_view(tiled.data(), tiled.size(), dtype, rows, cols, tile_rows, tile_cols);
    check_len(X.shape(1), cols, "each row of X");
    check_range(g0, g1, cf_n_groups(&w), "row-group");
    return run_matmat(t, kernel(t, t->matmat, dtype, "matmat"), w, X, rows, pool, g0, g1);
}

Out<float> gate_up_mm(In1<uint8_t> tiled, int dtype, int rows, int cols, In2<float> X, int tile_rows, int tile_cols,
                      std::optional<std::string> isa, Pool *pool, int p0, int p1) {
    const cf_kernel_table *t = table(isa);
    cf_tiled w = tiled_view(tiled.data(), tiled.size(), dtype, rows, cols, tile_rows, tile_cols);
    check_len(X.shape(1), cols, "each row of X");
    check_range(p0, p1, gate_up_pairs(rows), "pair");
    return run_matmat(t, kernel(t, t->gate_up_mm, dtype, "gate_up_mm"), w, X, rows / 2, pool, p0, p1);
}

Out<float> embed_row(In1<uint8_t> tiled, int dtype, int rows, int cols, int r, int tile_rows, int tile_cols,
                     std::optional<std::string> isa) {
    const cf_kernel_table *t = table(isa);
    cf_tiled w = tiled_view(tiled.data(), tiled.size(), dtype, rows, cols, tile_rows, tile_cols);
    if (r < 0 || r >= rows) bad_input("row " + std::to_string(r) + " is outside [0, " + std::to_string(rows) + ")");
    auto out = new_array<float>(cols);
    t->embed_row(&w, r, out.data());
    return out;
}

double thread_cpu_s() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// (wall, calling thread's CPU) seconds per mat-vec (activation already quantized), cycling
// through `copies` back-to-back copies of the matrix in `buf` so that a buffer larger than the
// caches measures DRAM. On a shared machine the CPU time of a 1-thread run is the steadier one.
std::tuple<double, double> bench_matvec(In1<uint8_t> buf, int copies, int dtype, int rows, int cols, In1<float> x, int tile_rows,
                    int tile_cols, std::optional<std::string> isa, Pool *pool, int iters) {
    const cf_kernel_table *t = table(isa);
    if (copies < 1 || buf.size() % copies) bad_input("buffer size is not a whole number of copies");
    cf_tiled w = tiled_view(buf.data(), buf.size() / copies, dtype, rows, cols, tile_rows, tile_cols);
    check_len(x.size(), cols, "x");
    size_t nbytes = cf_tiled_bytes(&w);
    std::vector<float> y(rows);
    nb::gil_scoped_release rel;
    ActQ8 a(cols);
    a.quantize(t, dtype, x.data());
    cf_matvec_fn fn = kernel(t, t->matvec, dtype, "matvec");
    int ng = cf_n_groups(&w);
    double c0 = thread_cpu_s();
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < iters; it++) {
        cf_tiled wi = w;
        wi.data = buf.data() + (size_t)(it % copies) * nbytes;
        parallel_ranges(pool, ng, [&](int lo, int hi) { fn(&wi, &a.view, y.data(), lo, hi); });
    }
    double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return {wall / iters, (thread_cpu_s() - c0) / iters};
}

Out<float> rmsnorm(In1<float> x, In1<float> w, float eps, std::optional<std::string> isa) {
    const cf_kernel_table *t = table(isa);
    check_len(w.size(), x.size(), "norm weight");
    auto out = new_array<float>(x.size());
    t->rmsnorm(out.data(), x.data(), w.data(), (int)x.size(), eps);
    return out;
}

Out<float> geglu(In1<float> gu, std::optional<std::string> isa) {
    const cf_kernel_table *t = table(isa);
    if (gu.size() % (2 * CF_G)) throw nb::value_error("geglu: gu holds pairs of 8 gate and 8 up values");
    auto out = new_array<float>(gu.size() / 2);
    t->geglu(out.data(), gu.data(), (int)(gu.size() / (2 * CF_G)));
    return out;
}

Out<float> swiglu_oai(In1<float> gu, float alpha, float limit, std::optional<std::string> isa) {
    const cf_kernel_table *t = table(isa);
    if (gu.size() % (2 * CF_G)) throw nb::value_error("swiglu_oai: gu holds pairs of 8 gate and 8 up values");
    auto out = new_array<float>(gu.size() / 2);
    t->swiglu_oai(out.data(), gu.data(), (int)(gu.size() / (2 * CF_G)), alpha, limit);
    return out;
}

Out<float> matvec_f32(In2<float> W, In1<float> x, std::optional<std::string> isa) {
    const cf_kernel_table *t = table(isa);
    check_len(x.size(), W.shape(1), "x");
    auto y = new_array<float>(W.shape(0));
    t->matvec_f32(y.data(), W.data(), x.data(), (int)W.shape(0), (int)W.shape(1));
    return y;
}

Out<float> softmax(In1<float> x, std::optional<std::string> isa) {
    const cf_kernel_table *t = table(isa);
    if (x.size() == 0) bad_input("softmax of an empty vector");
    auto out = new_array<float>(x.size());
    std::memcpy(out.data(), x.data(), sizeof(float) * x.size());
    t->softmax(out.data(), (int)x.size());
    return out;
}

std::tuple<Out<float>, Out<float>> rope_table(int head_dim, int pos, float theta) {
    if (head_dim < 2 || head_dim % 2) bad_input("head_dim " + std::to_string(head_dim) + " must be even");
    auto c = new_array<float>(head_dim / 2), s = new_array<float>(head_dim / 2);
    cf_rope_table(c.data(), s.data(), head_dim, pos, theta, NULL, 1.0f);
    return {c, s};
}

Out<float> rope(In1<float> x, int n_heads, int head_dim, int pos, float theta, std::optional<std::string> isa) {
    const cf_kernel_table *t = table(isa);
    if (head_dim < 2 || head_dim % 2) bad_input("head_dim " + std::to_string(head_dim) + " must be even");
    check_len(x.size(), (size_t)n_heads * head_dim, "x");
    std::vector<float> c(head_dim / 2), s(head_dim / 2);
    cf_rope_table(c.data(), s.data(), head_dim, pos, theta, NULL, 1.0f);
    auto out = new_array<float>(x.size());
    std::memcpy(out.data(), x.data(), sizeof(float) * x.size());
    t->rope(out.data(), n_heads, head_dim, c.data(), s.data());
    return out;
}

// A cache type name of the test entries ("f16", "q8_0") as its dtype id (cflow.h, "The 8-bit KV cache").
static int cache_type_id(const std::string &name, const char *what) {
    if (name == "f16") return CF_F16;
    if (name == "q8_0") return CF_Q8_0;
    bad_input(std::string(what) + " '" + name + "' is not one of f16, q8_0");
}

// head_dim of one cache: fp16 [n_kv_heads, max_seq, head_dim], or q8_0 rows as uint8
// [n_kv_heads, max_seq, head_dim / 32 * 34] (cflow.quant.quantize(rows, "q8_0")).
static int cache_head_dim(const AnyIn &c, int type, const char *what) {
    if (c.ndim() != 3) bad_input(std::string(what) + " must be [n_kv_heads, max_seq, row]");
    if (type == CF_F16) {
        half_data(c, what);
        return (int)c.shape(2);
    }
    size_t rb = cf_kv_row_bytes(CF_Q8_0, CF_QK);
    if (c.dtype() != nb::dtype<uint8_t>() || c.shape(2) == 0 || c.shape(2) % rb)
        bad_input(std::string(what) + " of type q8_0 must be uint8 rows of head_dim / 32 blocks of " +
                  std::to_string(rb) + " bytes");
    return (int)(c.shape(2) / rb * CF_QK);
}

// The two test entries' K/V caches: [n_kv_heads, max_seq, row] each (rows of their types), the
// same heads, positions and head_dim, and n_heads a multiple of n_kv_heads. Returns head_dim.
static int check_kv_caches(const AnyIn &k, const AnyIn &v, int n_heads, int n_kv_heads, int k_type, int v_type) {
    int hd = cache_head_dim(k, k_type, "k cache");
    if (cache_head_dim(v, v_type, "v cache") != hd || k.shape(0) != v.shape(0) || k.shape(1) != v.shape(1))
        bad_input("k and v caches differ in heads, positions or head_dim");
    if (n_heads < 1 || n_kv_heads < 1 || n_heads % n_kv_heads || (int)k.shape(0) != n_kv_heads)
        bad_input("n_heads must be a multiple of n_kv_heads, and the caches must hold n_kv_heads heads");
    return hd;
}

// Attention sinks of the two test entries: none, or one logit per query head.
static const float *sinks_of(const std::optional<In1<float>> &sinks, int n_heads) {
    if (!sinks) return nullptr;
    check_len(sinks->size(), (size_t)n_heads, "sinks");
    return sinks->data();
}

Out<float> attention(In1<float> q, AnyIn k, AnyIn v, int n_heads, int n_kv_heads, int n_pos,
                     std::optional<float> scale, std::optional<std::string> isa, Pool *pool,
                     const std::string &k_type_name, const std::string &v_type_name,
                     std::optional<In1<float>> sinks) {
    const cf_kernel_table *t = table(isa);
    int k_type = cache_type_id(k_type_name, "k_type"), v_type = cache_type_id(v_type_name, "v_type");
    int hd = check_kv_caches(k, v, n_heads, n_kv_heads, k_type, v_type);
    int max_seq = (int)k.shape(1);
    if (n_pos < 1 || n_pos > max_seq) bad_input("n_pos " + std::to_string(n_pos) + " is outside [1, " + std::to_string(max_seq) + "]");
    check_len(q.size(), (size_t)n_heads * hd, "q");
    cf_attn_shape s{n_heads, n_kv_heads, hd, max_seq, n_pos, scale ? *scale : 1.0f / std::sqrt((float)hd),
                    sinks_of(sinks, n_heads)};
    const void *kp = k.data(), *vp = v.data();
    auto out = new_array<float>(q.size());
    float *op = out.data();
    const float *qp = q.data();
    {
        nb::gil_scoped_release rel;
        std::vector<float> att((size_t)n_heads * n_pos);
        parallel_ranges(pool, n_heads, [&](int h0, int h1) {
            float *a = att.data() + (size_t)h0 * n_pos;
            if (k_type == CF_F16 && v_type == CF_F16)
                t->attention(op, qp, (const cf_half *)kp, (const cf_half *)vp, a, &s, h0, h1);
            else
                t->attention_q8kv(op, qp, kp, vp, k_type, v_type, a, &s, h0, h1);
        });
    }
    return out;
}

// Test entry of attention_block: q [n_q, n_heads * head_dim] (queries at positions pos0..), caches
// [n_kv_heads, max_seq, head_dim]; a pool splits the heads, each range with its own scratch.
Out<float> attention_block(In1<float> q, AnyIn k, AnyIn v, int n_heads, int n_kv_heads, int pos0, int window,
                           std::optional<float> scale, std::optional<std::string> isa, Pool *pool,
                           const std::string &k_type_name, const std::string &v_type_name,
                           std::optional<In1<float>> sinks) {
    const cf_kernel_table *t = table(isa);
    int k_type = cache_type_id(k_type_name, "k_type"), v_type = cache_type_id(v_type_name, "v_type");
    int hd = check_kv_caches(k, v, n_heads, n_kv_heads, k_type, v_type);
    int max_seq = (int)k.shape(1), q_dim = n_heads * hd;
    if (q.size() == 0 || q.size() % q_dim) bad_input("q must hold whole queries of n_heads * head_dim floats");
    int n_q = (int)(q.size() / q_dim);
    if (pos0 < 0 || pos0 + n_q > max_seq)
        bad_input("positions " + std::to_string(pos0) + ".." + std::to_string(pos0 + n_q - 1) +
                  " do not fit the cache of " + std::to_string(max_seq));
    if (window < 0) bad_input("window must be 0 (none) or a number of positions");
    cf_attn_block_shape s{n_heads, n_kv_heads, hd, max_seq, scale ? *scale : 1.0f / std::sqrt((float)hd),
                          pos0, n_q, window, q_dim, q_dim, sinks_of(sinks, n_heads)};
    int n_last = pos0 + n_q - cf_attn_lo(&s, n_q - 1);
    const void *kp = k.data(), *vp = v.data();
    auto out = new_array<float>(q.size());
    float *op = out.data();
    const float *qp = q.data();
    {
        nb::gil_scoped_release rel;
        std::vector<float> att((size_t)n_heads * n_q * n_last);
        parallel_ranges(pool, n_heads, [&](int h0, int h1) {
            float *a = att.data() + (size_t)h0 * n_q * n_last;
            if (k_type == CF_F16 && v_type == CF_F16)
                t->attention_block(op, qp, (const cf_half *)kp, (const cf_half *)vp, a, &s, h0, h1);
            else
                t->attention_block_q8kv(op, qp, kp, vp, k_type, v_type, a, &s, h0, h1);
        });
    }
    return out;
}

std::tuple<Out<int32_t>, Out<float>> topk(In1<float> x, int k, std::optional<std::string> isa) {
    if (k < 1 || (size_t)k > x.size()) bad_input("k=" + std::to_string(k) + " must be in [1, len(x)]");
    for (size_t i = 0; i < x.size(); i++)
        if (x.data()[i] != x.data()[i]) bad_input("x holds NaN at index " + std::to_string(i));
    const cf_kernel_table *t = table(isa);
    auto idx = new_array<int32_t>(k);
    auto val = new_array<float>(k);
    t->topk(x.data(), (int)x.size(), k, idx.data(), val.data());
    return {idx, val};
}

Out<uint16_t> f32_to_f16(In1<float> x, std::optional<std::string> isa) {
    const cf_kernel_table *t = table(isa);
    auto out = new_array<uint16_t>(x.size());
    t->f32_to_f16(out.data(), x.data(), (int)x.size());
    return out;
}

// One KV cache row (or several back to back) into q8_0 blocks: x.size() / 32 blocks of 34 bytes.
Out<uint8_t> f32_to_q8_0(In1<float> x, std::optional<std::string> isa) {
    const cf_kernel_table *t = table(isa);
    if (x.size() % CF_QK) bad_input("x must hold a multiple of 32 values, got " + std::to_string(x.size()));
    auto out = new_array<uint8_t>(x.size() / CF_QK * cf_kv_row_bytes(CF_Q8_0, CF_QK));
    t->f32_to_q8_0(out.data(), x.data(), (int)x.size());
    return out;
}

// cf_half_to_float over an array: the conversion the reference kernels (and the ISA kernels'
// scalar tails) read every fp16 scale and cached K/V value with. Not in the kernel table: the
// engine never converts whole fp16 arrays.
Out<float> f16_to_f32(AnyIn h) {
    const cf_half *hp = half_data(h, "input");
    auto out = new_array<float>(h.size());
    for (size_t i = 0; i < h.size(); i++) out.data()[i] = cf_half_to_float(hp[i]);
    return out;
}

nb::dict cpu_features() {
    unsigned f = cf_cpu_features();
    nb::dict d;
    const std::pair<const char *, unsigned> names[] = {
        {"avx", CF_CPU_AVX},           {"avx2", CF_CPU_AVX2},         {"fma", CF_CPU_FMA},
        {"f16c", CF_CPU_F16C},         {"avxvnni", CF_CPU_AVXVNNI},   {"avx512f", CF_CPU_AVX512F},
        {"avx512bw", CF_CPU_AVX512BW}, {"avx512vl", CF_CPU_AVX512VL}, {"avx512vnni", CF_CPU_AVX512VNNI}};
    for (auto &n : names) d[n.first] = (f & n.second) != 0;
    return d;
}

std::vector<std::string> available_isas() {
    std::vector<std::string> v;
    for (const char *const *n = cf_available_isas(); *n; n++) v.emplace_back(*n);
    return v;
}

void make_error_class(nb::module_ &m) {
    nb::object base = nb::module_::import_("cflow.errors").attr("CflowError");
    PyObject *bases = PyTuple_Pack(2, base.ptr(), PyExc_ValueError);
    g_input_error = PyErr_NewException("cflow._native.KernelInputError", bases, nullptr);
    Py_DECREF(bases);
    if (!g_input_error) throw nb::python_error();
    m.attr("KernelInputError") = nb::handle(g_input_error);
}

} // namespace

NB_MODULE(_native, m) {
    m.doc() = "cflow's C core: quantized tiled mat-vec and friends, a thread pool, the decode engine";
    make_error_class(m);

    using nb::arg;
    auto none = nb::none();
    m.def("isa", [] { return std::string(cf_kernels()->name); }, "Name of the kernel table in use.");
    m.def("available_isas", &available_isas, "Kernel tables this CPU can run, best last.");
    m.def("cpu_features", &cpu_features, "CPU features the dispatcher probed.");
    m.def("set_prefetch", [](int mode) {
        if (cf_set_prefetch(mode))
            throw nb::value_error(("prefetch must be -1 (the kernels' default), 0 (off) or 1.." +
                                   std::to_string(CF_PREFETCH_MAX) + " bytes ahead, got " + std::to_string(mode)).c_str());
    }, arg("mode"),
          "The process-wide software-prefetch mode of the kernels (cflow.h): -1 each kernel's default (the "
          "one-row mat-vec: matvec_default_ahead), 0 off everywhere, N > 0 PREFETCHT0 N bytes ahead in every weight-streaming "
          "kernel. An engine sets its own mode (NativeEngine.prefetch) at the start of each call.");
    m.def("get_prefetch", &cf_get_prefetch, "The process-wide software-prefetch mode (-1 default, 0 off, N bytes).");
    m.def("matvec_default_ahead", &cf_matvec_default_ahead, arg("dtype"),
          "The default mode's one-row mat-vec prefetch distance for a dtype id on this CPU (bytes; 0: none).");
    m.def("avx512_q6k_streams", []() { return cf_avx512_q6k_streams() != 0; },
          "Whether the avx512 table runs its own Q6_K kernels on this CPU (not on Zen 4; CFLOW_AVX512_Q6K=1/0 forces it).");
    m.def("avx512_small_batch", []() { return cf_avx512_small_batch_groups() ? "group" : "pair"; },
          "How the avx512 table runs batches of 2-16 Q4_0/Q4_1/Q8_0 tokens on this CPU: 'group' (one group per "
          "ymm: Zen 4) or 'pair' (two groups per zmm); CFLOW_AVX512_SMALL_BATCH=group/pair forces it.");
    m.attr("PREFETCH_DEFAULT") = (int)CF_PREFETCH_DEFAULT;
    m.attr("PREFETCH_OFF") = (int)CF_PREFETCH_OFF;
    m.attr("PREFETCH_MAX") = (int)CF_PREFETCH_MAX;
    m.def("tiled_bytes", [](int dtype, int rows, int cols, int tr, int tc) {
        cf_tiled w{nullptr, dtype, rows, cols, tr, tc};
        return cf_tiled_bytes(&w);
    }, arg("dtype"), arg("rows"), arg("cols"), arg("tile_rows") = 128, arg("tile_cols") = 256);
    m.def("read_bandwidth", [](size_t nbytes, int threads, int reps) {
        nb::gil_scoped_release rel;
        return cf_read_bandwidth(nbytes, threads, reps);
    }, arg("nbytes"), arg("threads") = 1, arg("reps") = 5, "Best-of-reps read bandwidth in GB/s (<0: no memory).");
    m.def("int8_peak", [](const std::string &isa, int threads, int reps) {
        nb::gil_scoped_release rel;
        return cf_int8_peak(isa.c_str(), threads, reps);
    }, arg("isa"), arg("threads") = 1, arg("reps") = 3,
       "Best-of-reps int8 multiply-add throughput in GOP/s (2 ops per MAC) of the instruction form a "
       "kernel table ('avx2', 'avxvnni', 'avx512') is built on, with no loads: the prefill compute "
       "ceiling. -1 when that form is not compiled in; the caller checks the CPU has it.");

    nb::class_<Pool>(m, "Pool", "A persistent thread pool; the calling thread is thread 0.")
        .def(nb::init<int>(), arg("n_threads"))
        .def_prop_ro("size", &Pool::size)
        .def("selftest", &pool_selftest, arg("n_calls"),
             "Run a counting task n_calls times; returns (per-thread counts, violations).")
        .def("run_latency", &pool_run_latency, arg("n_calls"), "Seconds per empty run.");

    m.def("quantize_act", &quantize_act, arg("x"), arg("isa") = none);
    m.def("quantize_act_k", &quantize_act_k, arg("x"), arg("isa") = none,
          "The K-quant kernels' activation: (qk int8 [n], dk float32 [n/256], bsums int16 [n/16]).");
    // The four tiled kernels take one argument list: the matrix, x (or X), the tile, the table,
    // a pool, and the unit range (row groups g0, g1 or gate/up pairs p0, p1; -1: to the end).
    auto def_tiled = [&](const char *name, auto fn, const char *x, const char *lo, const char *hi, const char *doc) {
        m.def(name, fn, arg("tiled"), arg("dtype"), arg("rows"), arg("cols"), arg(x), arg("tile_rows") = 128,
              arg("tile_cols") = 256, arg("isa") = none, arg("pool") = none, arg(lo) = 0, arg(hi) = -1, doc);
    };
    def_tiled("matvec", &matvec, "x", "g0", "g1",
              "y = W x for a tiled quantized W (x is quantized first in the format of W's dtype: int8 per "
              "32-block, or per 256-block with sums for the K-quants); rows of "
              "groups [g0, g1) only (others stay 0).");
    def_tiled("gate_up", &gate_up, "x", "p0", "p1",
              "silu(gate x) * (up x) from an interleaved [2*d_ff, d] tiled matrix; returns d_ff values.");
    def_tiled("matmat", &matmat, "X", "g0", "g1",
              "Y[b] = W X[b] for the B rows of X [B, cols] with the batched (prefill) kernel; returns [B, rows], "
              "rows of groups [g0, g1) only (others stay 0).");
    def_tiled("gate_up_mm", &gate_up_mm, "X", "p0", "p1",
              "gate_up for the B rows of X [B, cols] with the batched kernel; returns [B, d_ff].");
    m.def("embed_row", &embed_row, arg("tiled"), arg("dtype"), arg("rows"), arg("cols"), arg("r"),
          arg("tile_rows") = 128, arg("tile_cols") = 256, arg("isa") = none);
    m.def("bench_matvec", &bench_matvec, arg("buf"), arg("copies"), arg("dtype"), arg("rows"), arg("cols"), arg("x"),
          arg("tile_rows") = 128, arg("tile_cols") = 256, arg("isa") = none, arg("pool") = none, arg("iters") = 100);
    m.def("rmsnorm", &rmsnorm, arg("x"), arg("w"), arg("eps") = 1e-5f, arg("isa") = none);
    m.def("geglu", &geglu, arg("gu"), arg("isa") = none,
          "gelu_tanh(gate) * up over pairs of 8 gate and 8 up values (an interleaved gate/up row), "
          "as the engine's GeGLU");
    m.def("swiglu_oai", &swiglu_oai, arg("gu"), arg("alpha") = 1.702f, arg("limit") = 7.0f, arg("isa") = none,
          "OpenAI's clamped SwiGLU over pairs of 8 gate and 8 up values: min(g, limit) * sigmoid(alpha "
          "min(g, limit)) * (clamp(u, -limit, limit) + 1), as gpt-oss's experts (llama.cpp's swiglu_oai)");
    m.def("matvec_f32", &matvec_f32, arg("W"), arg("x"), arg("isa") = none);
    m.def("softmax", &softmax, arg("x"), arg("isa") = none);
    m.def("rope_table", &rope_table, arg("head_dim"), arg("pos"), arg("theta"));
    m.def("rope", &rope, arg("x"), arg("n_heads"), arg("head_dim"), arg("pos"), arg("theta"), arg("isa") = none);
    m.def("attention", &attention, arg("q"), arg("k"), arg("v"), arg("n_heads"), arg("n_kv_heads"), arg("n_pos"),
          arg("scale") = none, arg("isa") = none, arg("pool") = none, arg("k_type") = "f16", arg("v_type") = "f16",
          arg("sinks") = none,
          "One query over caches k, v [n_kv_heads, max_seq, row] (positions [0, n_pos)): fp16 rows of head_dim, "
          "or with k_type / v_type 'q8_0' uint8 rows of head_dim / 32 q8_0 blocks (attention_q8kv); sinks: "
          "[n_heads] logits that join each head's softmax denominator (gpt-oss).");
    m.def("attention_block", &attention_block, arg("q"), arg("k"), arg("v"), arg("n_heads"), arg("n_kv_heads"),
          arg("pos0"), arg("window") = 0, arg("scale") = none, arg("isa") = none, arg("pool") = none,
          arg("k_type") = "f16", arg("v_type") = "f16", arg("sinks") = none,
          "Queries q [n_q * n_heads * head_dim] at positions pos0.. over caches k, v [n_kv_heads, max_seq, row] "
          "(fp16, or q8_0 rows as in attention), causal (window > 0: the last `window` positions); "
          "[n_q * n_heads * head_dim].");
    m.def("topk", &topk, arg("x"), arg("k"), arg("isa") = nb::none());
    m.def("f32_to_f16", &f32_to_f16, arg("x"), arg("isa") = none, "fp16 bits (uint16), round to nearest even.");
    m.def("f32_to_q8_0", &f32_to_q8_0, arg("x"), arg("isa") = none,
          "KV cache rows to q8_0 blocks (uint8, 34 bytes per 32 values): cflow.quant.quantize(x, 'q8_0')'s bytes.");
    m.def("f16_to_f32", &f16_to_f32, arg("h"), "fp16 bits (or float16) to float32 with the scalar cf_half_to_float.");

    cf_bind_engine(m);
    cf_bind_deltanet(m);
}
