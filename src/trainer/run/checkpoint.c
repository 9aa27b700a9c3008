/*
 * checkpoint.c — writing a checkpoint (checkpoint.h): the file sets and
 * their shards (the same plan on every rank), the indexes, the directory
 * published by one rename; the room one checkpoint takes.
 */
#define _POSIX_C_SOURCE 200809L /* mkdir, rename, statvfs, fsync */
#include "checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

/* ---- the file sets and their shards --------------------------------------------- */

/* A file set: its tensors (the parameters of one or both hf sets) in
 * n_kinds dtypes/buffers each. */
typedef struct set_spec {
    const char* prefix;   /* "model", "mtp", "optimizer" */
    int32_t which;        /* MST_HF_MODEL, MST_HF_MTP, or -1: both */
    int32_t n_kinds;      /* 1: the bf16 weights; 3: master, adam_m, adam_v */
} set_spec;

static const set_spec sets[] = {{"model", MST_HF_MODEL, 1}, {"mtp", MST_HF_MTP, 1}, {"optimizer", -1, 3}};
enum { N_SETS = 3 };

static const char* const kind_prefix[3] = {"master.", "adam_m.", "adam_v."};

typedef struct shard {
    int32_t owner;        /* the rank that writes it            */
    int32_t first, n;     /* its items: order[first .. first+n) */
} shard;

typedef struct plan {
    int32_t* order;       /* [n_items] parameter indices: by owner rank, then table order */
    int32_t n_items;
    shard* shards;        /* [n_shards]                          */
    int32_t n_shards;
} plan;

/* The grid rank that writes p: data-parallel rank 0 of the stage that holds
 * it (the embedding: stage 0, whose copy counts; a tied table's copy on the
 * last stage is not written), an expert's own rank there. */
static int32_t owner_of(const mst_hf_param* p, const mst_model* m) {
    const int32_t per_rank = m->n_local;
    const int first = strcmp(p->name, "model.embed_tokens.weight") == 0;
    return mst_model_stage_of(m, p->layer, first) * m->dist.world + (p->expert < 0 ? 0 : p->expert / per_rank);
}

static uint64_t item_bytes(const mst_hf_param* p, const set_spec* s) {
    return (uint64_t)mst_hf_numel(p) * (s->n_kinds == 1 ? 2u : 12u);
}

/* The shards of set s over W ranks: each rank's tensors packed in table
 * order into shards of at most `limit` bytes (a bigger tensor alone). */
static mst_status plan_set(const mst_hf_param* p, int32_t np, const set_spec* s, const mst_model* m, uint64_t limit,
                           plan* out) {
    const int32_t W = mst_model_grid_size(m);
    memset(out, 0, sizeof *out);
    out->order = (int32_t*)malloc(sizeof(int32_t) * (size_t)np);
    out->shards = (shard*)malloc(sizeof(shard) * (size_t)(np + W));
    if (!out->order || !out->shards) return mst_set_error(MST_ERR_OOM, "checkpoint: shard plan of %d tensors", np);
    for (int32_t r = 0; r < W; r++) {
        uint64_t bytes = 0;
        for (int32_t i = 0; i < np; i++) {
            if ((s->which >= 0 && p[i].set != s->which) || owner_of(&p[i], m) != r) continue;
            const uint64_t b = item_bytes(&p[i], s);
            shard* last = out->n_shards ? &out->shards[out->n_shards - 1] : NULL;
            if (!last || last->owner != r || (last->n && bytes + b > limit)) {
                out->shards[out->n_shards++] = (shard){r, out->n_items, 0};
                last = &out->shards[out->n_shards - 1];
                bytes = 0;
            }
            out->order[out->n_items++] = i;
            last->n++;
            bytes += b;
        }
    }
    return MST_OK;
}

static void plan_free(plan* pl) {
    free(pl->order);
    free(pl->shards);
    memset(pl, 0, sizeof *pl);
}

/* The file name of shard k of K. */
static void shard_name(const set_spec* s, int32_t k, int32_t K, char* buf, size_t cap) {
    if (K == 1) snprintf(buf, cap, "%s.safetensors", s->prefix);
    else snprintf(buf, cap, "%s-%05d-of-%05d.safetensors", s->prefix, k + 1, K);
}

/* Elements [off, off + n) of kind k of set s into host: the bf16 weights
 * from the backend, the optimizer's from this rank's state and, sharded,
 * the replicated runs from runs [3] (mst_optim_gather_runs'). */
static mst_status read_kind(mst_model* m, const set_spec* s, int32_t k, float* const runs[3], int64_t off, int64_t n,
                            void* host) {
    if (s->n_kinds == 1) return mst_copy_b2h(m->ctx, host, m->w + off, sizeof(uint16_t) * (size_t)n);
    return mst_optim_state_get(m, k, off, n, runs[k], (float*)host);
}

static void entry_of(const mst_hf_param* p, const set_spec* s, int32_t k, mst_st_entry* e) {
    memset(e, 0, sizeof *e);
    snprintf(e->name, sizeof e->name, "%s%s", s->n_kinds == 1 ? "" : kind_prefix[k], p->name);
    e->dtype = s->n_kinds == 1 ? MST_ST_BF16 : MST_ST_F32;
    e->nd = p->nd;
    e->dims[0] = p->dims[0], e->dims[1] = p->dims[1];
}

/* Writes shard sh of set s (this rank's) as path. */
static mst_status write_shard(mst_model* m, const mst_hf_param* p, const set_spec* s, const plan* pl, const shard* sh,
                              float* const state[3], const char* path) {
    const int32_t n = sh->n * s->n_kinds;
    mst_st_entry* e = (mst_st_entry*)malloc(sizeof *e * (size_t)n);
    int64_t big = 1;
    for (int32_t i = 0; i < sh->n; i++) {
        const mst_hf_param* q = &p[pl->order[sh->first + i]];
        MST_ASSERT(q->off >= 0); /* this rank's own */
        big = mst_hf_numel(q) > big ? mst_hf_numel(q) : big;
        for (int32_t k = 0; e && k < s->n_kinds; k++) entry_of(q, s, k, &e[i * s->n_kinds + k]);
    }
    void* host = malloc((size_t)big * 4);
    mst_st_writer w;
    mst_status st = e && host ? mst_st_write_begin(&w, path, e, n) : mst_set_error(MST_ERR_OOM, "checkpoint '%s'", path);
    for (int32_t i = 0; st == MST_OK && i < sh->n; i++) {
        const mst_hf_param* q = &p[pl->order[sh->first + i]];
        for (int32_t k = 0; st == MST_OK && k < s->n_kinds; k++) {
            const size_t bytes = (size_t)mst_hf_numel(q) * (s->n_kinds == 1 ? 2 : 4);
            st = read_kind(m, s, k, state, q->off, mst_hf_numel(q), host);
            if (st == MST_OK) st = mst_st_write_data(&w, host, bytes);
            else mst_st_write_abort(&w);
        }
    }
    if (st == MST_OK) st = mst_st_write_end(&w);
    free(host);
    free(e);
    return st;
}

/* model.safetensors.index.json (or the set's): every tensor to its shard. */
static mst_status write_index(const mst_hf_param* p, const set_spec* s, const plan* pl, const char* dir) {
    char path[4400], name[64];
    snprintf(path, sizeof path, "%s/%s.safetensors.index.json", dir, s->prefix);
    FILE* f = fopen(path, "w");
    if (!f) return mst_set_error(MST_ERR_IO, "checkpoint '%s': %s", path, strerror(errno));
    uint64_t total = 0;
    for (int32_t i = 0; i < pl->n_items; i++) total += item_bytes(&p[pl->order[i]], s);
    fprintf(f, "{\n  \"metadata\": {\"total_size\": %llu},\n  \"weight_map\": {", (unsigned long long)total);
    int first = 1;
    for (int32_t k = 0; k < pl->n_shards; k++) {
        shard_name(s, k, pl->n_shards, name, sizeof name);
        for (int32_t i = 0; i < pl->shards[k].n; i++)
            for (int32_t t = 0; t < s->n_kinds; t++) {
                fprintf(f, "%s\n    \"%s%s\": \"%s\"", first ? "" : ",", s->n_kinds == 1 ? "" : kind_prefix[t],
                        p[pl->order[pl->shards[k].first + i]].name, name);
                first = 0;
            }
    }
    fprintf(f, "\n  }\n}\n");
    int bad = ferror(f) || fflush(f) != 0 || fsync(fileno(f)) != 0;
    bad |= fclose(f) != 0;
    return bad ? mst_set_error(MST_ERR_IO, "checkpoint '%s': write failed: %s", path, strerror(errno)) : MST_OK;
}

/* Sharded: the replicated runs' optimizer state into runs [3] on the
 * data-parallel rank 0 (the writer of the replicated tensors), the other
 * ranks taking part (collective, before any writes); unsharded: nothing,
 * every rank reads its state as it writes. */
static mst_status gather_runs(mst_model* m, float* runs[3]) {
    if (!m->opt_shard) return MST_OK;
    const size_t n = (size_t)(m->rep[0].n + m->rep[1].n);
    mst_status st = MST_OK;
    for (int k = 0; k < 3 && m->dist.rank == 0; k++) {
        runs[k] = (float*)malloc(sizeof(float) * n + 1);
        if (!runs[k] && st == MST_OK) st = mst_set_error(MST_ERR_OOM, "checkpoint: optimizer state (%zu)", n);
    }
    int32_t bad = st != MST_OK; /* every rank gathers, or none */
    MST_TRY(mst_model_allreduce_host(m, &bad, 1, MST_EP_MAX_I32));
    if (bad) return st != MST_OK ? st : mst_set_error(MST_ERR_STATE, "checkpoint: another rank failed gathering the optimizer state");
    for (int k = 0; k < 3 && st == MST_OK; k++) st = mst_optim_gather_runs(m, k, runs[k]);
    return st;
}

/* This rank's shards of every set into dir; rank 0 also the indexes. */
static mst_status write_sets(mst_model* m, const mst_train_config* cfg, const char* dir) {
    const mst_model_config* c = &m->cfg;
    const int32_t np = mst_hf_n_params(c), rank = mst_model_grid_rank(m);
    float* state[3] = {NULL, NULL, NULL}; /* sharded, DP rank 0: [rep[0].n + rep[1].n] each: master, adam_m, adam_v */
    mst_status st = gather_runs(m, state);
    mst_hf_param* p = st == MST_OK ? (mst_hf_param*)malloc(sizeof *p * (size_t)np) : NULL;
    if (!p) {
        for (int k = 0; k < 3; k++) free(state[k]);
        return st != MST_OK ? st : mst_set_error(MST_ERR_OOM, "checkpoint: %d tensor names", np);
    }
    mst_hf_params(c, m, p);
    const uint64_t limit = cfg->save_shard_bytes ? (uint64_t)cfg->save_shard_bytes : MST_CKPT_SHARD_BYTES;
    st = mst_hf_params_check(p, np, m);
    char path[4400], name[64];
    for (int s = 0; s < N_SETS && st == MST_OK; s++) {
        plan pl;
        st = plan_set(p, np, &sets[s], m, limit, &pl);
        for (int32_t k = 0; st == MST_OK && k < pl.n_shards; k++) {
            if (pl.shards[k].owner != rank) continue;
            shard_name(&sets[s], k, pl.n_shards, name, sizeof name);
            snprintf(path, sizeof path, "%s/%s", dir, name);
            st = write_shard(m, p, &sets[s], &pl, &pl.shards[k], state, path);
        }
        if (st == MST_OK && rank == 0 && pl.n_shards > 1) st = write_index(p, &sets[s], &pl, dir);
        plan_free(&pl);
    }
    free(p);
    for (int k = 0; k < 3; k++) free(state[k]);
    return st;
}

/* ---- the directory ----------------------------------------------------------------- */

static mst_status mkdirs(const char* dir) {
    char p[4300];
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

/* Removes dir and the files in it (a checkpoint has no subdirectories). */
static void remove_dir(const char* dir) {
    DIR* d = opendir(dir);
    if (!d) return;
    char path[4600];
    for (struct dirent* e; (e = readdir(d));) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        unlink(path);
    }
    closedir(d);
    rmdir(dir);
}

static int is_dir(const char* path) {
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* dir's parent ("." when it has none) into buf. */
static void parent_of(const char* dir, char* buf, size_t cap) {
    snprintf(buf, cap, "%s", dir);
    char* slash = strrchr(buf, '/');
    while (slash && slash > buf && slash[1] == 0) *slash = 0, slash = strrchr(buf, '/'); /* trailing slashes */
    if (!slash) snprintf(buf, cap, ".");
    else if (slash == buf) buf[1] = 0;
    else *slash = 0;
}

/* tmp (complete and synced) becomes dir; an older dir goes only then. */
static mst_status publish(const char* tmp, const char* dir) {
    char old[4300], parent[4300];
    snprintf(old, sizeof old, "%s.old", dir);
    parent_of(dir, parent, sizeof parent);
    MST_TRY(mst_fsync_dir(tmp));
    const int had = is_dir(dir);
    if (had) {
        remove_dir(old);
        if (rename(dir, old) != 0) return mst_set_error(MST_ERR_IO, "checkpoint '%s': rename to '%s': %s", dir, old, strerror(errno));
    }
    if (rename(tmp, dir) != 0) {
        mst_status st = mst_set_error(MST_ERR_IO, "checkpoint '%s': rename from '%s': %s", dir, tmp, strerror(errno));
        if (had) rename(old, dir);
        return st;
    }
    if (had) remove_dir(old);
    return mst_fsync_dir(parent);
}

/* W ranks: the first failure of any rank is every rank's (MST_ERR_STATE on
 * the ranks that did not fail themselves); one rank: st. */
static mst_status agree(mst_model* m, mst_status st, const char* dir) {
    int32_t failed = st != MST_OK;
    if (!m->dist.ep && !m->dist.pipe) return st;
    const mst_status sync = mst_model_allreduce_host_world(m, &failed, 1, MST_EP_MAX_I32);
    if (st != MST_OK) return st;
    if (sync != MST_OK) return sync;
    return failed ? mst_set_error(MST_ERR_STATE, "checkpoint '%s': another rank failed writing it", dir) : MST_OK;
}

mst_status mst_ckpt_save(mst_model* m, const mst_train_config* cfg, int64_t step, uint64_t data_rng,
                         const mst_train_result* res, const char* dir) {
    const int rank0 = mst_model_grid_rank(m) == 0;
    char tmp[4300], path[4400], parent[4300];
    snprintf(tmp, sizeof tmp, "%s.tmp", dir);
    parent_of(dir, parent, sizeof parent);
    mst_status st = MST_OK;
    if (rank0) { /* a stale DIR.tmp of an interrupted write goes first */
        remove_dir(tmp);
        st = mkdirs(parent);
        if (st == MST_OK) st = mkdirs(tmp);
    }
    st = agree(m, st, dir);
    if (st == MST_OK) st = agree(m, write_sets(m, cfg, tmp), dir);
    if (st == MST_OK && rank0) {
        snprintf(path, sizeof path, "%s/config.json", tmp);
        st = mst_hf_write_config(path, &m->cfg);
        snprintf(path, sizeof path, "%s/trainer.json", tmp);
        if (st == MST_OK) st = mst_ckpt_write_meta(path, cfg, mst_model_grid_size(m), step, data_rng, res);
        if (st == MST_OK) st = publish(tmp, dir);
    }
    if (st != MST_OK && rank0) remove_dir(tmp);
    return agree(m, st, dir);
}

/* ---- room on the disk -------------------------------------------------------------- */

double mst_ckpt_bytes(const mst_model_config* c, int64_t steps) {
    const int32_t np = mst_hf_n_params(c);
    mst_hf_param* p = (mst_hf_param*)malloc(sizeof *p * (size_t)np);
    if (!p) return 0;
    mst_hf_params(c, NULL, p);
    double elems = 0;
    for (int32_t i = 0; i < np; i++) elems += (double)mst_hf_numel(&p[i]);
    free(p);
    /* 2 bytes (weights) + 12 (master, m, v) per element; each tensor named
     * in up to 4 headers and 4 index lines of under 256 bytes; config.json,
     * trainer.json (about 100 bytes a step) */
    return elems * 14 + (double)np * 2048 + 65536 + 128.0 * (double)steps;
}

mst_status mst_ckpt_check_room(const mst_train_config* cfg, const char* dir) {
    char at[4300];
    snprintf(at, sizeof at, "%s", dir);
    while (!is_dir(at) && strcmp(at, ".") != 0 && strcmp(at, "/") != 0) {
        char up[4300];
        parent_of(at, up, sizeof up);
        snprintf(at, sizeof at, "%s", up);
    }
    struct statvfs sv;
    if (statvfs(at, &sv) != 0) return mst_set_error(MST_ERR_IO, "--save '%s': %s: %s", dir, at, strerror(errno));
    const double have = (double)sv.f_bavail * (double)sv.f_frsize, need = mst_ckpt_bytes(&cfg->model, cfg->steps);
    if (need <= have) return MST_OK;
    return mst_set_error(MST_ERR_INVALID, "--save '%s': one checkpoint takes %.1f MiB, the filesystem there has %.1f MiB free",
                         dir, need / 1048576.0, have / 1048576.0);
}
