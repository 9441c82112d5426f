/* A malloc trace for memory_table.py --trace: with this library preloaded, every allocation of at least 64 KiB and
 * every free is written to a file between malloc_trace_on(path) and malloc_trace_off(), one "a <ptr> <bytes>" or
 * "f <ptr> 0" line each (frees of smaller blocks too; replay.py ignores what it never saw allocated).
 *
 *   gcc -O2 -shared -fPIC -o benchmarks/malloc/trace.so benchmarks/malloc/trace.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#define TRACED_BYTES 65536

static void *(*next_malloc)(size_t);
static void (*next_free)(void *);
static void *(*next_calloc)(size_t, size_t);
static void *(*next_realloc)(void *, size_t);
static int (*next_posix_memalign)(void **, size_t, size_t);
static void *(*next_aligned_alloc)(size_t, size_t);
static void *(*next_memalign)(size_t, size_t);
static int out = -1;
static __thread int writing;
static char bootstrap[1 << 16]; /* dlsym's own calloc, before the real one is known */
static size_t bootstrap_used;
static int resolving;

static void resolve(void) {
    if (next_malloc || resolving) return;
    resolving = 1;
    next_malloc = dlsym(RTLD_NEXT, "malloc");
    next_free = dlsym(RTLD_NEXT, "free");
    next_calloc = dlsym(RTLD_NEXT, "calloc");
    next_realloc = dlsym(RTLD_NEXT, "realloc");
    next_posix_memalign = dlsym(RTLD_NEXT, "posix_memalign");
    next_aligned_alloc = dlsym(RTLD_NEXT, "aligned_alloc");
    next_memalign = dlsym(RTLD_NEXT, "memalign");
    resolving = 0;
}

static void record(char op, void *p, size_t n) {
    if (out < 0 || writing || (op == 'a' && n < TRACED_BYTES)) return;
    writing = 1;
    char line[64];
    int k = snprintf(line, sizeof line, "%c %lx %zu\n", op, (unsigned long)p, n);
    if (write(out, line, k) < 0) out = -1;
    writing = 0;
}

void malloc_trace_on(const char *path) { out = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644); }
void malloc_trace_off(void) { close(out); out = -1; }

void *malloc(size_t n) { resolve(); void *p = next_malloc(n); record('a', p, n); return p; }
void *calloc(size_t k, size_t n) {
    if (resolving && bootstrap_used + k * n <= sizeof bootstrap) {
        void *p = bootstrap + bootstrap_used;
        bootstrap_used += (k * n + 15) & ~(size_t)15;
        return p;
    }
    resolve();
    void *p = next_calloc(k, n);
    record('a', p, k * n);
    return p;
}
void free(void *p) {
    if (!p || ((char *)p >= bootstrap && (char *)p < bootstrap + sizeof bootstrap)) return;
    resolve();
    record('f', p, 0);
    next_free(p);
}
void *realloc(void *p, size_t n) {
    resolve();
    void *q = next_realloc(p, n);
    if (p) record('f', p, 0);
    record('a', q, n);
    return q;
}
int posix_memalign(void **p, size_t align, size_t n) {
    resolve();
    int err = next_posix_memalign(p, align, n);
    if (!err) record('a', *p, n);
    return err;
}
void *aligned_alloc(size_t align, size_t n) { resolve(); void *p = next_aligned_alloc(align, n); record('a', p, n); return p; }
void *memalign(size_t align, size_t n) { resolve(); void *p = next_memalign(align, n); record('a', p, n); return p; }
