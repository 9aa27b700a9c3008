/*
 * ckpt_load.c — reading tensors into a model (checkpoint.h): resume (the
 * bf16 weights and optimizer state bit for bit), --init-from (a Hugging
 * Face model's weights, any float dtype), and --dump-grads' file.
 */
#define _POSIX_C_SOURCE 200809L /* rename */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint.h"

/* The parameter table of m (*p malloc'd, checked against m's layout) and its count. */
static mst_status table_of(const mst_model* m, mst_hf_param** p, int32_t* np) {
    *np = mst_hf_n_params(&m->cfg);
    *p = (mst_hf_param*)malloc(sizeof **p * (size_t)*np);
    if (!*p) return mst_set_error(MST_ERR_OOM, "checkpoint: %d names", *np);
    mst_hf_params(&m->cfg, m, *p);
    return mst_hf_params_check(*p, *np, m);
}

static int cmp_param(const void* a, const void* b) {
    return strcmp(((const mst_hf_param*)a)->name, ((const mst_hf_param*)b)->name);
}

/* Every tensor of the open set h is one of the model's (of set `which`, or
 * any when -1), under `prefix` + its name; and there are `want` of them. */
static mst_status only_params(const mst_hf* h, const mst_hf_param* p, int32_t np, int32_t which, int32_t kinds,
                              const char* const* prefixes) {
    mst_hf_param* sorted = (mst_hf_param*)malloc(sizeof *sorted * (size_t)np);
    if (!sorted) return mst_set_error(MST_ERR_OOM, "checkpoint: %d names", np);
    int64_t want = 0;
    for (int32_t i = 0; i < np; i++)
        if (which < 0 || p[i].set == which) sorted[want++] = p[i];
    qsort(sorted, (size_t)want, sizeof *sorted, cmp_param);
    mst_status st = MST_OK;
    for (int64_t i = 0; st == MST_OK && i < mst_hf_n_tensors(h); i++) {
        const char* path = NULL;
        const char* name = mst_hf_tensor_name(h, i, &path);
        int known = 0;
        for (int32_t k = 0; k < kinds && !known; k++) {
            const size_t n = strlen(prefixes[k]);
            mst_hf_param key;
            if (strncmp(name, prefixes[k], n) != 0 || strlen(name + n) >= sizeof key.name) continue;
            strcpy(key.name, name + n);
            known = bsearch(&key, sorted, (size_t)want, sizeof *sorted, cmp_param) != NULL;
        }
        if (!known)
            st = mst_set_error(MST_ERR_INVALID, "'%s': tensor '%s' is not a parameter of the model config.json describes", path, name);
    }
    if (st == MST_OK && mst_hf_n_tensors(h) != want * kinds)
        st = mst_set_error(MST_ERR_INVALID, "'%s': %lld tensors, the model config.json describes has %lld", mst_hf_dir(h),
                           (long long)mst_hf_n_tensors(h), (long long)(want * kinds));
    free(sorted);
    return st;
}

/* Tensor prefix + p->name is in h with p's shape (and dtype, when
 * dtype >= 0). */
static mst_status present(const mst_hf* h, const mst_hf_param* p, const char* prefix, int dtype) {
    char name[MST_ST_NAME];
    snprintf(name, sizeof name, "%s%s", prefix, p->name);
    const char* path = NULL;
    const mst_st_entry* e = mst_hf_entry(h, name, &path);
    if (!e) return mst_set_error(MST_ERR_INVALID, "'%s': no tensor '%s' (missing)", mst_hf_dir(h), name);
    if (dtype >= 0 && e->dtype != (mst_st_dtype)dtype)
        return mst_set_error(MST_ERR_INVALID, "'%s': tensor '%s' is %s, a checkpoint's is %s", path, name,
                             mst_st_dtype_str(e->dtype), mst_st_dtype_str((mst_st_dtype)dtype));
    if (e->dtype != MST_ST_F32 && e->dtype != MST_ST_BF16 && e->dtype != MST_ST_F16)
        return mst_set_error(MST_ERR_INVALID, "'%s': tensor '%s' is %s (expected F32, BF16 or F16)", path, name,
                             mst_st_dtype_str(e->dtype));
    return mst_hf_check_shape(h, name, p->nd, p->dims);
}

/* Reads prefix + p->name (converted to `to`) into the backend buffer base
 * at p's offset (elem bytes per element) through host [numel]. */
static mst_status into(mst_model* m, const mst_hf* h, const mst_hf_param* p, const char* prefix, mst_st_dtype to, void* base,
                       void* host) {
    char name[MST_ST_NAME];
    snprintf(name, sizeof name, "%s%s", prefix, p->name);
    const size_t elem = to == MST_ST_BF16 ? 2 : 4;
    MST_TRY(mst_hf_read(h, name, p->nd, p->dims, to, host));
    return mst_copy_h2b(m->ctx, (char*)base + (size_t)p->off * elem, host, (size_t)mst_hf_numel(p) * elem);
}

/* Reads prefix + p->name (F32) into optimizer state buffer k (0 master, 1
 * adam_m, 2 adam_v) where this rank holds it, through host [numel]. */
static mst_status into_state(mst_model* m, const mst_hf* h, const mst_hf_param* p, const char* prefix, int k, float* host) {
    char name[MST_ST_NAME];
    snprintf(name, sizeof name, "%s%s", prefix, p->name);
    MST_TRY(mst_hf_read(h, name, p->nd, p->dims, MST_ST_F32, host));
    return mst_optim_state_put(m, k, p->off, mst_hf_numel(p), host);
}

static int64_t biggest(const mst_hf_param* p, int32_t np) {
    int64_t b = 1;
    for (int32_t i = 0; i < np; i++) b = mst_hf_numel(&p[i]) > b ? mst_hf_numel(&p[i]) : b;
    return b;
}

static const char* const opt_prefix[3] = {"master.", "adam_m.", "adam_v."};

mst_status mst_ckpt_load(mst_model* m, const char* dir) {
    int32_t np = 0;
    mst_hf_param* p = NULL;
    mst_hf *hw = NULL, *ho = NULL;
    mst_status st = table_of(m, &p, &np);
    if (st == MST_OK) st = mst_hf_open(dir, &hw);
    if (st == MST_OK) st = mst_hf_open_set(dir, "optimizer", 1, &ho);
    static const char* const none[1] = {""};
    /* every name, dtype and shape before any byte reaches the model */
    for (int32_t i = 0; st == MST_OK && i < np; i++) {
        if (p[i].off < 0) continue; /* another rank's expert */
        st = present(hw, &p[i], "", MST_ST_BF16);
        for (int k = 0; k < 3 && st == MST_OK; k++) st = present(ho, &p[i], opt_prefix[k], MST_ST_F32);
    }
    if (st == MST_OK) st = only_params(hw, p, np, -1, 1, none);
    if (st == MST_OK) st = only_params(ho, p, np, -1, 3, opt_prefix);
    void* host = st == MST_OK ? malloc((size_t)biggest(p, np) * 4) : NULL;
    if (st == MST_OK && !host) st = mst_set_error(MST_ERR_OOM, "checkpoint: staging");
    if (st == MST_OK) mst_hf_verify_on_read(hw), mst_hf_verify_on_read(ho);
    for (int32_t i = 0; st == MST_OK && i < np; i++) {
        if (p[i].off < 0) continue;
        st = into(m, hw, &p[i], "", MST_ST_BF16, m->w, host);
        for (int k = 0; k < 3 && st == MST_OK; k++) st = into_state(m, ho, &p[i], opt_prefix[k], k, (float*)host);
    }
    free(host);
    mst_hf_close(hw);
    mst_hf_close(ho);
    free(p);
    return st;
}

/* Set `which` of an HF directory holds exactly the model's tensors of that
 * set, each of its shape in a float dtype (every one, on every rank). */
static mst_status check_set(const mst_hf* h, const mst_hf_param* p, int32_t np, int32_t which) {
    static const char* const none[1] = {""};
    for (int32_t i = 0; i < np; i++)
        if (p[i].set == which) MST_TRY(present(h, &p[i], "", -1));
    return only_params(h, p, np, which, 1, none);
}

/* The model set and the MTP set (NULL when dir has none) of an HF
 * directory whose config.json is c, checked. */
static mst_status open_hf(const char* dir, const mst_model_config* c, const mst_hf_param* p, int32_t np, mst_hf** hw,
                          mst_hf** hm) {
    mst_model_config file = *c;
    MST_TRY(mst_hf_read_config(dir, &file));
    const int32_t f = mst_hf_config_diff(&file, c);
    if (f >= 0) {
        int32_t n = 0;
        char a[32], b[32];
        mst_hf_field_str(&file, f, a, sizeof a);
        mst_hf_field_str(c, f, b, sizeof b);
        return mst_set_error(MST_ERR_INVALID, "'%s/config.json': %s %s, the model %s", dir, mst_hf_fields(&n)[f].key, a, b);
    }
    *hw = *hm = NULL;
    MST_TRY(mst_hf_open_set(dir, "model", 1, hw));
    MST_TRY(mst_hf_open_set(dir, "mtp", 0, hm));
    MST_TRY(check_set(*hw, p, np, MST_HF_MODEL));
    return *hm ? check_set(*hm, p, np, MST_HF_MTP) : MST_OK;
}

mst_status mst_ckpt_check_hf(const char* dir, const mst_model_config* c) {
    const int32_t np = mst_hf_n_params(c);
    mst_hf_param* p = (mst_hf_param*)malloc(sizeof *p * (size_t)np);
    if (!p) return mst_set_error(MST_ERR_OOM, "--init-from '%s': names", dir);
    mst_hf_params(c, NULL, p);
    mst_hf *hw = NULL, *hm = NULL;
    mst_status st = open_hf(dir, c, p, np, &hw, &hm);
    mst_hf_close(hw);
    mst_hf_close(hm);
    free(p);
    return st;
}

/* One set of an HF directory into m's master and bf16 weights (this rank's). */
static mst_status init_set(mst_model* m, const mst_hf* h, const mst_hf_param* p, int32_t np, int32_t which) {
    const int64_t big = biggest(p, np);
    float* host = (float*)malloc((size_t)big * 4);
    uint16_t* half = (uint16_t*)malloc((size_t)big * 2);
    mst_status st = host && half ? MST_OK : mst_set_error(MST_ERR_OOM, "--init-from: staging");
    for (int32_t i = 0; st == MST_OK && i < np; i++) {
        if (p[i].set != which || p[i].off < 0) continue;
        const size_t n = (size_t)mst_hf_numel(&p[i]);
        st = into_state(m, h, &p[i], "", 0, host);
        mst_fp32_to_bf16_array(half, host, n);
        if (st == MST_OK) st = mst_copy_h2b(m->ctx, m->w + p[i].off, half, n * 2);
    }
    free(host);
    free(half);
    return st;
}

mst_status mst_ckpt_init_from(mst_model* m, const char* dir) {
    int32_t np = 0;
    mst_hf_param* p = NULL;
    mst_hf *hw = NULL, *hm = NULL;
    mst_status st = table_of(m, &p, &np);
    if (st == MST_OK) st = open_hf(dir, &m->cfg, p, np, &hw, &hm);
    if (st == MST_OK) st = init_set(m, hw, p, np, MST_HF_MODEL);
    if (st == MST_OK && hm) st = init_set(m, hm, p, np, MST_HF_MTP);
    mst_hf_close(hw);
    mst_hf_close(hm);
    free(p);
    return st;
}

/* ---- --dump-grads --------------------------------------------------------------- */

mst_status mst_ckpt_dump_grads(mst_model* m, const char* path, const int32_t* tok, const double loss[3],
                               const float* logits) {
    if (m->dist.ep) return mst_set_error(MST_ERR_UNSUPPORTED, "--dump-grads '%s': one rank only", path);
    int32_t np = 0;
    mst_hf_param* p = NULL;
    mst_status st = table_of(m, &p, &np);
    mst_st_entry* e = (mst_st_entry*)calloc((size_t)np + 5, sizeof *e);
    float* host = (float*)malloc((size_t)(p ? biggest(p, np) : 1) * 4);
    char tmp[4300];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (st == MST_OK && (!e || !host)) st = mst_set_error(MST_ERR_OOM, "--dump-grads '%s'", path);
    for (int32_t i = 0; st == MST_OK && i < np; i++) {
        snprintf(e[i].name, sizeof e[i].name, "%s", p[i].name);
        e[i].dtype = MST_ST_F32, e[i].nd = p[i].nd, e[i].dims[0] = p[i].dims[0], e[i].dims[1] = p[i].dims[1];
    }
    const mst_model_config* c = &m->cfg;
    static const char* const lname[3] = {"loss_main", "loss_mtp", "loss_aux"};
    if (st == MST_OK) {
        e[np] = (mst_st_entry){.name = "tokens", .dtype = MST_ST_I32, .nd = 2, .dims = {m->n_micro * c->batch, c->seq + 2}};
        for (int k = 0; k < 3; k++) {
            e[np + 1 + k] = (mst_st_entry){.dtype = MST_ST_F32, .nd = 1, .dims = {1}};
            snprintf(e[np + 1 + k].name, sizeof e[np + 1 + k].name, "%s", lname[k]);
        }
        e[np + 4] = (mst_st_entry){.name = "logits", .dtype = MST_ST_F32, .nd = 2,
                                   .dims = {m->n_micro * c->batch * c->seq, c->vocab}};
    }
    mst_st_writer w;
    if (st == MST_OK) st = mst_st_write_begin(&w, tmp, e, np + 5);
    for (int32_t i = 0; st == MST_OK && i < np; i++) {
        const size_t bytes = (size_t)mst_hf_numel(&p[i]) * 4;
        st = mst_copy_b2h(m->ctx, host, m->grad + p[i].off, bytes);
        if (st == MST_OK) st = mst_st_write_data(&w, host, bytes);
        else mst_st_write_abort(&w);
    }
    if (st == MST_OK) st = mst_st_write_data(&w, tok, sizeof(int32_t) * (size_t)(e[np].dims[0] * e[np].dims[1]));
    for (int k = 0; k < 3 && st == MST_OK; k++) {
        const float x = (float)loss[k];
        st = mst_st_write_data(&w, &x, 4);
    }
    if (st == MST_OK) st = mst_st_write_data(&w, logits, sizeof(float) * (size_t)(e[np + 4].dims[0] * e[np + 4].dims[1]));
    if (st == MST_OK) st = mst_st_write_end(&w);
    if (st == MST_OK && rename(tmp, path) != 0) {
        st = mst_set_error(MST_ERR_IO, "--dump-grads '%s': rename: %s", path, strerror(errno));
        remove(tmp);
    }
    free(host);
    free(e);
    free(p);
    return st;
}
