/*
 * hf_params.c — the trainer's parameters by their Hugging Face names
 * (hf.h): each hub tensor is one contiguous slice of the flat buffers
 * (model.h: wqkv's q, k, v row blocks; w1's gate and up halves per expert;
 * w2 per expert).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hf.h"

int64_t mst_hf_kv_heads(const mst_model_config* c) { return c->n_kv_head > 0 ? c->n_kv_head : c->n_head; }
int64_t mst_hf_head_dim(const mst_model_config* c) {
    return c->head_dim > 0 ? c->head_dim : c->n_head > 0 ? c->hidden / c->n_head : 0;
}

int64_t mst_hf_numel(const mst_hf_param* p) { return p->nd == 1 ? p->dims[0] : p->dims[0] * p->dims[1]; }

static int32_t per_layer(const mst_model_config* c) { return 9 + 3 * c->experts; }

int32_t mst_hf_n_params(const mst_model_config* c) {
    return 2 + !c->tie_embeddings + c->layers * per_layer(c) + 4 + per_layer(c);
}

typedef struct table {
    mst_hf_param* p;
    int32_t n;
    int32_t set, layer;
} table;

static void add(table* t, const char* prefix, const char* name, int64_t off, int64_t d0, int64_t d1, int32_t expert) {
    mst_hf_param* p = &t->p[t->n++];
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s%s", prefix, name);
    p->nd = d1 ? 2 : 1;
    p->dims[0] = d0, p->dims[1] = d1;
    p->set = t->set, p->layer = t->layer, p->expert = expert;
    p->off = off;
}

/* off + k when the model is given (base >= 0), else -1. */
static int64_t at(int64_t base, int64_t k) { return base >= 0 ? base + k : -1; }

static void layer(table* t, const mst_model_config* c, const mst_model* m, int32_t l) {
    const int64_t H = c->hidden, F = c->ffn, NH = c->n_head, KV = mst_hf_kv_heads(c), D = mst_hf_head_dim(c);
    const mst_layer_params* q = m && m->lp[l].ln1 >= 0 ? &m->lp[l] : NULL; /* NULL: another stage's */
    char pre[48];
    snprintf(pre, sizeof pre, "model.layers.%d.", l);
    t->layer = l;
    add(t, pre, "input_layernorm.weight", q ? q->ln1 : -1, H, 0, -1);
    add(t, pre, "self_attn.q_proj.weight", q ? q->wqkv : -1, NH * D, H, -1);
    add(t, pre, "self_attn.k_proj.weight", at(q ? q->wqkv : -1, NH * D * H), KV * D, H, -1);
    add(t, pre, "self_attn.v_proj.weight", at(q ? q->wqkv : -1, (NH + KV) * D * H), KV * D, H, -1);
    add(t, pre, "self_attn.o_proj.weight", q ? q->wo : -1, H, NH * D, -1);
    add(t, pre, "self_attn.q_norm.weight", q ? q->q_norm : -1, D, 0, -1);
    add(t, pre, "self_attn.k_norm.weight", q ? q->k_norm : -1, D, 0, -1);
    add(t, pre, "post_attention_layernorm.weight", q ? q->ln2 : -1, H, 0, -1);
    add(t, pre, "mlp.gate.weight", q ? q->wr : -1, c->experts, H, -1);
    /* W ranks: this rank's experts are [first, first + El) */
    const int32_t El = m ? m->n_local : c->experts, first = m ? m->dist.rank * El : 0;
    char name[64];
    for (int32_t e = 0; e < c->experts; e++) {
        const int32_t le = e - first;
        const int here = q && le >= 0 && le < El;
        const int64_t w1 = here ? q->w1 + (int64_t)le * 2 * F * H : -1, w2 = here ? q->w2 + (int64_t)le * H * F : -1;
        snprintf(name, sizeof name, "mlp.experts.%d.gate_proj.weight", e);
        add(t, pre, name, w1, F, H, e);
        snprintf(name, sizeof name, "mlp.experts.%d.up_proj.weight", e);
        add(t, pre, name, at(w1, F * H), F, H, e);
        snprintf(name, sizeof name, "mlp.experts.%d.down_proj.weight", e);
        add(t, pre, name, w2, H, F, e);
    }
}

void mst_hf_params(const mst_model_config* c, const mst_model* m, mst_hf_param* out) {
    const int64_t H = c->hidden;
    table t = {out, 0, MST_HF_MODEL, -1};
    add(&t, "", "model.embed_tokens.weight", m ? m->emb : -1, c->vocab, H, -1);
    for (int32_t l = 0; l < c->layers; l++) layer(&t, c, m, l);
    t.layer = -1;
    add(&t, "", "model.norm.weight", m ? m->lnf : -1, H, 0, -1);
    if (!c->tie_embeddings) add(&t, "", "lm_head.weight", m ? m->head : -1, c->vocab, H, -1);
    /* the MTP module, DeepSeek-V3's names: eh_proj takes [enorm(emb) | hnorm(h)] */
    t.set = MST_HF_MTP;
    t.layer = c->layers;
    char pre[48];
    snprintf(pre, sizeof pre, "model.layers.%d.", c->layers);
    add(&t, pre, "enorm.weight", m ? m->ln_e : -1, H, 0, -1);
    add(&t, pre, "hnorm.weight", m ? m->ln_h : -1, H, 0, -1);
    add(&t, pre, "eh_proj.weight", m ? m->proj : -1, H, 2 * H, -1);
    add(&t, pre, "shared_head.norm.weight", m ? m->ln_mf : -1, H, 0, -1);
    layer(&t, c, m, c->layers);
    MST_ASSERT(t.n == mst_hf_n_params(c));
}

static int by_off(const void* a, const void* b) {
    const int64_t x = (*(const mst_hf_param* const*)a)->off, y = (*(const mst_hf_param* const*)b)->off;
    return x < y ? -1 : x > y;
}

mst_status mst_hf_params_check(const mst_hf_param* p, int32_t np, const mst_model* m) {
    const mst_hf_param** o = (const mst_hf_param**)malloc(sizeof *o * (size_t)np);
    if (!o) return mst_set_error(MST_ERR_OOM, "parameter names: %d", np);
    int32_t n = 0;
    for (int32_t i = 0; i < np; i++)
        if (p[i].off >= 0) o[n++] = &p[i];
    qsort(o, (size_t)n, sizeof *o, by_off);
    int64_t at = 0;
    mst_status st = MST_OK;
    for (int32_t i = 0; i < n && st == MST_OK; i++) {
        if (o[i]->off != at)
            st = mst_set_error(MST_ERR_STATE, "parameter names: '%s' at element %lld, the one before it ends at %lld (model.h's "
                               "layout and hf_params.c disagree)", o[i]->name, (long long)o[i]->off, (long long)at);
        at = o[i]->off + mst_hf_numel(o[i]);
    }
    if (st == MST_OK && at != m->n_params)
        st = mst_set_error(MST_ERR_STATE, "parameter names: they cover %lld of the model's %lld elements (model.h's layout and "
                           "hf_params.c disagree)", (long long)at, (long long)m->n_params);
    free(o);
    return st;
}
