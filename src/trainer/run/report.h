/*
 * report.h — what the trainer writes about a run beside the loop
 * (trainer.c): the memory table (report.c), the --timeline pictures
 * (timeline.c), the JSON document (report_json.c), and the bit-identity
 * comparisons (compare.c).
 */
#ifndef MST_REPORT_H
#define MST_REPORT_H

#include "trainer.h"

/* The run's memory table into res->mem (this rank's; res->mem_max the max
 * over W ranks), its peak rows and weights hash. After the last step. */
mst_status mst_train_memory_table(mst_model* m, mst_train_result* res);
/* --timeline: one more step's passes with the pages read after every entry,
 * drawn into cfg->timeline_path (and KEEP's into its -keep.svg). */
mst_status mst_train_timeline(mst_model* m, const mst_train_config* cfg, const mst_train_result* res);
/* P > 1 stages (report_stages.c): each stage's table (its data-parallel
 * rank 0's) into res->stage_mem [P] on every rank; the one-line-a-stage
 * summary; the JSON "stages" array. */
mst_status mst_train_stage_tables(mst_model* m, mst_train_result* res);
void mst_train_json_stages(FILE* f, const mst_train_result* r);
/* P > 1: stage s's backend peak, the max over its ranks (res->grid_peak). */
size_t mst_train_stage_peak(const mst_train_result* r, int32_t s);
/* "  \"name\": [v...],\n" of the steps [first, n] (1-based); null where not finite. */
void mst_train_json_array(FILE* f, const char* name, const double* v, int64_t first, int64_t n);

#endif
