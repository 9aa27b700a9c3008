/*
 * test_schedule.c — pipeline schedules (plain, 1F1B, interleaved) and layer
 * recompute plans: exact known orders, the properties every schedule must
 * keep, and the bad-input cases. Backend-independent (runs on either).
 */
#include <stdlib.h>
#include <string.h>

#include "harness.h"

/* Each (chunk, mb) forward and backward exactly once, forward first; chunks
 * of one microbatch forward in order and backward in reverse order. Returns
 * the peak number of forwards whose backward has not run yet. */
static int check_properties(const mst_schedule_config* c, const mst_sched_entry* e, int n) {
    const int M = c->microbatches, V = c->virtual_stages;
    int* fpos = (int*)malloc(sizeof(int) * M * V);
    int* bpos = (int*)malloc(sizeof(int) * M * V);
    for (int i = 0; i < M * V; i++) fpos[i] = bpos[i] = -1;
    int live = 0, peak = 0;
    for (int i = 0; i < n; i++) {
        int k = e[i].microbatch * V + e[i].chunk;
        CHECK(e[i].chunk >= 0 && e[i].chunk < V && e[i].microbatch >= 0 && e[i].microbatch < M,
              "%s entry %d out of range", mst_schedule_kind_str(c->kind), i);
        int* pos = e[i].backward ? bpos : fpos;
        CHECK(pos[k] < 0, "%s: entry %d repeats (chunk %d, mb %d)", mst_schedule_kind_str(c->kind), i,
              e[i].chunk, e[i].microbatch);
        pos[k] = i;
        live += e[i].backward ? -1 : 1;
        if (live > peak) peak = live;
    }
    for (int mb = 0; mb < M; mb++)
        for (int ch = 0; ch < V; ch++) {
            int k = mb * V + ch;
            CHECK(fpos[k] >= 0 && bpos[k] > fpos[k], "%s S=%d r=%d M=%d V=%d: (chunk %d, mb %d) F %d B %d",
                  mst_schedule_kind_str(c->kind), c->stages, c->rank, M, V, ch, mb, fpos[k], bpos[k]);
            if (ch > 0) {
                CHECK(fpos[k] > fpos[k - 1], "forward of chunk %d before chunk %d (mb %d)", ch, ch - 1, mb);
                CHECK(bpos[k] < bpos[k - 1], "backward of chunk %d after chunk %d (mb %d)", ch, ch - 1, mb);
            }
        }
    free(fpos);
    free(bpos);
    return peak;
}

static void known_orders(void) {
    /* 1F1B, 4 stages, first rank, 6 microbatches: 3 warm-up forwards. */
    mst_schedule_config c = {sizeof(mst_schedule_config), MST_SCHEDULE_1F1B, 4, 0, 6, 1};
    mst_sched_entry e[12];
    CHECK_OK(mst_schedule_make(&c, e, 12));
    const char* want = "F0F1F2F3B0F4B1F5B2B3B4B5";
    char got[64] = "";
    for (int i = 0; i < 12; i++) {
        char s[8];
        snprintf(s, sizeof s, "%c%d", e[i].backward ? 'B' : 'F', e[i].microbatch);
        strcat(got, s);
    }
    CHECK(strcmp(got, want) == 0, "1f1b order %s, expected %s", got, want);
    /* last rank: no warm-up, strict alternation */
    c.rank = 3;
    CHECK_OK(mst_schedule_make(&c, e, 12));
    for (int i = 0; i < 12; i++)
        CHECK(e[i].backward == (i & 1) && e[i].microbatch == i / 2, "last rank entry %d", i);
    /* plain: all forwards, then backwards from the last microbatch */
    c = (mst_schedule_config){sizeof(mst_schedule_config), MST_SCHEDULE_PLAIN, 1, 0, 3, 1};
    CHECK_OK(mst_schedule_make(&c, e, 6));
    CHECK(!e[2].backward && e[3].backward && e[3].microbatch == 2 && e[5].microbatch == 0,
          "plain order");
}

/* mst_schedule_sets against the schedule itself: as many sets as the peak
 * of microbatches between their chunk-0 forward and chunk-0 backward, and
 * no two microbatches in flight together in one set. */
static void check_sets(const mst_schedule_config* c, const mst_sched_entry* e, int n) {
    const int M = c->microbatches;
    int32_t* set_of = (int32_t*)malloc(sizeof(int32_t) * M);
    int* open = (int*)calloc((size_t)M, sizeof(int)); /* 1 while in flight */
    int32_t n_sets = -1;
    CHECK_OK(mst_schedule_sets(e, n, M, set_of, &n_sets));
    int live = 0, peak = 0, clash = 0;
    for (int i = 0; i < n; i++) {
        if (e[i].chunk != 0) continue;
        const int mb = e[i].microbatch;
        if (e[i].backward) {
            open[mb] = 0, live--;
            continue;
        }
        for (int o = 0; o < M; o++) clash += open[o] && set_of[o] == set_of[mb];
        open[mb] = 1, live++;
        if (live > peak) peak = live;
    }
    CHECK(n_sets == peak, "%s S=%d r=%d M=%d V=%d: %d activation sets, %d microbatches in flight at most",
          mst_schedule_kind_str(c->kind), c->stages, c->rank, M, c->virtual_stages, n_sets, peak);
    CHECK(clash == 0, "%s S=%d r=%d M=%d V=%d: %d microbatches share a set with one in flight",
          mst_schedule_kind_str(c->kind), c->stages, c->rank, M, c->virtual_stages, clash);
    free(set_of), free(open);
}

static void properties(void) {
    for (int kind = 0; kind < 3; kind++)
        for (int S = 1; S <= 4; S++)
            for (int r = 0; r < S; r++)
                for (int M = S; M <= 3 * S; M += S)
                    for (int V = kind == 2 ? 2 : 1; V <= (kind == 0 ? 2 : kind == 1 ? 1 : 3); V++) {
                        mst_schedule_config c = {sizeof(mst_schedule_config), (mst_schedule_kind)kind, S, r, M, V};
                        int n = 2 * M * V;
                        mst_sched_entry* e = (mst_sched_entry*)malloc(sizeof *e * n);
                        mst_status st = mst_schedule_make(&c, e, n);
                        CHECK(st == MST_OK, "%s S=%d r=%d M=%d V=%d: %s", mst_schedule_kind_str(c.kind),
                              S, r, M, V, mst_last_error());
                        if (st == MST_OK) {
                            int peak = check_properties(&c, e, n);
                            check_sets(&c, e, n);
                            if (kind == 1) {
                                int want = S - r < M ? S - r : M;
                                CHECK(peak == want, "1f1b S=%d r=%d M=%d: peak %d in flight, expected %d",
                                      S, r, M, peak, want);
                            }
                            if (kind == 0) CHECK(peak == M * V, "plain: peak %d", peak);
                        }
                        free(e);
                    }
}

static void bad_schedules(void) {
    mst_sched_entry e[64];
    mst_schedule_config bad[] = {
        {sizeof(mst_schedule_config), MST_SCHEDULE_1F1B, 4, 4, 4, 1},        /* rank past stages           */
        {sizeof(mst_schedule_config), MST_SCHEDULE_1F1B, 0, 0, 4, 1},        /* no stages                  */
        {sizeof(mst_schedule_config), MST_SCHEDULE_1F1B, 2, 0, 0, 1},        /* no microbatches            */
        {sizeof(mst_schedule_config), MST_SCHEDULE_INTERLEAVED, 4, 0, 6, 2}, /* 6 not a multiple of 4      */
        {sizeof(mst_schedule_config), MST_SCHEDULE_INTERLEAVED, 2, 0, 4, 1}, /* interleaved needs V >= 2   */
        {sizeof(mst_schedule_config), MST_SCHEDULE_1F1B, 2, 0, 4, 2},        /* 1f1b with chunks           */
    };
    const char* const why[] = {"rank = 4, must be in [0, stages = 4)", "stages = 0", "microbatches = 0",
                               "microbatches = 6 with schedule interleaved", "virtual_stages = 1 with schedule interleaved",
                               "virtual_stages = 2 with schedule 1f1b"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_STATUS(mst_schedule_make(&bad[i], e, 2 * bad[i].microbatches * bad[i].virtual_stages),
                     MST_ERR_INVALID);
        CHECK(strstr(mst_last_error(), why[i]) != NULL, "bad schedule %zu: message '%s', expected '%s'", i,
              mst_last_error(), why[i]);
    }
    int32_t set_of[4], n_sets;
    const mst_sched_entry early[2] = {{1, 0, 0}, {0, 0, 0}}; /* backward before forward */
    CHECK_STATUS(mst_schedule_sets(early, 2, 1, set_of, &n_sets), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "out of order") != NULL, "sets, backward first: '%s'", mst_last_error());
    const mst_sched_entry stray[2] = {{0, 0, 0}, {1, 0, 4}}; /* microbatch past M */
    CHECK_STATUS(mst_schedule_sets(stray, 2, 1, set_of, &n_sets), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "microbatch 4") != NULL, "sets, microbatch 4 of 1: '%s'", mst_last_error());
    CHECK_STATUS(mst_schedule_sets(early + 1, 1, 1, set_of, &n_sets), MST_ERR_INVALID); /* no backward */
    mst_schedule_config ok = {sizeof(mst_schedule_config), MST_SCHEDULE_1F1B, 2, 0, 4, 1};
    CHECK_STATUS(mst_schedule_make(&ok, e, 7), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "n_out = 7") != NULL, "message does not name n_out: %s", mst_last_error());
    mst_schedule_kind k;
    CHECK_OK(mst_schedule_kind_parse("interleaved", &k));
    CHECK(k == MST_SCHEDULE_INTERLEAVED, "parse interleaved");
    CHECK_STATUS(mst_schedule_kind_parse("zigzag", &k), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "zigzag") != NULL, "message names the value: %s", mst_last_error());
}

static void recompute_plans(void) {
    mst_recompute_config c = MST_RECOMPUTE_CONFIG_INIT;
    int32_t cs[6];
    CHECK_OK(mst_recompute_parse("uniform:2", &c));
    CHECK_OK(mst_recompute_plan(&c, 5, cs));
    const int32_t want_u[5] = {0, 0, 2, 2, 4};
    CHECK(memcmp(cs, want_u, sizeof want_u) == 0, "uniform:2 plan");
    CHECK_OK(mst_recompute_parse("block:2", &c));
    CHECK_OK(mst_recompute_plan(&c, 5, cs));
    const int32_t want_b[5] = {0, 1, -1, -1, -1};
    CHECK(memcmp(cs, want_b, sizeof want_b) == 0, "block:2 plan");
    CHECK_OK(mst_recompute_parse("none", &c));
    CHECK_OK(mst_recompute_plan(&c, 3, cs));
    const int32_t want_n[3] = {-1, -1, -1};
    CHECK(memcmp(cs, want_n, sizeof want_n) == 0, "none plan");
    const char* bad[] = {"selective:1", "uniform", "uniform:", "uniform:0", "block:x", "block:2x", "unifor:2"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_STATUS(mst_recompute_parse(bad[i], &c), MST_ERR_INVALID);
        CHECK(strstr(mst_last_error(), bad[i]) != NULL, "message does not name '%s': %s", bad[i],
              mst_last_error());
    }
    c = (mst_recompute_config){sizeof(mst_recompute_config), MST_RECOMPUTE_BLOCK, 6};
    CHECK_STATUS(mst_recompute_plan(&c, 5, cs), MST_ERR_INVALID); /* more layers than the stage has */
}

static void run(mst_ctx_t* ctx) {
    (void)ctx;
    known_orders();
    properties();
    bad_schedules();
    recompute_plans();
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
