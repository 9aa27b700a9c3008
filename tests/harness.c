/*
 * harness.c — the shared test harness (see harness.h).
 */
#define _XOPEN_SOURCE 700 /* mkdtemp, nftw */
#include "harness.h"

#include <ftw.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "lib/internal.h"

int mst_test_checks;
int mst_test_failures;

void mst_test_fail(const char* file, int line, const char* fmt, ...) {
    mst_test_failures++;
    if (mst_test_failures > 50) return; /* enough to see the pattern */
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FAIL %s:%d: ", file, line);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

int mst_test_main(int argc, char** argv, void (*run)(mst_ctx_t* ctx)) {
    mst_backend_kind kind = MST_BACKEND_CPU;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc) {
            const char* b = argv[++i];
            if (strcmp(b, "cuda") == 0) kind = MST_BACKEND_CUDA;
            else if (strcmp(b, "cpu") != 0) {
                fprintf(stderr, "%s: unknown backend '%s'\n", argv[0], b);
                return 2;
            }
        }
    }
    if (!mst_backend_available(kind) && !getenv("MST_TEST_REQUIRE_GPU")) {
        printf("%s: skipped: backend %s not available here\n", argv[0], kind == MST_BACKEND_CUDA ? "cuda" : "cpu");
        return MST_TEST_SKIP;
    }
    mst_ctx_t* ctx = NULL;
    if (mst_ctx_create(kind, 0, &ctx) != MST_OK) {
        fprintf(stderr, "%s: no context: %s\n", argv[0], mst_last_error());
        return 1;
    }
    printf("%s on %s\n", argv[0], mst_ctx_describe(ctx));
    run(ctx);
    mst_ctx_destroy(ctx);
    printf("%s: %d passed, %d failed\n", argv[0], mst_test_checks - mst_test_failures,
           mst_test_failures);
    return mst_test_failures ? 1 : 0;
}

mst_backend_kind mst_test_backend_arg(int argc, char** argv) {
    /* a line at a time: a test that ctest kills at its timeout still shows
     * the cases it finished (a full pipe buffer would be lost with it) */
    setvbuf(stdout, NULL, _IOLBF, 0);
    mst_backend_kind kind = MST_BACKEND_CPU;
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--backend") && !strcmp(argv[i + 1], "cuda")) kind = MST_BACKEND_CUDA;
    return kind;
}

int mst_test_devices(mst_backend_kind kind, int most) {
    if (kind == MST_BACKEND_CPU) return 64;
    int n = 0;
    for (mst_ctx_t* c = NULL; n < most && mst_ctx_create(kind, n, &c) == MST_OK; n++) mst_ctx_destroy(c);
    return n;
}

int mst_test_skip_devices(const char* prog, int n_dev, const char* needs) {
    printf("%s: skipped: %d CUDA devices, %s\n", prog, n_dev, needs);
    /* no GPU where one is required fails; one GPU skips */
    return n_dev == 0 && getenv("MST_TEST_REQUIRE_GPU") ? 1 : MST_TEST_SKIP;
}

uint64_t mst_rng_next(mst_rng* r) { return mst_splitmix64(&r->s); }

double mst_rng_uniform(mst_rng* r) { return mst_splitmix_unit(&r->s); }

double mst_rng_normal(mst_rng* r) {
    double u = mst_rng_uniform(r) + 1e-300, v = mst_rng_uniform(r);
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

int64_t mst_rng_int(mst_rng* r, int64_t lo, int64_t hi) {
    return lo + (int64_t)(mst_rng_next(r) % (uint64_t)(hi - lo + 1));
}

void mst_rng_bf16(mst_rng* r, uint16_t* dst, size_t n, double scale) {
    for (size_t i = 0; i < n; i++) dst[i] = mst_ref_bf16((float)(mst_rng_normal(r) * scale));
}

void mst_rng_fp32(mst_rng* r, float* dst, size_t n, double lo, double hi) {
    for (size_t i = 0; i < n; i++) dst[i] = (float)(lo + (hi - lo) * mst_rng_uniform(r));
}

void mst_rng_counts(mst_rng* r, int32_t* counts, int n_groups, int64_t total, double skew) {
    double* w = (double*)malloc(sizeof(double) * (size_t)n_groups);
    double sum = 0;
    for (int g = 0; g < n_groups; g++) {
        double zipf = 1.0 / pow((double)(g + 1), 1.2);
        w[g] = (1 - skew) * (0.5 + mst_rng_uniform(r)) + skew * zipf * (0.5 + mst_rng_uniform(r));
        sum += w[g];
    }
    int64_t given = 0;
    for (int g = 0; g < n_groups; g++) {
        counts[g] = (int32_t)floor((double)total * w[g] / sum);
        given += counts[g];
    }
    for (int64_t i = 0; given < total; i++, given++) counts[mst_rng_int(r, 0, n_groups - 1)]++;
    /* shuffle so the big groups are not always first */
    for (int g = n_groups - 1; g > 0; g--) {
        int j = (int)mst_rng_int(r, 0, g);
        int32_t t = counts[g];
        counts[g] = counts[j];
        counts[j] = t;
    }
    free(w);
}

double mst_ref_bf16_value(uint16_t h) {
    const int exp = (h >> 7) & 0xFF, man = h & 0x7F;
    double v;
    if (exp == 0xFF) v = man ? NAN : INFINITY;
    else if (exp == 0) v = ldexp(man, -133);   /* subnormal: man 2^-126 / 128 */
    else v = ldexp(128 + man, exp - 134); /* (1 + man / 128) 2^(exp - 127) */
    return h & 0x8000 ? -v : v;
}

/* The magnitude of code c in 0 .. 0x7F80, infinity standing for 2^128 (where
 * it sits on the grid for rounding). */
static double grid(unsigned c) { return c == 0x7F80 ? ldexp(1, 128) : mst_ref_bf16_value((uint16_t)c); }

uint16_t mst_ref_bf16(double x) {
    const uint16_t sign = signbit(x) ? 0x8000 : 0;
    if (isnan(x)) return sign | 0x7FC0;
    const double a = fabs(x);
    if (a >= ldexp(1, 128)) return sign | 0x7F80;
    unsigned lo = 0, hi = 0x7F80; /* grid(lo) <= a < grid(hi) */
    while (hi - lo > 1) {
        unsigned mid = (lo + hi) / 2;
        if (grid(mid) <= a) lo = mid;
        else hi = mid;
    }
    const double half = (grid(lo) + grid(hi)) / 2; /* exact: both have 8 significant bits */
    unsigned c = a < half ? lo : a > half ? hi : (lo % 2 == 0 ? lo : hi);
    return (uint16_t)(sign | c);
}

double mst_rel_err_bf16(const uint16_t* got, const double* ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)got[i] << 16; /* not the library's converter */
        float f;
        memcpy(&f, &u, sizeof f);
        double d = (double)f - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    if (isnan(num)) return INFINITY;
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

double mst_rel_err_fp32(const float* got, const double* ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)got[i] - ref[i];
        num += d * d;
        den += ref[i] * ref[i];
    }
    if (isnan(num)) return INFINITY;
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

int64_t mst_first_diff(const void* a, const void* b, size_t n_bytes) {
    const unsigned char *x = (const unsigned char*)a, *y = (const unsigned char*)b;
    for (size_t i = 0; i < n_bytes; i++)
        if (x[i] != y[i]) return (int64_t)i;
    return -1;
}

mst_guarded mst_guarded_alloc(mst_ctx_t* ctx, size_t n_bytes) {
    mst_guarded g = {0};
    g.n_bytes = n_bytes;
    if (mst_alloc(ctx, n_bytes + 2 * MST_GUARD_BYTES, &g.base) != MST_OK) {
        fprintf(stderr, "harness: alloc of %zu bytes failed: %s\n", n_bytes, mst_last_error());
        abort();
    }
    g.data = (char*)g.base + MST_GUARD_BYTES;
    mst_fill(ctx, g.base, 0xA5, MST_GUARD_BYTES);
    mst_fill(ctx, (char*)g.data + n_bytes, 0xA5, MST_GUARD_BYTES);
    mst_fill(ctx, g.data, MST_POISON, n_bytes);
    return g;
}

void mst_guarded_put(mst_ctx_t* ctx, mst_guarded* g, const void* host) {
    if (host) mst_copy_h2b(ctx, g->data, host, g->n_bytes);
    else mst_fill(ctx, g->data, MST_POISON, g->n_bytes);
}

void mst_guarded_get(mst_ctx_t* ctx, const mst_guarded* g, void* host) {
    mst_copy_b2h(ctx, host, g->data, g->n_bytes);
}

void mst_guarded_fill_fp32(mst_ctx_t* ctx, mst_guarded* g, float v) {
    size_t n = g->n_bytes / 4;
    float* h = (float*)malloc(g->n_bytes);
    if (!h) abort();
    for (size_t i = 0; i < n; i++) h[i] = v;
    mst_guarded_put(ctx, g, h);
    free(h);
}

int mst_guarded_intact(mst_ctx_t* ctx, const mst_guarded* g) {
    unsigned char buf[2 * MST_GUARD_BYTES];
    mst_copy_b2h(ctx, buf, g->base, MST_GUARD_BYTES);
    mst_copy_b2h(ctx, buf + MST_GUARD_BYTES, (char*)g->data + g->n_bytes, MST_GUARD_BYTES);
    for (size_t i = 0; i < sizeof buf; i++)
        if (buf[i] != 0xA5) return 0;
    return 1;
}

void mst_guarded_free(mst_ctx_t* ctx, mst_guarded* g) {
    mst_free(ctx, g->base);
    g->base = g->data = NULL;
}

/* ---- files ---- */

int mst_test_tmpdir(char* buf, size_t cap, const char* stem) {
    if (snprintf(buf, cap, "/tmp/%s_XXXXXX", stem) >= (int)cap) return 0;
    return mkdtemp(buf) != NULL;
}

static int rm_entry(const char* path, const struct stat* st, int flag, struct FTW* ftw) {
    (void)st, (void)flag, (void)ftw;
    return remove(path);
}

void mst_test_rmtree(const char* dir) { nftw(dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS); }

unsigned char* mst_test_slurp(const char* path, long* n) {
    FILE* f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char* b = (unsigned char*)malloc((size_t)*n + 1);
    if (!b) {
        fclose(f);
        return NULL;
    }
    if (fread(b, 1, (size_t)*n, f) != (size_t)*n) *n = -1;
    fclose(f);
    b[*n > 0 ? *n : 0] = 0;
    return b;
}
