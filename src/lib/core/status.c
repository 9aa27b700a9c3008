/*
 * status.c — status names, the per-thread last-error message, and the
 * argument checks shared by every public function.
 */
#include <stdarg.h>
#include <stdio.h>

#include "../backend/counts.h"
#include "context.h"

static _Thread_local char last_error[512];

const char* mst_status_str(mst_status s) {
    switch (s) {
    case MST_OK: return "ok";
    case MST_ERR_INVALID: return "invalid argument";
    case MST_ERR_OOM: return "out of memory";
    case MST_ERR_COUNTS: return "bad counts";
    case MST_ERR_OVERFLOW: return "stash pool overflow";
    case MST_ERR_BACKEND: return "backend error";
    case MST_ERR_UNSUPPORTED: return "unsupported";
    case MST_ERR_STATE: return "bad state";
    case MST_ERR_IO: return "i/o error";
    }
    return "unknown status";
}

const char* mst_last_error(void) { return last_error; }

mst_status mst_set_error(mst_status s, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return s;
}

mst_status mst_check_struct_size(const char* arg, const char* type, size_t got, size_t want) {
    if (got == want) return MST_OK;
    char init[64]; /* the initializer: "mst_mem_report_t" -> "MST_MEM_REPORT_INIT" */
    size_t n = 0;
    for (const char* c = type; *c && n + 1 < sizeof init; c++) init[n++] = (char)(*c >= 'a' && *c <= 'z' ? *c - 32 : *c);
    init[n] = 0;
    if (n > 2 && init[n - 2] == '_' && init[n - 1] == 'T') init[n -= 2] = 0;
    return mst_set_error(MST_ERR_INVALID,
                         "%s (%s) has struct_size %zu, this library knows %zu: set it with %s_INIT "
                         "(a program built against another moestash.h?)",
                         arg, type, got, want, init);
}

mst_status mst_check_ctx(const mst_ctx_t* ctx) {
    if (!ctx) return mst_set_error(MST_ERR_INVALID, "ctx is NULL");
    return MST_OK;
}

mst_status mst_check_tensor(const mst_tensor* t, const char* name, mst_dtype dtype) {
    if (!t) return mst_set_error(MST_ERR_INVALID, "%s is NULL", name);
    if (t->pages)
        return mst_set_error(MST_ERR_INVALID, "%s is paged: only the x of grouped_linear_wgrad may be", name);
    if (!t->data) return mst_set_error(MST_ERR_INVALID, "%s.data is NULL", name);
    if (t->dtype != dtype)
        return mst_set_error(MST_ERR_INVALID, "%s.dtype is %s, expected %s", name,
                             mst_dtype_name(t->dtype), mst_dtype_name(dtype));
    if (t->rows <= 0 || t->cols <= 0)
        return mst_set_error(MST_ERR_INVALID, "%s has shape [%lld, %lld]: both must be > 0", name,
                             (long long)t->rows, (long long)t->cols);
    return MST_OK;
}

mst_status mst_check_shape(const mst_tensor* t, const char* name, int64_t rows, int64_t cols) {
    if (t->rows != rows || t->cols != cols)
        return mst_set_error(MST_ERR_INVALID, "%s has shape [%lld, %lld], expected [%lld, %lld]",
                             name, (long long)t->rows, (long long)t->cols, (long long)rows,
                             (long long)cols);
    return MST_OK;
}

mst_status mst_check_pages(const mst_pages* pg, const char* name) {
    if (!pg->table || pg->page_rows <= 0 || pg->n_pages[0] < 0 || pg->n_pages[1] < 0 ||
        (pg->n_pages[0] > 0 && !pg->block[0]) || (pg->n_pages[1] > 0 && !pg->block[1]))
        return mst_set_error(MST_ERR_INVALID, "%s: table %p, page_rows %lld, blocks of %lld / %lld pages at %p / %p",
                             name, (const void*)pg->table, (long long)pg->page_rows, (long long)pg->n_pages[0],
                             (long long)pg->n_pages[1], pg->block[0], pg->block[1]);
    return MST_OK;
}

mst_status mst_counts_offsets(const int32_t* counts, int32_t n_groups, int64_t max_rows,
                              int64_t* off) {
    if (mst_counts_total(counts, n_groups, max_rows, off) != MST_COUNTS_BAD) return MST_OK;
    for (int32_t g = 0; g < n_groups; g++) { /* the message names the first culprit */
        if (counts[g] < 0)
            return mst_set_error(MST_ERR_COUNTS, "counts[%d] = %d is negative", g, counts[g]);
        if (off[g + 1] > max_rows)
            return mst_set_error(MST_ERR_COUNTS,
                                 "counts sum to %lld by group %d, past max_rows = %lld",
                                 (long long)off[g + 1], g, (long long)max_rows);
    }
    MST_ASSERT(!"mst_counts_total and its explanation disagree");
    return MST_ERR_COUNTS;
}
