/* engine_profile.c — the engine's profiler: per-thread segment marks (cf_prof_mark, which the
 * interpreter's ph() and sync_threads() call when profiling is on) and the profile API of
 * engine.h (buffers allocated at profile_start, so the per-token path never allocates). */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "engine_internal.h"
#include "util.h"

int64_t cf_prof_mark(cf_engine *e, int ith, int kind, int layer) {
    cf_prof_thread *p = &e->prof[ith];
    int64_t now = (int64_t)cf_now_ns();
    if (p->kind >= 0) {
        if (p->n < e->prof_cap) p->ev[p->n++] = (cf_prof_event){p->last, now, p->kind, p->layer};
        else p->dropped++;
    }
    p->kind = kind;
    if (layer >= 0) p->layer = layer;
    p->last = now;
    return now;
}

int64_t cf_prof_open(cf_engine *e, int ith, int kind, int layer) {
    e->prof[ith].kind = -1;
    return cf_prof_mark(e, ith, kind, layer);
}

/* Upper bound of the events one call records on one thread, from the plan: every phase and
 * barrier an op can pass, with the most experts a batch can route to, each possibly its own wave. */
int cf_engine_profile_events_per_call(const cf_engine *e) {
    int64_t n = 4; /* setup, the join */
    int nx = cf_min(e->c.n_experts, e->c.top_k * e->max_batch);
    for (int i = 0; i < e->n_ops; i++) {
        switch (e->plan[(size_t)i * CF_OP_FIELDS]) {
        case CF_OP_EMBED: n += 2; break;
        case CF_OP_ATTN: n += 12; break;  /* norm, qkv, (wait, qkv), wait, attn, wait, wo, (wait, norm), wait */
        case CF_OP_DENSE: n += 5; break;  /* norm, gate_up, wait, down, wait (post_norms: always) */
        case CF_OP_ROUTE: n += 2; break;
        case CF_OP_EXPERTS: n += 1 + 8 * (int64_t)nx; break; /* io, wave wait, io, gate_up, wait, down, wait */
        case CF_OP_RESID: n += 2; break;
        case CF_OP_FINAL: n += 2; break;
        }
    }
    return n > INT_MAX / 2 ? INT_MAX / 2 : (int)n;
}

void cf_engine_profile_free(cf_engine *e) {
    e->prof_on = 0;
    if (e->prof)
        for (int t = 0; t < e->n_threads; t++) free(e->prof[t].ev);
    free(e->prof);
    free(e->prof_calls);
    e->prof = NULL;
    e->prof_calls = NULL;
    e->prof_cap = e->prof_calls_cap = e->prof_ncalls = 0;
    e->prof_dropped_calls = 0;
}

int cf_engine_profile_start(cf_engine *e, int calls) {
    cf_engine_profile_free(e);
    if (calls < 1) calls = 1;
    int64_t cap = (int64_t)calls * cf_engine_profile_events_per_call(e);
    if (cap > INT_MAX) cap = INT_MAX;
    size_t sz = (size_t)e->n_threads * sizeof(cf_prof_thread);
    e->prof = aligned_alloc(64, (sz + 63) & ~(size_t)63);
    e->prof_calls = calloc((size_t)calls, sizeof(cf_prof_call));
    if (!e->prof || !e->prof_calls) {
        free(e->prof);
        e->prof = NULL;
        cf_engine_profile_free(e);
        return -1;
    }
    memset(e->prof, 0, sz);
    int fail = 0;
    for (int t = 0; t < e->n_threads; t++) {
        e->prof[t].kind = -1;
        /* touched now, so the first events do not fault pages in on the token path */
        e->prof[t].ev = calloc((size_t)cap, sizeof(cf_prof_event));
        if (!e->prof[t].ev) fail = 1;
        else memset(e->prof[t].ev, 0, (size_t)cap * sizeof(cf_prof_event));
    }
    if (fail) {
        cf_engine_profile_free(e);
        return -1;
    }
    e->prof_cap = (int)cap;
    e->prof_calls_cap = calls;
    e->prof_on = 1;
    return 0;
}

void cf_engine_profile_stop(cf_engine *e) { e->prof_on = 0; }
int cf_engine_profiling(const cf_engine *e) { return e->prof_on; }
int cf_engine_profile_events(const cf_engine *e, int ith, const cf_prof_event **out) {
    *out = NULL;
    if (!e->prof || ith < 0 || ith >= e->n_threads) return 0;
    *out = e->prof[ith].ev;
    return e->prof[ith].n;
}
int cf_engine_profile_calls(const cf_engine *e, const cf_prof_call **out) {
    *out = e->prof_calls;
    return e->prof_ncalls;
}
int64_t cf_engine_profile_dropped(const cf_engine *e) {
    int64_t n = e->prof_dropped_calls;
    if (e->prof)
        for (int t = 0; t < e->n_threads; t++) n += e->prof[t].dropped;
    return n;
}
