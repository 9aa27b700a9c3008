/*
 * safetensors.c — the strict reader and the writer of safetensors.h.
 */
#define _POSIX_C_SOURCE 200809L /* fileno, fsync, fstat */
#include "safetensors.h"

#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json.h"
#include "hash.h"

static const struct { const char* name; size_t bytes; } dtypes[MST_ST_N_DTYPES] = {
    {"F32", 4}, {"BF16", 2}, {"F16", 2}, {"I32", 4}, {"F64", 8}, {"I64", 8}, {"I16", 2}, {"I8", 1}, {"U8", 1}, {"BOOL", 1}};

const char* mst_st_dtype_str(mst_st_dtype d) { return d >= 0 && d < MST_ST_N_DTYPES ? dtypes[d].name : "?"; }
size_t mst_st_dtype_bytes(mst_st_dtype d) { return d >= 0 && d < MST_ST_N_DTYPES ? dtypes[d].bytes : 0; }

int64_t mst_st_numel(const mst_st_entry* e) {
    int64_t n = 1;
    for (int32_t d = 0; d < e->nd; d++) n *= e->dims[d];
    return n;
}

/* ---- reading the header ------------------------------------------------------ */

static int by_name(const void* a, const void* b) {
    return strcmp(((const mst_st_entry*)a)->name, ((const mst_st_entry*)b)->name);
}
static int by_offset(const void* a, const void* b) {
    const mst_st_entry *x = *(const mst_st_entry* const*)a, *y = *(const mst_st_entry* const*)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : x->end < y->end ? -1 : x->end > y->end;
}

/* One header entry (key token k, value token v) into e. */
static mst_status parse_entry(const char* path, const mst_json* j, int32_t k, int32_t v, mst_st_entry* e) {
    memset(e, 0, sizeof *e);
    if (mst_json_str(j, k, e->name, sizeof e->name))
        return mst_set_error(MST_ERR_INVALID, "safetensors '%s': a tensor name over %d bytes", path, MST_ST_NAME - 1);
    const int32_t dt = mst_json_get(j, v, "dtype"), sh = mst_json_get(j, v, "shape"), of = mst_json_get(j, v, "data_offsets");
    if (dt < 0 || sh < 0 || of < 0 || j->tok[sh].kind != MST_JSON_ARRAY || j->tok[of].kind != MST_JSON_ARRAY ||
        j->tok[of].n_children != 2)
        return mst_set_error(MST_ERR_INVALID, "safetensors '%s': tensor '%s' lacks dtype, shape or data_offsets [begin, end]",
                             path, e->name);
    e->dtype = MST_ST_N_DTYPES;
    for (int d = 0; d < MST_ST_N_DTYPES; d++)
        if (mst_json_eq(j, dt, dtypes[d].name)) e->dtype = (mst_st_dtype)d;
    char got[16] = "?";
    if (e->dtype == MST_ST_N_DTYPES) {
        mst_json_str(j, dt, got, sizeof got);
        return mst_set_error(MST_ERR_INVALID, "safetensors '%s': tensor '%s' has dtype '%s' (not one this reader knows)",
                             path, e->name, got);
    }
    e->nd = j->tok[sh].n_children;
    if (e->nd > MST_ST_MAX_DIMS)
        return mst_set_error(MST_ERR_INVALID, "safetensors '%s': tensor '%s' has %d dims (at most %d)", path, e->name, e->nd,
                             MST_ST_MAX_DIMS);
    for (int32_t d = 0, t = sh + 1; d < e->nd; d++, t = j->tok[t].next)
        if (mst_json_i64(j, t, &e->dims[d]) || e->dims[d] < 0 || e->dims[d] > ((int64_t)1 << 40))
            return mst_set_error(MST_ERR_INVALID, "safetensors '%s': tensor '%s': shape entry %d is not a size", path, e->name, d);
    int64_t b = -1, x = -1;
    if (mst_json_i64(j, of + 1, &b) || mst_json_i64(j, of + 2, &x) || b < 0 || x < b)
        return mst_set_error(MST_ERR_INVALID, "safetensors '%s': tensor '%s': data_offsets not [begin, end] with begin <= end",
                             path, e->name);
    e->begin = (uint64_t)b, e->end = (uint64_t)x;
    const uint64_t want = (uint64_t)mst_st_numel(e) * dtypes[e->dtype].bytes;
    if (e->end - e->begin != want)
        return mst_set_error(MST_ERR_INVALID, "safetensors '%s': tensor '%s': data_offsets [%llu, %llu) hold %llu bytes, its "
                             "shape and dtype %llu", path, e->name, (unsigned long long)e->begin, (unsigned long long)e->end,
                             (unsigned long long)(e->end - e->begin), (unsigned long long)want);
    return MST_OK;
}

/* The entries, sorted by offset, tile [0, data_bytes) exactly. */
static mst_status check_tiling(const mst_st_file* f) {
    const mst_st_entry** o = (const mst_st_entry**)malloc(sizeof *o * (size_t)(f->n ? f->n : 1));
    if (!o) return mst_set_error(MST_ERR_OOM, "safetensors '%s': %d entries", f->path, f->n);
    for (int32_t i = 0; i < f->n; i++) o[i] = &f->e[i];
    qsort(o, (size_t)f->n, sizeof *o, by_offset);
    uint64_t at = 0;
    mst_status st = MST_OK;
    for (int32_t i = 0; i < f->n && st == MST_OK; i++) {
        const mst_st_entry* e = o[i];
        if (e->begin > at)
            st = mst_set_error(MST_ERR_INVALID, "safetensors '%s': data_offsets leave bytes [%llu, %llu) to no tensor (before "
                               "'%s')", f->path, (unsigned long long)at, (unsigned long long)e->begin, e->name);
        else if (e->begin < at)
            st = mst_set_error(MST_ERR_INVALID, "safetensors '%s': tensor '%s' at [%llu, %llu) overlaps '%s' (which ends at %llu)",
                               f->path, e->name, (unsigned long long)e->begin, (unsigned long long)e->end, o[i - 1]->name,
                               (unsigned long long)at);
        else if (e->end > f->data_bytes)
            st = mst_set_error(MST_ERR_INVALID, "safetensors '%s': tensor '%s' at [%llu, %llu) runs past the data's %llu bytes "
                               "(truncated?)", f->path, e->name, (unsigned long long)e->begin, (unsigned long long)e->end,
                               (unsigned long long)f->data_bytes);
        at = e->end;
    }
    if (st == MST_OK && at != f->data_bytes)
        st = mst_set_error(MST_ERR_INVALID, "safetensors '%s': the tensors end at data byte %llu, the file has %llu (trailing "
                           "bytes)", f->path, (unsigned long long)at, (unsigned long long)f->data_bytes);
    for (int32_t i = 1; i < f->n && st == MST_OK; i++)
        if (strcmp(f->e[i - 1].name, f->e[i].name) == 0)
            st = mst_set_error(MST_ERR_INVALID, "safetensors '%s': tensor '%s' twice", f->path, f->e[i].name);
    free(o);
    return st;
}

/* The header's JSON: entries and the hash of __metadata__. */
static mst_status parse_header(mst_st_file* f, const mst_json* j) {
    if (j->tok[0].kind != MST_JSON_OBJECT)
        return mst_set_error(MST_ERR_INVALID, "safetensors '%s': the header is not a JSON object", f->path);
    f->e = (mst_st_entry*)malloc(sizeof *f->e * (size_t)(j->tok[0].n_children / 2 + 1));
    if (!f->e) return mst_set_error(MST_ERR_OOM, "safetensors '%s': header entries", f->path);
    for (int32_t k = 1; k < j->tok[0].next; k = j->tok[k + 1].next) {
        if (mst_json_eq(j, k, "__metadata__")) {
            char hex[32], *end;
            const int32_t h = mst_json_get(j, k + 1, "fnv1a");
            if (h >= 0 && (mst_json_str(j, h, hex, sizeof hex) || (f->fnv1a = strtoull(hex, &end, 16), *end || !hex[0])))
                return mst_set_error(MST_ERR_INVALID, "safetensors '%s': __metadata__.fnv1a is not a hex number", f->path);
            f->has_hash = h >= 0;
            continue;
        }
        if (j->tok[k + 1].kind != MST_JSON_OBJECT)
            return mst_set_error(MST_ERR_INVALID, "safetensors '%s': header entry %d is not an object", f->path, f->n);
        MST_TRY(parse_entry(f->path, j, k, k + 1, &f->e[f->n]));
        f->n++;
    }
    qsort(f->e, (size_t)f->n, sizeof *f->e, by_name);
    return check_tiling(f);
}

static mst_status open_header(const char* path, mst_st_file* out, char** hdr) {
    FILE* fp = fopen(path, "rb");
    if (!fp) return mst_set_error(errno == ENOENT ? MST_ERR_INVALID : MST_ERR_IO, "safetensors '%s': %s", path, strerror(errno));
    struct stat sb;
    uint8_t len[8];
    uint64_t n = 0, size = 0;
    mst_status st = fstat(fileno(fp), &sb) == 0 ? MST_OK : mst_set_error(MST_ERR_IO, "safetensors '%s': %s", path, strerror(errno));
    if (st == MST_OK) size = (uint64_t)sb.st_size;
    if (st == MST_OK && (size < 8 || fread(len, 1, 8, fp) != 8))
        st = mst_set_error(MST_ERR_INVALID, "safetensors '%s': %llu bytes, no header (truncated)", path, (unsigned long long)size);
    for (int b = 0; st == MST_OK && b < 8; b++) n |= (uint64_t)len[b] << (8 * b);
    if (st == MST_OK && (n > (100u << 20) || n + 8 > size))
        st = mst_set_error(MST_ERR_INVALID, "safetensors '%s': a header of %llu bytes in a file of %llu (truncated or not "
                           "safetensors)", path, (unsigned long long)n, (unsigned long long)size);
    if (st == MST_OK && !(*hdr = (char*)malloc((size_t)n + 1))) st = mst_set_error(MST_ERR_OOM, "safetensors '%s': header", path);
    if (st == MST_OK && fread(*hdr, 1, (size_t)n, fp) != n)
        st = mst_set_error(MST_ERR_IO, "safetensors '%s': header read failed", path);
    fclose(fp);
    out->data_at = 8 + n;
    out->data_bytes = size - (8 + n);
    return st;
}

mst_status mst_st_open(const char* path, mst_st_file* out) {
    memset(out, 0, sizeof *out);
    out->path = strdup(path);
    if (!out->path) return mst_set_error(MST_ERR_OOM, "safetensors '%s'", path);
    char* hdr = NULL;
    mst_status st = open_header(path, out, &hdr);
    mst_json j = {0};
    size_t err_at = 0;
    if (st == MST_OK && mst_json_parse(hdr, (size_t)(out->data_at - 8), &j, &err_at))
        st = mst_set_error(MST_ERR_INVALID, "safetensors '%s': the header is not JSON (byte %zu)", path, err_at);
    else if (st == MST_OK) st = parse_header(out, &j);
    mst_json_free(&j);
    free(hdr);
    if (st != MST_OK) mst_st_close(out);
    return st;
}

void mst_st_close(mst_st_file* f) {
    free(f->path);
    free(f->e);
    memset(f, 0, sizeof *f);
}

const mst_st_entry* mst_st_find(const mst_st_file* f, const char* name) {
    mst_st_entry key;
    if (strlen(name) >= sizeof key.name) return NULL;
    strcpy(key.name, name);
    return (const mst_st_entry*)bsearch(&key, f->e, (size_t)f->n, sizeof *f->e, by_name);
}

/* ---- reading data ----------------------------------------------------------------- */

static float f16_to_f32(uint16_t h) {
    const uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
    uint32_t u;
    if (e == 31) u = s | 0x7f800000u | (m << 13);           /* inf, NaN */
    else if (e) u = s | ((e + 112) << 23) | (m << 13);       /* normal   */
    else if (!m) u = s;                                      /* zero     */
    else {                                                   /* subnormal: m 2^-24 */
        float x = (float)m * 5.9604644775390625e-8f;
        memcpy(&u, &x, 4);
        u |= s;
    }
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* Element i of raw (dtype d, F32 / BF16 / F16) as a float. */
static float as_f32(const void* raw, mst_st_dtype d, size_t i) {
    if (d == MST_ST_F32) return ((const float*)raw)[i];
    if (d == MST_ST_BF16) return mst_bf16_to_fp32(((const uint16_t*)raw)[i]);
    return f16_to_f32(((const uint16_t*)raw)[i]);
}

static mst_status read_bytes(const mst_st_file* f, uint64_t at, void* buf, size_t bytes) {
    FILE* fp = fopen(f->path, "rb");
    if (!fp) return mst_set_error(MST_ERR_IO, "safetensors '%s': %s", f->path, strerror(errno));
    mst_status st = fseeko(fp, (off_t)(f->data_at + at), SEEK_SET) == 0 && fread(buf, 1, bytes, fp) == bytes
                        ? MST_OK : mst_set_error(MST_ERR_IO, "safetensors '%s': read of %zu bytes at data byte %llu failed "
                                                 "(the file changed?)", f->path, bytes, (unsigned long long)at);
    fclose(fp);
    return st;
}

mst_status mst_st_read(const mst_st_file* f, const mst_st_entry* e, mst_st_dtype to, void* out) {
    const int floaty = e->dtype == MST_ST_F32 || e->dtype == MST_ST_BF16 || e->dtype == MST_ST_F16;
    if (!(to == MST_ST_I32 ? e->dtype == MST_ST_I32 : (to == MST_ST_F32 || to == MST_ST_BF16) && floaty))
        return mst_set_error(MST_ERR_INVALID, "safetensors '%s': tensor '%s' is %s, not convertible to %s", f->path, e->name,
                             mst_st_dtype_str(e->dtype), mst_st_dtype_str(to));
    const size_t n = (size_t)mst_st_numel(e), bytes = (size_t)(e->end - e->begin);
    if (e->dtype == to) return read_bytes(f, e->begin, out, bytes);
    void* raw = malloc(bytes ? bytes : 1);
    if (!raw) return mst_set_error(MST_ERR_OOM, "safetensors '%s': tensor '%s' (%zu bytes)", f->path, e->name, bytes);
    mst_status st = read_bytes(f, e->begin, raw, bytes);
    for (size_t i = 0; st == MST_OK && i < n; i++) {
        const float x = as_f32(raw, e->dtype, i);
        if (to == MST_ST_F32) ((float*)out)[i] = x;
        else ((uint16_t*)out)[i] = mst_fp32_to_bf16(x);
    }
    free(raw);
    return st;
}

mst_status mst_st_verify(const mst_st_file* f) {
    if (!f->has_hash) return MST_OK;
    const mst_st_entry** o = (const mst_st_entry**)malloc(sizeof *o * (size_t)(f->n ? f->n : 1));
    size_t big = 1;
    for (int32_t i = 0; i < f->n; i++) big = f->e[i].end - f->e[i].begin > big ? (size_t)(f->e[i].end - f->e[i].begin) : big;
    void* buf = malloc(big);
    mst_status st = o && buf ? MST_OK : mst_set_error(MST_ERR_OOM, "safetensors '%s': verify", f->path);
    for (int32_t i = 0; st == MST_OK && i < f->n; i++) o[i] = &f->e[i];
    if (st == MST_OK) qsort(o, (size_t)f->n, sizeof *o, by_offset);
    uint64_t h = MST_FNV1A_SEED;
    for (int32_t i = 0; st == MST_OK && i < f->n; i++) {
        st = read_bytes(f, o[i]->begin, buf, (size_t)(o[i]->end - o[i]->begin));
        h = mst_fnv1a(h, buf, (size_t)(o[i]->end - o[i]->begin));
    }
    if (st == MST_OK && h != f->fnv1a)
        st = mst_set_error(MST_ERR_INVALID, "safetensors '%s': the data's FNV-1a is %016llx, its header says %016llx (damaged)",
                           f->path, (unsigned long long)h, (unsigned long long)f->fnv1a);
    free(buf);
    free(o);
    return st;
}

/* ---- writing -------------------------------------------------------------------- */

typedef struct sbuf {
    char* s;
    size_t n, cap;
    int oom;
} sbuf;

static void put(sbuf* b, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(sbuf* b, const char* fmt, ...) {
    for (int tries = 0; tries < 2 && !b->oom; tries++) {
        va_list ap;
        va_start(ap, fmt);
        const int k = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k >= 0 && b->s && b->n + (size_t)k < b->cap) {
            b->n += (size_t)k;
            return;
        }
        size_t cap = b->cap ? b->cap : 4096;
        while (cap <= b->n + (size_t)k + 8) cap *= 2;
        char* s = (char*)realloc(b->s, cap);
        if (!s) b->oom = 1;
        else b->s = s, b->cap = cap;
    }
}

/* The header with the hash placeholder; *hash_at its offset in the text. */
static void header(sbuf* b, mst_st_entry* e, int32_t n, size_t* hash_at) {
    put(b, "{\"__metadata__\":{\"format\":\"pt\",\"writer\":\"moestash %d.%d\",\"fnv1a\":\"", MST_VERSION_MAJOR,
        MST_VERSION_MINOR);
    *hash_at = b->n;
    put(b, "0000000000000000\"}");
    uint64_t off = 0;
    for (int32_t i = 0; i < n; i++) {
        e[i].begin = off;
        e[i].end = off += (uint64_t)mst_st_numel(&e[i]) * mst_st_dtype_bytes(e[i].dtype);
        put(b, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", e[i].name, mst_st_dtype_str(e[i].dtype));
        for (int32_t d = 0; d < e[i].nd; d++) put(b, "%s%lld", d ? "," : "", (long long)e[i].dims[d]);
        put(b, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)e[i].begin, (unsigned long long)e[i].end);
    }
    put(b, "}");
    while (!b->oom && b->n % 8) put(b, " ");
}

mst_status mst_st_write_begin(mst_st_writer* w, const char* path, mst_st_entry* e, int32_t n) {
    memset(w, 0, sizeof *w);
    w->hash = MST_FNV1A_SEED;
    w->path = strdup(path);
    sbuf b = {0};
    size_t hash_at = 0;
    header(&b, e, n, &hash_at);
    mst_status st = w->path && !b.oom ? MST_OK : mst_set_error(MST_ERR_OOM, "safetensors '%s': header", path);
    if (st == MST_OK && !(w->f = fopen(path, "wb")))
        st = mst_set_error(MST_ERR_IO, "safetensors '%s': %s", path, strerror(errno));
    uint8_t len[8];
    for (int k = 0; k < 8; k++) len[k] = (uint8_t)((uint64_t)b.n >> (8 * k));
    if (st == MST_OK && (fwrite(len, 1, 8, w->f) != 8 || fwrite(b.s, 1, b.n, w->f) != b.n))
        st = mst_set_error(MST_ERR_IO, "safetensors '%s': header write failed: %s", path, strerror(errno));
    w->hash_at = (long)(8 + hash_at);
    w->left = n ? e[n - 1].end : 0;
    free(b.s);
    if (st != MST_OK) mst_st_write_abort(w);
    return st;
}

mst_status mst_st_write_data(mst_st_writer* w, const void* p, size_t bytes) {
    if (!w->f || bytes > w->left) {
        mst_st_write_abort(w);
        return mst_set_error(MST_ERR_STATE, "safetensors writer: %zu bytes more than its header holds", bytes);
    }
    w->hash = mst_fnv1a(w->hash, p, bytes);
    w->left -= bytes;
    if (fwrite(p, 1, bytes, w->f) == bytes) return MST_OK;
    mst_status st = mst_set_error(MST_ERR_IO, "safetensors '%s': write failed: %s", w->path, strerror(errno));
    mst_st_write_abort(w);
    return st;
}

mst_status mst_st_write_end(mst_st_writer* w) {
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)w->hash);
    mst_status st = w->f && w->left == 0 ? MST_OK : mst_set_error(MST_ERR_STATE, "safetensors '%s': %llu bytes missing", w->path,
                                                                   (unsigned long long)w->left);
    if (st == MST_OK && (fseek(w->f, w->hash_at, SEEK_SET) != 0 || fwrite(hex, 1, 16, w->f) != 16 || fflush(w->f) != 0 ||
                         fsync(fileno(w->f)) != 0))
        st = mst_set_error(MST_ERR_IO, "safetensors '%s': %s", w->path, strerror(errno));
    if (st == MST_OK) {
        const int bad = fclose(w->f) != 0;
        w->f = NULL;
        if (bad) st = mst_set_error(MST_ERR_IO, "safetensors '%s': close failed: %s", w->path, strerror(errno));
    }
    if (st != MST_OK) mst_st_write_abort(w);
    free(w->path);
    w->path = NULL;
    return st;
}

void mst_st_write_abort(mst_st_writer* w) {
    if (w->f) fclose(w->f);
    if (w->path) unlink(w->path);
    free(w->path);
    w->f = NULL;
    w->path = NULL;
}

mst_status mst_fsync_dir(const char* dir) {
    const int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return mst_set_error(MST_ERR_IO, "'%s': %s", dir, strerror(errno));
    const int bad = fsync(fd) != 0 && errno != EINVAL; /* some filesystems do not sync directories */
    close(fd);
    return bad ? mst_set_error(MST_ERR_IO, "'%s': fsync: %s", dir, strerror(errno)) : MST_OK;
}
