/*
 * checkpoint.c — save and load of a training run (checkpoint.h): the
 * parameter names, the safetensors files, trainer.json.
 */
#define _POSIX_C_SOURCE 200809L /* mkdir, rename */
#include "checkpoint.h"

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "trainer/io/hash.h"
#include "trainer/io/json.h"

/* ---- the parameters by name ------------------------------------------------- */

typedef struct param {
    char name[64];
    int64_t off;       /* element offset in the flat buffers */
    int64_t dims[3];
    int nd;
} param;

static int64_t numel(const param* p) {
    int64_t n = 1;
    for (int d = 0; d < p->nd; d++) n *= p->dims[d];
    return n;
}

static void add(param* out, int* n, const char* prefix, const char* name, int64_t off, int nd, int64_t d0,
                int64_t d1, int64_t d2) {
    param* p = &out[(*n)++];
    *p = (param){.off = off, .nd = nd, .dims = {d0, d1, d2}, .name = {0}};
    snprintf(p->name, sizeof p->name, "%s%s", prefix, name);
}

/* Every parameter of m in buffer order; out [mst_ckpt_n_params]. Returns the
 * count. Layer L is the MTP module's transformer layer. */
static int params_of(const mst_model* m, param* out) {
    const mst_model_config* c = &m->cfg;
    const int64_t H = c->hidden, F = c->ffn, E = c->experts, El = m->n_local; /* W ranks: this rank's E / W */
    int n = 0;
    const int64_t D = c->head_dim, Wq = (c->n_head + 2 * c->n_kv_head) * D, HO = c->n_head * D;
    add(out, &n, "", "embed.weight", m->emb, 2, c->vocab, H, 0);
    if (m->head != m->emb) add(out, &n, "", "lm_head.weight", m->head, 2, c->vocab, H, 0);
    add(out, &n, "", "mtp.proj.weight", m->proj, 2, H, 2 * H, 0);
    char pre[40];
    for (int32_t l = 0; l <= c->layers; l++) {
        const mst_layer_params* q = &m->lp[l];
        snprintf(pre, sizeof pre, l < c->layers ? "layers.%d." : "mtp.layer.", l);
        add(out, &n, pre, "attn.wqkv", q->wqkv, 2, Wq, H, 0);
        add(out, &n, pre, "attn.wo", q->wo, 2, H, HO, 0);
        add(out, &n, pre, "router.weight", q->wr, 2, E, H, 0);
        add(out, &n, pre, "experts.w1", q->w1, 3, El, 2 * F, H);
        add(out, &n, pre, "experts.w2", q->w2, 3, El, H, F);
    }
    for (int32_t l = 0; l <= c->layers; l++) {
        snprintf(pre, sizeof pre, l < c->layers ? "layers.%d." : "mtp.layer.", l);
        add(out, &n, pre, "attn_norm.weight", m->lp[l].ln1, 1, H, 0, 0);
        add(out, &n, pre, "attn.q_norm.weight", m->lp[l].q_norm, 1, D, 0, 0);
        add(out, &n, pre, "attn.k_norm.weight", m->lp[l].k_norm, 1, D, 0, 0);
        add(out, &n, pre, "mlp_norm.weight", m->lp[l].ln2, 1, H, 0, 0);
    }
    add(out, &n, "", "final_norm.weight", m->lnf, 1, H, 0, 0);
    add(out, &n, "", "mtp.norm_emb.weight", m->ln_e, 1, H, 0, 0);
    add(out, &n, "", "mtp.norm_hidden.weight", m->ln_h, 1, H, 0, 0);
    add(out, &n, "", "mtp.final_norm.weight", m->ln_mf, 1, H, 0, 0);
    return n;
}

static int n_params_of(const mst_model* m) { return 6 + (m->head != m->emb) + 9 * (m->cfg.layers + 1); }

/* The table of m's parameters (malloc'd, n_params_of(m) entries), checked to
 * cover the flat buffers exactly; NULL when out of memory. */
static param* param_table(const mst_model* m) {
    param* p = (param*)malloc(sizeof(param) * (size_t)n_params_of(m));
    if (!p) return NULL;
    MST_ASSERT(params_of(m, p) == n_params_of(m));
    int64_t total = 0;
    for (int i = 0; i < n_params_of(m); i++) total += numel(&p[i]);
    MST_ASSERT(total == m->n_params);
    return p;
}

/* "0.1": the version written into the files. */
static const char* version(void) {
    static char v[16];
    snprintf(v, sizeof v, "%d.%d", MST_VERSION_MAJOR, MST_VERSION_MINOR);
    return v;
}

/* ---- one safetensors file ---------------------------------------------------- *
 * Entries: `n_kinds` tensors per parameter (optimizer: master, m, v), each
 * read from / written to the backend buffer of its kind at the parameter's
 * offset. */

typedef struct st_kind {
    const char* prefix;    /* "" or "master." ... */
    void* base;            /* backend buffer [n_params] of this kind */
    int bf16;              /* 1: BF16 (2 bytes), 0: F32 (4 bytes)    */
} st_kind;

static size_t elem_bytes(const st_kind* k) { return k->bf16 ? 2 : 4; }

/* Elements of the largest parameter: the size of a host staging buffer. */
static int64_t biggest(const param* p, int np) {
    int64_t b = 0;
    for (int i = 0; i < np; i++) b = numel(&p[i]) > b ? numel(&p[i]) : b;
    return b;
}

/* The header JSON (padded with spaces to a multiple of 8 bytes) into buf. */
static size_t header(char* buf, size_t cap, const param* p, int np, const st_kind* kinds, int nk) {
    size_t at = (size_t)snprintf(buf, cap, "{\"__metadata__\":{\"format\":\"pt\",\"writer\":\"moestash %s\"}",
                                 version());
    uint64_t off = 0;
    for (int k = 0; k < nk; k++)
        for (int i = 0; i < np && at < cap; i++) {
            const uint64_t bytes = (uint64_t)numel(&p[i]) * elem_bytes(&kinds[k]);
            at += (size_t)snprintf(buf + at, cap - at, ",\"%s%s\":{\"dtype\":\"%s\",\"shape\":[", kinds[k].prefix,
                                   p[i].name, kinds[k].bf16 ? "BF16" : "F32");
            for (int d = 0; d < p[i].nd && at < cap; d++)
                at += (size_t)snprintf(buf + at, cap - at, "%s%lld", d ? "," : "", (long long)p[i].dims[d]);
            if (at < cap)
                at += (size_t)snprintf(buf + at, cap - at, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                                       (unsigned long long)(off + bytes));
            off += bytes;
        }
    if (at + 9 > cap) return 0;
    buf[at++] = '}';
    while (at % 8) buf[at++] = ' ';
    buf[at] = 0;
    return at;
}

static size_t header_cap(int np, int nk) { return 256 + (size_t)np * (size_t)nk * 200; }

static mst_status write_tensors(mst_ctx_t* ctx, const char* path, const param* p, int np, const st_kind* kinds,
                                int nk, uint64_t* hash) {
    const size_t cap = header_cap(np, nk);
    char* hdr = (char*)malloc(cap);
    void* host = malloc((size_t)biggest(p, np) * 4);
    FILE* f = fopen(path, "wb");
    mst_status st = hdr && host ? MST_OK : mst_set_error(MST_ERR_OOM, "checkpoint '%s': staging buffers", path);
    if (st == MST_OK && !f) st = mst_set_error(MST_ERR_IO, "checkpoint '%s': %s", path, strerror(errno));
    const size_t n_hdr = st == MST_OK ? header(hdr, cap, p, np, kinds, nk) : 0;
    uint8_t len[8];
    for (int b = 0; b < 8; b++) len[b] = (uint8_t)((uint64_t)n_hdr >> (8 * b));
    if (st == MST_OK && (fwrite(len, 1, 8, f) != 8 || fwrite(hdr, 1, n_hdr, f) != n_hdr))
        st = mst_set_error(MST_ERR_IO, "checkpoint '%s': header write failed", path);
    *hash = MST_FNV1A_SEED;
    for (int k = 0; k < nk && st == MST_OK; k++)
        for (int i = 0; i < np && st == MST_OK; i++) {
            const size_t bytes = (size_t)numel(&p[i]) * elem_bytes(&kinds[k]);
            st = mst_copy_b2h(ctx, host, (char*)kinds[k].base + (size_t)p[i].off * elem_bytes(&kinds[k]), bytes);
            if (st == MST_OK && fwrite(host, 1, bytes, f) != bytes)
                st = mst_set_error(MST_ERR_IO, "checkpoint '%s': write of %s%s failed", path, kinds[k].prefix,
                                   p[i].name);
            *hash = mst_fnv1a(*hash, host, bytes);
        }
    if (f && fclose(f) != 0 && st == MST_OK) st = mst_set_error(MST_ERR_IO, "checkpoint '%s': close failed", path);
    free(hdr);
    free(host);
    return st;
}

/* Reads the header of a safetensors file open at its start: its text
 * (*hdr, malloc'd; the caller frees it) tokenized into j, and its length;
 * leaves f at the first data byte. */
static mst_status read_header(FILE* f, const char* path, char** hdr, mst_json* j, uint64_t* n_hdr) {
    uint8_t len[8];
    *hdr = NULL;
    if (fread(len, 1, 8, f) != 8) return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': truncated (no header)", path);
    *n_hdr = 0;
    for (int b = 0; b < 8; b++) *n_hdr |= (uint64_t)len[b] << (8 * b);
    if (*n_hdr > (100u << 20))
        return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': header of %llu bytes", path, (unsigned long long)*n_hdr);
    *hdr = (char*)malloc((size_t)*n_hdr + 1);
    if (!*hdr) return mst_set_error(MST_ERR_OOM, "checkpoint '%s': header", path);
    size_t err_at = 0;
    if (fread(*hdr, 1, (size_t)*n_hdr, f) != *n_hdr)
        return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': truncated header", path);
    if (mst_json_parse(*hdr, (size_t)*n_hdr, j, &err_at))
        return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': header is not JSON (byte %zu)", path, err_at);
    return MST_OK;
}

/* Checks the header of an open file against the expected entries; leaves f at
 * the first data byte. */
static mst_status check_header(FILE* f, const char* path, const param* p, int np, const st_kind* kinds, int nk) {
    char* hdr = NULL;
    mst_json j;
    uint64_t n_hdr = 0;
    mst_status st = read_header(f, path, &hdr, &j, &n_hdr);
    if (st != MST_OK) {
        free(hdr);
        return st;
    }
    /* every expected entry present with its dtype, shape and offsets; nothing else */
    uint64_t off = 0;
    int found = 0;
    char name[160], want[96];
    for (int k = 0; k < nk && st == MST_OK; k++)
        for (int i = 0; i < np && st == MST_OK; i++) {
            snprintf(name, sizeof name, "%s%s", kinds[k].prefix, p[i].name);
            const int32_t t = mst_json_get(&j, 0, name);
            const uint64_t bytes = (uint64_t)numel(&p[i]) * elem_bytes(&kinds[k]);
            int at = snprintf(want, sizeof want, "[");
            for (int d = 0; d < p[i].nd; d++) at += snprintf(want + at, sizeof want - (size_t)at, "%s%lld", d ? "," : "", (long long)p[i].dims[d]);
            snprintf(want + at, sizeof want - (size_t)at, "]");
            const int32_t dt = mst_json_get(&j, t, "dtype"), sh = mst_json_get(&j, t, "shape"),
                          of = mst_json_get(&j, t, "data_offsets");
            char got_shape[96] = "?";
            if (sh >= 0) mst_json_str(&j, sh, got_shape, sizeof got_shape);
            int64_t o0 = -1, o1 = -1;
            if (of >= 0 && j.tok[of].n_children == 2) mst_json_i64(&j, of + 1, &o0), mst_json_i64(&j, of + 2, &o1);
            if (t < 0) st = mst_set_error(MST_ERR_INVALID, "checkpoint '%s': no tensor '%s' (another model configuration?)", path, name);
            else if (dt < 0 || !mst_json_eq(&j, dt, kinds[k].bf16 ? "BF16" : "F32"))
                st = mst_set_error(MST_ERR_INVALID, "checkpoint '%s': tensor '%s' is not %s", path, name, kinds[k].bf16 ? "BF16" : "F32");
            else if (strcmp(got_shape, want) != 0)
                st = mst_set_error(MST_ERR_INVALID, "checkpoint '%s': tensor '%s' has shape %s, this model %s (another model configuration)",
                                   path, name, got_shape, want);
            else if (o0 != (int64_t)off || o1 != (int64_t)(off + bytes))
                st = mst_set_error(MST_ERR_INVALID, "checkpoint '%s': tensor '%s' at bytes [%lld, %lld), expected [%llu, %llu)",
                                   path, name, (long long)o0, (long long)o1, (unsigned long long)off, (unsigned long long)(off + bytes));
            off += bytes;
            found++;
        }
    if (st == MST_OK) {
        const int entries = j.tok[0].n_children / 2 - (mst_json_get(&j, 0, "__metadata__") >= 0);
        if (entries != found)
            st = mst_set_error(MST_ERR_INVALID, "checkpoint '%s': %d tensors, this model has %d (another model configuration)",
                               path, entries, found);
    }
    mst_json_free(&j);
    free(hdr);
    if (st != MST_OK) return st;
    /* truncation: the data must be exactly `off` bytes */
    const long here = ftell(f);
    if (here < 0 || fseek(f, 0, SEEK_END) != 0) return mst_set_error(MST_ERR_IO, "checkpoint '%s': cannot seek", path);
    const long size = ftell(f);
    if (size != here + (long)off)
        return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': %ld bytes, expected %lld (truncated or damaged)", path, size,
                             (long long)(here + (long)off));
    return fseek(f, here, SEEK_SET) == 0 ? MST_OK : mst_set_error(MST_ERR_IO, "checkpoint '%s': cannot seek", path);
}

/* Opens path and checks its header (*f NULL on failure). */
static mst_status open_checked(const char* path, const param* p, int np, const st_kind* kinds, int nk, FILE** f) {
    *f = fopen(path, "rb");
    if (!*f) return mst_set_error(MST_ERR_IO, "checkpoint '%s': %s", path, strerror(errno));
    mst_status st = check_header(*f, path, p, np, kinds, nk);
    if (st != MST_OK) fclose(*f), *f = NULL;
    return st;
}

/* Reads the data of a checked file into the model's buffers; closes f. */
static mst_status read_tensors(mst_ctx_t* ctx, FILE* f, const char* path, const param* p, int np, const st_kind* kinds,
                               int nk, uint64_t want_hash) {
    mst_status st = MST_OK;
    void* host = st == MST_OK ? malloc((size_t)biggest(p, np) * 4) : NULL;
    if (st == MST_OK && !host) st = mst_set_error(MST_ERR_OOM, "checkpoint '%s': staging buffer", path);
    uint64_t hash = MST_FNV1A_SEED;
    for (int k = 0; k < nk && st == MST_OK; k++)
        for (int i = 0; i < np && st == MST_OK; i++) {
            const size_t bytes = (size_t)numel(&p[i]) * elem_bytes(&kinds[k]);
            if (fread(host, 1, bytes, f) != bytes) st = mst_set_error(MST_ERR_IO, "checkpoint '%s': read failed", path);
            else st = mst_copy_h2b(ctx, (char*)kinds[k].base + (size_t)p[i].off * elem_bytes(&kinds[k]), host, bytes);
            hash = mst_fnv1a(hash, host, bytes);
        }
    fclose(f);
    free(host);
    if (st == MST_OK && hash != want_hash)
        st = mst_set_error(MST_ERR_INVALID, "checkpoint '%s': data hash %016llx, trainer.json says %016llx (damaged)", path,
                           (unsigned long long)hash, (unsigned long long)want_hash);
    return st;
}

/* ---- trainer.json: the configuration, field by field ------------------------- */

typedef enum { F_I32, F_I64, F_U64, F_F32, F_F64 } ftype;
typedef struct field {
    const char* name;
    ftype type;
    size_t off; /* in mst_train_config */
} field;

#define FLD(name, type, member) {name, type, offsetof(mst_train_config, member)}
static const field fields[] = {
    FLD("model.vocab", F_I64, model.vocab), FLD("model.hidden", F_I64, model.hidden),
    FLD("model.ffn", F_I64, model.ffn), FLD("model.heads", F_I64, model.n_head), FLD("model.seq", F_I64, model.seq),
    FLD("model.batch", F_I64, model.batch), FLD("model.layers", F_I32, model.layers),
    FLD("model.experts", F_I32, model.experts), FLD("model.top_k", F_I32, model.top_k), FLD("model.ep", F_I32, model.ep),
    FLD("model.capacity_factor", F_F32, model.capacity_factor), FLD("model.mtp_weight", F_F32, model.mtp_weight),
    FLD("model.aux_coef", F_F32, model.aux_coef), FLD("model.norm_eps", F_F32, model.norm_eps),
    FLD("model.init_std", F_F32, model.init_std), FLD("model.seed", F_U64, model.seed),
    FLD("model.attention", F_I32, model.attention), FLD("model.kv_heads", F_I64, model.n_kv_head),
    FLD("model.head_dim", F_I64, model.head_dim), FLD("model.rope_theta", F_F32, model.rope_theta),
    FLD("model.norm_topk_prob", F_I32, model.norm_topk_prob), FLD("model.tie_embeddings", F_I32, model.tie_embeddings),
    FLD("optim.lr", F_F32, optim.lr), FLD("optim.min_lr_frac", F_F32, optim.min_lr_frac),
    FLD("optim.beta1", F_F32, optim.beta1), FLD("optim.beta2", F_F32, optim.beta2), FLD("optim.eps", F_F32, optim.eps),
    FLD("optim.weight_decay", F_F32, optim.weight_decay), FLD("optim.clip", F_F32, optim.clip),
    FLD("optim.warmup", F_I64, optim.warmup), FLD("optim.steps", F_I64, optim.steps),
    FLD("mem.recompute_layers", F_I32, mem.recompute.num_layers), FLD("mem.virtual_stages", F_I32, mem.virtual_stages),
    FLD("mem.pool_factor", F_F64, mem.pool_factor), FLD("mem.recompute_full", F_I32, mem.recompute_full),
    FLD("mem.recompute_mtp", F_I32, mem.recompute_mtp), FLD("microbatches", F_I32, microbatches),
    FLD("steps", F_I64, steps), FLD("eval_fraction", F_F64, eval_fraction), FLD("eval_every", F_I64, eval_every),
    FLD("eval_batches", F_I32, eval_batches),
};
#undef FLD
#define N_FIELDS (int)(sizeof fields / sizeof fields[0])

static const char* const recompute_names[] = {"none", "uniform", "block"};

static void write_field(FILE* f, const mst_train_config* c, const field* d) {
    const char* p = (const char*)c + d->off;
    switch (d->type) {
    case F_I32: fprintf(f, "  \"config.%s\": %d,\n", d->name, *(const int32_t*)p); break;
    case F_I64: fprintf(f, "  \"config.%s\": %lld,\n", d->name, (long long)*(const int64_t*)p); break;
    case F_U64: fprintf(f, "  \"config.%s\": %llu,\n", d->name, (unsigned long long)*(const uint64_t*)p); break;
    case F_F32: fprintf(f, "  \"config.%s\": %.9g,\n", d->name, (double)*(const float*)p); break;
    case F_F64: fprintf(f, "  \"config.%s\": %.17g,\n", d->name, *(const double*)p); break;
    }
}

static int read_field(const mst_json* j, mst_train_config* c, const field* d) {
    char key[96];
    snprintf(key, sizeof key, "config.%s", d->name);
    const int32_t t = mst_json_get(j, 0, key);
    char* p = (char*)c + d->off;
    int64_t i = 0;
    double x = 0;
    switch (d->type) {
    case F_I32: return mst_json_i64(j, t, &i) || i != (int32_t)i ? -1 : (*(int32_t*)p = (int32_t)i, 0);
    case F_I64: return mst_json_i64(j, t, &i) ? -1 : (*(int64_t*)p = i, 0);
    case F_U64: {
        char buf[32], *end;
        if (t < 0 || mst_json_str(j, t, buf, sizeof buf)) return -1;
        errno = 0;
        unsigned long long u = strtoull(buf, &end, 10);
        return errno || *end ? -1 : (*(uint64_t*)p = u, 0);
    }
    case F_F32: {
        char buf[64], *end;
        if (t < 0 || mst_json_str(j, t, buf, sizeof buf)) return -1;
        float v = strtof(buf, &end); /* the float printed with %.9g, exactly */
        return *end ? -1 : (*(float*)p = v, 0);
    }
    case F_F64: return mst_json_f64(j, t, &x) ? -1 : (*(double*)p = x, 0);
    }
    return -1;
}

/* A JSON string value without characters that would need escaping. */
static mst_status plain_string(const char* what, const char* s) {
    for (const char* c = s; *c; c++)
        if (*c == '"' || *c == '\\' || (unsigned char)*c < 0x20)
            return mst_set_error(MST_ERR_INVALID, "checkpoint: %s '%s' holds a quote, backslash or control character", what, s);
    return MST_OK;
}

static mst_status write_meta(const char* path, const mst_train_config* c, int32_t ranks, int64_t step,
                             uint64_t data_rng, uint64_t h_model, uint64_t h_optim) {
    MST_TRY(plain_string("--policy", c->mem.policy ? c->mem.policy : ""));
    MST_TRY(plain_string("--data", c->data_path ? c->data_path : ""));
    MST_TRY(plain_string("--eval-data", c->eval_path ? c->eval_path : ""));
    FILE* f = fopen(path, "w");
    if (!f) return mst_set_error(MST_ERR_IO, "checkpoint '%s': %s", path, strerror(errno));
    fprintf(f, "{\n  \"format\": \"moestash-checkpoint\",\n  \"version\": %d,\n  \"library\": \"%s\",\n", MST_CKPT_VERSION,
            version());
    fprintf(f, "  \"ranks\": %d,\n  \"step\": %lld,\n  \"data_rng\": \"%016llx\",\n", ranks, (long long)step,
            (unsigned long long)data_rng);
    fprintf(f, "  \"model_fnv1a\": \"%016llx\",\n  \"optimizer_fnv1a\": \"%016llx\",\n", (unsigned long long)h_model,
            (unsigned long long)h_optim);
    for (int i = 0; i < N_FIELDS; i++) write_field(f, c, &fields[i]);
    fprintf(f, "  \"config.mem.policy\": \"%s\",\n", c->mem.policy ? c->mem.policy : "");
    fprintf(f, "  \"config.mem.recompute\": \"%s\",\n", recompute_names[c->mem.recompute.method]);
    fprintf(f, "  \"config.mem.schedule\": \"%s\",\n", mst_schedule_kind_str(c->mem.schedule));
    fprintf(f, "  \"config.eval_data\": \"%s\",\n", c->eval_path ? c->eval_path : "");
    fprintf(f, "  \"config.data\": \"%s\"\n}\n", c->data_path ? c->data_path : "");
    int bad = ferror(f);
    bad |= fclose(f) != 0;
    return bad ? mst_set_error(MST_ERR_IO, "checkpoint '%s': write failed", path) : MST_OK;
}

static int read_hex(const mst_json* j, const char* key, uint64_t* out) {
    char buf[32], *end;
    if (mst_json_str(j, mst_json_get(j, 0, key), buf, sizeof buf) || !buf[0]) return -1;
    errno = 0;
    *out = strtoull(buf, &end, 16);
    return errno || *end ? -1 : 0;
}

static mst_status read_file(const char* path, char** text, size_t* n) {
    FILE* f = fopen(path, "rb");
    if (!f) return mst_set_error(MST_ERR_IO, "checkpoint '%s': %s", path, strerror(errno));
    char* buf = (char*)malloc(1 << 20);
    size_t got = buf ? fread(buf, 1, (1 << 20) - 1, f) : 0;
    const int more = !feof(f);
    fclose(f);
    if (!buf || more) {
        free(buf);
        return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': not a trainer.json (over 1 MiB)", path);
    }
    buf[got] = 0;
    *text = buf, *n = got;
    return MST_OK;
}

static mst_status parse_meta(const char* path, const mst_json* j, mst_ckpt_meta* out) {
    int64_t version = 0;
    if (mst_json_get(j, 0, "format") < 0 || !mst_json_eq(j, mst_json_get(j, 0, "format"), "moestash-checkpoint"))
        return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': not a moestash checkpoint (format)", path);
    if (mst_json_i64(j, mst_json_get(j, 0, "version"), &version) || version != MST_CKPT_VERSION)
        return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': format version %lld, this build reads version %d", path,
                             (long long)version, MST_CKPT_VERSION);
    mst_ckpt_meta* o = out;
    int64_t ranks = 1; /* absent: one rank */
    const int32_t tr = mst_json_get(j, 0, "ranks");
    if (tr >= 0 && (mst_json_i64(j, tr, &ranks) || ranks < 1 || ranks > 1024))
        return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': ranks not a count of 1 .. 1024", path);
    o->ranks = (int32_t)ranks;
    for (int i = 0; i < N_FIELDS; i++)
        if (read_field(j, &o->cfg, &fields[i]))
            return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': config.%s missing or not a number", path, fields[i].name);
    char rec[16], sched[32];
    if (mst_json_i64(j, mst_json_get(j, 0, "step"), &o->step) || read_hex(j, "data_rng", &o->data_rng) ||
        mst_json_str(j, mst_json_get(j, 0, "config.mem.policy"), o->policy, sizeof o->policy) ||
        mst_json_str(j, mst_json_get(j, 0, "config.data"), o->data_path, sizeof o->data_path) ||
        mst_json_str(j, mst_json_get(j, 0, "config.eval_data"), o->eval_path, sizeof o->eval_path) ||
        mst_json_str(j, mst_json_get(j, 0, "config.mem.recompute"), rec, sizeof rec) ||
        mst_json_str(j, mst_json_get(j, 0, "config.mem.schedule"), sched, sizeof sched))
        return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': step, data_rng, policy, data, recompute or schedule missing", path);
    o->cfg.mem.recompute.method = MST_RECOMPUTE_NONE;
    for (int k = 0; k < 3; k++)
        if (strcmp(rec, recompute_names[k]) == 0) o->cfg.mem.recompute.method = (mst_recompute_method)k;
    MST_TRY(mst_schedule_kind_parse(sched, &o->cfg.mem.schedule));
    o->cfg.mem.policy = o->policy[0] ? o->policy : NULL;
    o->cfg.data_path = o->data_path[0] ? o->data_path : NULL;
    o->cfg.eval_path = o->eval_path[0] ? o->eval_path : NULL;
    if (o->step < 0 || o->step > o->cfg.steps)
        return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': step %lld outside the run's %lld steps", path,
                             (long long)o->step, (long long)o->cfg.steps);
    return MST_OK;
}

/* dir/trainer.json, or dir/rank-0/trainer.json when only that one is there. */
static void meta_path(const char* dir, char* path, size_t cap) {
    snprintf(path, cap, "%s/rank-0/trainer.json", dir);
    FILE* f = fopen(path, "rb");
    if (f) fclose(f);
    if (!f) snprintf(path, cap, "%s/trainer.json", dir);
}

mst_status mst_ckpt_check_ranks(const mst_ckpt_meta* meta, const char* dir, int32_t ranks) {
    if (meta->ranks == ranks) return MST_OK;
    return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': saved by %d rank%s, this run has %d", dir, meta->ranks,
                         meta->ranks == 1 ? "" : "s", ranks);
}

mst_status mst_ckpt_read_meta(const char* dir, mst_ckpt_meta* out) {
    char path[4200];
    meta_path(dir, path, sizeof path);
    memset(out, 0, sizeof *out);
    out->cfg.mem = mst_mem_config_default();
    char* text = NULL;
    size_t n = 0, err_at = 0;
    MST_TRY(read_file(path, &text, &n));
    mst_json j;
    mst_status st = mst_json_parse(text, n, &j, &err_at)
                        ? mst_set_error(MST_ERR_INVALID, "checkpoint '%s': not JSON (byte %zu)", path, err_at)
                        : MST_OK;
    if (st == MST_OK) {
        st = j.tok[0].kind == MST_JSON_OBJECT ? parse_meta(path, &j, out)
                                              : mst_set_error(MST_ERR_INVALID, "checkpoint '%s': not an object", path);
        mst_json_free(&j);
    }
    free(text);
    return st;
}

/* ---- save / load --------------------------------------------------------------- */

static mst_status mkdirs(const char* dir) {
    char p[4096];
    if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p) return mst_set_error(MST_ERR_INVALID, "--save '%s': path too long", dir);
    for (char* c = p + 1; *c; c++) {
        if (*c != '/') continue;
        *c = 0;
        if (mkdir(p, 0777) != 0 && errno != EEXIST) return mst_set_error(MST_ERR_IO, "--save '%s': %s", p, strerror(errno));
        *c = '/';
    }
    if (mkdir(p, 0777) != 0 && errno != EEXIST) return mst_set_error(MST_ERR_IO, "--save '%s': %s", p, strerror(errno));
    return MST_OK;
}

static void kinds_of(mst_model* m, st_kind* weights, st_kind optim[3]) {
    *weights = (st_kind){"", m->w, 1};
    optim[0] = (st_kind){"master.", m->master, 0};
    optim[1] = (st_kind){"adam_m.", m->adam_m, 0};
    optim[2] = (st_kind){"adam_v.", m->adam_v, 0};
}

/* dir/name.tmp, written first, and dir/name, its place after the rename. */
static void place(const char* dir, const char* name, char* tmp, char* final, size_t cap) {
    snprintf(tmp, cap, "%s/%s.tmp", dir, name);
    snprintf(final, cap, "%s/%s", dir, name);
}

static mst_status commit(const char* tmp, const char* final) {
    return rename(tmp, final) == 0 ? MST_OK : mst_set_error(MST_ERR_IO, "checkpoint '%s': %s", final, strerror(errno));
}

mst_status mst_ckpt_save(mst_model* m, const mst_train_config* cfg, int64_t step, uint64_t data_rng, const char* dir) {
    MST_TRY(mkdirs(dir));
    const int np = n_params_of(m);
    param* p = param_table(m);
    if (!p) return mst_set_error(MST_ERR_OOM, "checkpoint: parameter table");
    st_kind w, o[3];
    kinds_of(m, &w, o);
    char tmp[3][4200], fin[3][4200];
    uint64_t hm = 0, ho = 0;
    place(dir, "model.safetensors", tmp[0], fin[0], sizeof tmp[0]);
    place(dir, "optimizer.safetensors", tmp[1], fin[1], sizeof tmp[1]);
    place(dir, "trainer.json", tmp[2], fin[2], sizeof tmp[2]);
    remove(fin[2]); /* no trainer.json while the tensors change */
    mst_status st = write_tensors(m->ctx, tmp[0], p, np, &w, 1, &hm);
    if (st == MST_OK) st = write_tensors(m->ctx, tmp[1], p, np, o, 3, &ho);
    if (st == MST_OK) st = commit(tmp[0], fin[0]);
    if (st == MST_OK) st = commit(tmp[1], fin[1]);
    if (st == MST_OK) st = write_meta(tmp[2], cfg, m->dist.ep ? m->dist.world : 1, step, data_rng, hm, ho);
    if (st == MST_OK) st = commit(tmp[2], fin[2]);
    free(p);
    return st;
}

mst_status mst_ckpt_load(mst_model* m, const char* dir) {
    char path[4200];
    snprintf(path, sizeof path, "%s/trainer.json", dir);
    char* text = NULL;
    size_t n = 0;
    MST_TRY(read_file(path, &text, &n));
    mst_json j;
    uint64_t hm = 0, ho = 0;
    int bad = mst_json_parse(text, n, &j, NULL);
    if (!bad) {
        bad = read_hex(&j, "model_fnv1a", &hm) || read_hex(&j, "optimizer_fnv1a", &ho);
        mst_json_free(&j);
    }
    free(text);
    if (bad) return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': no tensor hashes", path);
    const int np = n_params_of(m);
    param* p = param_table(m);
    if (!p) return mst_set_error(MST_ERR_OOM, "checkpoint: parameter table");
    st_kind w, o[3];
    kinds_of(m, &w, o);
    /* both headers and sizes checked before any byte reaches the model */
    char pm[4200], po[4200];
    snprintf(pm, sizeof pm, "%s/model.safetensors", dir);
    snprintf(po, sizeof po, "%s/optimizer.safetensors", dir);
    FILE *fm = NULL, *fo = NULL;
    mst_status st = open_checked(pm, p, np, &w, 1, &fm);
    if (st == MST_OK) st = open_checked(po, p, np, o, 3, &fo);
    if (st == MST_OK) st = read_tensors(m->ctx, fm, pm, p, np, &w, 1, hm), fm = NULL;
    if (st == MST_OK) st = read_tensors(m->ctx, fo, po, p, np, o, 3, ho), fo = NULL;
    if (fm) fclose(fm);
    if (fo) fclose(fo);
    free(p);
    return st;
}

mst_status mst_ckpt_read_bf16(const char* dir, const char* name, int64_t n, float* out) {
    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE* f = fopen(path, "rb");
    if (!f) return mst_set_error(MST_ERR_IO, "checkpoint '%s': %s", path, strerror(errno));
    char* hdr = NULL;
    mst_json j = {0};
    uint64_t n_hdr = 0;
    int64_t o0 = -1, o1 = -1;
    mst_status st = read_header(f, path, &hdr, &j, &n_hdr);
    if (st == MST_OK) {
        const int32_t t = mst_json_get(&j, 0, name), dt = mst_json_get(&j, t, "dtype"), of = mst_json_get(&j, t, "data_offsets");
        if (of >= 0 && j.tok[of].n_children == 2) mst_json_i64(&j, of + 1, &o0), mst_json_i64(&j, of + 2, &o1);
        if (t < 0 || dt < 0 || !mst_json_eq(&j, dt, "BF16") || o0 < 0 || o1 - o0 != 2 * n)
            st = mst_set_error(MST_ERR_INVALID, "checkpoint '%s': no BF16 tensor '%s' of %lld values", path, name, (long long)n);
        mst_json_free(&j);
    }
    uint16_t* raw = st == MST_OK ? (uint16_t*)malloc(sizeof(uint16_t) * (size_t)n) : NULL;
    if (st == MST_OK && (!raw || fseek(f, (long)(8 + n_hdr + (uint64_t)o0), SEEK_SET) != 0 ||
                         fread(raw, 2, (size_t)n, f) != (size_t)n))
        st = mst_set_error(MST_ERR_INVALID, "checkpoint '%s': tensor '%s' truncated", path, name);
    for (int64_t i = 0; st == MST_OK && i < n; i++) out[i] = mst_bf16_to_fp32(raw[i]);
    free(raw);
    free(hdr);
    fclose(f);
    return st;
}
