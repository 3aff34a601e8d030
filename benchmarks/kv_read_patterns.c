/* Read rates of a batch decode step's K/V access patterns, each against a plain sequential read
 * of the same number of bytes timed in the same round (see kv_read_patterns.py, which builds
 * and runs this and summarises its output).
 *
 * Why: item 3 of issue 25 puts paged decode attention within 1.2x of reading the step's K/V
 * once at the measured read rate, and that rate comes from a sequential read. These patterns
 * separate what the paging itself costs, with no math at all: the same bytes read
 * sequentially in page-sized pieces, pages in allocation order with the step's row structure,
 * pages shuffled, the next page prefetched as the attention kernel does, larger pages.
 *
 * Usage: kv_read_patterns ROUNDS THREADS ROWS MIN_KEYS MAX_KEYS LAYERS KV_HEADS HEAD_DIM SEED
 *        PAUSE_MS
 * After one untimed round (page faults, first touches), prints one line per round: for each
 * pattern, the GB/s of a sequential read timed just before it and the pattern's time over
 * that read's (pairs, so that a change of the host's memory mode within a round moves both);
 * rounds PAUSE_MS apart, so that they sample the host's memory modes over a longer span.
 */
#define _GNU_SOURCE
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int32_t vint __attribute__((vector_size(64)));
typedef float vfloat __attribute__((vector_size(64)));

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Zeroed memory on transparent huge pages where the kernel allows it, as the runtime's caches. */
static char *huge_buffer(size_t bytes) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    madvise(p, bytes, MADV_HUGEPAGE);
    memset(p, 1, bytes);
    return (char *)p;
}

/* The OR of `bytes` at k and v read side by side; with `next_k` (or NULL), the first
 * `ahead` bytes of the next page's lines prefetched into L2 as they go. */
static inline vint read_pair(const char *k, const char *v, const char *next_k,
                             const char *next_v, int64_t bytes, int64_t ahead) {
    vint sink = {0};
    for (int64_t b = 0; b + 64 <= bytes; b += 64) {
        vint x, y;
        memcpy(&x, k + b, 64);
        memcpy(&y, v + b, 64);
        sink |= x | y;
        if (next_k != NULL && b < ahead) {
            __builtin_prefetch(next_k + b, 0, 2);
            __builtin_prefetch(next_v + b, 0, 2);
        }
    }
    return sink;
}

typedef struct {
    const char *name;
    int64_t block; /* tokens a page */
    int shuffled;  /* pages in random order (else each row's pages consecutive) */
    int prefetch;  /* the next page's lines prefetched through the read */
    int by_head;   /* a page read head by head (the kernel's order) or whole */
} pattern;

typedef struct {
    int64_t rows, layers, kv, head_dim, width;
    const int64_t *keys, *order;
} step_shape;

/* One page table per layer, [layers][rows][width] (-1 past a row's keys). */
static int64_t *page_table(const step_shape *s, int64_t block, int shuffled, int64_t *pages_out) {
    int64_t pages = 0;
    for (int64_t r = 0; r < s->rows; ++r) pages += (s->keys[r] + block - 1) / block;
    pages *= s->layers;
    int64_t *perm = malloc(sizeof(int64_t) * (size_t)pages);
    int64_t *table = malloc(sizeof(int64_t) * (size_t)(s->layers * s->rows * s->width));
    if (perm == NULL || table == NULL) return NULL;
    for (int64_t p = 0; p < pages; ++p) perm[p] = p;
    for (int64_t p = pages - 1; shuffled && p > 0; --p) {
        const int64_t j = rand() % (p + 1), t = perm[p];
        perm[p] = perm[j];
        perm[j] = t;
    }
    int64_t next = 0;
    for (int64_t l = 0; l < s->layers; ++l)
        for (int64_t r = 0; r < s->rows; ++r)
            for (int64_t slot = 0; slot < s->width; ++slot)
                table[(l * s->rows + r) * s->width + slot] =
                    slot * block < s->keys[r] ? perm[next++] : -1;
    free(perm);
    *pages_out = pages;
    return table;
}

/* Seconds to read every row's keys and values of every layer in the pattern's page order:
 * rows longest first, shared dynamically by the threads, as the attention kernel does. */
static double walk(const step_shape *s, const pattern *p, const int64_t *table, const char *k,
                   const char *v, int threads, int *sink) {
    const int64_t row_bytes = s->head_dim * 4, head_bytes = p->block * row_bytes;
    const int64_t width = s->width;
    int seen = 0;
    const double start = now();
#pragma omp parallel num_threads(threads) reduction(| : seen)
    for (int64_t l = 0; l < s->layers; ++l) {
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < s->rows; ++item) {
            const int64_t r = s->order[item], n = s->keys[r];
            const int64_t *pages = table + (l * s->rows + r) * width;
            vint acc = {0};
            for (int64_t slot = 0; slot * p->block < n; ++slot) {
                const int64_t page = pages[slot];
                const int64_t count = n - slot * p->block < p->block ? n - slot * p->block : p->block;
                const int64_t next = (slot + 1) * p->block < n ? pages[slot + 1] : -1;
                const int64_t bytes = count * row_bytes;
                const int64_t parts = p->by_head ? s->kv : 1;
                const int64_t part_bytes = p->by_head ? bytes : s->kv * head_bytes;
                for (int64_t h = 0; h < parts; ++h) {
                    const int64_t at = (page * s->kv + h) * head_bytes;
                    const char *nk = NULL, *nv = NULL;
                    if (p->prefetch && next >= 0) {
                        nk = k + (next * s->kv + h) * head_bytes;
                        nv = v + (next * s->kv + h) * head_bytes;
                    }
                    acc |= read_pair(k + at, v + at, nk, nv, part_bytes, part_bytes * 3 / 4);
                }
            }
            seen |= acc[0] | acc[5] | acc[15];
        }
    }
    *sink |= seen;
    return now() - start;
}

/* Seconds for each thread to read its contiguous share of `bytes` (one stream a thread), each
 * line added into one float vector: the fastest C loop measured on Zen 4, 0.98-1.0x of
 * `torch.sum` over the same huge pages (ORing the lines into a vector of which two lanes are
 * used read at 0.89x in the host's fast memory mode). */
static double sequential(const char *buffer, int64_t bytes, int threads, int *sink) {
    int seen = 0;
    const double start = now();
#pragma omp parallel num_threads(threads) reduction(| : seen)
    {
        const int64_t id = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t lines = bytes / 64, first = lines * id / n, last = lines * (id + 1) / n;
        vfloat acc = {0};
        for (int64_t line = first; line < last; ++line) {
            vfloat x;
            memcpy(&x, buffer + line * 64, 64);
            acc += x;
        }
        float total = 0.0f;
        for (int lane = 0; lane < 16; ++lane) total += acc[lane];
        seen |= total != 0.0f;
    }
    *sink |= seen;
    return now() - start;
}

/* Seconds to read K and V side by side in `chunk`-byte pieces, in order (no rows, no pages):
 * what the page size alone costs when the pieces are consecutive. */
static double chunks_in_order(const char *k, const char *v, int64_t bytes, int64_t chunk,
                              int threads, int *sink) {
    int seen = 0;
    const int64_t pieces = bytes / chunk;
    const double start = now();
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : seen)
    for (int64_t i = 0; i < pieces; ++i) {
        const vint acc = read_pair(k + i * chunk, v + i * chunk, NULL, NULL, chunk, 0);
        seen |= acc[0] | acc[9];
    }
    *sink |= seen;
    return now() - start;
}

int main(int argc, char **argv) {
    if (argc != 11) {
        fprintf(stderr,
                "usage: %s ROUNDS THREADS ROWS MIN_KEYS MAX_KEYS LAYERS KV_HEADS HEAD_DIM SEED "
                "PAUSE_MS\n",
                argv[0]);
        return 2;
    }
    const int rounds = atoi(argv[1]), threads = atoi(argv[2]);
    const int64_t rows = atoll(argv[3]), min_keys = atoll(argv[4]), max_keys = atoll(argv[5]);
    const int64_t layers = atoll(argv[6]), kv = atoll(argv[7]), head_dim = atoll(argv[8]);
    srand((unsigned)atoi(argv[9]));
    const int pause_ms = atoi(argv[10]);
    if (pause_ms < 0 || rounds < 1 || threads < 1 || rows < 1 || min_keys < 1 || max_keys < min_keys ||
        layers < 1 || kv < 1 || head_dim < 16 || head_dim % 16 != 0) {
        fprintf(stderr, "invalid arguments\n");
        return 2;
    }
    const pattern patterns[] = {
        {"pages shuffled, next page prefetched (the kernel's walk)", 32, 1, 1, 1},
        {"pages shuffled, no prefetch", 32, 1, 0, 1},
        {"pages in allocation order, no prefetch", 32, 0, 0, 1},
        {"pages in allocation order, next page prefetched", 32, 0, 1, 1},
        {"pages of 256 tokens shuffled, next page prefetched", 256, 1, 1, 1},
    };
    const int n_patterns = (int)(sizeof(patterns) / sizeof(patterns[0]));
    int64_t *keys = malloc(sizeof(int64_t) * (size_t)rows);
    int64_t *order = malloc(sizeof(int64_t) * (size_t)rows);
    if (keys == NULL || order == NULL) return 1;
    int64_t total_keys = 0;
    for (int64_t r = 0; r < rows; ++r) {
        keys[r] = min_keys + rand() % (max_keys - min_keys + 1);
        total_keys += keys[r];
        int64_t j = r;
        for (; j > 0 && keys[order[j - 1]] < keys[r]; --j) order[j] = order[j - 1];
        order[j] = r;
    }
    const step_shape shape = {rows, layers, kv, head_dim, 0 /* per pattern */, keys, order};
    const int64_t step_bytes = 2 * total_keys * layers * kv * head_dim * 4;
    /* Room for the largest page table (pages of 256 tokens round each row up further). */
    int64_t most_pages = 0;
    int64_t *tables[sizeof(patterns) / sizeof(patterns[0])];
    step_shape shapes[sizeof(patterns) / sizeof(patterns[0])]; /* page-table width per block */
    for (int i = 0; i < n_patterns; ++i) {
        shapes[i] = shape;
        shapes[i].width = (max_keys + patterns[i].block - 1) / patterns[i].block;
        int64_t pages = 0;
        tables[i] = page_table(&shapes[i], patterns[i].block, patterns[i].shuffled, &pages);
        if (tables[i] == NULL) return 1;
        const int64_t blocks = pages * patterns[i].block / 32;
        most_pages = blocks > most_pages ? blocks : most_pages;
    }
    const int64_t cache_bytes = most_pages * kv * 32 * head_dim * 4;
    char *k = huge_buffer((size_t)cache_bytes), *v = huge_buffer((size_t)cache_bytes);
    char *probe = huge_buffer((size_t)step_bytes);
    if (k == NULL || v == NULL || probe == NULL) {
        fprintf(stderr, "cannot map %lld bytes\n", (long long)(2 * cache_bytes + step_bytes));
        return 1;
    }
    printf("{\"step_bytes\": %lld, \"patterns\": [\"pages of 32 tokens consecutive (no rows)\"",
           (long long)step_bytes);
    for (int i = 0; i < n_patterns; ++i) printf(", \"%s\"", patterns[i].name);
    printf("]}\n");
    fflush(stdout);
    int sink = 0;
    const int64_t chunk = 32 * head_dim * 4;
    for (int round = -1; round < rounds; ++round) { /* round -1: first touches, untimed */
        if (round > 0 && pause_ms > 0) usleep((useconds_t)pause_ms * 1000);
        for (int i = -1; i < n_patterns; ++i) {
            const double base = sequential(probe, step_bytes, threads, &sink);
            double seconds;
            if (i < 0) {
                seconds = chunks_in_order(k, v, step_bytes / 2 / chunk * chunk, chunk, threads,
                                          &sink);
            } else {
                seconds = walk(&shapes[i], &patterns[i], tables[i], k, v, threads, &sink);
            }
            if (round >= 0) printf("%s%.3f %.4f", i < 0 ? "" : " ", step_bytes / base / 1e9, seconds / base);
        }
        if (round >= 0) printf("\n");
        fflush(stdout);
    }
    if (sink == 0) { /* the buffers hold ones: nothing was read */
        fprintf(stderr, "no bytes were read\n");
        return 1;
    }
    return 0;
}
