"""Writes the driver timing shim's C source (see build.sh) for the entry points named in argv[1]."""
import sys

names = [l.strip() for l in open(sys.argv[1]) if l.strip()]
print(r'''#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef uintptr_t U;
typedef U (*F)(U, U, U, U, U, U, U, U, U, U, U, U);
static void *real;
static uint64_t t_start;
static inline uint64_t now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + t.tv_nsec;
}''')
print('#define N %d' % len(names))
print('static const char *names[N] = {%s};' % ', '.join('"%s"' % n for n in names))
print(r'''static F fns[N];
static uint64_t cnt[N], ns[N];
static F get(int i) {
    F f = __atomic_load_n(&fns[i], __ATOMIC_ACQUIRE);
    if (!f) {
        if (!real) real = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
        f = real ? (F)dlsym(real, names[i]) : 0;
        if (!f) { fprintf(stderr, "driver-time shim: no %s in libcuda.so.1\n", names[i]); abort(); }
        __atomic_store_n(&fns[i], f, __ATOMIC_RELEASE);
    }
    return f;
}
__attribute__((constructor)) static void init(void) { t_start = now(); }
__attribute__((destructor)) static void fini(void) {
    const char *p = getenv("SHIM_OUT");
    FILE *o = p ? fopen(p, "a") : stderr;
    if (!o) o = stderr;
    uint64_t tot = 0, c = 0;
    for (int i = 0; i < N; i++) { tot += ns[i]; c += cnt[i]; }
    if (!c) return;
    fprintf(o, "# process wall %.1f ms, %llu driver calls, %.1f ms inside them\n",
            (now() - t_start) / 1e6, (unsigned long long)c, tot / 1e6);
    for (int i = 0; i < N; i++)
        if (cnt[i])
            fprintf(o, "%-40s %10llu calls %10.2f ms %8.2f us each\n", names[i],
                    (unsigned long long)cnt[i], ns[i] / 1e6, ns[i] / 1e3 / cnt[i]);
    if (o != stderr) fclose(o);
}''')
for i, n in enumerate(names):
    print('U %s(U a, U b, U c, U d, U e, U f, U g, U h, U i, U j, U k, U l) {' % n)
    print('    F fn = get(%d);' % i)
    print('    uint64_t t = now();')
    print('    U r = fn(a, b, c, d, e, f, g, h, i, j, k, l);')
    print('    t = now() - t;')
    print('    __atomic_add_fetch(&cnt[%d], 1, __ATOMIC_RELAXED);' % i)
    print('    __atomic_add_fetch(&ns[%d], t, __ATOMIC_RELAXED);' % i)
    print('    return r;')
    print('}')
