/*
 * hf.h — a Hugging Face Qwen3-MoE model directory, as transformers writes
 * and reads it (Qwen3MoeForCausalLM), and the names of the trainer's
 * parameters in it:
 *
 *   config.json                       model_type "qwen3_moe" and its fields
 *   model.safetensors                 the weights by their hub names, or
 *   model.safetensors.index.json      {"weight_map": {name: shard file}} and
 *   model-0000i-of-0000K.safetensors  its shards
 *   mtp.safetensors (or mtp.safetensors.index.json and mtp-*-of-*): the
 *                                     MTP module, DeepSeek-V3 names
 *                                     (model.layers.{L}.enorm, .hnorm,
 *                                     .eh_proj, .shared_head.norm and layer
 *                                     L's tensors); transformers ignores it
 *
 * Readers (sample, eval, --init-from) go through mst_hf_open /
 * mst_hf_read: every file's header is checked (safetensors.h) when opened,
 * each tensor's shape when read, dtypes F32, BF16 and F16 convert.
 */
#ifndef MST_HF_H
#define MST_HF_H

#include "safetensors.h"
#include "trainer/model/model.h"

/* ---- config.json ---- */

/* Reads dir/config.json into the architecture fields of *cfg: vocab,
 * hidden, ffn (moe_intermediate_size), n_head, n_kv_head, head_dim,
 * rope_theta, norm_eps, layers, experts, top_k, norm_topk_prob,
 * tie_embeddings, aux_coef (router_aux_loss_coef); the others (seq,
 * batch, ep, seeds, ...) stay as they were. MST_ERR_INVALID naming the file
 * and the field: another model_type, a field missing or out of range, a
 * feature the trainer does not have (dense layers, sliding window, biases,
 * another rope_type or activation). */
mst_status mst_hf_read_config(const char* dir, mst_model_config* cfg);
/* The architecture fields config.json holds, by JSON key, with the train
 * flag that sets each (NULL: none). */
typedef struct mst_hf_field {
    const char* key;      /* "hidden_size"                              */
    const char* flag;     /* "--hidden", or NULL                        */
    size_t off;           /* in mst_model_config                        */
    int32_t type;         /* 0: int64_t, 1: int32_t, 2: float           */
} mst_hf_field;
const mst_hf_field* mst_hf_fields(int32_t* n);
/* The first field (index into mst_hf_fields) where a and b differ, or -1. */
int32_t mst_hf_config_diff(const mst_model_config* a, const mst_model_config* b);
/* Field f of c as text ("128", "1e+06"). */
void mst_hf_field_str(const mst_model_config* c, int32_t f, char* buf, size_t cap);
/* Writes c as a config.json at path (fsync'ed). */
mst_status mst_hf_write_config(const char* path, const mst_model_config* c);
/* The query, key-value heads and head dim of c (n_kv_head 0: NH; head_dim
 * 0: H / NH). */
int64_t mst_hf_kv_heads(const mst_model_config* c);
int64_t mst_hf_head_dim(const mst_model_config* c);

/* ---- the parameters by name ---- */

enum { MST_HF_MODEL = 0, MST_HF_MTP = 1 };

typedef struct mst_hf_param {
    char name[96];      /* the hub name ("model.layers.3.mlp.experts.7.up_proj.weight") */
    int32_t nd;
    int64_t dims[2];
    int32_t set;        /* MST_HF_MODEL or MST_HF_MTP (its file set)        */
    int32_t layer;      /* 0 .. L (L: the MTP layer), -1 outside the layers  */
    int32_t expert;     /* global expert index, -1: not an expert's (every
                           rank holds it)                                    */
    int64_t off;        /* element offset in the model's flat buffers, -1:
                           no model given, or another rank's expert          */
} mst_hf_param;

int64_t mst_hf_numel(const mst_hf_param* p);
/* Tensors of a model of config c (embedding, layers, norm, untied head,
 * then the MTP module). */
int32_t mst_hf_n_params(const mst_model_config* c);
/* out [mst_hf_n_params(c)]: model.embed_tokens; per layer
 * input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
 * post_attention_layernorm, mlp.gate, mlp.experts.{e}.{gate,up,down}_proj;
 * model.norm; lm_head (untied only); then the MTP module: enorm, hnorm,
 * eh_proj, shared_head.norm and layer L's tensors. m (may be NULL): the
 * offsets of its rank's tensors in its flat buffers (model.h's layout). */
void mst_hf_params(const mst_model_config* c, const mst_model* m, mst_hf_param* out);
/* MST_ERR_STATE unless the tensors of p [np] (mst_hf_params with m) that
 * m's rank holds tile its flat buffers [0, n_params) exactly. */
mst_status mst_hf_params_check(const mst_hf_param* p, int32_t np, const mst_model* m);

/* ---- reading a directory ---- */

typedef struct mst_hf mst_hf;

/* Opens the file set `prefix` of dir ("model", "mtp", "optimizer"):
 * prefix.safetensors, else prefix.safetensors.index.json and the shards
 * its weight_map names; every header checked, and each name of the index
 * in its shard. Absent: MST_ERR_INVALID naming both files when required,
 * else MST_OK with *out NULL. */
mst_status mst_hf_open_set(const char* dir, const char* prefix, int required, mst_hf** out);
/* The model of dir: its "model" set and, where present, its "mtp" set. */
mst_status mst_hf_open(const char* dir, mst_hf** out);
void mst_hf_close(mst_hf* h);
/* 1 when the open sets hold a tensor named name. */
int mst_hf_has(const mst_hf* h, const char* name);
/* The header entry of tensor name (NULL: none), and its file's path. */
const mst_st_entry* mst_hf_entry(const mst_hf* h, const char* name, const char** path);
/* Tensors in the open sets, and the i-th's name and file (0 <= i < n). */
int64_t mst_hf_n_tensors(const mst_hf* h);
const char* mst_hf_tensor_name(const mst_hf* h, int64_t i, const char** path);
/* From now on each file's data is checked against its hash (mst_st_verify)
 * before its first tensor is read. */
void mst_hf_verify_on_read(mst_hf* h);
/* Tensor name, which must have shape dims [nd], converted into out (to:
 * MST_ST_F32 float [numel], MST_ST_BF16 uint16_t [numel]). MST_ERR_INVALID
 * naming the file when it is missing or of another shape. */
mst_status mst_hf_read(const mst_hf* h, const char* name, int32_t nd, const int64_t* dims, mst_st_dtype to, void* out);
/* MST_ERR_INVALID naming the file unless tensor name is there with shape dims [nd]. */
mst_status mst_hf_check_shape(const mst_hf* h, const char* name, int32_t nd, const int64_t* dims);
/* The same for a parameter of mst_hf_params. */
mst_status mst_hf_read_param(const mst_hf* h, const mst_hf_param* p, mst_st_dtype to, void* out);
/* Checks every file's data against the hash in its header (files without
 * one pass). */
mst_status mst_hf_verify(const mst_hf* h);
/* The directory (as given to open). */
const char* mst_hf_dir(const mst_hf* h);

#endif
