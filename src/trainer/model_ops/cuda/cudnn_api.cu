/*
 * cudnn_api.cu — loading cuDNN's backend API at run time (dlopen of
 * $MST_CUDNN_LIB or libcudnn.so.9, a table of function pointers) and the
 * descriptor builders of cudnn_api.h. Nothing here runs on the device.
 */
#ifdef MST_HAVE_CUDNN
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "cudnn_api.h"
#include "trainer/model_ops/model_backend.h"

/* The default library: cuDNN 9's dispatcher, which loads its sublibraries
 * (graph, engines) from its own folder or the loader's path. */
static const char* lib_name(const char* name) {
    const char* env = getenv("MST_CUDNN_LIB");
    return name ? name : env && env[0] ? env : "libcudnn.so.9";
}

/* dlsym of every function of the table; *missing: the first absent one. */
static int bind_all(void* lib, mst_cudnn_api* a, const char** missing) {
#define BIND(field, sym)                                        \
    do {                                                        \
        *(void**)&a->field = dlsym(lib, sym);                   \
        if (!a->field) { *missing = sym; return 0; }            \
    } while (0)
    BIND(get_version, "cudnnGetVersion");
    BIND(error_string, "cudnnGetErrorString");
    BIND(last_error, "cudnnGetLastErrorString");
    BIND(create, "cudnnCreate");
    BIND(destroy, "cudnnDestroy");
    BIND(set_stream, "cudnnSetStream");
    BIND(create_desc, "cudnnBackendCreateDescriptor");
    BIND(destroy_desc, "cudnnBackendDestroyDescriptor");
    BIND(finalize, "cudnnBackendFinalize");
    BIND(set, "cudnnBackendSetAttribute");
    BIND(get, "cudnnBackendGetAttribute");
    BIND(execute, "cudnnBackendExecute");
#undef BIND
    return 1;
}

/* Opens and binds the library `name`: MST_OK, or MST_ERR_UNSUPPORTED naming
 * it and why; on success *out holds the open handle. */
static mst_status open_lib(const char* name, mst_cudnn_api* out) {
    memset(out, 0, sizeof *out);
    void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char* e = dlerror();
        return mst_set_error(MST_ERR_UNSUPPORTED, "cuDNN: dlopen(\"%s\") failed: %s", name, e ? e : "?");
    }
    const char* missing = NULL;
    if (!bind_all(lib, out, &missing)) {
        dlclose(lib);
        return mst_set_error(MST_ERR_UNSUPPORTED, "cuDNN: %s has no symbol %s (not cuDNN 9's backend API)", name,
                             missing);
    }
    out->version = out->get_version();
    if (out->version / 10000 != CUDNN_MAJOR) {
        const size_t v = out->version;
        dlclose(lib);
        memset(out, 0, sizeof *out);
        return mst_set_error(MST_ERR_UNSUPPORTED, "cuDNN: %s is version %zu.%zu.%zu; built for %d.x (headers %d.%d.%d)",
                             name, v / 10000, v / 100 % 100, v % 100, CUDNN_MAJOR, CUDNN_MAJOR, CUDNN_MINOR,
                             CUDNN_PATCHLEVEL);
    }
    out->lib = lib;
    return MST_OK;
}

extern "C" mst_status mst_cudnn_probe(const char* name, size_t* version) {
    mst_cudnn_api a;
    MST_TRY(open_lib(lib_name(name), &a));
    if (version) *version = a.version;
    dlclose(a.lib);
    return MST_OK;
}

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static mst_cudnn_api g_api;
static mst_status g_status;
static char g_why[512];

static void load_once(void) {
    g_status = open_lib(lib_name(NULL), &g_api);
    if (g_status != MST_OK) snprintf(g_why, sizeof g_why, "%s", mst_last_error());
}

mst_status mst_cudnn_api_get(const mst_cudnn_api** out) {
    pthread_once(&g_once, load_once);
    *out = g_status == MST_OK ? &g_api : NULL;
    return g_status == MST_OK ? MST_OK : mst_set_error(g_status, "%s", g_why);
}

mst_status mst_cudnn_fail(const mst_cudnn_api* api, cudnnStatus_t s, const char* what, const char* file, int line) {
    char detail[384] = "";
    api->last_error(detail, sizeof detail);
    const mst_status st = (int)s / 1000 == 3 ? MST_ERR_UNSUPPORTED : MST_ERR_BACKEND;
    return mst_set_error(st, "cuDNN %s failed: %s%s%s at %s:%d", what, api->error_string(s), detail[0] ? ": " : "",
                         detail, file, line);
}

/* ---- builders ---------------------------------------------------------------- */

mst_status cdn_desc(cdn_build* g, cudnnBackendDescriptorType_t type, cudnnBackendDescriptor_t* out) {
    if (g->n_descs == CDN_MAX_DESCS)
        return mst_set_error(MST_ERR_INVALID, "cuDNN graph: more than %d descriptors", CDN_MAX_DESCS);
    *out = NULL;
    CUDNN_TRY(g->api, create_desc(type, out));
    g->descs[g->n_descs++] = *out;
    return MST_OK;
}

void cdn_keep(cdn_build* g, cudnnBackendDescriptor_t d) {
    for (int i = 0; i < g->n_descs; i++)
        if (g->descs[i] == d) {
            g->descs[i] = g->descs[--g->n_descs];
            return;
        }
}

void cdn_free(cdn_build* g) {
    for (int i = g->n_descs - 1; i >= 0; i--) g->api->destroy_desc(g->descs[i]);
    g->n_descs = 0;
    g->n_ops = 0;
}

static mst_status add_op(cdn_build* g, cudnnBackendDescriptor_t op) {
    if (g->n_ops == (int)(sizeof g->ops / sizeof *g->ops))
        return mst_set_error(MST_ERR_INVALID, "cuDNN graph: more than %d operations", g->n_ops);
    CUDNN_TRY(g->api, finalize(op));
    g->ops[g->n_ops++] = op;
    return MST_OK;
}

mst_status cdn_tensor_make(cdn_build* g, const cdn_tensor* t, cudnnBackendDescriptor_t* out) {
    const mst_cudnn_api* A = g->api;
    cudnnBackendDescriptor_t d;
    const int64_t align = 16;
    const bool virt = t->is_virtual != 0, byval = t->by_value != 0;
    MST_TRY(cdn_desc(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR, &d));
    CUDNN_TRY(A, set(d, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &t->dtype));
    CUDNN_TRY(A, set(d, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, t->nd, t->dim));
    CUDNN_TRY(A, set(d, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, t->nd, t->stride));
    CUDNN_TRY(A, set(d, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &t->uid));
    CUDNN_TRY(A, set(d, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align));
    CUDNN_TRY(A, set(d, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt));
    if (byval) CUDNN_TRY(A, set(d, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &byval));
    CUDNN_TRY(A, finalize(d));
    *out = d;
    return MST_OK;
}

mst_status cdn_pointwise(cdn_build* g, cudnnPointwiseMode_t mode, cudnnDataType_t prec, int64_t axis,
                         cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t,
                         cudnnBackendDescriptor_t y) {
    const mst_cudnn_api* A = g->api;
    cudnnBackendDescriptor_t pw, op;
    MST_TRY(cdn_desc(g, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, &pw));
    CUDNN_TRY(A, set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode));
    CUDNN_TRY(A, set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec));
    if (axis >= 0) CUDNN_TRY(A, set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis));
    CUDNN_TRY(A, finalize(pw));
    MST_TRY(cdn_desc(g, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, &op));
    CUDNN_TRY(A, set(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw));
    CUDNN_TRY(A, set(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x));
    if (b) CUDNN_TRY(A, set(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b));
    if (t) CUDNN_TRY(A, set(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t));
    CUDNN_TRY(A, set(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y));
    return add_op(g, op);
}

mst_status cdn_matmul(cdn_build* g, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    const mst_cudnn_api* A = g->api;
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t mm, op;
    MST_TRY(cdn_desc(g, CUDNN_BACKEND_MATMUL_DESCRIPTOR, &mm));
    CUDNN_TRY(A, set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32));
    CUDNN_TRY(A, finalize(mm));
    MST_TRY(cdn_desc(g, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, &op));
    CUDNN_TRY(A, set(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a));
    CUDNN_TRY(A, set(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b));
    CUDNN_TRY(A, set(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c));
    CUDNN_TRY(A, set(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm));
    return add_op(g, op);
}

mst_status cdn_reduce(cdn_build* g, cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    const mst_cudnn_api* A = g->api;
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t rd, op;
    MST_TRY(cdn_desc(g, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, &rd));
    CUDNN_TRY(A, set(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32));
    CUDNN_TRY(A, set(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode));
    CUDNN_TRY(A, finalize(rd));
    MST_TRY(cdn_desc(g, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, &op));
    CUDNN_TRY(A, set(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x));
    CUDNN_TRY(A, set(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y));
    CUDNN_TRY(A, set(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd));
    return add_op(g, op);
}

mst_status cdn_reshape(cdn_build* g, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    const mst_cudnn_api* A = g->api;
    cudnnBackendDescriptor_t op;
    MST_TRY(cdn_desc(g, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, &op));
    CUDNN_TRY(A, set(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x));
    CUDNN_TRY(A, set(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y));
    return add_op(g, op);
}
#endif /* MST_HAVE_CUDNN (else model_ops_cudnn.cu says so) */
