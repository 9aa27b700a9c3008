/*
 * compare.c — runs that must agree bit for bit: `train --check-policies`
 * (every policy and layer recompute against KEEP) and mst_train_compare.
 */
#include <string.h>

#include "lib/internal.h"
#include "report.h"

/* ---- --check-policies ------------------------------------------------------------ */

/* One run of --check-policies in the JSON document (label without padding). */
static void json_run(FILE* f, int i, const char* label, const mst_train_result* r, const char* verdict) {
    fprintf(f, "%s    {\"run\": \"", i ? ",\n" : "");
    for (const char* c = label; *c; c++) /* runs of spaces as one; none at the end */
        if (*c != ' ' || (c > label && c[-1] != ' ' && c[1] && c[strspn(c, " ")])) fputc(*c, f);
    fprintf(f, "\",\n");
    mst_train_json_array(f, "loss", r->loss, r->first_step, r->steps);
    mst_train_json_array(f, "mtp_loss", r->mtp_loss, r->first_step, r->steps);
    fprintf(f, "     \"weights_hash\": \"%016llx\", \"reruns\": %lld, \"verdict\": \"%s\"}", (unsigned long long)r->weights_hash,
            (long long)r->reruns, verdict);
}

mst_status mst_train_compare(mst_ctx_t* ctx, const mst_train_config* runs, const char* const* labels, int n,
                             FILE* out, FILE* json) {
    mst_train_result base = {0};
    int bad = 0;
    mst_status st = MST_OK;
    if (json) fprintf(json, "{\n  \"check_policies\": [\n");
    for (int i = 0; i < n && st == MST_OK; i++) {
        mst_train_result r = {0};
        st = mst_train_run(ctx, &runs[i], NULL, &r);
        if (st != MST_OK) {
            if (out) fprintf(out, "check-policies: %s FAILED: %s\n", labels[i], mst_last_error());
            mst_train_result_free(&r);
            break;
        }
        int same = i == 0 || (r.weights_hash == base.weights_hash &&
                              memcmp(r.loss, base.loss, sizeof(double) * (size_t)r.steps) == 0 &&
                              memcmp(r.mtp_loss, base.mtp_loss, sizeof(double) * (size_t)r.steps) == 0);
        bad |= !same;
        if (out)
            fprintf(out, "check-policies: %s loss %.6f, weights %016llx, reruns %lld: %s\n", labels[i],
                r.loss[r.steps - 1], (unsigned long long)r.weights_hash, (long long)r.reruns,
                i == 0 ? "reference" : same ? "bit-identical" : "DIFFERS");
        if (json) json_run(json, i, labels[i], &r, i == 0 ? "reference" : same ? "bit-identical" : "DIFFERS");
        if (i == 0) base = r;
        else mst_train_result_free(&r);
    }
    mst_train_result_free(&base);
    if (json) fprintf(json, "\n  ],\n  \"all_bit_identical\": %s\n}\n", st == MST_OK && !bad ? "true" : "false");
    if (st != MST_OK) return st;
    return bad ? mst_set_error(MST_ERR_STATE, "a run changed the losses or the final weights") : MST_OK;
}

mst_status mst_train_check_policies(mst_ctx_t* ctx, const mst_train_config* cfg, FILE* out, FILE* json) {
#define K MST_POLICY_KEEP
#define S MST_POLICY_STASH
#define O MST_POLICY_OFFLOAD
#define R MST_POLICY_RECOMPUTE
    static const struct { mst_policy name[MST_N_SAVED]; const char* recompute; } runs[] = { /* [fc1, act, fc2, probs] */
        {{K, K, K, K}, "none"}, {{S, S, S, S}, "none"}, {{O, O, O, O}, "none"}, {{K, K, R, K}, "none"},
        {{S, O, R, K}, "none"}, {{K, K, K, K}, "uniform:1"}, {{S, S, S, S}, "block:1"},
    };
#undef K
#undef S
#undef O
#undef R
    enum { N = sizeof runs / sizeof *runs };
    mst_train_config c[N];
    char label[N][MST_POLICY_SPEC_MAX + 32], spec[MST_POLICY_SPEC_MAX];
    const char* labels[N];
    for (int i = 0; i < N; i++) {
        c[i] = *cfg;
        memcpy(c[i].mem.policy.name, runs[i].name, sizeof runs[i].name);
        c[i].mem.policy.per_layer = NULL;
        MST_TRY(mst_recompute_parse(runs[i].recompute, &c[i].mem.recompute));
        MST_TRY(mst_policy_spec_format(runs[i].name, spec, sizeof spec));
        snprintf(label[i], sizeof label[i], "%-66s --recompute %-9s", spec, runs[i].recompute);
        labels[i] = label[i];
    }
    mst_status st = mst_train_compare(ctx, c, labels, N, out, json);
    return st == MST_ERR_STATE ? mst_set_error(st, "a policy changed the losses or the final weights") : st;
}

