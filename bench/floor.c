/* The floor in C: bench/floor.py's server, line for line, without the interpreter.
 *
 *   floor-native serve --upstreams FILE --listen HOST:PORT --middle FILE [--admin HOST:PORT]
 *
 * Started by `bench/floor.py --native ...`, which encodes the response's constant part (resources,
 * type URL, control plane: eds-server's bytes) into the --middle file, compiles this file with gcc
 * into bench/results/ and execs it. One epoll loop: HTTP/2 by hand (preface, SETTINGS both ways,
 * PING, WINDOW_UPDATE both ways, RST_STREAM, GOAWAY; request header blocks are not decoded), requests
 * cut into gRPC messages only to tell a first request from an ACK, a change learnt from inotify and
 * written to every answered stream as one iovec list and one sendmsg per connection. SIGUSR1 and
 * SIGTERM print the counters to stderr, as the Python floor does.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/inotify.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

enum { DATA = 0, HEADERS = 1, RST_STREAM = 3, SETTINGS = 4, PING = 6, GOAWAY = 7, WINDOW_UPDATE = 8 };
enum { FLAG_ACK = 1, END_HEADERS = 4, PADDED = 8 };
#define OUR_WINDOW 0x7fffffffu
#define OUR_MAX_FRAME (1u << 17)
#define NIOV 1024

static const uint8_t PREFACE[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
static const uint8_t RESPONSE_HEADERS[] = "\x88\x0f\x10\x10" "application/grpc";

typedef struct {
    uint32_t id;
    int64_t window;
    uint32_t need;
    uint8_t head[5];
    uint8_t headlen, answered, open, blocked;
    uint64_t consumed;
} Stream;

typedef struct {  /* a piece of output: in the connection's arena (base NULL) or in a body */
    const uint8_t *base;
    size_t off, len;
} Piece;

typedef struct {
    int fd, preface, writing;
    uint8_t *rbuf;
    size_t rlen, rcap;
    Piece *out;
    size_t ohead, olen, ocap;
    uint8_t *arena;
    size_t alen, acap;
    Stream *streams;  /* indexed by id >> 1 (client streams are odd) */
    size_t nstreams;
    int64_t send_window, peer_initial;
    uint32_t peer_max_frame;
    uint64_t consumed;
    size_t nblocked;
} Conn;

static uint8_t *middle, *body;
static size_t middle_len, body_len;
static uint64_t version;
static volatile sig_atomic_t want_report, want_stop;
static struct {
    unsigned long connections, streams, responses, acks, changes, sendmsg, sendmsg_partial;
    unsigned long long bytes_sent, bytes_read;
} st;
static int ep;

static void *xrealloc(void *p, size_t n) {
    p = realloc(p, n);
    if (!p) { perror("floor: realloc"); exit(1); }
    return p;
}

static void report(void) {
    fprintf(stderr, "floor: connections %lu, streams %lu, responses %lu, acks %lu, changes %lu, sendmsg %lu, "
            "sendmsg_partial %lu, bytes_sent %llu, bytes_read %llu\n", st.connections, st.streams, st.responses,
            st.acks, st.changes, st.sendmsg, st.sendmsg_partial, st.bytes_sent, st.bytes_read);
    fflush(stderr);
}

static void on_signal(int sig) { if (sig == SIGTERM) want_stop = 1; else want_report = 1; }

static void make_body(void) {  /* gRPC prefix, version_info (1), middle, nonce (5): bench/floor.py's layout */
    char ver[17], nonce[24];
    snprintf(ver, sizeof ver, "%016llx", (unsigned long long)version);
    int nlen = snprintf(nonce, sizeof nonce, "%llu", (unsigned long long)version + 1);
    size_t msg = 2 + 16 + middle_len + 2 + (size_t)nlen;
    body_len = 5 + msg;
    body = malloc(body_len);  /* older bodies stay: output may still point into them (a few per run) */
    if (!body) { perror("floor: malloc"); exit(1); }
    uint8_t *p = body;
    *p++ = 0; *p++ = msg >> 24; *p++ = msg >> 16; *p++ = msg >> 8; *p++ = msg;
    *p++ = 0x0a; *p++ = 0x10; memcpy(p, ver, 16); p += 16;
    memcpy(p, middle, middle_len); p += middle_len;
    *p++ = 0x2a; *p++ = (uint8_t)nlen; memcpy(p, nonce, (size_t)nlen);
}

static void put(Conn *c, const uint8_t *base, size_t off, size_t len) {
    if (c->olen == c->ocap) { c->ocap = c->ocap ? 2 * c->ocap : 1024; c->out = xrealloc(c->out, c->ocap * sizeof(Piece)); }
    c->out[c->olen++] = (Piece){base, off, len};
}

static void put_frame(Conn *c, uint32_t len, uint8_t type, uint8_t flags, uint32_t sid, const void *payload, size_t plen) {
    if (c->alen + 9 + plen > c->acap) { c->acap = 2 * (c->alen + 9 + plen) + 4096; c->arena = xrealloc(c->arena, c->acap); }
    uint8_t *h = c->arena + c->alen;
    h[0] = len >> 16; h[1] = len >> 8; h[2] = len; h[3] = type; h[4] = flags;
    h[5] = sid >> 24; h[6] = sid >> 16; h[7] = sid >> 8; h[8] = sid;
    if (plen) memcpy(h + 9, payload, plen);
    put(c, NULL, c->alen, 9 + plen);
    c->alen += 9 + plen;
}

static void close_conn(Conn *c) {  /* freed after the events at hand (they may name it): see reap */
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    c->fd = -1;
}

/* Everything queued, NIOV pieces a sendmsg; the rest when writable. 0 when the connection is gone. */
static int flush(Conn *c) {
    struct iovec iov[NIOV];
    while (c->ohead < c->olen) {
        size_t n = 0, total = 0;
        for (size_t i = c->ohead; i < c->olen && n < NIOV; i++, n++) {
            Piece *p = &c->out[i];
            iov[n].iov_base = (void *)((p->base ? p->base : c->arena) + p->off);
            iov[n].iov_len = p->len;
            total += p->len;
        }
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = n};
        ssize_t sent = sendmsg(c->fd, &m, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno != EAGAIN && errno != EINTR) { close_conn(c); return 0; }
            sent = 0;
        }
        st.sendmsg++;
        st.bytes_sent += (unsigned long long)sent;
        size_t left = (size_t)sent, i = c->ohead;
        while (i < c->olen && left >= c->out[i].len) left -= c->out[i++].len;
        c->ohead = i;
        if ((size_t)sent == total) continue;
        st.sendmsg_partial++;
        c->out[i].off += left;
        c->out[i].len -= left;
        if (!c->writing) {
            struct epoll_event e = {.events = EPOLLIN | EPOLLOUT, .data.ptr = c};
            epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &e);
            c->writing = 1;
        }
        return 1;
    }
    c->ohead = c->olen = c->alen = 0;
    if (c->writing) {
        struct epoll_event e = {.events = EPOLLIN, .data.ptr = c};
        epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &e);
        c->writing = 0;
    }
    return 1;
}

static Stream *stream_of(Conn *c, uint32_t sid) {
    size_t k = sid >> 1;
    if (!(sid & 1) || k >= c->nstreams || !c->streams[k].open) return NULL;
    return &c->streams[k];
}

/* The current body's DATA frames for one stream, if both windows take it (else owed). */
static void queue(Conn *c, Stream *s) {
    if ((int64_t)body_len > s->window || (int64_t)body_len > c->send_window) {
        if (!s->blocked) { s->blocked = 1; c->nblocked++; }
        return;
    }
    s->window -= (int64_t)body_len;
    c->send_window -= (int64_t)body_len;
    for (size_t off = 0; off < body_len; off += c->peer_max_frame) {
        size_t n = body_len - off < c->peer_max_frame ? body_len - off : c->peer_max_frame;
        put_frame(c, (uint32_t)n, DATA, 0, s->id, NULL, 0);
        put(c, body, off, n);
    }
    st.responses++;
}

static void unblock(Conn *c) {
    for (size_t k = 0; k < c->nstreams && c->nblocked; k++) {
        Stream *s = &c->streams[k];
        if (s->open && s->blocked) { s->blocked = 0; c->nblocked--; queue(c, s); }
    }
}

static void message(Conn *c, Stream *s) {
    if (s->answered) { st.acks++; return; }
    s->answered = 1;
    put_frame(c, sizeof RESPONSE_HEADERS - 1, HEADERS, END_HEADERS, s->id, RESPONSE_HEADERS, sizeof RESPONSE_HEADERS - 1);
    queue(c, s);
}

static void on_data(Conn *c, uint32_t sid, uint8_t flags, const uint8_t *p, size_t n, size_t length) {
    c->consumed += length;
    Stream *s = stream_of(c, sid);
    if (!s) return;
    s->consumed += length;
    if (s->consumed >= OUR_WINDOW / 2) {
        uint32_t inc = htonl((uint32_t)s->consumed);
        put_frame(c, 4, WINDOW_UPDATE, 0, sid, &inc, 4);
        s->consumed = 0;
    }
    if (flags & PADDED) {
        if (n < 1 || p[0] >= n) return;
        n -= 1 + p[0];
        p += 1;
    }
    size_t pos = 0;
    while (pos < n) {
        if (s->need) {
            size_t take = s->need < n - pos ? s->need : n - pos;
            s->need -= (uint32_t)take;
            pos += take;
            if (!s->need) message(c, s);
            continue;
        }
        while (s->headlen < 5 && pos < n) s->head[s->headlen++] = p[pos++];
        if (s->headlen == 5) {
            s->need = (uint32_t)s->head[1] << 24 | s->head[2] << 16 | s->head[3] << 8 | s->head[4];
            s->headlen = 0;
            if (!s->need) message(c, s);
        }
    }
}

static void on_headers(Conn *c, uint32_t sid) {
    if (!(sid & 1)) return;
    size_t k = sid >> 1;
    if (k >= c->nstreams) {
        size_t n = c->nstreams ? c->nstreams : 256;
        while (n <= k) n *= 2;
        c->streams = xrealloc(c->streams, n * sizeof(Stream));
        memset(c->streams + c->nstreams, 0, (n - c->nstreams) * sizeof(Stream));
        c->nstreams = n;
    }
    Stream *s = &c->streams[k];
    if (s->open || s->id) return;  /* a stream's later HEADERS (trailers), or an id used before */
    s->id = sid; s->open = 1; s->window = c->peer_initial;
    st.streams++;
}

static int on_read(Conn *c) {
    if (c->rcap - c->rlen < (1u << 20)) { c->rcap = c->rlen + (1u << 20); c->rbuf = xrealloc(c->rbuf, c->rcap); }
    ssize_t got = recv(c->fd, c->rbuf + c->rlen, c->rcap - c->rlen, 0);
    if (got < 0 && (errno == EAGAIN || errno == EINTR)) return 1;
    if (got <= 0) { close_conn(c); return 0; }
    st.bytes_read += (unsigned long long)got;
    c->rlen += (size_t)got;
    uint8_t *b = c->rbuf;
    size_t pos = 0, end = c->rlen;
    if (!c->preface) {
        if (end < 24) return 1;
        if (memcmp(b, PREFACE, 24)) { close_conn(c); return 0; }
        c->preface = 1; pos = 24;
    }
    while (end - pos >= 9) {
        uint32_t length = (uint32_t)b[pos] << 16 | b[pos + 1] << 8 | b[pos + 2];
        uint8_t type = b[pos + 3], flags = b[pos + 4];
        uint32_t sid = ((uint32_t)b[pos + 5] << 24 | b[pos + 6] << 16 | b[pos + 7] << 8 | b[pos + 8]) & 0x7fffffff;
        if (end - pos - 9 < length) break;
        const uint8_t *p = b + pos + 9;
        pos += 9 + length;
        switch (type) {
        case DATA: on_data(c, sid, flags, p, length, length); break;
        case HEADERS: on_headers(c, sid); break;
        case WINDOW_UPDATE: {
            if (length < 4) break;
            uint32_t inc = ((uint32_t)p[0] << 24 | p[1] << 16 | p[2] << 8 | p[3]) & 0x7fffffff;
            Stream *s;
            if (!sid) c->send_window += inc;
            else if ((s = stream_of(c, sid))) s->window += inc;
            break;
        }
        case SETTINGS:
            if (flags & FLAG_ACK) break;
            for (uint32_t o = 0; o + 6 <= length; o += 6) {
                uint16_t id = (uint16_t)(p[o] << 8 | p[o + 1]);
                uint32_t v = (uint32_t)p[o + 2] << 24 | p[o + 3] << 16 | p[o + 4] << 8 | p[o + 5];
                if (id == 4) {
                    for (size_t k = 0; k < c->nstreams; k++) if (c->streams[k].open) c->streams[k].window += (int64_t)v - c->peer_initial;
                    c->peer_initial = v;
                } else if (id == 5) c->peer_max_frame = v;
            }
            put_frame(c, 0, SETTINGS, FLAG_ACK, 0, NULL, 0);
            break;
        case PING:
            if (!(flags & FLAG_ACK) && length == 8) put_frame(c, 8, PING, FLAG_ACK, 0, p, 8);
            break;
        case RST_STREAM: {
            Stream *s = stream_of(c, sid);
            if (s) { s->open = 0; if (s->blocked) { s->blocked = 0; c->nblocked--; } }
            break;
        }
        case GOAWAY: close_conn(c); return 0;
        default: break;
        }
    }
    memmove(b, b + pos, end - pos);
    c->rlen = end - pos;
    if (c->consumed >= OUR_WINDOW / 2) {
        uint32_t inc = htonl((uint32_t)c->consumed);
        put_frame(c, 4, WINDOW_UPDATE, 0, 0, &inc, 4);
        c->consumed = 0;
    }
    if (c->nblocked) unblock(c);
    return c->olen > c->ohead ? flush(c) : 1;
}

static Conn **conns;
static size_t nconns, cap_conns;

static void on_accept(int lfd) {
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) return;
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        Conn *c = calloc(1, sizeof(Conn));
        if (!c) { perror("floor: calloc"); exit(1); }
        c->fd = fd; c->send_window = c->peer_initial = 65535; c->peer_max_frame = 16384;
        if (nconns == cap_conns) { cap_conns = cap_conns ? 2 * cap_conns : 256; conns = xrealloc(conns, cap_conns * sizeof(Conn *)); }
        conns[nconns++] = c;
        st.connections++;
        struct epoll_event e = {.events = EPOLLIN, .data.ptr = c};
        epoll_ctl(ep, EPOLL_CTL_ADD, fd, &e);
        uint8_t settings[12] = {0, 4, OUR_WINDOW >> 24, (OUR_WINDOW >> 16) & 255, (OUR_WINDOW >> 8) & 255, OUR_WINDOW & 255,
                                0, 5, OUR_MAX_FRAME >> 24, (OUR_MAX_FRAME >> 16) & 255, (OUR_MAX_FRAME >> 8) & 255, 0};
        uint32_t grow = htonl(OUR_WINDOW - 65535);
        put_frame(c, 12, SETTINGS, 0, 0, settings, 12);
        put_frame(c, 4, WINDOW_UPDATE, 0, 0, &grow, 4);
        flush(c);
    }
}

static void reap(void) {
    size_t keep = 0;
    for (size_t i = 0; i < nconns; i++) {
        Conn *c = conns[i];
        if (c->fd >= 0) { conns[keep++] = c; continue; }
        free(c->rbuf); free(c->out); free(c->arena); free(c->streams); free(c);
    }
    nconns = keep;
}

static void change(void) {
    version++;
    st.changes++;
    make_body();
    for (size_t i = 0; i < nconns; i++) {
        Conn *c = conns[i];
        if (c->fd < 0) continue;
        for (size_t k = 0; k < c->nstreams; k++) {
            Stream *s = &c->streams[k];
            if (s->blocked) { s->blocked = 0; c->nblocked--; }  /* the new response replaces what was owed */
            if (s->open && s->answered) queue(c, s);
        }
        if (c->olen > c->ohead) flush(c);
    }
}

int main(int argc, char **argv) {
    const char *upstreams = NULL, *listen_at = NULL, *middle_path = NULL;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--upstreams")) upstreams = argv[i + 1];
        else if (!strcmp(argv[i], "--listen")) listen_at = argv[i + 1];
        else if (!strcmp(argv[i], "--middle")) middle_path = argv[i + 1];
    }
    if (argc < 2 || strcmp(argv[1], "serve") || !upstreams || !listen_at || !middle_path) {
        fprintf(stderr, "usage: %s serve --upstreams FILE --listen HOST:PORT --middle FILE [--admin HOST:PORT]\n", argv[0]);
        return 2;
    }
    FILE *f = fopen(middle_path, "rb");
    if (!f) { perror(middle_path); return 1; }
    fseek(f, 0, SEEK_END); middle_len = (size_t)ftell(f); fseek(f, 0, SEEK_SET);
    middle = malloc(middle_len);
    if (!middle || fread(middle, 1, middle_len, f) != middle_len) { perror(middle_path); return 1; }
    fclose(f);
    unlink(middle_path);  /* written for this process alone by bench/floor.py */
    make_body();

    char host[256];
    const char *colon = strrchr(listen_at, ':');
    if (!colon || (size_t)(colon - listen_at) >= sizeof host) { fprintf(stderr, "--listen HOST:PORT\n"); return 2; }
    memcpy(host, listen_at, (size_t)(colon - listen_at)); host[colon - listen_at] = 0;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
    if (inet_pton(AF_INET, host, &a.sin_addr) != 1) { fprintf(stderr, "--listen: IPv4 only\n"); return 2; }
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0), one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(lfd, (struct sockaddr *)&a, sizeof a) || listen(lfd, 4096)) { perror("floor: listen"); return 1; }

    char dir[PATH_MAX];
    const char *slash = strrchr(upstreams, '/');
    const char *name = slash ? slash + 1 : upstreams;
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - upstreams) : 1, slash ? upstreams : ".");
    int ino = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (ino < 0 || inotify_add_watch(ino, dir, IN_CLOSE_WRITE | IN_MOVED_TO) < 0) { perror("floor: inotify"); return 1; }

    struct sigaction sa = {.sa_handler = on_signal};  /* no SA_RESTART: epoll_wait returns EINTR */
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGUSR1, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    ep = epoll_create1(EPOLL_CLOEXEC);
    static int lmark, imark;
    struct epoll_event e = {.events = EPOLLIN, .data.ptr = &lmark};
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &e);
    e.data.ptr = &imark;
    epoll_ctl(ep, EPOLL_CTL_ADD, ino, &e);
    struct epoll_event evs[256];
    for (;;) {
        int n = epoll_wait(ep, evs, 256, -1);
        if (want_report) { want_report = 0; report(); }
        if (want_stop) { report(); return 0; }
        for (int i = 0; i < n; i++) {
            void *d = evs[i].data.ptr;
            if (d == &lmark) { on_accept(lfd); continue; }
            if (d == &imark) {
                char buf[65536] __attribute__((aligned(__alignof__(struct inotify_event))));
                ssize_t len = read(ino, buf, sizeof buf);
                int changed = 0;
                for (ssize_t o = 0; o < len;) {
                    struct inotify_event *ev = (struct inotify_event *)(buf + o);
                    if (ev->len && !strcmp(ev->name, name)) changed = 1;
                    o += (ssize_t)(sizeof *ev + ev->len);
                }
                if (changed) change();
                continue;
            }
            Conn *c = d;
            if (c->fd < 0) continue;
            if ((evs[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) && !on_read(c)) continue;
            if (c->fd >= 0 && (evs[i].events & EPOLLOUT)) flush(c);
        }
        reap();
    }
}
