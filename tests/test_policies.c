/*
 * test_policies.c — the typed path of a policy, from its spec to the memory
 * manager of a model.
 * The spec: every valid per-name assignment (fc2_input alone may be
 * recomputed) formatted by mst_policy_spec_format and parsed back by
 * mst_policy_spec_parse is itself; the short forms ("stash", "recompute")
 * where they apply; values that are not a policy of their name, and a
 * buffer too small, refused.
 * The model: its mst_mem_config.policy (one policy per name on every layer,
 * or the planner's per-layer table) is what its manager applies at each
 * (layer, name): a name is given a KEEP buffer exactly where the expected
 * policy, written here from the table, is KEEP.
 */
#include <string.h>

#include "harness.h"
#include "lib/internal.h"
#include "trainer/model/model.h"

#define K MST_POLICY_KEEP
#define S MST_POLICY_STASH
#define O MST_POLICY_OFFLOAD
#define R MST_POLICY_RECOMPUTE
#define SF MST_POLICY_STASH_FP8
#define OF MST_POLICY_OFFLOAD_FP8

/* Every valid assignment round-trips; the short forms; bad values refused. */
static void spec_format(void) {
    char s[MST_POLICY_SPEC_MAX];
    int n_valid = 0;
    static const mst_policy all[] = {K, S, O, R, SF, OF};
    for (int v = 0; v < 6 * 6 * 6 * 6; v++) {
        mst_policy p[MST_N_SAVED], q[MST_N_SAVED];
        int valid = 1;
        for (int n = 0, u = v; n < MST_N_SAVED; n++, u /= 6) {
            p[n] = all[u % 6];
            valid &= p[n] != MST_POLICY_RECOMPUTE || n == MST_SAVED_FC2_INPUT;
            valid &= !(p[n] & MST_POLICY_FP8) || n != MST_SAVED_PROBS; /* probs is fp32 */
        }
        memset(s, '#', sizeof s);
        if (!valid) {
            CHECK_STATUS(mst_policy_spec_format(p, s, sizeof s), MST_ERR_INVALID);
            continue;
        }
        n_valid++;
        CHECK_OK(mst_policy_spec_format(p, s, sizeof s));
        memset(q, 0xff, sizeof q);
        CHECK_OK(mst_policy_spec_parse(s, q));
        CHECK(memcmp(p, q, sizeof p) == 0, "'%s' parses to (%d %d %d %d), formatted from (%d %d %d %d)", s, q[0], q[1],
              q[2], q[3], p[0], p[1], p[2], p[3]);
    }
    CHECK(n_valid == 5 * 5 * 6 * 3, "%d valid assignments", n_valid);
    static const struct { mst_policy p[MST_N_SAVED]; const char* spec; } forms[] = {
        {{K, K, K, K}, "keep"}, {{S, S, S, S}, "stash"}, {{O, O, O, O}, "offload"}, {{K, K, R, K}, "recompute"},
        {{S, O, R, K}, "fc1_input=stash,act_input=offload,fc2_input=recompute,probs=keep"},
        {{K, S, K, K}, "fc1_input=keep,act_input=stash,fc2_input=keep,probs=keep"},
        {{SF, SF, SF, S}, "stash:fp8"}, {{OF, OF, OF, O}, "offload:fp8"},
        {{SF, S, R, S}, "fc1_input=stash:fp8,act_input=stash,fc2_input=recompute,probs=stash"},
        {{OF, SF, SF, K}, "fc1_input=offload:fp8,act_input=stash:fp8,fc2_input=stash:fp8,probs=keep"},
    };
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
        CHECK_OK(mst_policy_spec_format(forms[i].p, s, sizeof s));
        CHECK(strcmp(s, forms[i].spec) == 0, "formatted '%s', expected '%s'", s, forms[i].spec);
    }
    const mst_policy bad[MST_N_SAVED] = {K, (mst_policy)7, K, K};
    CHECK_STATUS(mst_policy_spec_format(bad, s, sizeof s), MST_ERR_INVALID);
    const mst_policy bad8[][MST_N_SAVED] = {{K, K, K, SF}, {MST_POLICY_FP8 | K, K, K, K}, {K, K, MST_POLICY_FP8 | R, K}};
    for (size_t i = 0; i < sizeof bad8 / sizeof bad8[0]; i++)
        CHECK_STATUS(mst_policy_spec_format(bad8[i], s, sizeof s), MST_ERR_INVALID);
    mst_policy q[MST_N_SAVED];
    static const char* const bad_specs[] = {"probs=stash:fp8", "stash:fp9", "keep:fp8", "recompute:fp8",
                                            "fc1_input=stash:", "fc1_input=:fp8"};
    for (size_t i = 0; i < sizeof bad_specs / sizeof bad_specs[0]; i++) {
        CHECK_STATUS(mst_policy_spec_parse(bad_specs[i], q), MST_ERR_INVALID);
        CHECK(strstr(mst_last_error(), bad_specs[i]) || strstr(mst_last_error(), strchr(bad_specs[i], '=') ?
              strchr(bad_specs[i], '=') + 1 : bad_specs[i]), "'%s' refused with '%s'", bad_specs[i], mst_last_error());
    }
    CHECK_OK(mst_policy_spec_parse("act_input=stash:bf16,fc1_input=offload:bf16", q));
    CHECK(q[0] == O && q[1] == S && q[2] == K && q[3] == K, "':bf16' is the plain policy");
    CHECK(mst_policy_base(OF) == O && mst_policy_base(SF) == S && mst_policy_valid(SF) &&
          !mst_policy_valid((mst_policy)(MST_POLICY_FP8 | R)), "mst_policy_base, mst_policy_valid");
    CHECK_STATUS(mst_policy_spec_format(forms[4].p, s, 20), MST_ERR_INVALID);
    CHECK_STATUS(mst_policy_spec_format(forms[4].p, NULL, sizeof s), MST_ERR_INVALID);
}

static mst_model_config tiny(void) {
    mst_model_config m = {.vocab = 64, .hidden = 32, .ffn = 16, .n_head = 2, .n_kv_head = 1, .head_dim = 16,
                          .rope_theta = 10000.0f, .norm_topk_prob = 1, .tie_embeddings = 1, .seq = 8, .batch = 2,
                          .layers = 3, .experts = 4, .top_k = 2, .ep = 2, .capacity_factor = 2.0f,
                          .mtp_weight = 0.3f, .aux_coef = 0.01f, .norm_eps = 1e-5f, .init_std = 0.02f, .seed = 3};
    return m;
}

/* A model under mem: at each (layer, name) of its L+1 layers a KEEP buffer
 * exactly where want[layer][name] is KEEP. */
static void applies(mst_ctx_t* ctx, const mst_mem_config* mem, const mst_policy want[][MST_N_SAVED], const char* what) {
    const mst_model_config c = tiny();
    mst_model* m = NULL;
    CHECK_OK(mst_model_create(ctx, &c, 1, mem, &m));
    if (!m) return;
    for (int32_t l = 0; l <= c.layers; l++)
        for (int n = 0; n < MST_N_SAVED; n++) {
            mst_tensor t;
            CHECK_OK(mst_memmgr_keep_buffer(m->mm, l, 0, (mst_saved_name)n, &t));
            CHECK((t.data != NULL) == (want[l][n] == MST_POLICY_KEEP), "%s: layer %d, %s: policy %s, a KEEP buffer %s",
                  what, l, mst_saved_name_str((mst_saved_name)n), mst_policy_str(want[l][n]), t.data ? "given" : "absent");
        }
    mst_model_destroy(m);
}

static void model_policies(mst_ctx_t* ctx) {
    /* one policy per name on every layer: fc1_input alone kept */
    mst_mem_config mem = mst_mem_config_default();
    CHECK_OK(mst_policy_spec_parse("act_input=stash,fc2_input=recompute,probs=offload", mem.policy.name));
    const mst_policy uniform[4][MST_N_SAVED] = {{K, S, R, O}, {K, S, R, O}, {K, S, R, O}, {K, S, R, O}};
    applies(ctx, &mem, uniform, "one policy per name");
    /* the planner's table: layer l keeps name l alone */
    const mst_policy table[4][MST_N_SAVED] = {{K, S, S, O}, {O, K, R, S}, {S, O, K, S}, {S, S, O, K}};
    mem = mst_mem_config_default();
    CHECK_OK(mst_policy_spec_parse("stash", mem.policy.name)); /* per_layer decides over name[] */
    mem.policy.per_layer = &table[0][0];
    applies(ctx, &mem, table, "per-layer table");
}

static void run(mst_ctx_t* ctx) {
    spec_format();
    model_policies(ctx);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
