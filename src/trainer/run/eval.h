/*
 * eval.h — `moestash eval`: a model's mean next-token loss on a token file,
 * computed by the trainer's own forward (src/trainer/model/, the
 * mst_step_eval path) on the model's bf16 weights, so that it can be set
 * beside transformers' loss on the same windows.
 *
 * The file's tokens are cut into consecutive non-overlapping windows of T+1
 * tokens from its start (window w: tokens [w (T+1), (w+1) (T+1))): the first
 * T are the inputs, the last T the targets. As many full windows as fit are
 * evaluated (or the first n_windows), B at a time; the tokens after the last
 * full window are not used. The loss is the mean over every target of
 * logsumexp(logits) - logit[target] (nats). Deterministic: the same model,
 * file, T and B give the same bits; each window's losses depend on its own
 * tokens only, so another B gives the same bits on the CPU backend (CUDA:
 * the GEMMs' shapes change, their rounding may).
 */
#ifndef MST_EVAL_H
#define MST_EVAL_H

#include "trainer/model/model.h"

typedef struct mst_eval_config {
    const char* model_dir;  /* a Hugging Face Qwen3-MoE directory (io/hf.h)      */
    const char* data_path;  /* text or an llm.c .bin token file (mst_data_file) */
    int64_t seq;            /* T                                                */
    int64_t batch;          /* B windows per forward                            */
    int64_t n_windows;      /* the first n windows; 0: all that fit             */
} mst_eval_config;

typedef struct mst_eval_result {
    double loss;            /* mean next-token loss over the targets (nats)     */
    int64_t tokens;         /* targets: windows x T                             */
    int64_t windows;
    double* window_loss;    /* [windows] each window's mean loss (owned)        */
} mst_eval_result;

/* Reads the model's config, checks its files (mst_ckpt_check_hf) and the
 * data (MST_ERR_INVALID naming the flag and value: a directory that is not
 * a qwen3_moe model, a tensor missing, extra or of another shape, a token
 * not below the vocabulary, no full window, --windows past the file's),
 * then builds the model on ctx, loads its weights (mst_ckpt_init_from) and
 * runs the windows through it. */
mst_status mst_eval_run(mst_ctx_t* ctx, const mst_eval_config* c, mst_eval_result* out);
void mst_eval_result_free(mst_eval_result* r);

#endif
