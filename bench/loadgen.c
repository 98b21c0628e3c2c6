/* bench/loadgen.c: the load generator of bench/serving.py, in C. The same
 * generator as bench/loadgen.py (the reference, and serving.py's fallback):
 * the same options, the same semantics and the same JSON on stdout, for a
 * fraction of its CPU (the generator shares the machine's cores with the
 * server under test, so its own cost shows up in the server's tail latency).
 *
 *     gcc -std=c11 -O2 -Wall -Wextra -o loadgen bench/loadgen.c -lm
 *     ./loadgen --port 8080 --bodies bodies.jsonl --rate 2000 --duration 10
 *     ./loadgen --port 8080 --bodies batch.jsonl --closed 4 --duration 10
 *
 * (bench/serving.py builds it into bench-out/serving/loadgen by itself.)
 *
 * Open loop (--rate R): request i is due at start + i/R. At that moment it
 * goes out on a free keep-alive connection (connections are used in turn, a
 * FIFO of free ones); if none is free it waits in a FIFO queue, and the wait
 * counts. Latency = from the *scheduled* time to the last byte of the answer
 * (no coordinated omission); `service` = from the send to the last byte; `lag`
 * = send - scheduled (queueing for a connection, and this process waiting for
 * a core). Closed loop (--closed K): K connections, each sends its next
 * request as soon as its answer is complete; latency from send to answer.
 *
 * Requests scheduled in the first --warmup seconds are sent but not counted.
 * One request at a time per connection (no pipelining). Each body (one line of
 * --bodies, sent as is) is wrapped into request bytes once, before the run:
 * "POST <path> HTTP/1.1", Host, Content-Type, Content-Length (HTTP/1.1, so
 * keep-alive; byte for byte what loadgen.py sends). Answers are parsed only as
 * far as the status line, Content-Length (or chunked, or the connection's
 * close), X-Model-Version (any case; or the body's "model_version") and a
 * check that a 2xx body holds "pctr". Errors: non-2xx answers (by status), 2xx
 * bodies without "pctr", failed connects ("connect: <Python's exception
 * name>"), connections that failed or closed with a request in flight (not
 * retried; a lost connection is reopened after 50 ms, a failed reopen retried
 * every 200 ms), and in an open-loop run requests still unanswered when it
 * stops (`unfinished`: counted in the percentiles with the time they had
 * waited). An open-loop run stops early (`aborted`) once some request has
 * waited --abort-after seconds. `ok_per_s`: good answers that arrived inside
 * the measured window, per second. Percentiles by nearest rank over every
 * counted request (all kept in memory).
 *
 * One thread, non-blocking sockets (TCP_NODELAY), epoll, CLOCK_MONOTONIC.
 * Requests leave on time to within tens of microseconds (measured lag p50
 * ~0.04 ms on 2 vCPUs), where epoll_wait's timeout would round up to the next
 * millisecond: the loop sleeps in epoll_wait(-1) with a
 * timerfd in the epoll set, armed at the absolute time of the next due
 * request (CLOCK_MONOTONIC, TFD_TIMER_ABSTIME). The timer stays armed while
 * answers wake the loop, so an answer costs no timer set-up; measured on 2
 * vCPUs at 1,000 requests/s, this costs ~20% less CPU than epoll_pwait2 with a
 * nanosecond timeout (an hrtimer armed and cancelled on every wait) for the
 * same lateness. --selector: precise (the default) and select (loadgen.py's
 * names): the timerfd; pwait2: epoll_pwait2 with a timespec timeout (timer
 * slack set to 1 us; falls back to the timerfd where the kernel or libc lacks
 * it); epoll: plain epoll_wait, timeouts rounded up to whole milliseconds.
 * While no connection is free, the loop does not wake for each due request
 * (it could only queue it; its scheduled time follows from its index): due
 * requests are queued when a connection frees, when the watchdog looks for
 * the abort (every 0.25 s) and at the stop, so an overloaded run costs little
 * CPU and measures the same.
 *
 * Prints one JSON object on stdout (exit 0), or {"fatal": ...} (exit 2) when
 * no connection could be opened; progress lines (running p99) on stderr.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#if defined(__GLIBC__) && defined(__GLIBC_PREREQ)
#if __GLIBC_PREREQ(2, 35)
#define HAVE_EPOLL_PWAIT2 1
#endif
#endif

#define MAX_EVENTS 256
#define TFD_TAG UINT64_MAX
#define READ_CHUNK 65536

/* ---- small utilities ------------------------------------------------------------------------ */

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("loadgen: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void *xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) die("out of memory (%zu bytes)", n);
    return q;
}

static char *xstrndup(const char *s, size_t n) {
    char *p = xrealloc(NULL, n + 1);
    memcpy(p, s, n);
    p[n] = 0;
    return p;
}

static double mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double cpu_seconds(void) {
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return (double)r.ru_utime.tv_sec + (double)r.ru_utime.tv_usec * 1e-6 + (double)r.ru_stime.tv_sec +
           (double)r.ru_stime.tv_usec * 1e-6;
}

static int is_space(int ch) {  /* Python's bytes whitespace */
    return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r' || ch == '\v' || ch == '\f';
}

/* a growable array of doubles */
typedef struct {
    double *v;
    size_t n, cap;
} dvec;

static void dvec_push(dvec *d, double x) {
    if (d->n == d->cap) {
        d->cap = d->cap ? d->cap * 2 : 8192;
        d->v = xrealloc(d->v, d->cap * sizeof(double));
    }
    d->v[d->n++] = x;
}

/* counts by string key, in insertion order (like a Python dict) */
typedef struct {
    char **keys;
    long long *counts;
    size_t n, cap;
} counter;

static void counter_add(counter *c, const char *key, size_t len, long long k) {
    for (size_t i = 0; i < c->n; i++)
        if (strlen(c->keys[i]) == len && memcmp(c->keys[i], key, len) == 0) {
            c->counts[i] += k;
            return;
        }
    if (c->n == c->cap) {
        c->cap = c->cap ? c->cap * 2 : 8;
        c->keys = xrealloc(c->keys, c->cap * sizeof(char *));
        c->counts = xrealloc(c->counts, c->cap * sizeof(long long));
    }
    c->keys[c->n] = xstrndup(key, len);
    c->counts[c->n++] = k;
}

static long long counter_get(const counter *c, const char *key) {
    for (size_t i = 0; i < c->n; i++)
        if (strcmp(c->keys[i], key) == 0) return c->counts[i];
    return 0;
}

static long long counter_sum(const counter *c) {
    long long s = 0;
    for (size_t i = 0; i < c->n; i++) s += c->counts[i];
    return s;
}

/* a growable string */
typedef struct {
    char *s;
    size_t n, cap;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        while (b->n + n + 1 > b->cap) b->cap = b->cap ? b->cap * 2 : 4096;
        b->s = xrealloc(b->s, b->cap);
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = 0;
}

static void sb_puts(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_printf(sbuf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof tmp) {
        sb_put(b, tmp, (size_t)n);
        return;
    }
    char *big = xrealloc(NULL, (size_t)n + 1);
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    sb_put(b, big, (size_t)n);
    free(big);
}

/* Python's round(x, nd): the correctly rounded decimal, read back */
static double pyround(double x, int nd) {
    if (!isfinite(x) || fabs(x) >= 1e17) return x;
    char tmp[64];
    snprintf(tmp, sizeof tmp, "%.*f", nd, x);
    return strtod(tmp, NULL);
}

/* a float as Python's repr (json.dumps) writes it: the shortest digits that read back */
static void sb_float(sbuf *b, double x) {
    if (isnan(x)) { sb_puts(b, "NaN"); return; }
    if (isinf(x)) { sb_puts(b, x > 0 ? "Infinity" : "-Infinity"); return; }
    if (x == 0) { sb_puts(b, signbit(x) ? "-0.0" : "0.0"); return; }
    char e[48];
    for (int p = 1; p <= 17; p++) {
        snprintf(e, sizeof e, "%.*e", p - 1, x);
        if (strtod(e, NULL) == x) break;
    }
    /* e: [-]d[.ddd]e[+-]XX */
    char digits[32];
    int nd = 0, neg = 0;
    const char *s = e;
    if (*s == '-') { neg = 1; s++; }
    for (; *s && *s != 'e'; s++)
        if (*s >= '0' && *s <= '9') digits[nd++] = *s;
    int exp10 = atoi(s + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = 0;
    if (neg) sb_puts(b, "-");
    if (exp10 >= -4 && exp10 < 16) {  /* fixed notation, as Python writes these */
        if (exp10 >= 0) {
            for (int i = 0; i <= exp10; i++) sb_put(b, i < nd ? &digits[i] : "0", 1);
            sb_puts(b, ".");
            if (nd > exp10 + 1) sb_put(b, digits + exp10 + 1, (size_t)(nd - exp10 - 1));
            else sb_puts(b, "0");
        } else {
            sb_puts(b, "0.");
            for (int i = 0; i < -exp10 - 1; i++) sb_puts(b, "0");
            sb_put(b, digits, (size_t)nd);
        }
    } else {
        sb_put(b, digits, 1);
        if (nd > 1) {
            sb_puts(b, ".");
            sb_put(b, digits + 1, (size_t)(nd - 1));
        }
        sb_printf(b, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
    }
}

/* a JSON string as json.dumps writes it (ensure_ascii: non-ASCII as \uXXXX) */
static void sb_json_str(sbuf *b, const char *s, size_t n) {
    sb_puts(b, "\"");
    const unsigned char *p = (const unsigned char *)s, *end = p + n;
    while (p < end) {
        unsigned c = *p;
        if (c == '"') { sb_puts(b, "\\\""); p++; continue; }
        if (c == '\\') { sb_puts(b, "\\\\"); p++; continue; }
        if (c == '\n') { sb_puts(b, "\\n"); p++; continue; }
        if (c == '\r') { sb_puts(b, "\\r"); p++; continue; }
        if (c == '\t') { sb_puts(b, "\\t"); p++; continue; }
        if (c == '\b') { sb_puts(b, "\\b"); p++; continue; }
        if (c == '\f') { sb_puts(b, "\\f"); p++; continue; }
        if (c < 0x20) { sb_printf(b, "\\u%04x", c); p++; continue; }
        if (c < 0x80) { sb_put(b, (const char *)p, 1); p++; continue; }
        /* UTF-8 to code points; a byte that does not decode stands for U+FFFD */
        unsigned cp = 0xfffd;
        int len = 1;
        if ((c & 0xe0) == 0xc0 && end - p >= 2 && (p[1] & 0xc0) == 0x80) {
            cp = ((c & 0x1fu) << 6) | (p[1] & 0x3fu), len = 2;
            if (cp < 0x80) cp = 0xfffd, len = 1;
        } else if ((c & 0xf0) == 0xe0 && end - p >= 3 && (p[1] & 0xc0) == 0x80 && (p[2] & 0xc0) == 0x80) {
            cp = ((c & 0x0fu) << 12) | ((p[1] & 0x3fu) << 6) | (p[2] & 0x3fu), len = 3;
            if (cp < 0x800 || (cp >= 0xd800 && cp < 0xe000)) cp = 0xfffd, len = 1;
        } else if ((c & 0xf8) == 0xf0 && end - p >= 4 && (p[1] & 0xc0) == 0x80 && (p[2] & 0xc0) == 0x80 &&
                   (p[3] & 0xc0) == 0x80) {
            cp = ((c & 0x07u) << 18) | ((p[1] & 0x3fu) << 12) | ((p[2] & 0x3fu) << 6) | (p[3] & 0x3fu), len = 4;
            if (cp < 0x10000 || cp > 0x10ffff) cp = 0xfffd, len = 1;
        }
        if (cp >= 0x10000) {
            cp -= 0x10000;
            sb_printf(b, "\\u%04x\\u%04x", 0xd800 + (cp >> 10), 0xdc00 + (cp & 0x3ff));
        } else {
            sb_printf(b, "\\u%04x", cp);
        }
        p += len;
    }
    sb_puts(b, "\"");
}

static void sb_counter(sbuf *b, const counter *c) {
    sb_puts(b, "{");
    for (size_t i = 0; i < c->n; i++) {
        if (i) sb_puts(b, ", ");
        sb_json_str(b, c->keys[i], strlen(c->keys[i]));
        sb_printf(b, ": %lld", c->counts[i]);
    }
    sb_puts(b, "}");
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* nearest rank: the smallest value with at least q of the values at or below it */
static size_t rank_index(size_t n, double q) {
    double k = ceil(q * (double)n) - 1;
    if (k < 0) k = 0;
    if (k > (double)(n - 1)) k = (double)(n - 1);
    return (size_t)k;
}

/* the k-th smallest of a[0..n) (a is reordered) */
static double kth(double *a, long n, long k) {
    long lo = 0, hi = n - 1;
    while (lo < hi) {
        double p = a[lo + (hi - lo) / 2];
        long i = lo, j = hi;
        while (i <= j) {
            while (a[i] < p) i++;
            while (a[j] > p) j--;
            if (i <= j) {
                double t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (k <= j) hi = j;
        else if (k >= i) lo = i;
        else return a[k];
    }
    return a[k];
}

/* ---- state ---------------------------------------------------------------------------------- */

enum { C_IDLE, C_CONNECTING, C_OPEN };

typedef struct {
    int fd;
    uint32_t gen;        /* bumped when the socket closes: events of an old socket are dropped */
    int state;
    int addr_i;          /* the address being tried */
    int retry;           /* a failed connect is retried (reopens; not the first connect) */
    int initial;         /* the first connect, not yet resolved */
    int in_conns;        /* made and not lost (Python's `conns` set) */
    int want_out;        /* EPOLLOUT registered */
    int reopen_pending;
    double reopen_at;
    int has_req;         /* the request in flight */
    double req_sched, req_sent;
    const char *out;     /* request bytes still to write */
    size_t out_len, out_off;
    char *buf;           /* the answer so far */
    size_t len, cap;
    long long need;      /* -1: head not read yet; -2 chunked; -3 until the close; else the answer's bytes */
    size_t head_len;     /* the head (lowercased) up to and with the last header's \r\n */
} Conn;

static struct {
    /* options */
    const char *host, *path, *ctype, *bodies, *label, *selector;
    int port, connections, closed;
    double rate, duration, warmup, drain, abort_after, progress;
    /* request bytes */
    char **req;
    size_t *req_len, nreq;
    /* addresses */
    struct addrinfo *ai;
    struct addrinfo **addrs;
    int naddrs;
    /* waiting */
    int ep, tfd, wait_mode;   /* 0 epoll_pwait2, 1 timerfd (the default), 2 epoll_wait (ms) */
    double tfd_armed;
    /* connections */
    Conn *conns;
    int nconns, init_outstanding, init_failed, pending_reopens, inflight;
    int first_errno;
    int *freeq;               /* ring of free connections, in turn */
    int free_head, free_len;
    /* open loop: indices of due requests waiting for a connection */
    long long *q;
    size_t q_head, q_len, q_cap;
    long long next_i, total, sent;
    double start, measure_from, end;
    int closed_loop, running, stopping, aborted, done, watch_done;
    /* measured requests */
    dvec latency, service, lag, sched;
    counter status, errors, versions;
    long long completed_all, ok_in_window, connect_failures, reconnects;
    size_t progress_mark;
    double progress_last;
    dvec tmp;
} G;

static void note(const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    sbuf b = {0};
    if (G.label && G.label[0]) {
        sb_puts(&b, G.label);
        sb_puts(&b, ": ");
    }
    sb_puts(&b, msg);
    sb_puts(&b, "\n");
    fwrite(b.s, 1, b.n, stderr);
    fflush(stderr);
    free(b.s);
}

/* the Python exception class an errno becomes (the error keys name it, like loadgen.py's) */
static const char *exc_name(int err) {
    switch (err) {
    case ECONNREFUSED: return "ConnectionRefusedError";
    case ECONNRESET: return "ConnectionResetError";
    case ECONNABORTED: return "ConnectionAbortedError";
    case EPIPE: case ESHUTDOWN: return "BrokenPipeError";
    case ETIMEDOUT: return "TimeoutError";
    case EAGAIN: case EALREADY: case EINPROGRESS: return "BlockingIOError";
    case EINTR: return "InterruptedError";
    case ENOENT: return "FileNotFoundError";
    case EACCES: case EPERM: return "PermissionError";
    case ECHILD: return "ChildProcessError";
    default: return "OSError";
    }
}

static double sched_time(long long i) { return G.start + (double)i / G.rate; }

static void maybe_done(void) {
    if (G.inflight == 0 && (G.closed_loop || G.stopping || (G.next_i >= G.total && G.q_len == 0))) G.done = 1;
}

/* ---- the FIFOs ------------------------------------------------------------------------------ */

static void free_push(Conn *c) {
    int idx = (int)(c - G.conns);
    G.freeq[(G.free_head + G.free_len) % G.nconns] = idx;
    G.free_len++;
}

static Conn *free_pop(void) {
    int idx = G.freeq[G.free_head];
    G.free_head = (G.free_head + 1) % G.nconns;
    G.free_len--;
    return &G.conns[idx];
}

static void free_remove(Conn *c) {
    int idx = (int)(c - G.conns);
    for (int k = 0; k < G.free_len; k++) {
        if (G.freeq[(G.free_head + k) % G.nconns] != idx) continue;
        for (int m = k; m < G.free_len - 1; m++)
            G.freeq[(G.free_head + m) % G.nconns] = G.freeq[(G.free_head + m + 1) % G.nconns];
        G.free_len--;
        return;
    }
}

static void q_push(long long i) {
    if (G.q_len == G.q_cap) {
        size_t cap = G.q_cap ? G.q_cap * 2 : 1024;
        long long *q = xrealloc(NULL, cap * sizeof(long long));
        for (size_t k = 0; k < G.q_len; k++) q[k] = G.q[(G.q_head + k) % G.q_cap];
        free(G.q);
        G.q = q, G.q_cap = cap, G.q_head = 0;
    }
    G.q[(G.q_head + G.q_len) % G.q_cap] = i;
    G.q_len++;
}

static long long q_pop(void) {
    long long i = G.q[G.q_head];
    G.q_head = (G.q_head + 1) % G.q_cap;
    G.q_len--;
    return i;
}

/* ---- results -------------------------------------------------------------------------------- */

/* an answer (status >= 0) or a failure (status -1, error set) of a request scheduled at `sched`, sent at `sent` */
static void record(double sched, double sent, int status, const char *version, size_t vlen, int body_ok,
                   const char *error) {
    double now = mono();
    G.completed_all++;
    int good = status >= 200 && status < 300 && body_ok;
    if (!G.closed_loop && G.measure_from <= now && now <= G.end && sched < G.measure_from && good)
        G.ok_in_window++;  /* a warm-up request answered inside the window counts for the achieved rate */
    int measured;
    if (G.closed_loop) {
        measured = G.measure_from <= sent && now <= G.end;
        sched = sent;
    } else {
        measured = sched >= G.measure_from;
    }
    if (!measured) return;
    static int key_status = -1;
    static char key[32];
    char ebuf[48];
    if (status >= 0) {
        if (status != key_status) snprintf(key, sizeof key, "%d", key_status = status);
        counter_add(&G.status, key, strlen(key), 1);
        if (!(status >= 200 && status < 300)) {
            snprintf(ebuf, sizeof ebuf, "HTTP %d", status);
            error = ebuf;
        } else if (!body_ok) {
            error = "2xx without pctr";
        }
    }
    if (error) {
        counter_add(&G.errors, error, strlen(error), 1);
    } else {
        if (now <= G.end) G.ok_in_window++;
        if (version) counter_add(&G.versions, version, vlen, 1);
    }
    dvec_push(&G.latency, now - sched);
    dvec_push(&G.service, now - sent);
    dvec_push(&G.lag, sent - sched);
    dvec_push(&G.sched, sched - G.measure_from);
}

/* ---- connections ---------------------------------------------------------------------------- */

static void on_free(Conn *c);
static void start_connect(Conn *c, int from, int last_err);

static void ep_set(Conn *c, int op, uint32_t events) {
    struct epoll_event ev = {.events = events, .data.u64 = ((uint64_t)c->gen << 32) | (uint32_t)(c - G.conns)};
    if (epoll_ctl(G.ep, op, c->fd, &ev) < 0) die("epoll_ctl: %s", strerror(errno));
}

static void set_want_out(Conn *c, int on) {
    if (c->want_out == on) return;
    c->want_out = on;
    ep_set(c, EPOLL_CTL_MOD, EPOLLIN | (on ? EPOLLOUT : 0));
}

static void close_socket(Conn *c) {
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    c->gen++;
    c->state = C_IDLE;
    c->want_out = 0;
    c->out = NULL;
    c->len = 0;
    c->need = -1;
}

static void schedule_reopen(Conn *c, double delay) {
    if (!c->reopen_pending) G.pending_reopens++;
    c->reopen_pending = 1;
    c->reopen_at = mono() + delay;
}

static void complete(Conn *c, int from_close);

/* the connection is gone (err_name: the exception, NULL for a plain close) */
static void conn_lost(Conn *c, const char *err_name) {
    if (c->need == -3 && c->has_req) {  /* a body delimited by the close */
        complete(c, 1);
    } else if (c->has_req) {
        char key[96];
        snprintf(key, sizeof key, "closed with a request in flight%s%s%s", err_name ? " (" : "",
                 err_name ? err_name : "", err_name ? ")" : "");
        c->has_req = 0;
        G.inflight--;
        record(c->req_sched, c->req_sent, -1, NULL, 0, 0, key);
    }
    close_socket(c);
    c->in_conns = 0;
    free_remove(c);
    if (!G.stopping) {
        G.reconnects++;
        c->retry = 1;
        schedule_reopen(c, 0.05);
    }
}

static void flush_out(Conn *c) {
    while (c->out_off < c->out_len) {
        ssize_t w = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
        if (w > 0) {
            c->out_off += (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            set_want_out(c, 1);
            return;
        }
        conn_lost(c, exc_name(w < 0 ? errno : EPIPE));
        return;
    }
    c->out = NULL;
    set_want_out(c, 0);
}

static void do_send(Conn *c, double sched) {
    double now = mono();
    size_t k = (size_t)(G.sent % (long long)G.nreq);
    G.sent++;
    c->has_req = 1;
    c->req_sched = sched;
    c->req_sent = now;
    G.inflight++;
    c->out = G.req[k];
    c->out_len = G.req_len[k];
    c->out_off = 0;
    flush_out(c);
}

/* open loop: requests due by `now` into the queue (in order) */
static void enqueue_due(double now) {
    while (G.next_i < G.total && sched_time(G.next_i) <= now) q_push(G.next_i++);
}

/* open loop: due requests into the queue; queued requests onto free connections */
static void pump(void) {
    enqueue_due(mono());
    while (G.q_len && G.free_len) {
        Conn *c = free_pop();
        do_send(c, sched_time(q_pop()));
    }
    if (G.next_i >= G.total && !G.q_len) maybe_done();
}

static void on_free(Conn *c) {
    c->in_conns = 1;
    if (G.stopping) {
        maybe_done();
        return;
    }
    if (G.closed_loop && G.running) {
        do_send(c, mono());
        return;
    }
    free_push(c);
    /* due requests not queued yet count too: with no connection free, the loop does not wake to queue them */
    if (G.q_len || (G.running && G.next_i < G.total && sched_time(G.next_i) <= mono())) pump();
    else if (G.next_i >= G.total && G.running) maybe_done();
}

static void connect_failed(Conn *c, int err) {
    G.connect_failures++;
    char key[64];
    snprintf(key, sizeof key, "connect: %s", exc_name(err));
    counter_add(&G.errors, key, strlen(key), 1);
    c->state = C_IDLE;
    if (c->initial) {
        c->initial = 0;
        G.init_outstanding--;
        G.init_failed++;
        if (!G.first_errno) G.first_errno = err;
    }
    if (c->retry && !G.stopping) schedule_reopen(c, 0.2);
}

static void connected(Conn *c) {
    c->state = C_OPEN;
    c->need = -1;
    c->len = 0;
    if (c->initial) {
        c->initial = 0;
        G.init_outstanding--;
    }
    ep_set(c, EPOLL_CTL_MOD, EPOLLIN);
    on_free(c);
}

/* try the addresses from `from` on; the last error is reported if none connects */
static void start_connect(Conn *c, int from, int last_err) {
    for (int a = from; a < G.naddrs; a++) {
        struct addrinfo *ai = G.addrs[a];
        int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            last_err = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        c->fd = fd;
        c->addr_i = a;
        c->want_out = 0;
        int r = connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (r == 0 || errno == EINPROGRESS) {
            c->state = C_CONNECTING;
            ep_set(c, EPOLL_CTL_ADD, EPOLLOUT);
            if (r == 0) connected(c);
            return;
        }
        last_err = errno;
        close_socket(c);
    }
    connect_failed(c, last_err ? last_err : ECONNREFUSED);
}

static void connecting_ready(Conn *c) {
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
    if (err == 0) {
        connected(c);
        return;
    }
    int next = c->addr_i + 1;
    close_socket(c);
    start_connect(c, next, err);
}

/* Python's int() of a short ASCII field: surrounding whitespace, an optional sign, digits */
static int parse_int(const char *s, const char *e, long long *out) {
    while (s < e && is_space((unsigned char)*s)) s++;
    while (e > s && is_space((unsigned char)e[-1])) e--;
    int neg = 0;
    if (s < e && (*s == '+' || *s == '-')) neg = *s++ == '-';
    if (s == e) return 0;
    long long v = 0;
    for (; s < e; s++) {
        if (*s == '_' ) continue;
        if (*s < '0' || *s > '9' || v > (LLONG_MAX - 9) / 10) return 0;
        v = v * 10 + (*s - '0');
    }
    *out = neg ? -v : v;
    return 1;
}

/* the whole answer is in c->buf: record it; then the connection is free again (or closed) */
static void complete(Conn *c, int from_close) {
    char *buf = c->buf, *head_end = c->buf + c->head_len;
    long long status;
    size_t hs = c->head_len < 12 ? c->head_len : 12;
    if (hs < 9 || !parse_int(buf + 9, buf + hs, &status) || status < 0 || status > 1000000) {
        c->need = -1;
        if (!from_close) conn_lost(c, "ValueError");
        else {
            c->has_req = 0;
            G.inflight--;
            record(c->req_sched, c->req_sent, -1, NULL, 0, 0, "closed with a request in flight (ValueError)");
        }
        return;
    }
    const char *version = NULL;
    size_t vlen = 0;
    char *i = memmem(buf, c->head_len, "\r\nx-model-version:", 18);
    if (i) {
        char *s = i + 18, *e = memmem(i + 2, (size_t)(head_end - (i + 2)), "\r\n", 2);
        while (s < e && is_space((unsigned char)*s)) s++;
        while (e > s && is_space((unsigned char)e[-1])) e--;
        version = s, vlen = (size_t)(e - s);
    }
    int body_ok = 1;
    if (status >= 200 && status < 300) {
        char *body = buf + c->head_len + 2;
        size_t blen = c->len - c->head_len - 2;
        body_ok = memmem(body, blen, "\"pctr\"", 6) != NULL;
        if (!version) {
            char *j = memmem(body, blen, "\"model_version\":\"", 17);
            if (j) {
                char *s = j + 17, *e = memchr(s, '"', (size_t)(body + blen - s));
                if (e) version = s, vlen = (size_t)(e - s);
            }
        }
    }
    int close_after = memmem(buf, c->head_len, "\r\nconnection: close", 19) != NULL;
    double sched = c->req_sched, sent = c->req_sent;
    c->has_req = 0;
    G.inflight--;
    c->len = 0;  /* the bytes stay where they are until the next read: `version` points into them */
    c->need = -1;
    record(sched, sent, (int)status, version, vlen, body_ok, NULL);
    if (from_close) return;
    if (close_after) conn_lost(c, NULL);  /* reopened like any lost connection */
    else on_free(c);
}

static void handle_read(Conn *c) {
    if (c->cap - c->len < READ_CHUNK) {
        c->cap = c->len + READ_CHUNK * 2;
        c->buf = xrealloc(c->buf, c->cap);
    }
    ssize_t r = recv(c->fd, c->buf + c->len, c->cap - c->len, 0);
    if (r < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
        conn_lost(c, exc_name(errno));
        return;
    }
    if (r == 0) {
        conn_lost(c, NULL);
        return;
    }
    if (!c->has_req) {  /* bytes nobody asked for: loadgen.py drops such a connection too */
        c->len = 0;
        conn_lost(c, NULL);
        return;
    }
    size_t old = c->len;
    c->len += (size_t)r;
    char *buf = c->buf;
    if (c->need == -1) {
        size_t from = old >= 3 ? old - 3 : 0;
        char *e = memmem(buf + from, c->len - from, "\r\n\r\n", 4);
        if (!e) return;
        size_t end = (size_t)(e - buf);
        c->head_len = end + 2;
        for (size_t k = 0; k < c->head_len; k++)
            if (buf[k] >= 'A' && buf[k] <= 'Z') buf[k] = (char)(buf[k] + 32);
        char *i = memmem(buf, c->head_len, "\r\ncontent-length:", 17);
        if (i) {
            char *le = memmem(i + 2, (size_t)(buf + c->head_len - (i + 2)), "\r\n", 2);
            long long n;
            if (!parse_int(i + 17, le, &n) || n < 0) {
                conn_lost(c, "ValueError");
                return;
            }
            c->need = (long long)end + 4 + n;
        } else if (memmem(buf, c->head_len, "\r\ntransfer-encoding: chunked", 28)) {
            c->need = -2;
        } else {
            c->need = -3;  /* no length: the body ends with the connection */
            return;
        }
    }
    if (c->need == -2) {
        if (!(c->len >= 5 && memcmp(buf + c->len - 5, "0\r\n\r\n", 5) == 0)) return;
    } else if (c->need == -3 || (long long)c->len < c->need) {
        return;
    }
    complete(c, 0);
}

static void handle_event(const struct epoll_event *e) {
    if (e->data.u64 == TFD_TAG) {  /* no read(): re-arming it (timerfd_settime) clears it */
        G.tfd_armed = -1;
        return;
    }
    uint32_t idx = (uint32_t)e->data.u64, gen = (uint32_t)(e->data.u64 >> 32);
    Conn *c = &G.conns[idx];
    if (gen != c->gen || c->fd < 0) return;  /* an event of a socket closed meanwhile */
    if (c->state == C_CONNECTING) {
        connecting_ready(c);
        return;
    }
    if ((e->events & EPOLLOUT) && c->out) {
        flush_out(c);
        if (gen != c->gen) return;
    }
    if (e->events & (EPOLLIN | EPOLLHUP | EPOLLERR)) handle_read(c);
}

/* ---- waiting -------------------------------------------------------------------------------- */

static int wait_until(double deadline, struct epoll_event *ev) {
    double dt = deadline - mono();
    if (dt < 0) dt = 0;
    int n;
    for (;;) {
        if (G.wait_mode == 0) {
#ifdef HAVE_EPOLL_PWAIT2
            struct timespec ts;
            if (isinf(dt) || dt > 3600) dt = 3600;
            ts.tv_sec = (time_t)dt;
            ts.tv_nsec = (long)((dt - (double)ts.tv_sec) * 1e9);
            if (ts.tv_nsec > 999999999) ts.tv_nsec = 999999999;
            n = epoll_pwait2(G.ep, ev, MAX_EVENTS, &ts, NULL);
            if (n < 0 && errno == ENOSYS) {
                G.wait_mode = 1;
                continue;
            }
#else
            G.wait_mode = 1;
            continue;
#endif
        } else if (G.wait_mode == 1) {
            if (dt == 0) {
                n = epoll_wait(G.ep, ev, MAX_EVENTS, 0);
            } else {
                if (G.tfd < 0) {
                    G.tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
                    if (G.tfd < 0) die("timerfd_create: %s", strerror(errno));
                    struct epoll_event tev = {.events = EPOLLIN, .data.u64 = TFD_TAG};
                    if (epoll_ctl(G.ep, EPOLL_CTL_ADD, G.tfd, &tev) < 0) die("epoll_ctl: %s", strerror(errno));
                }
                double at = isinf(deadline) ? mono() + 3600 : deadline;
                if (at != G.tfd_armed) {
                    struct itimerspec its = {{0, 0}, {0, 0}};
                    its.it_value.tv_sec = (time_t)at;
                    its.it_value.tv_nsec = (long)((at - (double)its.it_value.tv_sec) * 1e9);
                    if (its.it_value.tv_nsec > 999999999) its.it_value.tv_nsec = 999999999;
                    if (its.it_value.tv_sec == 0 && its.it_value.tv_nsec == 0) its.it_value.tv_nsec = 1;
                    if (timerfd_settime(G.tfd, TFD_TIMER_ABSTIME, &its, NULL) < 0)
                        die("timerfd_settime: %s", strerror(errno));
                    G.tfd_armed = at;
                }
                n = epoll_wait(G.ep, ev, MAX_EVENTS, -1);
            }
        } else {
            int ms = isinf(dt) || dt > 3600 ? 3600000 : (int)ceil(dt * 1e3);
            n = epoll_wait(G.ep, ev, MAX_EVENTS, ms);
        }
        if (n < 0 && errno == EINTR) return 0;
        if (n < 0) die("epoll wait: %s", strerror(errno));
        return n;
    }
}

/* ---- the run -------------------------------------------------------------------------------- */

static void fmt_ms(char *out, size_t n, int have, double x) {
    if (!have) snprintf(out, n, "-");
    else snprintf(out, n, "%.2f ms", x * 1e3);
}

static void fmt_commas(char *out, size_t n, long long v) {
    char digits[32];
    snprintf(digits, sizeof digits, "%lld", v < 0 ? -v : v);
    size_t len = strlen(digits), o = 0;
    if (v < 0 && o + 1 < n) out[o++] = '-';
    for (size_t k = 0; k < len && o + 2 < n; k++) {
        if (k && (len - k) % 3 == 0) out[o++] = ',';
        out[o++] = digits[k];
    }
    out[o] = 0;
}

/* the nearest-rank q-quantile of v[from..n) (copied; v stays as it is) */
static int quantile_of(const dvec *v, size_t from, double q, double *out) {
    size_t n = v->n - from;
    if (n == 0) return 0;
    G.tmp.n = 0;
    for (size_t k = from; k < v->n; k++) dvec_push(&G.tmp, v->v[k]);
    *out = kth(G.tmp.v, (long)n, (long)rank_index(n, q));
    return 1;
}

/* progress lines, and the open-loop abort once some request has waited too long */
static void watch(double now) {
    if (!G.closed_loop && !G.aborted && G.abort_after > 0) {
        enqueue_due(now);
        double oldest = now;
        for (int k = 0; k < G.nconns; k++)
            if (G.conns[k].has_req && G.conns[k].req_sched < oldest) oldest = G.conns[k].req_sched;
        if (G.q_len && sched_time(G.q[G.q_head]) < oldest) oldest = sched_time(G.q[G.q_head]);
        if (now - oldest > G.abort_after) {
            G.aborted = 1;
            G.total = G.next_i;  /* schedule nothing more */
            note("aborted at %.1f s: a request has waited %.1f s (overloaded)", now - G.start, now - oldest);
            G.done = 1;
            G.watch_done = 1;
            return;
        }
    }
    if (G.progress > 0 && now - G.progress_last >= G.progress) {
        G.progress_last = now;
        double w = 0, t = 0;
        int hw = quantile_of(&G.latency, G.progress_mark, .99, &w);
        G.progress_mark = G.latency.n;
        int ht = quantile_of(&G.latency, 0, .99, &t);
        char ws[32], ts[32], ns[32], es[48] = "";
        fmt_ms(ws, sizeof ws, hw, w);
        fmt_ms(ts, sizeof ts, ht, t);
        fmt_commas(ns, sizeof ns, (long long)G.latency.n);
        long long n_err = counter_sum(&G.errors);
        if (n_err) snprintf(es, sizeof es, ", %lld ERRORS", n_err);
        note("%5.1f s: p99 %s last %g s, %s so far; %s answered%s", now - G.start, ws, G.progress, ts, ns, es);
    }
}

static void sb_summary_ms(sbuf *b, dvec *v) {  /* sorts v */
    static const char *names[] = {"p50", "p90", "p95", "p99", "p99.9"};
    static const double qs[] = {.50, .90, .95, .99, .999};
    size_t n = v->n;
    qsort(v->v, n, sizeof(double), cmp_double);
    sb_puts(b, "{");
    for (int k = 0; k < 5; k++) {
        sb_printf(b, "\"%s\": ", names[k]);
        if (n) sb_float(b, pyround(v->v[rank_index(n, qs[k])] * 1e3, 4));
        else sb_puts(b, "null");
        sb_puts(b, ", ");
    }
    sb_puts(b, "\"max\": ");
    if (n) sb_float(b, pyround(v->v[n - 1] * 1e3, 4));
    else sb_puts(b, "null");
    sb_puts(b, ", \"mean\": ");
    if (n) {
        double s = 0;
        for (size_t k = 0; k < n; k++) s += v->v[k];
        sb_float(b, pyround(s / (double)n * 1e3, 4));
    } else {
        sb_puts(b, "null");
    }
    sb_puts(b, "}");
}

/* counted requests by the second they were scheduled in: count, p50, p99, max (ms) */
static void sb_per_second(sbuf *b) {
    size_t n = G.sched.n;
    sb_puts(b, "[");
    if (n == 0) {
        sb_puts(b, "]");
        return;
    }
    long long lo = 0, hi = 0;
    long long *key = xrealloc(NULL, n * sizeof(long long));
    for (size_t k = 0; k < n; k++) {
        key[k] = (long long)G.sched.v[k];  /* int(): toward zero */
        if (k == 0 || key[k] < lo) lo = key[k];
        if (k == 0 || key[k] > hi) hi = key[k];
    }
    size_t nb = (size_t)(hi - lo + 1);
    size_t *start = xrealloc(NULL, (nb + 1) * sizeof(size_t));
    memset(start, 0, (nb + 1) * sizeof(size_t));
    for (size_t k = 0; k < n; k++) start[key[k] - lo + 1]++;
    for (size_t k = 0; k < nb; k++) start[k + 1] += start[k];
    size_t *fill = xrealloc(NULL, nb * sizeof(size_t));
    memcpy(fill, start, nb * sizeof(size_t));
    double *vals = xrealloc(NULL, n * sizeof(double));
    for (size_t k = 0; k < n; k++) vals[fill[key[k] - lo]++] = G.latency.v[k];
    int first = 1;
    for (size_t s = 0; s < nb; s++) {
        size_t m = start[s + 1] - start[s];
        if (!m) continue;
        double *v = vals + start[s];
        qsort(v, m, sizeof(double), cmp_double);
        if (!first) sb_puts(b, ", ");
        first = 0;
        sb_printf(b, "{\"s\": %lld, \"n\": %zu, \"p50\": ", lo + (long long)s, m);
        sb_float(b, pyround(v[rank_index(m, .5)] * 1e3, 3));
        sb_puts(b, ", \"p99\": ");
        sb_float(b, pyround(v[rank_index(m, .99)] * 1e3, 3));
        sb_puts(b, ", \"max\": ");
        sb_float(b, pyround(v[m - 1] * 1e3, 3));
        sb_puts(b, "}");
    }
    sb_puts(b, "]");
    free(key), free(start), free(fill), free(vals);
}

static void print_result(size_t unfinished, double stopped, double cpu, double wall) {
    double window = G.closed_loop ? G.duration : (fmin(stopped, G.end) - G.measure_from);
    size_t answered = G.service.n;
    long long ok = 0;
    for (size_t k = 0; k < G.status.n; k++)
        if (G.status.keys[k][0] == '2') ok += G.status.counts[k];
    ok -= counter_get(&G.errors, "2xx without pctr");
    if (unfinished) counter_add(&G.errors, "unfinished", 10, (long long)unfinished);
    sbuf b = {0};
    sb_printf(&b, "{\"mode\": \"%s\", \"offered_rate\": ", G.closed_loop ? "closed" : "open");
    if (G.closed_loop) sb_puts(&b, "null");
    else sb_float(&b, G.rate);
    sb_printf(&b, ", \"connections\": %d, \"warmup_s\": ", G.closed_loop ? G.closed : G.connections);
    sb_float(&b, G.warmup);
    sb_puts(&b, ", \"duration_s\": ");
    sb_float(&b, G.duration);
    sb_puts(&b, ", \"measured_s\": ");
    sb_float(&b, pyround(window, 3));
    sb_puts(&b, ", \"scheduled\": ");
    if (G.closed_loop) sb_puts(&b, "null");
    else sb_printf(&b, "%zu", G.sched.n);
    sb_printf(&b, ", \"answered\": %zu, \"ok\": %lld, \"ok_per_s\": ", answered, ok);
    if (window > 0) sb_float(&b, pyround((double)G.ok_in_window / window, 1));
    else sb_puts(&b, "null");
    sb_puts(&b, ", \"status\": ");
    sb_counter(&b, &G.status);
    sb_puts(&b, ", \"errors\": ");
    sb_counter(&b, &G.errors);
    sb_printf(&b, ", \"error_count\": %lld, \"aborted\": %s, \"unfinished\": %zu", counter_sum(&G.errors),
              G.aborted ? "true" : "false", unfinished);
    /* per_second before the latencies are sorted: it pairs them with their scheduled times */
    sbuf ps = {0};
    sb_per_second(&ps);
    sb_puts(&b, ", \"latency_ms\": ");
    sb_summary_ms(&b, &G.latency);
    sb_puts(&b, ", \"service_ms\": ");
    sb_summary_ms(&b, &G.service);
    sb_puts(&b, ", \"lag_ms\": ");
    sb_summary_ms(&b, &G.lag);
    sb_puts(&b, ", \"versions\": ");
    sb_counter(&b, &G.versions);
    sb_printf(&b, ", \"reconnects\": %lld, \"connect_failures\": %lld, \"loadgen_cpu_s\": ", G.reconnects,
              G.connect_failures);
    sb_float(&b, pyround(cpu, 3));
    sb_puts(&b, ", \"loadgen_cpu_share\": ");
    if (wall > 0) sb_float(&b, pyround(cpu / wall, 3));
    else sb_puts(&b, "null");
    sb_puts(&b, ", \"per_second\": ");
    sb_put(&b, ps.s, ps.n);
    sb_puts(&b, "}\n");
    fwrite(b.s, 1, b.n, stdout);
    fflush(stdout);
    free(b.s), free(ps.s);
}

static void fatal_json(const char *msg) {
    sbuf b = {0};
    sb_puts(&b, "{\"fatal\": ");
    sb_json_str(&b, msg, strlen(msg));
    sb_puts(&b, "}\n");
    fwrite(b.s, 1, b.n, stdout);
    fflush(stdout);
    exit(2);
}

static void build_requests(void) {
    FILE *f = fopen(G.bodies, "rb");
    if (!f) die("%s: %s", G.bodies, strerror(errno));
    sbuf all = {0};
    char chunk[65536];
    size_t r;
    while ((r = fread(chunk, 1, sizeof chunk, f)) > 0) sb_put(&all, chunk, r);
    fclose(f);
    char head[2048];
    int hn = snprintf(head, sizeof head, "POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: %s\r\nContent-Length: ",
                      G.path, G.host, G.port, G.ctype);
    if (hn < 0 || (size_t)hn >= sizeof head) die("--path, --host or --content-type too long");
    size_t cap = 0;
    for (size_t pos = 0; pos < all.n;) {
        char *nl = memchr(all.s + pos, '\n', all.n - pos);
        size_t end = nl ? (size_t)(nl - all.s) : all.n;
        const char *line = all.s + pos;
        size_t len = end - pos;
        pos = end + 1;
        int blank = 1;
        for (size_t k = 0; k < len && blank; k++) blank = is_space((unsigned char)line[k]);
        if (blank) continue;  /* loadgen.py skips lines that strip() to nothing */
        if (G.nreq == cap) {
            cap = cap ? cap * 2 : 1024;
            G.req = xrealloc(G.req, cap * sizeof(char *));
            G.req_len = xrealloc(G.req_len, cap * sizeof(size_t));
        }
        sbuf rq = {0};
        sb_put(&rq, head, (size_t)hn);
        sb_printf(&rq, "%zu\r\n\r\n", len);
        sb_put(&rq, line, len);
        G.req[G.nreq] = rq.s;
        G.req_len[G.nreq++] = rq.n;
    }
    free(all.s);
    if (!G.nreq) die("%s: no request bodies", G.bodies);
}

static const char *USAGE =
    "usage: loadgen [-h] [--host HOST] --port PORT [--path PATH] [--content-type CONTENT_TYPE]\n"
    "               --bodies BODIES [--rate RATE] [--connections CONNECTIONS] [--closed CLOSED]\n"
    "               [--duration DURATION] [--warmup WARMUP] [--drain DRAIN] [--abort-after ABORT_AFTER]\n"
    "               [--progress PROGRESS] [--label LABEL]\n"
    "               [--selector {precise,select,epoll,pwait2}]\n";

static void usage_error(const char *fmt, ...) {
    va_list ap;
    fputs(USAGE, stderr);
    fputs("loadgen: error: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(2);
}

static double arg_float(const char *opt, const char *v) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    while (*end && is_space((unsigned char)*end)) end++;
    if (end == v || *end || errno == ERANGE) usage_error("argument %s: invalid float value: '%s'", opt, v);
    return x;
}

static int arg_int(const char *opt, const char *v) {
    long long x;
    if (!parse_int(v, v + strlen(v), &x) || x < INT32_MIN || x > INT32_MAX)
        usage_error("argument %s: invalid int value: '%s'", opt, v);
    return (int)x;
}

static void parse_args(int argc, char **argv) {
    G.host = "127.0.0.1", G.path = "/v1/predict", G.ctype = "application/json", G.label = "";
    G.selector = "precise";
    G.connections = 64, G.duration = 10.0, G.warmup = 2.0, G.drain = 2.0, G.abort_after = 2.0;
    int have_port = 0;
    for (int k = 1; k < argc; k++) {
        char *a = argv[k];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(USAGE, stdout);
            fputs("\nThe load generator of bench/serving.py, in C: see bench/loadgen.c's head comment.\n", stdout);
            exit(0);
        }
        if (strncmp(a, "--", 2) != 0) usage_error("unrecognized arguments: %s", a);
        char name[64];
        const char *val;
        char *eq = strchr(a, '=');
        if (eq) {
            snprintf(name, sizeof name, "%.*s", (int)(eq - a), a);
            val = eq + 1;
        } else {
            snprintf(name, sizeof name, "%s", a);
            if (k + 1 >= argc) usage_error("argument %s: expected one argument", name);
            val = argv[++k];
        }
        if (!strcmp(name, "--host")) G.host = val;
        else if (!strcmp(name, "--port")) G.port = arg_int(name, val), have_port = 1;
        else if (!strcmp(name, "--path")) G.path = val;
        else if (!strcmp(name, "--content-type")) G.ctype = val;
        else if (!strcmp(name, "--bodies")) G.bodies = val;
        else if (!strcmp(name, "--rate")) G.rate = arg_float(name, val);
        else if (!strcmp(name, "--connections")) G.connections = arg_int(name, val);
        else if (!strcmp(name, "--closed")) G.closed = arg_int(name, val);
        else if (!strcmp(name, "--duration")) G.duration = arg_float(name, val);
        else if (!strcmp(name, "--warmup")) G.warmup = arg_float(name, val);
        else if (!strcmp(name, "--drain")) G.drain = arg_float(name, val);
        else if (!strcmp(name, "--abort-after")) G.abort_after = arg_float(name, val);
        else if (!strcmp(name, "--progress")) G.progress = arg_float(name, val);
        else if (!strcmp(name, "--label")) G.label = val;
        else if (!strcmp(name, "--selector")) {
            if (strcmp(val, "precise") && strcmp(val, "select") && strcmp(val, "epoll") && strcmp(val, "pwait2"))
                usage_error("argument --selector: invalid choice: '%s' (choose from 'precise', 'select', "
                            "'epoll', 'pwait2')", val);
            G.selector = val;
        } else usage_error("unrecognized arguments: %s", a);
    }
    if (!have_port || !G.bodies)
        usage_error("the following arguments are required: %s",
                    !have_port && !G.bodies ? "--port, --bodies" : !have_port ? "--port" : "--bodies");
    if ((G.rate > 0) == (G.closed > 0)) usage_error("give exactly one of --rate R (open loop) or --closed K");
    if (G.closed <= 0 && G.connections < 1) usage_error("--connections: want at least 1");
    G.wait_mode = !strcmp(G.selector, "epoll") ? 2 : !strcmp(G.selector, "pwait2") ? 0 : 1;
}

int main(int argc, char **argv) {
    parse_args(argc, argv);
    build_requests();
    signal(SIGPIPE, SIG_IGN);
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  /* wake-ups within ~1 us of the deadline, not 50 us */

    G.closed_loop = G.closed > 0;
    G.total = G.closed_loop ? 0 : llrint(G.rate * (G.warmup + G.duration));  /* half to even, as round() */
    G.tfd = -1;
    G.tfd_armed = -1;
    G.ep = epoll_create1(EPOLL_CLOEXEC);
    if (G.ep < 0) die("epoll_create1: %s", strerror(errno));

    char port[16];
    snprintf(port, sizeof port, "%d", G.port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    int gai = getaddrinfo(G.host, port, &hints, &G.ai);
    if (gai != 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "could not connect to %s:%d: %s", G.host, G.port, gai_strerror(gai));
        fatal_json(msg);
    }
    for (struct addrinfo *p = G.ai; p; p = p->ai_next) {
        G.addrs = xrealloc(G.addrs, (size_t)(G.naddrs + 1) * sizeof *G.addrs);
        G.addrs[G.naddrs++] = p;
    }

    /* every connection, at once; the run starts when all have connected or failed */
    G.nconns = G.closed_loop ? G.closed : G.connections;
    G.conns = xrealloc(NULL, (size_t)G.nconns * sizeof(Conn));
    memset(G.conns, 0, (size_t)G.nconns * sizeof(Conn));
    G.freeq = xrealloc(NULL, (size_t)G.nconns * sizeof(int));
    G.init_outstanding = G.nconns;
    for (int k = 0; k < G.nconns; k++) {
        Conn *c = &G.conns[k];
        c->fd = -1;
        c->need = -1;
        c->initial = 1;
        start_connect(c, 0, 0);
    }
    struct epoll_event ev[MAX_EVENTS];
    while (G.init_outstanding > 0) {
        int n = epoll_wait(G.ep, ev, MAX_EVENTS, -1);
        if (n < 0 && errno != EINTR) die("epoll_wait: %s", strerror(errno));
        for (int k = 0; k < n; k++) handle_event(&ev[k]);
    }
    if (G.init_failed == G.nconns) {
        char msg[512];
        snprintf(msg, sizeof msg, "could not connect to %s:%d: [Errno %d] %s", G.host, G.port, G.first_errno,
                 strerror(G.first_errno));
        fatal_json(msg);
    }

    double cpu0 = cpu_seconds(), wall0 = mono();
    double t0 = mono();
    G.start = t0 + 0.05;
    G.measure_from = G.start + G.warmup;
    G.end = G.measure_from + G.duration;
    G.progress_last = t0;
    double watch_next = t0 + 0.25;
    double deadline_all = t0 + G.warmup + G.duration + 0.05 + G.drain;  /* open loop */
    double drain_deadline = INFINITY;                                  /* closed loop, once stopping */
    int phase = 0;
    if (!G.closed_loop) G.running = 1;

    for (;;) {
        double now = mono();
        if (!G.closed_loop) {
            if (phase == 0) {
                if (now >= G.start) {
                    phase = 1;
                    pump();
                }
            } else if (G.next_i < G.total && G.free_len && sched_time(G.next_i) <= now) {
                pump();
            }
            if (now >= deadline_all) break;
        } else {
            if (phase == 0 && now >= G.start) {
                phase = 1;
                G.running = 1;
                while (G.free_len) do_send(free_pop(), mono());
            }
            if (phase == 1 && now >= G.end) {
                phase = 2;
                G.stopping = 1;
                maybe_done();
                drain_deadline = mono() + G.drain;
            }
            if (phase == 2 && now >= drain_deadline) break;
        }
        if (G.pending_reopens) {
            for (int k = 0; k < G.nconns; k++) {
                Conn *c = &G.conns[k];
                if (c->reopen_pending && now >= c->reopen_at) {
                    c->reopen_pending = 0;
                    G.pending_reopens--;
                    start_connect(c, 0, 0);
                }
            }
        }
        if (!G.watch_done && now >= watch_next) {
            watch(now);
            watch_next = mono() + 0.25;
        }
        if (G.done && (!G.closed_loop || phase == 2)) break;

        double dl = watch_next;
        if (!G.closed_loop) {
            /* no wake-up for a due request while no connection is free: it could only be queued, and
               the queue is filled up when a connection frees (on_free), by the watch and at the stop */
            if (phase == 0) dl = fmin(dl, G.start);
            else if (G.next_i < G.total && G.free_len) dl = fmin(dl, sched_time(G.next_i));
            dl = fmin(dl, deadline_all);
        } else {
            dl = fmin(dl, phase == 0 ? G.start : phase == 1 ? G.end : drain_deadline);
        }
        if (G.pending_reopens)
            for (int k = 0; k < G.nconns; k++)
                if (G.conns[k].reopen_pending) dl = fmin(dl, G.conns[k].reopen_at);
        int n = wait_until(dl, ev);
        for (int k = 0; k < n; k++) handle_event(&ev[k]);
        if (G.done && (!G.closed_loop || phase == 2)) break;
    }

    double stopped = mono();
    G.stopping = 1;
    size_t unfinished = 0;
    if (!G.closed_loop) {  /* waited on and never answered: counted with the time they waited */
        enqueue_due(stopped);
        for (int k = 0; k < G.nconns; k++) {
            Conn *c = &G.conns[k];
            if (c->has_req && c->req_sched >= G.measure_from) {
                dvec_push(&G.latency, stopped - c->req_sched);
                dvec_push(&G.sched, c->req_sched - G.measure_from);
                unfinished++;
            }
        }
        for (size_t k = 0; k < G.q_len; k++) {
            double s = sched_time(G.q[(G.q_head + k) % G.q_cap]);
            if (s >= G.measure_from) {
                dvec_push(&G.latency, stopped - s);
                dvec_push(&G.sched, s - G.measure_from);
                unfinished++;
            }
        }
    }
    double cpu = cpu_seconds() - cpu0, wall = mono() - wall0;
    for (int k = 0; k < G.nconns; k++) {
        G.conns[k].has_req = 0;  /* counted above as unfinished, not as a closed connection */
        if (G.conns[k].fd >= 0) close(G.conns[k].fd);
    }
    print_result(unfinished, stopped, cpu, wall);
    return 0;
}
