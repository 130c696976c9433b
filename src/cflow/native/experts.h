/* experts.h — disk-resident experts: an expert cache with a byte budget, filled by pread threads.
 *
 * When a MoE model does not fit in memory, the dense weights (attention, norms, routers,
 * embeddings, lm_head, dense FFN) stay in the mmap and only the experts go through this store.
 * Each expert of a .cflow file is one contiguous, 4096-aligned span (docs/FORMAT.md, "Data order
 * and experts"), so one expert is one O_DIRECT read into one cache slot.
 *
 *   slots     n_slots buffers of slot_bytes = the largest expert rounded up to 4096, carved from
 *             one anonymous mapping: n_slots * slot_bytes <= budget, always. Untouched slots cost
 *             no memory (the mapping is lazy).
 *   keys      (weight set, expert) = set * E + e, as the file's expert table numbers them.
 *   states    EMPTY -> LOADING (acquired, read queued) -> READY, or FAILED (the read failed; the
 *             waiter reports it, the next call frees the slot). A slot's state is a 32-bit word
 *             the compute threads sleep on (cf_word_wait) and the reader wakes (cf_word_wake).
 *   pins      a slot is pinned from the route that chose its expert until the experts op that used
 *             it; pinned and LOADING slots are never evicted. A call never pins more than
 *             top_k x (layers in flight) slots at a time, which is the smallest cache accepted.
 *   spec      expert speculation (engine_spec.c, cf_route_disk) claims slots for experts a route
 *             has not chosen yet (cf_xstore_speculate): pinned and LOADING like a miss, and marked
 *             until an acquire uses the bytes (*miss = 2 then: read for this use, but early). The engine keeps its
 *             own count of the slots speculation holds or still has reads in flight for, within the
 *             slots beyond the minimum, so the plan's own pins always fit.
 *   policy    recency-weighted frequency on each layer's own clock, ties by recency (experts.c
 *             says why; tests/cachesim.py simulate is its Python twin), after a per-weight-set
 *             keep rank the engine may set (0 everywhere unless it does): a step's first layers,
 *             whose misses no read-ahead can hide, are evicted last.
 *   I/O       async: io_uring where the kernel offers it (uring.h: thread 0 submits, one reaper
 *             thread takes completions), else a queue and n_io pread threads (not the compute pool;
 *             they sleep in the kernel); sync: the caller reads, then computes (the baseline the
 *             async mode beats). Both async readers publish through the same slot states.
 *             O_DIRECT where the filesystem takes it, else buffered pread with readahead off and
 *             posix_fadvise(DONTNEED) after each read, so the page cache does not keep a second
 *             copy of what the cache holds.
 *
 * Threading: every function except cf_xstore_wait is called by one compute thread at a time
 * (thread 0 of the engine's pool, or the caller between calls); the reader threads (or the
 * io_uring reaper) touch only a slot's state, its read result and the queue (the ring).
 */
#ifndef CFLOW_EXPERTS_H
#define CFLOW_EXPERTS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CF_XALIGN 4096 /* O_DIRECT offsets, lengths and buffers; the .cflow alignment */
/* A routing's weight in an expert's eviction score (experts.c, cf_xstore_visit); the score halves
 * every routing of the layer after. Exported as _native.EXPERT_VISIT_SCORE for the policy's Python
 * replay (tests/cachesim.py). */
#define CF_XVISIT_SCORE (1u << 16)

typedef struct {
    const char *path;      /* the model file; named in every error */
    int n_keys;            /* weight sets x experts */
    int n_experts;         /* E, to name (set, expert) in messages */
    const int64_t *offset; /* [n_keys] file offset of each expert's span (4096-aligned) */
    const int64_t *nbytes; /* [n_keys] bytes of the span (read rounded up to 4096) */
    int64_t budget;        /* bytes the slots may take */
    int min_slots;         /* fewer slots than this is refused (top_k x layers in flight) */
    int async;             /* 1: reader threads; 0: cf_xstore_read_now in the caller */
    int n_io;              /* reader threads when async (1..16) */
    int direct;            /* 1: O_DIRECT where the filesystem takes it; 0: buffered pread */
    int reader;            /* async: CF_XREADER_* */
} cf_xstore_opts;

/* Which async reader: io_uring where the kernel offers it, else pread threads (AUTO); the threads
 * (THREADS); or, for tests, an io_uring setup the kernel refuses, so the fallback runs as it does
 * where io_uring is blocked (URING_REFUSED), or every read done in the submitting thread, so which
 * slots are still loading never depends on timing (INLINE). */
enum { CF_XREADER_AUTO, CF_XREADER_THREADS, CF_XREADER_URING_REFUSED, CF_XREADER_INLINE, CF_XREADER_KINDS };
extern const char *const cf_xreader_names[CF_XREADER_KINDS]; /* "auto", "threads", "uring-refused", "inline" */

typedef struct {
    int n_slots, async, n_io, direct;
    int uring;         /* 1: the async reads go through io_uring */
    const char *note;  /* why not, where io_uring was wanted ("" otherwise); lives as long as the store */
    int64_t slot_bytes, cache_bytes;
} cf_xstore_info;

/* Test-only fault injection (cf_xstore_inject_fault): the read with index `after` (0-based,
 * counting from the call) fails once, as an I/O error or as a short read, after `delay_us`
 * microseconds (so the threads waiting for it are asleep, not spinning, when it fails). */
enum { CF_XFAULT_NONE, CF_XFAULT_EIO, CF_XFAULT_SHORT, CF_XFAULT_KINDS };
extern const char *const cf_xfault_names[CF_XFAULT_KINDS]; /* "none", "eio", "short" */

typedef struct cf_xstore cf_xstore;

/* Open the file, size and allocate the cache, start the readers. NULL and a message in err when
 * the budget is below min_slots slots, the file cannot be opened or read, or memory runs out. */
cf_xstore *cf_xstore_open(const cf_xstore_opts *o, char *err, size_t n);
void cf_xstore_free(cf_xstore *xs); /* finishes queued reads, joins the readers */

/* Start of an engine call: waits out reads a failed call left in flight (pinned slots), unpins
 * everything, frees FAILED slots, and checks the file is still the one loaded (size and mtime). -1
 * and a message when it is not. Unpinned reads in flight (speculation nobody waited for) go on
 * landing: they are not evictable until then, and no call waits for them. */
int cf_xstore_begin(cf_xstore *xs, char *err, size_t n);

/* A layer using weight set `set` routed to experts chosen[0..n): the policy's clock for that set. */
void cf_xstore_visit(cf_xstore *xs, int set, const int *chosen, int n);
/* Eviction rank of weight set `set` (0..255, default 0): victims come from the lowest rank first,
 * then by the policy. The engine ranks the layers whose misses it cannot hide highest. */
void cf_xstore_keep(cf_xstore *xs, int set, int rank);
/* Pin key's slot, choosing and claiming a victim when it is not cached (*miss = 1: the slot is
 * LOADING and must be submitted or read; 2: a speculative read, landed or not, brought the expert
 * and nothing had used it yet; 0: cached). -1 when every slot is pinned or loading. */
int cf_xstore_acquire(cf_xstore *xs, int key, int *miss);
/* Speculation. The slot holding key (whatever its state), or -1 when it is not cached. */
int cf_xstore_lookup(const cf_xstore *xs, int key);
/* Claim and pin a victim for key, which must not be cached (cf_xstore_lookup < 0), LOADING and
 * marked speculative: submit it like a miss, release it like any pin. -1 when no slot can be evicted. */
int cf_xstore_speculate(cf_xstore *xs, int key);
/* Pin a slot that holds a key already (cached or coming) without using it: speculation keeps an
 * expert predicted for a later layer from being evicted before that layer routes. */
void cf_xstore_pin(cf_xstore *xs, int slot);
/* Is the slot's read still in flight (it cannot be evicted until it lands)? */
int cf_xstore_loading(const cf_xstore *xs, int slot);
void cf_xstore_release(cf_xstore *xs, int slot);
/* Queue reads of LOADING slots for the readers (one lock for all); `need` is the layer they are
 * for in this call (io_uring issues the most needed first, a few at a time; the pread threads take
 * them in arrival order). */
void cf_xstore_submit(cf_xstore *xs, const int *slots, int n, int need);
/* Read a LOADING slot in the calling thread (sync mode). */
void cf_xstore_read_now(cf_xstore *xs, int slot);
/* Any thread: wait until the slot is READY (0) or FAILED (-1). stall_ns (may be NULL) gets the
 * nanoseconds spent waiting added. */
int cf_xstore_wait(cf_xstore *xs, int slot, uint64_t *stall_ns);
const uint8_t *cf_xstore_data(const cf_xstore *xs, int slot);
/* What went wrong with a FAILED slot, as one sentence naming the file. */
void cf_xstore_error(const cf_xstore *xs, int slot, char *out, size_t n);

void cf_xstore_get_info(const cf_xstore *xs, cf_xstore_info *out);
uint64_t cf_xstore_bytes_read(const cf_xstore *xs); /* since open, every reader together */
/* Keys of READY slots into keys[n_slots]; returns how many. */
int cf_xstore_resident(const cf_xstore *xs, int *keys);
void cf_xstore_inject_fault(cf_xstore *xs, int64_t after, int kind, int delay_us);

#ifdef __cplusplus
}
#endif
#endif /* CFLOW_EXPERTS_H */
