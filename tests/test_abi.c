/*
 * test_abi.c — the struct sizes of moestash.h (its "struct sizes" section):
 * every struct that may grow is refused by each function that reads or fills
 * it when its struct_size is not the size this library knows: 0 (never
 * initialized), a shorter struct (an older header; allocated with exactly
 * that many bytes, so that a read past it is an error under ASan), a longer
 * one and the first 8 bytes of a struct of a header without struct_size (two
 * int32 fields). MST_ERR_INVALID, the message naming the argument, the
 * struct, the size given, the size known and the initializer; nothing written
 * into a refused output. The sizes each initializer sets pass.
 */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

/* The bad sizes of a struct of `want` bytes. */
static int bad_sizes(size_t want, size_t out[4]) {
    out[0] = 0;
    out[1] = want - 8;
    out[2] = want + 8;
    out[3] = ((size_t)4 << 32) | 2; /* {int32 2, int32 4}: a struct of 0.1 */
    return 4;
}

/* A struct of `size` bytes, exactly that many when the size is below the
 * real one (but at least its struct_size field): random bytes after
 * struct_size. */
static void* make_struct(mst_rng* rng, size_t size, size_t real) {
    size_t n = size < real ? size : real;
    if (n < sizeof size) n = sizeof size;
    unsigned char* p = (unsigned char*)malloc(n);
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)mst_rng_next(rng);
    memcpy(p, &size, sizeof size);
    return p;
}

static void expect_refused(mst_status st, const char* arg, const char* type, size_t got, size_t want,
                           const char* init) {
    CHECK(st == MST_ERR_INVALID, "%s (%s) with struct_size %zu: status %s, expected invalid argument", arg, type,
          got, mst_status_str(st));
    char size_got[64], size_want[64], arg_type[128];
    snprintf(size_got, sizeof size_got, "struct_size %zu", got);
    snprintf(size_want, sizeof size_want, "knows %zu", want);
    snprintf(arg_type, sizeof arg_type, "%s (%s)", arg, type);
    const char* msg = mst_last_error();
    CHECK(strstr(msg, arg_type) && strstr(msg, size_got) && strstr(msg, size_want) && strstr(msg, init),
          "message '%s' should name '%s', '%s', '%s' and %s", msg, arg_type, size_got, size_want, init);
}

/* Each function of a struct T: `call` run with p, a T* of each bad size. */
#define EACH_BAD_SIZE(T, arg, init, call)                                      \
    do {                                                                       \
        size_t sizes_[4];                                                      \
        for (int i_ = 0, n_ = bad_sizes(sizeof(T), sizes_); i_ < n_; i_++) {   \
            T* p = (T*)make_struct(rng, sizes_[i_], sizeof(T));                \
            expect_refused((call), arg, #T, sizes_[i_], sizeof(T), init);      \
            free(p);                                                           \
        }                                                                      \
    } while (0)

static void configs(mst_ctx_t* ctx, mst_rng* rng) {
    mst_sched_entry sched[4];
    mst_schedule_config sc = MST_SCHEDULE_CONFIG_INIT;
    sc.kind = MST_SCHEDULE_1F1B, sc.stages = 1, sc.microbatches = 2, sc.virtual_stages = 1;
    CHECK_OK(mst_schedule_make(&sc, sched, 4));
    EACH_BAD_SIZE(mst_schedule_config, "cfg", "MST_SCHEDULE_CONFIG_INIT", mst_schedule_make(p, sched, 4));

    mst_memmgr_config mc = MST_MEMMGR_CONFIG_INIT;
    mc.n_layers = 2, mc.n_microbatches = 2, mc.virtual_stages = 1, mc.max_rows = 64, mc.hidden = 16, mc.ffn = 8;
    mc.schedule = sched, mc.n_schedule = 4;
    mst_memmgr_t* m = NULL;
    EACH_BAD_SIZE(mst_memmgr_config, "cfg", "MST_MEMMGR_CONFIG_INIT", mst_memmgr_create(ctx, p, &m));
    CHECK(m == NULL, "a refused memmgr_create returned a manager");
    CHECK_OK(mst_memmgr_create(ctx, &mc, &m));

    mst_recompute_config rc = MST_RECOMPUTE_CONFIG_INIT;
    CHECK_OK(mst_recompute_parse("block:1", &rc));
    CHECK(rc.struct_size == sizeof rc && rc.method == MST_RECOMPUTE_BLOCK, "recompute_parse block:1");
    EACH_BAD_SIZE(mst_recompute_config, "out", "MST_RECOMPUTE_CONFIG_INIT", mst_recompute_parse("uniform:1", p));
    EACH_BAD_SIZE(mst_recompute_config, "cfg", "MST_RECOMPUTE_CONFIG_INIT", mst_memmgr_set_recompute(m, p));
    CHECK_OK(mst_memmgr_set_recompute(m, &rc));

    /* a report: refused sizes leave every byte of the caller's struct as it was */
    mst_mem_report_t rep = MST_MEM_REPORT_INIT;
    CHECK_OK(mst_mem_report(m, &rep));
    CHECK(rep.struct_size == sizeof rep, "mem_report wrote struct_size %zu", rep.struct_size);
    size_t sizes[4];
    for (int i = 0, n = bad_sizes(sizeof rep, sizes); i < n; i++) {
        unsigned char buf[sizeof(mst_mem_report_t)], before[sizeof buf];
        for (size_t b = 0; b < sizeof buf; b++) buf[b] = (unsigned char)mst_rng_next(rng);
        memcpy(buf, &sizes[i], sizeof sizes[i]);
        memcpy(before, buf, sizeof buf);
        expect_refused(mst_mem_report(m, (mst_mem_report_t*)(void*)buf), "out", "mst_mem_report_t", sizes[i],
                       sizeof rep, "MST_MEM_REPORT_INIT");
        CHECK(memcmp(buf, before, sizeof buf) == 0, "a refused mem_report wrote into its output");
    }
    EACH_BAD_SIZE(mst_mem_report_t, "out", "MST_MEM_REPORT_INIT", mst_mem_report(m, p));
    mst_memmgr_destroy(m);
}

static void pools(mst_ctx_t* ctx, mst_rng* rng) {
    mst_pool_config pc = mst_pool_config_default(4);
    CHECK(pc.struct_size == sizeof pc, "pool_config_default: struct_size %zu", pc.struct_size);
    mst_pool_t* pool = NULL;
    EACH_BAD_SIZE(mst_pool_config, "cfg", "MST_POOL_CONFIG_INIT", mst_pool_create(ctx, MST_DTYPE_BF16, 16, p, &pool));
    CHECK(pool == NULL, "a refused pool_create returned a pool");
    CHECK_OK(mst_pool_create(ctx, MST_DTYPE_BF16, 16, &pc, &pool));
    mst_pool_stats st = MST_POOL_STATS_INIT;
    CHECK_OK(mst_pool_stats_get(pool, &st));
    CHECK(st.struct_size == sizeof st && st.n_dev_pages == 4, "pool_stats_get");
    EACH_BAD_SIZE(mst_pool_stats, "out", "MST_POOL_STATS_INIT", mst_pool_stats_get(pool, p));
    EACH_BAD_SIZE(mst_pool_stats, "measured", "MST_POOL_STATS_INIT", mst_pool_config_from_peak(p, 1.0, 0.0, &pc));
    EACH_BAD_SIZE(mst_pool_config, "out", "MST_POOL_CONFIG_INIT", mst_pool_config_from_peak(&st, 1.0, 0.0, p));
    CHECK_OK(mst_pool_config_from_peak(&st, 1.0, 0.0, &pc));
    mst_pool_destroy(pool);
}

static mst_status no_produce(void* self, mst_saved_name n, int64_t r, int64_t c, mst_dtype dt, mst_tensor* out) {
    (void)self, (void)n, (void)r, (void)c, (void)dt, (void)out;
    return MST_ERR_STATE; /* a saver of a refused size was called */
}

static void mlp(mst_ctx_t* ctx, mst_rng* rng) {
    mst_mlp_config cfg = mst_mlp_config_default(2, 16, 8);
    CHECK(cfg.struct_size == sizeof cfg, "mlp_config_default: struct_size %zu", cfg.struct_size);
    const mst_policy keep[MST_N_SAVED] = {MST_POLICY_KEEP, MST_POLICY_KEEP, MST_POLICY_KEEP, MST_POLICY_KEEP};
    mst_saver_basic_t* basic = NULL;
    EACH_BAD_SIZE(mst_mlp_config, "cfg", "MST_MLP_CONFIG_INIT", mst_saver_basic_create(ctx, 8, p, keep, &basic));
    const mst_tensor none = {0};
    EACH_BAD_SIZE(mst_mlp_config, "cfg", "MST_MLP_CONFIG_INIT",
                  mst_grouped_mlp_forward(ctx, p, NULL, &none, &none, &none, NULL, NULL));
    /* a saver of a refused size is refused before anything else of the call */
    for (int i = 0; i < 4; i++) {
        size_t sizes[4];
        bad_sizes(sizeof(mst_saver), sizes);
        mst_saver* s = (mst_saver*)make_struct(rng, sizes[i], sizeof(mst_saver));
        if (sizes[i] >= offsetof(mst_saver, commit)) s->produce = no_produce;
        expect_refused(mst_grouped_mlp_forward(ctx, &cfg, NULL, &none, &none, &none, s, NULL), "saver", "mst_saver",
                       sizes[i], sizeof(mst_saver), "MST_SAVER_INIT");
        expect_refused(mst_grouped_mlp_backward(ctx, &cfg, NULL, &none, &none, s, NULL, NULL, MST_WGRAD_OVERWRITE),
                       "saver", "mst_saver", sizes[i], sizeof(mst_saver), "MST_SAVER_INIT");
        free(s);
    }
    CHECK_OK(mst_saver_basic_create(ctx, 8, &cfg, keep, &basic));
    const mst_saver* sv = mst_saver_basic_get(basic);
    CHECK(sv->struct_size == sizeof *sv, "the basic saver's struct_size is %zu", sv->struct_size);
    mst_saver_basic_destroy(basic);
}

static void ep(mst_ctx_t* ctx, mst_rng* rng) {
    if (mst_ctx_backend(ctx) != MST_BACKEND_CPU) return; /* the CPU twin takes CPU contexts */
    mst_ep_group_t* g = NULL;
    CHECK_OK(mst_ep_group_create(1, &g));
    mst_ep_t* e = NULL;
    EACH_BAD_SIZE(mst_ep_config, "cfg", "MST_EP_CONFIG_INIT", mst_ep_create_local(ctx, p, g, 0, &e));
    CHECK(e == NULL, "a refused ep_create_local returned a communicator");
    mst_ep_config c = MST_EP_CONFIG_INIT;
    c.n_experts = 2, c.top_k = 1, c.hidden = 8, c.max_tokens = 4, c.max_rows = 8;
    CHECK_OK(mst_ep_create_local(ctx, &c, g, 0, &e));
    mst_ep_destroy(e);
    mst_ep_group_destroy(g);
}

static void run(mst_ctx_t* ctx) {
    mst_rng rng = {0xAB1u};
    configs(ctx, &rng);
    pools(ctx, &rng);
    mlp(ctx, &rng);
    ep(ctx, &rng);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
