/* engine_spec.c — the route's side of experts on disk (experts.h): acquiring cache slots in waves,
 * and expert speculation (predicting later layers' experts and starting their reads early).
 * Everything here runs on thread 0, inside the route and experts ops of engine.c. */
#include <stdlib.h>
#include <string.h>

#include "engine_internal.h"
#include "util.h"

// ---------------------------------------------------------------------------------------------
// experts on disk: acquiring cache slots, waves, waiting for bytes

/* Thread 0: pin cache slots for the chosen experts list[i0..) of moe slot ms, at most `max`, and
 * stop at the first that finds no evictable slot; the missing ones are queued for the readers
 * (async) or read here (sync). Returns the index after the last one acquired. */
int cf_acquire_wave(cf_engine *e, int l, int ms, int i0, int max) {
    int set = l % e->c.n_unique;
    cf_state *s = &e->s;
    int E = e->c.n_experts, n = s->exp_cnt[ms], nm = 0, i = i0;
    const int *list = s->exp_list + (size_t)ms * E;
    int *slot = s->exp_slot + (size_t)ms * E;
    for (; i < n && i - i0 < max; i++) {
        int miss, sl = cf_xstore_acquire(e->xs, set * E + list[i], &miss);
        if (sl < 0) break;
        slot[list[i]] = sl;
        e->cnt.n[miss ? CF_CNT_CACHE_MISSES : CF_CNT_CACHE_HITS]++;
        if (miss == 2) e->cnt.n[CF_CNT_SPEC_READS_USED]++; /* read early by speculation */
        if (miss == 1) e->xwave[nm++] = sl;
    }
    if (e->xasync) {
        cf_xstore_submit(e->xs, e->xwave, nm, l);
    } else if (nm) { /* sync: read, then compute; the reading is the stall */
        uint64_t t0 = cf_now_ns();
        for (int j = 0; j < nm; j++) cf_xstore_read_now(e->xs, e->xwave[j]);
        e->cnt.n[CF_CNT_IO_STALL_NS] += cf_now_ns() - t0;
    }
    return i;
}

// ---------------------------------------------------------------------------------------------
// expert speculation: at route(l), predict the experts of layers l+1 .. l+depth and start reads
//
// With delta_expert = 0 (plain Mixtral) experts(l) follows route(l) at once, so a layer's reads
// overlap only each other and that layer's expert compute. Speculation starts later layers' reads
// earlier: right after route(l) has queued its own reads (they go first), thread 0 predicts what
// route(l+k) will choose and queues reads of the predicted experts the cache lacks, which then
// overlap the compute of the layers in between. One expert of a Mixtral-sized model takes about
// ten layers' compute to read from an SSD, so one layer ahead (depth 1, "next-layer") hides little
// of it; a deeper horizon starts each read up to `depth` layers before it is needed.
//
// What is predicted from what: route(l+k) will normalise a residual that does not exist yet. The
// latest vector that does is route(l)'s own input z_l (h_l, or h_l + f_l with moe_input
// post_dense): the prediction is the top_k of softmax(router_{l+k}(rmsnorm(z_l) * moe_norm_{l+k})),
// computed as route does (so two layers sharing a weight set predict exactly what the first chose:
// tested). The residual stream changes little from one layer to the next, so this often picks the
// same experts, and less often the further ahead (measured by the predict counters). With
// B rows, the union of the rows' top_k is predicted, and reads start for the most-voted first.
//
// Which layers each route predicts: the next one (from the freshest input) and the one entering
// the horizon, l + depth (the first route of a call predicts all of 1 .. depth). A layer's marks
// are the union of its predictions; its route scores them (speculation_hits / speculation_predicted:
// the share of predicted experts the layer chose). Two router evaluations per route, whatever the
// depth: a router is E x d floats, and re-predicting every layer in the horizon at every route
// would read depth of them.
//
// Slots: the plan's own pins never exceed min_slots = top_k x layers in flight (engine.h, "the
// plan"), the smallest cache accepted. Speculation gets only the n_slots - min_slots beyond that
// (off when there are none), counted in spec_slot: every slot it pins until the layer it was
// predicted for routes (those it reads, and the predicted experts already cached, so that reads for
// other layers do not evict them first), and every slot whose speculative read is still in flight
// after the pin is gone (a LOADING slot cannot be evicted). So whenever the plan needs a slot
// (each of a route's first top_k, the first of a wave) at most min_slots - 1 of its own pins and
// spec_room other slots are not evictable: the plan's acquires never fail, speculation never waits for a slot and
// never evicts a pinned or loading one; nearer layers are served first, and a horizon that does
// not fit the spare slots is cut short. At route(l) the pins predicted for l are dropped after its
// first wave is pinned: the experts it chose sit in their slots (their acquire counts a cache miss
// and speculation_reads_used), the others stay cached at a low score (their layer never chose them),
// evicted first. Results are bit for bit those without speculation: it only changes which bytes
// are read when.

#define SPEC_MIN_PRECISION 0.9 /* share of a distance's predictions chosen for it to start reads */
#define SPEC_MIN_SAMPLES 32    /* predictions at a distance before the gate judges it */
#define SPEC_WINDOW 512        /* predictions per distance before the counts halve */

/* Thread 0 at route(l): drop the speculative pins predicted for layers up to l; forget the slots
 * that are neither pinned nor loading any more. */
static void spec_release(cf_engine *e, int l) {
    int k = 0;
    for (int i = 0; i < e->spec.n; i++) {
        int sl = e->spec.slot[i], target = e->spec.target[i];
        if (target >= 0 && target <= l) {
            cf_xstore_release(e->xs, sl);
            target = -1;
        }
        if (target >= 0 || cf_xstore_loading(e->xs, sl)) {
            e->spec.slot[k] = sl;
            e->spec.target[k++] = target;
        }
    }
    e->spec.n = k;
}

/* Thread 0, at route(l): how many of the experts predicted for l it chose (cnt: its routing), in
 * all (the counters) and per distance the prediction was made from (the gate, spec_trusted). */
static void spec_score(cf_engine *e, int l, const int *cnt) {
    uint16_t *mark = e->spec.mark + (size_t)l * e->c.n_experts;
    for (int x = 0; x < e->c.n_experts; x++) {
        if (!mark[x]) continue;
        if (cnt[x]) e->cnt.n[CF_CNT_SPEC_HITS]++;
        for (int k = 1; k <= CF_SPEC_MAX_DEPTH; k++)
            if (mark[x] >> (k - 1) & 1) {
                if (++e->spec.dist_pred[k] > SPEC_WINDOW) { /* decay: recent routing counts most */
                    e->spec.dist_pred[k] /= 2;
                    e->spec.dist_hit[k] /= 2;
                }
                e->spec.dist_hit[k] += cnt[x] > 0;
            }
        mark[x] = 0;
    }
}

/* May predictions made k layers ahead start reads? Once SPEC_MIN_SAMPLES predictions at that
 * distance are in, and while at least SPEC_MIN_PRECISION of them were chosen, over the last
 * ~SPEC_WINDOW. A wrong read costs a whole read and evicts a cached expert; a right one only moves a
 * read that would happen anyway earlier, by k layers' compute. One Mixtral-sized expert takes about
 * ten layers' compute to read (engine_spec.c above), so at k = 1 a prediction pays for itself only
 * when it is right about ten times in eleven: the same bar as the deeper distances. Random-weight
 * models pass it (89-99% at k = 1); learned routing mostly does not (48-75%: the trained family's
 * traces, docs/results/routing.md), and reading those predictions read 34-65% more bytes per token
 * (docs/results/delay_window.md). Where routing changes much from layer to layer, deep predictions
 * are often wrong too, and reading them made a 95% cache miss twice as often, plus a wasted read per
 * token (docs/results/moe.md). The gate keeps the predicting (to keep measuring) and stops the
 * reading. CFLOW_SPEC_GATE_NEXT=0 trusts the next layer always (what the engine did before the
 * learned-routing runs; benchmarks compare the two). */
static int spec_trusted(const cf_engine *e, int k) {
    if (k <= 1 && !e->spec.gate_next) return 1;
    if (e->spec.dist_pred[k] < SPEC_MIN_SAMPLES) return 0;
    return (double)e->spec.dist_hit[k] >= e->spec.min_precision * (double)e->spec.dist_pred[k];
}

/* Keep ranks (experts.h): which layers' misses the cache should avoid. Speculation trusted up to
 * d layers ahead (spec_trusted at every distance 1..d) starts the read of a layer l >= d when
 * route(l - d) runs, d layers before it is needed, but the read of a layer l < d only at the
 * call's first route, l layers before: a step's first layers cannot be predicted before the step
 * exists, and layer 0 not at all. So layer l's misses are exposed by max(0, d - l) layers more than
 * the rest; that is its rank, and the cache evicts low ranks first. With uniform routing this moves
 * misses to layers whose reads overlap compute and adds few (+7% in the replay of
 * tests/test_experts_disk.py: the churning last layers lose experts to the misses just before
 * them); with skewed routing it can cost more hits, which a step's first layers then do not stall
 * on. Off without speculation (sync reads hide nothing), while not even the next layer is trusted
 * (d = 0: every rank 0), or with CFLOW_EXPERT_KEEP=0 (benchmarks:
 * the policy alone). Measured: docs/results/moe.md. */
static void keep_ranks(cf_engine *e) {
    if (!e->spec.keep) return;
    int d = 0;
    while (d < e->spec.depth && spec_trusted(e, d + 1)) d++;
    if (d == e->spec.keep_depth) return;
    e->spec.keep_depth = d;
    for (int set = 0; set < e->c.n_unique; set++) /* a shared set is first used by layer `set` */
        cf_xstore_keep(e->xs, set, cf_max(0, d - set));
}

/* Thread 0, when a call starts: cf_xstore_begin dropped every pin (a failed call may have left
 * some); reads still in flight stay counted until they land. */
void cf_spec_begin(cf_engine *e) {
    if (!e->spec.depth) return;
    for (int i = 0; i < e->spec.n; i++) e->spec.target[i] = -1;
    e->spec.horizon = -1;
    memset(e->spec.mark, 0, (size_t)e->c.n_layers * e->c.n_experts * sizeof *e->spec.mark);
    keep_ranks(e);
}

/* Thread 0: pin a cached (or loading) slot predicted for layer target, so no other read evicts it
 * before target routes; a slot speculation holds already keeps its pin until the later layer. */
static void spec_hold(cf_engine *e, int sl, int target) {
    for (int i = 0; i < e->spec.n; i++)
        if (e->spec.slot[i] == sl) {
            if (e->spec.target[i] < 0) cf_xstore_pin(e->xs, sl); /* a read landing after its pin was dropped */
            e->spec.target[i] = cf_max(e->spec.target[i], target);
            return;
        }
    cf_xstore_pin(e->xs, sl);
    e->spec.slot[e->spec.n] = sl;
    e->spec.target[e->spec.n++] = target;
}

/* Thread 0, once route(l) is done (its scratch is free): what speculation predicts row b's route of
 * layer `target` will choose, from route(l)'s input: the top_k of
 * softmax(router_target(rmsnorm(z_l) * moe_norm_target)), as route computes it. */
void cf_predict_route(cf_engine *e, int b, int target, int src_kind, int *chosen) {
    const cf_config *c = &e->c;
    cf_state *s = &e->s;
    int E = c->n_experts, d = c->d;
    const cf_layer *w = &e->w.sets[target % c->n_unique];
    float *z = e->ts[0].xb, *zn = z + e->kmax, *pr = s->rlogits, val[64];
    const float *hb = s->h + (size_t)b * d;
    for (int i = 0; i < d; i++) z[i] = hb[i] + (src_kind == CF_SRC_HF ? s->f[(size_t)b * d + i] : 0.0f);
    e->k->rmsnorm(zn, z, w->moe_norm, d, c->norm_eps);
    e->k->matvec_f32(pr, w->router, zn, E, d);
    if (w->router_bias) /* gpt-oss: the choice is the top_k of the biased logits (softmax keeps the order) */
        for (int x = 0; x < E; x++) pr[x] += w->router_bias[x];
    e->k->softmax(pr, E);
    e->k->topk(pr, E, c->top_k, chosen, val);
}

/* Thread 0, after route(l)'s own reads are queued: predict route(target) from route(l)'s input
 * (or take the replayed trace's prediction) and start the reads of predicted experts nobody has
 * cached or is reading. */
static void spec_predict(cf_engine *e, int l, int target, int src_kind) {
    int k_ahead = target - l, trusted = spec_trusted(e, k_ahead);
    const cf_config *c = &e->c;
    int E = c->n_experts, set = target % c->n_unique, most = 0, nm = 0;
    int *votes = e->spec.votes, chosen[64];
    uint16_t *mark = e->spec.mark + (size_t)target * E;
    memset(votes, 0, (size_t)E * sizeof *votes);
    for (int b = 0; b < e->B; b++) {
        const int32_t *rp = e->routes.mode == CF_ROUTES_REPLAY ? cf_routes_pred(e, b, l) : NULL;
        if (rp)
            for (int k = 0; k < c->top_k; k++) chosen[k] = rp[(size_t)(k_ahead - 1) * c->top_k + k];
        else
            cf_predict_route(e, b, target, src_kind, chosen);
        for (int k = 0; k < c->top_k; k++) most = cf_max(most, ++votes[chosen[k]]);
    }
    for (int x = 0; x < E; x++)
        if (votes[x] > 0) {
            if (!mark[x]) e->cnt.n[CF_CNT_SPEC_PREDICTED]++;
            mark[x] |= (uint16_t)(1u << (k_ahead - 1));
        }
    if (!trusted) return;
    for (int v = most; v > 0 && e->spec.n < e->spec.room; v--)
        for (int x = 0; x < E && e->spec.n < e->spec.room; x++) {
            if (votes[x] != v) continue;
            int sl = cf_xstore_lookup(e->xs, set * E + x);
            if (sl >= 0) { /* cached or coming: keep it until target routes */
                spec_hold(e, sl, target);
                continue;
            }
            if ((sl = cf_xstore_speculate(e->xs, set * E + x)) < 0) { /* cannot happen within spec_room */
                v = 0;
                break;
            }
            e->spec.slot[e->spec.n] = sl;
            e->spec.target[e->spec.n++] = target;
            e->xwave[nm++] = sl;
        }
    e->cnt.n[CF_CNT_SPEC_READS] += (uint64_t)nm;
    cf_xstore_submit(e->xs, e->xwave, nm, target);
}

/* Thread 0 at route(l): the next layer, then those entering the horizon (spec_horizon: the
 * furthest layer predicted in this call; at its first route, all of l+2 .. l+depth). */
static void spec_ahead(cf_engine *e, int l, int src_kind) {
    int last = cf_min(l + e->spec.depth, e->c.n_layers - 1);
    if (l + 1 > last) return;
    spec_predict(e, l, l + 1, src_kind);
    for (int t = cf_max(e->spec.horizon + 1, l + 2); t <= last; t++) spec_predict(e, l, t, src_kind);
    e->spec.horizon = cf_max(e->spec.horizon, last);
}

/* Thread 0, after the route of layer l into moe slot ms: list the chosen experts in ascending order
 * (the order their outputs are summed in RAM too, so results are bit for bit the same) and, with
 * async I/O, pin and start reading up to top_k of them now: their bytes arrive while the layers up
 * to the experts op run. top_k per layer in flight is what the smallest cache guarantees; a batch
 * that routes to more experts reads the rest in waves (op_experts_disk). With speculation, then
 * predict layer l+1 (above). */
void cf_route_disk(cf_engine *e, int l, int ms, int src_kind) {
    cf_state *s = &e->s;
    int E = e->c.n_experts, n = 0;
    const int *cnt = s->exp_n + (size_t)ms * E;
    int *list = s->exp_list + (size_t)ms * E;
    for (int x = 0; x < E; x++)
        if (cnt[x]) list[n++] = x;
    s->exp_cnt[ms] = n;
    cf_xstore_visit(e->xs, l % e->c.n_unique, list, n);
    s->exp_pre[ms] = e->xasync ? cf_acquire_wave(e, l, ms, 0, e->c.top_k) : 0;
    if (!e->spec.depth) return;
    spec_score(e, l, cnt);
    spec_release(e, l); /* after the first wave: the chosen ones are pinned by it now */
    spec_ahead(e, l, src_kind);
}

/* After the cache is open: speculation needs reads that run beside compute, and slots beyond the
 * plan's own (min_slots); without them it stays off. */
int cf_spec_open(cf_engine *e, int depth, char *err, size_t n) {
    const cf_config *c = &e->c;
    cf_xstore_info xi;
    cf_xstore_get_info(e->xs, &xi);
    int min_slots = cf_expert_min_slots(c->top_k, e->inflight);
    if (depth <= 0 || !e->xasync || xi.n_slots <= min_slots) return 0;
    cf_spec *sp = &e->spec;
    sp->room = xi.n_slots - min_slots;
    sp->slot = calloc((size_t)sp->room, sizeof *sp->slot);
    sp->target = calloc((size_t)sp->room, sizeof *sp->target);
    sp->mark = calloc((size_t)c->n_layers * c->n_experts, sizeof *sp->mark);
    sp->votes = calloc((size_t)c->n_experts, sizeof *sp->votes);
    if (!sp->slot || !sp->target || !sp->mark || !sp->votes) return cf_set_err(err, n, "out of memory"), -1;
    sp->depth = cf_min(depth, CF_SPEC_MAX_DEPTH);
    const char *mp = getenv("CFLOW_SPEC_MIN_PRECISION"); /* 0: every distance reads; > 1: only the next layer */
    sp->min_precision = mp && *mp ? atof(mp) : SPEC_MIN_PRECISION;
    const char *gn = getenv("CFLOW_SPEC_GATE_NEXT");
    sp->gate_next = !(gn && *gn == '0');
    sp->horizon = -1;
    const char *kp = getenv("CFLOW_EXPERT_KEEP"); /* 0: the policy without keep ranks */
    sp->keep = !(kp && *kp == '0');
    sp->keep_depth = -1;
    return 0;
}

void cf_spec_free(cf_spec *sp) {
    free(sp->slot);
    free(sp->target);
    free(sp->mark);
    free(sp->votes);
    memset(sp, 0, sizeof *sp);
}
