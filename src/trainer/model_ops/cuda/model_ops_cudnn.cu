/*
 * model_ops_cudnn.cu — causal grouped-query attention through cuDNN's fused
 * attention (its SDPA graph in the backend API), forward and backward side
 * by side, under the flash contract of model_backend.h: forward saves the
 * output and each row's logsumexp (cuDNN's softmax stats are max + log(sum
 * exp) of the scaled scores, natural log: our lse as is), backward reads
 * them and writes rowsum(dO O) into delta. The same tensors as our flash
 * kernels (model_ops_flash.cu), so the memory table and recompute do not
 * change; the CPU reference of the contract is model_ops_attn.c.
 *
 * The graphs are the composite ones cuDNN's fused flash-attention engines
 * recognise (as NVIDIA's cudnn-frontend lowers sdpa / sdpa_backward; our own
 * C from reading it), over strided views of the [B*T, (NH + 2 KV) D] qkv
 * rows (no copies):
 *   forward:  S = (Q K^T) sc, masked above the diagonal (gen_index rows and
 *     columns, row >= col, binary select with -inf), M = rowmax S,
 *     E = exp(S - M), Z = rowsum E, stats = M + log Z, P = E / Z (bf16),
 *     O = P V;
 *   backward: sum = rowsum(dO O) (into delta), E = exp(masked S - stats),
 *     dV = E^T dO, dS = E (dO V^T - sum) sc, dK = dS^T Q, dQ = dS K; with
 *     KV < NH the matmuls broadcast each key-value head over its group and
 *     dK, dV are reduced over the group's heads.
 * Deterministic backward by default: dQ written by its matmul directly (the
 * frontend's deterministic form on Hopper) and engines noted
 * NONDETERMINISTIC skipped; a->nondeterministic takes the fp32 dQ
 * accumulator form and any engine (for `bench attn` to price determinism).
 *
 * Plans are built once per (B, NH, KV, T, D, direction, nondeterministic)
 * by attn_cudnn_check (at model creation, outside any capture), each graph's
 * workspace sized then and one context workspace grown to the largest; a
 * call finds its plan in the context's cache and only creates a variant pack
 * and executes on the context's stream: no allocation, no host sync, so the
 * step stays capturable. A plan missing during capture is an error.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model_ops.cuh"

#ifdef MST_HAVE_CUDNN
#include "cudnn_api.h"

namespace {

enum : int64_t { U_Q = 1, U_K, U_V, U_O, U_STATS, U_SCALE, U_NEG_INF, U_ONE, U_DO, U_DQ, U_DK, U_DV, U_SUM, U_DQ_ACC,
                 U_VIRTUAL = 100 };

const cudnnDataType_t F32 = CUDNN_DATA_FLOAT, BF16 = CUDNN_DATA_BFLOAT16, I32 = CUDNN_DATA_INT32,
                      BOOL = CUDNN_DATA_BOOLEAN;

/* What a plan is built for: its cache key. */
struct sdpa_key {
    int64_t B, NH, KV, T, D;
    int backward, nondet;
};

struct sdpa_plan {
    sdpa_key key;
    cdn_build g;                   /* the graph's descriptors, kept with the plan   */
    cudnnBackendDescriptor_t plan; /* the execution plan (one of g's)               */
    int64_t ws_bytes;              /* the plan's workspace                          */
    int64_t acc_off;               /* bytes: the fp32 dQ accumulator [B, NH, T, D]
                                      in the workspace (nondeterministic backward) */
    int64_t engine;                /* cuDNN's engine index (for messages)           */
    int noted_nondet;              /* the engine is noted NONDETERMINISTIC: taken
                                      only where no other one took the graph   */
    float scale, neg_inf, one;     /* the by-value scalars the packs point at       */
};

/* A context's cuDNN state (mst_cuda_impl.cudnn). */
struct sdpa_state {
    cudnnHandle_t handle;
    sdpa_plan** plans;             /* [n_plans] */
    int n_plans, cap_plans;
    mst_ws ws;                     /* the plans' workspace: the largest need     */
};

int same_key(const sdpa_key& x, const sdpa_key& y) {
    return x.B == y.B && x.NH == y.NH && x.KV == y.KV && x.T == y.T && x.D == y.D && x.backward == y.backward &&
           x.nondet == y.nondet;
}

/* ---- layouts (elements) ------------------------------------------------------ */

struct shape {
    int64_t d[4], s[4];
};

/* One graph under construction: its builder, the next virtual uid, the dims. */
struct gb {
    cdn_build* g;
    int64_t next;
    int64_t B, NH, KV, T, D, W, HO; /* W = (NH + 2 KV) D: qkv row; HO = NH D: out row */
};

shape q_of(const gb& b) { return {{b.B, b.NH, b.T, b.D}, {b.T * b.W, b.D, b.W, 1}}; }  /* Q, dQ   */
shape kv_of(const gb& b) { return {{b.B, b.KV, b.T, b.D}, {b.T * b.W, b.D, b.W, 1}}; } /* K, V, dK, dV */
shape kvt_of(const gb& b) { return {{b.B, b.KV, b.D, b.T}, {b.T * b.W, b.D, 1, b.W}}; } /* K^T, V^T */
shape o_of(const gb& b) { return {{b.B, b.NH, b.T, b.D}, {b.T * b.HO, b.D, b.HO, 1}}; } /* O, dO   */
shape row_of(const gb& b) { return {{b.B, b.NH, b.T, 1}, {b.NH * b.T, b.T, 1, 1}}; }    /* stats   */
shape s_of(const gb& b) { return {{b.B, b.NH, b.T, b.T}, {b.NH * b.T * b.T, b.T * b.T, b.T, 1}}; } /* scores */
shape st_of(const gb& b) { return {{b.B, b.NH, b.T, b.T}, {b.NH * b.T * b.T, b.T * b.T, 1, b.T}}; } /* S^T */
shape full_of(const gb& b) { return {{b.B, b.NH, b.T, b.D}, {b.NH * b.T * b.D, b.T * b.D, b.D, 1}}; }

/* A tensor of layout x: uid > 0 in memory, uid 0 virtual (the next uid). */
mst_status tens(gb& b, cudnnDataType_t dt, int64_t uid, const shape& x, cudnnBackendDescriptor_t* out) {
    cdn_tensor t = {4, {x.d[0], x.d[1], x.d[2], x.d[3]}, {x.s[0], x.s[1], x.s[2], x.s[3]},
                    uid ? uid : b.next++, dt, uid == 0, 0};
    return cdn_tensor_make(b.g, &t, out);
}

/* A host fp32 scalar passed by value (4 dims of 1: an operand of a
 * pointwise op has as many dims as the other). */
mst_status scalar(gb& b, int64_t uid, cudnnBackendDescriptor_t* out) {
    cdn_tensor t = {4, {1, 1, 1, 1}, {1, 1, 1, 1}, uid, F32, 0, 1};
    return cdn_tensor_make(b.g, &t, out);
}

/* y = mode(x, other) into a new virtual tensor of layout x and type dt. */
mst_status pw(gb& b, cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t other,
              const shape& l, cudnnDataType_t dt, cudnnBackendDescriptor_t* y) {
    MST_TRY(tens(b, dt, 0, l, y));
    return cdn_pointwise(b.g, mode, F32, -1, x, other, NULL, *y);
}

/* s with -inf above the diagonal (key > query): the top-left causal band. */
mst_status causal(gb& b, cudnnBackendDescriptor_t s, cudnnBackendDescriptor_t neg_inf, cudnnBackendDescriptor_t* y) {
    const shape S = s_of(b);
    cudnnBackendDescriptor_t row, col, keep;
    MST_TRY(tens(b, I32, 0, S, &row));
    MST_TRY(cdn_pointwise(b.g, CUDNN_POINTWISE_GEN_INDEX, F32, 2, s, NULL, NULL, row));
    MST_TRY(tens(b, I32, 0, S, &col));
    MST_TRY(cdn_pointwise(b.g, CUDNN_POINTWISE_GEN_INDEX, F32, 3, s, NULL, NULL, col));
    MST_TRY(tens(b, BOOL, 0, S, &keep));
    MST_TRY(cdn_pointwise(b.g, CUDNN_POINTWISE_CMP_GE, BOOL, -1, row, col, NULL, keep));
    MST_TRY(tens(b, F32, 0, S, y));
    return cdn_pointwise(b.g, CUDNN_POINTWISE_BINARY_SELECT, F32, -1, s, neg_inf, keep, *y);
}

/* out = a x over each query head; with KV < NH summed over each group
 * (a [B, NH, T, T] bf16 transposed scores, x [B, NH, T, D]; out [B, KV, T, D]). */
mst_status group_matmul(gb& b, cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t out) {
    if (b.KV == b.NH) return cdn_matmul(b.g, a, x, out);
    cudnnBackendDescriptor_t full;
    MST_TRY(tens(b, BF16, 0, full_of(b), &full));
    MST_TRY(cdn_matmul(b.g, a, x, full));
    return cdn_reduce(b.g, CUDNN_REDUCE_TENSOR_ADD, full, out);
}

mst_status graph_forward(gb& b) {
    const shape S = s_of(b), R = row_of(b);
    cudnnBackendDescriptor_t Q, KT, V, O, stats, sc, ninf, s, s1, s2, m, s3, e, z, l, p;
    MST_TRY(tens(b, BF16, U_Q, q_of(b), &Q));
    MST_TRY(tens(b, BF16, U_K, kvt_of(b), &KT));
    MST_TRY(tens(b, BF16, U_V, kv_of(b), &V));
    MST_TRY(tens(b, BF16, U_O, o_of(b), &O));
    MST_TRY(tens(b, F32, U_STATS, R, &stats));
    MST_TRY(scalar(b, U_SCALE, &sc));
    MST_TRY(scalar(b, U_NEG_INF, &ninf));
    MST_TRY(tens(b, F32, 0, S, &s));
    MST_TRY(cdn_matmul(b.g, Q, KT, s));
    MST_TRY(pw(b, CUDNN_POINTWISE_MUL, s, sc, S, F32, &s1));
    MST_TRY(causal(b, s1, ninf, &s2));
    MST_TRY(tens(b, F32, 0, R, &m));
    MST_TRY(cdn_reduce(b.g, CUDNN_REDUCE_TENSOR_MAX, s2, m));
    MST_TRY(pw(b, CUDNN_POINTWISE_SUB, s2, m, S, F32, &s3));
    MST_TRY(pw(b, CUDNN_POINTWISE_EXP, s3, NULL, S, F32, &e));
    MST_TRY(tens(b, F32, 0, R, &z));
    MST_TRY(cdn_reduce(b.g, CUDNN_REDUCE_TENSOR_ADD, e, z));
    MST_TRY(pw(b, CUDNN_POINTWISE_LOG, z, NULL, R, F32, &l));
    MST_TRY(cdn_pointwise(b.g, CUDNN_POINTWISE_ADD, F32, -1, m, l, NULL, stats));
    MST_TRY(pw(b, CUDNN_POINTWISE_DIV, e, z, S, BF16, &p));
    return cdn_matmul(b.g, p, V, O);
}

mst_status graph_backward(gb& b, int nondet) {
    const shape S = s_of(b), R = row_of(b), ST = st_of(b);
    cudnnBackendDescriptor_t Q, KT, VT, O, dO, stats, dQ, dK, dV, sum, sc, ninf, one;
    MST_TRY(tens(b, BF16, U_Q, q_of(b), &Q));
    MST_TRY(tens(b, BF16, U_K, kvt_of(b), &KT));
    MST_TRY(tens(b, BF16, U_V, kvt_of(b), &VT));
    MST_TRY(tens(b, BF16, U_O, o_of(b), &O));
    MST_TRY(tens(b, BF16, U_DO, o_of(b), &dO));
    MST_TRY(tens(b, F32, U_STATS, R, &stats));
    MST_TRY(tens(b, BF16, U_DQ, q_of(b), &dQ));
    MST_TRY(tens(b, BF16, U_DK, kv_of(b), &dK));
    MST_TRY(tens(b, BF16, U_DV, kv_of(b), &dV));
    MST_TRY(tens(b, F32, U_SUM, R, &sum));
    MST_TRY(scalar(b, U_SCALE, &sc));
    MST_TRY(scalar(b, U_NEG_INF, &ninf));
    MST_TRY(scalar(b, U_ONE, &one));
    /* sum = rowsum(dO O) (the frontend's dO-O layout of the virtual product) */
    const shape DOO = {{b.B, b.NH, b.T, b.D}, {b.NH * b.T * b.D, b.T * b.D, b.NH * b.D, 1}};
    cudnnBackendDescriptor_t doo, r, s, s1, s2, s3, e, pt, dp, dp1, ds, ds1, dst, k;
    MST_TRY(pw(b, CUDNN_POINTWISE_MUL, dO, O, DOO, F32, &doo));
    MST_TRY(tens(b, F32, 0, R, &r));
    MST_TRY(cdn_reduce(b.g, CUDNN_REDUCE_TENSOR_ADD, doo, r));
    MST_TRY(cdn_pointwise(b.g, CUDNN_POINTWISE_MUL, F32, -1, r, one, NULL, sum));
    /* E = exp(masked S sc - stats); dV = E^T dO */
    MST_TRY(tens(b, F32, 0, S, &s));
    MST_TRY(cdn_matmul(b.g, Q, KT, s));
    MST_TRY(pw(b, CUDNN_POINTWISE_MUL, s, sc, S, F32, &s1));
    MST_TRY(pw(b, CUDNN_POINTWISE_SUB, s1, stats, S, F32, &s2));
    MST_TRY(causal(b, s2, ninf, &s3));
    MST_TRY(pw(b, CUDNN_POINTWISE_EXP, s3, NULL, S, F32, &e));
    MST_TRY(tens(b, BF16, 0, ST, &pt));
    MST_TRY(cdn_reshape(b.g, e, pt));
    MST_TRY(group_matmul(b, pt, dO, dV));
    /* dS = E (dO V^T - sum) sc; dK = dS^T Q */
    MST_TRY(tens(b, F32, 0, S, &dp));
    MST_TRY(cdn_matmul(b.g, dO, VT, dp));
    MST_TRY(pw(b, CUDNN_POINTWISE_SUB, dp, sum, S, F32, &dp1));
    MST_TRY(pw(b, CUDNN_POINTWISE_MUL, dp1, e, S, F32, &ds));
    MST_TRY(pw(b, CUDNN_POINTWISE_MUL, ds, sc, S, F32, &ds1));
    MST_TRY(tens(b, BF16, 0, ST, &dst));
    MST_TRY(cdn_reshape(b.g, ds1, dst));
    MST_TRY(group_matmul(b, dst, Q, dK));
    /* dQ = dS K (K: K^T seen transposed), directly or through the fp32 accumulator */
    MST_TRY(tens(b, F32, 0, kv_of(b), &k));
    MST_TRY(cdn_reshape(b.g, KT, k));
    if (!nondet) return cdn_matmul(b.g, ds1, k, dQ);
    cudnnBackendDescriptor_t acc;
    MST_TRY(tens(b, F32, U_DQ_ACC, full_of(b), &acc));
    MST_TRY(cdn_matmul(b.g, ds1, k, acc));
    return cdn_pointwise(b.g, CUDNN_POINTWISE_IDENTITY, F32, -1, acc, NULL, NULL, dQ);
}

/* ---- engine choice ------------------------------------------------------------ */

enum { MAX_CONFIGS = 16 };

/* Whether engine config cfg is noted NONDETERMINISTIC (*nondet) and its index. */
mst_status engine_notes(cdn_build* g, cudnnBackendDescriptor_t cfg, int* nondet, int64_t* index) {
    const mst_cudnn_api* A = g->api;
    cudnnBackendDescriptor_t eng;
    MST_TRY(cdn_desc(g, CUDNN_BACKEND_ENGINE_DESCRIPTOR, &eng));
    int64_t n = 0;
    CUDNN_TRY(A, get(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &eng));
    cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
    CUDNN_TRY(A, get(eng, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE, CUDNN_NUMERICAL_NOTE_TYPE_COUNT,
                     &n, notes));
    *nondet = 0;
    for (int64_t i = 0; i < n && i < CUDNN_NUMERICAL_NOTE_TYPE_COUNT; i++)
        *nondet |= notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
    CUDNN_TRY(A, get(eng, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, index));
    return MST_OK;
}

/* The graph of p->g finalized, the heuristics' configs tried in their order
 * until one gives an execution plan (p->plan, p->ws_bytes, p->engine):
 * first skipping engines noted nondeterministic (unless p->key.nondet),
 * then, where none other took it, those (p->noted_nondet: the GPU test's
 * bit-identity checks tell whether its runs differ). */
mst_status choose_plan(cudnnHandle_t h, sdpa_plan* p) {
    cdn_build* g = &p->g;
    const mst_cudnn_api* A = g->api;
    cudnnBackendDescriptor_t graph, heur, cfg[MAX_CONFIGS];
    MST_TRY(cdn_desc(g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, &graph));
    CUDNN_TRY(A, set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, g->n_ops, g->ops));
    CUDNN_TRY(A, set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h));
    CUDNN_TRY(A, finalize(graph));
    MST_TRY(cdn_desc(g, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, &heur));
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    CUDNN_TRY(A, set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph));
    CUDNN_TRY(A, set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode));
    CUDNN_TRY(A, finalize(heur));
    int64_t n = 0;
    CUDNN_TRY(A, get(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, NULL));
    if (n > MAX_CONFIGS) n = MAX_CONFIGS;
    for (int64_t i = 0; i < n; i++) MST_TRY(cdn_desc(g, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &cfg[i]));
    int64_t got = 0;
    if (n > 0) CUDNN_TRY(A, get(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &got, cfg));
    char why[400] = "the heuristics returned no engine config";
    for (int64_t k = 0; k < 2 * got; k++) {
        const int64_t i = k % got, pass = k / got; /* pass 1: the engines noted nondeterministic */
        int nondet = 0;
        int64_t index = -1;
        MST_TRY(engine_notes(g, cfg[i], &nondet, &index));
        if (nondet && !p->key.nondet && pass == 0) {
            snprintf(why, sizeof why, "engine %lld is noted nondeterministic", (long long)index);
            continue;
        }
        if (pass == 1 && !(nondet && !p->key.nondet)) continue; /* tried in pass 0 */
        cudnnBackendDescriptor_t plan;
        MST_TRY(cdn_desc(g, CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan));
        CUDNN_TRY(A, set(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h));
        CUDNN_TRY(A, set(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfg[i]));
        const cudnnStatus_t s = A->finalize(plan);
        if (s != CUDNN_STATUS_SUCCESS) {
            mst_cudnn_fail(A, s, "finalize(execution plan)", __FILE__, __LINE__);
            snprintf(why, sizeof why, "engine %lld: %s", (long long)index, mst_last_error());
            continue;
        }
        CUDNN_TRY(A, get(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &p->ws_bytes));
        p->plan = plan;
        p->engine = index;
        p->noted_nondet = nondet;
        return MST_OK;
    }
    return mst_set_error(MST_ERR_UNSUPPORTED, "cuDNN %s attention: none of %lld engine configs took it (last: %s)",
                         p->key.backward ? "backward" : "forward", (long long)got, why);
}

/* ---- the context's state and plan cache --------------------------------------- */

void plan_free(sdpa_plan* p) {
    if (!p) return;
    cdn_free(&p->g);
    free(p);
}

void state_free(void* v) {
    sdpa_state* s = (sdpa_state*)v;
    if (!s) return;
    for (int i = 0; i < s->n_plans; i++) plan_free(s->plans[i]);
    free(s->plans);
    const mst_cudnn_api* A = NULL;
    if (s->handle && mst_cudnn_api_get(&A) == MST_OK) A->destroy(s->handle);
    free(s); /* s->ws is context memory: the context frees it */
}

mst_status state_of(mst_ctx_t* ctx, const mst_cudnn_api* A, sdpa_state** out) {
    mst_cuda_impl* c = mst_cuda(ctx);
    if (!c->cudnn) { /* kept only once its handle is made */
        cudnnHandle_t h = NULL;
        MST_CUDA_TRY(cudaSetDevice(c->device));
        CUDNN_TRY(A, create(&h));
        sdpa_state* s = (sdpa_state*)calloc(1, sizeof *s);
        if (!s) {
            A->destroy(h);
            return mst_set_error(MST_ERR_OOM, "cuDNN attention state");
        }
        s->handle = h;
        c->cudnn = s;
        c->cudnn_free = state_free;
    }
    *out = (sdpa_state*)c->cudnn;
    return MST_OK;
}

/* The plan of a's dims: one forward whatever the backward's determinism. */
sdpa_key key_of(const mst_attn_args* a, int backward) {
    return {a->batch, a->n_head, a->n_kv_head, a->seq, a->head_dim, backward, backward && a->nondeterministic};
}

/* A new plan for k (graph built, engine chosen, scalars set). */
mst_status plan_build(const mst_cudnn_api* A, cudnnHandle_t h, const sdpa_key& k, sdpa_plan** out) {
    sdpa_plan* p = (sdpa_plan*)calloc(1, sizeof *p);
    if (!p) return mst_set_error(MST_ERR_OOM, "cuDNN attention plan");
    p->key = k;
    p->g.api = A;
    p->scale = 1.0f / sqrtf((float)k.D);
    p->neg_inf = A->version < 91000 ? -FLT_MAX : -INFINITY; /* older cuDNN masks with the lowest float */
    p->one = 1.0f;
    gb b = {&p->g, U_VIRTUAL, k.B, k.NH, k.KV, k.T, k.D, (k.NH + 2 * k.KV) * k.D, k.NH * k.D};
    mst_status st = k.backward ? graph_backward(b, k.nondet) : graph_forward(b);
    if (st == MST_OK) st = choose_plan(h, p);
    if (st != MST_OK) {
        plan_free(p);
        return st;
    }
    const int64_t align = 256;
    p->acc_off = (p->ws_bytes + align - 1) / align * align;
    if (getenv("MST_CUDNN_VERBOSE"))
        fprintf(stderr, "cuDNN %zu attention plan: %s%s B %lld NH %lld KV %lld T %lld D %lld: engine %lld%s, "
                "workspace %.1f MiB\n", A->version, k.backward ? "backward" : "forward",
                k.nondet ? " (nondeterministic allowed)" : "", (long long)k.B, (long long)k.NH, (long long)k.KV,
                (long long)k.T, (long long)k.D, (long long)p->engine,
                p->noted_nondet ? " NOTED NONDETERMINISTIC" : "", (double)p->ws_bytes / (1 << 20));
    *out = p;
    return MST_OK;
}

/* Bytes of workspace plan p uses (its own, then the dQ accumulator). */
size_t plan_ws(const sdpa_plan* p) {
    const sdpa_key& k = p->key;
    return (size_t)p->acc_off + (k.backward && k.nondet ? (size_t)(k.B * k.NH * k.T * k.D) * sizeof(float) : 0);
}

/* The plan of key k from the cache, built (and the workspace grown) when
 * missing, which must not happen during a capture. */
mst_status plan_of(mst_ctx_t* ctx, const sdpa_key& k, sdpa_state** st_out, sdpa_plan** out) {
    const mst_cudnn_api* A;
    sdpa_state* s;
    MST_TRY(mst_cudnn_api_get(&A));
    MST_TRY(state_of(ctx, A, &s));
    *st_out = s;
    for (int i = 0; i < s->n_plans; i++)
        if (same_key(s->plans[i]->key, k)) {
            *out = s->plans[i];
            return MST_OK;
        }
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    MST_CUDA_TRY(cudaStreamIsCapturing(mst_cuda(ctx)->stream, &cap));
    if (cap != cudaStreamCaptureStatusNone)
        return mst_set_error(MST_ERR_INVALID, "cuDNN attention: no plan for B %lld NH %lld KV %lld T %lld D %lld %s "
                             "during capture (attn_cudnn_check builds it before)", (long long)k.B, (long long)k.NH,
                             (long long)k.KV, (long long)k.T, (long long)k.D, k.backward ? "backward" : "forward");
    if (s->n_plans == s->cap_plans) {
        const int cap_n = s->cap_plans ? 2 * s->cap_plans : 8;
        sdpa_plan** grown = (sdpa_plan**)realloc(s->plans, sizeof *grown * (size_t)cap_n);
        if (!grown) return mst_set_error(MST_ERR_OOM, "cuDNN attention plan cache");
        s->plans = grown;
        s->cap_plans = cap_n;
    }
    sdpa_plan* p;
    MST_TRY(plan_build(A, s->handle, k, &p));
    void* ws;
    mst_status st = mst_workspace(ctx, &s->ws, plan_ws(p) > 0 ? plan_ws(p) : 1, &ws);
    if (st != MST_OK) {
        plan_free(p);
        return st;
    }
    s->plans[s->n_plans++] = p;
    *out = p;
    return MST_OK;
}

/* Executes p on the context's stream with the tensors uids[i] at ptrs[i]. */
mst_status execute(mst_ctx_t* ctx, sdpa_state* s, sdpa_plan* p, const int64_t* uids, void* const* ptrs, int n) {
    const mst_cudnn_api* A = p->g.api;
    CUDNN_TRY(A, set_stream(s->handle, mst_cuda(ctx)->stream));
    cdn_build pack_g = {};
    pack_g.api = A;
    cudnnBackendDescriptor_t pack;
    void* ws = s->ws.ptr;
    mst_status st = cdn_desc(&pack_g, CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &pack);
    cudnnStatus_t e = CUDNN_STATUS_SUCCESS;
    const char* what = "";
#define STEP(call)                                                    \
    if (st == MST_OK && e == CUDNN_STATUS_SUCCESS) {                  \
        e = A->call;                                                  \
        what = #call;                                                 \
    }
    STEP(set(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids));
    STEP(set(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs));
    STEP(set(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws));
    STEP(finalize(pack));
    STEP(execute(s->handle, p->plan, pack));
#undef STEP
    if (st == MST_OK && e != CUDNN_STATUS_SUCCESS) st = mst_cudnn_fail(A, e, what, __FILE__, __LINE__);
    cdn_free(&pack_g);
    return st;
}

bool aligned16(const void* p) { return p && ((uintptr_t)p & 15) == 0; }

/* The buffers of a call: present and 16-byte aligned (with D % 8 == 0 every
 * head's columns then are too). */
mst_status check_ptrs(const mst_attn_args* a, int backward) {
    const void* need[] = {a->qkv, a->out, a->lse, backward ? (const void*)a->dout : a->qkv,
                          backward ? (const void*)a->dqkv : a->qkv, backward ? (const void*)a->delta : a->qkv};
    for (size_t i = 0; i < sizeof need / sizeof *need; i++)
        if (!aligned16(need[i]))
            return mst_set_error(MST_ERR_INVALID, "cuDNN attention: buffer %zu of (qkv, out, lse, dout, dqkv, delta) "
                                 "is NULL or not 16-byte aligned (%p)", i, need[i]);
    return MST_OK;
}

} // namespace

/* The graph of a's dims built and finalized as an operation graph (no
 * handle, no device: every operation's shapes and types checked by cuDNN),
 * then dropped. */
extern "C" mst_status mst_cudnn_graph_check(const mst_attn_args* a, int backward) {
    const mst_cudnn_api* A;
    MST_TRY(mst_cudnn_api_get(&A));
    cdn_build g = {};
    g.api = A;
    const sdpa_key k = key_of(a, backward);
    gb b = {&g, U_VIRTUAL, k.B, k.NH, k.KV, k.T, k.D, (k.NH + 2 * k.KV) * k.D, k.NH * k.D};
    mst_status st = backward ? graph_backward(b, k.nondet) : graph_forward(b);
    cudnnBackendDescriptor_t graph = NULL;
    if (st == MST_OK) st = cdn_desc(&g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, &graph);
    cudnnStatus_t e = CUDNN_STATUS_SUCCESS;
    if (st == MST_OK) e = A->set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, g.n_ops, g.ops);
    if (st == MST_OK && e == CUDNN_STATUS_SUCCESS) e = A->finalize(graph);
    if (st == MST_OK && e != CUDNN_STATUS_SUCCESS) st = mst_cudnn_fail(A, e, "finalize(operation graph)", __FILE__, __LINE__);
    cdn_free(&g);
    return st;
}

/* The dims cuDNN's fused attention is asked for (D a multiple of 8 up to
 * 128, KV dividing NH), then the library and both plans: building them here
 * (outside any capture) is what makes the later calls allocation-free. */
extern "C" mst_status mst_cuda_attn_cudnn_check(mst_ctx_t* ctx, const mst_attn_args* a) {
    if (a->head_dim % 8 != 0 || a->head_dim < 8 || a->head_dim > 128)
        return mst_set_error(MST_ERR_UNSUPPORTED, "cuDNN attention: head_dim %lld: expected a multiple of 8 up to 128",
                             (long long)a->head_dim);
    if (a->n_head < 1 || a->n_kv_head < 1 || a->n_head % a->n_kv_head != 0)
        return mst_set_error(MST_ERR_INVALID, "cuDNN attention: n_kv_head %lld must divide n_head %lld",
                             (long long)a->n_kv_head, (long long)a->n_head);
    if (a->batch < 1 || a->seq < 1)
        return mst_set_error(MST_ERR_INVALID, "cuDNN attention: batch %lld, seq %lld: expected >= 1",
                             (long long)a->batch, (long long)a->seq);
    sdpa_state* s;
    sdpa_plan* p;
    MST_TRY(plan_of(ctx, key_of(a, 0), &s, &p));
    return plan_of(ctx, key_of(a, 1), &s, &p);
}

extern "C" mst_status mst_cuda_attn_cudnn_forward(mst_ctx_t* ctx, const mst_attn_args* a) {
    MST_TRY(check_ptrs(a, 0));
    sdpa_state* s;
    sdpa_plan* p;
    MST_TRY(plan_of(ctx, key_of(a, 0), &s, &p));
    const int64_t HO = a->n_head * a->head_dim, KVD = a->n_kv_head * a->head_dim;
    uint16_t* qkv = (uint16_t*)a->qkv;
    const int64_t uids[] = {U_Q, U_K, U_V, U_O, U_STATS, U_SCALE, U_NEG_INF};
    void* const ptrs[] = {qkv, qkv + HO, qkv + HO + KVD, a->out, a->lse, &p->scale, &p->neg_inf};
    return execute(ctx, s, p, uids, ptrs, (int)(sizeof uids / sizeof *uids));
}

extern "C" mst_status mst_cuda_attn_cudnn_backward(mst_ctx_t* ctx, const mst_attn_args* a) {
    MST_TRY(check_ptrs(a, 1));
    sdpa_state* s;
    sdpa_plan* p;
    MST_TRY(plan_of(ctx, key_of(a, 1), &s, &p));
    const int64_t HO = a->n_head * a->head_dim, KVD = a->n_kv_head * a->head_dim;
    uint16_t *qkv = (uint16_t*)a->qkv, *d = a->dqkv;
    const int64_t uids[] = {U_Q, U_K, U_V, U_O, U_DO, U_STATS, U_DQ, U_DK, U_DV, U_SUM, U_SCALE, U_NEG_INF, U_ONE,
                            U_DQ_ACC};
    void* const ptrs[] = {qkv, qkv + HO, qkv + HO + KVD, a->out, (void*)a->dout, a->lse, d, d + HO, d + HO + KVD,
                          a->delta, &p->scale, &p->neg_inf, &p->one, (char*)s->ws.ptr + p->acc_off};
    const int n = (int)(sizeof uids / sizeof *uids) - (p->key.nondet ? 0 : 1); /* the accumulator: nondet only */
    return execute(ctx, s, p, uids, ptrs, n);
}

#else /* built without cuDNN's headers */

static mst_status no_cudnn(void) {
    return mst_set_error(MST_ERR_UNSUPPORTED, "cuDNN attention: built without cuDNN's headers (cudnn_graph.h not "
                         "found at configure time)");
}
extern "C" mst_status mst_cudnn_probe(const char* name, size_t* version) {
    (void)name, (void)version;
    return no_cudnn();
}
extern "C" mst_status mst_cudnn_graph_check(const mst_attn_args* a, int backward) {
    (void)a, (void)backward;
    return no_cudnn();
}
extern "C" mst_status mst_cuda_attn_cudnn_check(mst_ctx_t* ctx, const mst_attn_args* a) {
    (void)ctx, (void)a;
    return no_cudnn();
}
extern "C" mst_status mst_cuda_attn_cudnn_forward(mst_ctx_t* ctx, const mst_attn_args* a) {
    (void)ctx, (void)a;
    return no_cudnn();
}
extern "C" mst_status mst_cuda_attn_cudnn_backward(mst_ctx_t* ctx, const mst_attn_args* a) {
    (void)ctx, (void)a;
    return no_cudnn();
}
#endif
