/*
 * plot.h — SVG pictures of a run, readable in any browser: line charts (loss
 * curves) and stacked-area charts (memory over one step by category, with
 * the microbatches' forward and backward marked). Plain SVG 1.1, no script,
 * no external resources; every series is one <path> (line) or <polygon>
 * (area) carrying its name in a <title> and a data-series attribute, so
 * tests can find them.
 */
#ifndef MST_PLOT_H
#define MST_PLOT_H

#include <stdint.h>

#include "moestash.h"

typedef struct mst_plot_series {
    const char* name;
    const double* x;    /* [n] (line charts; area charts share the chart's x) */
    const double* y;    /* [n]                                               */
    int64_t n;
} mst_plot_series;

typedef struct mst_plot_mark {
    double x;           /* where on the x axis                               */
    const char* label;  /* short text drawn at the top ("F0", "B1", ...)     */
} mst_plot_mark;

typedef struct mst_plot {
    const char* title;
    const char* x_label;
    const char* y_label;
    const mst_plot_series* series; /* [n_series]                           */
    int n_series;
    const mst_plot_mark* marks;    /* [n_marks] vertical lines (optional)   */
    int n_marks;
} mst_plot;

/* Line chart of every series (points with non-finite y are skipped). */
mst_status mst_plot_lines(const char* path, const mst_plot* p);
/* Stacked areas: series k drawn on top of series 0 .. k-1; every series
 * has the same n and the same x (taken from series[0].x). */
mst_status mst_plot_stacked(const char* path, const mst_plot* p);

#endif
