/*
 * ckpt_meta.c — trainer.json of a checkpoint (checkpoint.h): the format and
 * version, the ranks that wrote it, the steps done, the data sampler's
 * state, the run's configuration field by field and the losses so far.
 */
#define _POSIX_C_SOURCE 200809L /* fileno, fsync */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "checkpoint.h"
#include "trainer/io/json.h"

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

/* The losses of steps 1 .. step (res NULL: none): "losses": [[main, mtp, aux, eval], ...], eval null when not evaluated. */
static void write_losses(FILE* f, const mst_train_result* res, int64_t step) {
    fprintf(f, "  \"losses\": [");
    for (int64_t i = 0; res && i < step && i < res->steps; i++) {
        fprintf(f, "%s[%.17g, %.17g, %.17g, ", i ? ", " : "", res->loss[i], res->mtp_loss[i], res->aux_loss[i]);
        if (isfinite(res->eval_loss[i])) fprintf(f, "%.17g]", res->eval_loss[i]);
        else fprintf(f, "null]");
    }
    fprintf(f, "],\n");
}

mst_status mst_ckpt_write_meta(const char* path, const mst_train_config* c, int32_t ranks, int64_t step, uint64_t data_rng,
                               const mst_train_result* res) {
    char policy[MST_POLICY_SPEC_MAX];
    MST_TRY(mst_policy_spec_format(c->mem.policy.name, policy, sizeof policy)); /* a plan's per_layer is not kept */
    MST_TRY(plain_string("--data", c->data_path ? c->data_path : ""));
    MST_TRY(plain_string("--eval-data", c->eval_path ? c->eval_path : ""));
    FILE* f = fopen(path, "w");
    if (!f) return mst_set_error(MST_ERR_IO, "checkpoint '%s': %s", path, strerror(errno));
    fprintf(f, "{\n  \"format\": \"moestash-checkpoint\",\n  \"version\": %d,\n  \"library\": \"%d.%d\",\n", MST_CKPT_VERSION,
            MST_VERSION_MAJOR, MST_VERSION_MINOR);
    fprintf(f, "  \"ranks\": %d,\n  \"pp\": %d,\n  \"step\": %lld,\n  \"data_rng\": \"%016llx\",\n", ranks,
            c->pp > 1 ? c->pp : 1, (long long)step,
            (unsigned long long)data_rng);
    write_losses(f, res, step);
    for (int i = 0; i < N_FIELDS; i++) write_field(f, c, &fields[i]);
    fprintf(f, "  \"config.mem.policy\": \"%s\",\n", policy);
    fprintf(f, "  \"config.mem.recompute\": \"%s\",\n", recompute_names[c->mem.recompute.method]);
    fprintf(f, "  \"config.mem.schedule\": \"%s\",\n", mst_schedule_kind_str(c->mem.schedule));
    fprintf(f, "  \"config.mem.adam_moments\": \"%s\",\n", c->mem.moments_bf16 ? "bf16" : "fp32");
    fprintf(f, "  \"config.eval_data\": \"%s\",\n", c->eval_path ? c->eval_path : "");
    fprintf(f, "  \"config.data\": \"%s\"\n}\n", c->data_path ? c->data_path : "");
    int bad = ferror(f) || fflush(f) != 0 || fsync(fileno(f)) != 0;
    bad |= fclose(f) != 0;
    return bad ? mst_set_error(MST_ERR_IO, "checkpoint '%s': write failed: %s", path, strerror(errno)) : MST_OK;
}

static int read_hex(const mst_json* j, const char* key, uint64_t* out) {
    char buf[32], *end;
    if (mst_json_str(j, mst_json_get(j, 0, key), buf, sizeof buf) || !buf[0]) return -1;
    errno = 0;
    *out = strtoull(buf, &end, 16);
    return errno || *end ? -1 : 0;
}

/* path's text (malloc'd, up to 256 MiB) tokenized into j; the caller frees both. */
static mst_status load_json(const char* path, char** text, mst_json* j) {
    FILE* f = fopen(path, "rb");
    if (!f) return mst_set_error(MST_ERR_IO, "checkpoint '%s': %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char* buf = NULL;
    for (;;) {
        char* t = (char*)realloc(buf, cap + 1);
        if (!t) break;
        buf = t;
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap || cap >= (256u << 20)) break;
        cap *= 2;
    }
    const int more = !feof(f);
    fclose(f);
    *text = buf;
    if (!buf || more) return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': not a trainer.json (over 256 MiB)", path);
    size_t err_at = 0;
    if (mst_json_parse(buf, n, j, &err_at)) return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': not JSON (byte %zu)", path, err_at);
    if (j->tok[0].kind == MST_JSON_OBJECT) return MST_OK;
    mst_json_free(j);
    return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': not an object", path);
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
    int64_t pp = 1; /* absent: one stage */
    const int32_t tp = mst_json_get(j, 0, "pp");
    if (tp >= 0 && (mst_json_i64(j, tp, &pp) || pp < 1 || pp > ranks || ranks % pp))
        return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': pp not a divisor of its %lld ranks", path, (long long)ranks);
    o->cfg.pp = (int32_t)pp;
    for (int i = 0; i < N_FIELDS; i++)
        if (read_field(j, &o->cfg, &fields[i]))
            return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': config.%s missing or not a number", path, fields[i].name);
    char rec[16], sched[32], policy[MST_POLICY_SPEC_MAX];
    if (mst_json_i64(j, mst_json_get(j, 0, "step"), &o->step) || read_hex(j, "data_rng", &o->data_rng) ||
        mst_json_str(j, mst_json_get(j, 0, "config.mem.policy"), policy, sizeof policy) ||
        mst_json_str(j, mst_json_get(j, 0, "config.data"), o->data_path, sizeof o->data_path) ||
        mst_json_str(j, mst_json_get(j, 0, "config.eval_data"), o->eval_path, sizeof o->eval_path) ||
        mst_json_str(j, mst_json_get(j, 0, "config.mem.recompute"), rec, sizeof rec) ||
        mst_json_str(j, mst_json_get(j, 0, "config.mem.schedule"), sched, sizeof sched))
        return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': step, data_rng, policy, data, recompute or schedule missing", path);
    o->cfg.mem.recompute.method = MST_RECOMPUTE_NONE;
    for (int k = 0; k < 3; k++)
        if (strcmp(rec, recompute_names[k]) == 0) o->cfg.mem.recompute.method = (mst_recompute_method)k;
    MST_TRY(mst_schedule_kind_parse(sched, &o->cfg.mem.schedule));
    char mom[8] = "fp32"; /* absent (an older checkpoint): fp32 */
    const int32_t tm = mst_json_get(j, 0, "config.mem.adam_moments");
    if (tm >= 0 && (mst_json_str(j, tm, mom, sizeof mom) || (strcmp(mom, "fp32") && strcmp(mom, "bf16"))))
        return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': config.mem.adam_moments not fp32 or bf16", path);
    o->cfg.mem.moments_bf16 = strcmp(mom, "bf16") == 0;
    memset(&o->cfg.mem.policy, 0, sizeof o->cfg.mem.policy); /* "": keep (an older checkpoint's NULL policy) */
    if (policy[0] && mst_policy_spec_parse(policy, o->cfg.mem.policy.name) != MST_OK)
        return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': config.mem.policy: %s", path, mst_last_error());
    o->cfg.data_path = o->data_path[0] ? o->data_path : NULL;
    o->cfg.eval_path = o->eval_path[0] ? o->eval_path : NULL;
    if (o->step < 0 || o->step > o->cfg.steps)
        return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': step %lld outside the run's %lld steps", path,
                             (long long)o->step, (long long)o->cfg.steps);
    return MST_OK;
}

mst_status mst_ckpt_check_ranks(const mst_ckpt_meta* meta, const char* dir, int32_t ranks) {
    if (meta->ranks == ranks) return MST_OK;
    return mst_set_error(MST_ERR_INVALID, "checkpoint '%s': saved by %d rank%s, this run has %d", dir, meta->ranks,
                         meta->ranks == 1 ? "" : "s", ranks);
}

mst_status mst_ckpt_read_meta(const char* dir, mst_ckpt_meta* out) {
    char path[4200];
    snprintf(path, sizeof path, "%s/trainer.json", dir);
    memset(out, 0, sizeof *out);
    out->cfg.mem = mst_mem_config_default();
    char* text = NULL;
    mst_json j;
    mst_status st = load_json(path, &text, &j);
    if (st == MST_OK) {
        st = parse_meta(path, &j, out);
        mst_json_free(&j);
    }
    free(text);
    return st;
}

/* One [main, mtp, aux, eval] entry of "losses" (eval null: NaN). */
static int read_loss_row(const mst_json* j, int32_t t, double* v) {
    if (j->tok[t].kind != MST_JSON_ARRAY || j->tok[t].n_children != 4) return -1;
    int32_t x = t + 1;
    for (int k = 0; k < 4; k++, x = j->tok[x].next)
        if (mst_json_f64(j, x, &v[k]) && !(k == 3 && mst_json_eq(j, x, "null") && (v[k] = NAN, 1))) return -1;
    return 0;
}

mst_status mst_ckpt_read_losses(const char* dir, int64_t step, mst_train_result* res) {
    char path[4200];
    snprintf(path, sizeof path, "%s/trainer.json", dir);
    char* text = NULL;
    mst_json j;
    mst_status st = load_json(path, &text, &j);
    if (st != MST_OK) {
        free(text);
        return st;
    }
    const int32_t a = mst_json_get(&j, 0, "losses");
    if (a < 0 || j.tok[a].kind != MST_JSON_ARRAY || j.tok[a].n_children != step)
        st = mst_set_error(MST_ERR_INVALID, "checkpoint '%s': \"losses\" is not %lld rows", path, (long long)step);
    int32_t t = a + 1;
    for (int64_t i = 0; st == MST_OK && i < step; i++, t = j.tok[t].next) {
        double v[4];
        if (read_loss_row(&j, t, v))
            st = mst_set_error(MST_ERR_INVALID, "checkpoint '%s': losses row %lld is not [main, mtp, aux, eval]", path, (long long)i);
        else if (i < res->steps)
            res->loss[i] = v[0], res->mtp_loss[i] = v[1], res->aux_loss[i] = v[2], res->eval_loss[i] = v[3];
    }
    mst_json_free(&j);
    free(text);
    return st;
}
