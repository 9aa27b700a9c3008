/*
 * args.c — the argument parser of every subcommand (see args.h).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "args.h"

void mst_args_init(mst_args* a, const char* cmd, int argc, char** argv) {
    memset(a, 0, sizeof *a);
    a->cmd = cmd;
    a->argc = argc;
    a->argv = argv;
}

int mst_args_next(mst_args* a) {
    if (a->next >= a->argc) return 0;
    a->arg = a->argv[a->next++];
    const char* eq = strncmp(a->arg, "--", 2) == 0 ? strchr(a->arg, '=') : NULL;
    size_t n = eq ? (size_t)(eq - a->arg) : strlen(a->arg);
    if (n >= sizeof a->flag) n = sizeof a->flag - 1; /* too long for any flag: unknown */
    memcpy(a->flag, a->arg, n);
    a->flag[n] = 0;
    a->inline_value = eq ? eq + 1 : NULL;
    a->value = NULL;
    return 1;
}

int mst_args_is(const mst_args* a, const char* name) { return strcmp(a->flag, name) == 0; }

int mst_cli_bad(const char* cmd, const char* flag, const char* value, const char* why) {
    fprintf(stderr, "%s: %s '%s': %s\n", cmd, flag, value ? value : "", why);
    return 2;
}

int mst_args_bad(const mst_args* a, const char* value, const char* why) {
    return mst_cli_bad(a->cmd, a->flag, value, why);
}

const char* mst_args_peek(const mst_args* a) {
    if (a->inline_value) return a->inline_value;
    return a->next < a->argc && a->argv[a->next][0] != '-' ? a->argv[a->next] : NULL;
}

int mst_args_unknown(const mst_args* a) {
    if (strncmp(a->arg, "-", 1) != 0) {
        fprintf(stderr, "%s: '%s': not a flag (see %s --help)\n", a->cmd, a->arg, a->cmd);
        return 2;
    }
    const char* v = mst_args_peek(a);
    char why[160];
    snprintf(why, sizeof why, "unknown flag (see %s --help)", a->cmd);
    if (v) return mst_args_bad(a, v, why);
    fprintf(stderr, "%s: %s: %s\n", a->cmd, a->flag, why);
    return 2;
}

int mst_args_switch(const mst_args* a, int* out) {
    if (a->inline_value) return mst_args_bad(a, a->inline_value, "takes no value");
    *out = 1;
    return 0;
}

/* The raw value: after '=' or the next argument (consumed); NULL if none. */
static const char* raw_value(mst_args* a) {
    if (a->inline_value) return a->value = a->inline_value;
    if (a->next >= a->argc) return NULL;
    return a->value = a->argv[a->next++];
}

int mst_args_str(mst_args* a, const char** out) {
    const char* v = raw_value(a);
    if (!v) return mst_args_bad(a, "", "missing value");
    if (!*v) return mst_args_bad(a, v, "empty value");
    *out = v;
    return 0;
}

int mst_args_int(mst_args* a, int64_t lo, int64_t hi, int64_t* out) {
    const char* v = NULL;
    int rc = mst_args_str(a, &v);
    if (rc) return rc;
    char* end = NULL;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (*end || errno) return mst_args_bad(a, v, "expected an integer");
    if (x < lo || x > hi) {
        char why[96];
        snprintf(why, sizeof why, "expected %lld .. %lld", (long long)lo, (long long)hi);
        return mst_args_bad(a, v, why);
    }
    *out = x;
    return 0;
}

int mst_args_int32(mst_args* a, int32_t lo, int32_t hi, int32_t* out) {
    int64_t x = 0;
    int rc = mst_args_int(a, lo, hi, &x);
    if (rc == 0) *out = (int32_t)x;
    return rc;
}

int mst_args_float(mst_args* a, double lo, double hi, float* out) {
    const char* v = NULL;
    int rc = mst_args_str(a, &v);
    if (rc) return rc;
    char* end = NULL;
    errno = 0;
    double x = strtod(v, &end);
    if (*end || errno || !isfinite(x)) return mst_args_bad(a, v, "expected a number");
    if (x < lo || x > hi) {
        char why[96];
        snprintf(why, sizeof why, "expected %g .. %g", lo, hi);
        return mst_args_bad(a, v, why);
    }
    *out = (float)x;
    return 0;
}

int mst_args_choice(mst_args* a, const char* const* words, int* out) {
    const char* v = NULL;
    int rc = mst_args_str(a, &v);
    if (rc) return rc;
    char why[256] = "expected";
    for (int i = 0; words[i]; i++) {
        if (strcmp(v, words[i]) == 0) return (*out = i, 0);
        size_t n = strlen(why);
        snprintf(why + n, sizeof why - n, "%s %s", i ? (words[i + 1] ? "," : " or") : "", words[i]);
    }
    return mst_args_bad(a, v, why);
}

/* "WHAT: <the system's reason>" for the errno just set. */
static int bad_errno(const mst_args* a, const char* v, const char* what) {
    char why[256];
    snprintf(why, sizeof why, "%s: %s", what, strerror(errno));
    return mst_args_bad(a, v, why);
}

static const char* kind_of(mode_t m) {
    return S_ISDIR(m) ? "a directory" : S_ISFIFO(m) ? "a FIFO" : S_ISSOCK(m) ? "a socket"
           : S_ISCHR(m) || S_ISBLK(m) ? "a device" : "not a regular file";
}

int mst_args_out_file(mst_args* a, const char** out) {
    const char* v = NULL;
    int rc = mst_args_str(a, &v);
    if (rc) return rc;
    char why[256];
    struct stat st;
    if (stat(v, &st) == 0) {
        if (!S_ISREG(st.st_mode)) {
            snprintf(why, sizeof why, "cannot write a file there: it is %s", kind_of(st.st_mode));
            return mst_args_bad(a, v, why);
        }
        FILE* f = fopen(v, "r+"); /* writable, and left as it is */
        if (!f) return bad_errno(a, v, "cannot write");
        fclose(f);
    } else {
        FILE* f = fopen(v, "w");
        if (!f) return bad_errno(a, v, "cannot create");
        fclose(f);
        remove(v);
    }
    *out = v;
    return 0;
}

int mst_args_in_file(mst_args* a, const char** out) {
    const char* v = NULL;
    int rc = mst_args_str(a, &v);
    if (rc) return rc;
    char why[256];
    struct stat st;
    if (stat(v, &st) != 0) return bad_errno(a, v, "cannot read");
    if (!S_ISREG(st.st_mode)) {
        snprintf(why, sizeof why, "cannot read: it is %s, not a file", kind_of(st.st_mode));
        return mst_args_bad(a, v, why);
    }
    FILE* f = fopen(v, "rb");
    if (!f) return bad_errno(a, v, "cannot read");
    fclose(f);
    *out = v;
    return 0;
}

FILE* mst_out_open(const char* cmd, const char* path) {
    FILE* f = fopen(path, "w");
    if (!f) fprintf(stderr, "%s: --json '%s': cannot write: %s\n", cmd, path, strerror(errno));
    return f;
}

int mst_out_close(const char* cmd, const char* path, FILE* f) {
    int failed = ferror(f);
    errno = 0;
    if (fclose(f) != 0 || failed) {
        fprintf(stderr, "%s: --json '%s': write failed: %s\n", cmd, path, errno ? strerror(errno) : "I/O error");
        return 1;
    }
    return 0;
}

mst_backend_kind mst_default_backend(void) {
    return mst_backend_available(MST_BACKEND_CUDA) ? MST_BACKEND_CUDA : MST_BACKEND_CPU;
}

const char* mst_backend_unavailable_why(mst_backend_kind kind) {
    static char why[512];
    if (mst_backend_available(kind)) return "";
#ifndef MST_HAVE_CUDA
    if (kind == MST_BACKEND_CUDA) return "not built in (configured without nvcc, or with -DMST_CUDA=OFF)";
#endif
    mst_ctx_t* ctx = NULL;
    if (mst_ctx_create(kind, 0, &ctx) == MST_OK) { /* appeared since the check */
        mst_ctx_destroy(ctx);
        return "";
    }
    snprintf(why, sizeof why, "%s", mst_last_error());
    return why;
}

int mst_args_backend(mst_args* a, mst_backend_kind* out) {
    static const char* const names[] = {"cpu", "cuda", NULL};
    int i = 0;
    int rc = mst_args_choice(a, names, &i);
    if (rc) return rc;
    *out = i ? MST_BACKEND_CUDA : MST_BACKEND_CPU;
    const char* why = mst_backend_unavailable_why(*out);
    if (*why) {
        char line[600];
        snprintf(line, sizeof line, "not available: %s", why);
        return mst_args_bad(a, names[i], line);
    }
    return 0;
}

const char* mst_args_find(int argc, char** argv, const char* name) {
    size_t n = strlen(name);
    for (int i = 0; i < argc; i++) {
        if (strncmp(argv[i], name, n) != 0) continue;
        if (argv[i][n] == '=') return argv[i] + n + 1;
        if (argv[i][n] == 0 && i + 1 < argc) return argv[i + 1];
    }
    return NULL;
}

int mst_args_help(int argc, char** argv) {
    for (int i = 0; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) return 1;
    return 0;
}
