/*
 * test_plot.c — the SVG charts (src/trainer/io/plot.h): a line chart and a
 * stacked-area chart are well-formed XML (every tag closed in order, checked
 * here by a small reader of its own, and by Python's xml.etree when python3
 * is on the PATH), hold one path / polygon per series with its name, put
 * the largest value at the top of the frame, and refuse empty series.
 */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "trainer/io/plot.h"

static char* slurp(const char* path) {
    FILE* f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char* b = (char*)malloc((size_t)n + 1);
    b[fread(b, 1, (size_t)n, f)] = 0;
    fclose(f);
    return b;
}

/* 1 when every element is closed in order (a stack of tag names). */
static int balanced(const char* s) {
    char stack[64][32];
    int depth = 0, seen_root = 0;
    for (const char* c = strchr(s, '<'); c; c = strchr(c + 1, '<')) {
        if (c[1] == '?' || c[1] == '!') continue;
        const int closing = c[1] == '/';
        const char* name = c + 1 + closing;
        size_t len = strcspn(name, " \t\n/>");
        const char* gt = strchr(c, '>');
        if (!gt || len == 0 || len >= 32) return 0;
        if (closing) {
            if (depth == 0 || strncmp(stack[depth - 1], name, len) != 0 || stack[depth - 1][len]) return 0;
            depth--;
        } else if (gt[-1] != '/') {
            if (depth == 64 || (depth == 0 && seen_root)) return 0;
            memcpy(stack[depth], name, len);
            stack[depth++][len] = 0;
            seen_root = 1;
        }
    }
    return depth == 0 && seen_root;
}

static int count(const char* s, const char* what) {
    int n = 0;
    for (const char* c = strstr(s, what); c; c = strstr(c + 1, what)) n++;
    return n;
}

static void python_parses(const char* path, const char* tag, int n) {
    if (system("command -v python3 >/dev/null 2>&1") != 0) return;
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "python3 -c \"import sys, xml.etree.ElementTree as E; r = E.parse('%s').getroot(); "
             "n = len(r.findall('{http://www.w3.org/2000/svg}%s')); sys.exit(0 if n == %d else 1)\"",
             path, tag, n);
    CHECK(system(cmd) == 0, "python3 xml.etree: %s is not XML with %d <%s>", path, n, tag);
}

static void run(mst_ctx_t* ctx) {
    (void)ctx;
    char dir[128], path[160];
    if (!mst_test_tmpdir(dir, sizeof dir, "mst_plot")) {
        CHECK(0, "no temporary directory");
        return;
    }
    double x[50], a[50], b[50], c[50];
    for (int i = 0; i < 50; i++) {
        x[i] = i + 1;
        a[i] = 5.5 * exp(-i / 20.0);
        b[i] = i % 10 == 0 ? 4.0 - i / 25.0 : NAN; /* eval every 10 steps */
        c[i] = 1 + (i % 7);
    }
    mst_plot_series ls[] = {{"train <loss>", x, a, 50}, {"eval & loss", x, b, 50}};
    mst_plot lp = {"loss \"curves\"", "step", "loss (nats)", ls, 2, NULL, 0};
    snprintf(path, sizeof path, "%s/loss.svg", dir);
    CHECK_OK(mst_plot_lines(path, &lp));
    char* s = slurp(path);
    CHECK(s && balanced(s), "%s is not well-formed", path);
    CHECK(s && count(s, "<path data-series=") == 2, "line chart: %d paths", s ? count(s, "<path data-series=") : -1);
    CHECK(s && strstr(s, "train &lt;loss&gt;") && strstr(s, "eval &amp; loss"), "series names missing or unescaped");
    CHECK(s && count(s, " M") >= 6, "the eval series (NaN between points) is not drawn in pieces");
    python_parses(path, "path", 2);
    free(s);

    mst_plot_series st[] = {{"weights", x, c, 50}, {"saved", x, a, 50}, {"pages", x, c, 50}};
    mst_plot_mark mk[] = {{10, "F0"}, {30, "B0"}};
    mst_plot sp = {"memory", "time", "MiB", st, 3, mk, 2};
    snprintf(path, sizeof path, "%s/mem.svg", dir);
    CHECK_OK(mst_plot_stacked(path, &sp));
    s = slurp(path);
    CHECK(s && balanced(s), "%s is not well-formed", path);
    CHECK(s && count(s, "<polygon data-series=") == 3, "stacked chart: polygons");
    CHECK(s && strstr(s, ">F0<") && strstr(s, ">B0<"), "marks missing");
    python_parses(path, "polygon", 3);
    free(s);
    remove(path);
    snprintf(path, sizeof path, "%s/loss.svg", dir);
    remove(path);

    mst_plot_series bad[] = {{"a", x, a, 50}, {"b", x, a, 49}};
    mst_plot bp = {"t", "x", "y", bad, 2, NULL, 0};
    CHECK_STATUS(mst_plot_stacked("/tmp/never.svg", &bp), MST_ERR_INVALID);
    CHECK(strstr(mst_last_error(), "series 'b' has 49 points") != NULL, "message '%s'", mst_last_error());
    CHECK_STATUS(mst_plot_lines("/nonexistent/dir/x.svg", &lp), MST_ERR_IO);
    CHECK(strstr(mst_last_error(), "/nonexistent/dir/x.svg") != NULL, "message '%s'", mst_last_error());
    rmdir(dir);
}

int main(int argc, char** argv) { return mst_test_main(argc, argv, run); }
