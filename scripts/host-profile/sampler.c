// A sampling profiler of a process's host CPU time, loaded with LD_PRELOAD (the GPU machines
// have no perf, gdb or strace). Every millisecond of the process's CPU time (ITIMER_PROF, all
// threads) the running thread records its call stack (glibc's backtrace: the unwinder reads
// .eh_frame, so no frame pointers are needed). At exit the stacks go to $HOSTPROF_OUT and the
// address map to $HOSTPROF_OUT.maps; report.py symbolizes them against the same binary, unstripped.
#define _GNU_SOURCE
#include <execinfo.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

#define DEPTH 96
#define WORDS (1u << 25) /* 256 MiB of 8-byte words */

static uintptr_t *buf;
static atomic_uint_fast64_t used;
static atomic_uint_fast64_t dropped;

static void on_prof(int sig, siginfo_t *info, void *ctx) {
    (void)sig, (void)info, (void)ctx;
    int saved = errno;
    void *frames[DEPTH];
    int n = backtrace(frames, DEPTH);
    uint64_t at = atomic_fetch_add(&used, (uint64_t)n + 2);
    if (at + n + 2 > WORDS) {
        atomic_fetch_add(&dropped, 1);
    } else {
        buf[at] = (uintptr_t)syscall(SYS_gettid);
        buf[at + 1] = (uintptr_t)n;
        memcpy(&buf[at + 2], frames, sizeof(void *) * n);
    }
    errno = saved;
}

static void write_all(int fd, const void *p, size_t len) {
    const char *c = p;
    while (len > 0) {
        ssize_t w = write(fd, c, len);
        if (w <= 0) return;
        c += w, len -= (size_t)w;
    }
}

__attribute__((destructor)) static void finish(void) {
    static atomic_int done;
    const char *out = getenv("HOSTPROF_OUT");
    if (!out || !buf || atomic_exchange(&done, 1)) return;
    struct itimerval off = {0};
    setitimer(ITIMER_PROF, &off, NULL);
    uint64_t n = atomic_load(&used);
    if (n > WORDS) n = WORDS; /* a sample that did not fit was dropped, not written */
    char path[4096];
    snprintf(path, sizeof path, "%s.%d", out, (int)getpid());
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
        write_all(fd, buf, n * sizeof(uintptr_t));
        close(fd);
    }
    snprintf(path, sizeof path, "%s.%d.maps", out, (int)getpid());
    int in = open("/proc/self/maps", O_RDONLY);
    fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (in >= 0 && fd >= 0) {
        char chunk[65536];
        ssize_t r;
        while ((r = read(in, chunk, sizeof chunk)) > 0) write_all(fd, chunk, (size_t)r);
    }
    if (in >= 0) close(in);
    if (fd >= 0) close(fd);
    fprintf(stderr, "hostprof: %llu words, %llu samples dropped, to %s.%d\n",
            (unsigned long long)n, (unsigned long long)atomic_load(&dropped), out, (int)getpid());
}

/* A run stopped by `timeout` or Ctrl-C still leaves its samples. */
static void on_stop(int sig) {
    finish();
    signal(sig, SIG_DFL);
    raise(sig);
}

__attribute__((constructor)) static void start(void) {
    if (!getenv("HOSTPROF_OUT")) return;
    void *warm[4];
    backtrace(warm, 4); /* loads libgcc_s now, not inside the first signal */
    buf = mmap(NULL, (size_t)WORDS * sizeof(uintptr_t), PROT_READ | PROT_WRITE,
               MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (buf == MAP_FAILED) { buf = NULL; return; }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_prof;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGPROF, &sa, NULL);
    signal(SIGTERM, on_stop);
    signal(SIGINT, on_stop);
    /* HOSTPROF_US=0: no timer; only the program's own raise(SIGPROF) records a stack (an event
       count by call site: the CUDA emulator raises it at each allocation when asked). */
    long us = getenv("HOSTPROF_US") ? atol(getenv("HOSTPROF_US")) : 1000;
    if (us > 0) {
        struct itimerval it = {{us / 1000000, us % 1000000}, {us / 1000000, us % 1000000}};
        setitimer(ITIMER_PROF, &it, NULL);
    }
}
