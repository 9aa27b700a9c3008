/*
 * moestash.h — the one public C API of moestash.
 *
 * moestash trains mixture-of-experts expert layers with little activation
 * memory while staying capturable in one CUDA graph. Everything here is plain
 * C11, callable through any C FFI.
 *
 * Conventions:
 *   - every fallible function returns mst_status; on failure mst_last_error()
 *     names the argument and its value.
 *   - "backend memory" is memory of the context's backend: host memory for the
 *     CPU backend, device memory for the CUDA backend (see mst_alloc).
 *   - shapes in comments use short capitals: E groups, R rows (max_rows),
 *     I/O in/out widths, H hidden, F ffn.
 *
 * Ownership and lifetimes:
 *   - the caller owns what a *_create returns and gives it back with the
 *     matching *_destroy; a NULL destroys nothing. mst_tensor and mst_pages
 *     are views: they own nothing.
 *   - backend memory from mst_alloc belongs to its context: mst_free gives
 *     one block back, mst_ctx_destroy every block still allocated.
 *   - pools (with their handles), memory managers and basic savers hold their
 *     context: destroy them before it (a pool's pinned host block and every
 *     object's host memory are freed by its own destroy, not the context's).
 *   - a saver from mst_memmgr_forward/backward/recompute or
 *     mst_saver_basic_get belongs to the object that returned it.
 *   - strings returned are the library's: static (names, mst_version), the
 *     context's (mst_ctx_describe, until it is destroyed), or the thread's
 *     (mst_last_error, until the next failing call on that thread).
 *
 * Threading: the library takes no locks. Calls on one context, and on every
 * object created on it, must not overlap: use each from one thread at a time.
 * The last-error message is per thread.
 */
#ifndef MOESTASH_H
#define MOESTASH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Every function of this header is exported (MST_API); the shared library
 * exports nothing else. */
#ifndef MST_API
#if defined(__GNUC__) || defined(__clang__)
#define MST_API __attribute__((visibility("default")))
#else
#define MST_API
#endif
#endif

/* The version of this header; mst_version() is the library's ("0.2.0").
 * 0.x: every minor version may change a layout of this header, so the SONAME
 * carries it (libmoestash.so.0.2): bump MST_VERSION_MINOR with any change of
 * a struct below. */
#define MST_VERSION_MAJOR 0
#define MST_VERSION_MINOR 2
#define MST_VERSION_PATCH 0

MST_API const char* mst_version(void);

/* ---- struct sizes (ABI) --------------------------------------------------- *
 * A struct that may grow (the configs, the reports, the saver table) starts
 * with `size_t struct_size`, set by its MST_<NAME>_INIT initializer (or the
 * function that returns a filled one, e.g. mst_pool_config_default) to the
 * sizeof the caller was compiled with; this holds for structs the library
 * fills too (mst_mem_report_t, mst_pool_stats: set struct_size before the
 * call). The library refuses a size it does not know with MST_ERR_INVALID
 * naming the struct, the size it got and the size it expects, instead of
 * reading or writing past a shorter struct. A later version that grows a
 * struct keeps accepting the sizes of the earlier ones.
 * Frozen layouts (no struct_size; changing one changes the SONAME): the views
 * mst_tensor and mst_pages, the array element mst_sched_entry, the fixed set
 * of tensors mst_mlp_weights and the opaque mst_ep_id. */
#ifdef __cplusplus
#define MST_STRUCT_INIT_(T) {sizeof(T)}
#else
#define MST_STRUCT_INIT_(T) {.struct_size = sizeof(T)}
#endif

/* ---- status -------------------------------------------------------------- */

typedef enum mst_status {
    MST_OK = 0,
    MST_ERR_INVALID,     /* bad argument: null pointer, shape, dtype, value   */
    MST_ERR_OOM,         /* an allocation failed                              */
    MST_ERR_COUNTS,      /* counts negative or summing past max_rows          */
    MST_ERR_OVERFLOW,    /* a stash pool ran out of pages (device flag)       */
    MST_ERR_BACKEND,     /* the backend (CUDA, cuBLAS) reported an error      */
    MST_ERR_UNSUPPORTED, /* backend not built in, or op missing on a backend  */
    MST_ERR_STATE,       /* call out of order: e.g. restore of a free handle  */
    MST_ERR_IO,          /* a file could not be read or written               */
} mst_status;

MST_API const char* mst_status_str(mst_status s);
/* The message of the last failure on this thread ("" if none). */
MST_API const char* mst_last_error(void);

/* ---- dtypes and bf16 ----------------------------------------------------- */

typedef enum mst_dtype {
    MST_DTYPE_BF16 = 0, /* uint16_t storage, round-to-nearest-even from fp32 */
    MST_DTYPE_FP32,
    MST_DTYPE_INT32,
    MST_DTYPE_FP8,      /* a pool's pages only (mst_pool_create): bf16 rows stored
                           as e4m3 codes with one fp32 scale per 128 elements */
} mst_dtype;

MST_API size_t mst_dtype_size(mst_dtype dt);
MST_API const char* mst_dtype_name(mst_dtype dt);

MST_API uint16_t mst_fp32_to_bf16(float f); /* round to nearest even; NaN stays NaN */
MST_API float mst_bf16_to_fp32(uint16_t h);
MST_API void mst_fp32_to_bf16_array(uint16_t* dst, const float* src, size_t n);
MST_API void mst_bf16_to_fp32_array(float* dst, const uint16_t* src, size_t n);

/* ---- context ------------------------------------------------------------- */

typedef enum mst_backend_kind {
    MST_BACKEND_CPU = 0,
    MST_BACKEND_CUDA,
} mst_backend_kind;

typedef struct mst_ctx mst_ctx_t;

/* True when the library was built with this backend and, for CUDA, a device
 * is present. */
MST_API int mst_backend_available(mst_backend_kind kind);
/* Creates a context: streams, workspace and the device-side error flag.
 * device: CUDA device index (ignored for the CPU backend). */
MST_API mst_status mst_ctx_create(mst_backend_kind kind, int device, mst_ctx_t** out);
MST_API void mst_ctx_destroy(mst_ctx_t* ctx);
MST_API mst_backend_kind mst_ctx_backend(const mst_ctx_t* ctx);
/* A one-line description (backend, device name, memory, build options). */
MST_API const char* mst_ctx_describe(const mst_ctx_t* ctx);
/* Waits for all work on the context's streams. */
MST_API mst_status mst_ctx_sync(mst_ctx_t* ctx);
/* Waits, then reads and clears the device error flag: MST_ERR_COUNTS when an
 * op saw bad counts since the last check. One small read, once per step. */
MST_API mst_status mst_ctx_check(mst_ctx_t* ctx);
/* Backend memory in use through mst_alloc, now and at peak, in bytes. */
MST_API void mst_ctx_mem(const mst_ctx_t* ctx, size_t* in_use_bytes, size_t* peak_bytes);
/* Starts a new peak: the peak becomes the bytes in use now. */
MST_API void mst_ctx_mem_reset_peak(mst_ctx_t* ctx);
/* Total backend memory: the device's for CUDA, the host's physical RAM for
 * the CPU backend. */
MST_API mst_status mst_ctx_capacity(mst_ctx_t* ctx, size_t* total_bytes);
/* Stream the context enqueues on (cudaStream_t for CUDA, NULL for the CPU).
 * The caller may set it, e.g. while capturing a CUDA graph on its own stream. */
MST_API void* mst_ctx_stream(mst_ctx_t* ctx);
MST_API mst_status mst_ctx_set_stream(mst_ctx_t* ctx, void* stream);

/* ---- backend memory ------------------------------------------------------ */

MST_API mst_status mst_alloc(mst_ctx_t* ctx, size_t n_bytes, void** out);
MST_API void mst_free(mst_ctx_t* ctx, void* ptr);
MST_API mst_status mst_copy_h2b(mst_ctx_t* ctx, void* dst, const void* host_src, size_t n_bytes);
MST_API mst_status mst_copy_b2h(mst_ctx_t* ctx, void* host_dst, const void* src, size_t n_bytes);
MST_API mst_status mst_copy_b2b(mst_ctx_t* ctx, void* dst, const void* src, size_t n_bytes);
/* Sets every byte of [dst, dst + n_bytes) to `byte`. */
MST_API mst_status mst_fill(mst_ctx_t* ctx, void* dst, int byte, size_t n_bytes);

/* ---- tensors ------------------------------------------------------------- */

/* A 2-D row-major view of backend memory. Does not own its data. */
/* Rows held in pages (a stashed tensor, read in place): row r is row
 * r % page_rows of page table[r / page_rows]; an id with bit 31 set is page
 * (id & 0x7fffffff) of the host block, else of the device block. Rows past
 * table_rows and ids past their block read as zeros. */
typedef struct mst_pages {
    const uint32_t* table; /* backend memory, [table_rows / page_rows] ids  */
    void* block[2];        /* device block, pinned host block (or NULL)      */
    int64_t n_pages[2];    /* pages of each block                            */
    int64_t page_rows;     /* rows per page                                  */
    int64_t table_rows;    /* rows the table covers (a page_rows multiple)   */
} mst_pages;

typedef struct mst_tensor {
    void* data;      /* backend memory, rows * cols elements */
    mst_dtype dtype;
    int64_t rows;
    int64_t cols;
    const mst_pages* pages; /* NULL: rows at data; else the rows are in these
                               pages (data unused). Only the x of
                               mst_grouped_linear_wgrad may be paged */
} mst_tensor;

MST_API mst_tensor mst_tensor_make(void* data, mst_dtype dtype, int64_t rows, int64_t cols);
MST_API size_t mst_tensor_bytes(const mst_tensor* t);

/* ---- grouped linear (graph-safe) ---------------------------------------- *
 * Rows r of group g, off = exclusive prefix sum of counts:
 *   forward (TN): y[r] = x[r] W[g]^T + bias[g] * s[r]
 *   dgrad   (NN): dx[r] = dy[r] W[g]
 *   wgrad   (NT): dW[g] (+)= sum_r dy[r]^T x[r]; dbias[g] (+)= sum_r dy[r] s[r];
 *                 ds[r] = dy[r] . bias[g]
 * counts: int32 [E, 1] in backend memory, read when the op executes (on the
 * device for CUDA). Rows past sum(counts) are neither read nor written.
 * Bad counts (negative, sum > R): nothing is written past R, the context's
 * error flag is set; the CPU backend also returns MST_ERR_COUNTS at once, the
 * CUDA backend at the next mst_ctx_check(). */

typedef enum mst_wgrad_mode {
    MST_WGRAD_OVERWRITE = 0, /* main_grad[g] = dW[g]                               */
    MST_WGRAD_ACCUMULATE,    /* main_grad[g] += dW[g], in the GEMM epilogue        */
    MST_WGRAD_DEFERRED,      /* recorded; runs as ACCUMULATE at mst_wgrad_flush()  */
} mst_wgrad_mode;

/* x [R, I] bf16; w [E*O, I] bf16 (packed [E, O, I]); bias [E, O] bf16 or NULL;
 * scale [R, 1] fp32 or NULL (1); counts [E, 1] int32; y [R, O] bf16. */
MST_API mst_status mst_grouped_linear_forward(mst_ctx_t* ctx, const mst_tensor* x, const mst_tensor* w,
                                              const mst_tensor* bias, const mst_tensor* scale,
                                              const mst_tensor* counts, mst_tensor* y);
/* dy [R, O] bf16; w [E*O, I] bf16; counts [E, 1]; dx [R, I] bf16. */
MST_API mst_status mst_grouped_linear_dgrad(mst_ctx_t* ctx, const mst_tensor* dy, const mst_tensor* w,
                                            const mst_tensor* counts, mst_tensor* dx);
/* dy [R, O] bf16; x [R, I] bf16; counts [E, 1];
 * main_grad_w [E*O, I] fp32 (required);
 * main_grad_b [E, O] fp32 or NULL (dbias, with scale s when given);
 * bias [E, O] bf16 and dscale [R, 1] fp32: both or neither (ds = dy . bias[g]);
 * scale [R, 1] fp32 or NULL (used for dbias only). */
MST_API mst_status mst_grouped_linear_wgrad(mst_ctx_t* ctx, const mst_tensor* dy, const mst_tensor* x,
                                            const mst_tensor* scale, const mst_tensor* bias,
                                            const mst_tensor* counts, mst_tensor* main_grad_w,
                                            mst_tensor* main_grad_b, mst_tensor* dscale,
                                            mst_wgrad_mode mode);
/* Runs every DEFERRED wgrad recorded on ctx, in the order recorded, and
 * empties the queue. One that fails does not stop the others: all run, and
 * the first failure is returned (its message names it). */
MST_API mst_status mst_wgrad_flush(mst_ctx_t* ctx);
/* Number of DEFERRED wgrads waiting for mst_wgrad_flush(). */
MST_API int mst_wgrad_pending(const mst_ctx_t* ctx);

/* ---- saved activations (the interface the memory manager plugs into) ---- *
 * An op that saves activations for its backward asks a saver where to put
 * them. The saver applies the policy of each name: KEEP (own max_rows
 * buffer), STASH (device pages), OFFLOAD (pinned host pages), RECOMPUTE (not
 * saved; the op recomputes it in backward). A policy moves only the tensor it
 * names. */

typedef enum mst_saved_name {
    MST_SAVED_FC1_INPUT = 0, /* x   [R, H]    bf16 */
    MST_SAVED_ACT_INPUT,     /* h   [R, 2F]   bf16 (fc1 output) */
    MST_SAVED_FC2_INPUT,     /* z   [R, F]    bf16 (activation output) */
    MST_SAVED_PROBS,         /* p   [R, 1]    fp32 */
    MST_N_SAVED,
} mst_saved_name;

typedef enum mst_policy {
    MST_POLICY_KEEP = 0,
    MST_POLICY_STASH,
    MST_POLICY_OFFLOAD,
    MST_POLICY_RECOMPUTE,
    MST_N_POLICIES,
    /* STASH and OFFLOAD with fp8 pages ("stash:fp8"): a bf16 tensor's rows
     * quantized to e4m3 with one power-of-two fp32 scale per 128 elements
     * (|x' - x| <= 2^-4 max(|x|, 2^-6 scale): see docs/DESIGN.md), restored
     * as bf16 before the backward reads them. The plain policies store the
     * tensor's own bits (exact). A value is the base policy plus
     * MST_POLICY_FP8; mst_policy_base gives the base. */
    MST_POLICY_FP8 = 0x100,
    MST_POLICY_STASH_FP8 = MST_POLICY_FP8 | MST_POLICY_STASH,
    MST_POLICY_OFFLOAD_FP8 = MST_POLICY_FP8 | MST_POLICY_OFFLOAD,
} mst_policy;

/* KEEP, STASH, OFFLOAD or RECOMPUTE of p (its page format dropped). */
MST_API mst_policy mst_policy_base(mst_policy p);
/* 1 when p is a policy: a base policy, or STASH / OFFLOAD with fp8 pages. */
MST_API int mst_policy_valid(mst_policy p);

MST_API const char* mst_saved_name_str(mst_saved_name n); /* "fc1_input", ... */
MST_API const char* mst_policy_str(mst_policy p);          /* "keep", "stash:fp8", ... */
/* Parses a name ("act_input") or policy ("stash", "stash:fp8", "stash:bf16"
 * = "stash"); MST_ERR_INVALID naming it. */
MST_API mst_status mst_saved_name_parse(const char* s, mst_saved_name* out);
MST_API mst_status mst_policy_parse(const char* s, mst_policy* out);
/* A policy spec: one policy for every name ("stash"; "recompute" means
 * fc2_input recomputed, the rest kept) or NAME=POLICY items separated by
 * commas ("fc1_input=stash,fc2_input=recompute"; names left out: keep) into
 * out[name]. MST_ERR_INVALID with a message naming the item: an empty item,
 * an unknown name or policy, a name given twice, a bare policy among items,
 * recompute for a name other than fc2_input, fp8 for probs (fp32). A bare
 * fp8 policy ("stash:fp8") gives probs the policy's bf16 form. */
MST_API mst_status mst_policy_spec_parse(const char* spec, mst_policy out[MST_N_SAVED]);
/* The spec of p[] that mst_policy_spec_parse reads back as p[]: the policy
 * when every name has it ("recompute" when fc2_input alone is recomputed),
 * or "stash:fp8" when the bf16 names have it and probs "stash"), else
 * NAME=POLICY for every name in mst_saved_name order. MST_ERR_INVALID for a
 * value that is not a policy (or recompute beside a name other than
 * fc2_input, fp8 for probs) or an out[size] too small (MST_POLICY_SPEC_MAX
 * holds any). */
#define MST_POLICY_SPEC_MAX 96
MST_API mst_status mst_policy_spec_format(const mst_policy p[MST_N_SAVED], char* out, size_t size);
/* The shape of saved tensor `name` of a grouped MLP of width `hidden` and
 * `ffn`: [R, *cols] of *dtype (the table in the comments of mst_saved_name). */
MST_API mst_status mst_saved_shape(mst_saved_name name, int64_t hidden, int64_t ffn, int64_t* cols,
                                   mst_dtype* dtype);

typedef struct mst_saver {
    size_t struct_size; /* sizeof(mst_saver): MST_SAVER_INIT              */
    void* self;
    /* Forward, before the producer runs: the [R, cols] buffer to write tensor
     * `name` into (an op output that is saved). A compute buffer shared by
     * layers unless the policy is KEEP. */
    mst_status (*produce)(void* self, mst_saved_name name, int64_t rows, int64_t cols,
                          mst_dtype dtype, mst_tensor* out);
    /* Forward, once `src` (rows [0, sum(counts)) valid) holds the tensor:
     * KEEP copies it into its own buffer unless src is that buffer already,
     * STASH / OFFLOAD pack it into pages, RECOMPUTE does nothing. */
    mst_status (*commit)(void* self, mst_saved_name name, const mst_tensor* src,
                         const mst_tensor* counts);
    /* Backward: a tensor holding the saved rows. out->data is NULL when the
     * policy is RECOMPUTE: the op recomputes it. */
    mst_status (*fetch)(void* self, mst_saved_name name, mst_tensor* out);
    /* Backward: the op is done with tensor `name`. With MST_WGRAD_DEFERRED
     * the fetched data is still read by mst_wgrad_flush(): keep it valid
     * until the flush. */
    mst_status (*release)(void* self, mst_saved_name name);
    /* Forward, optional (NULL: never), before the producer of `name` runs:
     * pages (out->table set) that the producer writes the saved rows into
     * besides its output, so that commit copies nothing; out->table NULL:
     * the saver does not take the tensor that way. */
    mst_status (*claim)(void* self, mst_saved_name name, const mst_tensor* counts, mst_pages* out);
} mst_saver;
#define MST_SAVER_INIT MST_STRUCT_INIT_(mst_saver)

/* The basic saver: KEEP for every name, RECOMPUTE for fc2_input only; STASH
 * and OFFLOAD are the memory manager's (MST_ERR_UNSUPPORTED here). Each KEEP
 * name owns a [max_rows, cols] buffer allocated at create: produce() hands it
 * out (commit then copies nothing); commit() of a tensor held elsewhere copies
 * its max_rows rows in. A RECOMPUTE fc2_input gets one compute buffer. */
typedef struct mst_saver_basic mst_saver_basic_t;
struct mst_mlp_config;
MST_API mst_status mst_saver_basic_create(mst_ctx_t* ctx, int64_t max_rows,
                                          const struct mst_mlp_config* cfg,
                                          const mst_policy policies[MST_N_SAVED],
                                          mst_saver_basic_t** out);
MST_API void mst_saver_basic_destroy(mst_saver_basic_t* s);
MST_API const mst_saver* mst_saver_basic_get(mst_saver_basic_t* s);

/* ---- grouped MLP ---------------------------------------------------------- *
 * fc1 grouped linear (H -> 2F) -> gated activation scaled by the router prob
 * -> fc2 grouped linear (F -> H, bias scaled by the prob). See docs/DESIGN.md. */

typedef enum mst_activation {
    MST_ACT_SWIGLU = 0,     /* z = silu(a) * b * p                                    */
    MST_ACT_CLAMPED_SWIGLU, /* a' = min(a, L), b' = clamp(b, -L, L),
                               z = a' * sigmoid(alpha a') * (b' + 1) * p              */
} mst_activation;

typedef struct mst_mlp_config {
    size_t struct_size;      /* sizeof(mst_mlp_config)               */
    int32_t n_groups;        /* E                                   */
    int64_t hidden;          /* H                                   */
    int64_t ffn;             /* F                                   */
    mst_activation act;
    float clamp_limit;       /* L, default 7                         */
    float clamp_alpha;       /* alpha, default 1.702                 */
} mst_mlp_config;
#define MST_MLP_CONFIG_INIT MST_STRUCT_INIT_(mst_mlp_config)

/* Weights and their fp32 main gradients; b1, b2 and their grads optional
 * (data NULL). */
typedef struct mst_mlp_weights {
    mst_tensor w1;      /* [E*2F, H] bf16 */
    mst_tensor b1;      /* [E, 2F]   bf16 (optional) */
    mst_tensor w2;      /* [E*H, F]  bf16 */
    mst_tensor b2;      /* [E, H]    bf16 (optional) */
    mst_tensor g_w1;    /* [E*2F, H] fp32 main_grad */
    mst_tensor g_b1;    /* [E, 2F]   fp32 (optional) */
    mst_tensor g_w2;    /* [E*H, F]  fp32 main_grad */
    mst_tensor g_b2;    /* [E, H]    fp32 (optional) */
} mst_mlp_weights;

MST_API mst_mlp_config mst_mlp_config_default(int32_t n_groups, int64_t hidden, int64_t ffn);

/* x [R, H] bf16, probs [R, 1] fp32, counts [E, 1] int32 -> y [R, H] bf16.
 * Saved activations go through `saver`. */
MST_API mst_status mst_grouped_mlp_forward(mst_ctx_t* ctx, const mst_mlp_config* cfg,
                                           const mst_mlp_weights* w, const mst_tensor* x,
                                           const mst_tensor* probs, const mst_tensor* counts,
                                           const mst_saver* saver, mst_tensor* y);
/* dy [R, H] bf16 -> dx [R, H] bf16, dprobs [R, 1] fp32; weight and bias
 * gradients into w->g_* through `mode`. Fetches and releases every saved
 * tensor it used. Its scratch (dz, dh, a recomputed z) is the context's MLP
 * workspace, sized by R on the first call: run forward and backward once
 * before capturing them in a CUDA graph. With MST_WGRAD_DEFERRED the queued
 * wgrads read that scratch: mst_wgrad_flush() before the next backward on the
 * context (MST_ERR_STATE otherwise). */
MST_API mst_status mst_grouped_mlp_backward(mst_ctx_t* ctx, const mst_mlp_config* cfg,
                                            const mst_mlp_weights* w, const mst_tensor* dy,
                                            const mst_tensor* counts, const mst_saver* saver,
                                            mst_tensor* dx, mst_tensor* dprobs, mst_wgrad_mode mode);

/* ---- paged stash --------------------------------------------------------- *
 * See docs/DESIGN.md. A pool holds the pages of one (dtype, width): a device
 * block of n_dev_pages, an optional pinned-host block of n_host_pages, and a
 * free-list ring for each, all state in backend memory. A handle holds one
 * stashed tensor: its page table (device pages first, then host pages) and
 * its row count, in backend memory.
 *
 * mst_stash_save / mst_stash_restore / mst_pool_reset enqueue on the
 * context's current stream (mst_ctx_stream), never sync, allocate nothing and
 * are capturable in a CUDA graph. Counts are read when the op executes (on
 * the device for CUDA). Every operation on one pool must be ordered on one
 * stream (they update the rings without atomics), except the copy part of a
 * split restore (mst_stash_restore_copy).
 *
 * Runtime conditions, flagged in backend memory and read by mst_pool_poll():
 *   overflow   a save found too few free pages (device + host together):
 *              it took and copied nothing (its handle's table now names no
 *              page: in-place reads see zeros); the pool's overflow flag
 *              and the context's MST_FLAG_OVERFLOW bit are set; every later
 *              save is a no-op until mst_pool_reset(). A handle whose save
 *              was skipped holds nothing: its restore writes nothing.
 *   bad state  restore of a handle that holds nothing (never saved, already
 *              restored, or saved before the last reset), or a save into a
 *              handle that still holds pages: nothing is written, the pool's
 *              state flag is set. The CPU backend also returns MST_ERR_STATE
 *              at once; CUDA reports it at the next mst_pool_poll().
 *   bad counts a count < 0 or sum(counts) > src rows: nothing is taken or
 *              written, the context's MST_FLAG_COUNTS bit is set (reported by
 *              mst_ctx_check); the CPU backend also returns MST_ERR_COUNTS.
 *
 * Ring invariant (per block b, checked by mst_pool_check):
 *   0 <= tail[b] - head[b] <= n_pages[b]; the free ids are
 *   ring[b][(head[b] + i) % n_pages[b]] for i < tail[b] - head[b]; every page
 *   id is in its ring or in the table of exactly one live handle. */

typedef struct mst_pool mst_pool_t;
typedef struct mst_stash_handle mst_stash_handle_t;

#define MST_POOL_PAGE_ROWS 64     /* default rows per page            */
#define MST_POOL_DEV_FACTOR 1.10  /* default device pages over peak   */
#define MST_POOL_HOST_FACTOR 0.0  /* default host pages over peak     */

typedef struct mst_pool_config {
    size_t struct_size;   /* sizeof(mst_pool_config)                         */
    int64_t page_rows;    /* rows per page, a multiple of 8 (default 64)   */
    int64_t n_dev_pages;  /* pages of the device block (>= 0)               */
    int64_t n_host_pages; /* pages of the pinned host block (>= 0; 0: none) */
    int32_t copy_sms;     /* SMs one save or restore may use (>= 0; 0: as many
                             as help). Copies that run beside compute on a
                             side stream go faster on all SMs but take them
                             from the compute: a few SMs each copy at a higher
                             rate and leave the rest to it (CUDA) */
} mst_pool_config;
#define MST_POOL_CONFIG_INIT MST_STRUCT_INIT_(mst_pool_config)

typedef struct mst_pool_stats {
    size_t struct_size;       /* sizeof(mst_pool_stats), set by the caller      */
    int64_t page_rows;        /* rows per page                                  */
    int64_t page_bytes;       /* bytes per page                                 */
    int64_t n_dev_pages;      /* capacity of the device block                   */
    int64_t n_host_pages;     /* capacity of the host block                     */
    int64_t dev_used;         /* device pages in live handles now               */
    int64_t host_used;        /* host pages in live handles now                 */
    int64_t dev_peak;         /* max of dev_used since creation                 */
    int64_t host_peak;        /* max of host_used since creation                */
    int64_t total_peak;       /* max of dev_used + host_used since creation     */
    int64_t spilled_pages;    /* host pages taken by saves since the last reset */
    int32_t overflowed;       /* 1 while the overflow flag is set               */
} mst_pool_stats;
#define MST_POOL_STATS_INIT MST_STRUCT_INIT_(mst_pool_stats)

/* A config of n_dev_pages device pages, no host block, 64 rows per page. */
MST_API mst_pool_config mst_pool_config_default(int64_t n_dev_pages);
/* Sizing from a measuring run (a pool big enough for the worst case, whose
 * total_peak is the peak pages in use): n_dev_pages = ceil(peak * dev_factor),
 * n_host_pages = ceil(peak * host_factor), at least one page in all. */
MST_API mst_status mst_pool_config_from_peak(const mst_pool_stats* measured, double dev_factor,
                                             double host_factor, mst_pool_config* out);

/* dtype bf16 or fp32; width W > 0 elements per row; cfg with at least one
 * page. Allocates both blocks and ends with a reset. dtype fp8: pages of
 * bf16 rows (W a multiple of 8) stored as e4m3 codes with one fp32 scale per
 * 128 elements: a save quantizes (a block holding inf or NaN is stored as
 * zeros and raises the context's error flag: mst_ctx_check returns
 * MST_ERR_COUNTS), a restore gives bf16 back (see MST_POLICY_FP8); such
 * pages are neither claimed nor read in place (mst_stash_handle_pages). */
MST_API mst_status mst_pool_create(mst_ctx_t* ctx, mst_dtype dtype, int64_t width,
                                   const mst_pool_config* cfg, mst_pool_t** out);
/* Syncs, then frees the blocks and the handles the pool still has. */
MST_API void mst_pool_destroy(mst_pool_t* pool);
/* One kernel: refills both rings, clears the overflow, state and spill
 * counters; handles saved before it hold nothing afterwards. Peaks stay. */
MST_API mst_status mst_pool_reset(mst_pool_t* pool);
/* Syncs and verifies the ring invariant and that every page is in exactly one
 * place; MST_ERR_STATE naming the first violation. Debug builds and tests. */
MST_API mst_status mst_pool_check(mst_pool_t* pool);
/* Syncs and reads the counters. */
MST_API mst_status mst_pool_stats_get(mst_pool_t* pool, mst_pool_stats* out);
/* Syncs and reads the flags (one small read, once per step): MST_ERR_STATE
 * when a bad-state operation happened since the last poll (that flag is then
 * cleared), else MST_ERR_OVERFLOW while the overflow flag is set, else MST_OK. */
MST_API mst_status mst_pool_poll(mst_pool_t* pool);
/* Device int32 [1]: nonzero once a save overflowed, until mst_pool_reset. For
 * kernels that must skip themselves (the optimizer update). */
MST_API const int32_t* mst_pool_overflow_flag(const mst_pool_t* pool);

/* A handle for tensors of up to max_rows rows (max_rows * row bytes < 4 GiB). */
MST_API mst_status mst_stash_handle_create(mst_pool_t* pool, int64_t max_rows, mst_stash_handle_t** out);
/* Pages a handle still holds are lost until mst_pool_reset. */
MST_API void mst_stash_handle_destroy(mst_stash_handle_t* h);

/* src [R, W] of the pool's dtype, counts [E, 1] int32: packs rows
 * [0, sum(counts)) into pages, device pages first, then host pages for the
 * rest (page-granular spill). A sum past the handle's max_rows (R may be
 * larger) is an overflow: flagged on the device like too few pages. */
MST_API mst_status mst_stash_save(mst_pool_t* pool, mst_stash_handle_t* h, const mst_tensor* src,
                                  const mst_tensor* counts);
/* A save without the copy: takes and tables the pages for rows
 * [0, sum(counts)) of a [rows, W] tensor that its producer then writes into
 * them itself (mst_stash_handle_pages). Overflow and bad counts as a save;
 * after an overflow the producer's writes go nowhere (the table is not the
 * handle's): the step is rerun. */
MST_API mst_status mst_stash_claim(mst_pool_t* pool, mst_stash_handle_t* h, int64_t rows, const mst_tensor* counts);
/* dst [R, W] with R >= the handle's max_rows: copies the saved rows back into
 * rows [0, n) (rows past n untouched) and returns the pages to their rings. */
MST_API mst_status mst_stash_restore(mst_pool_t* pool, mst_stash_handle_t* h, mst_tensor* dst);
/* The same restore in two parts, for a caller that copies on another stream
 * than the pool's: _copy writes rows [0, n) of dst and leaves the handle its
 * pages (it reads only the handle and its pages, so it may run on any stream
 * once the save finished); _return then returns the pages (no copy), ordered
 * with the pool's other operations and after the copy. */
MST_API mst_status mst_stash_restore_copy(mst_pool_t* pool, mst_stash_handle_t* h, mst_tensor* dst);
MST_API mst_status mst_stash_restore_return(mst_pool_t* pool, mst_stash_handle_t* h);
/* The handle's rows in place, for an op that reads them from the pages
 * (mst_tensor.pages) instead of a restore: valid once the save has run and
 * until mst_stash_restore_return gives the pages back. */
MST_API mst_status mst_stash_handle_pages(const mst_stash_handle_t* h, mst_pages* out);

/* ---- schedules ------------------------------------------------------------ *
 * The order of forward and backward passes over (model chunk, microbatch) on
 * one pipeline rank. A rank holds `virtual_stages` chunks of its layers. */

typedef enum mst_schedule_kind {
    MST_SCHEDULE_PLAIN = 0,   /* all forwards, then all backwards (last first) */
    MST_SCHEDULE_1F1B,        /* warm-up forwards, one-forward-one-backward, cool-down */
    MST_SCHEDULE_INTERLEAVED, /* 1F1B over virtual stages (model chunks)           */
} mst_schedule_kind;

typedef struct mst_schedule_config {
    size_t struct_size;     /* sizeof(mst_schedule_config)                     */
    mst_schedule_kind kind;
    int32_t stages;         /* pipeline stages S >= 1                          */
    int32_t rank;           /* this rank, 0 <= rank < S                        */
    int32_t microbatches;   /* M >= 1 (interleaved: a multiple of S)           */
    int32_t virtual_stages; /* V >= 1 chunks on this rank (interleaved: >= 2)  */
} mst_schedule_config;
#define MST_SCHEDULE_CONFIG_INIT MST_STRUCT_INIT_(mst_schedule_config)

typedef struct mst_sched_entry {
    int32_t backward;   /* 0 forward, 1 backward   */
    int32_t chunk;      /* 0 <= chunk < V          */
    int32_t microbatch; /* 0 <= microbatch < M     */
} mst_sched_entry;

/* Fills out [2 M V] (n_out must be 2 M V). A schedule that does not fit the
 * stage count is MST_ERR_INVALID naming the value. */
MST_API mst_status mst_schedule_make(const mst_schedule_config* cfg, mst_sched_entry* out, int32_t n_out);
/* The activation sets a schedule needs: microbatch mb takes a set (the
 * lowest free one) at its first forward (chunk 0) and gives it back after its
 * last backward (chunk 0 again), so buffers of microbatches not in flight
 * together are shared (1F1B on one stage: one set). Fills set_of [M] and
 * *n_sets (<= M). A schedule that is not 2 M V entries with one forward and
 * one backward of chunk 0 per microbatch, forward first, is MST_ERR_INVALID. */
MST_API mst_status mst_schedule_sets(const mst_sched_entry* s, int32_t n, int32_t microbatches, int32_t* set_of,
                                     int32_t* n_sets);
MST_API mst_status mst_schedule_kind_parse(const char* s, mst_schedule_kind* out);
MST_API const char* mst_schedule_kind_str(mst_schedule_kind k);

/* ---- layer recompute ------------------------------------------------------ *
 * uniform:N — layers in chunks of N; each chunk's input is saved and the
 *             chunk recomputed in backward.
 * block:N   — the first N layers of the stage are recomputed (each its own
 *             chunk), the rest keep their activations. */

typedef enum mst_recompute_method {
    MST_RECOMPUTE_NONE = 0,
    MST_RECOMPUTE_UNIFORM,
    MST_RECOMPUTE_BLOCK,
} mst_recompute_method;

typedef struct mst_recompute_config {
    size_t struct_size; /* sizeof(mst_recompute_config), also before a parse */
    mst_recompute_method method;
    int32_t num_layers; /* recompute_num_layers N >= 1 */
} mst_recompute_config;
#define MST_RECOMPUTE_CONFIG_INIT MST_STRUCT_INIT_(mst_recompute_config)

/* "none", "uniform:N" or "block:N"; a clear error otherwise. */
MST_API mst_status mst_recompute_parse(const char* spec, mst_recompute_config* out);
/* chunk_start [n_layers]: the first layer of layer l's recompute chunk, or
 * -1 when layer l keeps its activations. Errors name a bad N. */
MST_API mst_status mst_recompute_plan(const mst_recompute_config* cfg, int32_t n_layers,
                                      int32_t* chunk_start);

/* ---- memory manager ----------------------------------------------------- *
 * Owns the saved activations of every (layer, microbatch, name) and applies
 * the policy of each (layer, name). See docs/DESIGN.md.
 *
 * Step protocol (all of it capturable in one CUDA graph, except a measuring
 * step, which runs eagerly with host-known counts):
 *   mst_memmgr_step_begin(m, measuring)
 *   for each schedule entry, for each layer of its chunk (forward: in order;
 *   backward: in reverse order):
 *       mst_memmgr_forward(m, layer, mb, &saver)  -> the op's saver
 *       mst_memmgr_backward(m, layer, mb, &saver) -> the op's saver
 *   mst_memmgr_step_end(m)             joins the side stream
 *   mst_memmgr_step_check(m)           host: one small read; MST_ERR_OVERFLOW
 *                                      when a pool overflowed: rerun the step
 *                                      with measuring = 1 (exact shapes),
 *                                      which also resizes the pools.
 * The first step must be a measuring step: it sizes the pools from the peak
 * pages it saw (ceil(peak * factor)).
 * Restored tensors live in shared restore buffers that the next backward
 * reuses: with MST_WGRAD_DEFERRED, flush before the next layer's backward
 * (or keep the tensors the deferred wgrads read under KEEP). */

typedef struct mst_memmgr mst_memmgr_t;

typedef struct mst_memmgr_config {
    size_t struct_size;              /* sizeof(mst_memmgr_config)                */
    int32_t n_layers;                /* L layers of this rank                    */
    int32_t n_microbatches;          /* M                                        */
    int32_t virtual_stages;          /* V: layer l is in chunk l / (L / V)       */
    int64_t max_rows;                /* R of every layer's grouped rows          */
    int64_t hidden;                  /* H: width of fc1_input                    */
    int64_t ffn;                     /* F: act_input is 2F wide, fc2_input F     */
    const mst_sched_entry* schedule; /* [n_schedule], copied                     */
    int32_t n_schedule;              /* 2 M V                                    */
    int32_t page_rows;               /* rows per page, default 64                */
    double dev_factor;               /* device pool size over peak, default 1.10 */
    double host_factor;              /* host pool size over peak, default 0      */
    /* (optional) Called at the end of every measuring step with the n sizes
     * (rows, pages) it measured, before the pools are sized from them; may
     * raise each, e.g. to its max over the ranks of a data-parallel group,
     * so that every rank sizes its pools for the largest load any rank saw.
     * Called on every rank at the same point (every rank measures alike). */
    mst_status (*share_needs)(void* user, int64_t* needs, int32_t n);
    void* share_user;                /* its first argument                       */
} mst_memmgr_config;
#define MST_MEMMGR_CONFIG_INIT MST_STRUCT_INIT_(mst_memmgr_config)

/* Bytes by category, for the trainer to print. */
typedef struct mst_mem_report {
    size_t struct_size;           /* sizeof(mst_mem_report_t), set by the caller      */
    size_t kept_bytes;            /* KEEP buffers (max_rows rows each)                */
    size_t compute_bytes;         /* shared compute and restore buffers               */
    size_t dev_pages_bytes;       /* device page blocks allocated                     */
    size_t dev_pages_peak_bytes;  /* device pages in use at peak (last sized step)    */
    size_t host_pages_bytes;      /* pinned host page blocks allocated                */
    size_t host_pages_peak_bytes; /* host pages in use at peak                        */
    size_t dev_pages_used_bytes;  /* device pages in live handles now                 */
    size_t host_pages_used_bytes; /* host pages in live handles now                   */
    size_t recompute_bytes;       /* what RECOMPUTE and layer recompute did not save  */
    size_t static_keep_bytes;     /* all-KEEP with static max_rows buffers            */
    size_t exact_bytes;           /* peak of saved activations with exact shapes      */
    int32_t overflows;            /* steps that overflowed                            */
    int32_t reruns;               /* measuring steps after the first                  */
} mst_mem_report_t;
#define MST_MEM_REPORT_INIT MST_STRUCT_INIT_(mst_mem_report_t)

/* cfg->schedule must list every (chunk, microbatch) forward and backward
 * once, each microbatch in its order: forward of chunk 0 .. V-1, then
 * backward of V-1 .. 0; otherwise MST_ERR_INVALID naming the first entry out
 * of order (e.g. a backward before its forward). */
MST_API mst_status mst_memmgr_create(mst_ctx_t* ctx, const mst_memmgr_config* cfg, mst_memmgr_t** out);
MST_API void mst_memmgr_destroy(mst_memmgr_t* m);
/* Policy of (layer, name); layer -1 sets every layer. Before the first step.
 * RECOMPUTE is accepted for fc2_input only (the grouped MLP recomputes it);
 * whole layers are recomputed through mst_memmgr_set_recompute. */
MST_API mst_status mst_memmgr_set_policy(mst_memmgr_t* m, int32_t layer, mst_saved_name name, mst_policy p);
/* The policies of a spec (mst_policy_spec_parse) for every layer and name. */
MST_API mst_status mst_memmgr_set_policy_spec(mst_memmgr_t* m, const char* spec);
MST_API mst_status mst_memmgr_set_recompute(mst_memmgr_t* m, const mst_recompute_config* rc);
/* The same from an explicit plan: chunk_start [n_layers], each -1 (kept) or
 * the first layer of l's chunk (chunks contiguous: chunk_start[l] is l or
 * chunk_start[l - 1]); e.g. mst_recompute_plan's, with the last layer made a
 * chunk of its own. Errors name the layer. */
MST_API mst_status mst_memmgr_set_recompute_plan(mst_memmgr_t* m, const int32_t* chunk_start);
/* chunk start of layer l's recompute chunk, or -1 (see mst_recompute_plan). */
MST_API int32_t mst_memmgr_recompute_chunk(const mst_memmgr_t* m, int32_t layer);
/* Rows saved for (layer, mb) in the last measuring step (every name of a
 * layer call saves the same rows: the sum of its counts); 0 for a layer in a
 * recompute chunk, or before the first measuring step. */
MST_API mst_status mst_memmgr_saved_rows(const mst_memmgr_t* m, int32_t layer, int32_t mb, int64_t* rows);
/* 1 when the backward of a sized step reads STASHed tensor `name` from its
 * device pages in place (no restore copy) on this backend and these shapes. */
MST_API int mst_memmgr_reads_pages(const mst_memmgr_t* m, mst_saved_name name);

MST_API mst_status mst_memmgr_step_begin(mst_memmgr_t* m, int measuring);
/* The saver for the forward of (layer, mb). For a layer inside a recompute
 * chunk this saver keeps nothing; the caller saves the chunk input itself
 * (mst_memmgr_chunk_input) and reruns the chunk before its backward with
 * mst_memmgr_recompute(). */
MST_API mst_status mst_memmgr_forward(mst_memmgr_t* m, int32_t layer, int32_t mb, const mst_saver** out);
/* The saver for the backward of (layer, mb). */
MST_API mst_status mst_memmgr_backward(mst_memmgr_t* m, int32_t layer, int32_t mb, const mst_saver** out);
/* The saver for rerunning the forward of `layer` (in a recompute chunk) just
 * before its backward: it keeps the activations until that backward. */
MST_API mst_status mst_memmgr_recompute(mst_memmgr_t* m, int32_t layer, int32_t mb, const mst_saver** out);
/* A buffer [R, H] bf16 kept for the input of the recompute chunk that starts
 * at `layer`, microbatch mb. */
MST_API mst_status mst_memmgr_chunk_input(mst_memmgr_t* m, int32_t layer, int32_t mb, mst_tensor* out);
/* The [R, cols] buffer that tensor `name` of (layer, mb) is kept in when its
 * policy is KEEP (outside recompute chunks); out->data = NULL otherwise. A
 * caller that writes the tensor there before the forward of (layer, mb)
 * (the previous layer's output, as this layer's fc1_input) spares commit's
 * copy of its R rows. */
MST_API mst_status mst_memmgr_keep_buffer(mst_memmgr_t* m, int32_t layer, int32_t mb, mst_saved_name name,
                                          mst_tensor* out);
MST_API mst_status mst_memmgr_step_end(mst_memmgr_t* m);
MST_API mst_status mst_memmgr_step_check(mst_memmgr_t* m);
/* Device int32: nonzero when this step overflowed (the optimizer skips). */
MST_API const int32_t* mst_memmgr_overflow_flag(const mst_memmgr_t* m);
MST_API mst_status mst_mem_report(const mst_memmgr_t* m, mst_mem_report_t* out);
/* Syncs; checks every pool's invariant and, between steps, that no page is
 * held (nothing leaked). */
MST_API mst_status mst_memmgr_check(mst_memmgr_t* m);

/* ---- expert parallelism (EP) --------------------------------------------- *
 * Experts spread over W ranks (one context each): global expert g lives on
 * rank g / El, El = E / W, as local expert g % El. Every rank of a
 * communicator calls the same functions in the same order (collectives) with
 * the same mst_ep_config.
 *
 * dispatch: token rows x [N, H] with their top-k expert ids [N, k] (and
 *   probs [N, k]) -> this rank's expert-major rows [R, H]: the rows of local
 *   expert e are [off_e, off_e + counts[e]), off = exclusive prefix of
 *   counts, ordered by source rank, then token, then slot; counts [El]
 *   stay in backend memory (never read by the host). Rows past sum(counts)
 *   are not written.
 * combine: expert outputs [R, H] -> y[t] = sum over s = 0..k-1, in that
 *   order, in fp32, of w[t][s] * out[row of (t, s)]; w = probs, or 1 when
 *   probs is NULL (experts that applied the probs themselves). One rounding.
 * Backward of each: dispatch's is a combine-like unweighted sum of row
 *   gradients (and the row-prob gradients back to their slots); combine's a
 *   dispatch-like scatter of dy (times the prob) plus dprobs[t][s] =
 *   dy[t] . out[row of (t, s)], fp32.
 * Deterministic: the same inputs give the same bits (no float atomics).
 * Budgets: a rank sends at most C = pair_rows rows to one rank and receives
 *   at most R = max_rows rows. Past either, the context's device flag is
 *   raised (mst_ctx_check returns MST_ERR_COUNTS): a sender skips the rows
 *   of that destination, a receiver writes no row and zero counts; nothing is
 *   written out of bounds, the outputs of that step are meaningless and the
 *   step is rerun with larger budgets.
 * Graph-safe (CUDA): every size that reaches the host is static; the NCCL
 *   send/recv path moves fixed-capacity blocks (C rows per rank pair), the
 *   device-API path only the rows that exist (counts read on the device).
 * Routing metadata lives in a handle (one per layer and microbatch, kept
 *   from dispatch to the backward of both). */

typedef struct mst_ep mst_ep_t;
typedef struct mst_ep_handle mst_ep_handle_t;
typedef struct mst_ep_group mst_ep_group_t;

/* How the ranks exchange rows (NCCL communicators; the CPU twin ignores it). */
typedef enum mst_ep_path_kind {
    MST_EP_PATH_AUTO = 0, /* lsa where NCCL's device API reaches every rank, else p2p   */
    MST_EP_PATH_P2P,      /* ncclSend/ncclRecv of fixed-capacity blocks (C rows a pair)   */
    MST_EP_PATH_LSA,      /* NCCL device API: kernels store the valid rows into the peers'
                             symmetric windows over NVLink (MST_ERR_UNSUPPORTED where not
                             available)                                                  */
} mst_ep_path_kind;

typedef struct mst_ep_config {
    size_t struct_size; /* sizeof(mst_ep_config)                              */
    int32_t n_experts;  /* E over all ranks, a multiple of the world size W  */
    int32_t top_k;      /* k, 1 <= k <= E                                     */
    int64_t hidden;     /* H, a multiple of 8 (rows of 16-byte multiples)     */
    int64_t max_tokens; /* N: most tokens of one dispatch on this rank        */
    int64_t max_rows;   /* R: most rows this rank's experts receive           */
    int64_t pair_rows;  /* C: most rows one rank sends to one rank (0: N k,
                           which no routing can pass)                         */
    int32_t path;       /* mst_ep_path_kind (0: auto)                         */
    int64_t window_rows; /* 0: none; else the communicator holds dispatch
                           outputs of up to this many rows (rows [., H] bf16,
                           row_probs [.] fp32) for mst_ep_window_rows: in the
                           symmetric window on the lsa path, where dispatch
                           into them stores each row straight at its expert
                           row on the receiver (no unpack)                   */
} mst_ep_config;
#define MST_EP_CONFIG_INIT MST_STRUCT_INIT_(mst_ep_config)

/* An NCCL unique id: rank 0 makes it, every rank gets a copy (e.g. through
 * a TCP rendezvous) and passes it to mst_ep_create. */
typedef struct mst_ep_id {
    char bytes[128];
} mst_ep_id;

MST_API mst_status mst_ep_id_create(mst_ep_id* out);
/* Gives every rank rank 0's id over TCP (the launcher's MASTER_ADDR and
 * MASTER_PORT): rank 0 listens on host:port and sends *id to each rank once
 * all world ranks joined; the others connect (retrying until rank 0 is up)
 * and receive it into *id. Every wait ends by timeout_ms: MST_ERR_IO naming
 * the rank and what did not happen (so no rank hangs). world 1: nothing. */
MST_API mst_status mst_ep_id_share(mst_ep_id* id, int rank, int world, const char* host, int port,
                                   int timeout_ms);
/* A communicator of `world` ranks over NCCL on a CUDA context; this is rank
 * `rank`. MST_ERR_UNSUPPORTED when the library was built without NCCL or the
 * context is not CUDA. cfg NULL (here and in mst_ep_create_local): a bare
 * communicator, with no dispatch buffers, for mst_ep_allreduce (and the
 * trainer's point-to-point transfers between pipeline stages). */
MST_API mst_status mst_ep_create(mst_ctx_t* ctx, const mst_ep_config* cfg, const mst_ep_id* id, int rank,
                                 int world, mst_ep_t** out);
/* The same over an existing ncclComm_t (passed as void*, e.g. a PyTorch
 * process group's), not owned: it must outlive the communicator. */
MST_API mst_status mst_ep_create_nccl(mst_ctx_t* ctx, const mst_ep_config* cfg, void* nccl_comm,
                                      mst_ep_t** out);
/* The CPU twin: ranks as threads of one process, each with its own CPU
 * context, exchanging through shared memory. A group of `world` ranks; each
 * thread joins it with mst_ep_create_local. Destroy the group after every
 * communicator of it. */
MST_API mst_status mst_ep_group_create(int world, mst_ep_group_t** out);
MST_API void mst_ep_group_destroy(mst_ep_group_t* g);
MST_API mst_status mst_ep_create_local(mst_ctx_t* ctx, const mst_ep_config* cfg, mst_ep_group_t* group,
                                       int rank, mst_ep_t** out);
MST_API void mst_ep_destroy(mst_ep_t* ep);
MST_API int mst_ep_rank(const mst_ep_t* ep);
MST_API int mst_ep_world(const mst_ep_t* ep);
/* Which exchange runs: "local threads (CPU twin)", "nccl send/recv,
 * fixed-capacity blocks" or "nccl device API (...)". */
MST_API const char* mst_ep_path(const mst_ep_t* ep);

/* Changes R = max_rows (the rows this rank's experts may receive) for the
 * dispatches and combines after it: every rank the same, between steps,
 * never inside a capture. No buffer depends on R (dispatches into the window
 * rows need R <= cfg.window_rows). */
MST_API mst_status mst_ep_set_max_rows(mst_ep_t* ep, int64_t max_rows);

/* The dispatch outputs the communicator holds (cfg.window_rows > 0):
 * rows [R, H] bf16 and row_probs [R, 1] fp32 (row_probs may be NULL), R =
 * max_rows now (MST_ERR_INVALID when R > cfg.window_rows). Their contents
 * are valid until the next dispatch of this communicator (any handle): the
 * peers write into them then, once that dispatch has started on every rank,
 * so whatever reads them on another stream must be ordered before it on the
 * context's stream. A dispatch whose rows (and row_probs, when
 * given) are exactly these takes the direct path where the transport has one
 * (lsa, and the CPU twin, which mirrors it): each sender stores its rows at
 * their final expert rows in the receiver's window, with no receive blocks
 * and no unpack; elsewhere (p2p, builds without NCCL's device API) they are
 * ordinary backend memory and dispatch unpacks into them as into any rows.
 * Collective: every rank of a dispatch passes these or none. Same bits
 * either way. */
MST_API mst_status mst_ep_window_rows(mst_ep_t* ep, mst_tensor* rows, mst_tensor* row_probs);

/* All-reduce over the ranks, in place, enqueued on the context's stream
 * (capturable over NCCL): every rank ends with the same bits. Float sums
 * add in one order on every transport: rank 0's value + rank 1's + ... in
 * the element type, so the CPU twin and NCCL over NVLink or a network give
 * the same bits (NCCL moves the bytes; the sum is the library's). Integer
 * sums and maxima are exact. */
typedef enum mst_ep_reduce {
    MST_EP_SUM_F32 = 0, /* float, sum         */
    MST_EP_SUM_F64,     /* double, sum        */
    MST_EP_SUM_I32,     /* int32, sum         */
    MST_EP_MAX_I32,     /* int32, max         */
    MST_EP_MAX_F64,     /* double, max        */
} mst_ep_reduce;
/* data: count elements of `kind`'s type in backend memory (collective: every
 * rank with the same count and kind, in the same order as its other calls). */
MST_API mst_status mst_ep_allreduce(mst_ep_t* ep, void* data, int64_t count, mst_ep_reduce kind);

MST_API mst_status mst_ep_handle_create(mst_ep_t* ep, mst_ep_handle_t** out);
/* Destroy a communicator's handles before the communicator. */
MST_API void mst_ep_handle_destroy(mst_ep_handle_t* h);

/* x [N, H] bf16 (N <= max_tokens); topk_idx [N, k] int32 global expert ids;
 * rows [R, H] bf16; counts [El, 1] int32; probs [N, k] fp32 and row_probs
 * [R, 1] fp32, both or neither: each row gets the prob of its slot. An id
 * outside [0, E) raises the flag and its slot is skipped. */
MST_API mst_status mst_ep_dispatch(mst_ep_t* ep, mst_ep_handle_t* h, const mst_tensor* x,
                                   const mst_tensor* topk_idx, const mst_tensor* probs, mst_tensor* rows,
                                   mst_tensor* row_probs, mst_tensor* counts);
/* d_rows [R, H] bf16; d_row_probs [R, 1] fp32 and dprobs [N, k] fp32: both
 * or neither; dx [N, H] bf16 = sum over slots of d_rows[row of (t, s)];
 * dprobs[t][s] = d_row_probs[row of (t, s)] (0 for a skipped slot). */
MST_API mst_status mst_ep_dispatch_backward(mst_ep_t* ep, mst_ep_handle_t* h, const mst_tensor* d_rows,
                                            const mst_tensor* d_row_probs, mst_tensor* dx,
                                            mst_tensor* dprobs);
/* out_rows [R, H] bf16; probs [N, k] fp32 or NULL; y [N, H] bf16. */
MST_API mst_status mst_ep_combine(mst_ep_t* ep, mst_ep_handle_t* h, const mst_tensor* out_rows,
                                  const mst_tensor* probs, mst_tensor* y);
/* dy [N, H] bf16 -> d_rows [R, H] bf16 (dy[t] * probs[t][s], or dy[t]).
 * With probs: out_rows [R, H] (those combine read) and dprobs [N, k] fp32
 * are required; without, both NULL. */
MST_API mst_status mst_ep_combine_backward(mst_ep_t* ep, mst_ep_handle_t* h, const mst_tensor* dy,
                                           const mst_tensor* probs, const mst_tensor* out_rows,
                                           mst_tensor* d_rows, mst_tensor* dprobs);

#ifdef __cplusplus
}
#endif
#endif /* MOESTASH_H */
