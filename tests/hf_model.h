/*
 * hf_model.h — tests' random Qwen3-MoE model directories (header-only):
 * config.json and model.safetensors written through trainer/io/hf.h, F32
 * weights (norm weights in [0.8, 1.2], matrices in [-scale, scale]), the
 * hub's names, independent of the trainer's model and checkpoints.
 */
#ifndef MST_TEST_HF_MODEL_H
#define MST_TEST_HF_MODEL_H

#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "trainer/io/hf.h"

/* dir/config.json and dir/model.safetensors of config c; skip: the table
 * index (mst_hf_params) of a tensor left out (-1: none); bad_shape: the
 * index of one written with its first dim one short (-1: none). */
static inline void mst_test_write_hf_model(const char* dir, const mst_model_config* c, mst_rng* r, double scale,
                                           int32_t skip, int32_t bad_shape) {
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    CHECK_OK(mst_hf_write_config(path, c));
    const int32_t n = mst_hf_n_params(c);
    mst_hf_param* p = (mst_hf_param*)calloc((size_t)n, sizeof *p);
    mst_st_entry* e = (mst_st_entry*)calloc((size_t)n, sizeof *e);
    mst_hf_params(c, NULL, p);
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++) {
        if (p[i].set != MST_HF_MODEL || i == skip) continue;
        snprintf(e[m].name, sizeof e[m].name, "%s", p[i].name);
        e[m].dtype = MST_ST_F32, e[m].nd = p[i].nd;
        e[m].dims[0] = p[i].dims[0] - (i == bad_shape), e[m].dims[1] = p[i].dims[1];
        m++;
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    mst_st_writer w;
    CHECK_OK(mst_st_write_begin(&w, path, e, m));
    for (int32_t i = 0; i < m; i++) {
        const int64_t k = mst_st_numel(&e[i]);
        float* v = (float*)malloc(sizeof(float) * (size_t)k);
        const int norm = e[i].nd == 1;
        mst_rng_fp32(r, v, (size_t)k, norm ? 0.8 : -scale, norm ? 1.2 : scale);
        CHECK_OK(mst_st_write_data(&w, v, sizeof(float) * (size_t)k));
        free(v);
    }
    CHECK_OK(mst_st_write_end(&w));
    free(p), free(e);
}

#endif
