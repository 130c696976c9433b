/* uring.c — io_uring on raw syscalls (uring.h). The rings are the kernel's shared memory: the
 * producer of each ring publishes its tail with a release store after filling the entries, the
 * consumer reads the tail with an acquire load and publishes its head with a release store. */
#define _GNU_SOURCE
#include "uring.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "util.h"

#if defined(__has_include)
#if __has_include(<linux/io_uring.h>) && defined(__NR_io_uring_setup)
#include <linux/io_uring.h>
#ifdef IORING_FEAT_EXT_ARG /* waits with a timeout: Linux 5.11 headers and later */
#define CF_HAVE_URING 1
#endif
#endif
#endif

#ifdef CF_HAVE_URING

static unsigned pow2_at_least(unsigned n) {
    unsigned p = 1;
    while (p < n && p < (1u << 15)) p <<= 1;
    return p;
}

int cf_uring_open(cf_uring *r, unsigned entries, int refuse, char *why, size_t n) {
    memset(r, 0, sizeof *r);
    r->fd = -1;
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    unsigned sq = pow2_at_least(entries < 8 ? 8 : entries);
    /* a completion for every read in flight, however many the submission queue takes at once */
    p.flags = IORING_SETUP_CQSIZE | IORING_SETUP_CLAMP;
    p.cq_entries = 2 * sq;
    if (refuse) p.flags |= 1u << 31; /* a flag no kernel knows: EINVAL, the refusal path */
    int fd = (int)syscall(__NR_io_uring_setup, sq, &p);
    if (fd < 0) {
        cf_set_err(why, n, "io_uring_setup: %s", strerror(errno));
        return -1;
    }
    r->fd = fd;
    if (!(p.features & IORING_FEAT_EXT_ARG)) {
        cf_set_err(why, n, "io_uring of this kernel cannot wait with a timeout (Linux < 5.11)");
        cf_uring_close(r);
        return -1;
    }
    r->sq_entries = p.sq_entries;
    r->cq_entries = p.cq_entries;
    r->sq_map_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_map_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    r->sqes_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sq_map = mmap(NULL, r->sq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    r->cq_map = mmap(NULL, r->cq_map_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
    r->sqes = mmap(NULL, r->sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (r->sq_map == MAP_FAILED || r->cq_map == MAP_FAILED || r->sqes == MAP_FAILED) {
        cf_set_err(why, n, "mapping the io_uring rings: %s", strerror(errno));
        cf_uring_close(r);
        return -1;
    }
    uint8_t *sqm = r->sq_map, *cqm = r->cq_map;
    r->sq_head = (unsigned *)(sqm + p.sq_off.head);
    r->sq_tail = (unsigned *)(sqm + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sqm + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sqm + p.sq_off.array);
    r->cq_head = (unsigned *)(cqm + p.cq_off.head);
    r->cq_tail = (unsigned *)(cqm + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cqm + p.cq_off.ring_mask);
    r->cqes = cqm + p.cq_off.cqes;
    return 0;
}

void cf_uring_close(cf_uring *r) {
    if (r->sq_map && r->sq_map != MAP_FAILED) munmap(r->sq_map, r->sq_map_len);
    if (r->cq_map && r->cq_map != MAP_FAILED) munmap(r->cq_map, r->cq_map_len);
    if (r->sqes && r->sqes != MAP_FAILED) munmap(r->sqes, r->sqes_len);
    if (r->fd >= 0) close(r->fd);
    memset(r, 0, sizeof *r);
    r->fd = -1;
}

int cf_uring_read(cf_uring *r, int fd, void *buf, unsigned len, uint64_t off, uint64_t user) {
    unsigned head = __atomic_load_n(r->sq_head, __ATOMIC_ACQUIRE);
    unsigned tail = *r->sq_tail + r->queued; /* only we write the tail */
    if (tail - head >= r->sq_entries) return -1;
    unsigned i = tail & *r->sq_mask;
    struct io_uring_sqe *e = (struct io_uring_sqe *)r->sqes + i;
    memset(e, 0, sizeof *e);
    e->opcode = len ? IORING_OP_READ : IORING_OP_NOP;
    e->fd = len ? fd : -1;
    e->addr = (uint64_t)(uintptr_t)buf;
    e->len = len;
    e->off = off;
    e->user_data = user;
    r->sq_array[i] = i;
    r->queued++;
    return 0;
}

int cf_uring_submit(cf_uring *r) {
    if (!r->queued) return 0;
    unsigned n = r->queued;
    __atomic_store_n(r->sq_tail, *r->sq_tail + n, __ATOMIC_RELEASE);
    r->queued = 0;
    for (int tries = 0; n;) {
        long got = syscall(__NR_io_uring_enter, r->fd, n, 0, 0, NULL, 0);
        if (got > 0) {
            n -= (unsigned)got;
            tries = 0;
        } else if (got < 0 && errno == EINTR) {
            continue;
        } else if (++tries > 1000 || (got < 0 && errno != EAGAIN && errno != EBUSY)) {
            return (int)n; /* left in the ring, where nothing starts them */
        } else {
            usleep(100); /* out of kernel resources for a moment: let completions free some */
        }
    }
    return 0;
}

int cf_uring_wait(cf_uring *r, int64_t timeout_ns) {
    struct __kernel_timespec ts = {.tv_sec = timeout_ns / 1000000000, .tv_nsec = timeout_ns % 1000000000};
    struct io_uring_getevents_arg arg = {.ts = (uint64_t)(uintptr_t)&ts};
    if (__atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE) != *r->cq_head) return 0;
    long got = syscall(__NR_io_uring_enter, r->fd, 0, 1, IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG, &arg,
                       sizeof arg);
    return got < 0 && errno != EINTR && errno != ETIME ? -errno : 0;
}

int cf_uring_next(cf_uring *r, uint64_t *user, int32_t *res) {
    unsigned head = *r->cq_head;
    if (head == __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE)) return 0;
    const struct io_uring_cqe *c = (const struct io_uring_cqe *)r->cqes + (head & *r->cq_mask);
    *user = c->user_data;
    *res = c->res;
    __atomic_store_n(r->cq_head, head + 1, __ATOMIC_RELEASE);
    return 1;
}

#else /* no io_uring headers: every open says so and the caller uses threads */

int cf_uring_open(cf_uring *r, unsigned entries, int refuse, char *why, size_t n) {
    (void)entries;
    (void)refuse;
    memset(r, 0, sizeof *r);
    r->fd = -1;
    cf_set_err(why, n, "built without io_uring");
    return -1;
}
void cf_uring_close(cf_uring *r) { (void)r; }
int cf_uring_read(cf_uring *r, int fd, void *buf, unsigned len, uint64_t off, uint64_t user) {
    (void)r, (void)fd, (void)buf, (void)len, (void)off, (void)user;
    return -1;
}
int cf_uring_submit(cf_uring *r) { return (int)r->queued; }
int cf_uring_wait(cf_uring *r, int64_t timeout_ns) { return (void)r, (void)timeout_ns, -ENOSYS; }
int cf_uring_next(cf_uring *r, uint64_t *user, int32_t *res) { return (void)r, (void)user, (void)res, 0; }

#endif
