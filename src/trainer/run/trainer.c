/*
 * trainer.c — the training loop (see trainer.h). A step (step.c): M
 * microbatches of forward + backward along the schedule (main_grad zeroed
 * first), clip + AdamW (skipped on the backend when the step's flag is set),
 * the record of flag and loss sums; eagerly, or replayed from its captured
 * graph (--graph on, from step cfg->graph_from). The host uploads the step's staged inputs, launches
 * it, stages the next step's batch while it runs, then reads the record
 * once. A step flagged over budget (a group got more rows than max_rows) is
 * rerun with exact shapes: every group sized to the largest group seen,
 * with its own memory manager, and the static buffers come back for the
 * next step. A step whose stash pool overflowed is rerun as a measuring
 * step, which resizes the pools. Reruns run eagerly; the step is captured
 * again after one.
 */
#include <math.h>
#include <string.h>

#include "lib/internal.h"
#include "checkpoint.h"
#include "planner.h"
#include "trainer/io/plot.h"
#include "trainer/model/ops.h"
#include "report.h"

/* The largest group of any layer so far (host read: the rerun path only). */
static mst_status exact_rows(mst_model* m, int64_t* rows) {
    const int64_t n = (int64_t)(m->cfg.layers + 1) * m->cfg.ep;
    int32_t* peak = (int32_t*)malloc(sizeof(int32_t) * (size_t)n);
    if (!peak) return mst_set_error(MST_ERR_OOM, "peak rows");
    mst_status st = mst_model_peak_rows(m, peak);
    *rows = 1;
    for (int64_t i = 0; i < n; i++) *rows = peak[i] > *rows ? peak[i] : *rows;
    free(peak);
    return st;
}

/* Starts step `step` on the uploaded inputs: the first eagerly as the
 * measuring step, the others replayed from the captured graph (--graph on)
 * or eagerly. */
static mst_status launch_step(mst_model* m, const mst_train_config* cfg, int64_t step, mst_train_result* res) {
    int32_t inject = step == cfg->force_over_budget ? MST_FLAG_COUNTS : 0;
    inject |= step == cfg->force_overflow ? MST_FLAG_OVERFLOW : 0;
    if (inject) MST_TRY(mst_copy_h2b(m->ctx, m->ctx->err_flag, &inject, sizeof inject));
    const int first = step == res->first_step; /* the measuring step: this run's first */
    if (first || !cfg->graph_from || step < cfg->graph_from) return mst_step_run(m, &cfg->optim, first);
    int captured = 0;
    MST_TRY(mst_step_replay(m, &cfg->optim, &captured));
    res->captures += captured;
    res->replays += m->graph != NULL;
    return MST_OK;
}

/* After a flagged step, its reruns (eager, on the same inputs), then its
 * record again. A step flagged over budget is rerun with exact shapes:
 * every group sized to the largest group seen, with a manager of its own; a
 * layer after an over-budget one saw other inputs, so its group may still
 * not fit the first exact size: rerun again (each rerun fixes at least one
 * more layer); the last attempt sizes groups for every token copy (N k
 * rows). A step whose stash pool overflowed is rerun as a measuring step,
 * which resizes the pools. The static buffers come back afterwards. */
static mst_status rerun(mst_model* m, const mst_train_config* cfg, mst_train_result* res, mst_step_record* r,
                        int eval) {
    mst_status st = mst_memmgr_step_check(m->mm);
    const int64_t all = m->cfg.batch * m->cfg.seq * m->cfg.top_k;
    for (int32_t attempt = 0; (st == MST_ERR_COUNTS || st == MST_ERR_OVERFLOW) && attempt <= m->cfg.layers + 1;
         attempt++) {
        res->reruns++;
        if (st == MST_ERR_COUNTS) {
            res->over_budget++;
            int64_t exact = all;
            if (attempt < m->cfg.layers + 1) MST_TRY(exact_rows(m, &exact));
            /* exact <= R only when the flag was forced: still a fresh
             * manager of its own, one row larger */
            MST_TRY(mst_model_set_max_rows(m, exact > m->max_rows ? exact : m->max_rows + 1));
        }
        MST_TRY(eval ? mst_step_eval(m, 1) : mst_step_run(m, &cfg->optim, 1));
        st = mst_memmgr_step_check(m->mm);
    }
    if (st != MST_OK) return st;
    MST_TRY(mst_step_read(m, r));
    return mst_model_set_max_rows(m, m->static_rows);
}

void mst_train_draw(const mst_model* m, mst_data* d, const mst_train_config* cfg, int32_t* tok) {
    const int64_t win = cfg->model.seq + 2, per = cfg->model.batch * win, W = m->dist.world;
    for (int32_t mb = 0; mb < cfg->microbatches; mb++) {
        int32_t* t = tok + mb * per * W; /* [W B, T+2] of scratch past this step's windows */
        mst_data_batch(d, cfg->model.batch * W, cfg->model.seq, W > 1 ? t : tok + mb * per);
        if (W > 1) memmove(tok + mb * per, t + m->dist.rank * per, sizeof(int32_t) * (size_t)per);
    }
}

/* Draws the next step's microbatches and stages them with its AdamW values. */
static mst_status stage_next(mst_model* m, mst_data* d, const mst_train_config* cfg, int32_t* tok, int64_t step) {
    mst_train_draw(m, d, cfg, tok);
    float hyper[MST_N_HYPER];
    mst_optim_hyper(&cfg->optim, step, hyper);
    return mst_model_stage(m, (int)((step - 1) & 1), tok, hyper);
}

/* One step (1-based) on staged inputs: upload, launch, stage the next step
 * while this one runs, read the record (rerun when it is flagged), losses. */
static mst_status one_step(mst_model* m, mst_data* d, const mst_train_config* cfg, int32_t* tok, int64_t step,
                           mst_train_result* res) {
    MST_TRY(mst_model_upload(m, (int)((step - 1) & 1)));
    MST_TRY(launch_step(m, cfg, step, res));
    if (step < cfg->steps) MST_TRY(stage_next(m, d, cfg, tok, step + 1));
    mst_step_record r;
    MST_TRY(mst_step_read(m, &r));
    if (r.flag) MST_TRY(rerun(m, cfg, res, &r, 0));
    const double MN = (double)(m->n_micro * m->cfg.batch * m->cfg.seq) * m->dist.world;
    res->loss[step - 1] = r.loss_main / MN;
    res->mtp_loss[step - 1] = r.loss_mtp / MN;
    res->aux_loss[step - 1] = r.aux / (double)m->n_micro;
    return MST_OK;
}

/* Held-out loss after `step`: eval_batches batches of the eval text (the
 * same windows every time), each a step's microbatches through forward and
 * backward without the optimizer, staged in the slot `step` used (free: the
 * next step's inputs wait in the other). Mean main loss per token. */
static mst_status evaluate(mst_model* m, mst_data* e, const mst_train_config* cfg, int32_t* tok, int64_t step,
                           mst_train_result* res, double* out) {
    const int32_t nb = cfg->eval_batches > 0 ? cfg->eval_batches : 8;
    const uint64_t rng = e->rng;
    const int slot = (int)((step - 1) & 1);
    float hyper[MST_N_HYPER];
    mst_optim_hyper(&cfg->optim, step, hyper);
    double sum = 0;
    for (int32_t b = 0; b < nb; b++) {
        mst_train_draw(m, e, cfg, tok);
        MST_TRY(mst_model_stage(m, slot, tok, hyper));
        MST_TRY(mst_model_upload(m, slot));
        MST_TRY(mst_step_eval(m, 0));
        mst_step_record r;
        MST_TRY(mst_step_read(m, &r));
        if (r.flag) MST_TRY(rerun(m, cfg, res, &r, 1));
        sum += r.loss_main;
    }
    e->rng = rng;
    *out = sum / ((double)nb * (double)(m->n_micro * m->cfg.batch * m->cfg.seq) * m->dist.world);
    return MST_OK;
}

/* DIR/step-N (or DIR/final) of the run after `step`; rng: the sampler's
 * state before the next step's batches were drawn. */
static mst_status save(mst_model* m, const mst_train_config* cfg, int64_t step, uint64_t rng, int final,
                       const mst_train_result* res) {
    char dir[4200];
    if (final) snprintf(dir, sizeof dir, "%s/final", cfg->save_dir);
    else snprintf(dir, sizeof dir, "%s/step-%lld", cfg->save_dir, (long long)step);
    return mst_ckpt_save(m, cfg, step, rng, res, dir);
}

/* After each forward entry that ran the main head (the chunk of layer
 * L-1): its logits again, the same op on the same inputs (the final norm's
 * output and the head), into user: float [M, N, V] at the microbatch's rows.
 * m->logits is free between entries (the backward reads d logits). */
static mst_status main_logits(mst_model* m, int32_t entry, void* user) {
    const mst_sched_entry e = m->sched[entry];
    const mst_model_config* c = &m->cfg;
    if (e.backward || e.chunk != (c->layers - 1) / m->layers_per_chunk) return MST_OK;
    const int64_t N = c->batch * c->seq, V = c->vocab;
    uint16_t* h = (uint16_t*)malloc(sizeof(uint16_t) * (size_t)(N * V));
    mst_status st = h ? mst_op_linear(m, N, c->hidden, V, m->micro[e.microbatch].xf, m->w + m->head, m->logits)
                      : mst_set_error(MST_ERR_OOM, "--dump-grads: logits");
    if (st == MST_OK) st = mst_copy_b2h(m->ctx, h, m->logits, sizeof(uint16_t) * (size_t)(N * V));
    if (st == MST_OK) mst_bf16_to_fp32_array((float*)user + e.microbatch * N * V, h, (size_t)(N * V));
    free(h);
    return st;
}

/* --dump-grads: step 1's forward and backward on its staged inputs (slot
 * 0) without the optimizer, which gives the gradients the step hands
 * AdamW, written out with the step's tokens and losses; step 1 itself runs
 * after, on the same inputs. */
static mst_status dump_grads(mst_model* m, const mst_train_config* cfg, const int32_t* tok, mst_train_result* res) {
    const int64_t N = m->cfg.batch * m->cfg.seq, V = m->cfg.vocab;
    float* logits = (float*)malloc(sizeof(float) * (size_t)(m->n_micro * N * V));
    if (!logits) return mst_set_error(MST_ERR_OOM, "--dump-grads: logits of %lld tokens", (long long)(m->n_micro * N));
    m->after_entry = main_logits, m->after_entry_user = logits;
    mst_status st = mst_model_upload(m, 0);
    if (st == MST_OK) st = mst_step_eval(m, 1);
    mst_step_record r;
    if (st == MST_OK) st = mst_step_read(m, &r);
    if (st == MST_OK && r.flag) st = rerun(m, cfg, res, &r, 1);
    m->after_entry = NULL, m->after_entry_user = NULL;
    const double MN = (double)(m->n_micro * N);
    const double loss[3] = {r.loss_main / MN, r.loss_mtp / MN, r.aux / (double)m->n_micro};
    if (st == MST_OK) st = mst_ckpt_dump_grads(m, cfg->dump_grads, tok, loss, logits);
    free(logits);
    return st;
}

/* --plot: the train loss every step, the eval loss where evaluated. */
static mst_status plot(const mst_train_config* cfg, const mst_train_result* r) {
    const int64_t n = r->steps - r->first_step + 1;
    double* x = (double*)malloc(sizeof(double) * (size_t)n * 3);
    if (!x) return mst_set_error(MST_ERR_OOM, "--plot");
    double *ex = x + n, *ey = x + 2 * n;
    int64_t ne = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t s = r->first_step + i;
        x[i] = (double)s;
        if (isfinite(r->eval_loss[s - 1])) ex[ne] = (double)s, ey[ne++] = r->eval_loss[s - 1];
    }
    mst_plot_series ser[] = {{"train loss", x, r->loss + r->first_step - 1, n}, {"eval loss (held out)", ex, ey, ne}};
    const mst_plot p = {"moestash train: next-byte loss", "step", "loss (nats per byte)", ser, ne ? 2 : 1, NULL, 0};
    mst_status st = mst_plot_lines(cfg->plot_path, &p);
    free(x);
    return st;
}

/* ---- the loop ------------------------------------------------------------------ */

static mst_status load_data(const mst_train_config* cfg, mst_data* d) {
    if (!cfg->data_path) return mst_data_synthetic(d, cfg->model.seed, 1 << 20);
    return mst_data_file(d, "--data", cfg->data_path, cfg->model.vocab, cfg->model.seq + 2, cfg->model.seed);
}

static mst_status alloc_result(mst_train_result* res, int64_t steps) {
    memset(res, 0, sizeof *res);
    res->steps = steps;
    res->first_step = 1;
    res->eval_loss = (double*)malloc(sizeof(double) * (size_t)steps);
    for (int64_t i = 0; res->eval_loss && i < steps; i++) res->eval_loss[i] = NAN;
    res->loss = (double*)calloc((size_t)steps, sizeof(double));
    res->mtp_loss = (double*)calloc((size_t)steps, sizeof(double));
    res->aux_loss = (double*)calloc((size_t)steps, sizeof(double));
    res->tok_per_s = (double*)calloc((size_t)steps, sizeof(double));
    if (!res->loss || !res->mtp_loss || !res->aux_loss || !res->tok_per_s || !res->eval_loss)
        return mst_set_error(MST_ERR_OOM, "result arrays for %lld steps", (long long)steps);
    return MST_OK;
}

/* W ranks: the step's all-reduce of the replicated gradients timed apart,
 * eager, 5 times after the run (on the last step's gradients, which nothing
 * reads again: the checkpoint and the memory table are taken). */
static mst_status time_allreduce(mst_model* m, mst_train_result* res) {
    if (!m->dist.ep) return MST_OK;
    enum { TIMES = 5 };
    MST_TRY(mst_step_share_grads(m)); /* NCCL's first call of a size sets up */
    MST_TRY(mst_ctx_sync(m->ctx));
    const double t0 = mst_clock_s();
    for (int i = 0; i < TIMES; i++) MST_TRY(mst_step_share_grads(m));
    MST_TRY(mst_ctx_sync(m->ctx));
    res->allreduce_ms = (mst_clock_s() - t0) * 1e3 / TIMES;
    res->allreduce_bytes = sizeof(float) * (size_t)mst_step_shared_grads(m);
    return MST_OK;
}

static mst_status train_loop(mst_model* m, mst_data* d, mst_data* e, const mst_train_config* cfg, FILE* progress,
                             mst_train_result* res) {
    const int64_t per = cfg->model.batch * (cfg->model.seq + 2) * m->dist.world; /* the global batch's */
    const double tokens = (double)(cfg->model.batch * cfg->model.seq * cfg->microbatches) * m->dist.world;
    const int64_t every = cfg->log_every > 0 ? cfg->log_every : 1;
    int32_t* tok = (int32_t*)malloc(sizeof(int32_t) * (size_t)(per * cfg->microbatches));
    if (!tok) return mst_set_error(MST_ERR_OOM, "token batch");
    const double t0 = mst_clock_s();
    mst_status st = stage_next(m, d, cfg, tok, res->first_step);
    if (st == MST_OK && cfg->dump_grads && res->first_step == 1) st = dump_grads(m, cfg, tok, res);
    uint64_t rng = d->rng; /* the sampler before the next step's batches */
    for (int64_t i = res->first_step - 1; i < cfg->steps && st == MST_OK; i++) {
        double ts = mst_clock_s();
        rng = d->rng;
        st = one_step(m, d, cfg, tok, i + 1, res);
        if (st != MST_OK) break;
        res->tok_per_s[i] = tokens / (mst_clock_s() - ts);
        if (e && ((cfg->eval_every > 0 && (i + 1) % cfg->eval_every == 0) || i + 1 == cfg->steps))
            st = evaluate(m, e, cfg, tok, i + 1, res, &res->eval_loss[i]);
        if (st == MST_OK && cfg->save_dir && cfg->save_every > 0 && (i + 1) % cfg->save_every == 0)
            st = save(m, cfg, i + 1, rng, 0, res);
        size_t in_use = 0;
        mst_ctx_mem(m->ctx, &in_use, NULL);
        if (st == MST_OK && progress && ((i + 1) % every == 0 || i + 1 == cfg->steps || isfinite(res->eval_loss[i]))) {
            fprintf(progress, "step %5lld | loss %.4f | mtp %.4f | aux %.4f | lr %.2e | %8.0f tok/s | mem %.1f MiB | reruns %lld | graph %lld",
                    (long long)(i + 1), res->loss[i], res->mtp_loss[i], res->aux_loss[i],
                    (double)mst_optim_lr(&cfg->optim, i + 1), res->tok_per_s[i],
                    (double)in_use / (1 << 20), (long long)res->reruns, (long long)res->captures);
            if (isfinite(res->eval_loss[i]))
                fprintf(progress, " | eval %.4f (%.3f bits/%s)", res->eval_loss[i], res->eval_loss[i] / log(2.0),
                        cfg->model.vocab == 256 ? "byte" : "token");
            fprintf(progress, "\n");
            fflush(progress);
        }
    }
    res->seconds = mst_clock_s() - t0;
    free(tok);
    if (st == MST_OK && cfg->save_dir) st = save(m, cfg, cfg->steps, rng, 1, res);
    if (st == MST_OK && cfg->plot_path && mst_model_grid_rank(m) == 0) st = plot(cfg, res); /* W ranks: the same curves */
    if (st == MST_OK) st = mst_memmgr_check(m->mm);
    if (st == MST_OK) st = mst_train_memory_table(m, res);
    if (st == MST_OK && cfg->timeline_path) st = mst_train_timeline(m, cfg, res);
    if (st == MST_OK) st = time_allreduce(m, res);
    return st;
}

/* --resume: the checkpoint must be of this run's configuration; its
 * tensors go into m, its sampler state into d, and the run goes on after
 * its step. */
static mst_status resume(mst_model* m, const mst_train_config* cfg, mst_data* d, mst_train_result* res) {
    mst_ckpt_meta meta;
    const int32_t W = mst_model_grid_size(m);
    const char* dir = cfg->resume_dir;
    MST_TRY(mst_ckpt_read_meta(dir, &meta));
    MST_TRY(mst_ckpt_check_ranks(&meta, cfg->resume_dir, W));
    if (memcmp(&meta.cfg.model, &cfg->model, sizeof cfg->model) != 0 || meta.cfg.microbatches != cfg->microbatches ||
        (meta.cfg.pp > 1 ? meta.cfg.pp : 1) != m->stages ||
        meta.cfg.eval_fraction != cfg->eval_fraction)
        return mst_set_error(MST_ERR_INVALID, "--resume '%s': the checkpoint is of another configuration (model, "
                             "microbatches, pipeline stages or held-out fraction)", cfg->resume_dir);
    if (meta.step >= cfg->steps)
        return mst_set_error(MST_ERR_INVALID, "--resume '%s': the checkpoint is at step %lld, --steps %lld leaves "
                             "nothing to do", cfg->resume_dir, (long long)meta.step, (long long)cfg->steps);
    MST_TRY(mst_ckpt_load(m, dir));
    MST_TRY(mst_ckpt_read_losses(dir, meta.step, res));
    d->rng = meta.data_rng;
    res->first_step = meta.step + 1;
    return MST_OK;
}

/* --memory-budget: the probe and the plan (res->plan); *cfg becomes
 * `planned`, a copy with the plan's memory configuration. */
static mst_status plan_budget(mst_ctx_t* ctx, const mst_train_config** cfg, mst_train_config* planned, mst_data* d,
                              mst_train_result* res) {
    res->plan = (mst_plan_report*)calloc(1, sizeof *res->plan);
    if (!res->plan) return mst_set_error(MST_ERR_OOM, "memory plan");
    MST_TRY(mst_plan_budget(ctx, *cfg, d, res->plan));
    *planned = **cfg;
    mst_plan_apply(res->plan, planned);
    *cfg = planned;
    return MST_OK;
}

mst_status mst_train_run(mst_ctx_t* ctx, const mst_train_config* cfg, FILE* progress,
                         mst_train_result* res) {
    if (cfg->steps < 1) return mst_set_error(MST_ERR_INVALID, "--steps %lld: expected >= 1", (long long)cfg->steps);
    MST_TRY(mst_model_config_check(&cfg->model));
    if (cfg->save_dir) MST_TRY(mst_ckpt_check_room(cfg, cfg->save_dir));
    if (cfg->init_from && cfg->resume_dir)
        return mst_set_error(MST_ERR_INVALID, "--init-from '%s': contradicts --resume (which has its own weights)", cfg->init_from);
    MST_TRY(alloc_result(res, cfg->steps));
    mst_data d, e = {0};
    MST_TRY(load_data(cfg, &d));
    mst_status st = MST_OK;
    if (cfg->eval_path) st = mst_data_file(&e, "--eval-data", cfg->eval_path, cfg->model.vocab, cfg->model.seq + 2,
                                         cfg->model.seed ^ 0xE7A1ull);
    else if (cfg->eval_fraction > 0) st = mst_data_split(&d, cfg->eval_fraction, cfg->model.seq + 2, &e);
    mst_train_config planned;
    if (st == MST_OK && cfg->memory_budget) st = plan_budget(ctx, &cfg, &planned, &d, res);
    mst_ctx_mem_reset_peak(ctx); /* this run's peak */
    mst_model* m = NULL;
    if (st == MST_OK) st = mst_model_create_dist(ctx, &cfg->model, cfg->microbatches, &cfg->mem, &cfg->dist, &m);
    if (st == MST_OK && cfg->resume_dir) st = resume(m, cfg, &d, res);
    if (st == MST_OK && cfg->init_from) st = mst_ckpt_init_from(m, cfg->init_from);
    if (st == MST_OK) st = train_loop(m, &d, e.tok ? &e : NULL, cfg, progress, res);
    mst_model_destroy(m);
    mst_data_free(&d);
    mst_data_free(&e);
    return st;
}

void mst_train_result_free(mst_train_result* res) {
    free(res->loss);
    free(res->mtp_loss);
    free(res->aux_loss);
    free(res->tok_per_s);
    free(res->eval_loss);
    free(res->peak_rows);
    free(res->rank_peak);
    free(res->stage_mem);
    free(res->stage_sets);
    free(res->grid_peak);
    mst_plan_report_free(res->plan);
    free(res->plan);
    memset(res, 0, sizeof *res);
}

