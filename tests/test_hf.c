/*
 * test_hf.c — the safetensors reader and writer and the Hugging Face model
 * directory (src/trainer/io/safetensors.h, hf.h), without a model:
 * - a file written with random F32, BF16 and I32 tensors is checked by hand
 *   (header length and padding, each entry's JSON text, the data bytes),
 *   then read back bit for bit, and F32 -> BF16 against the harness's own
 *   rounding; F16 bits written by hand convert to their known values;
 * - headers that lie are refused naming the file and the problem: a gap
 *   between tensors, an overlap, a tensor past the end (truncated), trailing
 *   bytes, offsets whose extent is not the shape's, a name twice, an
 *   unknown dtype, a header longer than the file, a damaged data byte;
 * - config.json: written, read back field for field; other model types,
 *   missing fields, dense layers, contradictions refused naming the field;
 * - an index with its shards: read through the weight_map; a shard that
 *   lacks a tensor its index names, or a missing shard, is refused;
 * - the parameter table: count, names, shapes, and no two names alike.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "harness.h"
#include "trainer/io/hf.h"


static void spit(const char* path, const void* p, size_t n) {
    FILE* f = fopen(path, "wb");
    CHECK(f && fwrite(p, 1, n, f) == n, "cannot write %s", path);
    if (f) fclose(f);
}

/* A safetensors file by hand: header text (padded here) and data bytes. */
static void by_hand(const char* path, const char* json, const void* data, size_t n) {
    size_t len = strlen(json);
    const size_t padded = (len + 7) / 8 * 8;
    unsigned char* b = (unsigned char*)malloc(8 + padded + n);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)padded >> (8 * i));
    memcpy(b + 8, json, len);
    memset(b + 8 + len, ' ', padded - len);
    if (n) memcpy(b + 8 + padded, data, n);
    spit(path, b, 8 + padded + n);
    free(b);
}

/* ---- writer and reader ---- */

static void write_read(const char* dir) {
    char path[512];
    snprintf(path, sizeof path, "%s/a.safetensors", dir);
    mst_rng r = {11};
    float a[6 * 5];
    uint16_t b[7];
    int32_t c[3 * 2];
    mst_rng_fp32(&r, a, 30, -3, 3);
    mst_rng_bf16(&r, b, 7, 1.0);
    for (int i = 0; i < 6; i++) c[i] = (int32_t)mst_rng_int(&r, -1000, 1000);
    mst_st_entry e[3] = {{.name = "w.a", .dtype = MST_ST_F32, .nd = 2, .dims = {6, 5}},
                         {.name = "w.b", .dtype = MST_ST_BF16, .nd = 1, .dims = {7}},
                         {.name = "tok", .dtype = MST_ST_I32, .nd = 2, .dims = {3, 2}}};
    mst_st_writer w;
    CHECK_OK(mst_st_write_begin(&w, path, e, 3));
    CHECK_OK(mst_st_write_data(&w, a, sizeof a));
    CHECK_OK(mst_st_write_data(&w, b, sizeof b));
    CHECK_OK(mst_st_write_data(&w, c, sizeof c));
    CHECK_OK(mst_st_write_end(&w));

    long n = 0;
    unsigned char* f = mst_test_slurp(path, &n);
    CHECK(f && n > 8, "cannot read %s", path);
    if (!f) return;
    uint64_t len = 0;
    for (int i = 0; i < 8; i++) len |= (uint64_t)f[i] << (8 * i);
    CHECK(len % 8 == 0 && 8 + len + 120 + 14 + 24 == (uint64_t)n, "header %llu bytes in a %ld-byte file", (unsigned long long)len, n);
    CHECK(strstr((char*)f + 8, "\"w.a\":{\"dtype\":\"F32\",\"shape\":[6,5],\"data_offsets\":[0,120]}") &&
              strstr((char*)f + 8, "\"w.b\":{\"dtype\":\"BF16\",\"shape\":[7],\"data_offsets\":[120,134]}") &&
              strstr((char*)f + 8, "\"tok\":{\"dtype\":\"I32\",\"shape\":[3,2],\"data_offsets\":[134,158]}"),
          "header entries: %.*s", (int)len, (char*)f + 8);
    CHECK(mst_first_diff(f + 8 + len, a, sizeof a) < 0 && mst_first_diff(f + 8 + len + 120, b, sizeof b) < 0 &&
              mst_first_diff(f + 8 + len + 134, c, sizeof c) < 0, "data bytes differ from what was written");
    free(f);

    mst_st_file s;
    CHECK_OK(mst_st_open(path, &s));
    CHECK_OK(mst_st_verify(&s));
    CHECK(s.n == 3 && s.has_hash, "%d entries, hash %d", s.n, s.has_hash);
    float ga[30], gb[7];
    uint16_t ha[30], hb[7];
    int32_t gc[6];
    memset(ga, 0xFF, sizeof ga), memset(gb, 0xFF, sizeof gb), memset(gc, 0xFF, sizeof gc), memset(ha, 0xFF, sizeof ha);
    const mst_st_entry *ea = mst_st_find(&s, "w.a"), *eb = mst_st_find(&s, "w.b"), *ec = mst_st_find(&s, "tok");
    CHECK(ea && eb && ec && !mst_st_find(&s, "w.c"), "lookup by name");
    if (!ea || !eb || !ec) return;
    CHECK_OK(mst_st_read(&s, ea, MST_ST_F32, ga));
    CHECK_OK(mst_st_read(&s, ea, MST_ST_BF16, ha));
    CHECK_OK(mst_st_read(&s, eb, MST_ST_F32, gb));
    CHECK_OK(mst_st_read(&s, eb, MST_ST_BF16, hb));
    CHECK_OK(mst_st_read(&s, ec, MST_ST_I32, gc));
    CHECK(mst_first_diff(ga, a, sizeof a) < 0 && mst_first_diff(hb, b, sizeof b) < 0 && mst_first_diff(gc, c, sizeof c) < 0,
          "read back differs");
    int bad = 0;
    for (int i = 0; i < 30; i++) bad += ha[i] != mst_ref_bf16(a[i]);
    for (int i = 0; i < 7; i++) bad += gb[i] != (float)mst_ref_bf16_value(b[i]);
    CHECK(bad == 0, "%d conversions differ from the reference", bad);
    CHECK_STATUS(mst_st_read(&s, ec, MST_ST_F32, ga), MST_ERR_INVALID);
    CHECK_MESSAGE("I32");
    mst_st_close(&s);

    /* a damaged data byte: the header's hash says so */
    f = mst_test_slurp(path, &n);
    f[n - 30] ^= 4;
    spit(path, f, (size_t)n);
    free(f);
    CHECK_OK(mst_st_open(path, &s));
    CHECK_STATUS(mst_st_verify(&s), MST_ERR_INVALID);
    CHECK_MESSAGE("damaged");
    mst_st_close(&s);
}

static void f16(const char* dir) {
    char path[512];
    snprintf(path, sizeof path, "%s/h.safetensors", dir);
    const uint16_t h[6] = {0x3C00, 0xC000, 0x0001, 0x7BFF, 0x3555, 0x8400};
    const double want[6] = {1.0, -2.0, ldexp(1.0, -24), 65504.0, 0.333251953125, -ldexp(1.0, -14)};
    by_hand(path, "{\"h\":{\"dtype\":\"F16\",\"shape\":[2,3],\"data_offsets\":[0,12]}}", h, sizeof h);
    mst_st_file s;
    CHECK_OK(mst_st_open(path, &s));
    float got[6];
    memset(got, 0xFF, sizeof got);
    const mst_st_entry* e = mst_st_find(&s, "h");
    CHECK(e != NULL, "no h");
    if (e) CHECK_OK(mst_st_read(&s, e, MST_ST_F32, got));
    for (int i = 0; i < 6; i++) CHECK(got[i] == (float)want[i], "F16 %04x -> %g, expected %g", h[i], got[i], want[i]);
    mst_st_close(&s);
}

/* Headers that lie about where the tensors are. */
static void lies(const char* dir) {
    char path[512];
    snprintf(path, sizeof path, "%s/bad.safetensors", dir);
    unsigned char data[64];
    for (int i = 0; i < 64; i++) data[i] = (unsigned char)(i * 37 + 1);
    static const struct { const char* json; size_t n; const char* want; } cases[] = {
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}", 20,
         "bytes [8, 12) to no tensor"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12,
         "overlaps"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 12, "runs past"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 12, "trailing"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "hold 8 bytes, its shape and dtype 12"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", 16,
         "twice"},
        {"{\"a\":{\"dtype\":\"Q4\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "dtype 'Q4'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, "begin <= end"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "data_offsets"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8, "not JSON"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        by_hand(path, cases[k].json, data, cases[k].n);
        mst_st_file s;
        CHECK_STATUS(mst_st_open(path, &s), MST_ERR_INVALID);
        CHECK_MESSAGE(cases[k].want);
        CHECK_MESSAGE(path);
    }
    /* a header longer than the file */
    unsigned char b[16] = {200, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    spit(path, b, sizeof b);
    mst_st_file s;
    CHECK_STATUS(mst_st_open(path, &s), MST_ERR_INVALID);
    CHECK_MESSAGE("truncated");
    spit(path, b, 5);
    CHECK_STATUS(mst_st_open(path, &s), MST_ERR_INVALID);
    CHECK_MESSAGE("no header");
}

/* ---- config.json ---- */

static mst_model_config tiny_model(void) {
    return (mst_model_config){.vocab = 300, .hidden = 64, .ffn = 24, .n_head = 4, .n_kv_head = 2, .head_dim = 16,
                              .rope_theta = 1e6f, .norm_topk_prob = 1, .tie_embeddings = 0, .seq = 8, .batch = 2,
                              .layers = 3, .experts = 8, .top_k = 2, .ep = 1, .norm_eps = 1e-6f, .aux_coef = 0.001f};
}

static void write_text(const char* dir, const char* text) {
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    spit(path, text, strlen(text));
}

static void config(const char* dir) {
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    const mst_model_config c = tiny_model();
    CHECK_OK(mst_hf_write_config(path, &c));
    mst_model_config r = {.seq = 8, .batch = 2, .ep = 1};
    CHECK_OK(mst_hf_read_config(dir, &r));
    CHECK(r.vocab == 300 && r.hidden == 64 && r.ffn == 24 && r.n_head == 4 && r.n_kv_head == 2 && r.head_dim == 16 &&
              r.rope_theta == 1e6f && r.norm_topk_prob == 1 && r.tie_embeddings == 0 && r.layers == 3 && r.experts == 8 &&
              r.top_k == 2 && r.norm_eps == 1e-6f && r.aux_coef == 0.001f,
          "config read back differs");
    long n = 0;
    unsigned char* t = mst_test_slurp(path, &n);
    CHECK(t && strstr((char*)t, "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 1000000.0}") &&
              strstr((char*)t, "\"model_type\": \"qwen3_moe\"") && strstr((char*)t, "\"torch_dtype\": \"bfloat16\""),
          "config.json: %s", t ? (char*)t : "(none)");
    free(t);

    static const struct { const char* text; const char* want; } bad[] = {
        {"{\"model_type\": \"llama\"}", "model_type"},
        {"{\"hidden_size\": 64}", "model_type"},
        {"{\"model_type\": \"qwen3_moe\", \"vocab_size\": 256}", "hidden_size missing"},
        {"{\"model_type\": \"qwen3_moe\", \"vocab_size\": 256, \"hidden_size\": 64, \"moe_intermediate_size\": 8, "
         "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 3, \"num_experts\": 4, "
         "\"num_experts_per_tok\": 2}", "num_key_value_heads"},
        {"{\"model_type\": \"qwen3_moe\", \"vocab_size\": 256, \"hidden_size\": 64, \"moe_intermediate_size\": 8, "
         "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_experts\": 4, \"num_local_experts\": 8, "
         "\"num_experts_per_tok\": 2}", "num_local_experts"},
        {"{\"model_type\": \"qwen3_moe\", \"vocab_size\": 256, \"hidden_size\": 64, \"moe_intermediate_size\": 8, "
         "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_experts\": 4, \"num_experts_per_tok\": 2, "
         "\"mlp_only_layers\": [1]}", "mlp_only_layers"},
        {"{\"model_type\": \"qwen3_moe\", \"vocab_size\": 256, \"hidden_size\": 64, \"moe_intermediate_size\": 8, "
         "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_experts\": 4, \"num_experts_per_tok\": 2, "
         "\"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 4.0}}", "rope_type"},
        {"{\"model_type\": \"qwen3_moe\", \"vocab_size\": -3}", "vocab_size"},
        {"[1, 2]", "not a JSON object"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        write_text(dir, bad[k].text);
        mst_model_config x = tiny_model();
        CHECK_STATUS(mst_hf_read_config(dir, &x), MST_ERR_INVALID);
        CHECK_MESSAGE(bad[k].want);
        CHECK_MESSAGE("config.json");
    }
    /* transformers 5's own spelling: num_local_experts, rope_parameters only, defaults for the rest */
    write_text(dir, "{\"model_type\": \"qwen3_moe\", \"vocab_size\": 256, \"hidden_size\": 64, \"moe_intermediate_size\": 8, "
                    "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_local_experts\": 4, \"num_experts_per_tok\": 2, "
                    "\"rope_parameters\": {\"rope_theta\": 5000.0, \"rope_type\": \"default\"}}");
    mst_model_config x = tiny_model();
    CHECK_OK(mst_hf_read_config(dir, &x));
    CHECK(x.experts == 4 && x.rope_theta == 5000.0f && x.n_kv_head == 4 && x.head_dim == 16 && x.norm_eps == 1e-6f &&
              x.tie_embeddings == 0 && x.norm_topk_prob == 0,
          "defaults: experts %d theta %g kv %lld D %lld", x.experts, (double)x.rope_theta, (long long)x.n_kv_head,
          (long long)x.head_dim);
}

/* ---- an index and its shards ---- */

static void index_json(const char* dir) {
    char p1[512], p2[512], pi[512];
    snprintf(p1, sizeof p1, "%s/model-00001-of-00002.safetensors", dir);
    snprintf(p2, sizeof p2, "%s/model-00002-of-00002.safetensors", dir);
    snprintf(pi, sizeof pi, "%s/model.safetensors.index.json", dir);
    const float x[4] = {1.5f, -2.25f, 3.0f, 0.125f};
    by_hand(p1, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", x, 8);
    by_hand(p2, "{\"b\":{\"dtype\":\"F32\",\"shape\":[1,2],\"data_offsets\":[0,8]}}", x + 2, 8);
    const char* idx = "{\"metadata\": {\"total_size\": 16}, \"weight_map\": {\"a\": \"model-00001-of-00002.safetensors\", "
                      "\"b\": \"model-00002-of-00002.safetensors\"}}";
    spit(pi, idx, strlen(idx));
    mst_hf* h = NULL;
    CHECK_OK(mst_hf_open_set(dir, "model", 1, &h));
    float got[2] = {NAN, NAN};
    const int64_t d2[2] = {1, 2}, d1[1] = {2};
    if (h) {
        CHECK(mst_hf_has(h, "a") && mst_hf_has(h, "b") && !mst_hf_has(h, "c"), "names");
        CHECK_OK(mst_hf_read(h, "b", 2, d2, MST_ST_F32, got));
        CHECK(got[0] == 3.0f && got[1] == 0.125f, "b read %g %g", got[0], got[1]);
        CHECK_STATUS(mst_hf_read(h, "b", 1, d1, MST_ST_F32, got), MST_ERR_INVALID);
        CHECK_MESSAGE("has shape [1, 2], config.json makes it [2]");
        CHECK_STATUS(mst_hf_read(h, "c", 1, d1, MST_ST_F32, got), MST_ERR_INVALID);
        CHECK_MESSAGE("no tensor 'c'");
        mst_hf_close(h);
    }
    mst_hf* none = (mst_hf*)1;
    CHECK_OK(mst_hf_open_set(dir, "mtp", 0, &none));
    CHECK(none == NULL, "an absent optional set is NULL");
    CHECK_STATUS(mst_hf_open_set(dir, "mtp", 1, &none), MST_ERR_INVALID);
    CHECK_MESSAGE("mtp.safetensors.index.json");

    /* the index names a tensor its shard lacks */
    idx = "{\"weight_map\": {\"a\": \"model-00002-of-00002.safetensors\", \"b\": \"model-00002-of-00002.safetensors\"}}";
    spit(pi, idx, strlen(idx));
    CHECK_STATUS(mst_hf_open_set(dir, "model", 1, &h), MST_ERR_INVALID);
    CHECK_MESSAGE("tensor 'a' is not in 'model-00002-of-00002.safetensors'");
    /* a shard missing */
    idx = "{\"weight_map\": {\"a\": \"model-00001-of-00002.safetensors\", \"b\": \"model-00003-of-00002.safetensors\"}}";
    spit(pi, idx, strlen(idx));
    CHECK_STATUS(mst_hf_open_set(dir, "model", 1, &h), MST_ERR_INVALID);
    CHECK_MESSAGE("model-00003-of-00002.safetensors");
    idx = "{\"weight_map\": {\"a\": \"../model-00001-of-00002.safetensors\"}}";
    spit(pi, idx, strlen(idx));
    CHECK_STATUS(mst_hf_open_set(dir, "model", 1, &h), MST_ERR_INVALID);
    CHECK_MESSAGE("not a file name");
}

/* ---- the parameter table ---- */

static int cmp_name(const void* a, const void* b) {
    return strcmp(((const mst_hf_param*)a)->name, ((const mst_hf_param*)b)->name);
}

static void params(void) {
    mst_model_config c = tiny_model();
    for (int tie = 0; tie < 2; tie++) {
        c.tie_embeddings = tie;
        const int32_t n = mst_hf_n_params(&c);
        CHECK(n == 3 * (9 + 24) + 2 + !tie + 4 + (9 + 24), "%d tensors", n);
        mst_hf_param* p = (mst_hf_param*)malloc(sizeof *p * (size_t)n);
        mst_hf_params(&c, NULL, p);
        int64_t elems = 0;
        int offs = 0;
        for (int32_t i = 0; i < n; i++) elems += mst_hf_numel(&p[i]), offs += p[i].off != -1;
        CHECK(offs == 0, "%d offsets without a model", offs);
        /* V H (+ V H untied) + H + per layer (2H + (NH+2KV) D H + H NH D + 2D + E H + 3 E F H), L + 1 layers, MTP 2H + 2H^2 + H */
        const int64_t layer = 2 * 64 + (4 + 4) * 16 * 64 + 64 * 64 + 2 * 16 + 8 * 64 + 3 * 8 * 24 * 64;
        const int64_t want = 300 * 64 * (2 - tie) + 64 + 4 * layer + 3 * 64 + 2 * 64 * 64;
        CHECK(elems == want, "%lld elements, expected %lld", (long long)elems, (long long)want);
        CHECK(strcmp(p[0].name, "model.embed_tokens.weight") == 0 && strcmp(p[2].name, "model.layers.0.self_attn.q_proj.weight") == 0 &&
                  p[3].dims[0] == 32 && strcmp(p[3].name, "model.layers.0.self_attn.k_proj.weight") == 0,
              "first names: %s %s %s", p[0].name, p[2].name, p[3].name);
        const mst_hf_param* up = &p[1 + 9 + 3 * 5 + 1]; /* layer 0, expert 5's up_proj */
        CHECK(strcmp(up->name, "model.layers.0.mlp.experts.5.up_proj.weight") == 0 && up->expert == 5 && up->dims[0] == 24 &&
                  up->dims[1] == 64, "%s expert %d", up->name, up->expert);
        const mst_hf_param* mtp = &p[n - (9 + 24) - 2];
        CHECK(strcmp(mtp->name, "model.layers.3.eh_proj.weight") == 0 && mtp->set == MST_HF_MTP && mtp->dims[1] == 128,
              "%s", mtp->name);
        qsort(p, (size_t)n, sizeof *p, cmp_name);
        for (int32_t i = 1; i < n; i++) CHECK(strcmp(p[i - 1].name, p[i].name) != 0, "%s twice", p[i].name);
        free(p);
    }
}

static void run(mst_ctx_t* ctx) {
    (void)ctx;
    char dir[128];
    if (!mst_test_tmpdir(dir, sizeof dir, "mst_hf")) {
        CHECK(0, "no temporary directory");
        return;
    }
    write_read(dir);
    f16(dir);
    lies(dir);
    config(dir);
    index_json(dir);
    params();
    mst_test_rmtree(dir);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
