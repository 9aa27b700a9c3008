/*
 * saver.c — names and policies of saved activations, and the basic saver
 * (KEEP everywhere, RECOMPUTE for fc2_input) that tests and simple users
 * plug into the grouped MLP. STASH and OFFLOAD belong to the memory manager.
 *
 * Every name has its own slot, so a policy moves only the tensor it names.
 */
#include <stdio.h>
#include <string.h>

#include "../core/context.h"

static const char* const saved_names[MST_N_SAVED] = {"fc1_input", "act_input", "fc2_input", "probs"};
static const char* const policy_names[MST_N_POLICIES] = {"keep", "stash", "offload", "recompute"};

const char* mst_saved_name_str(mst_saved_name n) {
    return (unsigned)n < MST_N_SAVED ? saved_names[n] : "unknown";
}

mst_policy mst_policy_base(mst_policy p) { return (mst_policy)((int)p & ~(int)MST_POLICY_FP8); }

int mst_policy_valid(mst_policy p) {
    const mst_policy b = mst_policy_base(p);
    if ((unsigned)b >= MST_N_POLICIES) return 0;
    return !((int)p & MST_POLICY_FP8) || b == MST_POLICY_STASH || b == MST_POLICY_OFFLOAD;
}

/* Does p store fp8 pages? */
static int is_fp8(mst_policy p) { return ((int)p & MST_POLICY_FP8) != 0; }

const char* mst_policy_str(mst_policy p) {
    if (!mst_policy_valid(p)) return "unknown";
    if (is_fp8(p)) return mst_policy_base(p) == MST_POLICY_STASH ? "stash:fp8" : "offload:fp8";
    return policy_names[p];
}

/* *out = the index of s in names [n]; else an error naming `what` and the
 * names expected. */
static mst_status parse_name(const char* s, const char* const* names, int n, const char* what,
                             const char* expected, int* out) {
    for (int i = 0; s && i < n; i++)
        if (strcmp(s, names[i]) == 0) return *out = i, MST_OK;
    return mst_set_error(MST_ERR_INVALID, "%s '%s': expected %s", what, s ? s : "(null)", expected);
}

mst_status mst_saved_name_parse(const char* s, mst_saved_name* out) {
    int i = 0;
    if (!out) return mst_set_error(MST_ERR_INVALID, "saved name '%s': out is NULL", s ? s : "(null)");
    MST_TRY(parse_name(s, saved_names, MST_N_SAVED, "saved name", "fc1_input, act_input, fc2_input or probs", &i));
    *out = (mst_saved_name)i;
    return MST_OK;
}

mst_status mst_policy_parse(const char* s, mst_policy* out) {
    static const struct { const char* s; mst_policy p; } forms[] = {
        {"keep", MST_POLICY_KEEP},           {"stash", MST_POLICY_STASH},
        {"offload", MST_POLICY_OFFLOAD},     {"recompute", MST_POLICY_RECOMPUTE},
        {"stash:fp8", MST_POLICY_STASH_FP8}, {"offload:fp8", MST_POLICY_OFFLOAD_FP8},
        {"stash:bf16", MST_POLICY_STASH},    {"offload:bf16", MST_POLICY_OFFLOAD},
    };
    if (!out) return mst_set_error(MST_ERR_INVALID, "policy '%s': out is NULL", s ? s : "(null)");
    for (size_t i = 0; s && i < sizeof forms / sizeof forms[0]; i++)
        if (strcmp(s, forms[i].s) == 0) return *out = forms[i].p, MST_OK;
    return mst_set_error(MST_ERR_INVALID, "policy '%s': expected keep, stash, offload or recompute (stash and "
                         "offload with a page format: stash:fp8, stash:bf16)", s ? s : "(null)");
}

/* A bare policy's value for name n: recompute is fc2_input's alone (the
 * rest kept), fp8 pages hold the bf16 names (probs keeps the bf16 form). */
static mst_policy bare_policy(mst_policy p, int n) {
    if (p == MST_POLICY_RECOMPUTE && n != MST_SAVED_FC2_INPUT) return MST_POLICY_KEEP;
    return n == MST_SAVED_PROBS ? mst_policy_base(p) : p;
}

/* Item [item, item + len) (not empty) of policy spec `spec` into out[];
 * seen[n]: name n given by an earlier item. */
static mst_status spec_item(const char* spec, const char* item, size_t len, int n_items, mst_policy out[MST_N_SAVED],
                            int seen[MST_N_SAVED]) {
    char buf[64];
    if (len >= sizeof buf)
        return mst_set_error(MST_ERR_INVALID, "policy spec '%s': item '%.*s' is too long", spec, (int)len, item);
    memcpy(buf, item, len);
    buf[len] = '\0';
    char* eq = strchr(buf, '=');
    mst_policy p;
    if (!eq) {
        if (n_items > 1)
            return mst_set_error(MST_ERR_INVALID, "policy spec '%s': item '%s' is a bare policy among NAME=POLICY items",
                                 spec, buf);
        MST_TRY(mst_policy_parse(buf, &p));
        for (int n = 0; n < MST_N_SAVED; n++) out[n] = bare_policy(p, n);
        return MST_OK;
    }
    *eq = '\0';
    mst_saved_name n;
    MST_TRY(mst_saved_name_parse(buf, &n));
    MST_TRY(mst_policy_parse(eq + 1, &p));
    *eq = '=';
    if (seen[n]) return mst_set_error(MST_ERR_INVALID, "policy spec '%s': item '%s' names %s again", spec, buf,
                                      mst_saved_name_str(n));
    if (p == MST_POLICY_RECOMPUTE && n != MST_SAVED_FC2_INPUT)
        return mst_set_error(MST_ERR_INVALID, "policy spec '%s': item '%s': only fc2_input is recomputed", spec, buf);
    if (is_fp8(p) && n == MST_SAVED_PROBS)
        return mst_set_error(MST_ERR_INVALID, "policy spec '%s': item '%s': probs is fp32, fp8 pages hold bf16 "
                             "tensors", spec, buf);
    seen[n] = 1;
    out[n] = p;
    return MST_OK;
}

mst_status mst_policy_spec_parse(const char* spec, mst_policy out[MST_N_SAVED]) {
    if (!spec || !*spec) return mst_set_error(MST_ERR_INVALID, "policy spec '%s' is empty", spec ? spec : "(null)");
    if (!out) return mst_set_error(MST_ERR_INVALID, "policy spec '%s': out is NULL", spec);
    const size_t len = strlen(spec);
    if (spec[0] == ',' || spec[len - 1] == ',' || strstr(spec, ",,"))
        return mst_set_error(MST_ERR_INVALID, "policy spec '%s': an empty item", spec);
    int n_items = 1, seen[MST_N_SAVED] = {0};
    for (const char* c = spec; *c; c++) n_items += *c == ',';
    for (int n = 0; n < MST_N_SAVED; n++) out[n] = MST_POLICY_KEEP;
    for (const char* item = spec;; ) {
        const char* end = strchr(item, ',');
        const size_t len = end ? (size_t)(end - item) : strlen(item);
        MST_TRY(spec_item(spec, item, len, n_items, out, seen));
        if (!end) return MST_OK;
        item = end + 1;
    }
}

mst_status mst_policy_spec_format(const mst_policy p[MST_N_SAVED], char* out, size_t size) {
    if (!p || !out || !size) return mst_set_error(MST_ERR_INVALID, "policy spec format: p or out is NULL or size 0");
    int uniform = 1, recompute = 1, bare = 1; /* bare: p[] is what the bare policy of fc1_input gives */
    for (int n = 0; n < MST_N_SAVED; n++) {
        if (!mst_policy_valid(p[n]) || (p[n] == MST_POLICY_RECOMPUTE && n != MST_SAVED_FC2_INPUT) ||
            (is_fp8(p[n]) && n == MST_SAVED_PROBS))
            return mst_set_error(MST_ERR_INVALID, "policy spec format: %s = %d is not a policy of it",
                                 mst_saved_name_str((mst_saved_name)n), (int)p[n]);
        uniform &= p[n] == p[0];
        recompute &= p[n] == (n == MST_SAVED_FC2_INPUT ? MST_POLICY_RECOMPUTE : MST_POLICY_KEEP);
        bare &= p[n] == bare_policy(p[0], n);
    }
    size_t at = 0;
    if (uniform || recompute || bare)
        at = (size_t)snprintf(out, size, "%s", mst_policy_str(recompute ? MST_POLICY_RECOMPUTE : p[0]));
    for (int n = 0; !uniform && !recompute && !bare && n < MST_N_SAVED && at < size; n++)
        at += (size_t)snprintf(out + at, size - at, "%s%s=%s", n ? "," : "", mst_saved_name_str((mst_saved_name)n),
                               mst_policy_str(p[n]));
    return at < size ? MST_OK : mst_set_error(MST_ERR_INVALID, "policy spec format: out[%zu] is too small", size);
}

mst_status mst_saved_shape(mst_saved_name name, int64_t hidden, int64_t ffn, int64_t* cols, mst_dtype* dtype) {
    if ((unsigned)name >= MST_N_SAVED)
        return mst_set_error(MST_ERR_INVALID, "saved name %d is not a mst_saved_name", (int)name);
    if (!cols || !dtype) return mst_set_error(MST_ERR_INVALID, "cols or dtype is NULL");
    const int64_t widths[MST_N_SAVED] = {hidden, 2 * ffn, ffn, 1};
    *cols = widths[name];
    *dtype = name == MST_SAVED_PROBS ? MST_DTYPE_FP32 : MST_DTYPE_BF16;
    return MST_OK;
}

/* ---- the basic saver ---------------------------------------------------- */

/* One saved name. Invariant: data != NULL for every slot after create;
 * committed implies policy == KEEP. */
typedef struct basic_slot {
    mst_policy policy;  /* KEEP or RECOMPUTE (fc2_input only)                */
    mst_tensor buf;     /* [R, cols] backend memory: the KEEP buffer, or the
                           compute buffer of a RECOMPUTE name                 */
    int committed;      /* a forward committed it and backward not released   */
} basic_slot;

struct mst_saver_basic {
    mst_ctx_t* ctx;
    basic_slot slot[MST_N_SAVED];
    mst_saver saver;    /* self = this */
};

static mst_status slot_of(void* self, mst_saved_name name, basic_slot** out) {
    if ((unsigned)name >= MST_N_SAVED)
        return mst_set_error(MST_ERR_INVALID, "saved name %d is not a mst_saved_name", (int)name);
    *out = &((mst_saver_basic_t*)self)->slot[name];
    return MST_OK;
}

/* t matches the slot's buffer in shape and dtype. */
static mst_status check_like(const basic_slot* s, mst_saved_name name, int64_t rows, int64_t cols,
                             mst_dtype dt) {
    if (rows != s->buf.rows || cols != s->buf.cols || dt != s->buf.dtype)
        return mst_set_error(MST_ERR_INVALID,
                             "%s: [%lld, %lld] %s, but the saver holds [%lld, %lld] %s",
                             mst_saved_name_str(name), (long long)rows, (long long)cols,
                             mst_dtype_name(dt), (long long)s->buf.rows, (long long)s->buf.cols,
                             mst_dtype_name(s->buf.dtype));
    return MST_OK;
}

static mst_status basic_produce(void* self, mst_saved_name name, int64_t rows, int64_t cols,
                                mst_dtype dtype, mst_tensor* out) {
    basic_slot* s = NULL;
    MST_TRY(slot_of(self, name, &s));
    MST_TRY(check_like(s, name, rows, cols, dtype));
    *out = s->buf;
    return MST_OK;
}

static mst_status basic_commit(void* self, mst_saved_name name, const mst_tensor* src,
                               const mst_tensor* counts) {
    (void)counts; /* KEEP copies all R rows: no host read of the counts */
    basic_slot* s = NULL;
    MST_TRY(slot_of(self, name, &s));
    MST_TRY(mst_check_tensor(src, mst_saved_name_str(name), s->buf.dtype));
    MST_TRY(check_like(s, name, src->rows, src->cols, src->dtype));
    if (s->policy == MST_POLICY_RECOMPUTE) return MST_OK;
    s->committed = 1;
    if (src->data == s->buf.data) return MST_OK;
    return mst_copy_b2b(((mst_saver_basic_t*)self)->ctx, s->buf.data, src->data,
                        mst_tensor_bytes(&s->buf));
}

static mst_status basic_fetch(void* self, mst_saved_name name, mst_tensor* out) {
    basic_slot* s = NULL;
    MST_TRY(slot_of(self, name, &s));
    *out = s->buf;
    if (s->policy == MST_POLICY_RECOMPUTE) {
        out->data = NULL;
        return MST_OK;
    }
    if (!s->committed)
        return mst_set_error(MST_ERR_STATE, "fetch of %s, which no forward committed",
                             mst_saved_name_str(name));
    return MST_OK;
}

static mst_status basic_release(void* self, mst_saved_name name) {
    basic_slot* s = NULL;
    MST_TRY(slot_of(self, name, &s));
    s->committed = 0;
    return MST_OK;
}

static mst_status check_policy(mst_saved_name n, mst_policy p) {
    if (!mst_policy_valid(p))
        return mst_set_error(MST_ERR_INVALID, "policies[%s] = %d is not a mst_policy",
                             mst_saved_name_str(n), (int)p);
    if (p == MST_POLICY_KEEP || (p == MST_POLICY_RECOMPUTE && n == MST_SAVED_FC2_INPUT))
        return MST_OK;
    return mst_set_error(MST_ERR_UNSUPPORTED,
                         "policies[%s] = %s: the basic saver does keep (any name) and recompute "
                         "(fc2_input only); stash and offload need the memory manager",
                         mst_saved_name_str(n), mst_policy_str(p));
}

mst_status mst_saver_basic_create(mst_ctx_t* ctx, int64_t max_rows,
                                  const struct mst_mlp_config* cfg,
                                  const mst_policy policies[MST_N_SAVED],
                                  mst_saver_basic_t** out) {
    MST_TRY(mst_check_ctx(ctx));
    if (!out) return mst_set_error(MST_ERR_INVALID, "out is NULL");
    *out = NULL;
    if (!cfg) return mst_set_error(MST_ERR_INVALID, "cfg is NULL");
    MST_TRY(MST_CHECK_STRUCT("cfg", cfg, mst_mlp_config));
    if (!policies) return mst_set_error(MST_ERR_INVALID, "policies is NULL");
    if (max_rows <= 0) return mst_set_error(MST_ERR_INVALID, "max_rows = %lld", (long long)max_rows);
    if (cfg->hidden <= 0 || cfg->ffn <= 0)
        return mst_set_error(MST_ERR_INVALID, "cfg: hidden = %lld, ffn = %lld: both must be > 0",
                             (long long)cfg->hidden, (long long)cfg->ffn);
    for (int n = 0; n < MST_N_SAVED; n++) MST_TRY(check_policy((mst_saved_name)n, policies[n]));
    mst_saver_basic_t* s = (mst_saver_basic_t*)calloc(1, sizeof *s);
    if (!s) return mst_set_error(MST_ERR_OOM, "basic saver");
    s->ctx = ctx;
    s->saver = (mst_saver){sizeof(mst_saver), s, basic_produce, basic_commit, basic_fetch, basic_release, NULL};
    for (int n = 0; n < MST_N_SAVED; n++) {
        int64_t cols;
        mst_dtype dt;
        mst_saved_shape((mst_saved_name)n, cfg->hidden, cfg->ffn, &cols, &dt);
        void* data = NULL;
        mst_status st = mst_alloc(ctx, (size_t)max_rows * (size_t)cols * mst_dtype_size(dt), &data);
        if (st != MST_OK) {
            mst_saver_basic_destroy(s);
            return st;
        }
        s->slot[n] = (basic_slot){policies[n], mst_tensor_make(data, dt, max_rows, cols), 0};
    }
    *out = s;
    return MST_OK;
}

void mst_saver_basic_destroy(mst_saver_basic_t* s) {
    if (!s) return;
    for (int n = 0; n < MST_N_SAVED; n++) mst_free(s->ctx, s->slot[n].buf.data);
    free(s);
}

const mst_saver* mst_saver_basic_get(mst_saver_basic_t* s) { return s ? &s->saver : NULL; }
