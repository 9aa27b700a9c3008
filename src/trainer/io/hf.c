/*
 * hf.c — reading the tensor file sets of a model directory (hf.h): one
 * file, or an index and its shards, each header checked when opened.
 */
#include "hf.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json.h"

struct mst_hf {
    char* dir;            /* owned                                    */
    mst_st_file* files;   /* [n_files] every file of every open set    */
    int32_t n_files, cap;
    uint8_t* checked;     /* [n_files] verify on read: 1 once verified (NULL: off) */
};

static int exists(const char* path) {
    FILE* f = fopen(path, "rb");
    if (f) fclose(f);
    return f != NULL;
}

static mst_status add_file(mst_hf* h, const char* path) {
    if (h->n_files == h->cap) {
        const int32_t cap = h->cap ? 2 * h->cap : 8;
        mst_st_file* f = (mst_st_file*)realloc(h->files, sizeof *f * (size_t)cap);
        if (!f) return mst_set_error(MST_ERR_OOM, "'%s': file list", path);
        h->files = f, h->cap = cap;
    }
    MST_TRY(mst_st_open(path, &h->files[h->n_files]));
    h->n_files++;
    return MST_OK;
}

/* The file among the open ones that holds name, or NULL. */
static const mst_st_file* holder(const mst_hf* h, const char* name, const mst_st_entry** e) {
    for (int32_t i = 0; i < h->n_files; i++)
        if ((*e = mst_st_find(&h->files[i], name))) return &h->files[i];
    return NULL;
}

/* A shard file name of an index: a plain name in the directory. */
static int plain_name(const char* s) { return s[0] && s[0] != '.' && !strchr(s, '/') && !strchr(s, '\\'); }

static mst_status read_text(const char* path, char** text, size_t* n) {
    FILE* f = fopen(path, "rb");
    if (!f) return mst_set_error(MST_ERR_INVALID, "'%s': %s", path, strerror(errno));
    enum { CAP = 64 << 20 };
    size_t cap = 1 << 16;
    *text = NULL, *n = 0;
    for (;;) {
        char* t = (char*)realloc(*text, cap + 1);
        if (!t) break;
        *text = t;
        *n += fread(t + *n, 1, cap - *n, f);
        if (*n < cap || cap >= CAP) break;
        cap *= 2;
    }
    const int more = !feof(f);
    fclose(f);
    if (!*text || more) {
        free(*text);
        return mst_set_error(MST_ERR_INVALID, "'%s': over 64 MiB (not an index)", path);
    }
    return MST_OK;
}

/* prefix.safetensors.index.json: opens each shard its weight_map names (once)
 * and checks every name is in its shard. */
static mst_status open_index(mst_hf* h, const char* path) {
    char* text = NULL;
    size_t n = 0, err_at = 0;
    MST_TRY(read_text(path, &text, &n));
    mst_json j = {0};
    mst_status st = mst_json_parse(text, n, &j, &err_at) ? mst_set_error(MST_ERR_INVALID, "'%s': not JSON (byte %zu)", path, err_at)
                                                         : MST_OK;
    const int32_t map = st == MST_OK ? mst_json_get(&j, 0, "weight_map") : -1;
    if (st == MST_OK && (map < 0 || j.tok[map].kind != MST_JSON_OBJECT))
        st = mst_set_error(MST_ERR_INVALID, "'%s': no weight_map object", path);
    const int32_t first = h->n_files;
    char name[MST_ST_NAME], file[512], full[4800];
    /* the shards, each once (in the order first named) */
    for (int32_t k = map + 1; st == MST_OK && k < j.tok[map].next; k = j.tok[k + 1].next) {
        if (mst_json_str(&j, k + 1, file, sizeof file) || j.tok[k + 1].kind != MST_JSON_STRING || !plain_name(file))
            st = mst_set_error(MST_ERR_INVALID, "'%s': a weight_map value is not a file name of the directory", path);
        int seen = 0;
        for (int32_t i = first; st == MST_OK && i < h->n_files && !seen; i++) {
            const char* base = strrchr(h->files[i].path, '/');
            seen = strcmp(base ? base + 1 : h->files[i].path, file) == 0;
        }
        snprintf(full, sizeof full, "%s/%s", h->dir, file);
        if (st == MST_OK && !seen) st = add_file(h, full);
    }
    for (int32_t k = map + 1; st == MST_OK && k < j.tok[map].next; k = j.tok[k + 1].next) {
        const mst_st_entry* e = NULL;
        const mst_st_file* f = NULL;
        if (mst_json_str(&j, k, name, sizeof name)) st = mst_set_error(MST_ERR_INVALID, "'%s': a tensor name too long", path);
        mst_json_str(&j, k + 1, file, sizeof file);
        if (st == MST_OK) f = holder(h, name, &e);
        const char* base = f ? strrchr(f->path, '/') : NULL;
        if (st == MST_OK && (!f || strcmp(base ? base + 1 : f->path, file) != 0))
            st = mst_set_error(MST_ERR_INVALID, "'%s': tensor '%s' is not in '%s', where its weight_map says", path, name, file);
    }
    mst_json_free(&j);
    free(text);
    return st;
}

/* No name in two files of the set opened from `first` on. */
static mst_status no_twins(const mst_hf* h, int32_t first) {
    for (int32_t i = first + 1; i < h->n_files; i++)
        for (int32_t k = 0; k < h->files[i].n; k++)
            for (int32_t o = 0; o < i; o++)
                if (mst_st_find(&h->files[o], h->files[i].e[k].name))
                    return mst_set_error(MST_ERR_INVALID, "'%s': tensor '%s' is also in '%s'", h->files[i].path,
                                         h->files[i].e[k].name, h->files[o].path);
    return MST_OK;
}

/* Adds the set `prefix` of h's directory to h; *found 0 when it has none. */
static mst_status add_set(mst_hf* h, const char* prefix, int required, int* found) {
    char one[4300], index[4300];
    snprintf(one, sizeof one, "%s/%s.safetensors", h->dir, prefix);
    snprintf(index, sizeof index, "%s/%s.safetensors.index.json", h->dir, prefix);
    const int32_t first = h->n_files;
    *found = 1;
    if (exists(one)) MST_TRY(add_file(h, one));
    else if (exists(index)) MST_TRY(open_index(h, index));
    else if (required)
        return mst_set_error(MST_ERR_INVALID, "'%s': neither %s.safetensors nor %s.safetensors.index.json", h->dir, prefix, prefix);
    else *found = 0;
    return no_twins(h, first);
}

static mst_status create(const char* dir, mst_hf** out) {
    *out = (mst_hf*)calloc(1, sizeof **out);
    if (*out) (*out)->dir = strdup(dir);
    if (*out && (*out)->dir) return MST_OK;
    mst_hf_close(*out);
    *out = NULL;
    return mst_set_error(MST_ERR_OOM, "'%s'", dir);
}

mst_status mst_hf_open_set(const char* dir, const char* prefix, int required, mst_hf** out) {
    MST_TRY(create(dir, out));
    int found = 0;
    mst_status st = add_set(*out, prefix, required, &found);
    if (st != MST_OK || !found) {
        mst_hf_close(*out);
        *out = NULL;
    }
    return st;
}

mst_status mst_hf_open(const char* dir, mst_hf** out) {
    MST_TRY(create(dir, out));
    int found = 0;
    mst_status st = add_set(*out, "model", 1, &found);
    if (st == MST_OK) st = add_set(*out, "mtp", 0, &found);
    if (st != MST_OK) {
        mst_hf_close(*out);
        *out = NULL;
    }
    return st;
}

void mst_hf_close(mst_hf* h) {
    if (!h) return;
    for (int32_t i = 0; i < h->n_files; i++) mst_st_close(&h->files[i]);
    free(h->files);
    free(h->checked);
    free(h->dir);
    free(h);
}

const char* mst_hf_dir(const mst_hf* h) { return h->dir; }

int mst_hf_has(const mst_hf* h, const char* name) {
    const mst_st_entry* e = NULL;
    return h && holder(h, name, &e) != NULL;
}

mst_status mst_hf_check_shape(const mst_hf* h, const char* name, int32_t nd, const int64_t* dims) {
    const mst_st_entry* e = NULL;
    const mst_st_file* f = holder(h, name, &e);
    if (!f) return mst_set_error(MST_ERR_INVALID, "'%s': no tensor '%s' (missing)", h->dir, name);
    int same = e->nd == nd;
    for (int32_t d = 0; same && d < nd; d++) same = e->dims[d] == dims[d];
    if (same) return MST_OK;
    char got[96] = "", want[96] = "";
    for (int32_t d = 0; d < e->nd; d++) snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", d ? ", " : "", (long long)e->dims[d]);
    for (int32_t d = 0; d < nd; d++) snprintf(want + strlen(want), sizeof want - strlen(want), "%s%lld", d ? ", " : "", (long long)dims[d]);
    return mst_set_error(MST_ERR_INVALID, "'%s': tensor '%s' has shape [%s], config.json makes it [%s]", f->path, name, got, want);
}

mst_status mst_hf_read(const mst_hf* h, const char* name, int32_t nd, const int64_t* dims, mst_st_dtype to, void* out) {
    MST_TRY(mst_hf_check_shape(h, name, nd, dims));
    const mst_st_entry* e = NULL;
    const mst_st_file* f = holder(h, name, &e);
    if (h->checked && !h->checked[f - h->files]) {
        MST_TRY(mst_st_verify(f));
        h->checked[f - h->files] = 1;
    }
    return mst_st_read(f, e, to, out);
}

mst_status mst_hf_read_param(const mst_hf* h, const mst_hf_param* p, mst_st_dtype to, void* out) {
    return mst_hf_read(h, p->name, p->nd, p->dims, to, out);
}

mst_status mst_hf_verify(const mst_hf* h) {
    for (int32_t i = 0; i < h->n_files; i++) MST_TRY(mst_st_verify(&h->files[i]));
    return MST_OK;
}

const mst_st_entry* mst_hf_entry(const mst_hf* h, const char* name, const char** path) {
    const mst_st_entry* e = NULL;
    const mst_st_file* f = holder(h, name, &e);
    if (path) *path = f ? f->path : NULL;
    return f ? e : NULL;
}

int64_t mst_hf_n_tensors(const mst_hf* h) {
    int64_t n = 0;
    for (int32_t i = 0; h && i < h->n_files; i++) n += h->files[i].n;
    return n;
}

const char* mst_hf_tensor_name(const mst_hf* h, int64_t i, const char** path) {
    for (int32_t k = 0; k < h->n_files; i -= h->files[k].n, k++)
        if (i < h->files[k].n) {
            if (path) *path = h->files[k].path;
            return h->files[k].e[i].name;
        }
    return NULL;
}

void mst_hf_verify_on_read(mst_hf* h) {
    if (!h->checked) h->checked = (uint8_t*)calloc((size_t)(h->n_files ? h->n_files : 1), 1);
}
