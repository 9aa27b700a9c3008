/*
 * test_checkpoint.c — checkpoints (src/trainer/run/checkpoint.h) as Hugging
 * Face model directories:
 * - the weights, master weights and AdamW moments of a model come back bit
 *   for bit in another model; the configuration field for field; the files
 *   are the HF ones (config.json, model.safetensors, mtp.safetensors) and
 *   the first tensor of model.safetensors is checked by hand (its name,
 *   shape, offsets and bytes), independently of the reader;
 * - with a small shard size the sets are sharded (model-0000i-of-0000K and
 *   an index whose every entry is in its shard) and still load bit for bit;
 * - damage is refused naming the file: truncation, a flipped byte (hash),
 *   data_offsets that no longer tile the file, another dtype, a renamed
 *   tensor, another version, another configuration (the model unchanged);
 * - a save that fails (its temporary directory blocked) leaves the earlier
 *   checkpoint in place and loadable;
 * - --init-from: a directory of F32 tensors (made here from a checkpoint)
 *   gives the master weights those exact values and the bf16 weights
 *   their rounding; a shape that contradicts config.json is refused;
 * - room: a model whose checkpoint cannot fit is refused naming both sizes.
 */
#define _POSIX_C_SOURCE 200809L /* truncate */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"
#include "trainer/run/checkpoint.h"

/* Field by field into a zeroed config: the round-trip checks compare the
 * structs with memcmp, so their padding must be zero on both sides (a
 * designated initializer of a local leaves it indeterminate). */
static mst_train_config tiny(int64_t hidden) {
    mst_train_config t;
    memset(&t, 0, sizeof t);
    mst_model_config* m = &t.model;
    m->vocab = 256, m->hidden = hidden, m->ffn = 16, m->n_head = 2, m->n_kv_head = 1, m->head_dim = hidden / 2;
    m->rope_theta = 10000.0f, m->norm_topk_prob = 1, m->tie_embeddings = 1, m->seq = 8, m->batch = 2;
    m->layers = 2, m->experts = 4, m->top_k = 2, m->ep = 2, m->capacity_factor = 2.0f;
    m->mtp_weight = 0.3f, m->aux_coef = 0.01f, m->norm_eps = 1e-5f, m->init_std = 0.02f, m->seed = 12345678901234ull;
    mst_optim_config* o = &t.optim;
    o->lr = 3e-3f, o->min_lr_frac = 0.1f, o->beta1 = 0.9f, o->beta2 = 0.95f, o->eps = 1e-8f;
    o->weight_decay = 0.1f, o->clip = 1.0f, o->warmup = 3, o->steps = 7;
    t.mem = mst_mem_config_default();
    CHECK_OK(mst_policy_spec_parse("fc1_input=stash,act_input=offload", t.mem.policy.name));
    t.mem.recompute = (mst_recompute_config){sizeof(mst_recompute_config), MST_RECOMPUTE_UNIFORM, 1};
    t.mem.schedule = MST_SCHEDULE_1F1B;
    t.mem.pool_factor = 1.25;
    t.microbatches = 2;
    t.steps = 7;
    t.data_path = "some dir/corpus.txt";
    return t;
}

/* The four flat buffers of a model: bf16 weights and three fp32 states. */
static size_t state_bytes(const mst_model* m) { return (size_t)m->n_params * (2 + 3 * 4); }

static void get_state(mst_ctx_t* ctx, const mst_model* m, unsigned char* h) {
    const size_t n = (size_t)m->n_params;
    mst_copy_b2h(ctx, h, m->w, n * 2);
    mst_copy_b2h(ctx, h + n * 2, m->master, n * 4);
    mst_copy_b2h(ctx, h + n * 6, m->adam_m, n * 4);
    mst_copy_b2h(ctx, h + n * 10, m->adam_v, n * 4);
}

static void put_state(mst_ctx_t* ctx, mst_model* m, const unsigned char* h) {
    const size_t n = (size_t)m->n_params;
    mst_copy_h2b(ctx, m->w, h, n * 2);
    mst_copy_h2b(ctx, m->master, h + n * 2, n * 4);
    mst_copy_h2b(ctx, m->adam_m, h + n * 6, n * 4);
    mst_copy_h2b(ctx, m->adam_v, h + n * 10, n * 4);
}

/* Random finite state: bf16 weights, fp32 states (no NaN bit patterns, so
 * that conversions are comparable). */
static void random_state(unsigned char* h, const mst_model* m, uint64_t seed) {
    mst_rng r = {seed};
    const size_t n = (size_t)m->n_params;
    mst_rng_bf16(&r, (uint16_t*)h, n, 1.0);
    mst_rng_fp32(&r, (float*)(h + n * 2), 3 * n, -2, 2);
}


static int exists(const char* dir, const char* name) {
    char p[600];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    struct stat sb;
    return stat(p, &sb) == 0;
}

/* model.embed_tokens.weight [256, H] bf16 is model.safetensors' first
 * tensor: header read by hand, data against the model's embedding. */
static void by_hand(const char* dir, const mst_model* m, const unsigned char* state) {
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    long n = 0;
    unsigned char* b = mst_test_slurp(path, &n);
    CHECK(b && n > 8, "cannot read %s", path);
    if (!b || n <= 8) return;
    uint64_t len = 0;
    for (int i = 0; i < 8; i++) len |= (uint64_t)b[i] << (8 * i);
    CHECK(len % 8 == 0 && 8 + len < (uint64_t)n, "header length %llu of a %ld-byte file", (unsigned long long)len, n);
    const int64_t H = m->cfg.hidden;
    char want[160];
    snprintf(want, sizeof want, "\"model.embed_tokens.weight\":{\"dtype\":\"BF16\",\"shape\":[256,%lld],\"data_offsets\":[0,%lld]}",
             (long long)H, (long long)(256 * H * 2));
    CHECK(strstr((const char*)b + 8, want) != NULL, "header lacks %s", want);
    CHECK(strstr((const char*)b + 8, "\"model.layers.1.mlp.experts.3.down_proj.weight\":{\"dtype\":\"BF16\",\"shape\":[") != NULL,
          "header lacks layer 1's expert 3");
    CHECK(mst_first_diff(b + 8 + len, state + m->emb * 2, (size_t)(256 * H * 2)) < 0, "embedding bytes differ from the model's");
    free(b);
}

/* Named tensors of model.safetensors against slices of the model's flat
 * buffers at the offsets model.h documents: wqkv's q, k, v row blocks, w1's
 * gate and up halves per expert, w2 per expert, the QK norms. */
static void slices(const char* dir, const mst_model* m, const unsigned char* state) {
    const mst_model_config* c = &m->cfg;
    const int64_t H = c->hidden, F = c->ffn, NH = c->n_head, KV = c->n_kv_head ? c->n_kv_head : NH;
    const int64_t D = c->head_dim ? c->head_dim : H / NH;
    const uint16_t* w = (const uint16_t*)state;
    const struct { const char* name; int layer; int64_t off, n; } want[] = {
        {"self_attn.q_proj.weight", 0, m->lp[0].wqkv, NH * D * H},
        {"self_attn.k_proj.weight", 1, m->lp[1].wqkv + NH * D * H, KV * D * H},
        {"self_attn.v_proj.weight", 1, m->lp[1].wqkv + (NH + KV) * D * H, KV * D * H},
        {"self_attn.o_proj.weight", 0, m->lp[0].wo, H * NH * D},
        {"self_attn.q_norm.weight", 1, m->lp[1].q_norm, D},
        {"self_attn.k_norm.weight", 0, m->lp[0].k_norm, D},
        {"mlp.gate.weight", 1, m->lp[1].wr, c->experts * H},
        {"mlp.experts.2.gate_proj.weight", 0, m->lp[0].w1 + 2 * 2 * F * H, F * H},
        {"mlp.experts.2.up_proj.weight", 1, m->lp[1].w1 + (2 * 2 + 1) * F * H, F * H},
        {"mlp.experts.3.down_proj.weight", 1, m->lp[1].w2 + 3 * H * F, H * F},
        {"input_layernorm.weight", 1, m->lp[1].ln1, H},
        {"post_attention_layernorm.weight", 0, m->lp[0].ln2, H},
    };
    char path[512], name[128];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    mst_st_file f;
    CHECK_OK(mst_st_open(path, &f));
    for (size_t k = 0; k < sizeof want / sizeof want[0]; k++) {
        snprintf(name, sizeof name, "model.layers.%d.%s", want[k].layer, want[k].name);
        const mst_st_entry* e = mst_st_find(&f, name);
        CHECK(e && mst_st_numel(e) == want[k].n && e->dtype == MST_ST_BF16, "%s: missing, or not %lld bf16 values", name,
              (long long)want[k].n);
        if (!e || mst_st_numel(e) != want[k].n) continue;
        uint16_t* got = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)want[k].n);
        CHECK_OK(mst_st_read(&f, e, MST_ST_BF16, got));
        CHECK(mst_first_diff(got, w + want[k].off, sizeof(uint16_t) * (size_t)want[k].n) < 0, "%s is not its slice of the model",
              name);
        free(got);
    }
    mst_st_close(&f);
}

static void round_trip(mst_ctx_t* ctx, const char* dir, size_t shard_bytes) {
    mst_train_config cfg = tiny(32);
    cfg.save_shard_bytes = shard_bytes;
    mst_model *a = NULL, *b = NULL, *c = NULL;
    CHECK_OK(mst_model_create(ctx, &cfg.model, 1, NULL, &a));
    CHECK_OK(mst_model_create(ctx, &cfg.model, 1, NULL, &b));
    if (!a || !b) return;
    const size_t n = state_bytes(a);
    unsigned char *s = (unsigned char*)malloc(n), *poison = (unsigned char*)malloc(n), *got = (unsigned char*)malloc(n);
    random_state(s, a, 7);
    memset(poison, 0xFF, n);
    put_state(ctx, a, s);
    /* the losses so far: steps 1 .. 5 of 7, step 3 evaluated */
    double l[4][7], back[4][7];
    mst_rng lr = {17};
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 7; i++) l[k][i] = k == 3 && i != 2 ? NAN : mst_rng_uniform(&lr) * 6, back[k][i] = -1;
    mst_train_result res = {.loss = l[0], .mtp_loss = l[1], .aux_loss = l[2], .eval_loss = l[3], .steps = 7};
    mst_train_result got_res = {.loss = back[0], .mtp_loss = back[1], .aux_loss = back[2], .eval_loss = back[3], .steps = 7};
    CHECK_OK(mst_ckpt_save(a, &cfg, 5, 0x0123456789abcdefull, &res, dir));
    CHECK_OK(mst_ckpt_read_losses(dir, 5, &got_res));
    int lbad = 0;
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 7; i++)
            lbad += i < 5 ? !(back[k][i] == l[k][i] || (isnan(l[k][i]) && isnan(back[k][i]))) : back[k][i] != -1;
    CHECK(lbad == 0, "%d losses differ after trainer.json", lbad);
    CHECK(exists(dir, "config.json") && exists(dir, "trainer.json"), "config.json, trainer.json");
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.tmp", dir);
    CHECK(access(tmp, F_OK) != 0, "%s left behind", tmp);
    if (!shard_bytes) {
        CHECK(exists(dir, "model.safetensors") && exists(dir, "mtp.safetensors") && exists(dir, "optimizer.safetensors") &&
                  !exists(dir, "model.safetensors.index.json"), "one file per set");
        by_hand(dir, a, s);
        slices(dir, a, s);
    } else {
        CHECK(exists(dir, "model.safetensors.index.json") && exists(dir, "optimizer.safetensors.index.json") &&
                  !exists(dir, "model.safetensors"),
              "sharded sets with their indexes");
        /* every shard of the model set at most the limit (each tensor here is smaller) */
        mst_hf* h = NULL;
        CHECK_OK(mst_hf_open_set(dir, "model", 1, &h));
        int64_t n_t = mst_hf_n_tensors(h);
        CHECK(n_t == mst_hf_n_params(&cfg.model) - (9 + 3 * 4) - 4, "%lld tensors in the model set", (long long)n_t);
        int K = 0;
        char f[80], full[700];
        for (int k = 2; k < 1000 && !K; k++) {
            snprintf(f, sizeof f, "model-00001-of-%05d.safetensors", k);
            if (exists(dir, f)) K = k;
        }
        int shards = 0;
        for (int k = 1; k <= K; k++) {
            snprintf(f, sizeof f, "model-%05d-of-%05d.safetensors", k, K);
            snprintf(full, sizeof full, "%s/%s", dir, f);
            struct stat sb;
            if (stat(full, &sb) != 0) continue;
            shards++;
            CHECK((size_t)sb.st_size < shard_bytes + 8192, "%s: %lld bytes over a shard size of %zu", f, (long long)sb.st_size,
                  shard_bytes);
        }
        CHECK(shards == K, "%d of %d shards there", shards, K);
        CHECK(shards > 2, "%d model shards", shards);
        mst_hf_close(h);
    }

    put_state(ctx, b, poison);
    CHECK_OK(mst_ckpt_load(b, dir));
    get_state(ctx, b, got);
    CHECK(mst_first_diff(got, s, n) < 0, "loaded state differs from the saved one at byte %lld", (long long)mst_first_diff(got, s, n));

    mst_ckpt_meta meta;
    CHECK_OK(mst_ckpt_read_meta(dir, &meta));
    CHECK(meta.step == 5 && meta.data_rng == 0x0123456789abcdefull, "step %lld, rng %llx", (long long)meta.step,
          (unsigned long long)meta.data_rng);
    const mst_train_config* r = &meta.cfg;
    CHECK(memcmp(&r->model, &cfg.model, sizeof cfg.model) == 0, "model config differs after the round trip");
    CHECK(memcmp(&r->optim, &cfg.optim, sizeof cfg.optim) == 0, "optimizer config differs after the round trip");
    CHECK(memcmp(&r->mem.policy, &cfg.mem.policy, sizeof cfg.mem.policy) == 0, "policy (%d %d %d %d)", r->mem.policy.name[0],
          r->mem.policy.name[1], r->mem.policy.name[2], r->mem.policy.name[3]);
    CHECK(r->data_path && strcmp(r->data_path, cfg.data_path) == 0, "data '%s'", r->data_path ? r->data_path : "(null)");
    CHECK(r->mem.schedule == MST_SCHEDULE_1F1B && r->mem.pool_factor == 1.25 && r->microbatches == 2 && r->steps == 7,
          "schedule %d, pool factor %g, microbatches %d, steps %lld", (int)r->mem.schedule, r->mem.pool_factor,
          r->microbatches, (long long)r->steps);

    /* another configuration: refused, the model left as it was */
    mst_train_config other = tiny(48);
    CHECK_OK(mst_model_create(ctx, &other.model, 1, NULL, &c));
    if (c) {
        unsigned char* before = (unsigned char*)malloc(state_bytes(c));
        unsigned char* after = (unsigned char*)malloc(state_bytes(c));
        get_state(ctx, c, before);
        CHECK_STATUS(mst_ckpt_load(c, dir), MST_ERR_INVALID);
        CHECK_MESSAGE("shape");
        get_state(ctx, c, after);
        CHECK(mst_first_diff(before, after, state_bytes(c)) < 0, "a refused load changed the model");
        free(before), free(after);
    }
    mst_model_destroy(a), mst_model_destroy(b), mst_model_destroy(c);
    free(s), free(poison), free(got);
}

/* A good checkpoint damaged; the load must refuse it with a message
 * holding `want` (and the file's name). */
static void refused(mst_ctx_t* ctx, const char* dir, const char* file, long cut, long flip, const char* json_from,
                    const char* json_to, const char* want) {
    mst_train_config cfg = tiny(32);
    mst_model* a = NULL;
    CHECK_OK(mst_model_create(ctx, &cfg.model, 1, NULL, &a));
    if (!a) return;
    CHECK_OK(mst_ckpt_save(a, &cfg, 3, 99, NULL, dir));
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    long n = 0;
    unsigned char* b = mst_test_slurp(path, &n);
    CHECK(b != NULL, "no %s", path);
    if (b && cut) CHECK(truncate(path, n - cut) == 0, "truncate %s", path);
    if (b && flip) b[n - flip] ^= 0x01;
    if (b && json_from) { /* same length: a safetensors header keeps its size */
        const size_t skip = strstr(file, ".safetensors") ? 8 : 0;
        char* at = strstr((char*)b + skip, json_from);
        CHECK(at != NULL, "%s lacks '%s'", path, json_from);
        CHECK(strlen(json_to) == strlen(json_from), "test bug: replacement of another length");
        if (at && strlen(json_to) == strlen(json_from)) memcpy(at, json_to, strlen(json_to));
    }
    if (b && (flip || json_from)) {
        FILE* f = fopen(path, "wb");
        fwrite(b, 1, (size_t)n, f);
        fclose(f);
    }
    free(b);
    mst_ckpt_meta meta;
    mst_status st = mst_ckpt_read_meta(dir, &meta);
    if (st == MST_OK) st = mst_ckpt_load(a, dir);
    CHECK(st == MST_ERR_INVALID, "%s damaged: %s, expected invalid (%s)", file, mst_status_str(st), mst_last_error());
    CHECK_MESSAGE(want);
    if (strcmp(file, "trainer.json") != 0 && !strstr(want, "(missing)")) CHECK_MESSAGE(file); /* else the directory */
    mst_model_destroy(a);
    mst_test_rmtree(dir);
}

/* A save that fails leaves the checkpoint before it whole. */
static void failed_save(mst_ctx_t* ctx, const char* dir) {
    mst_train_config cfg = tiny(32);
    mst_model *a = NULL, *b = NULL;
    CHECK_OK(mst_model_create(ctx, &cfg.model, 1, NULL, &a));
    CHECK_OK(mst_model_create(ctx, &cfg.model, 1, NULL, &b));
    if (!a || !b) return;
    const size_t n = state_bytes(a);
    unsigned char *s = (unsigned char*)malloc(n), *s2 = (unsigned char*)malloc(n), *got = (unsigned char*)malloc(n);
    random_state(s, a, 21);
    random_state(s2, a, 22);
    put_state(ctx, a, s);
    CHECK_OK(mst_ckpt_save(a, &cfg, 3, 1, NULL, dir));
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.tmp", dir);
    FILE* f = fopen(tmp, "w"); /* a file where the save makes its directory */
    if (f) fclose(f);
    put_state(ctx, a, s2);
    CHECK(mst_ckpt_save(a, &cfg, 4, 2, NULL, dir) != MST_OK, "a save into a blocked place succeeded");
    unlink(tmp);
    CHECK_OK(mst_ckpt_load(b, dir));
    get_state(ctx, b, got);
    CHECK(mst_first_diff(got, s, n) < 0, "the earlier checkpoint changed");
    /* and a save over an existing checkpoint replaces it whole */
    CHECK_OK(mst_ckpt_save(a, &cfg, 4, 2, NULL, dir));
    CHECK_OK(mst_ckpt_load(b, dir));
    get_state(ctx, b, got);
    CHECK(mst_first_diff(got, s2, n) < 0, "the checkpoint saved over the old one differs");
    char old[600];
    snprintf(old, sizeof old, "%s.old", dir);
    CHECK(access(old, F_OK) != 0 && access(tmp, F_OK) != 0, "litter left beside %s", dir);
    mst_model_destroy(a), mst_model_destroy(b);
    free(s), free(s2), free(got);
    mst_test_rmtree(dir);
}

/* A copy of dir's model set with every tensor as F32, in a directory of its own. */
static void to_f32(const char* from, const char* to) {
    mkdir(to, 0700);
    char a[600], b[600];
    mst_hf* h = NULL;
    CHECK_OK(mst_hf_open_set(from, "model", 1, &h));
    if (!h) return;
    const int64_t n = mst_hf_n_tensors(h);
    mst_st_entry* e = (mst_st_entry*)calloc((size_t)n, sizeof *e);
    for (int64_t i = 0; i < n; i++) {
        e[i] = *mst_hf_entry(h, mst_hf_tensor_name(h, i, NULL), NULL);
        e[i].dtype = MST_ST_F32;
    }
    snprintf(b, sizeof b, "%s/model.safetensors", to);
    mst_st_writer w;
    CHECK_OK(mst_st_write_begin(&w, b, e, (int32_t)n));
    mst_rng r = {3};
    for (int64_t i = 0; i < n; i++) {
        const size_t k = (size_t)mst_st_numel(&e[i]);
        float* x = (float*)malloc(k * 4);
        mst_rng_fp32(&r, x, k, -1, 1); /* values no bf16 holds */
        CHECK_OK(mst_st_write_data(&w, x, k * 4));
        free(x);
    }
    CHECK_OK(mst_st_write_end(&w));
    snprintf(a, sizeof a, "%s/config.json", from);
    snprintf(b, sizeof b, "%s/config.json", to);
    long len = 0;
    unsigned char* t = mst_test_slurp(a, &len);
    FILE* f = fopen(b, "wb");
    fwrite(t, 1, (size_t)len, f);
    fclose(f);
    free(t);
    free(e);
    mst_hf_close(h);
}

static void init_from(mst_ctx_t* ctx, const char* dir, const char* hf) {
    mst_train_config cfg = tiny(32);
    mst_model *a = NULL, *b = NULL;
    CHECK_OK(mst_model_create(ctx, &cfg.model, 1, NULL, &a));
    CHECK_OK(mst_model_create(ctx, &cfg.model, 1, NULL, &b));
    if (!a || !b) return;
    CHECK_OK(mst_ckpt_save(a, &cfg, 0, 1, NULL, dir));
    to_f32(dir, hf);
    const size_t n = state_bytes(b);
    unsigned char *before = (unsigned char*)malloc(n), *after = (unsigned char*)malloc(n);
    get_state(ctx, b, before);
    CHECK_OK(mst_ckpt_init_from(b, hf));
    get_state(ctx, b, after);
    /* every main-model tensor: master the file's F32, w its bf16 rounding; the MTP module (no mtp set) as it was */
    mst_hf* h = NULL;
    CHECK_OK(mst_hf_open_set(hf, "model", 1, &h));
    const int32_t np = mst_hf_n_params(&cfg.model);
    mst_hf_param* p = (mst_hf_param*)malloc(sizeof *p * (size_t)np);
    mst_hf_params(&cfg.model, b, p);
    int bad = 0, mtp_same = 1;
    const size_t N = (size_t)b->n_params;
    const uint16_t* w = (const uint16_t*)after;
    const float* master = (const float*)(after + N * 2);
    for (int32_t i = 0; h && i < np; i++) {
        const size_t k = (size_t)mst_hf_numel(&p[i]);
        if (p[i].set == MST_HF_MTP) {
            mtp_same &= mst_first_diff(after + N * 2 + p[i].off * 4, before + N * 2 + p[i].off * 4, k * 4) < 0;
            continue;
        }
        float* x = (float*)malloc(k * 4);
        CHECK_OK(mst_hf_read_param(h, &p[i], MST_ST_F32, x));
        for (size_t j = 0; j < k; j++) bad += master[p[i].off + j] != x[j] || w[p[i].off + j] != mst_ref_bf16(x[j]);
        free(x);
    }
    CHECK(bad == 0, "%d values differ from the F32 file's", bad);
    CHECK(mtp_same, "the MTP module changed without an mtp set");
    free(p);
    mst_hf_close(h);

    /* a model of another shape: refused naming the field */
    mst_train_config other = tiny(48);
    mst_model* c = NULL;
    CHECK_OK(mst_model_create(ctx, &other.model, 1, NULL, &c));
    if (c) CHECK_STATUS(mst_ckpt_init_from(c, hf), MST_ERR_INVALID);
    CHECK_MESSAGE("hidden_size 32");
    mst_model_destroy(a), mst_model_destroy(b), mst_model_destroy(c);
    free(before), free(after);
    mst_test_rmtree(dir);
    mst_test_rmtree(hf);
}

static void room(void) {
    mst_train_config cfg = tiny(32);
    CHECK_OK(mst_ckpt_check_room(&cfg, "/tmp/no/such/dir"));
    cfg.model.hidden = 65536, cfg.model.ffn = 262144, cfg.model.experts = 1024, cfg.model.layers = 256;
    CHECK_STATUS(mst_ckpt_check_room(&cfg, "/tmp/no/such/dir"), MST_ERR_INVALID);
    CHECK_MESSAGE("--save '/tmp/no/such/dir': one checkpoint takes");
    CHECK_MESSAGE("MiB free");
}

static void run(mst_ctx_t* ctx) {
    char dir[128];
    if (!mst_test_tmpdir(dir, sizeof dir, "mst_ckpt")) {
        CHECK(0, "no temporary directory");
        return;
    }
    char sub[256], hf[256];
    snprintf(sub, sizeof sub, "%s/run/step-5", dir); /* parents made by save */
    round_trip(ctx, sub, 0);
    round_trip(ctx, sub, 20000); /* over the old one */
    snprintf(sub, sizeof sub, "%s/run", dir);
    mst_test_rmtree(sub);
    snprintf(sub, sizeof sub, "%s/ck", dir);
    refused(ctx, sub, "optimizer.safetensors", 1, 0, NULL, NULL, "runs past");
    refused(ctx, sub, "model.safetensors", 0, 3, NULL, NULL, "damaged");
    refused(ctx, sub, "model.safetensors", 0, 0, "\"data_offsets\":[0,16384]", "\"data_offsets\":[8,16392]",
            "bytes [0, 8) to no tensor");
    refused(ctx, sub, "mtp.safetensors", 0, 0, "\"dtype\":\"BF16\"", "\"dtype\":\"F16\" ", "is F16, a checkpoint's is BF16");
    refused(ctx, sub, "model.safetensors", 0, 0, "model.norm.weight", "model.norX.weight",
            "no tensor 'model.norm.weight' (missing)");
    refused(ctx, sub, "optimizer.safetensors", 0, 0, "adam_v.model.norm.weight", "adam_v.model.norm.weighT",
            "no tensor 'adam_v.model.norm.weight' (missing)");
    refused(ctx, sub, "trainer.json", 0, 0, "\"version\": 2", "\"version\": 3", "version 3");
    refused(ctx, sub, "trainer.json", 0, 0, "moestash-checkpoint", "other-format-000000", "not a moestash");
    refused(ctx, sub, "trainer.json", 0, 0, "\"config.model.hidden\": 32", "\"config.model.hidden\": 3.", "config.model.hidden");
    failed_save(ctx, sub);
    snprintf(hf, sizeof hf, "%s/hf", dir);
    init_from(ctx, sub, hf);
    room();
    mst_ckpt_meta meta;
    CHECK_STATUS(mst_ckpt_read_meta("/nonexistent/moestash/ckpt", &meta), MST_ERR_IO);
    CHECK_MESSAGE("/nonexistent/moestash/ckpt/trainer.json");
    mst_test_rmtree(dir);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
