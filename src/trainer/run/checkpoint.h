/*
 * checkpoint.h — a training run on disk, so that it can be resumed bit for
 * bit and its model opened elsewhere. A checkpoint is a directory:
 *
 *   model.safetensors      the bf16 weights the forward pass uses, one tensor
 *                          per parameter ("layers.0.attn.wqkv" [3H, H], ...;
 *                          dtype BF16), readable with the `safetensors`
 *                          package (safetensors.torch.load_file)
 *   optimizer.safetensors  per parameter, dtype F32: "master.<name>" (fp32
 *                          master weights), "adam_m.<name>", "adam_v.<name>"
 *   trainer.json           format name and version, the steps done, the data
 *                          sampler's state, the run's configuration
 *                          ("config.<field>") and an FNV-1a hash of the data
 *                          of each tensor file
 *
 * A run on W > 1 ranks writes one such directory per rank, DIR/rank-R, each
 * with that rank's tensors (the replicated ones, and its shard of the
 * experts: "layers.l.experts.w1" [E / W, 2F, H] holding experts
 * [R E / W, (R + 1) E / W)) and a trainer.json naming W ("ranks"); it
 * resumes on W ranks only.
 *
 * trainer.json is written last, each file under a temporary name renamed
 * into place: a directory without it is not a checkpoint. Loading checks the
 * format version, every tensor's name, dtype and shape against the model, the
 * file sizes (truncation) and the hashes, and fails with MST_ERR_INVALID or
 * MST_ERR_IO naming the file and what differs; nothing is loaded partially
 * into the model unless every check passed for the tensors read so far
 * (a failed load leaves the model's weights undefined: rebuild it).
 */
#ifndef MST_CHECKPOINT_H
#define MST_CHECKPOINT_H

#include "trainer.h"

enum { MST_CKPT_VERSION = 1 };

/* What a checkpoint holds besides tensors: the configuration (its strings
 * point into the buffers below), steps done and the sampler's state. */
typedef struct mst_ckpt_meta {
    mst_train_config cfg;
    int64_t step;             /* optimizer steps done                      */
    int32_t ranks;            /* W of the run that wrote it (1: one rank)  */
    uint64_t data_rng;        /* mst_data.rng after `step` steps           */
    char policy[512];         /* cfg.mem.policy ("" when NULL)             */
    char data_path[4096];     /* cfg.data_path ("" when synthetic)         */
    char eval_path[4096];     /* cfg.eval_path ("" when none)              */
} mst_ckpt_meta;

/* Writes the checkpoint of m after `step` steps into dir (created, with its
 * parent, when missing). */
mst_status mst_ckpt_save(mst_model* m, const mst_train_config* cfg, int64_t step, uint64_t data_rng,
                         const char* dir);
/* Reads dir/trainer.json, or dir/rank-0/trainer.json where the run had
 * several ranks. */
mst_status mst_ckpt_read_meta(const char* dir, mst_ckpt_meta* out);
/* MST_ERR_INVALID naming dir unless the checkpoint was saved by `ranks`
 * ranks (its meta's). */
mst_status mst_ckpt_check_ranks(const mst_ckpt_meta* meta, const char* dir, int32_t ranks);
/* Loads the tensors of dir into m (built from the checkpoint's config). */
mst_status mst_ckpt_load(mst_model* m, const char* dir);
/* One bf16 weight of dir/model.safetensors by name, n elements, as fp32
 * into host out [n] (for tools that need no model: sampling). */
mst_status mst_ckpt_read_bf16(const char* dir, const char* name, int64_t n, float* out);

#endif
