/*
 * test_checkpoint.c — checkpoints (src/trainer/run/checkpoint.h): the weights,
 * master weights and AdamW moments of a model come back bit for bit in
 * another model; the configuration comes back field for field; the
 * safetensors layout is checked by hand (header length, JSON entry, data
 * bytes), independently of the reader; a truncated file, a damaged byte,
 * another model configuration, another format version and a missing
 * directory are refused with a message saying so, before any byte reaches
 * the model.
 */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, truncate */
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"
#include "trainer/run/checkpoint.h"

static mst_train_config tiny(int64_t hidden) {
    mst_train_config t = {0};
    mst_model_config m = {.vocab = 256, .hidden = hidden, .ffn = 16, .n_head = 2,
                          .n_kv_head = 1, .head_dim = hidden / 2, .rope_theta = 10000.0f, .norm_topk_prob = 1, .tie_embeddings = 1, .seq = 8, .batch = 2,
                          .layers = 2, .experts = 4, .top_k = 2, .ep = 2, .capacity_factor = 2.0f,
                          .mtp_weight = 0.3f, .aux_coef = 0.01f, .norm_eps = 1e-5f, .init_std = 0.02f,
                          .seed = 12345678901234ull};
    mst_optim_config o = {.lr = 3e-3f, .min_lr_frac = 0.1f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f,
                          .weight_decay = 0.1f, .clip = 1.0f, .warmup = 3, .steps = 7};
    t.model = m;
    t.optim = o;
    t.mem = mst_mem_config_default();
    t.mem.policy = "fc1_input=stash,act_input=offload";
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

static void random_bytes(unsigned char* h, size_t n, uint64_t seed) {
    mst_rng r = {seed};
    for (size_t i = 0; i < n; i++) h[i] = (unsigned char)(mst_rng_next(&r) >> 56);
}


static void check_message(const char* want) {
    CHECK(strstr(mst_last_error(), want) != NULL, "message '%s' does not say '%s'", mst_last_error(), want);
}

/* Reads a whole file into a malloc'd buffer. */
static unsigned char* slurp(const char* path, long* n) {
    FILE* f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char* b = (unsigned char*)malloc((size_t)*n + 1);
    if (fread(b, 1, (size_t)*n, f) != (size_t)*n) *n = -1;
    fclose(f);
    b[*n > 0 ? *n : 0] = 0;
    return b;
}

/* The first tensor of model.safetensors is embed.weight [256, H] bf16 at
 * data offset 0: the header is read by hand (length, JSON text) and the
 * data compared with the model's first 256 H weights. */
static void by_hand(const char* dir, const unsigned char* state, int64_t hidden) {
    char path[512];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    long n = 0;
    unsigned char* b = slurp(path, &n);
    CHECK(b && n > 8, "cannot read %s", path);
    if (!b || n <= 8) return;
    uint64_t len = 0;
    for (int i = 0; i < 8; i++) len |= (uint64_t)b[i] << (8 * i);
    CHECK(len % 8 == 0 && 8 + len < (uint64_t)n, "header length %llu of a %ld-byte file", (unsigned long long)len, n);
    char want[128];
    snprintf(want, sizeof want, "\"embed.weight\":{\"dtype\":\"BF16\",\"shape\":[256,%lld],\"data_offsets\":[0,%lld]}",
             (long long)hidden, (long long)(256 * hidden * 2));
    CHECK(strstr((const char*)b + 8, want) != NULL, "header lacks %s", want);
    CHECK(b[8] == '{' && (b[8 + len - 1] == ' ' || b[8 + len - 1] == '}'), "header is not a padded JSON object");
    CHECK(mst_first_diff(b + 8 + len, state, (size_t)(256 * hidden * 2)) < 0, "embed.weight bytes differ from the model's");
    free(b);
}

static void round_trip(mst_ctx_t* ctx, const char* dir) {
    mst_train_config cfg = tiny(32);
    mst_model *a = NULL, *b = NULL, *c = NULL;
    CHECK_OK(mst_model_create(ctx, &cfg.model, 1, NULL, &a));
    CHECK_OK(mst_model_create(ctx, &cfg.model, 1, NULL, &b));
    if (!a || !b) return;
    const size_t n = state_bytes(a);
    unsigned char *s = (unsigned char*)malloc(n), *poison = (unsigned char*)malloc(n), *got = (unsigned char*)malloc(n);
    random_bytes(s, n, 7);
    memset(poison, 0xFF, n);
    put_state(ctx, a, s);
    CHECK_OK(mst_ckpt_save(a, &cfg, 5, 0x0123456789abcdefull, dir));

    put_state(ctx, b, poison);
    CHECK_OK(mst_ckpt_load(b, dir));
    get_state(ctx, b, got);
    CHECK(mst_first_diff(got, s, n) < 0, "loaded state differs from the saved one at byte %lld", (long long)mst_first_diff(got, s, n));
    by_hand(dir, s, 32);

    mst_ckpt_meta meta;
    CHECK_OK(mst_ckpt_read_meta(dir, &meta));
    CHECK(meta.step == 5 && meta.data_rng == 0x0123456789abcdefull, "step %lld, rng %llx", (long long)meta.step,
          (unsigned long long)meta.data_rng);
    const mst_train_config* r = &meta.cfg;
    CHECK(memcmp(&r->model, &cfg.model, sizeof cfg.model) == 0, "model config differs after the round trip");
    CHECK(memcmp(&r->optim, &cfg.optim, sizeof cfg.optim) == 0, "optimizer config differs after the round trip");
    CHECK(r->mem.policy && strcmp(r->mem.policy, cfg.mem.policy) == 0, "policy '%s'", r->mem.policy ? r->mem.policy : "(null)");
    CHECK(r->data_path && strcmp(r->data_path, cfg.data_path) == 0, "data '%s'", r->data_path ? r->data_path : "(null)");
    CHECK(r->mem.recompute.method == MST_RECOMPUTE_UNIFORM && r->mem.recompute.num_layers == 1, "recompute %d:%d",
          (int)r->mem.recompute.method, r->mem.recompute.num_layers);
    CHECK(r->mem.schedule == MST_SCHEDULE_1F1B && r->mem.pool_factor == 1.25 && r->microbatches == 2 && r->steps == 7,
          "schedule %d, pool factor %g, microbatches %d, steps %lld", (int)r->mem.schedule, r->mem.pool_factor,
          r->microbatches, (long long)r->steps);

    /* another configuration: shapes differ; the model is left as it was */
    mst_train_config other = tiny(48);
    CHECK_OK(mst_model_create(ctx, &other.model, 1, NULL, &c));
    if (c) {
        unsigned char* before = (unsigned char*)malloc(state_bytes(c));
        unsigned char* after = (unsigned char*)malloc(state_bytes(c));
        get_state(ctx, c, before);
        CHECK_STATUS(mst_ckpt_load(c, dir), MST_ERR_INVALID);
        check_message("shape");
        get_state(ctx, c, after);
        CHECK(mst_first_diff(before, after, state_bytes(c)) < 0, "a refused load changed the model");
        free(before), free(after);
    }
    mst_model_destroy(a), mst_model_destroy(b), mst_model_destroy(c);
    free(s), free(poison), free(got);
}

/* Damage done to a copy of a good checkpoint; the load must refuse it
 * with `status` and a message holding `want`. */
static void refused(mst_ctx_t* ctx, const char* dir, const char* file, long cut, long flip, const char* json_from,
                    const char* json_to, mst_status status, const char* want) {
    mst_train_config cfg = tiny(32);
    mst_model* a = NULL;
    CHECK_OK(mst_model_create(ctx, &cfg.model, 1, NULL, &a));
    if (!a) return;
    CHECK_OK(mst_ckpt_save(a, &cfg, 3, 99, dir));
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    long n = 0;
    unsigned char* b = slurp(path, &n);
    if (b && cut) CHECK(truncate(path, n - cut) == 0, "truncate %s", path);
    if (b && flip) {
        b[n - flip] ^= 0x01;
        FILE* f = fopen(path, "wb");
        fwrite(b, 1, (size_t)n, f);
        fclose(f);
    }
    if (b && json_from) { /* same length: a safetensors header keeps its size */
        const size_t skip = strstr(file, ".safetensors") ? 8 : 0;
        char* at = strstr((char*)b + skip, json_from);
        CHECK(at != NULL, "%s lacks '%s'", path, json_from);
        CHECK(strlen(json_to) == strlen(json_from), "test bug: replacement of another length");
        if (at && strlen(json_to) == strlen(json_from)) {
            memcpy(at, json_to, strlen(json_to));
            FILE* f = fopen(path, "wb");
            fwrite(b, 1, (size_t)n, f);
            fclose(f);
        }
    }
    free(b);
    mst_ckpt_meta meta;
    mst_status st = mst_ckpt_read_meta(dir, &meta);
    if (st == MST_OK) st = mst_ckpt_load(a, dir);
    CHECK(st == status, "%s damaged: %s, expected %s (%s)", file, mst_status_str(st), mst_status_str(status), mst_last_error());
    check_message(want);
    mst_model_destroy(a);
    mst_test_rmtree(dir);
    mkdir(dir, 0700);
}

static void run(mst_ctx_t* ctx) {
    char dir[128];
    if (!mst_test_tmpdir(dir, sizeof dir, "mst_ckpt")) {
        CHECK(0, "no temporary directory");
        return;
    }
    char sub[256];
    snprintf(sub, sizeof sub, "%s/run/step-5", dir); /* parents made by save */
    round_trip(ctx, sub);
    snprintf(sub, sizeof sub, "%s/run", dir);
    mst_test_rmtree(sub);
    refused(ctx, dir, "optimizer.safetensors", 1, 0, NULL, NULL, MST_ERR_INVALID, "truncated");
    refused(ctx, dir, "model.safetensors", 0, 3, NULL, NULL, MST_ERR_INVALID, "hash");
    refused(ctx, dir, "trainer.json", 0, 0, "\"version\": 1", "\"version\": 2", MST_ERR_INVALID, "version 2");
    refused(ctx, dir, "trainer.json", 0, 0, "moestash-checkpoint", "other-format-000000", MST_ERR_INVALID, "not a moestash");
    refused(ctx, dir, "trainer.json", 0, 0, "\"config.model.hidden\": 32", "\"config.model.hidden\": 3.",
            MST_ERR_INVALID, "config.model.hidden");
    refused(ctx, dir, "model.safetensors", 0, 0, "\"dtype\":\"BF16\"", "\"dtype\":\"F16\" ", MST_ERR_INVALID, "not BF16");
    mst_ckpt_meta meta;
    CHECK_STATUS(mst_ckpt_read_meta("/nonexistent/moestash/ckpt", &meta), MST_ERR_IO);
    check_message("/nonexistent/moestash/ckpt/trainer.json");
    mst_test_rmtree(dir);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
