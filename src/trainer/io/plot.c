/*
 * plot.c — the SVG charts of plot.h: a frame with ticks at round values, the
 * series, a legend; axes scaled to the data (area charts from zero).
 */
#include "plot.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "lib/internal.h"

enum { W = 1000, HGT = 520, L = 80, R = 300, TOP = 50, BOT = 60 }; /* canvas and margins, px */

static const char* const colors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b",
                                     "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939",
                                     "#8c6d31", "#843c39", "#7b4173", "#3182bd"};
#define N_COLORS (int)(sizeof colors / sizeof colors[0])

typedef struct frame {
    double x0, x1, y0, y1; /* data range shown */
} frame;

static double px(const frame* f, double x) { return L + (x - f->x0) / (f->x1 - f->x0) * (W - L - R); }
static double py(const frame* f, double y) { return HGT - BOT - (y - f->y0) / (f->y1 - f->y0) * (HGT - TOP - BOT); }

/* Text with &, <, > and quotes escaped. */
static void text(FILE* f, const char* s) {
    for (; s && *s; s++) {
        switch (*s) {
        case '&': fputs("&amp;", f); break;
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '"': fputs("&quot;", f); break;
        default: fputc(*s, f);
        }
    }
}

/* A round tick step giving about 6 ticks over [lo, hi]. */
static double tick_step(double lo, double hi) {
    const double raw = (hi - lo) / 6, mag = pow(10, floor(log10(raw))), r = raw / mag;
    return mag * (r < 1.5 ? 1 : r < 3.5 ? 2 : r < 7.5 ? 5 : 10);
}

static void axes(FILE* f, const frame* fr, const mst_plot* p) {
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#333\"/>\n", L, TOP, W - L - R,
            HGT - TOP - BOT);
    const double sx = tick_step(fr->x0, fr->x1), sy = tick_step(fr->y0, fr->y1);
    for (double x = ceil(fr->x0 / sx) * sx; x <= fr->x1 + 1e-9 * sx; x += sx)
        fprintf(f, "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#ddd\"/><text x=\"%.1f\" y=\"%d\" "
                   "font-size=\"12\" text-anchor=\"middle\">%g</text>\n",
                px(fr, x), TOP, px(fr, x), HGT - BOT, px(fr, x), HGT - BOT + 16, x);
    for (double y = ceil(fr->y0 / sy) * sy; y <= fr->y1 + 1e-9 * sy; y += sy)
        fprintf(f, "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#ddd\"/><text x=\"%d\" y=\"%.1f\" "
                   "font-size=\"12\" text-anchor=\"end\">%g</text>\n",
                L, py(fr, y), W - R, py(fr, y), L - 6, py(fr, y) + 4, y);
    fprintf(f, "<text x=\"%d\" y=\"28\" font-size=\"16\" font-weight=\"bold\">", L);
    text(f, p->title);
    fprintf(f, "</text>\n<text x=\"%d\" y=\"%d\" font-size=\"13\" text-anchor=\"middle\">", (L + W - R) / 2, HGT - 18);
    text(f, p->x_label);
    fprintf(f, "</text>\n<text x=\"18\" y=\"%d\" font-size=\"13\" text-anchor=\"middle\" transform=\"rotate(-90 18 %d)\">",
            (TOP + HGT - BOT) / 2, (TOP + HGT - BOT) / 2);
    text(f, p->y_label);
    fprintf(f, "</text>\n");
    for (int i = 0; i < p->n_marks; i++) {
        const double x = px(fr, p->marks[i].x);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#999\" stroke-dasharray=\"3,3\"/>"
                   "<text x=\"%.1f\" y=\"%d\" font-size=\"10\" text-anchor=\"middle\">",
                x, TOP, x, HGT - BOT, x, TOP - 4);
        text(f, p->marks[i].label);
        fprintf(f, "</text>\n");
    }
}

static void legend(FILE* f, const mst_plot* p, int reverse) {
    for (int i = 0; i < p->n_series; i++) {
        const int k = reverse ? p->n_series - 1 - i : i;
        const int y = TOP + 8 + 20 * i;
        fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"14\" height=\"10\" fill=\"%s\"/><text x=\"%d\" y=\"%d\" font-size=\"12\">",
                W - R + 12, y, colors[k % N_COLORS], W - R + 32, y + 10);
        text(f, p->series[k].name);
        fprintf(f, "</text>\n");
    }
}

static FILE* begin(const char* path) {
    FILE* f = fopen(path, "w");
    if (!f) return NULL;
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" "
               "width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" font-family=\"sans-serif\">\n"
               "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
            W, HGT, W, HGT);
    return f;
}

static mst_status end(FILE* f, const char* path) {
    fprintf(f, "</svg>\n");
    int bad = ferror(f);
    bad |= fclose(f) != 0;
    return bad ? mst_set_error(MST_ERR_IO, "'%s': write failed", path) : MST_OK;
}

static mst_status check(const char* path, const mst_plot* p, int stacked) {
    if (!path || !p || p->n_series < 1 || !p->series)
        return mst_set_error(MST_ERR_INVALID, "plot '%s': no series", path ? path : "(null)");
    for (int k = 0; k < p->n_series; k++) {
        const mst_plot_series* s = &p->series[k];
        if (s->n < 1 || !s->y || (!s->x && !stacked) || (stacked && s->n != p->series[0].n))
            return mst_set_error(MST_ERR_INVALID, "plot '%s': series '%s' has %lld points", path, s->name ? s->name : "?",
                                 (long long)s->n);
    }
    if (stacked && !p->series[0].x) return mst_set_error(MST_ERR_INVALID, "plot '%s': no x values", path);
    return MST_OK;
}

/* Widens a degenerate range. */
static void pad(double* lo, double* hi) {
    if (!(*hi > *lo)) *hi = *lo + (fabs(*lo) > 0 ? fabs(*lo) * 0.1 : 1);
}

mst_status mst_plot_lines(const char* path, const mst_plot* p) {
    MST_TRY(check(path, p, 0));
    frame fr = {INFINITY, -INFINITY, INFINITY, -INFINITY};
    for (int k = 0; k < p->n_series; k++)
        for (int64_t i = 0; i < p->series[k].n; i++) {
            const double x = p->series[k].x[i], y = p->series[k].y[i];
            if (!isfinite(x) || !isfinite(y)) continue;
            fr.x0 = fmin(fr.x0, x), fr.x1 = fmax(fr.x1, x), fr.y0 = fmin(fr.y0, y), fr.y1 = fmax(fr.y1, y);
        }
    if (!isfinite(fr.x0)) fr = (frame){0, 1, 0, 1};
    pad(&fr.x0, &fr.x1);
    pad(&fr.y0, &fr.y1);
    const double m = (fr.y1 - fr.y0) * 0.05;
    fr.y0 -= m, fr.y1 += m;
    FILE* f = begin(path);
    if (!f) return mst_set_error(MST_ERR_IO, "'%s': %s", path, strerror(errno));
    axes(f, &fr, p);
    for (int k = 0; k < p->n_series; k++) {
        const mst_plot_series* s = &p->series[k];
        fprintf(f, "<path data-series=\"");
        text(f, s->name);
        fprintf(f, "\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.8\" d=\"", colors[k % N_COLORS]);
        int pen = 0;
        for (int64_t i = 0; i < s->n; i++) {
            if (!isfinite(s->x[i]) || !isfinite(s->y[i])) {
                pen = 0;
                continue;
            }
            fprintf(f, "%s%.1f,%.1f", pen ? " L" : " M", px(&fr, s->x[i]), py(&fr, s->y[i]));
            pen = 1;
        }
        fprintf(f, "\"><title>");
        text(f, s->name);
        fprintf(f, "</title></path>\n");
        for (int64_t i = 0; i < s->n; i++) /* a point with no drawn neighbour: a dot */
            if (isfinite(s->x[i]) && isfinite(s->y[i]) && (i == 0 || !isfinite(s->y[i - 1])) &&
                (i + 1 == s->n || !isfinite(s->y[i + 1])))
                fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" fill=\"%s\"/>\n", px(&fr, s->x[i]),
                        py(&fr, s->y[i]), colors[k % N_COLORS]);
    }
    legend(f, p, 0);
    return end(f, path);
}

mst_status mst_plot_stacked(const char* path, const mst_plot* p) {
    MST_TRY(check(path, p, 1));
    const int64_t n = p->series[0].n;
    const double* x = p->series[0].x;
    double* top = (double*)calloc((size_t)n, sizeof(double));
    double* base = (double*)calloc((size_t)n, sizeof(double));
    if (!top || !base) {
        free(top), free(base);
        return mst_set_error(MST_ERR_OOM, "plot '%s'", path);
    }
    frame fr = {x[0], x[n - 1], 0, 0};
    for (int64_t i = 0; i < n; i++) {
        double s = 0;
        for (int k = 0; k < p->n_series; k++) s += fmax(0, p->series[k].y[i]);
        fr.y1 = fmax(fr.y1, s * 1.05);
    }
    pad(&fr.x0, &fr.x1);
    pad(&fr.y0, &fr.y1);
    FILE* f = begin(path);
    if (!f) {
        free(top), free(base);
        return mst_set_error(MST_ERR_IO, "'%s': %s", path, strerror(errno));
    }
    axes(f, &fr, p);
    for (int k = 0; k < p->n_series; k++) {
        const mst_plot_series* s = &p->series[k];
        for (int64_t i = 0; i < n; i++) top[i] = base[i] + fmax(0, s->y[i]);
        fprintf(f, "<polygon data-series=\"");
        text(f, s->name);
        fprintf(f, "\" fill=\"%s\" fill-opacity=\"0.85\" stroke=\"none\" points=\"", colors[k % N_COLORS]);
        for (int64_t i = 0; i < n; i++) fprintf(f, "%.1f,%.1f ", px(&fr, x[i]), py(&fr, top[i]));
        for (int64_t i = n - 1; i >= 0; i--) fprintf(f, "%.1f,%.1f ", px(&fr, x[i]), py(&fr, base[i]));
        fprintf(f, "\"><title>");
        text(f, s->name);
        fprintf(f, "</title></polygon>\n");
        memcpy(base, top, sizeof(double) * (size_t)n);
    }
    legend(f, p, 1);
    free(top), free(base);
    return end(f, path);
}
