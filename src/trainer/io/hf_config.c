/*
 * hf_config.c — config.json of a Qwen3-MoE model (hf.h), read strictly and
 * written with the fields transformers' Qwen3MoeConfig reads (transformers
 * 5: "rope_parameters"; "rope_theta" beside it for older readers).
 */
#define _POSIX_C_SOURCE 200809L /* fileno, fsync */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hf.h"
#include "json.h"

/* ---- reading ---------------------------------------------------------------- */

typedef struct reader {
    const char* path;
    const mst_json* j;
} reader;

static mst_status bad(const reader* r, const char* key, const char* why) {
    return mst_set_error(MST_ERR_INVALID, "'%s': %s %s", r->path, key, why);
}

/* An integer field in [lo, hi]; absent: *out = dflt when dflt >= lo, else an error. */
static mst_status get_int(const reader* r, const char* key, int64_t lo, int64_t hi, int64_t dflt, int64_t* out) {
    const int32_t t = mst_json_get(r->j, 0, key);
    if (t < 0) return dflt >= lo ? (*out = dflt, MST_OK) : bad(r, key, "missing");
    char why[96];
    snprintf(why, sizeof why, "is not an integer in [%lld, %lld]", (long long)lo, (long long)hi);
    return mst_json_i64(r->j, t, out) || *out < lo || *out > hi ? bad(r, key, why) : MST_OK;
}

static mst_status get_num(const reader* r, int32_t obj, const char* key, double lo, double hi, double dflt, double* out) {
    const int32_t t = mst_json_get(r->j, obj, key);
    if (t < 0) return (*out = dflt, MST_OK);
    char why[96];
    snprintf(why, sizeof why, "is not a number in [%g, %g]", lo, hi);
    return mst_json_f64(r->j, t, out) || !(*out >= lo && *out <= hi) ? bad(r, key, why) : MST_OK;
}

/* A boolean field (absent: dflt). */
static mst_status get_bool(const reader* r, const char* key, int dflt, int32_t* out) {
    const int32_t t = mst_json_get(r->j, 0, key);
    if (t < 0) return (*out = dflt, MST_OK);
    if (mst_json_eq(r->j, t, "true") || mst_json_eq(r->j, t, "false"))
        return (*out = mst_json_eq(r->j, t, "true"), MST_OK);
    return bad(r, key, "is not true or false");
}

/* A string field that must be `want` when present. */
static mst_status want_str(const reader* r, int32_t obj, const char* key, const char* want, const char* why) {
    const int32_t t = mst_json_get(r->j, obj, key);
    if (t < 0 || (r->j->tok[t].kind == MST_JSON_STRING && mst_json_eq(r->j, t, want))) return MST_OK;
    char got[64] = "?", msg[256];
    mst_json_str(r->j, t, got, sizeof got);
    snprintf(msg, sizeof msg, "is '%s': %s", got, why);
    return bad(r, key, msg);
}

/* Fields that would make it another model than the trainer's. */
static mst_status features(const reader* r, const mst_model_config* c) {
    int64_t sparse = 1;
    MST_TRY(get_int(r, "decoder_sparse_step", 1, 1, 1, &sparse));
    const int32_t dense = mst_json_get(r->j, 0, "mlp_only_layers");
    if (dense >= 0 && (r->j->tok[dense].kind != MST_JSON_ARRAY || r->j->tok[dense].n_children))
        return bad(r, "mlp_only_layers", "lists dense MLP layers: the trainer's layers are all MoE layers");
    int32_t flag = 0;
    MST_TRY(get_bool(r, "attention_bias", 0, &flag));
    if (flag) return bad(r, "attention_bias", "is true: the trainer's attention has no biases");
    MST_TRY(get_bool(r, "use_sliding_window", 0, &flag));
    if (flag) return bad(r, "use_sliding_window", "is true: the trainer's attention is full causal");
    MST_TRY(want_str(r, 0, "hidden_act", "silu", "the trainer's experts are SwiGLU (silu)"));
    const int32_t rp = mst_json_get(r->j, 0, "rope_parameters");
    if (rp >= 0) MST_TRY(want_str(r, rp, "rope_type", "default", "the trainer's rotary embedding is the default one"));
    if (c->n_head % c->n_kv_head != 0) return bad(r, "num_key_value_heads", "does not divide num_attention_heads");
    if (c->top_k > c->experts) return bad(r, "num_experts_per_tok", "is above the number of experts");
    return MST_OK;
}

/* num_experts (the hub's name) or num_local_experts (transformers 5's), the same when both. */
static mst_status experts(const reader* r, int64_t* out) {
    int64_t a = -1, b = -1;
    if (mst_json_get(r->j, 0, "num_experts") >= 0) MST_TRY(get_int(r, "num_experts", 1, 1 << 16, -1, &a));
    if (mst_json_get(r->j, 0, "num_local_experts") >= 0) MST_TRY(get_int(r, "num_local_experts", 1, 1 << 16, -1, &b));
    if (a < 0 && b < 0) return bad(r, "num_experts", "missing (nor num_local_experts)");
    if (a >= 0 && b >= 0 && a != b) return bad(r, "num_experts", "differs from num_local_experts");
    *out = a >= 0 ? a : b;
    return MST_OK;
}

/* rope_parameters.rope_theta, else rope_theta, else 10000. */
static mst_status rope(const reader* r, double* theta) {
    const int32_t rp = mst_json_get(r->j, 0, "rope_parameters");
    double top = 0;
    MST_TRY(get_num(r, 0, "rope_theta", 1, 1e12, 10000.0, &top));
    if (rp < 0) return (*theta = top, MST_OK);
    if (r->j->tok[rp].kind != MST_JSON_OBJECT) return bad(r, "rope_parameters", "is not an object");
    return get_num(r, rp, "rope_theta", 1, 1e12, top, theta);
}

static mst_status parse(const reader* r, mst_model_config* out) {
    MST_TRY(want_str(r, 0, "model_type", "qwen3_moe", "this reads Qwen3-MoE models (model_type 'qwen3_moe')"));
    if (mst_json_get(r->j, 0, "model_type") < 0) return bad(r, "model_type", "missing (expected 'qwen3_moe')");
    mst_model_config c = *out;
    int64_t v = 0;
    double x = 0;
    MST_TRY(get_int(r, "vocab_size", 1, INT32_MAX, -1, &c.vocab));
    MST_TRY(get_int(r, "hidden_size", 1, 1 << 20, -1, &c.hidden));
    MST_TRY(get_int(r, "moe_intermediate_size", 1, 1 << 20, -1, &c.ffn));
    MST_TRY(get_int(r, "num_hidden_layers", 1, 4096, -1, &v));
    c.layers = (int32_t)v;
    MST_TRY(get_int(r, "num_attention_heads", 1, 1 << 16, -1, &c.n_head));
    MST_TRY(get_int(r, "num_key_value_heads", 1, 1 << 16, c.n_head, &c.n_kv_head));
    MST_TRY(get_int(r, "head_dim", 1, 1 << 16, c.hidden / c.n_head >= 1 ? c.hidden / c.n_head : -1, &c.head_dim));
    MST_TRY(experts(r, &v));
    c.experts = (int32_t)v;
    MST_TRY(get_int(r, "num_experts_per_tok", 1, 1 << 16, -1, &v));
    c.top_k = (int32_t)v;
    MST_TRY(get_bool(r, "norm_topk_prob", 0, &c.norm_topk_prob));
    MST_TRY(get_bool(r, "tie_word_embeddings", 0, &c.tie_embeddings));
    MST_TRY(get_num(r, 0, "rms_norm_eps", 0, 1, 1e-6, &x));
    c.norm_eps = (float)x;
    MST_TRY(get_num(r, 0, "router_aux_loss_coef", 0, 1e3, 0.001, &x));
    c.aux_coef = (float)x;
    MST_TRY(rope(r, &x));
    c.rope_theta = (float)x;
    MST_TRY(features(r, &c));
    *out = c;
    return MST_OK;
}

mst_status mst_hf_read_config(const char* dir, mst_model_config* cfg) {
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE* f = fopen(path, "rb");
    if (!f) return mst_set_error(MST_ERR_INVALID, "'%s': %s (not a Hugging Face model directory)", path, strerror(errno));
    enum { CAP = 1 << 20 };
    char* text = (char*)malloc(CAP);
    const size_t n = text ? fread(text, 1, CAP, f) : 0;
    fclose(f);
    if (!text) return mst_set_error(MST_ERR_OOM, "'%s'", path);
    mst_json j = {0};
    size_t err_at = 0;
    mst_status st = n == CAP ? mst_set_error(MST_ERR_INVALID, "'%s': over 1 MiB (not a config.json)", path)
                    : mst_json_parse(text, n, &j, &err_at) ? mst_set_error(MST_ERR_INVALID, "'%s': not JSON (byte %zu)", path, err_at)
                    : j.tok[0].kind != MST_JSON_OBJECT ? mst_set_error(MST_ERR_INVALID, "'%s': not a JSON object", path)
                                                       : MST_OK;
    if (st == MST_OK) {
        const reader r = {path, &j};
        st = parse(&r, cfg);
    }
    mst_json_free(&j);
    free(text);
    return st;
}

/* ---- the fields by name ---- */

#define FIELD(key, flag, member, type) {key, flag, offsetof(mst_model_config, member), type}
static const mst_hf_field fields[] = {
    FIELD("vocab_size", "--vocab", vocab, 0), FIELD("hidden_size", "--hidden", hidden, 0),
    FIELD("moe_intermediate_size", "--ffn", ffn, 0), FIELD("num_hidden_layers", "--layers", layers, 1),
    FIELD("num_attention_heads", "--heads", n_head, 0), FIELD("num_key_value_heads", "--kv-heads", n_kv_head, 0),
    FIELD("head_dim", "--head-dim", head_dim, 0), FIELD("num_experts", "--experts", experts, 1),
    FIELD("num_experts_per_tok", "--top-k", top_k, 1), FIELD("rope_theta", "--rope-theta", rope_theta, 2),
    FIELD("norm_topk_prob", "--norm-topk-prob", norm_topk_prob, 1), FIELD("tie_word_embeddings", "--tie-embeddings", tie_embeddings, 1),
    FIELD("rms_norm_eps", NULL, norm_eps, 2),
};
#undef FIELD

const mst_hf_field* mst_hf_fields(int32_t* n) {
    *n = (int32_t)(sizeof fields / sizeof fields[0]);
    return fields;
}

/* Field f of c as config.json states it (the defaults of 0 spelled out). */
static double field_value(const mst_model_config* c, int32_t f) {
    const char* p = (const char*)c + fields[f].off;
    if (fields[f].off == offsetof(mst_model_config, n_kv_head)) return (double)mst_hf_kv_heads(c);
    if (fields[f].off == offsetof(mst_model_config, head_dim)) return (double)mst_hf_head_dim(c);
    if (fields[f].off == offsetof(mst_model_config, rope_theta)) return c->rope_theta > 0 ? (double)c->rope_theta : 10000.0;
    return fields[f].type == 0 ? (double)*(const int64_t*)p : fields[f].type == 1 ? (double)*(const int32_t*)p : (double)*(const float*)p;
}

int32_t mst_hf_config_diff(const mst_model_config* a, const mst_model_config* b) {
    for (int32_t f = 0; f < (int32_t)(sizeof fields / sizeof fields[0]); f++)
        if (field_value(a, f) != field_value(b, f)) return f;
    return -1;
}

void mst_hf_field_str(const mst_model_config* c, int32_t f, char* buf, size_t cap) { snprintf(buf, cap, "%.9g", field_value(c, f)); }

/* ---- writing ---------------------------------------------------------------- */

/* A float as a JSON number that reads back as a float (a point or exponent kept). */
static void number(char* buf, size_t cap, double x) {
    if (x == (double)(int64_t)x && x > -1e15 && x < 1e15) { /* whole: 10000.0, 1000000.0 */
        snprintf(buf, cap, "%.1f", x);
        return;
    }
    for (int digits = 6; digits <= 9; digits++) { /* the shortest that reads back as the same float */
        snprintf(buf, cap, "%.*g", digits, x);
        if (strtof(buf, NULL) == (float)x) break;
    }
    if (!strpbrk(buf, ".eEn")) strncat(buf, ".0", cap - strlen(buf) - 1);
}

mst_status mst_hf_write_config(const char* path, const mst_model_config* c) {
    FILE* f = fopen(path, "w");
    if (!f) return mst_set_error(MST_ERR_IO, "'%s': %s", path, strerror(errno));
    char theta[32], eps[32], aux[32], std[32];
    number(theta, sizeof theta, c->rope_theta > 0 ? c->rope_theta : 10000.0);
    number(eps, sizeof eps, c->norm_eps);
    number(aux, sizeof aux, c->aux_coef);
    number(std, sizeof std, c->init_std);
    const char* tf[2] = {"false", "true"};
    fprintf(f, "{\n  \"architectures\": [\"Qwen3MoeForCausalLM\"],\n  \"model_type\": \"qwen3_moe\",\n");
    fprintf(f, "  \"vocab_size\": %lld,\n  \"hidden_size\": %lld,\n  \"moe_intermediate_size\": %lld,\n"
               "  \"intermediate_size\": %lld,\n  \"num_hidden_layers\": %d,\n  \"num_attention_heads\": %lld,\n"
               "  \"num_key_value_heads\": %lld,\n  \"head_dim\": %lld,\n",
            (long long)c->vocab, (long long)c->hidden, (long long)c->ffn, (long long)(c->ffn * c->top_k), c->layers,
            (long long)c->n_head, (long long)mst_hf_kv_heads(c), (long long)mst_hf_head_dim(c));
    fprintf(f, "  \"rope_theta\": %s,\n  \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": %s},\n", theta, theta);
    fprintf(f, "  \"max_position_embeddings\": %lld,\n  \"rms_norm_eps\": %s,\n  \"num_experts\": %d,\n"
               "  \"num_experts_per_tok\": %d,\n  \"norm_topk_prob\": %s,\n  \"router_aux_loss_coef\": %s,\n"
               "  \"output_router_logits\": false,\n  \"tie_word_embeddings\": %s,\n",
            (long long)(c->seq > 32768 ? c->seq : 32768), eps, c->experts, c->top_k, tf[c->norm_topk_prob != 0], aux,
            tf[c->tie_embeddings != 0]);
    fprintf(f, "  \"decoder_sparse_step\": 1,\n  \"mlp_only_layers\": [],\n  \"hidden_act\": \"silu\",\n"
               "  \"attention_bias\": false,\n  \"attention_dropout\": 0.0,\n  \"use_sliding_window\": false,\n"
               "  \"initializer_range\": %s,\n  \"use_cache\": true,\n  \"torch_dtype\": \"bfloat16\",\n"
               "  \"dtype\": \"bfloat16\"\n}\n", std);
    int bad = ferror(f) || fflush(f) != 0 || fsync(fileno(f)) != 0;
    bad |= fclose(f) != 0;
    return bad ? mst_set_error(MST_ERR_IO, "'%s': write failed: %s", path, strerror(errno)) : MST_OK;
}
