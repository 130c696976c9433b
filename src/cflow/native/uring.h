/* uring.h — the smallest io_uring the expert readers need, on raw syscalls (no liburing).
 *
 * One ring per expert store: one thread queues reads (cf_uring_read, then cf_uring_submit),
 * another waits for and takes completions (cf_uring_wait, cf_uring_next). Queueing is not
 * thread-safe: callers that queue from several threads hold one lock around it (experts.c does).
 * Where the kernel has no io_uring, or a container's seccomp profile refuses it (EPERM / ENOSYS),
 * cf_uring_open fails and says why; the caller then uses pread threads. Needs Linux 5.11 (waits
 * with a timeout, IORING_FEAT_EXT_ARG), else the open says so too.
 */
#ifndef CFLOW_URING_H
#define CFLOW_URING_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int fd;                       /* -1: not open */
    unsigned sq_entries, cq_entries;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    void *sqes, *cqes;            /* struct io_uring_sqe[sq_entries], struct io_uring_cqe[cq_entries] */
    void *sq_map, *cq_map;
    size_t sq_map_len, cq_map_len, sqes_len;
    unsigned queued;              /* SQEs written since the last cf_uring_submit */
} cf_uring;

/* Open a ring of at least `entries` submissions and completions (rounded up to a power of two).
 * refuse = 1 (tests) asks the kernel for an invalid setup, so the refusal path runs as it does
 * where io_uring is blocked. 0, or -1 and why in `why`. */
int cf_uring_open(cf_uring *r, unsigned entries, int refuse, char *why, size_t n);
void cf_uring_close(cf_uring *r);
/* Queue a read of len bytes at off of fd into buf (len 0: a no-op that completes with 0). 0, or
 * -1 when the submission queue is full (cf_uring_submit, then try again). */
int cf_uring_read(cf_uring *r, int fd, void *buf, unsigned len, uint64_t off, uint64_t user);
/* Hand the queued reads to the kernel: 0, or how many of the last ones it would not take (errno
 * set; they stay in the ring unsubmitted, and nothing starts them unless a later submit does). */
int cf_uring_submit(cf_uring *r);
/* Sleep until a completion is there or timeout_ns passed (0 either way), or -errno. */
int cf_uring_wait(cf_uring *r, int64_t timeout_ns);
/* Take the next completion: 1 with its user value and result (bytes, or -errno), 0 if none. */
int cf_uring_next(cf_uring *r, uint64_t *user, int32_t *res);

#ifdef __cplusplus
}
#endif
#endif /* CFLOW_URING_H */
