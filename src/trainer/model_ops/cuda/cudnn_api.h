/*
 * cudnn_api.h — cuDNN's backend (graph) API, loaded at run time: the
 * functions the trainer's cuDNN attention calls, found by dlopen in the
 * library (libcudnn.so.9, or $MST_CUDNN_LIB) and held in one table, so the
 * build needs only the headers and a machine without the library falls back
 * with the reason. Every call is checked (CUDNN_TRY): a failure becomes an
 * mst_status naming the call and cuDNN's error string (and its detail from
 * cudnnGetLastErrorString); the NOT_SUPPORTED family maps to
 * MST_ERR_UNSUPPORTED, the rest to MST_ERR_BACKEND.
 *
 * And the small builders every graph uses: tensors (dims, strides, uid;
 * virtual or by value), pointwise, matmul, reduction and reshape operations.
 * A graph under construction (cdn_build) owns each descriptor it made and
 * destroys them all at once.
 */
#ifndef MST_CUDNN_API_H
#define MST_CUDNN_API_H

#include <cudnn_graph.h>

#include "lib/internal.h"

typedef struct mst_cudnn_api {
    void* lib;            /* dlopen handle (kept for the process's life)     */
    size_t version;       /* cudnnGetVersion(): 91900 for 9.19.0              */
    size_t (*get_version)(void);
    const char* (*error_string)(cudnnStatus_t);
    void (*last_error)(char* message, size_t max_size);
    cudnnStatus_t (*create)(cudnnHandle_t* handle);
    cudnnStatus_t (*destroy)(cudnnHandle_t handle);
    cudnnStatus_t (*set_stream)(cudnnHandle_t handle, cudaStream_t stream);
    cudnnStatus_t (*create_desc)(cudnnBackendDescriptorType_t type, cudnnBackendDescriptor_t* desc);
    cudnnStatus_t (*destroy_desc)(cudnnBackendDescriptor_t desc);
    cudnnStatus_t (*finalize)(cudnnBackendDescriptor_t desc);
    cudnnStatus_t (*set)(cudnnBackendDescriptor_t desc, cudnnBackendAttributeName_t name,
                         cudnnBackendAttributeType_t type, int64_t count, const void* values);
    cudnnStatus_t (*get)(cudnnBackendDescriptor_t const desc, cudnnBackendAttributeName_t name,
                         cudnnBackendAttributeType_t type, int64_t requested, int64_t* count, void* values);
    cudnnStatus_t (*execute)(cudnnHandle_t handle, cudnnBackendDescriptor_t plan, cudnnBackendDescriptor_t pack);
} mst_cudnn_api;

/* The process's table, loaded once (thread-safe): MST_OK with *out, or
 * MST_ERR_UNSUPPORTED saying why (the same reason on every call). */
mst_status mst_cudnn_api_get(const mst_cudnn_api** out);

/* The failure of call `what` with status s as an mst_status (message: the
 * call, cuDNN's error string and detail, file:line). */
mst_status mst_cudnn_fail(const mst_cudnn_api* api, cudnnStatus_t s, const char* what, const char* file, int line);

#define CUDNN_TRY(api, call)                                                             \
    do {                                                                                 \
        cudnnStatus_t s_ = (api)->call;                                                  \
        if (s_ != CUDNN_STATUS_SUCCESS) return mst_cudnn_fail((api), s_, #call, __FILE__, __LINE__); \
    } while (0)

/* ---- graph construction ---------------------------------------------------- */

enum { CDN_MAX_DESCS = 256 }; /* a backward graph: ~80, then up to 16 configs, 32 engines, 32 plans */

typedef struct cdn_build {
    const mst_cudnn_api* api;
    cudnnBackendDescriptor_t descs[CDN_MAX_DESCS]; /* every descriptor made, destroyed by cdn_free */
    int n_descs;
    cudnnBackendDescriptor_t ops[64];               /* the operations, in graph order */
    int n_ops;
} cdn_build;

/* A tensor of nd <= 4 dims: dims and strides in elements, uid; virtual
 * (never in memory) or by value (a host scalar in the variant pack, nd 1);
 * alignment 16 bytes. */
typedef struct cdn_tensor {
    int nd;
    int64_t dim[4], stride[4];
    int64_t uid;
    cudnnDataType_t dtype;
    int is_virtual, by_value;
} cdn_tensor;

/* A finalized tensor descriptor of t into *out. */
mst_status cdn_tensor_make(cdn_build* g, const cdn_tensor* t, cudnnBackendDescriptor_t* out);
/* Pointwise op y = mode(x [, b [, t]]) (b, t NULL when absent); compute
 * type prec; axis >= 0 for GEN_INDEX. */
mst_status cdn_pointwise(cdn_build* g, cudnnPointwiseMode_t mode, cudnnDataType_t prec, int64_t axis,
                         cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t,
                         cudnnBackendDescriptor_t y);
/* c = a b (batched over the leading dims, broadcast where a dim is 1 or divides), fp32 compute. */
mst_status cdn_matmul(cdn_build* g, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c);
/* y = reduce(x) over the dims where y is smaller (ADD or MAX), fp32 compute. */
mst_status cdn_reduce(cdn_build* g, cudnnReduceTensorOp_t op, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y);
/* y = x seen with y's dims and strides. */
mst_status cdn_reshape(cdn_build* g, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y);
/* Destroys every descriptor g made (keeps those handed out with cdn_keep). */
void cdn_free(cdn_build* g);
/* Takes descriptor d out of g's ownership (the plan that outlives it). */
void cdn_keep(cdn_build* g, cudnnBackendDescriptor_t d);
/* A new descriptor of type `type`, owned by g. */
mst_status cdn_desc(cdn_build* g, cudnnBackendDescriptorType_t type, cudnnBackendDescriptor_t* out);

#endif
