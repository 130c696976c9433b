/* experts.c — the expert cache and its readers (experts.h has the design).
 *
 * Eviction: recency-weighted frequency on each layer's own clock ("layer LRFU"). Every expert has
 * a score; each time a layer routes (cf_xstore_visit), the scores of that layer's E experts halve
 * and the chosen ones gain CF_XVISIT_SCORE (experts.h). So a score is sum over the layer's past
 * routings of 2^-(routings since), counted for the routings that chose it: an expert its layer
 * chose last time outranks every expert it did not (>= 1 against < 1), and among those, use
 * further back breaks the tie. The victim is the lowest score, ties broken by global recency.
 *
 * Why the layer's clock and not a global one: a decode step visits the layers in a cycle, so
 * between two uses of layer l's experts every other layer's are touched once. Plain LRU (global
 * clock) then evicts exactly what the cycle needs next whenever the cache holds less than one
 * token's experts (hit rate 0), and a global LFU misses that routing persists from token to token.
 * Measured on a routing trace of the built-in model (tests/cachesim.py simulate replays a
 * trace through this policy, LRU, a global LFU and Belady's optimum): equal to or above LRU at
 * every budget, and well above it below one token's experts.
 *
 * A victim is the first EMPTY (or FAILED) slot, else the unpinned READY slot with the lowest
 * (keep rank of its weight set, score, last use). Finding it scans the slots: O(n_slots) per miss,
 * next to a read of megabytes that is nothing.
 *
 * Keep ranks (cf_xstore_keep; all 0 unless the engine sets them) say which layers' misses cost
 * most: with async reads and speculation trusted d layers ahead, a miss of layer l >= d is read
 * while d layers compute, but one of layer l < d only while l do (a step's first layers cannot be
 * predicted before the step exists), and layer 0's never. The engine ranks set l by d - l, so the
 * cache keeps a step's first layers and lets the misses fall where their reads hide (engine_spec.c,
 * "keep ranks"). With uniform routing this changes mostly which experts miss, not how many (a few
 * % more: docs/DESIGN.md).
 */
#define _GNU_SOURCE
#include "experts.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cflow.h"
#include "uring.h"
#include "util.h"

#define WAIT_SPIN 256  /* pause iterations (a few us) before a waiter sleeps: reads take longer */

enum { XS_EMPTY, XS_LOADING, XS_READY, XS_FAILED };

typedef struct {
    /* the word waiters sleep on, alone on its cache line: readers write it, every thread polls it */
    _Alignas(64) _Atomic uint32_t state;
    _Atomic uint32_t waiters; /* threads asleep on state (or about to be) */
    int key;                  /* -1: none */
    int pins;                 /* in-flight layers that need it (thread 0 only) */
    int spec;                 /* 1: filled by a speculative read that no acquire has used yet */
    uint64_t last_use;        /* tick of the last acquire */
    /* the last read's outcome, written by the reader before state */
    int err_no; /* errno; 0 with got < want: a short read */
    int64_t got, want;
    int fault;  /* io_uring: the injected fault its submission drew (CF_XFAULT_*) */
    uint8_t *data;
} xslot;

struct cf_xstore {
    char *path;
    int fd, direct, async, n_keys, n_experts;
    int64_t *off, *len; /* [n_keys] span offset, read length (nbytes rounded up to 4096) */
    int *slot_of;       /* [n_keys] slot holding the key, -1 */
    uint32_t *score;    /* [n_keys] recency-weighted use, on the layer's clock (cf_xstore_visit) */
    uint8_t *keep;      /* [n_keys / n_experts] eviction rank of each weight set: lower goes first */
    xslot *slots;
    int n_slots;
    size_t slot_bytes, mem_bytes;
    uint8_t *mem;
    uint64_t tick;
    off_t size0; /* the file as loaded: a change means it was rewritten under us */
    struct timespec mtime0;
    /* readers */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int *queue, q_head, q_len, stop;
    pthread_t *io;
    int n_io;
    pid_t pid;       /* the process the readers run in */
    /* io_uring (uring = 1) instead of the pread threads: thread 0 queues reads under ring_mu, one
     * reaper thread takes the completions and publishes them as a reader thread would */
    int uring, reaper_on, ring_broken;
    cf_uring ring;
    pthread_mutex_t ring_mu;
    pthread_t reaper;
    _Atomic int ring_inflight, ring_stop;
    /* reads waiting for the kernel (under ring_mu): at most ring_cap are in the kernel at once, the
     * rest wait here and go in order of need (the layer they are for, then arrival) as reads land */
    int *pend_slot, *pend_need, n_pend, ring_issued, ring_cap;
    int *sub_late, *reap_late; /* [n_slots + 1] reads a refusing ring left: thread 0's, the reaper's */
    char note[160]; /* why the readers are threads where io_uring was wanted ("" otherwise) */
    int inline_io;   /* 1: no readers here (a forked child): submit reads in the caller */
    _Atomic uint64_t bytes_read;
    _Atomic int64_t reads, fault_at;
    _Atomic int fault_kind, fault_delay_us;
};

const char *const cf_xfault_names[CF_XFAULT_KINDS] = {
    [CF_XFAULT_NONE] = "none", [CF_XFAULT_EIO] = "eio", [CF_XFAULT_SHORT] = "short",
};
const char *const cf_xreader_names[CF_XREADER_KINDS] = {
    [CF_XREADER_AUTO] = "auto", [CF_XREADER_THREADS] = "threads", [CF_XREADER_URING_REFUSED] = "uring-refused",
    [CF_XREADER_INLINE] = "inline",
};

static int64_t round_up(int64_t n) { return (n + CF_XALIGN - 1) / CF_XALIGN * CF_XALIGN; }

// ---------------------------------------------------------------------------------------------
// reading one expert

/* The injected fault the read starting now draws (test-only; CF_XFAULT_NONE almost always). */
static int draw_fault(cf_xstore *xs) {
    if (atomic_fetch_add(&xs->reads, 1) != atomic_load(&xs->fault_at)) return CF_XFAULT_NONE;
    return atomic_exchange(&xs->fault_kind, CF_XFAULT_NONE);
}

static int64_t fault_limit(int fault, int64_t want) {
    return fault == CF_XFAULT_SHORT ? want / 2 / CF_XALIGN * CF_XALIGN : want;
}

/* pread slot's bytes [*got, limit) of the span at off, until done, an error (returned) or the end
 * of the file. */
static int read_rest(const cf_xstore *xs, uint8_t *buf, int64_t off, int64_t limit, int64_t *got) {
    while (*got < limit) {
        ssize_t r = pread(xs->fd, buf + *got, (size_t)(limit - *got), off + *got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return errno;
        if (r == 0) break; /* end of file: the file shrank */
        *got += r;
        if (xs->direct && r % CF_XALIGN) break; /* O_DIRECT stops at EOF mid-block */
    }
    return 0;
}

/* The outcome of slot's read: through state, waking whoever sleeps on it. */
static void publish(cf_xstore *xs, int slot, int err, int64_t got) {
    xslot *s = &xs->slots[slot];
    int64_t off = xs->off[s->key], want = xs->len[s->key];
    /* buffered reads leave pages in the page cache: drop them, the cache slot is the copy */
    if (!xs->direct) posix_fadvise(xs->fd, off, want, POSIX_FADV_DONTNEED);
    atomic_fetch_add(&xs->bytes_read, (uint64_t)got);
    s->err_no = err;
    s->got = got;
    s->want = want;
    /* seq_cst store then load, against the waiter's seq_cst increment then futex check: either
     * we see the waiter and wake it, or its futex_wait sees the new state and returns */
    atomic_store(&s->state, err || got != want ? XS_FAILED : XS_READY);
    if (atomic_load(&s->waiters)) cf_word_wake(&s->state, INT_MAX);
}

/* Read slot's span: the whole rounded length or fail. Any thread (a reader, or thread 0 in sync
 * mode). */
static void do_read(cf_xstore *xs, int slot) {
    xslot *s = &xs->slots[slot];
    int key = s->key; /* set before the slot was queued; the queue's mutex orders it */
    int64_t got = 0;
    int err = 0, fault = draw_fault(xs);
    if (fault && atomic_load(&xs->fault_delay_us)) usleep((useconds_t)atomic_load(&xs->fault_delay_us));
    if (fault == CF_XFAULT_EIO) err = EIO;
    else err = read_rest(xs, s->data, xs->off[key], fault_limit(fault, xs->len[key]), &got);
    publish(xs, slot, err, got);
}

// ---------------------------------------------------------------------------------------------
// io_uring: thread 0 queues, the reaper publishes

#define RING_STOP UINT64_MAX /* the no-op that wakes the reaper to stop */

#define REAPER_TICK_NS 20000000 /* the reaper looks at ring_stop at least this often */
#define RING_CAP 2 /* expert reads in the kernel at once (CFLOW_EXPERT_QD overrides) */

/* Hand pending reads to the kernel, most needed first, while fewer than ring_cap are in it (under
 * ring_mu; thread 0 after queueing, the reaper after a read lands), or the stop token
 * (cf_xstore_free, stop = 1). An injected fault is drawn here, in issue order: an I/O error reads
 * nothing (a no-op), a short read asks for half. The submission queue holds n_slots + 1 entries,
 * more than can be pending, so it never fills. Should the kernel refuse to take them (never
 * seen), the ring is left alone from then on: the reads it did not take go into `late`, which the
 * caller does after unlocking (*n_late of them). Why a cap: reads issued together share the
 * device, so one needed now would land only when all of them do; speculation queues reads for up
 * to 16 layers ahead, and without the cap the next layer's read waited for all of them (measured:
 * docs/results/moe.md, "async vs sync"). */
static void ring_dispatch_locked(cf_xstore *xs, int stop, int *late, int *n_late) {
    int issued[64], n = 0;
    while (xs->n_pend > 0 && xs->ring_issued < xs->ring_cap && n < 64) {
        int best = 0;
        for (int i = 1; i < xs->n_pend; i++)
            if (xs->pend_need[i] < xs->pend_need[best]) best = i;
        int slot = xs->pend_slot[best];
        for (int i = best + 1; i < xs->n_pend; i++) { /* keep arrival order among equals */
            xs->pend_slot[i - 1] = xs->pend_slot[i];
            xs->pend_need[i - 1] = xs->pend_need[i];
        }
        xs->n_pend--;
        xslot *s = &xs->slots[slot];
        s->fault = draw_fault(xs);
        unsigned len = (unsigned)(s->fault == CF_XFAULT_EIO ? 0 : fault_limit(s->fault, xs->len[s->key]));
        xs->ring_issued++;
        cf_uring_read(&xs->ring, xs->fd, s->data, len, (uint64_t)xs->off[s->key], (uint64_t)slot);
        issued[n++] = slot;
    }
    if (stop) cf_uring_read(&xs->ring, -1, NULL, 0, 0, RING_STOP);
    if (!n && !stop) return;
    int left = cf_uring_submit(&xs->ring), unsent = left - stop; /* the token is queued last */
    if (left) {
        xs->ring_broken = 1;
        xs->inline_io = 1;
        /* the kernel never saw these, nor will it see what is pending: the caller reads them */
        for (int i = n - (unsent > 0 ? unsent : 0); i < n; i++) late[(*n_late)++] = issued[i];
        xs->ring_issued -= unsent > 0 ? unsent : 0;
        for (int i = 0; i < xs->n_pend; i++) late[(*n_late)++] = xs->pend_slot[i];
        xs->n_pend = 0;
    }
}

/* Reads the ring could not take: in the calling thread (nothing else writes their slots). */
static void read_late(cf_xstore *xs, const int *late, int n_late) {
    for (int i = 0; i < n_late; i++) {
        atomic_fetch_sub(&xs->ring_inflight, 1);
        do_read(xs, late[i]);
    }
}

/* Thread 0: queue the reads of slots[0..n), needed by layer `need` (smaller: sooner), and issue what
 * the cap allows; or (stop = 1, cf_xstore_free) the stop token. ring_inflight counts queued and
 * issued reads until they land: cf_xstore_free waits for 0. */
static void ring_queue(cf_xstore *xs, const int *slots, int n, int need, int stop) {
    int n_late = 0;
    pthread_mutex_lock(&xs->ring_mu);
    for (int i = 0; i < n; i++) { /* never full: a slot is queued at most once (it is LOADING) */
        xs->pend_slot[xs->n_pend] = slots[i];
        xs->pend_need[xs->n_pend++] = need;
        atomic_fetch_add(&xs->ring_inflight, 1);
    }
    ring_dispatch_locked(xs, stop, xs->sub_late, &n_late);
    pthread_mutex_unlock(&xs->ring_mu);
    read_late(xs, xs->sub_late, n_late);
}

/* The reaper: slot's read completed with res (bytes, or -errno). */
static void ring_done(cf_xstore *xs, int slot, int32_t res) {
    xslot *s = &xs->slots[slot];
    int64_t limit = fault_limit(s->fault, xs->len[s->key]), got = res > 0 ? res : 0;
    int err = res < 0 ? -res : 0;
    if (s->fault && atomic_load(&xs->fault_delay_us)) usleep((useconds_t)atomic_load(&xs->fault_delay_us));
    if (s->fault == CF_XFAULT_EIO) err = EIO;
    else if (!err && got > 0 && got < limit && !(xs->direct && got % CF_XALIGN)) /* stopped early: finish */
        err = read_rest(xs, s->data, xs->off[s->key], limit, &got);
    publish(xs, slot, err, got);
    int n_late = 0;
    pthread_mutex_lock(&xs->ring_mu);
    xs->ring_issued--;
    if (!xs->ring_broken) ring_dispatch_locked(xs, 0, xs->reap_late, &n_late);
    pthread_mutex_unlock(&xs->ring_mu);
    read_late(xs, xs->reap_late, n_late);
    atomic_fetch_sub(&xs->ring_inflight, 1); /* after publishing: cf_xstore_free waits for 0 */
}

static void *reaper_main(void *arg) {
    cf_xstore *xs = arg;
    for (;;) {
        uint64_t user;
        int32_t res;
        while (cf_uring_next(&xs->ring, &user, &res))
            if (user != RING_STOP) ring_done(xs, (int)user, res);
        if (atomic_load(&xs->ring_stop) && atomic_load(&xs->ring_inflight) == 0) return NULL;
        if (cf_uring_wait(&xs->ring, REAPER_TICK_NS) < 0) usleep(REAPER_TICK_NS / 1000); /* poll instead */
    }
}

/* Readers on io_uring, if the kernel offers it and one real read through it works; else -1 and
 * the reason in xs->note (the caller starts pread threads). */
static int open_ring(cf_xstore *xs, int refuse) {
    char why[128];
    if (xs->n_slots + 1 > 32768) {
        snprintf(xs->note, sizeof xs->note, "io_uring not used (more than 32767 slots): pread threads");
        return -1;
    }
    if (cf_uring_open(&xs->ring, (unsigned)xs->n_slots + 1, refuse, why, sizeof why)) {
        snprintf(xs->note, sizeof xs->note, "io_uring unavailable (%s): pread threads", why);
        return -1;
    }
    /* a kernel may set the ring up and still refuse the read (IORING_OP_READ is Linux 5.6) */
    int32_t res = -ETIMEDOUT;
    uint64_t user;
    cf_uring_read(&xs->ring, xs->fd, xs->mem, CF_XALIGN, (uint64_t)xs->off[0], 0);
    if (cf_uring_submit(&xs->ring) == 0)
        for (int t = 0; t < 250 && !cf_uring_next(&xs->ring, &user, &res); t++) cf_uring_wait(&xs->ring, REAPER_TICK_NS);
    madvise(xs->mem, CF_XALIGN, MADV_DONTNEED);
    if (res <= 0) {
        snprintf(xs->note, sizeof xs->note, "io_uring read failed (%s): pread threads",
                 strerror(res < 0 ? -res : EIO));
        cf_uring_close(&xs->ring);
        return -1;
    }
    if (pthread_create(&xs->reaper, NULL, reaper_main, xs) != 0) {
        snprintf(xs->note, sizeof xs->note, "cannot start the io_uring reaper thread: pread threads");
        cf_uring_close(&xs->ring);
        return -1;
    }
    xs->reaper_on = xs->uring = 1;
    return 0;
}

static void *reader_main(void *arg) {
    cf_xstore *xs = arg;
    for (;;) {
        pthread_mutex_lock(&xs->mu);
        while (!xs->q_len && !xs->stop) pthread_cond_wait(&xs->cv, &xs->mu);
        if (!xs->q_len) { /* stop, and nothing left to read */
            pthread_mutex_unlock(&xs->mu);
            return NULL;
        }
        int slot = xs->queue[xs->q_head];
        xs->q_head = (xs->q_head + 1) % xs->n_slots;
        xs->q_len--;
        pthread_mutex_unlock(&xs->mu);
        do_read(xs, slot);
    }
}

// ---------------------------------------------------------------------------------------------
// the cache (thread 0)

static int pick_victim(const cf_xstore *xs) {
    int best = -1;
    for (int i = 0; i < xs->n_slots; i++) {
        const xslot *v = &xs->slots[i];
        uint32_t st = atomic_load_explicit(&v->state, memory_order_relaxed);
        if (v->pins || st == XS_LOADING) continue;
        if (v->key < 0 || st == XS_FAILED) return i;
        if (best < 0) {
            best = i;
            continue;
        }
        const xslot *b = &xs->slots[best];
        int kv = xs->keep[v->key / xs->n_experts], kb = xs->keep[b->key / xs->n_experts];
        if (kv != kb) {
            if (kv < kb) best = i;
        } else if (xs->score[v->key] < xs->score[b->key] ||
                   (xs->score[v->key] == xs->score[b->key] && v->last_use < b->last_use)) {
            best = i;
        }
    }
    return best;
}

/* Evict the victim and hand its slot to key, LOADING; -1 when every slot is pinned or loading. */
static int claim(cf_xstore *xs, int key, int spec) {
    int s = pick_victim(xs);
    if (s < 0) return -1;
    xslot *v = &xs->slots[s];
    if (v->key >= 0) xs->slot_of[v->key] = -1;
    v->key = key;
    v->spec = spec;
    xs->slot_of[key] = s;
    atomic_store_explicit(&v->state, XS_LOADING, memory_order_relaxed);
    return s;
}

int cf_xstore_acquire(cf_xstore *xs, int key, int *miss) {
    int s = xs->slot_of[key];
    *miss = 0;
    if (s < 0) {
        if ((s = claim(xs, key, 0)) < 0) return -1;
        *miss = 1;
    } else if (xs->slots[s].spec) {
        xs->slots[s].spec = 0;
        *miss = 2;
    }
    xs->slots[s].last_use = ++xs->tick;
    xs->slots[s].pins++;
    return s;
}

int cf_xstore_lookup(const cf_xstore *xs, int key) { return xs->slot_of[key]; }

int cf_xstore_speculate(cf_xstore *xs, int key) {
    if (xs->slot_of[key] >= 0) return -1;
    int s = claim(xs, key, 1);
    if (s < 0) return -1;
    xs->slots[s].last_use = ++xs->tick;
    xs->slots[s].pins++;
    return s;
}

void cf_xstore_pin(cf_xstore *xs, int slot) { xs->slots[slot].pins++; }

int cf_xstore_loading(const cf_xstore *xs, int slot) {
    return atomic_load_explicit(&((xslot *)&xs->slots[slot])->state, memory_order_relaxed) == XS_LOADING;
}

void cf_xstore_visit(cf_xstore *xs, int set, const int *chosen, int n) {
    uint32_t *sc = xs->score + (size_t)set * xs->n_experts;
    for (int x = 0; x < xs->n_experts; x++) sc[x] >>= 1;
    for (int i = 0; i < n; i++) sc[chosen[i]] += CF_XVISIT_SCORE; /* < 2 x CF_XVISIT_SCORE: no overflow */
}

void cf_xstore_keep(cf_xstore *xs, int set, int rank) {
    if (set >= 0 && set < xs->n_keys / xs->n_experts) xs->keep[set] = (uint8_t)cf_max(0, cf_min(rank, 255));
}

void cf_xstore_release(cf_xstore *xs, int slot) {
    if (xs->slots[slot].pins > 0) xs->slots[slot].pins--;
}

void cf_xstore_submit(cf_xstore *xs, const int *slots, int n, int need) {
    if (n <= 0) return;
    if (xs->inline_io) {
        for (int i = 0; i < n; i++) do_read(xs, slots[i]);
        return;
    }
    if (xs->uring) {
        ring_queue(xs, slots, n, need, 0);
        return;
    }
    pthread_mutex_lock(&xs->mu);
    for (int i = 0; i < n; i++) /* never full: a slot is queued at most once (it is LOADING) */
        xs->queue[(xs->q_head + xs->q_len++) % xs->n_slots] = slots[i];
    pthread_mutex_unlock(&xs->mu);
    if (n == 1) pthread_cond_signal(&xs->cv);
    else pthread_cond_broadcast(&xs->cv);
}

void cf_xstore_read_now(cf_xstore *xs, int slot) { do_read(xs, slot); }

int cf_xstore_wait(cf_xstore *xs, int slot, uint64_t *stall_ns) {
    xslot *s = &xs->slots[slot];
    uint32_t st = atomic_load_explicit(&s->state, memory_order_acquire);
    if (st != XS_LOADING) return st == XS_READY ? 0 : -1;
    uint64_t t0 = stall_ns ? cf_now_ns() : 0;
    cf_word_wait_spin(&s->state, XS_LOADING, WAIT_SPIN, &s->waiters);
    st = atomic_load_explicit(&s->state, memory_order_acquire);
    if (stall_ns) *stall_ns += cf_now_ns() - t0;
    return st == XS_READY ? 0 : -1;
}

const uint8_t *cf_xstore_data(const cf_xstore *xs, int slot) { return xs->slots[slot].data; }

int cf_xstore_begin(cf_xstore *xs, char *err, size_t n) {
    /* A forked child has none of the readers (threads do not survive fork, and one may have held
     * the queue's lock): it reads in the calling thread, and reads the parent had in flight will
     * never land here. */
    int forked = xs->async && !xs->inline_io && getpid() != xs->pid;
    if (forked) xs->inline_io = 1;
    for (int i = 0; i < xs->n_slots; i++) {
        xslot *s = &xs->slots[i];
        /* A pinned read in flight was left by a failed call: let it land, so the call starts
         * with every pinned slot settled. An unpinned one is a speculative read nobody needed:
         * it cannot be evicted while LOADING, so it may land whenever (no call waits for it). */
        if (atomic_load(&s->state) == XS_LOADING) {
            if (forked) atomic_store(&s->state, XS_FAILED); /* its reader is in the parent */
            else if (xs->async && s->pins) cf_xstore_wait(xs, i, NULL);
            else if (!xs->async) atomic_store(&s->state, XS_FAILED); /* acquired, never read */
        }
        s->pins = 0;
        if (atomic_load(&s->state) == XS_FAILED) {
            if (s->key >= 0) xs->slot_of[s->key] = -1;
            s->key = -1;
            s->spec = 0;
            atomic_store(&s->state, XS_EMPTY);
        }
    }
    struct stat st;
    if (fstat(xs->fd, &st) != 0) {
        cf_set_err(err, n, "cannot stat %s: %s", xs->path, strerror(errno));
        return -1;
    }
    if (st.st_size != xs->size0 || st.st_mtim.tv_sec != xs->mtime0.tv_sec ||
        st.st_mtim.tv_nsec != xs->mtime0.tv_nsec) {
        cf_set_err(err, n, "%s changed on disk since it was loaded (%lld bytes then, %lld now); its experts "
                "can no longer be read consistently: load the model again", xs->path, (long long)xs->size0,
                (long long)st.st_size);
        return -1;
    }
    return 0;
}

void cf_xstore_error(const cf_xstore *xs, int slot, char *out, size_t n) {
    const xslot *s = &xs->slots[slot];
    int key = s->key;
    int set = key / xs->n_experts, e = key % xs->n_experts;
    long long off = (long long)xs->off[key];
    if (s->err_no)
        cf_set_err(out, n, "reading expert %d of layer %d (%lld bytes at offset %lld) from %s failed: %s", e,
                set, (long long)s->want, off, xs->path, strerror(s->err_no));
    else
        cf_set_err(out, n, "reading expert %d of layer %d from %s returned %lld of %lld bytes at offset %lld: "
                "the file is shorter than when it was loaded (truncated or rewritten while running?); "
                "load the model again", e, set, xs->path, (long long)s->got, (long long)s->want, off);
}

void cf_xstore_get_info(const cf_xstore *xs, cf_xstore_info *out) {
    *out = (cf_xstore_info){.n_slots = xs->n_slots, .async = xs->async, .n_io = xs->uring ? 1 : xs->n_io,
                            .direct = xs->direct, .uring = xs->uring && !xs->ring_broken, .note = xs->note,
                            .slot_bytes = (int64_t)xs->slot_bytes, .cache_bytes = (int64_t)xs->mem_bytes};
}

uint64_t cf_xstore_bytes_read(const cf_xstore *xs) {
    return atomic_load(&((cf_xstore *)xs)->bytes_read);
}

int cf_xstore_resident(const cf_xstore *xs, int *keys) {
    int n = 0;
    for (int i = 0; i < xs->n_slots; i++)
        if (atomic_load(&((xslot *)&xs->slots[i])->state) == XS_READY) keys[n++] = xs->slots[i].key;
    return n;
}

void cf_xstore_inject_fault(cf_xstore *xs, int64_t after, int kind, int delay_us) {
    atomic_store(&xs->fault_delay_us, delay_us < 0 ? 0 : delay_us);
    atomic_store(&xs->fault_kind, kind);
    atomic_store(&xs->fault_at, kind == CF_XFAULT_NONE ? -1 : atomic_load(&xs->reads) + after);
}

// ---------------------------------------------------------------------------------------------
// open / free

/* Is O_DIRECT usable on this file? One aligned read answers it: some filesystems accept the
 * flag at open and refuse the reads (EINVAL). */
static int probe_direct(int fd, uint8_t *buf, int64_t off) {
    ssize_t r;
    do r = pread(fd, buf, CF_XALIGN, off);
    while (r < 0 && errno == EINTR);
    return r < 0 ? -errno : 0;
}

cf_xstore *cf_xstore_open(const cf_xstore_opts *o, char *err, size_t n) {
    if (o->n_keys < 1 || o->n_experts < 1 || o->budget < 0 || o->min_slots < 1) {
        cf_set_err(err, n, "bad expert store options");
        return NULL;
    }
    int64_t largest = 0;
    for (int k = 0; k < o->n_keys; k++) {
        /* an empty span: a key of a layer without experts (DeepSeek's leading dense layers), never read */
        if (o->offset[k] < 0 || o->offset[k] % CF_XALIGN || o->nbytes[k] < 0) {
            cf_set_err(err, n, "expert %d of layer %d has span (%lld, %lld bytes); expert spans must start on "
                    "a 4096-byte boundary (re-convert the model)", k % o->n_experts, k / o->n_experts,
                    (long long)o->offset[k], (long long)o->nbytes[k]);
            return NULL;
        }
        if (o->nbytes[k] > largest) largest = o->nbytes[k];
    }
    int64_t slot_bytes = round_up(largest), slots = o->budget / slot_bytes;
    if (slots > o->n_keys) slots = o->n_keys; /* room for every expert: more would stay empty */
    if (slots < o->min_slots) {
        cf_set_err(err, n, "an expert cache of %lld bytes holds %lld experts of %lld bytes; this model needs at "
                "least %d (top_k x layers in flight), %lld bytes: raise the expert cache budget", (long long)o->budget,
                (long long)slots, (long long)slot_bytes, o->min_slots, (long long)o->min_slots * slot_bytes);
        return NULL;
    }
    cf_xstore *xs = calloc(1, sizeof *xs);
    if (!xs) return cf_set_err(err, n, "out of memory"), NULL;
    xs->fd = -1;
    xs->ring.fd = -1;
    xs->mem = MAP_FAILED;
    xs->n_keys = o->n_keys;
    xs->n_experts = o->n_experts;
    xs->n_slots = (int)slots;
    xs->slot_bytes = (size_t)slot_bytes;
    xs->mem_bytes = (size_t)slots * (size_t)slot_bytes;
    xs->async = o->async ? 1 : 0;
    atomic_store(&xs->fault_at, -1);
    pthread_mutex_init(&xs->mu, NULL);
    pthread_mutex_init(&xs->ring_mu, NULL);
    pthread_cond_init(&xs->cv, NULL);
    xs->path = strdup(o->path ? o->path : "?");
    xs->off = malloc(sizeof(int64_t) * o->n_keys);
    xs->len = malloc(sizeof(int64_t) * o->n_keys);
    xs->slot_of = malloc(sizeof(int) * o->n_keys);
    xs->score = calloc(o->n_keys, sizeof(uint32_t));
    xs->keep = calloc((size_t)o->n_keys / o->n_experts + 1, 1);
    /* the slots' state words sit on their own cache lines: calloc does not align to 64 */
    if (posix_memalign((void **)&xs->slots, 64, (size_t)slots * sizeof(xslot)) == 0)
        memset(xs->slots, 0, (size_t)slots * sizeof(xslot));
    else
        xs->slots = NULL;
    xs->queue = calloc((size_t)slots, sizeof(int));
    xs->pend_slot = calloc((size_t)slots, sizeof(int));
    xs->pend_need = calloc((size_t)slots, sizeof(int));
    xs->sub_late = calloc((size_t)slots + 1, sizeof(int));
    xs->reap_late = calloc((size_t)slots + 1, sizeof(int));
    const char *qd = getenv("CFLOW_EXPERT_QD"); /* measurements: reads in the kernel at once */
    xs->ring_cap = qd && atoi(qd) > 0 ? atoi(qd) : RING_CAP;
    if (!xs->path || !xs->off || !xs->len || !xs->slot_of || !xs->score || !xs->keep || !xs->slots || !xs->queue ||
        !xs->pend_slot || !xs->pend_need || !xs->sub_late || !xs->reap_late) {
        cf_xstore_free(xs);
        return cf_set_err(err, n, "out of memory"), NULL;
    }
    // lazily backed: a slot costs memory once it is first filled
    xs->mem = mmap(NULL, xs->mem_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (xs->mem == MAP_FAILED) {
        cf_set_err(err, n, "cannot reserve %lld bytes for the expert cache: %s; give a smaller budget",
                (long long)xs->mem_bytes, strerror(errno));
        cf_xstore_free(xs);
        return NULL;
    }
    for (int i = 0; i < xs->n_slots; i++) {
        xs->slots[i].key = -1;
        xs->slots[i].data = xs->mem + (size_t)i * xs->slot_bytes;
    }

    xs->direct = o->direct ? 1 : 0;
    if (xs->direct) {
        xs->fd = open(xs->path, O_RDONLY | O_CLOEXEC | O_DIRECT);
        if (xs->fd < 0 && errno != EINVAL) goto open_failed;
        if (xs->fd >= 0 && probe_direct(xs->fd, xs->mem, o->offset[0]) == -EINVAL) {
            close(xs->fd);
            xs->fd = -1;
        }
        if (xs->fd < 0) xs->direct = 0; /* the filesystem refuses O_DIRECT: buffered reads */
    }
    if (xs->fd < 0) {
        xs->fd = open(xs->path, O_RDONLY | O_CLOEXEC);
        if (xs->fd < 0) goto open_failed;
        posix_fadvise(xs->fd, 0, 0, POSIX_FADV_RANDOM); /* exact reads: no readahead */
    }
    madvise(xs->mem, CF_XALIGN, MADV_DONTNEED); /* the probe's page: not resident until used */
    struct stat st;
    if (fstat(xs->fd, &st) != 0) goto open_failed;
    xs->size0 = st.st_size;
    xs->mtime0 = st.st_mtim;
    for (int k = 0; k < o->n_keys; k++) {
        xs->off[k] = o->offset[k];
        xs->len[k] = round_up(o->nbytes[k]);
        xs->slot_of[k] = -1;
        if (xs->off[k] + xs->len[k] > (int64_t)st.st_size) {
            cf_set_err(err, n, "expert %d of layer %d (%lld bytes at %lld, read rounded to 4096) runs past the end "
                    "of %s (%lld bytes); the file is truncated", k % o->n_experts, k / o->n_experts,
                    (long long)o->nbytes[k], (long long)o->offset[k], xs->path, (long long)st.st_size);
            cf_xstore_free(xs);
            return NULL;
        }
    }
    xs->pid = getpid();
    if (xs->async && o->reader == CF_XREADER_INLINE) { /* async bookkeeping, reads at submission */
        xs->inline_io = 1;
        snprintf(xs->note, sizeof xs->note, "inline reads (tests: every read lands when it is submitted)");
        return xs;
    }
    if (xs->async && o->reader != CF_XREADER_THREADS && open_ring(xs, o->reader == CF_XREADER_URING_REFUSED) == 0)
        return xs;
    if (xs->async) {
        int want = cf_min(cf_max(o->n_io, 1), 16);
        xs->io = calloc((size_t)want, sizeof *xs->io);
        if (!xs->io) {
            cf_xstore_free(xs);
            return cf_set_err(err, n, "out of memory"), NULL;
        }
        for (; xs->n_io < want; xs->n_io++)
            if (pthread_create(&xs->io[xs->n_io], NULL, reader_main, xs) != 0) break;
        if (!xs->n_io) {
            cf_xstore_free(xs);
            return cf_set_err(err, n, "cannot start the expert reader threads"), NULL;
        }
    }
    return xs;

open_failed:
    cf_set_err(err, n, "cannot read experts from %s: %s", xs->path, strerror(errno));
    cf_xstore_free(xs);
    return NULL;
}

void cf_xstore_free(cf_xstore *xs) {
    if (!xs) return;
    if (xs->reaper_on && getpid() == xs->pid) { /* (a forked child has no reaper to stop) */
        atomic_store(&xs->ring_stop, 1);
        pthread_mutex_lock(&xs->ring_mu); /* reads not issued yet never will be: nobody needs them now */
        for (int i = 0; i < xs->n_pend; i++) atomic_fetch_sub(&xs->ring_inflight, 1);
        xs->n_pend = 0;
        pthread_mutex_unlock(&xs->ring_mu);
        if (!xs->ring_broken) ring_queue(xs, NULL, 0, 0, 1); /* wakes it now; else it sees the flag within a tick */
        pthread_join(xs->reaper, NULL);                   /* after every read in flight has landed */
    }
    cf_uring_close(&xs->ring);
    if (xs->n_io && !xs->inline_io) { /* (a forked child has no readers to stop) */
        pthread_mutex_lock(&xs->mu);
        xs->stop = 1;
        pthread_mutex_unlock(&xs->mu);
        pthread_cond_broadcast(&xs->cv);
        for (int i = 0; i < xs->n_io; i++) pthread_join(xs->io[i], NULL);
    }
    if (xs->fd >= 0) close(xs->fd);
    if (xs->mem != MAP_FAILED && xs->mem) munmap(xs->mem, xs->mem_bytes);
    pthread_mutex_destroy(&xs->mu);
    pthread_mutex_destroy(&xs->ring_mu);
    pthread_cond_destroy(&xs->cv);
    free(xs->io);
    free(xs->path);
    free(xs->off);
    free(xs->len);
    free(xs->slot_of);
    free(xs->score);
    free(xs->keep);
    free(xs->slots);
    free(xs->queue);
    free(xs->pend_slot);
    free(xs->pend_need);
    free(xs->sub_late);
    free(xs->reap_late);
    free(xs);
}
