/*
 * checkpoint.h — a training run on disk: a Hugging Face model directory
 * (io/hf.h) that transformers opens as it is, and beside it, in files
 * transformers ignores, what resuming needs bit for bit:
 *
 *   config.json                   the model (model_type qwen3_moe)
 *   model.safetensors             bf16 weights by their hub names, or
 *   model.safetensors.index.json  + model-0000i-of-0000K.safetensors above
 *                                 the shard size (5 GB, HF's default)
 *   mtp.safetensors (or index)    the MTP module, bf16
 *   optimizer.safetensors (or     F32 per parameter: "master.<name>" (fp32
 *     index and shards)           master weights), "adam_m.<name>", "adam_v.<name>"
 *   trainer.json                  format and version, ranks, steps done, the
 *                                 data sampler's state, the run's
 *                                 configuration ("config.<field>"), the
 *                                 losses so far
 *
 * On W ranks the directory is still one model: rank 0 writes the
 * replicated tensors and every rank its own experts, each into its own
 * shard files of every set (so W ranks make at least W shards), and rank 0
 * the indexes, config.json and trainer.json. Resume on the same W reads
 * each rank's part back; sample and --init-from read it as any model.
 *
 * A checkpoint is written into DIR.tmp, every file fsync'ed, then renamed
 * to DIR (an older DIR is replaced only then) and the parent synced: a
 * failed or interrupted write leaves DIR as it was and removes DIR.tmp.
 * Each safetensors file holds the FNV-1a of its data, checked on resume.
 */
#ifndef MST_CHECKPOINT_H
#define MST_CHECKPOINT_H

#include "trainer.h"
#include "trainer/io/hf.h"

enum { MST_CKPT_VERSION = 2 };
#define MST_CKPT_SHARD_BYTES 5000000000ull /* the shard size of transformers' save_pretrained */

/* What trainer.json holds besides the losses: the configuration (its
 * strings point into the buffers below), steps done and the sampler's state. */
typedef struct mst_ckpt_meta {
    mst_train_config cfg;
    int64_t step;             /* optimizer steps done                      */
    int32_t ranks;            /* W of the run that wrote it (1: one rank)  */
    uint64_t data_rng;        /* mst_data.rng after `step` steps           */
    char data_path[4096];     /* cfg.data_path ("" when synthetic)         */
    char eval_path[4096];     /* cfg.eval_path ("" when none)              */
} mst_ckpt_meta;

/* Writes the checkpoint of m after `step` steps into dir (its parents
 * created when missing); res: the losses of steps 1 .. step (NULL: none).
 * Shards of at most cfg->save_shard_bytes (0: MST_CKPT_SHARD_BYTES), one
 * tensor over it alone in its shard. Collective on W ranks: every rank
 * returns the first failure of any. */
mst_status mst_ckpt_save(mst_model* m, const mst_train_config* cfg, int64_t step, uint64_t data_rng,
                         const mst_train_result* res, const char* dir);
/* Bytes one checkpoint of a model of config c takes on disk (every rank's
 * part, with headers and trainer.json for `steps` steps), an upper bound. */
double mst_ckpt_bytes(const mst_model_config* c, int64_t steps);
/* MST_ERR_INVALID naming --save, dir and both sizes unless the filesystem
 * of dir (or of its nearest existing parent) has room for one checkpoint
 * of cfg's model. */
mst_status mst_ckpt_check_room(const mst_train_config* cfg, const char* dir);

/* Writes trainer.json at path (fsync'ed); res: the losses (NULL: none). */
mst_status mst_ckpt_write_meta(const char* path, const mst_train_config* c, int32_t ranks, int64_t step, uint64_t data_rng,
                               const mst_train_result* res);
/* Reads dir/trainer.json. */
mst_status mst_ckpt_read_meta(const char* dir, mst_ckpt_meta* out);
/* Fills res's losses of steps 1 .. step from dir/trainer.json. */
mst_status mst_ckpt_read_losses(const char* dir, int64_t step, mst_train_result* res);
/* MST_ERR_INVALID naming dir unless the checkpoint was saved by `ranks`
 * ranks (its meta's). */
mst_status mst_ckpt_check_ranks(const mst_ckpt_meta* meta, const char* dir, int32_t ranks);
/* Resume: the bf16 weights, fp32 master weights and AdamW moments of m's
 * rank from dir (m built from the checkpoint's config); names, dtypes and
 * shapes checked for every tensor before any is read, each file's hash
 * before its first tensor is. A failed load leaves m's state undefined. */
mst_status mst_ckpt_load(mst_model* m, const char* dir);
/* --init-from: the weights of the Hugging Face model in dir (F32, BF16 or
 * F16) into m's fp32 master and bf16 weights; m's config must be dir's
 * config.json's (mst_hf_read_config). The MTP module's come from its
 * mtp file set when dir has one, else keep m's initialisation. A tensor
 * missing, of another shape, or one the model does not have is refused
 * naming the file. The optimizer state is m's (fresh). */
mst_status mst_ckpt_init_from(mst_model* m, const char* dir);
/* What mst_ckpt_init_from checks before it reads, without a model: dir's
 * config.json is c's, its sets hold exactly c's tensors with their shapes
 * (headers checked: a truncated file, data_offsets that do not tile it). */
mst_status mst_ckpt_check_hf(const char* dir, const mst_model_config* c);
/* --dump-grads: every parameter's fp32 main_grad by its hub name into the
 * safetensors file path, with "tokens" I32 [M B, T+2] (the step's
 * windows, tok [M, B, T+2]), F32 [1] "loss_main", "loss_mtp", "loss_aux"
 * (as the progress line prints them) and "logits" F32 [M B T, V] (the
 * main head's, logits [M, B T, V]). One rank. */
mst_status mst_ckpt_dump_grads(mst_model* m, const char* path, const int32_t* tok, const double loss[3],
                               const float* logits);

#endif
