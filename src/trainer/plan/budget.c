/*
 * budget.c — the memory-budget planner (budget.h): the peak and step time a
 * plan is predicted to have (mst_budget_eval), and the search for the
 * fastest plan that fits (mst_budget_solve).
 *
 * Peak. Every buffer of the run is static, so the peak is a sum:
 *   common    fixed + the layers' own activations per activation set (a
 *             microbatch in flight holds one; a layer recomputed whole
 *             keeps only its output, the MTP layer not even that (a pipeline
 *             stage before the last has none: no_mtp_layer); one shared
 *             slot of a layer's activations, and of the MTP module when it
 *             is recomputed) + KEEP buffers [R, cols] per (layer, set, name) +
 *             one compute buffer per name that some layer does not keep (or
 *             any layer recomputed) + rerun buffers (one per name when a
 *             layer is recomputed). The ops' workspaces live as long as the
 *             context: they are in fixed
 *   measuring common + restore buffers of R rows (both parities) of every
 *             paged name + the exact copies of STASHed tensors alive at once
 *             (OFFLOADed ones are in host memory)
 *   sized     common + restore buffers of the largest rows saved times the
 *             pool factor for the names restored (offloaded, or not read in
 *             place) + each pool's state, ring and device block
 *             (ceil(peak pages * factor) pages of the pages alive at once
 *             along the schedule; offload pools have no device block) + the
 *             handles of the paged tensors.
 * The layouts (restore arena widest first, 256-byte aligned views; page
 * counts; a tensor whose backward follows at once stays in its compute
 * buffer) are the memory manager's, src/lib/stash/memmgr_buffers.c.
 *
 * Time: the KEEP step plus, per (layer, mb): a recomputed layer's forward
 * (and the MTP module's when layer L1-1 is recomputed whole); per STASHed
 * tensor the device copies of its rows (the save, unless its producer writes
 * the pages: act_input, fc2_input read in place; the restore, unless read in
 * place); per OFFLOADed one its rows over PCIe both ways; a recomputed z its
 * read of h and write of z at device copy speed. Copies are charged in full
 * (the CPU runs them in line; on a GPU side streams hide part of them).
 *
 * Search: for each granularity (full, moe), greedy from all-KEEP: apply the
 * move that lowers the peak at the least added time per byte saved (one
 * tensor of one layer, one name on every layer, or one layer recomputed),
 * until the plan fits; then undo what is no longer needed, most expensive
 * first. Also every uniform plan (one policy per name on every layer, the
 * first N layers recomputed). The fastest fitting plan wins. The smallest
 * peak reported is found apart, the same whatever the budget: the least of
 * every uniform plan and of the greedy descent taken as far as it goes.
 */
#include <math.h>
#include <string.h>

#include "budget.h"

static size_t row_bytes(const mst_budget_model* bm, int n) {
    int64_t cols = 0;
    mst_dtype dt = MST_DTYPE_BF16;
    mst_saved_shape((mst_saved_name)n, bm->hidden, bm->ffn, &cols, &dt);
    return (size_t)cols * mst_dtype_size(dt);
}

static size_t align256(size_t b) { return (b + 255) & ~(size_t)255; }

static int is_paged(mst_policy p) { return p == MST_POLICY_STASH || p == MST_POLICY_OFFLOAD; }

/* ---- plan storage ---------------------------------------------------------------- */

mst_status mst_budget_plan_alloc(int32_t n_layers, mst_budget_plan* p) {
    memset(p, 0, sizeof *p);
    if (n_layers < 1) return mst_set_error(MST_ERR_INVALID, "n_layers = %d, must be >= 1", n_layers);
    p->chunk_start = (int32_t*)malloc(sizeof(int32_t) * (size_t)n_layers);
    p->policy = (mst_policy*)malloc(sizeof(mst_policy) * (size_t)n_layers * MST_N_SAVED);
    if (!p->chunk_start || !p->policy) {
        mst_budget_plan_free(p);
        return mst_set_error(MST_ERR_OOM, "budget plan of %d layers", n_layers);
    }
    mst_budget_plan_keep(n_layers, p);
    return MST_OK;
}

void mst_budget_plan_free(mst_budget_plan* p) {
    free(p->chunk_start);
    free(p->policy);
    memset(p, 0, sizeof *p);
}

void mst_budget_plan_keep(int32_t n_layers, mst_budget_plan* p) {
    p->full = 1;
    for (int32_t l = 0; l < n_layers; l++) p->chunk_start[l] = -1;
    for (int32_t i = 0; i < n_layers * MST_N_SAVED; i++) p->policy[i] = MST_POLICY_KEEP;
}

void mst_budget_plan_copy(int32_t n_layers, mst_budget_plan* dst, const mst_budget_plan* src) {
    int32_t* cs = dst->chunk_start;
    mst_policy* po = dst->policy;
    *dst = *src;
    dst->chunk_start = cs, dst->policy = po;
    memcpy(cs, src->chunk_start, sizeof(int32_t) * (size_t)n_layers);
    memcpy(po, src->policy, sizeof(mst_policy) * (size_t)n_layers * MST_N_SAVED);
}

/* ---- the model's checks ---------------------------------------------------------- */

mst_status mst_budget_model_check(const mst_budget_model* bm) {
    if (!bm) return mst_set_error(MST_ERR_INVALID, "bm is NULL");
    if (bm->n_layers < 1 || bm->n_micro < 1 || bm->n_sets < 1 || bm->n_sets > bm->n_micro)
        return mst_set_error(MST_ERR_INVALID, "n_layers = %d, n_micro = %d, n_sets = %d: each >= 1, n_sets <= n_micro",
                             bm->n_layers, bm->n_micro, bm->n_sets);
    if (!bm->sched || bm->n_sched < 2 || bm->layers_per_chunk < 1 || bm->n_layers % bm->layers_per_chunk)
        return mst_set_error(MST_ERR_INVALID, "schedule of %d entries, %d layers per chunk for %d layers",
                             bm->sched ? bm->n_sched : 0, bm->layers_per_chunk, bm->n_layers);
    if (!bm->rows) return mst_set_error(MST_ERR_INVALID, "rows is NULL");
    if (bm->no_mtp_layer != 0 && bm->no_mtp_layer != 1)
        return mst_set_error(MST_ERR_INVALID, "no_mtp_layer = %d, expected 0 or 1", bm->no_mtp_layer);
    if (bm->max_rows < 1 || bm->hidden < 1 || bm->ffn < 1 || bm->page_rows < 1 || !(bm->pool_factor > 0))
        return mst_set_error(MST_ERR_INVALID, "max_rows = %lld, hidden = %lld, ffn = %lld, page_rows = %d, "
                             "pool_factor = %g: all must be positive", (long long)bm->max_rows, (long long)bm->hidden,
                             (long long)bm->ffn, bm->page_rows, bm->pool_factor);
    for (int64_t i = 0; i < (int64_t)bm->n_layers * bm->n_micro; i++)
        if (bm->rows[i] < 0 || bm->rows[i] > bm->max_rows)
            return mst_set_error(MST_ERR_INVALID, "rows[%lld] = %lld, expected 0 .. max_rows = %lld", (long long)i,
                                 (long long)bm->rows[i], (long long)bm->max_rows);
    if (!(bm->dev_bw > 0) || !(bm->host_bw > 0) || !(bm->t_step >= 0) || !(bm->t_layer >= 0) || !(bm->t_mtp >= 0))
        return mst_set_error(MST_ERR_INVALID, "dev_bw = %g, host_bw = %g (> 0), t_step = %g, t_layer = %g, t_mtp = %g "
                             "(>= 0)", bm->dev_bw, bm->host_bw, bm->t_step, bm->t_layer, bm->t_mtp);
    for (int32_t i = 0; i < bm->n_sched; i++) {
        const mst_sched_entry e = bm->sched[i];
        if (e.chunk < 0 || e.chunk >= bm->n_layers / bm->layers_per_chunk || e.microbatch < 0 ||
            e.microbatch >= bm->n_micro)
            return mst_set_error(MST_ERR_INVALID, "sched[%d] = (chunk %d, mb %d) out of range", i, e.chunk, e.microbatch);
    }
    return MST_OK;
}

/* ---- prediction -------------------------------------------------------------------- */

static int rec(const mst_budget_plan* p, int32_t l) { return p->chunk_start[l] >= 0; }
static mst_policy pol(const mst_budget_plan* p, int32_t l, int n) { return p->policy[l * MST_N_SAVED + n]; }

/* What the plan does with name n over the layers not recomputed. */
typedef struct name_use {
    int not_kept;   /* some layer does not keep it                   */
    int paged;      /* some layer stashes or offloads it             */
    int pool[2];    /* some layer puts it into pool kind 0 (stash) / 1 (offload) */
} name_use;

static void uses(const mst_budget_model* bm, const mst_budget_plan* p, name_use u[MST_N_SAVED]) {
    memset(u, 0, sizeof(name_use) * MST_N_SAVED);
    for (int32_t l = 0; l < bm->n_layers; l++)
        for (int n = 0; n < MST_N_SAVED && !rec(p, l); n++) {
            const mst_policy q = pol(p, l, n);
            u[n].not_kept |= q != MST_POLICY_KEEP;
            u[n].paged |= is_paged(q);
            if (is_paged(q)) u[n].pool[q == MST_POLICY_OFFLOAD] = 1;
        }
}

/* Restore arena of `rows` rows for the names in want[]: widest first, both
 * parities side by side, 256-byte aligned, each view with R addressable rows. */
static size_t arena(const mst_budget_model* bm, const int want[MST_N_SAVED], int64_t rows) {
    int order[MST_N_SAVED], k = 0;
    for (int n = 0; n < MST_N_SAVED; n++) {
        if (!want[n]) continue;
        int i = k++;
        for (; i > 0 && row_bytes(bm, order[i - 1]) < row_bytes(bm, n); i--) order[i] = order[i - 1];
        order[i] = n;
    }
    size_t at = 0, need = 0;
    for (int i = 0; i < k; i++)
        for (int par = 0; par < 2; par++) {
            const size_t off = at, rb = row_bytes(bm, order[i]);
            at += align256((size_t)rows * rb);
            if (off + (size_t)bm->max_rows * rb > need) need = off + (size_t)bm->max_rows * rb;
        }
    return at > need ? at : need;
}

/* Walk of the measuring step along the schedule: the pages each pool would
 * hold at once, the STASHed exact copies alive at once, the largest rows of
 * a paged tensor, and which (layer, mb) stay in the compute buffers. */
typedef struct walk {
    int64_t peak_pages[MST_N_SAVED][2];
    size_t exact_peak;
    int64_t max_saved_rows;
} walk;

static int64_t pages(const mst_budget_model* bm, int64_t rows) { return (rows + bm->page_rows - 1) / bm->page_rows; }

/* Is the backward of (l, mb) the entry right after forward entry i? */
static int backward_follows(const mst_budget_model* bm, int32_t i, int32_t l, int32_t mb) {
    const int32_t c = bm->sched[i].chunk;
    if (l != (c + 1) * bm->layers_per_chunk - 1 || i + 1 >= bm->n_sched) return 0;
    const mst_sched_entry e = bm->sched[i + 1];
    return e.backward && e.chunk == c && e.microbatch == mb;
}

static void walk_schedule(const mst_budget_model* bm, const mst_budget_plan* p, unsigned char* in_compute, walk* w) {
    memset(w, 0, sizeof *w);
    int64_t live[MST_N_SAVED][2] = {{0}};
    size_t exact = 0;
    const int32_t M = bm->n_micro;
    for (int32_t i = 0; i < bm->n_sched; i++) {
        const mst_sched_entry e = bm->sched[i];
        const int32_t first = e.chunk * bm->layers_per_chunk;
        for (int32_t j = 0; j < bm->layers_per_chunk; j++) {
            const int32_t l = e.backward ? first + bm->layers_per_chunk - 1 - j : first + j;
            if (rec(p, l)) continue;
            const int64_t r = bm->rows[l * M + e.microbatch];
            if (!e.backward) in_compute[l * M + e.microbatch] = (unsigned char)backward_follows(bm, i, l, e.microbatch);
            if (in_compute[l * M + e.microbatch]) continue;
            for (int n = 0; n < MST_N_SAVED; n++) {
                const mst_policy q = pol(p, l, n);
                if (!is_paged(q)) continue;
                const int k = q == MST_POLICY_OFFLOAD;
                const int64_t dp = e.backward ? -pages(bm, r) : pages(bm, r);
                live[n][k] += dp;
                if (live[n][k] > w->peak_pages[n][k]) w->peak_pages[n][k] = live[n][k];
                if (q == MST_POLICY_STASH) exact = e.backward ? exact - (size_t)r * row_bytes(bm, n) : exact + (size_t)r * row_bytes(bm, n);
                if (exact > w->exact_peak) w->exact_peak = exact;
                if (!e.backward && r > w->max_saved_rows) w->max_saved_rows = r;
            }
        }
    }
}

/* The layers' own activations and the recompute slots. */
static size_t model_acts(const mst_budget_model* bm, const mst_budget_plan* p) {
    const int32_t L1 = bm->n_layers, top = bm->no_mtp_layer ? L1 : L1 - 1; /* the MTP layer, if here */
    size_t per_set = bm->mtp_input, shared = 0;
    int any = 0;
    for (int32_t l = 0; l < L1; l++) {
        any |= rec(p, l);
        per_set += rec(p, l) && p->full ? (l < top ? bm->layer_out : 0) : bm->layer_acts;
    }
    if (top < L1 && rec(p, top) && p->full) shared += bm->mtp_module;
    else per_set += bm->mtp_module;
    if (any && p->full) shared += bm->layer_acts;
    return per_set * (size_t)bm->n_sets + shared;
}

/* Pools (state, ring, device block) and handles of the sized steps. */
static size_t pools_and_handles(const mst_budget_model* bm, const mst_budget_plan* p, const name_use* u, const walk* w,
                                int64_t restore_rows) {
    size_t b = 0;
    for (int n = 0; n < MST_N_SAVED; n++)
        for (int k = 0; k < 2; k++) {
            if (!u[n].pool[k]) continue;
            const double peak = (double)w->peak_pages[n][k];
            int64_t dev = k ? 0 : (int64_t)ceil(peak * bm->pool_factor), host = k ? (int64_t)ceil(peak * bm->pool_factor) : 0;
            if (dev + host == 0) dev = 1;
            b += sizeof(mst_pool_state) + (size_t)(dev + host) * sizeof(uint32_t) +
                 (size_t)dev * (size_t)bm->page_rows * row_bytes(bm, n);
        }
    const size_t handle = sizeof(mst_handle_state) + (size_t)pages(bm, restore_rows) * sizeof(uint32_t);
    for (int32_t l = 0; l < bm->n_layers; l++)
        for (int n = 0; n < MST_N_SAVED && !rec(p, l); n++)
            if (is_paged(pol(p, l, n))) b += (size_t)bm->n_micro * handle;
    return b;
}

/* Rows of the sized restore buffers and handles (the manager's sized_restore_rows). */
static int64_t restore_rows(const mst_budget_model* bm, int64_t max_saved) {
    const int64_t pr = bm->page_rows;
    int64_t rows = (int64_t)ceil((double)max_saved * bm->pool_factor);
    rows = (rows + pr - 1) / pr * pr;
    if (rows < pr) rows = pr;
    return rows < bm->max_rows ? rows : bm->max_rows;
}

static double copy_s(const mst_budget_model* bm, int64_t rows, int n, double bw) {
    return (double)rows * (double)row_bytes(bm, n) / bw;
}

/* Time one (layer, mb) adds to the KEEP step. */
static double layer_cost(const mst_budget_model* bm, const mst_budget_plan* p, int32_t l, int64_t rows, int in_compute) {
    if (rec(p, l)) return bm->t_layer + (l == bm->n_layers - 1 && !bm->no_mtp_layer && p->full ? bm->t_mtp : 0.0);
    double t = 0;
    for (int n = 0; n < MST_N_SAVED; n++) {
        const mst_policy q = pol(p, l, n);
        if (q == MST_POLICY_RECOMPUTE) /* read h [rows, 2F], write z [rows, F] */
            t += copy_s(bm, rows, MST_SAVED_ACT_INPUT, bm->dev_bw) + copy_s(bm, rows, MST_SAVED_FC2_INPUT, bm->dev_bw);
        if (!is_paged(q) || in_compute) continue;
        if (q == MST_POLICY_OFFLOAD) {
            t += 2 * copy_s(bm, rows, n, bm->host_bw);
            continue;
        }
        const int claimed = bm->reads_pages[n] && (n == MST_SAVED_ACT_INPUT || n == MST_SAVED_FC2_INPUT);
        t += (claimed ? 0 : 1) * copy_s(bm, rows, n, bm->dev_bw) + (bm->reads_pages[n] ? 0 : 1) * copy_s(bm, rows, n, bm->dev_bw);
    }
    return t;
}

/* Evaluates p with in_compute scratch [L1 * M]. */
static void eval_with(const mst_budget_model* bm, mst_budget_plan* p, unsigned char* in_compute) {
    const int32_t L1 = bm->n_layers, M = bm->n_micro;
    const size_t R = (size_t)bm->max_rows;
    name_use u[MST_N_SAVED];
    uses(bm, p, u);
    walk w;
    memset(in_compute, 0, (size_t)L1 * (size_t)M);
    walk_schedule(bm, p, in_compute, &w);
    int any_rec = 0;
    for (int32_t l = 0; l < L1; l++) any_rec |= rec(p, l);
    size_t mgr = 0;
    for (int32_t l = 0; l < L1; l++)
        for (int n = 0; n < MST_N_SAVED && !rec(p, l); n++)
            if (pol(p, l, n) == MST_POLICY_KEEP) mgr += (size_t)bm->n_sets * R * row_bytes(bm, n);
    for (int n = 0; n < MST_N_SAVED; n++) {
        if (u[n].not_kept || any_rec) mgr += R * row_bytes(bm, n); /* compute buffer */
        if (any_rec) mgr += R * row_bytes(bm, n);                   /* rerun buffer   */
    }
    const size_t common_acts = model_acts(bm, p) + mgr;
    const size_t common = bm->fixed + common_acts;
    int paged[MST_N_SAVED], restored[MST_N_SAVED];
    for (int n = 0; n < MST_N_SAVED; n++) {
        paged[n] = u[n].paged;
        restored[n] = u[n].paged && (!bm->reads_pages[n] || u[n].pool[1]);
    }
    const int64_t rr = restore_rows(bm, w.max_saved_rows);
    const size_t meas_extra = arena(bm, paged, bm->max_rows) + w.exact_peak;
    const size_t sized_extra = arena(bm, restored, rr) + pools_and_handles(bm, p, u, &w, rr);
    p->peak_measuring = common + meas_extra;
    p->peak_sized = common + sized_extra;
    p->peak = p->peak_measuring > p->peak_sized ? p->peak_measuring : p->peak_sized;
    p->acts = common_acts + (meas_extra > sized_extra ? meas_extra : sized_extra);
    double t = bm->t_step;
    for (int32_t l = 0; l < L1; l++)
        for (int32_t mb = 0; mb < M; mb++) t += layer_cost(bm, p, l, bm->rows[l * M + mb], in_compute[l * M + mb]);
    p->step_s = t;
}

mst_status mst_budget_eval(const mst_budget_model* bm, mst_budget_plan* p) {
    MST_TRY(mst_budget_model_check(bm));
    if (!p || !p->chunk_start || !p->policy) return mst_set_error(MST_ERR_INVALID, "plan is NULL or not allocated");
    for (int32_t l = 0; l < bm->n_layers; l++) {
        if (p->chunk_start[l] != -1 && p->chunk_start[l] != l)
            return mst_set_error(MST_ERR_INVALID, "chunk_start[%d] = %d: expected -1 or %d (chunks of one layer)", l,
                                 p->chunk_start[l], l);
        for (int n = 0; n < MST_N_SAVED; n++) {
            const mst_policy q = pol(p, l, n);
            if ((int)q < 0 || q >= MST_N_POLICIES || (q == MST_POLICY_RECOMPUTE && n != MST_SAVED_FC2_INPUT))
                return mst_set_error(MST_ERR_INVALID, "policy of (layer %d, %s) = %d", l,
                                     mst_saved_name_str((mst_saved_name)n), (int)q);
        }
    }
    unsigned char* ic = (unsigned char*)malloc((size_t)bm->n_layers * (size_t)bm->n_micro);
    if (!ic) return mst_set_error(MST_ERR_OOM, "budget eval scratch");
    eval_with(bm, p, ic);
    free(ic);
    return MST_OK;
}

/* ---- search ----------------------------------------------------------------------- */

typedef struct search {
    const mst_budget_model* bm;
    size_t budget;
    unsigned char* ic;     /* [L1 M] eval scratch          */
    mst_budget_plan cur, trial, best;
    int have_best;
    int track;             /* the pass that finds the smallest peak */
    size_t smallest;
} search;

static void consider(search* s, mst_budget_plan* p) {
    eval_with(s->bm, p, s->ic);
    if (s->track && p->peak < s->smallest) s->smallest = p->peak;
    if (p->peak <= s->budget && (!s->have_best || p->step_s < s->best.step_s)) {
        mst_budget_plan_copy(s->bm->n_layers, &s->best, p);
        s->have_best = 1;
    }
}

static const mst_policy choices[] = {MST_POLICY_KEEP, MST_POLICY_STASH, MST_POLICY_OFFLOAD, MST_POLICY_RECOMPUTE};
enum { N_CHOICES = 4 };
static int allowed(int n, mst_policy q) { return q != MST_POLICY_RECOMPUTE || n == MST_SAVED_FC2_INPUT; }

/* A move: layer l (-1: every layer not recomputed) and name n set to q, or
 * (n < 0) layer l recomputed. */
typedef struct move { int32_t l; int n; mst_policy q; } move;

static int apply(const mst_budget_model* bm, mst_budget_plan* p, move mv) {
    if (mv.n < 0) {
        if (rec(p, mv.l)) return 0;
        p->chunk_start[mv.l] = mv.l;
        return 1;
    }
    int changed = 0;
    for (int32_t l = mv.l < 0 ? 0 : mv.l; l < (mv.l < 0 ? bm->n_layers : mv.l + 1); l++) {
        if (rec(p, l) || pol(p, l, mv.n) == mv.q) continue;
        p->policy[l * MST_N_SAVED + mv.n] = mv.q;
        changed = 1;
    }
    return changed;
}

/* Greedy descent from s->cur until it fits (or no move lowers the peak). */
static void descend(search* s) {
    const mst_budget_model* bm = s->bm;
    const int32_t L1 = bm->n_layers;
    eval_with(bm, &s->cur, s->ic);
    while (s->cur.peak > s->budget) {
        double best_score = 0;
        move best = {0, 0, MST_POLICY_KEEP};
        int found = 0;
        for (int32_t l = -1; l < L1; l++)
            for (int n = -1; n < MST_N_SAVED; n++)
                for (int c = 0; c < (n < 0 ? 1 : N_CHOICES); c++) {
                    const move mv = {l, n, choices[c]};
                    if ((n < 0 && l < 0) || (n >= 0 && !allowed(n, mv.q))) continue;
                    mst_budget_plan_copy(L1, &s->trial, &s->cur);
                    if (!apply(bm, &s->trial, mv)) continue;
                    consider(s, &s->trial);
                    if (s->trial.peak >= s->cur.peak) continue;
                    const double score = (s->trial.step_s - s->cur.step_s) / (double)(s->cur.peak - s->trial.peak);
                    if (!found || score < best_score) best_score = score, best = mv, found = 1;
                }
        if (!found) return;
        apply(bm, &s->cur, best);
        eval_with(bm, &s->cur, s->ic);
    }
    consider(s, &s->cur);
}

/* Undo what a fitting s->cur no longer needs: the cheaper choice of one
 * (layer, name), or a recomputed layer kept again, whichever saves the most
 * time and still fits; until nothing does. */
static void polish(search* s) {
    const mst_budget_model* bm = s->bm;
    const int32_t L1 = bm->n_layers;
    if (s->cur.peak > s->budget) return;
    for (;;) {
        double gain = 0;
        mst_budget_plan* pick = NULL;
        mst_budget_plan cand;
        if (mst_budget_plan_alloc(L1, &cand) != MST_OK) return;
        for (int32_t l = 0; l < L1; l++)
            for (int n = -1; n < MST_N_SAVED; n++)
                for (int c = 0; c < (n < 0 ? 1 : N_CHOICES); c++) {
                    mst_budget_plan_copy(L1, &s->trial, &s->cur);
                    if (n < 0) {
                        if (!rec(&s->trial, l)) continue;
                        s->trial.chunk_start[l] = -1;
                    } else {
                        if (!allowed(n, choices[c]) || rec(&s->trial, l) || pol(&s->trial, l, n) == choices[c]) continue;
                        s->trial.policy[l * MST_N_SAVED + n] = choices[c];
                    }
                    consider(s, &s->trial);
                    if (s->trial.peak > s->budget || s->cur.step_s - s->trial.step_s <= gain) continue;
                    gain = s->cur.step_s - s->trial.step_s;
                    mst_budget_plan_copy(L1, &cand, &s->trial);
                    pick = &cand;
                }
        if (pick) mst_budget_plan_copy(L1, &s->cur, pick);
        mst_budget_plan_free(&cand);
        if (!pick) return;
    }
}

/* Every uniform plan: one choice per name on every layer, the first N layers
 * recomputed (N = 0 .. L1), at granularity `full`. */
static void uniform_plans(search* s, int32_t full) {
    const int32_t L1 = s->bm->n_layers;
    int pick[MST_N_SAVED];
    for (int code = 0; code < N_CHOICES * N_CHOICES * N_CHOICES * N_CHOICES; code++) {
        int ok = 1;
        for (int n = 0, c = code; n < MST_N_SAVED; n++, c /= N_CHOICES) {
            pick[n] = c % N_CHOICES;
            ok &= allowed(n, choices[pick[n]]);
        }
        if (!ok) continue;
        for (int32_t nrec = 0; nrec <= L1; nrec++) {
            mst_budget_plan_keep(L1, &s->trial);
            s->trial.full = full;
            for (int32_t l = 0; l < L1; l++) {
                s->trial.chunk_start[l] = l < nrec ? l : -1;
                for (int n = 0; n < MST_N_SAVED; n++) s->trial.policy[l * MST_N_SAVED + n] = choices[pick[n]];
            }
            consider(s, &s->trial);
        }
    }
}

mst_status mst_budget_solve(const mst_budget_model* bm, size_t budget, mst_budget_plan* out, size_t* smallest) {
    MST_TRY(mst_budget_model_check(bm));
    if (!out || !out->chunk_start || !out->policy) return mst_set_error(MST_ERR_INVALID, "out is NULL or not allocated");
    const int32_t L1 = bm->n_layers;
    search s = {bm, 0, NULL, {0}, {0}, {0}, 0, 1, SIZE_MAX};
    s.ic = (unsigned char*)malloc((size_t)L1 * (size_t)bm->n_micro);
    mst_status st = s.ic ? MST_OK : mst_set_error(MST_ERR_OOM, "budget search scratch");
    if (st == MST_OK) st = mst_budget_plan_alloc(L1, &s.cur);
    if (st == MST_OK) st = mst_budget_plan_alloc(L1, &s.trial);
    if (st == MST_OK) st = mst_budget_plan_alloc(L1, &s.best);
    /* first the smallest peak, whatever the budget: every uniform plan and
     * the descent all the way down; then the search for the budget */
    for (int pass = 0; pass < 2 && st == MST_OK; pass++) {
        s.track = pass == 0;
        s.budget = pass == 0 ? 0 : budget;
        s.have_best = 0;
        for (int32_t full = 1; full >= 0; full--) {
            if (pass) uniform_plans(&s, full);
            mst_budget_plan_keep(L1, &s.cur);
            s.cur.full = full;
            descend(&s);
            if (pass) polish(&s);
            consider(&s, &s.cur);
        }
        if (pass == 0) uniform_plans(&s, 1), uniform_plans(&s, 0);
    }
    if (smallest) *smallest = s.smallest;
    if (st == MST_OK && s.have_best) mst_budget_plan_copy(L1, out, &s.best);
    else if (st == MST_OK)
        st = mst_set_error(MST_ERR_INVALID, "no plan fits %zu bytes: the smallest peak is %zu bytes", budget, s.smallest);
    free(s.ic);
    mst_budget_plan_free(&s.cur);
    mst_budget_plan_free(&s.trial);
    mst_budget_plan_free(&s.best);
    return st;
}
