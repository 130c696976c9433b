/* util.h — the small scalar helpers every C file of the core shares: integer min/max, the split
 * of a range over threads, the spin-wait hint, the scalar SiLU, the monotonic clock and the
 * error-message writer. One definition each, static inline so they cost nothing; C and C++
 * (bindings.cpp splits ranges the engine's way too).
 */
#ifndef CFLOW_UTIL_H
#define CFLOW_UTIL_H

#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

static inline int cf_min(int a, int b) { return a < b ? a : b; }
static inline int cf_max(int a, int b) { return a > b ? a : b; }

/* Worker ith of nth gets [*lo, *hi) of [0, n), cut at multiples of `align` (the last piece takes
 * the remainder). Contiguous, in order, and a function of (n, ith, nth, align) only: threads
 * that split two loops the same way own the same indices in both, which the engine relies on to
 * skip barriers. 64-bit products, so n * nth cannot overflow. */
static inline void cf_split_range(int n, int ith, int nth, int align, int *lo, int *hi) {
    int units = (n + align - 1) / align;
    int u0 = (int)((int64_t)units * ith / nth), u1 = (int)((int64_t)units * (ith + 1) / nth);
    *lo = cf_min(u0 * align, n);
    *hi = cf_min(u1 * align, n);
}

/* One iteration of a spin-wait: tells the core (and its SMT sibling) that we are waiting. */
static inline void cf_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

/* silu(g) = g * sigmoid(g), the SwiGLU gate; the scalar definition the vector ones match. */
static inline float cf_silu(float g) { return g / (1.0f + expf(-g)); }

/* Monotonic time in nanoseconds (profiling, I/O stall accounting, spin deadlines). */
static inline uint64_t cf_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* printf into a caller's error buffer (err may be NULL: the message is dropped). */
__attribute__((format(printf, 3, 4))) static inline void cf_set_err(char *err, size_t n, const char *fmt, ...) {
    if (!err || !n) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, n, fmt, ap);
    va_end(ap);
}

#endif /* CFLOW_UTIL_H */
