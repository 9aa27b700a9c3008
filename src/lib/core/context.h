/*
 * context.h — the private layout of a context and the error helpers every
 * part of the library uses.
 */
#ifndef MST_CONTEXT_H
#define MST_CONTEXT_H

#include <stdio.h>
#include <stdlib.h>

#include "../backend/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A workspace: backend-memory scratch that an op reuses between calls,
 * grown (never shrunk) by mst_workspace outside graph capture (run an op
 * once before capturing it); freed with the context. Its owner keeps it. */
typedef struct mst_ws {
    void* ptr;               /* backend memory, or NULL */
    size_t n_bytes;
} mst_ws;

struct mst_ops_state; /* the ops layer's state (src/lib/ops/ops_state.h) */

typedef struct mst_alloc_rec {
    void* ptr;           /* backend memory */
    size_t n_bytes;
} mst_alloc_rec;

struct mst_ctx {
    const mst_backend* be;   /* function table of this context's backend      */
    mst_backend_kind kind;
    int device;              /* CUDA device index; 0 for the CPU              */
    void* impl;              /* backend state (streams, handles)              */
    int32_t* err_flag;       /* [1] backend memory: MST_FLAG_* bits           */
    mst_alloc_rec* allocs;   /* [n_allocs] live allocations                   */
    int n_allocs, cap_allocs;
    size_t in_use_bytes;     /* sum of allocs[].n_bytes                       */
    size_t peak_bytes;       /* max of in_use_bytes over the context's life   */
    struct mst_ops_state* ops; /* the ops layer's state, made on first use   */
    void (*ops_free)(struct mst_ops_state* ops); /* frees it with the context */
    char desc[256];          /* mst_ctx_describe()                            */
};

/* Records a failure: formats the thread's last-error message, returns s. */
mst_status mst_set_error(mst_status s, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Programmer errors inside the library: abort with file and line. */
#define MST_ASSERT(cond)                                                              \
    do {                                                                              \
        if (!(cond)) {                                                                \
            fprintf(stderr, "moestash: assertion failed: %s at %s:%d\n", #cond,       \
                    __FILE__, __LINE__);                                              \
            abort();                                                                  \
        }                                                                             \
    } while (0)

#define MST_TRY(expr)                     \
    do {                                  \
        mst_status st_ = (expr);          \
        if (st_ != MST_OK) return st_;    \
    } while (0)

/* Argument checks shared by every public op: each names the argument. */
mst_status mst_check_ctx(const mst_ctx_t* ctx);
mst_status mst_check_tensor(const mst_tensor* t, const char* name, mst_dtype dtype);
mst_status mst_check_shape(const mst_tensor* t, const char* name, int64_t rows, int64_t cols);
/* Pages an op reads or writes rows of (mst_paged_row): a table, page rows,
 * and a block wherever pages are counted. */
mst_status mst_check_pages(const mst_pages* pg, const char* name);

/* A public struct that may grow (moestash.h, "struct sizes"): MST_OK when
 * `got`, its struct_size, is a size of `type` this library knows (today only
 * `want`, its sizeof); else MST_ERR_INVALID naming the argument, the struct,
 * both sizes and the initializer. */
mst_status mst_check_struct_size(const char* arg, const char* type, size_t got, size_t want);
#define MST_CHECK_STRUCT(arg, ptr, type) mst_check_struct_size(arg, #type, (ptr)->struct_size, sizeof(type))

/* Scratch of at least n_bytes in *ws, grown (never shrunk) on demand. */
mst_status mst_workspace(mst_ctx_t* ctx, mst_ws* ws, size_t n_bytes, void** out);

/* The counts contract (backend/counts.h) on host-readable counts: the
 * offsets into off [E+1], or MST_ERR_COUNTS (message naming the group) when
 * a count is negative or the sum passes max_rows. */
mst_status mst_counts_offsets(const int32_t* counts, int32_t n_groups, int64_t max_rows,
                              int64_t* off);

#ifdef __cplusplus
}
#endif
#endif /* MST_CONTEXT_H */
