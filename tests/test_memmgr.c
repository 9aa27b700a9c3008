/*
 * test_memmgr.c — the memory manager on a stack of grouped-MLP layers with
 * random routing and max_rows > rows, several microbatches, every schedule,
 * every policy, mixes of policies per tensor and per layer, and layer
 * recompute: gradients bit-identical to all-KEEP; no page leaked after each
 * step; an injected overflow detected and the rerun step bit-identical to a
 * run with large pools; a device block at factor 1.0 spills to its host block
 * on heavier counts; offload bytes equal the host pages used; bad input.
 * On CUDA the sized steps run as one captured CUDA graph. The schedules and
 * policies run again with each stream slowed down in turn (CUDA: a spin on
 * it; CPU: a side stream deferred as long as the events allow): a missing
 * event edge of the memory manager then changes the gradients.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef MST_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "harness.h"
#include "mlp_stack.h"
#include "lib/internal.h"

enum { L = 4, M = 4, E = 4, H = 32, F = 24, R = 200, PAGE = 16 };

/* Bytes of one row of each saved tensor: x [H] bf16, h [2F] bf16, z [F]
 * bf16, p fp32 (the test's own table, not the library's). */
static const size_t saved_row_bytes[MST_N_SAVED] = {H * 2, 2 * F * 2, F * 2, 4};

typedef struct setup {
    const char* name;
    mst_schedule_config sched;
    const char* policy;   /* spec, or NULL for per-layer mixes            */
    const char* recompute;
    double dev_factor;    /* pool sizing; 0: 1.10                         */
    double host_factor;
    mst_stream_sel slow;  /* the stream slowed down (cycles > 0)         */
    int64_t cycles;       /* its spin, clock cycles; 0: none             */
} setup;

/* Gradients of one step, downloaded: main_grads, dprobs, input grads. */
typedef struct grads {
    unsigned char* g;
    size_t n;
} grads;

static void random_counts(mst_rng* rng, int32_t* counts, double fill) {
    for (int mb = 0; mb < M; mb++) {
        int64_t total = (int64_t)(R * fill * (0.6 + 0.4 * mst_rng_uniform(rng)));
        for (int l = 0; l < L; l++)
            mst_rng_counts(rng, counts + ((int64_t)l * M + mb) * E, E, total, l & 1 ? 1.0 : 0.3);
    }
}

static grads download(mst_stack* s) {
    const size_t probs = (size_t)L * M * R * 4, rows = (size_t)M * R * H * 2;
    grads out = {malloc(s->gbuf_bytes + probs + rows), s->gbuf_bytes + probs + rows};
    mst_copy_b2h(s->ctx, out.g, s->gbuf, s->gbuf_bytes);
    for (int i = 0; i < L * M; i++)
        mst_copy_b2h(s->ctx, out.g + s->gbuf_bytes + (size_t)i * R * 4, s->dprobs[i].data, R * 4);
    /* input gradients: rows [0, n) of grad[chunk 0]; the rest is not data */
    int32_t c[E];
    for (int mb = 0; mb < M; mb++) {
        mst_copy_b2h(s->ctx, c, s->counts[mb].data, sizeof c);
        int64_t n = 0;
        for (int g = 0; g < E; g++) n += c[g];
        unsigned char* dst = out.g + s->gbuf_bytes + probs + (size_t)mb * R * H * 2;
        memset(dst, 0, (size_t)R * H * 2);
        mst_copy_b2h(s->ctx, dst, s->grad[mb].data, (size_t)n * H * 2);
    }
    /* dprobs past n are not data either: zero them on the host copy */
    for (int i = 0; i < L * M; i++) {
        mst_copy_b2h(s->ctx, c, s->counts[i].data, sizeof c);
        int64_t n = 0;
        for (int g = 0; g < E; g++) n += c[g];
        memset(out.g + s->gbuf_bytes + (size_t)i * R * 4 + n * 4, 0, (size_t)(R - n) * 4);
    }
    return out;
}

/* A sized (non-measuring) step; on CUDA captured once in a graph and replayed. */
static mst_status sized_step(mst_ctx_t* ctx, mst_stack* s, const mst_sched_entry* sch, int n) {
#ifdef MST_HAVE_CUDA
    if (mst_ctx_backend(ctx) == MST_BACKEND_CUDA) {
        cudaStream_t st = (cudaStream_t)mst_ctx_stream(ctx);
        cudaGraph_t g;
        cudaGraphExec_t ge;
        if (cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
            return MST_ERR_BACKEND;
        mst_status rs = mst_stack_step(s, sch, n, 0);
        cudaError_t e = cudaStreamEndCapture(st, &g);
        if (rs != MST_OK) return rs;
        if (e != cudaSuccess) return MST_ERR_BACKEND;
        if (cudaGraphInstantiate(&ge, g, 0) != cudaSuccess) return MST_ERR_BACKEND;
        e = cudaGraphLaunch(ge, st);
        cudaGraphExecDestroy(ge);
        cudaGraphDestroy(g);
        if (e != cudaSuccess) return MST_ERR_BACKEND;
        return mst_ctx_sync(ctx);
    }
#else
    (void)ctx;
#endif
    return mst_stack_step(s, sch, n, 0);
}

/* Runs a measuring step on counts a, then a sized step on counts b (rerun
 * measuring on overflow, as the trainer does); returns the sized step's grads. */
static grads run_setup(mst_ctx_t* ctx, mst_stack* s, const setup* su, const int32_t* a,
                       const int32_t* b, int* overflowed, mst_mem_report_t* rep) {
    int32_t n = 2 * su->sched.microbatches * su->sched.virtual_stages;
    mst_sched_entry* sch = (mst_sched_entry*)malloc(sizeof *sch * (size_t)n);
    CHECK_OK(mst_schedule_make(&su->sched, sch, n));
    mst_memmgr_config mc = {sizeof(mst_memmgr_config), L, M, su->sched.virtual_stages, R, H, F, sch, n, PAGE,
                            su->dev_factor ? su->dev_factor : 1.10, su->host_factor, NULL, NULL};
    CHECK_OK(mst_memmgr_create(ctx, &mc, &s->mm));
    if (su->cycles) CHECK_OK(mst_memmgr_debug_slow(s->mm, su->slow, su->cycles));
    if (su->policy) CHECK_OK(mst_memmgr_set_policy_spec(s->mm, su->policy));
    else { /* a different mix on each layer */
        for (int l = 0; l < L; l++)
            for (int nm = 0; nm < MST_N_SAVED; nm++) {
                mst_policy p = (mst_policy)((l + nm) % 3); /* keep, stash, offload */
                CHECK_OK(mst_memmgr_set_policy(s->mm, l, (mst_saved_name)nm, p));
            }
        CHECK_OK(mst_memmgr_set_policy(s->mm, 1, MST_SAVED_FC2_INPUT, MST_POLICY_RECOMPUTE));
    }
    if (su->recompute) {
        mst_recompute_config rc = MST_RECOMPUTE_CONFIG_INIT;
        CHECK_OK(mst_recompute_parse(su->recompute, &rc));
        CHECK_OK(mst_memmgr_set_recompute(s->mm, &rc));
    }
    CHECK_OK(mst_stack_route(s, a, 11));
    CHECK_OK(mst_stack_step(s, sch, n, 1));
    CHECK_OK(mst_memmgr_step_check(s->mm));
    CHECK_OK(mst_memmgr_check(s->mm));
    CHECK_OK(mst_stack_route(s, b, 22));
    CHECK_OK(sized_step(ctx, s, sch, n));
    CHECK_OK(mst_memmgr_check(s->mm));
    mst_status st = mst_memmgr_step_check(s->mm);
    *overflowed = st == MST_ERR_OVERFLOW;
    CHECK(st == MST_OK || st == MST_ERR_OVERFLOW, "%s: step check %s (%s)", su->name, mst_status_str(st),
          mst_last_error());
    if (*overflowed) { /* rerun with exact shapes, which also resizes the pools */
        CHECK_OK(mst_stack_step(s, sch, n, 1));
        CHECK_OK(mst_memmgr_step_check(s->mm));
        CHECK_OK(mst_memmgr_check(s->mm));
    }
    grads g = download(s);
    CHECK_OK(mst_mem_report(s->mm, rep));
    mst_memmgr_destroy(s->mm);
    s->mm = NULL;
    free(sch);
    return g;
}

static void compare(const grads* base, const grads* got, const char* what) {
    int64_t d = mst_first_diff(base->g, got->g, base->n);
    CHECK(d < 0, "%s: gradients differ from all-KEEP at byte %lld of %zu", what, (long long)d, base->n);
}

/* Every schedule, policy and layer recompute against all-KEEP. With cycles
 * > 0, stream `slow` is slowed down (a spin before each of its pool
 * operations, or at each layer call on main) in every run but KEEP's: an
 * event edge missing from the memory manager lets main overwrite a buffer
 * whose stash has not read it, or read rows that a restore has not written,
 * and the gradients change. */
static void policies_and_schedules(mst_ctx_t* ctx, const mst_mlp_config* mlp, mst_rng* rng, mst_stream_sel slow,
                                   int64_t cycles) {
    int32_t* a = (int32_t*)malloc(sizeof(int32_t) * L * M * E);
    random_counts(rng, a, 0.8);
    const mst_schedule_config scheds[] = {
        {sizeof(mst_schedule_config), MST_SCHEDULE_PLAIN, 1, 0, M, 1},
        {sizeof(mst_schedule_config), MST_SCHEDULE_1F1B, 4, 0, M, 1},
        {sizeof(mst_schedule_config), MST_SCHEDULE_1F1B, 4, 2, M, 1},
        {sizeof(mst_schedule_config), MST_SCHEDULE_INTERLEAVED, 2, 0, M, 2},
    };
    const char* specs[] = {"stash", "offload", "recompute", "fc1_input=stash,act_input=offload,fc2_input=recompute",
                           "act_input=stash,probs=offload", "fc1_input=stash,probs=offload", NULL};
    const char* recomputes[] = {"uniform:2", "block:1", "uniform:1"};
    for (size_t si = 0; si < sizeof scheds / sizeof scheds[0]; si++) {
        mst_stack stack, *s = &stack;
        CHECK_OK(mst_stack_create(ctx, mlp, L, M, scheds[si].virtual_stages, R, 5, s));
        setup keep = {"keep", scheds[si], "keep", NULL, 0, 0, MST_STREAM_MAIN, 0};
        int ov;
        mst_mem_report_t rk = MST_MEM_REPORT_INIT, r = MST_MEM_REPORT_INIT;
        grads base = run_setup(ctx, s, &keep, a, a, &ov, &rk);
        CHECK(!ov, "keep overflowed");
        for (size_t pi = 0; pi < sizeof specs / sizeof specs[0]; pi++) {
            setup su = {specs[pi] ? specs[pi] : "per-layer mix", scheds[si], specs[pi], NULL, 0, 0, slow, cycles};
            grads g = run_setup(ctx, s, &su, a, a, &ov, &r);
            char what[160];
            snprintf(what, sizeof what, "%s / %s S=%d r=%d V=%d, stream %d slowed by %lld cycles", su.name,
                     mst_schedule_kind_str(su.sched.kind), su.sched.stages, su.sched.rank, su.sched.virtual_stages,
                     (int)slow, (long long)cycles);
            compare(&base, &g, what);
            CHECK(!ov, "%s: overflowed on the counts it was sized with", what);
            if (specs[pi] && strcmp(specs[pi], "offload") == 0) {
                CHECK(r.dev_pages_bytes == 0, "%s: offload took %zu device page bytes", what, r.dev_pages_bytes);
                CHECK(r.host_pages_peak_bytes > 0, "%s: offload used no host pages", what);
                if (su.sched.kind == MST_SCHEDULE_1F1B && su.sched.rank == 0) {
                    /* every (layer, mb) is offloaded before the first backward:
                     * the host pages at the peak hold exactly the offloaded rows,
                     * rounded up to pages, of every name */
                    size_t want = 0;
                    size_t row_bytes = 0;
                    for (int nm = 0; nm < MST_N_SAVED; nm++) row_bytes += saved_row_bytes[nm];
                    for (int mb = 0; mb < M; mb++) {
                        int64_t n = 0;
                        for (int g = 0; g < E; g++) n += a[(int64_t)mb * E + g];
                        want += (size_t)L * (size_t)((n + PAGE - 1) / PAGE) * PAGE * row_bytes;
                    }
                    CHECK(r.host_pages_peak_bytes == want, "%s: host pages at peak %zu bytes, offloaded %zu",
                          what, r.host_pages_peak_bytes, want);
                }
            }
            if (specs[pi] && strcmp(specs[pi], "stash") == 0)
                CHECK(r.dev_pages_peak_bytes > 0 && r.host_pages_bytes == 0, "%s: stash pages", what);
            free(g.g);
        }
        for (size_t ri = 0; ri < sizeof recomputes / sizeof recomputes[0]; ri++) {
            setup su = {recomputes[ri], scheds[si], "stash", recomputes[ri], 0, 0, slow, cycles};
            grads g = run_setup(ctx, s, &su, a, a, &ov, &r);
            char what[160];
            snprintf(what, sizeof what, "recompute %s / %s S=%d V=%d, stream %d slowed by %lld cycles",
                     recomputes[ri], mst_schedule_kind_str(su.sched.kind), su.sched.stages,
                     su.sched.virtual_stages, (int)slow, (long long)cycles);
            compare(&base, &g, what);
            CHECK(r.recompute_bytes > 0, "%s: no recompute savings reported", what);
            free(g.g);
        }
        free(base.g);
        mst_stack_destroy(s);
    }
    free(a);
}

/* Pools sized on light routing, then a heavier step: overflow detected,
 * rerun with exact shapes gives the bits of a run sized for it. */
static void overflow_rerun(mst_ctx_t* ctx, mst_stack* s, mst_rng* rng) {
    int32_t* light = (int32_t*)malloc(sizeof(int32_t) * L * M * E);
    int32_t* heavy = (int32_t*)malloc(sizeof(int32_t) * L * M * E);
    random_counts(rng, light, 0.3);
    random_counts(rng, heavy, 0.95);
    setup su = {"stash overflow", {sizeof(mst_schedule_config), MST_SCHEDULE_1F1B, 4, 0, M, 1}, "stash", NULL, 0, 0, MST_STREAM_MAIN, 0};
    int ov, ov2;
    mst_mem_report_t r1 = MST_MEM_REPORT_INIT, r2 = MST_MEM_REPORT_INIT;
    grads g_over = run_setup(ctx, s, &su, light, heavy, &ov, &r1);
    CHECK(ov, "pools sized on light routing did not overflow on heavy routing");
    CHECK(r1.overflows == 1 && r1.reruns == 1, "report: %d overflows, %d reruns", r1.overflows, r1.reruns);
    grads g_big = run_setup(ctx, s, &su, heavy, heavy, &ov2, &r2);
    CHECK(!ov2, "pools sized on heavy routing overflowed");
    compare(&g_big, &g_over, "rerun after overflow");
    setup keep = {"keep", su.sched, "keep", NULL, 0, 0, MST_STREAM_MAIN, 0};
    mst_mem_report_t rk = MST_MEM_REPORT_INIT;
    grads g_keep = run_setup(ctx, s, &keep, heavy, heavy, &ov2, &rk);
    compare(&g_keep, &g_over, "rerun after overflow vs keep");
    CHECK(rk.exact_bytes < rk.static_keep_bytes, "exact %zu >= static keep %zu", rk.exact_bytes, rk.static_keep_bytes);
    free(g_over.g), free(g_big.g), free(g_keep.g), free(light), free(heavy);
}

/* Device pages at factor 1.0 of the measured peak and a host block (factor
 * 1.0): heavier counts on the next step spill page by page to the host block
 * instead of overflowing, and the gradients are KEEP's bits. */
static void host_spill(mst_ctx_t* ctx, mst_stack* s, mst_rng* rng) {
    int32_t* light = (int32_t*)malloc(sizeof(int32_t) * L * M * E);
    int32_t* heavy = (int32_t*)malloc(sizeof(int32_t) * L * M * E);
    random_counts(rng, light, 0.5);
    for (int i = 0; i < L * M; i++) { /* 5/4 of the rows; every layer of a microbatch alike */
        int32_t *lt = light + (int64_t)i * E, *hv = heavy + (int64_t)i * E, want = 0, sum = 0;
        for (int g = 0; g < E; g++) want += lt[g], sum += hv[g] = lt[g] * 5 / 4;
        hv[0] += want * 5 / 4 + 1 - sum;
    }
    const mst_schedule_config sc = {sizeof(mst_schedule_config), MST_SCHEDULE_1F1B, 4, 0, M, 1};
    setup su = {"stash, device 1.0 + host 1.0", sc, "stash", NULL, 1.0, 1.0, MST_STREAM_MAIN, 0};
    int ov;
    mst_mem_report_t r = MST_MEM_REPORT_INIT, rk = MST_MEM_REPORT_INIT;
    grads g = run_setup(ctx, s, &su, light, heavy, &ov, &r);
    CHECK(!ov, "%s: overflowed instead of spilling", su.name);
    CHECK(r.host_pages_peak_bytes > 0 && r.dev_pages_peak_bytes == r.dev_pages_bytes,
          "%s: %zu host page bytes at peak, device %zu of %zu", su.name, r.host_pages_peak_bytes,
          r.dev_pages_peak_bytes, r.dev_pages_bytes);
    setup keep = {"keep", sc, "keep", NULL, 0, 0, MST_STREAM_MAIN, 0};
    grads gk = run_setup(ctx, s, &keep, heavy, heavy, &ov, &rk);
    compare(&gk, &g, su.name);
    free(g.g), free(gk.g), free(light), free(heavy);
}

/* The one policy-spec parser: what it makes of good specs, and bad ones
 * refused with a message naming the item. */
static void policy_specs(void) {
    mst_policy p[MST_N_SAVED];
    CHECK_OK(mst_policy_spec_parse("act_input=stash,probs=offload,fc2_input=recompute", p));
    CHECK(p[MST_SAVED_FC1_INPUT] == MST_POLICY_KEEP && p[MST_SAVED_ACT_INPUT] == MST_POLICY_STASH &&
              p[MST_SAVED_FC2_INPUT] == MST_POLICY_RECOMPUTE && p[MST_SAVED_PROBS] == MST_POLICY_OFFLOAD,
          "items: %d %d %d %d", p[0], p[1], p[2], p[3]);
    CHECK_OK(mst_policy_spec_parse("recompute", p));
    CHECK(p[MST_SAVED_FC1_INPUT] == MST_POLICY_KEEP && p[MST_SAVED_ACT_INPUT] == MST_POLICY_KEEP &&
              p[MST_SAVED_FC2_INPUT] == MST_POLICY_RECOMPUTE && p[MST_SAVED_PROBS] == MST_POLICY_KEEP,
          "recompute: %d %d %d %d", p[0], p[1], p[2], p[3]);
    CHECK_OK(mst_policy_spec_parse("offload", p));
    for (int n = 0; n < MST_N_SAVED; n++) CHECK(p[n] == MST_POLICY_OFFLOAD, "offload: name %d is %d", n, p[n]);
    static const struct {
        const char* spec;
        const char* says; /* in the message */
    } bad[] = {
        {"", "is empty"},
        {"stash,", "an empty item"},
        {",stash", "an empty item"},
        {"fc1_input=stash,,probs=keep", "an empty item"},
        {"fc1_input=stash,fc1_input=keep", "item 'fc1_input=keep' names fc1_input again"},
        {"probs=stash,act_input=keep,probs=stash", "item 'probs=stash' names probs again"},
        {"stash,fc1_input=keep", "item 'stash' is a bare policy"},
        {"fc1_input=recompute", "item 'fc1_input=recompute': only fc2_input"},
        {"fc3_input=stash", "fc3_input"},
        {"act_input=squash", "squash"},
        {"act_input", "act_input"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_STATUS(mst_policy_spec_parse(bad[i].spec, p), MST_ERR_INVALID);
        CHECK(strstr(mst_last_error(), bad[i].says) != NULL, "spec '%s': message '%s' lacks '%s'", bad[i].spec,
              mst_last_error(), bad[i].says);
    }
}

/* The pages of each name at its peak along a schedule of a measuring step
 * under STASH, modelled from the schedule alone: the forward of (chunk, mb)
 * saves each layer's four tensors (ceil(rows / PAGE) pages each), its
 * backward gives them back; the last layer's produced tensors (act_input,
 * fc2_input) stay unsaved when the backward of the same (chunk, mb) comes
 * right after. sum[n]: every save's pages, as if none were given back. */
static void model_peaks(const mst_sched_entry* sch, int n_sch, int V, const int64_t rows[M],
                        int64_t peak[MST_N_SAVED], int64_t sum[MST_N_SAVED]) {
    int64_t live[MST_N_SAVED] = {0};
    const int lpc = L / V;
    for (int n = 0; n < MST_N_SAVED; n++) peak[n] = sum[n] = 0;
    for (int i = 0; i < n_sch; i++) {
        const mst_sched_entry e = sch[i];
        const int follows = !e.backward && i + 1 < n_sch && sch[i + 1].backward && sch[i + 1].chunk == e.chunk &&
                            sch[i + 1].microbatch == e.microbatch;
        const int back = i > 0 && !sch[i - 1].backward && sch[i - 1].chunk == e.chunk &&
                         sch[i - 1].microbatch == e.microbatch;
        const int64_t pages = (rows[e.microbatch] + PAGE - 1) / PAGE;
        for (int j = 0; j < lpc; j++)
            for (int n = 0; n < MST_N_SAVED; n++) {
                const int produced = n == MST_SAVED_ACT_INPUT || n == MST_SAVED_FC2_INPUT;
                if (produced && j == lpc - 1 && (e.backward ? back : follows)) continue;
                live[n] += e.backward ? -pages : pages;
                if (!e.backward) sum[n] += pages;
                if (live[n] > peak[n]) peak[n] = live[n];
            }
    }
}

/* Pools sized from the measured peak, not from every save (1F1B keeps a
 * few microbatches in flight), and the report's device-page peak is the
 * pages the sized step used, not the capacity: both against model_peaks. */
static void pool_sizing(mst_ctx_t* ctx, const mst_mlp_config* mlp, mst_rng* rng) {
    int32_t* a = (int32_t*)malloc(sizeof(int32_t) * L * M * E);
    random_counts(rng, a, 0.8);
    int64_t rows[M];
    for (int mb = 0; mb < M; mb++) {
        rows[mb] = 0;
        for (int g = 0; g < E; g++) rows[mb] += a[(int64_t)mb * E + g]; /* layer 0; every layer alike */
    }
    const mst_schedule_config scheds[] = {
        {sizeof(mst_schedule_config), MST_SCHEDULE_1F1B, 4, 3, M, 1},        /* last stage: one microbatch in flight */
        {sizeof(mst_schedule_config), MST_SCHEDULE_1F1B, 4, 2, M, 1},        /* two */
        {sizeof(mst_schedule_config), MST_SCHEDULE_INTERLEAVED, 2, 1, M, 2}, /* two chunks */
    };
    for (size_t si = 0; si < sizeof scheds / sizeof scheds[0]; si++) {
        mst_stack stack, *s = &stack;
        CHECK_OK(mst_stack_create(ctx, mlp, L, M, scheds[si].virtual_stages, R, 5, s));
        const int n_sch = 2 * M * scheds[si].virtual_stages;
        mst_sched_entry sch[2 * M * 2];
        CHECK_OK(mst_schedule_make(&scheds[si], sch, n_sch));
        int64_t peak[MST_N_SAVED], sum[MST_N_SAVED];
        model_peaks(sch, n_sch, scheds[si].virtual_stages, rows, peak, sum);
        setup su = {"stash", scheds[si], "stash", NULL, 0, 0, MST_STREAM_MAIN, 0};
        int ov;
        mst_mem_report_t r = MST_MEM_REPORT_INIT;
        grads g = run_setup(ctx, s, &su, a, a, &ov, &r);
        CHECK(!ov, "schedule %zu overflowed on the counts it was sized with", si);
        size_t want_cap = 0, want_peak = 0, all_saves = 0;
        for (int n = 0; n < MST_N_SAVED; n++) {
            const size_t page_bytes = (size_t)PAGE * saved_row_bytes[n];
            want_cap += (size_t)ceil((double)peak[n] * 1.10) * page_bytes;
            want_peak += (size_t)peak[n] * page_bytes;
            all_saves += (size_t)sum[n] * page_bytes;
        }
        CHECK(2 * all_saves > 3 * want_peak, "schedule %zu: every save %zu bytes, peak %zu: not a test of the peak", si,
              all_saves, want_peak);
        CHECK(r.dev_pages_bytes == want_cap, "schedule %zu: device pages of %zu bytes, want ceil(peak x 1.10) = %zu "
              "(every save: %zu)", si, r.dev_pages_bytes, want_cap, all_saves);
        CHECK(r.dev_pages_peak_bytes == want_peak, "schedule %zu: device pages at peak %zu bytes, want %zu (capacity %zu)",
              si, r.dev_pages_peak_bytes, want_peak, r.dev_pages_bytes);
        free(g.g);
        mst_stack_destroy(s);
    }
    free(a);
}

/* A schedule that lists a microbatch's steps out of order is refused at
 * create, naming the entry: two chunks (V = 2), so that chunk 0's own order
 * (which mst_schedule_sets checks too) stays right while chunk 1's backward
 * comes before its forward, or the microbatch's backward of chunk 0 comes
 * before its forward of chunk 1. Each from a valid interleaved schedule with
 * two entries swapped. */
static void schedule_order(mst_ctx_t* ctx) {
    const int32_t M = 2, V = 2, n = 2 * M * V;
    mst_schedule_config sc = MST_SCHEDULE_CONFIG_INIT;
    sc.kind = MST_SCHEDULE_INTERLEAVED, sc.stages = 1, sc.microbatches = M, sc.virtual_stages = V;
    mst_sched_entry good[8], bad[8];
    CHECK_OK(mst_schedule_make(&sc, good, n));
    mst_memmgr_config mc = MST_MEMMGR_CONFIG_INIT;
    mc.n_layers = 4, mc.n_microbatches = M, mc.virtual_stages = V, mc.max_rows = 64, mc.hidden = 16, mc.ffn = 8;
    mc.n_schedule = n;
    mst_memmgr_t* m = NULL;
    mc.schedule = good;
    CHECK_OK(mst_memmgr_create(ctx, &mc, &m));
    mst_memmgr_destroy(m);
    /* two entries of the valid schedule, swapped; the message of the first */
    const struct { mst_sched_entry a, b; const char* msg; } cases[] = {
        {{0, 1, 0}, {1, 1, 0}, "backward of (chunk 1, mb 0) before the forward of (chunk 1, mb 0)"},
        {{0, 1, 1}, {1, 0, 1}, "backward of (chunk 0, mb 1) before the forward of (chunk 1, mb 1)"},
        {{0, 1, 0}, {0, 0, 0}, "forward of (chunk 1, mb 0) out of order"},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        memcpy(bad, good, sizeof good);
        int ia = -1, ib = -1;
        for (int i = 0; i < n; i++) {
            if (!memcmp(&bad[i], &cases[c].a, sizeof bad[i])) ia = i;
            if (!memcmp(&bad[i], &cases[c].b, sizeof bad[i])) ib = i;
        }
        CHECK(ia >= 0 && ib >= 0, "case %zu: entries not in the schedule", c);
        if (ia < 0 || ib < 0) continue;
        mst_sched_entry t = bad[ia];
        bad[ia] = bad[ib], bad[ib] = t;
        const int first = ia < ib ? ia : ib;
        mc.schedule = bad;
        m = NULL;
        CHECK_STATUS(mst_memmgr_create(ctx, &mc, &m), MST_ERR_INVALID);
        CHECK(m == NULL, "case %zu: a refused create returned a manager", c);
        char at[32];
        snprintf(at, sizeof at, "schedule[%d]", first);
        CHECK(strstr(mst_last_error(), at) && strstr(mst_last_error(), cases[c].msg),
              "case %zu: message '%s' should name %s and say '%s'", c, mst_last_error(), at, cases[c].msg);
    }
}

/* The per-layer policy table: each layer its own mix (layer l stashes name
 * l % 4 and offloads name (l + 1) % 4, the rest kept), so that a policy
 * applied to another layer changes what some (layer, name) gets. KEEP's
 * buffer of (layer, mb, name) exists exactly when that layer keeps that name
 * (mst_memmgr_keep_buffer), and the forward saver hands it out (produce);
 * any other policy gets the name's compute buffer, shared by the layers. */
static void policy_table(mst_ctx_t* ctx) {
    const int32_t NL = 6, NM = 2;
    mst_schedule_config sc = MST_SCHEDULE_CONFIG_INIT;
    sc.kind = MST_SCHEDULE_PLAIN, sc.stages = 1, sc.microbatches = NM, sc.virtual_stages = 1;
    mst_sched_entry sch[4];
    CHECK_OK(mst_schedule_make(&sc, sch, 2 * NM));
    mst_memmgr_config mc = MST_MEMMGR_CONFIG_INIT;
    mc.n_layers = NL, mc.n_microbatches = NM, mc.virtual_stages = 1, mc.max_rows = 64, mc.hidden = 16, mc.ffn = 8;
    mc.schedule = sch, mc.n_schedule = 2 * NM;
    mst_memmgr_t* m = NULL;
    CHECK_OK(mst_memmgr_create(ctx, &mc, &m));
    mst_policy want[6][MST_N_SAVED];
    for (int32_t l = 0; l < NL; l++)
        for (int n = 0; n < MST_N_SAVED; n++) {
            want[l][n] = n == l % 4 ? MST_POLICY_STASH : n == (l + 1) % 4 ? MST_POLICY_OFFLOAD : MST_POLICY_KEEP;
            CHECK_OK(mst_memmgr_set_policy(m, l, (mst_saved_name)n, want[l][n]));
        }
    void* compute[MST_N_SAVED] = {0};
    CHECK_OK(mst_memmgr_step_begin(m, 1));
    for (int32_t mb = 0; mb < NM; mb++)
        for (int32_t l = 0; l < NL; l++) {
            const mst_saver* sv = NULL;
            CHECK_OK(mst_memmgr_forward(m, l, mb, &sv));
            for (int n = 0; n < MST_N_SAVED; n++) {
                const mst_saved_name nm = (mst_saved_name)n;
                int64_t cols;
                mst_dtype dt;
                CHECK_OK(mst_saved_shape(nm, mc.hidden, mc.ffn, &cols, &dt));
                mst_tensor kb, got;
                CHECK_OK(mst_memmgr_keep_buffer(m, l, mb, nm, &kb));
                CHECK_OK(sv->produce(sv->self, nm, mc.max_rows, cols, dt, &got));
                const int keep = want[l][n] == MST_POLICY_KEEP;
                CHECK((kb.data != NULL) == keep, "layer %d mb %d %s (%s): keep buffer %s", l, mb,
                      mst_saved_name_str(nm), mst_policy_str(want[l][n]), kb.data ? "given" : "absent");
                if (keep) {
                    CHECK(got.data == kb.data, "layer %d mb %d %s: produce did not hand out its keep buffer", l, mb,
                          mst_saved_name_str(nm));
                    continue;
                }
                if (!compute[n]) compute[n] = got.data;
                CHECK(got.data && got.data == compute[n], "layer %d mb %d %s (%s): produce gave %p, not the shared "
                      "compute buffer %p", l, mb, mst_saved_name_str(nm), mst_policy_str(want[l][n]), got.data,
                      compute[n]);
            }
        }
    mst_memmgr_destroy(m);
}

static void bad_input(mst_ctx_t* ctx) {
    mst_schedule_config sc = {sizeof(mst_schedule_config), MST_SCHEDULE_1F1B, 2, 0, 2, 1};
    mst_sched_entry sch[4];
    CHECK_OK(mst_schedule_make(&sc, sch, 4));
    mst_memmgr_config mc = {sizeof(mst_memmgr_config), 2, 2, 1, 64, 16, 8, sch, 4, 16, 0, 0, NULL, NULL};
    mst_memmgr_t* m = NULL;
    mc.n_schedule = 3;
    CHECK_STATUS(mst_memmgr_create(ctx, &mc, &m), MST_ERR_INVALID);
    mc.n_schedule = 4;
    mc.virtual_stages = 3; /* does not divide 2 layers */
    CHECK_STATUS(mst_memmgr_create(ctx, &mc, &m), MST_ERR_INVALID);
    mc.virtual_stages = 1;
    mst_sched_entry swapped[4] = {{1, 0, 0}, {0, 0, 0}, {0, 0, 1}, {1, 0, 1}};
    mc.schedule = swapped;
    CHECK_STATUS(mst_memmgr_create(ctx, &mc, &m), MST_ERR_INVALID);
    mc.schedule = sch;
    schedule_order(ctx);
    CHECK_OK(mst_memmgr_create(ctx, &mc, &m));
    CHECK_STATUS(mst_memmgr_set_policy_spec(m, "fc3_input=stash"), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "fc3_input") != NULL, "message names fc3_input: %s", mst_last_error());
    CHECK_STATUS(mst_memmgr_set_policy_spec(m, "act_input=squash"), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "squash") != NULL, "message names squash: %s", mst_last_error());
    CHECK_STATUS(mst_memmgr_set_policy(m, 0, MST_SAVED_PROBS, MST_POLICY_STASH_FP8), MST_ERR_INVALID);
    CHECK_MESSAGE("probs is fp32");
    CHECK_STATUS(mst_memmgr_set_policy(m, 0, MST_SAVED_ACT_INPUT, (mst_policy)(MST_POLICY_FP8 | MST_POLICY_KEEP)),
                 MST_ERR_INVALID);
    CHECK_STATUS(mst_memmgr_set_policy(m, 0, MST_SAVED_ACT_INPUT, MST_POLICY_RECOMPUTE), MST_ERR_INVALID);
    CHECK_STATUS(mst_memmgr_set_policy(m, 5, MST_SAVED_ACT_INPUT, MST_POLICY_KEEP), MST_ERR_INVALID);
    mst_recompute_config rc = {sizeof(mst_recompute_config), MST_RECOMPUTE_BLOCK, 3};
    CHECK_STATUS(mst_memmgr_set_recompute(m, &rc), MST_ERR_INVALID);
    mst_tensor kb;
    CHECK_STATUS(mst_memmgr_keep_buffer(m, 2, 0, MST_SAVED_FC1_INPUT, &kb), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "layer = 2") != NULL, "message names the layer: %s", mst_last_error());
    CHECK_STATUS(mst_memmgr_keep_buffer(m, 1, -1, MST_SAVED_FC1_INPUT, &kb), MST_ERR_INVALID);
    CHECK_OK(mst_memmgr_set_policy(m, 1, MST_SAVED_FC1_INPUT, MST_POLICY_STASH));
    CHECK_OK(mst_memmgr_keep_buffer(m, 1, 0, MST_SAVED_FC1_INPUT, &kb));
    CHECK(kb.data == NULL, "a stashed fc1_input has no keep buffer");
    CHECK_OK(mst_memmgr_set_policy(m, 1, MST_SAVED_FC1_INPUT, MST_POLICY_KEEP));
    CHECK_OK(mst_memmgr_keep_buffer(m, 1, 0, MST_SAVED_FC1_INPUT, &kb));
    CHECK(kb.data != NULL && kb.rows == 64 && kb.cols == 16, "keep buffer [%lld, %lld]", (long long)kb.rows,
          (long long)kb.cols);
    CHECK_STATUS(mst_memmgr_step_begin(m, 0), MST_ERR_STATE); /* first step must measure */
    CHECK_OK(mst_memmgr_step_begin(m, 1));
    const mst_saver* sv;
    CHECK_STATUS(mst_memmgr_forward(m, 1, 0, &sv), MST_ERR_STATE); /* layer 0 comes first */
    CHECK(strstr(mst_last_error(), "schedule mismatch") != NULL, "%s", mst_last_error());
    CHECK_OK(mst_memmgr_forward(m, 0, 0, &sv));
    mst_tensor t;
    CHECK_STATUS(sv->fetch(sv->self, MST_SAVED_FC1_INPUT, &t), MST_ERR_STATE); /* not in a backward */
    CHECK_OK(mst_memmgr_forward(m, 1, 0, &sv));
    CHECK_OK(mst_memmgr_forward(m, 0, 1, &sv));
    CHECK_OK(mst_memmgr_forward(m, 1, 1, &sv));
    CHECK_OK(mst_memmgr_backward(m, 1, 0, &sv));
    CHECK_STATUS(sv->fetch(sv->self, MST_SAVED_ACT_INPUT, &t), MST_ERR_STATE); /* never saved */
    CHECK(strstr(mst_last_error(), "never saved") != NULL, "%s", mst_last_error());
    CHECK_STATUS(mst_memmgr_step_end(m), MST_ERR_STATE); /* the schedule is not done */
    mst_memmgr_destroy(m);
}

/* ---- sizing after a measuring step: growth, cfg.share_needs ---- */

/* share_needs of the tests: logs the needs it is given, then multiplies them
 * by `scale` (another rank that needed more). */
/* The needs of each name: pages of its STASH, OFFLOAD, STASH_FP8 and
 * OFFLOAD_FP8 pools. */
enum { KINDS = 4 };

typedef struct share_log {
    int calls;
    int32_t n;
    int64_t seen[1 + KINDS * MST_N_SAVED];
    int64_t scale;
} share_log;

static mst_status share_scaled(void* user, int64_t* needs, int32_t n) {
    share_log* g = (share_log*)user;
    g->calls++;
    g->n = n;
    for (int32_t i = 0; i < n && i < 1 + KINDS * MST_N_SAVED; i++) g->seen[i] = needs[i], needs[i] *= g->scale;
    return MST_OK;
}

/* A STASH manager of 1F1B on one stage into s->mm, sharing needs through
 * share (NULL: none). */
static void stash_mm(mst_ctx_t* ctx, mst_stack* s, const mst_sched_entry* sch, int n, share_log* share) {
    mst_memmgr_config mc = {sizeof(mst_memmgr_config), L, M, 1, R, H, F, sch, n, PAGE, 1.10, 0, share ? share_scaled : NULL, share};
    CHECK_OK(mst_memmgr_create(ctx, &mc, &s->mm));
    CHECK_OK(mst_memmgr_set_policy_spec(s->mm, "stash"));
}

static size_t dev_pages_bytes(const mst_memmgr_t* mm) {
    mst_mem_report_t r = MST_MEM_REPORT_INIT;
    CHECK_OK(mst_mem_report(mm, &r));
    return r.dev_pages_bytes;
}

static void measure(mst_stack* s, const int32_t* counts, const mst_sched_entry* sch, int n) {
    CHECK_OK(mst_stack_route(s, counts, 11));
    CHECK_OK(mst_stack_step(s, sch, n, 1));
    CHECK_OK(mst_memmgr_step_check(s->mm));
}

/* Pools a measuring step finds short grow by half at least (the load grew
 * by 30 %: sized from the new peak alone they would grow by 30 %), and a
 * later measuring step on lighter routing does not shrink them. The rerun
 * after the overflow peaks about as high as a fresh manager's first
 * measuring step on the same routing: it holds no pools while it measures. */
static void pool_growth(mst_ctx_t* ctx, mst_stack* s, mst_rng* rng) {
    int32_t light[L * M * E], heavier[L * M * E];
    random_counts(rng, light, 0.3);
    for (int l = 0; l < L; l++) /* every count 30 % up; each (layer, mb) the same total, as route wants */
        for (int mb = 0; mb < M; mb++) {
            int32_t *c = heavier + ((int64_t)l * M + mb) * E, total = 0, got = 0;
            for (int g = 0; g < E; g++) total += light[mb * E + g]; /* layer 0's total */
            for (int g = 0; g < E; g++) got += c[g] = light[((int64_t)l * M + mb) * E + g] * 13 / 10;
            c[0] += (total * 13 + 9) / 10 - got;
        }
    const mst_schedule_config sc = {sizeof(mst_schedule_config), MST_SCHEDULE_1F1B, 4, 0, M, 1};
    mst_sched_entry sch[2 * M];
    CHECK_OK(mst_schedule_make(&sc, sch, 2 * M));
    stash_mm(ctx, s, sch, 2 * M, NULL);
    measure(s, light, sch, 2 * M);
    const size_t before = dev_pages_bytes(s->mm);
    CHECK_OK(mst_stack_route(s, heavier, 22));
    CHECK_OK(sized_step(ctx, s, sch, 2 * M));
    CHECK_STATUS(mst_memmgr_step_check(s->mm), MST_ERR_OVERFLOW);
    size_t in_use, rerun_peak, fresh_peak;
    mst_ctx_mem_reset_peak(ctx);
    CHECK_OK(mst_stack_step(s, sch, 2 * M, 1)); /* the rerun, measuring */
    CHECK_OK(mst_memmgr_step_check(s->mm));
    mst_ctx_mem(ctx, &in_use, &rerun_peak);
    const size_t after = dev_pages_bytes(s->mm);
    CHECK(2 * after >= 3 * before, "pools of %zu bytes found short grew to %zu: less than half again", before, after);
    measure(s, light, sch, 2 * M);
    CHECK(dev_pages_bytes(s->mm) == after, "a measuring step on light routing resized %zu bytes of pools to %zu",
          after, dev_pages_bytes(s->mm));
    CHECK_OK(mst_memmgr_check(s->mm));
    mst_memmgr_destroy(s->mm);
    stash_mm(ctx, s, sch, 2 * M, NULL);
    CHECK_OK(mst_stack_route(s, heavier, 22));
    mst_ctx_mem_reset_peak(ctx);
    CHECK_OK(mst_stack_step(s, sch, 2 * M, 1));
    mst_ctx_mem(ctx, &in_use, &fresh_peak);
    /* the two differ by when buffers that both keep are first allocated
     * (tens of KiB here); holding the pools adds all of `before` */
    CHECK(rerun_peak < fresh_peak + before / 2, "the rerun after an overflow peaked at %zu bytes, a first measuring "
          "step at %zu: it held the pools it outgrew (%zu bytes)", rerun_peak, fresh_peak, before);
    mst_memmgr_destroy(s->mm);
    s->mm = NULL;
}

/* cfg.share_needs gets the largest saved rows and every pool's peak pages
 * as the test's own page model counts them, once per measuring step, and
 * what it returns sizes the pools. */
static void shared_needs(mst_ctx_t* ctx, mst_stack* s, mst_rng* rng) {
    int32_t a[L * M * E];
    random_counts(rng, a, 0.6);
    int64_t rows[M], peak[MST_N_SAVED], sum[MST_N_SAVED], most = 0;
    for (int mb = 0; mb < M; mb++) {
        rows[mb] = 0;
        for (int g = 0; g < E; g++) rows[mb] += a[(int64_t)mb * E + g]; /* layer 0; every layer alike */
        most = rows[mb] > most ? rows[mb] : most;
    }
    const mst_schedule_config sc = {sizeof(mst_schedule_config), MST_SCHEDULE_1F1B, 4, 0, M, 1};
    mst_sched_entry sch[2 * M];
    CHECK_OK(mst_schedule_make(&sc, sch, 2 * M));
    model_peaks(sch, 2 * M, 1, rows, peak, sum);
    for (int64_t scale = 1; scale <= 3; scale += 2) {
        share_log lg = {.scale = scale};
        stash_mm(ctx, s, sch, 2 * M, &lg);
        measure(s, a, sch, 2 * M);
        CHECK(lg.calls == 1 && lg.n == 1 + KINDS * MST_N_SAVED, "share_needs: %d calls of %d needs, want 1 of %d",
              lg.calls, lg.n, 1 + KINDS * MST_N_SAVED);
        CHECK(lg.seen[0] == most, "share_needs saw %lld saved rows, want %lld", (long long)lg.seen[0], (long long)most);
        size_t want = 0;
        for (int n = 0; n < MST_N_SAVED; n++) {
            const int64_t* k = &lg.seen[1 + KINDS * n];
            CHECK(k[0] == peak[n] && k[1] == 0 && k[2] == 0 && k[3] == 0,
                  "share_needs saw %lld / %lld / %lld / %lld pages of %s, want %lld / 0 / 0 / 0", (long long)k[0],
                  (long long)k[1], (long long)k[2], (long long)k[3], mst_saved_name_str((mst_saved_name)n),
                  (long long)peak[n]);
            want += (size_t)ceil((double)(peak[n] * scale) * 1.10) * PAGE * saved_row_bytes[n];
        }
        CHECK(dev_pages_bytes(s->mm) == want, "needs x %lld: pools of %zu bytes, want ceil(%lld peak x 1.10) = %zu",
              (long long)scale, dev_pages_bytes(s->mm), (long long)scale, want);
        mst_memmgr_destroy(s->mm);
        s->mm = NULL;
    }
}

/* The first claim of a layer call takes the pages of every name it produced
 * that is read in place, in one batch with the saves queued before it: a
 * later claim of such a name hands out its own pages; a second claim of it
 * is an error, and so is a name taken that way and committed without having
 * been asked for (its pages would hold nothing), the message naming it.
 * act_input is always read in place; fc2_input where mst_memmgr_reads_pages
 * says so (the CPU always; CUDA's Hopper wgrad with pages of 2^k >= 64 rows,
 * hence pages of 64 here): otherwise its claim hands out nothing, is no
 * error twice, and its commit saves it as any other. */
static void claim_together(mst_ctx_t* ctx, mst_stack* s, mst_rng* rng) {
    enum { CLAIM_PAGE = 64 };
    mst_schedule_config sc = {sizeof(mst_schedule_config), MST_SCHEDULE_PLAIN, 1, 0, M, 1};
    mst_sched_entry sch[2 * M];
    CHECK_OK(mst_schedule_make(&sc, sch, 2 * M));
    mst_memmgr_config mc = {sizeof(mst_memmgr_config), L, M, 1, R, H, F, sch, 2 * M, CLAIM_PAGE, 1.10, 0, NULL, NULL};
    CHECK_OK(mst_memmgr_create(ctx, &mc, &s->mm));
    CHECK_OK(mst_memmgr_set_policy_spec(s->mm, "stash"));
    const int fc2_paged = mst_memmgr_reads_pages(s->mm, MST_SAVED_FC2_INPUT);
    CHECK(mst_memmgr_reads_pages(s->mm, MST_SAVED_ACT_INPUT), "act_input not read in place");
    CHECK(fc2_paged || mst_ctx_backend(ctx) != MST_BACKEND_CPU, "the CPU does not read fc2_input in place");
    int32_t counts[L * M * E];
    random_counts(rng, counts, 0.8);
    CHECK_OK(mst_stack_route(s, counts, 33));
    CHECK_OK(mst_stack_step(s, sch, 2 * M, 1));
    CHECK_OK(mst_memmgr_step_check(s->mm));
    CHECK_OK(mst_memmgr_step_begin(s->mm, 0));
    for (int32_t l = 0; l < 2; l++) {
        const mst_saver* sv;
        mst_tensor h, z;
        mst_pages ph, pz;
        const mst_tensor* tc = &s->counts[l * M];
        CHECK_OK(mst_memmgr_forward(s->mm, l, 0, &sv));
        CHECK_OK(sv->produce(sv->self, MST_SAVED_ACT_INPUT, R, 2 * F, MST_DTYPE_BF16, &h));
        CHECK_OK(sv->produce(sv->self, MST_SAVED_FC2_INPUT, R, F, MST_DTYPE_BF16, &z));
        CHECK_OK(sv->commit(sv->self, MST_SAVED_FC1_INPUT, &s->io[0], tc));
        CHECK_OK(sv->commit(sv->self, MST_SAVED_PROBS, &s->probs[l * M], tc));
        CHECK_OK(sv->claim(sv->self, MST_SAVED_ACT_INPUT, tc, &ph));
        CHECK(ph.table != NULL, "layer %d: act_input not claimed", l);
        if (l == 0) {
            CHECK_OK(sv->claim(sv->self, MST_SAVED_FC2_INPUT, tc, &pz));
            if (fc2_paged) {
                CHECK(pz.table != NULL && pz.table != ph.table, "layer 0: fc2_input's pages not handed out");
                CHECK_STATUS(sv->claim(sv->self, MST_SAVED_FC2_INPUT, tc, &pz), MST_ERR_STATE);
            } else {
                CHECK(pz.table == NULL, "layer 0: fc2_input, not read in place, handed out pages");
                CHECK_OK(sv->claim(sv->self, MST_SAVED_FC2_INPUT, tc, &pz));
            }
            CHECK_OK(sv->commit(sv->self, MST_SAVED_ACT_INPUT, &h, tc));
            CHECK_OK(sv->commit(sv->self, MST_SAVED_FC2_INPUT, &z, tc));
        } else if (fc2_paged) { /* fc2_input taken with act_input, never asked for */
            CHECK_OK(sv->commit(sv->self, MST_SAVED_ACT_INPUT, &h, tc));
            CHECK_STATUS(sv->commit(sv->self, MST_SAVED_FC2_INPUT, &z, tc), MST_ERR_STATE);
            CHECK(strstr(mst_last_error(), "fc2_input of (layer 1, mb 0)") != NULL &&
                      strstr(mst_last_error(), "never handed out") != NULL, "message: %s", mst_last_error());
        } else { /* not taken with act_input: saved from its buffer */
            CHECK_OK(sv->commit(sv->self, MST_SAVED_ACT_INPUT, &h, tc));
            CHECK_OK(sv->commit(sv->self, MST_SAVED_FC2_INPUT, &z, tc));
        }
    }
    const mst_saver* next;
    CHECK_OK(mst_memmgr_forward(s->mm, 2, 0, &next)); /* launches layer 1's saves */
    CHECK_OK(mst_memmgr_step_check(s->mm));            /* no pool ran out: every claim and save took pages */
    mst_memmgr_destroy(s->mm);
    s->mm = NULL;
}

static void run(mst_ctx_t* ctx) {
    mst_rng rng = {77};
    mst_mlp_config mlp = mst_mlp_config_default(E, H, F);
    mst_stack s;
    CHECK_OK(mst_stack_create(ctx, &mlp, L, M, 1, R, 5, &s));
    pool_sizing(ctx, &mlp, &rng);
    overflow_rerun(ctx, &s, &rng);
    pool_growth(ctx, &s, &rng);
    shared_needs(ctx, &s, &rng);
    host_spill(ctx, &s, &rng);
    claim_together(ctx, &s, &rng);
    mst_stack_destroy(&s);
    policies_and_schedules(ctx, &mlp, &rng, MST_STREAM_MAIN, 0);
    /* each stream slowed in turn: on CUDA a spin of about 0.6 ms; on the CPU
       a side stream deferred (main cannot lag there) */
    const int cuda = mst_ctx_backend(ctx) == MST_BACKEND_CUDA;
    for (mst_stream_sel sel = cuda ? MST_STREAM_MAIN : MST_STREAM_RING; sel < MST_N_STREAMS; sel++)
        policies_and_schedules(ctx, &mlp, &rng, sel, cuda ? (int64_t)1 << 20 : 1);
    bad_input(ctx);
    policy_table(ctx);
    policy_specs();
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
