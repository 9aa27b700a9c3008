/*
 * train.c — `moestash train`: the flags (their defaults, the presets and
 * --help are in train_config.c), the training run, the progress lines, the
 * memory table and --json. Bad input gets one line naming the flag and its
 * value, and exit code 2.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "cli.h"
#include "launch.h"
#include "trainer/run/checkpoint.h"
#include "trainer/run/planner.h"

typedef struct train_cli {
    mst_train_config cfg;
    mst_backend_kind kind; /* --backend, else cuda when available */
    const char* json;
    const char* graph;     /* --graph as given (NULL: the backend's default) */
    const char* policy;    /* --policy as given (NULL: not given) */
    const char* recompute; /* --recompute as given */
    const char* budget;    /* --memory-budget as given */
    int quiet, check_policies;
    int64_t gpus;          /* --gpus: ranks (a launched rank: WORLD_SIZE) */
    mst_launch l;          /* the launcher environment (launch.h)          */
} train_cli;

/* --memory-budget SIZE: bytes, or a number with a unit B, KB, MB, GB, TB
 * (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024); a whole number
 * of bytes >= 1. Returns 0 or the exit code 2. */
static int parse_size(mst_args* a, size_t* out) {
    static const struct { const char* unit; double bytes; } units[] = {
        {"", 1}, {"B", 1}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
        {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
    const char* v = NULL;
    int rc = mst_args_str(a, &v);
    if (rc) return rc;
    char* end = NULL;
    errno = 0;
    const double x = (v[0] >= '0' && v[0] <= '9') || v[0] == '.' ? strtod(v, &end) : NAN;
    if (!end || end == v || errno || !isfinite(x))
        return mst_args_bad(a, v, "expected a size: bytes, or a number with B, KB, MB, GB, TB, KiB, MiB, GiB or TiB");
    for (size_t k = 0; k < sizeof units / sizeof units[0]; k++) {
        if (strcmp(end, units[k].unit) != 0) continue;
        const double bytes = x * units[k].bytes;
        if (!(bytes >= 1) || bytes >= 9.2e18) return mst_args_bad(a, v, "expected at least 1 byte and below 8 EiB");
        if (bytes != floor(bytes)) return mst_args_bad(a, v, "not a whole number of bytes");
        *out = (size_t)bytes;
        return 0;
    }
    return mst_args_bad(a, v, "unknown unit: expected B, KB, MB, GB, TB, KiB, MiB, GiB or TiB");
}

/* The current flag with its value; returns 0 or the exit code 2. */
static int parse_flag(train_cli* t, mst_args* a) {
    static const char* const on_off[] = {"off", "on", NULL}, *const granularity[] = {"moe", "full", NULL},
                             *const attention[] = {"auto", "flash", "cublas", "cudnn", NULL}, *const moments[] = {"fp32", "bf16", NULL};
    mst_model_config* m = &t->cfg.model;
    int64_t x = 0;
    int rc = 0, i = 0;
    const char* v = NULL;
#define INT_FLAG(name, lo, hi, dst) \
    if (mst_args_is(a, name)) return (rc = mst_args_int(a, lo, hi, &x)) ? rc : ((dst) = x, 0)
    INT_FLAG("--steps", 1, 100000000, t->cfg.steps);
    INT_FLAG("--seq", 2, 8192, m->seq);
    INT_FLAG("--batch", 1, 65536, m->batch);
    INT_FLAG("--layers", 1, 256, m->layers);
    INT_FLAG("--hidden", 8, 65536, m->hidden);
    INT_FLAG("--heads", 1, 1024, m->n_head);
    INT_FLAG("--kv-heads", 1, 1024, m->n_kv_head);
    INT_FLAG("--head-dim", 2, 1024, m->head_dim);
    INT_FLAG("--vocab", 2, 1 << 24, m->vocab);
    INT_FLAG("--ffn", 1, 262144, m->ffn);
    INT_FLAG("--experts", 1, 1024, m->experts);
    INT_FLAG("--top-k", 1, 1024, m->top_k);
    INT_FLAG("--ep", 1, 1024, m->ep);
    INT_FLAG("--gpus", 1, 1024, t->gpus);
    INT_FLAG("--pp", 1, 256, t->cfg.pp);
    INT_FLAG("--microbatches", 1, 4096, t->cfg.microbatches);
    INT_FLAG("--warmup", 0, 100000000, t->cfg.optim.warmup);
    INT_FLAG("--seed", 0, INT64_MAX, m->seed);
    INT_FLAG("--force-over-budget", 0, INT64_MAX, t->cfg.force_over_budget);
    INT_FLAG("--force-overflow", 0, INT64_MAX, t->cfg.force_overflow);
    INT_FLAG("--log-every", 1, INT64_MAX, t->cfg.log_every);
    INT_FLAG("--save-every", 0, INT64_MAX, t->cfg.save_every);
    INT_FLAG("--eval-every", 0, INT64_MAX, t->cfg.eval_every);
    INT_FLAG("--eval-batches", 1, 1 << 20, t->cfg.eval_batches);
#undef INT_FLAG
    if (mst_args_is(a, "--capacity-factor")) return mst_args_float(a, 1e-6, 1024, &m->capacity_factor);
    if (mst_args_is(a, "--mtp-weight")) return mst_args_float(a, 0, 100, &m->mtp_weight);
    if (mst_args_is(a, "--aux-coef") || mst_args_is(a, "--aux-weight")) return mst_args_float(a, 0, 100, &m->aux_coef);
    if (mst_args_is(a, "--rope-theta")) return mst_args_float(a, 1, 1e12, &m->rope_theta);
    if (mst_args_is(a, "--norm-topk-prob"))
        return (rc = mst_args_choice(a, on_off, &i)) ? rc : (m->norm_topk_prob = i, 0);
    if (mst_args_is(a, "--tie-embeddings"))
        return (rc = mst_args_choice(a, on_off, &i)) ? rc : (m->tie_embeddings = i, 0);
    if (mst_args_is(a, "--lr")) return mst_args_float(a, 0, 10, &t->cfg.optim.lr);
    if (mst_args_is(a, "--pool-factor")) {
        float f = 0;
        rc = mst_args_float(a, 0.01, 100, &f);
        t->cfg.mem.pool_factor = f;
        return rc;
    }
    if (mst_args_is(a, "--eval-fraction")) {
        float f = 0;
        if ((rc = mst_args_float(a, 0, 1, &f))) return rc;
        if (!(f > 0 && f < 1)) return mst_args_bad(a, a->value, "expected a number between 0 and 1");
        t->cfg.eval_fraction = f;
        return 0;
    }
    if (mst_args_is(a, "--backend")) return mst_args_backend(a, &t->kind);
    if (mst_args_is(a, "--preset")) return mst_train_preset(a, &t->cfg, &v);
    if (mst_args_is(a, "--graph")) return (rc = mst_args_choice(a, on_off, &i)) ? rc : (t->graph = on_off[i], 0);
    if (mst_args_is(a, "--adam-moments"))
        return (rc = mst_args_choice(a, moments, &i)) ? rc : (t->cfg.mem.moments_bf16 = i, 0);
    if (mst_args_is(a, "--optimizer-shard"))
        return (rc = mst_args_choice(a, on_off, &i)) ? rc : (t->cfg.mem.optimizer_shard = i, 0);
    if (mst_args_is(a, "--overlap")) return (rc = mst_args_choice(a, on_off, &i)) ? rc : (t->cfg.mem.overlap = i, 0);
    if (mst_args_is(a, "--attention")) return (rc = mst_args_choice(a, attention, &i)) ? rc : (m->attention = i, 0);
    if (mst_args_is(a, "--recompute-granularity"))
        return (rc = mst_args_choice(a, granularity, &i)) ? rc : (t->cfg.mem.recompute_full = i, 0);
    if (mst_args_is(a, "--json")) return mst_args_out_file(a, &t->json);
    if (mst_args_is(a, "--plot")) return mst_args_out_file(a, &t->cfg.plot_path);
    if (mst_args_is(a, "--timeline")) return mst_args_out_file(a, &t->cfg.timeline_path);
    if (mst_args_is(a, "--data")) return mst_args_in_file(a, &t->cfg.data_path);
    if (mst_args_is(a, "--eval-data")) return mst_args_in_file(a, &t->cfg.eval_path);
    if (mst_args_is(a, "--save")) return mst_args_str(a, &t->cfg.save_dir);
    if (mst_args_is(a, "--resume")) return mst_args_str(a, &t->cfg.resume_dir);
    if (mst_args_is(a, "--init-from")) return mst_args_str(a, &t->cfg.init_from);
    if (mst_args_is(a, "--dump-grads")) return mst_args_out_file(a, &t->cfg.dump_grads);
    if (mst_args_is(a, "--save-shard")) return parse_size(a, &t->cfg.save_shard_bytes);
    if (mst_args_is(a, "--schedule")) {
        if ((rc = mst_args_str(a, &v))) return rc;
        if (mst_schedule_kind_parse(v, &t->cfg.mem.schedule) != MST_OK)
            return mst_args_bad(a, v, "expected plain, 1f1b or interleaved");
        t->cfg.mem.virtual_stages = t->cfg.mem.schedule == MST_SCHEDULE_INTERLEAVED ? 2 : 1;
        return 0;
    }
    if (mst_args_is(a, "--policy")) {
        if ((rc = mst_args_str(a, &t->policy))) return rc; /* parsed here once, carried typed */
        return mst_policy_spec_parse(t->policy, t->cfg.mem.policy.name) == MST_OK ? 0 : mst_args_bad(a, t->policy, mst_last_error());
    }
    if (mst_args_is(a, "--recompute")) {
        if ((rc = mst_args_str(a, &t->recompute))) return rc;
        return mst_recompute_parse(t->recompute, &t->cfg.mem.recompute) == MST_OK
                   ? 0 : mst_args_bad(a, t->recompute, "expected none, uniform:N or block:N");
    }
    if (mst_args_is(a, "--memory-budget")) {
        rc = parse_size(a, &t->cfg.memory_budget);
        t->budget = a->value;
        return rc;
    }
    if (mst_args_is(a, "--quiet")) return mst_args_switch(a, &t->quiet);
    if (mst_args_is(a, "--check-policies")) return mst_args_switch(a, &t->check_policies);
    if (mst_args_is(a, "--recompute-mtp")) return mst_args_switch(a, &t->cfg.mem.recompute_mtp);
    return mst_args_unknown(a);
}

static int parse(int argc, char** argv, train_cli* t) {
    mst_args a;
    mst_args_init(&a, "moestash train", argc, argv);
    while (mst_args_next(&a)) {
        int rc = parse_flag(t, &a);
        if (rc) return rc;
    }
    return 0;
}

/* --resume: the run's configuration is the checkpoint's; only flags that do
 * not change its results may be given beside it (--steps extends or cuts
 * the run; the learning-rate schedule stays the stored one). */
static int resumed(int argc, char** argv, train_cli* t, mst_ckpt_meta* meta) {
    static const char* const ok[] = {"--resume", "--steps", "--backend", "--save", "--save-every", "--json", "--plot",
                                     "--graph", "--log-every", "--quiet", "--eval-every", "--eval-batches", "--timeline",
                                     "--gpus", "--save-shard", "--optimizer-shard", "--overlap"};
    mst_args a;
    mst_args_init(&a, "moestash train", argc, argv);
    while (mst_args_next(&a)) {
        if (strncmp(a.arg, "--", 2) != 0) continue; /* a value */
        int fine = 0;
        for (size_t k = 0; k < sizeof ok / sizeof ok[0]; k++) fine |= mst_args_is(&a, ok[k]);
        if (!fine) return mst_args_bad(&a, mst_args_peek(&a), "not with --resume: the configuration comes from the checkpoint");
    }
    if (mst_ckpt_read_meta(t->cfg.resume_dir, meta) != MST_OK)
        return mst_cli_bad("moestash train", "--resume", t->cfg.resume_dir, mst_last_error());
    if (mst_ckpt_check_ranks(meta, t->cfg.resume_dir, t->gpus > 1 ? (int32_t)t->gpus : 1) != MST_OK)
        return mst_cli_bad("moestash train", "--resume", t->cfg.resume_dir, mst_last_error());
    mst_train_config c = meta->cfg;
    if (mst_args_find(argc, argv, "--steps")) c.steps = t->cfg.steps;
    c.resume_dir = t->cfg.resume_dir, c.save_dir = t->cfg.save_dir, c.save_every = t->cfg.save_every;
    c.plot_path = t->cfg.plot_path, c.log_every = t->cfg.log_every, c.timeline_path = t->cfg.timeline_path;
    c.mem.optimizer_shard = t->cfg.mem.optimizer_shard; /* the checkpoint holds the state whole: either way */
    c.mem.overlap = t->cfg.mem.overlap;         /* the same bits either way */
    if (t->cfg.eval_every) c.eval_every = t->cfg.eval_every;
    if (t->cfg.eval_batches) c.eval_batches = t->cfg.eval_batches;
    t->cfg = c;
    return 0;
}

/* --init-from DIR: the model's shape is DIR/config.json's; a shape flag
 * given beside it must say the same (--aux-coef, or --aux-weight, overrides its
 * router_aux_loss_coef). Returns 0 or the exit code 2. */
static int init_from(int argc, char** argv, train_cli* t) {
    const char* dir = t->cfg.init_from;
    mst_model_config hc = t->cfg.model;
    if (mst_hf_read_config(dir, &hc) != MST_OK) return mst_cli_bad("moestash train", "--init-from", dir, mst_last_error());
    int32_t n = 0;
    const mst_hf_field* f = mst_hf_fields(&n);
    for (int32_t i = 0; i < n; i++) {
        const char* given = f[i].flag ? mst_args_find(argc, argv, f[i].flag) : NULL;
        mst_model_config one = t->cfg.model;
        memcpy((char*)&one + f[i].off, (const char*)&hc + f[i].off, f[i].type == 0 ? 8 : 4);
        if (!given || mst_hf_config_diff(&one, &t->cfg.model) < 0) continue;
        char why[4400], want[32];
        mst_hf_field_str(&hc, i, want, sizeof want);
        snprintf(why, sizeof why, "contradicts %s %s of %s/config.json", f[i].key, want, dir);
        return mst_cli_bad("moestash train", f[i].flag, given, why);
    }
    if (mst_args_find(argc, argv, "--aux-coef") || mst_args_find(argc, argv, "--aux-weight"))
        hc.aux_coef = t->cfg.model.aux_coef; /* a training choice, not the architecture */
    t->cfg.model = hc;
    return mst_ckpt_check_hf(dir, &hc) == MST_OK ? 0 : mst_cli_bad("moestash train", "--init-from", dir, mst_last_error());
}

static int bad_value(const char* flag, int64_t value, const char* why) {
    char v[32];
    snprintf(v, sizeof v, "%lld", (long long)value);
    return mst_cli_bad("moestash train", flag, v, why);
}

/* --data and --eval-data read and checked before any work (a bad header, a
 * truncated file, a token not below the vocabulary): exit 2, one line. The
 * trainer reads them again when it starts. */
static int check_data(const mst_train_config* c) {
    const char* flag[2] = {"--data", "--eval-data"};
    const char* path[2] = {c->data_path, c->eval_path};
    for (int i = 0; i < 2; i++) {
        if (!path[i]) continue;
        mst_data d;
        const mst_status st = mst_data_file(&d, flag[i], path[i], c->model.vocab, c->model.seq + 2, 0);
        mst_data_free(&d);
        if (st != MST_OK) {
            fprintf(stderr, "moestash train: %s\n", mst_last_error());
            return st == MST_ERR_IO || st == MST_ERR_INVALID ? 2 : 1;
        }
    }
    return 0;
}

/* Flags that need another, or contradict one: exit 2 naming the one given. */
static int consistent(const train_cli* t) {
    const mst_train_config* c = &t->cfg;
    if (c->save_every && !c->save_dir) return bad_value("--save-every", c->save_every, "needs --save DIR");
    if (c->init_from && c->resume_dir) return mst_cli_bad("moestash train", "--init-from", c->init_from, "contradicts --resume");
    if (c->dump_grads && t->gpus > 1) return mst_cli_bad("moestash train", "--dump-grads", c->dump_grads, "one rank only (not --gpus)");
    if (c->save_dir && mst_ckpt_check_room(c, c->save_dir) != MST_OK) {
        fprintf(stderr, "moestash train: %s\n", mst_last_error());
        return 2;
    }
    if (c->eval_path && c->eval_fraction > 0)
        return mst_cli_bad("moestash train", "--eval-data", c->eval_path, "contradicts --eval-fraction");
    if (c->eval_every && !c->eval_path && !(c->eval_fraction > 0))
        return bad_value("--eval-every", c->eval_every, "needs --eval-data FILE or --eval-fraction F");
    if (c->eval_fraction > 0 && !c->data_path) return mst_cli_bad("moestash train", "--eval-fraction", "", "needs --data FILE");
    if (t->cfg.graph_from && t->kind != MST_BACKEND_CUDA)
        return mst_cli_bad("moestash train", "--graph", t->graph, "step capture needs --backend cuda");
    if (c->memory_budget && (t->policy || t->recompute || t->check_policies || c->mem.recompute_mtp))
        return mst_cli_bad("moestash train", "--memory-budget", t->budget,
                           t->check_policies ? "contradicts --check-policies"
                                             : "contradicts --policy, --recompute and --recompute-mtp (the plan chooses them)");
    if (t->check_policies && (t->policy || t->recompute))
        return mst_cli_bad("moestash train", t->policy ? "--policy" : "--recompute", t->policy ? t->policy : t->recompute,
                           "contradicts --check-policies (which runs every policy itself)");
    if (t->cfg.force_overflow > t->cfg.steps)
        return bad_value("--force-overflow", t->cfg.force_overflow, "after the last step (--steps)");
    if (t->cfg.force_over_budget > t->cfg.steps)
        return bad_value("--force-over-budget", t->cfg.force_over_budget, "after the last step (--steps)");
    if (t->gpus > 1 && t->kind == MST_BACKEND_CPU && t->l.launched)
        return mst_cli_bad(t->l.who, "--backend", "cpu", "ranks as processes (RANK, WORLD_SIZE set) need --backend cuda; "
                           "on the CPU --gpus N runs N rank threads of one process");
    return 0;
}


/* Sizes that cannot fit the backend's memory are refused before any work,
 * naming the flags of the larger part of the estimate. 0: they may fit. */
static int fits(mst_ctx_t* ctx, const mst_model_config* m, const mst_mem_config* mem, int32_t pp, int32_t dp) {
    double need = 0, params = 0;
    size_t have = 0;
    if (mst_model_bytes_at_least(m, mem->moments_bf16, mem->optimizer_shard, pp, dp, &need, &params) != MST_OK || mst_ctx_capacity(ctx, &have) != MST_OK)
        return 0;
    if (need <= (double)have) return 0;
    char v[96], why[160];
    const int attn = need - params > params;
    if (attn) snprintf(v, sizeof v, "%lld --batch %lld", (long long)m->seq, (long long)m->batch);
    else snprintf(v, sizeof v, "%lld (with --ffn %lld --experts %d --layers %d)", (long long)m->hidden, (long long)m->ffn,
                  m->experts, m->layers);
    snprintf(why, sizeof why, "needs at least %.1f GiB (%s), the backend has %.1f GiB", need / 1073741824.0,
             attn ? "one layer's attention, the head's logits" : "parameters, gradients and AdamW state",
             (double)have / 1073741824.0);
    return mst_cli_bad("moestash train", attn ? "--seq" : "--hidden", v, why);
}

/* --gpus N on the CPU: N rank threads; *res gets rank 0's result. */
static mst_status train_ranks(const train_cli* t, mst_train_result* res) {
    mst_train_result* all = (mst_train_result*)calloc((size_t)t->gpus, sizeof *all);
    if (!all) return mst_set_error(MST_ERR_OOM, "--gpus %lld results", (long long)t->gpus);
    mst_status st = mst_train_ranks(MST_BACKEND_CPU, &t->cfg, (int32_t)t->gpus, 0, t->quiet ? NULL : stdout, NULL, all);
    *res = all[0];
    for (int64_t r = 1; r < t->gpus; r++) mst_train_result_free(&all[r]);
    free(all);
    return st;
}

/* A launched rank of several (one process per GPU): its communicator for
 * the model (rendezvous, NCCL) into *ep and the run's dist; 0, or 1 after
 * the line. Not launched, or alone: *ep NULL. --pp P > 1: *pipe the grid's
 * (bare, from the shared id), *ep its split of the rank's stage
 * (mst_model_stage_comm: D > 1). */
static int rank_comm(train_cli* t, mst_ctx_t* ctx, mst_ep_t** ep, mst_ep_t** pipe) {
    *ep = *pipe = NULL;
    if (!t->l.launched || t->l.world == 1) return 0;
    const int32_t P = t->cfg.pp > 1 ? t->cfg.pp : 1, D = t->l.world / P, s = t->l.rank / D, d = t->l.rank % D;
    mst_ep_config ec; /* the stage's communicator (none for one rank a stage: its --ep groups are local) */
    const int own = mst_model_stage_comm(P, t->l.world); /* the stage's ranks have a communicator */
    mst_status st = own ? mst_model_ep_config(&t->cfg.model, D, &ec) : MST_OK;
    if (st == MST_OK && P == 1) st = mst_launch_ep(&t->l, ctx, &ec, ep);
    if (st == MST_OK && P > 1) st = mst_launch_ep(&t->l, ctx, NULL, pipe);
    if (st == MST_OK && P > 1 && own) st = mst_ep_create_split(ctx, &ec, *pipe, s, d, ep);
    if (st != MST_OK) {
        fprintf(stderr, "%s: the ranks' communicator: %s\n", t->l.who, mst_last_error());
        return 1;
    }
    mst_launch_fail_point(&t->l, "run");
    t->cfg.dist = (mst_dist){.rank = d, .world = D, .ep = *ep, .stage = s, .stages = P, .pipe = *pipe};
    return 0;
}

/* --pp P: the grid of --gpus N ranks (P stages of D = N / P data-parallel
 * ranks, which share each stage's experts: --ep D); 1F1B unless --schedule
 * says otherwise. 0, or exit code 2 after one line naming --pp. */
static int grid(int argc, char** argv, train_cli* t) {
    const int32_t P = t->cfg.pp > 1 ? t->cfg.pp : 1;
    if (P > 1 && !mst_args_find(argc, argv, "--schedule")) t->cfg.mem.schedule = MST_SCHEDULE_1F1B;
    if (mst_model_grid_check(&t->cfg.model, P, (int32_t)(t->gpus ? t->gpus : 1), t->cfg.mem.schedule,
                             t->cfg.mem.virtual_stages) != MST_OK) {
        fprintf(stderr, "moestash train: %s\n", mst_last_error());
        return 2;
    }
    return 0;
}

int mst_cmd_train(int argc, char** argv) {
    if (mst_args_help(argc, argv)) {
        mst_train_help();
        return 0;
    }
    train_cli t = {0};
    /* --backend first: it picks the defaults the other flags override (and
     * parse() checks its value) */
    const char* backend = mst_args_find(argc, argv, "--backend");
    t.kind = !backend ? mst_default_backend() : strcmp(backend, "cuda") == 0 ? MST_BACKEND_CUDA : MST_BACKEND_CPU;
    mst_train_defaults(&t.cfg, t.kind);
    if (parse(argc, argv, &t)) return 2;
    if (mst_launch_env("moestash train", &t.l)) return 2;
    if (t.l.launched && t.gpus && mst_launch_check_gpus(&t.l, (int32_t)t.gpus)) return 2;
    if (t.l.launched) t.gpus = t.l.world;
    t.cfg.optim.steps = t.cfg.steps;
    static mst_ckpt_meta meta; /* the strings of a resumed configuration live here */
    if (t.cfg.resume_dir && resumed(argc, argv, &t, &meta)) return 2;
    if (t.cfg.init_from && !t.cfg.resume_dir && init_from(argc, argv, &t)) return 2;
    if (t.graph) t.cfg.graph_from = strcmp(t.graph, "on") == 0;
    if (grid(argc, argv, &t)) return 2;
    const int64_t dp = t.gpus / (t.cfg.pp > 1 ? t.cfg.pp : 1); /* a stage's data-parallel ranks */
    if (dp > 1 && mst_args_find(argc, argv, "--ep") && t.cfg.model.ep != dp)
        return bad_value("--ep", t.cfg.model.ep, "on --gpus N ranks the expert groups are the ranks (--ep N; --pp P: N / P)");
    if (dp > 1 && t.cfg.model.experts % dp != 0) {
        char why[96];
        snprintf(why, sizeof why, "the ranks share the %d experts (--experts): must divide it", t.cfg.model.experts);
        return bad_value("--gpus", t.gpus, why);
    }
    if (dp > 1) t.cfg.model.ep = (int32_t)dp;
    if (consistent(&t)) return 2;
    if (t.cfg.model.capacity_factor == 0.0f) t.cfg.model.capacity_factor = (float)t.cfg.model.ep;
    if (mst_model_config_check(&t.cfg.model) != MST_OK) {
        fprintf(stderr, "moestash train: %s\n", mst_last_error());
        return 2;
    }
    const int data_rc = check_data(&t.cfg);
    if (data_rc) return data_rc;
    const mst_backend_kind kind = t.kind;
    if (t.gpus > 1 && kind == MST_BACKEND_CUDA && !t.l.launched) { /* this process launches the ranks */
        if (mst_launch_check_devices("moestash train", (int32_t)t.gpus)) return 2;
        return mst_launch_spawn("moestash train", "train", (int)t.gpus, argc, argv);
    }
    mst_launch_fail_point(&t.l, "start");
    mst_ctx_t* ctx = NULL;
    if (mst_ctx_create(kind, t.l.local_rank, &ctx) != MST_OK) {
        fprintf(stderr, "%s: --backend '%s': %s\n", t.l.who, kind == MST_BACKEND_CUDA ? "cuda" : "cpu", mst_last_error());
        return 2;
    }
    int32_t attn = MST_ATTN_AUTO;
    char attn_note[256];
    if (mst_model_attention(ctx, &t.cfg.model, &attn, attn_note, sizeof attn_note) != MST_OK) {
        fprintf(stderr, "%s: %s\n", t.l.who, mst_last_error());
        mst_ctx_destroy(ctx);
        return 2;
    }
    if (fits(ctx, &t.cfg.model, &t.cfg.mem, t.cfg.pp, (int32_t)dp)) { /* a rank's: its stage, its experts */
        mst_ctx_destroy(ctx);
        return 2;
    }
    mst_ep_t *ep = NULL, *pipe = NULL; /* the communicators of a launched rank (one process per GPU) */
    if (rank_comm(&t, ctx, &ep, &pipe)) {
        mst_ep_destroy(ep);
        mst_ep_destroy(pipe);
        mst_ctx_destroy(ctx);
        return 1;
    }
    const int rank0 = t.l.rank == 0;
    FILE* out = rank0 ? stdout : NULL; /* only rank 0 prints */
    const mst_model_config* m = &t.cfg.model;
    char policy[MST_POLICY_SPEC_MAX] = "?";
    mst_policy_spec_format(t.cfg.mem.policy.name, policy, sizeof policy);
    if (!t.quiet && rank0)
        printf("moestash train on %s%s\n  H=%lld F=%lld heads=%lld/%lld D=%lld V=%lld T=%lld B=%lld M=%d L=%d E=%d k=%d ep=%d pp=%d cf=%g "
               "max_rows=%lld mtp-weight=%g steps=%lld data=%s\n  schedule %s, policy %s, recompute %s, graph %s, "
               "attention %s%s%s\n",
               mst_ctx_describe(ctx), ep || pipe ? ", one process per GPU: B per rank"
                                      : t.gpus > 1 ? ", ranks as threads (--gpus): B per rank" : "",
               (long long)m->hidden, (long long)m->ffn, (long long)m->n_head, (long long)m->n_kv_head,
               (long long)m->head_dim, (long long)m->vocab, (long long)m->seq, (long long)m->batch, t.cfg.microbatches, m->layers, m->experts,
               m->top_k, m->ep, t.cfg.pp > 1 ? t.cfg.pp : 1, (double)m->capacity_factor, (long long)mst_model_max_rows(m, dp > 1 ? (int32_t)dp : 1),
               (double)m->mtp_weight, (long long)t.cfg.steps, t.cfg.data_path ? t.cfg.data_path : "synthetic",
               mst_schedule_kind_str(t.cfg.mem.schedule), t.cfg.memory_budget ? "planned (--memory-budget)" : policy,
               t.cfg.memory_budget ? "planned" : t.recompute ? t.recompute : "none",
               t.cfg.graph_from ? "on" : "off", mst_attn_kind_str(attn), attn_note[0] ? "; " : "", attn_note);
    mst_train_result res = {0};
    mst_status st = MST_OK;
    int rc = 0;
    if (t.check_policies) {
        FILE* json = t.json && rank0 ? fopen(t.json, "w") : NULL;
        if (t.json && rank0 && !json) {
            mst_ep_destroy(ep), mst_ep_destroy(pipe);
            mst_ctx_destroy(ctx);
            return mst_cli_bad(t.l.who, "--json", t.json, "cannot open for writing");
        }
        st = t.gpus > 1 && !ep && !pipe ? mst_train_ranks(MST_BACKEND_CPU, &t.cfg, (int32_t)t.gpus, 1, stdout, json, NULL)
                               : mst_train_check_policies(ctx, &t.cfg, out, json);
        if (json && fclose(json) != 0 && st == MST_OK) st = mst_set_error(MST_ERR_IO, "--json '%s': write failed", t.json);
        if (st == MST_ERR_STATE) {
            fprintf(stderr, "%s: --check-policies: %s\n", t.l.who, mst_last_error());
            mst_ep_destroy(ep), mst_ep_destroy(pipe);
            mst_ctx_destroy(ctx);
            return 1;
        }
    } else if (t.gpus > 1 && !ep && !pipe) {
        st = train_ranks(&t, &res);
    } else {
        st = mst_train_run(ctx, &t.cfg, t.quiet ? NULL : out, &res);
    }
    if (st == MST_OK && !t.check_policies && rank0) {
        if (!t.quiet) mst_train_print_memory(stdout, &res);
        if (res.plan) mst_plan_print(stdout, res.plan, &res, &t.cfg);
        const int64_t f = res.first_step - 1;
        printf("loss %.4f -> %.4f (mtp %.4f -> %.4f) in %lld steps, %.1f s, %lld reruns\n", res.loss[f],
               res.loss[res.steps - 1], res.mtp_loss[f], res.mtp_loss[res.steps - 1], (long long)(res.steps - f),
               res.seconds, (long long)res.reruns);
        if (isfinite(res.eval_loss[res.steps - 1]))
            printf("eval loss %.4f (%.3f bits per %s) on held-out data\n", res.eval_loss[res.steps - 1],
                   res.eval_loss[res.steps - 1] / log(2.0), t.cfg.model.vocab == 256 ? "byte" : "token");
        if (t.json) st = mst_train_write_json(t.json, &t.cfg, &res, mst_ctx_describe(ctx));
    }
    if (st != MST_OK) {
        /* input problems (a data file that is missing or empty) are exit 2 */
        rc = st == MST_ERR_IO || st == MST_ERR_INVALID ? 2 : 1;
        fprintf(stderr, "%s: %s\n", t.l.who, mst_last_error());
    }
    mst_train_result_free(&res);
    mst_ep_destroy(ep);
    mst_ep_destroy(pipe);
    mst_ctx_destroy(ctx);
    return rc;
}
