/*
 * json.c — the JSON tokenizer of json.h: one recursive pass over the text,
 * each value appended as a token before its children, its `next` set once
 * the children are read.
 */
#include "json.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

typedef struct parser {
    const char* s;
    int32_t n, at;
    mst_json_tok* tok;
    int32_t n_tok, cap;
    int depth;
} parser;

enum { MAX_DEPTH = 64 };

static void skip_ws(parser* p) {
    while (p->at < p->n && strchr(" \t\r\n", p->s[p->at]) && p->s[p->at]) p->at++;
}

static int32_t push(parser* p, mst_json_kind kind, int32_t start) {
    if (p->n_tok == p->cap) {
        int32_t cap = p->cap ? 2 * p->cap : 64;
        mst_json_tok* t = (mst_json_tok*)realloc(p->tok, sizeof *t * (size_t)cap);
        if (!t) return -1;
        p->tok = t, p->cap = cap;
    }
    p->tok[p->n_tok] = (mst_json_tok){kind, start, start, 0, 0};
    return p->n_tok++;
}

static int value(parser* p);

static int string(parser* p) {
    const int32_t t = push(p, MST_JSON_STRING, ++p->at);
    if (t < 0) return -1;
    while (p->at < p->n && p->s[p->at] != '"') {
        if ((unsigned char)p->s[p->at] < 0x20) return -1;
        p->at += p->s[p->at] == '\\' ? 2 : 1;
    }
    if (p->at >= p->n) return -1;
    p->tok[t].end = p->at++;
    p->tok[t].next = p->n_tok;
    return 0;
}

static int primitive(parser* p) {
    const int32_t t = push(p, MST_JSON_PRIMITIVE, p->at);
    if (t < 0) return -1;
    while (p->at < p->n && strchr("+-.0123456789eEtruefalsn", p->s[p->at]) && p->s[p->at]) p->at++;
    if (p->at == p->tok[t].start) return -1;
    p->tok[t].end = p->at;
    p->tok[t].next = p->n_tok;
    return 0;
}

/* An object or array: items separated by commas; object items are
 * "key": value pairs (both counted as children). */
static int container(parser* p, int object) {
    if (++p->depth > MAX_DEPTH) return -1;
    const int32_t t = push(p, object ? MST_JSON_OBJECT : MST_JSON_ARRAY, p->at++);
    if (t < 0) return -1;
    const char close = object ? '}' : ']';
    skip_ws(p);
    int first = 1;
    while (p->at < p->n && p->s[p->at] != close) {
        if (!first) {
            if (p->s[p->at] != ',') return -1;
            p->at++;
            skip_ws(p);
        }
        first = 0;
        if (object) {
            if (p->at >= p->n || p->s[p->at] != '"' || string(p)) return -1;
            p->tok[t].n_children++;
            skip_ws(p);
            if (p->at >= p->n || p->s[p->at] != ':') return -1;
            p->at++;
        }
        if (value(p)) return -1;
        p->tok[t].n_children++;
        skip_ws(p);
    }
    if (p->at >= p->n) return -1;
    p->tok[t].end = ++p->at;
    p->tok[t].next = p->n_tok;
    p->depth--;
    return 0;
}

static int value(parser* p) {
    skip_ws(p);
    if (p->at >= p->n) return -1;
    const char c = p->s[p->at];
    if (c == '{' || c == '[') return container(p, c == '{');
    if (c == '"') return string(p);
    return primitive(p);
}

int mst_json_parse(const char* text, size_t n, mst_json* out, size_t* err_at) {
    parser p = {text, (int32_t)n, 0, NULL, 0, 0, 0};
    memset(out, 0, sizeof *out);
    int bad = n > (size_t)INT32_MAX - 1 || value(&p);
    if (!bad) {
        skip_ws(&p);
        bad = p.at != p.n;
    }
    if (bad) {
        free(p.tok);
        if (err_at) *err_at = (size_t)p.at;
        return -1;
    }
    *out = (mst_json){text, (int32_t)n, p.tok, p.n_tok};
    return 0;
}

void mst_json_free(mst_json* j) {
    free(j->tok);
    memset(j, 0, sizeof *j);
}

int mst_json_eq(const mst_json* j, int32_t t, const char* s) {
    const mst_json_tok* k = &j->tok[t];
    const size_t len = (size_t)(k->end - k->start);
    return strlen(s) == len && memcmp(j->text + k->start, s, len) == 0;
}

int32_t mst_json_get(const mst_json* j, int32_t obj, const char* key) {
    if (obj < 0 || obj >= j->n_tok || j->tok[obj].kind != MST_JSON_OBJECT) return -1;
    for (int32_t t = obj + 1; t < j->tok[obj].next; t = j->tok[t + 1].next)
        if (mst_json_eq(j, t, key)) return t + 1;
    return -1;
}

int mst_json_str(const mst_json* j, int32_t t, char* buf, size_t cap) {
    if (t < 0) return -1;
    const size_t len = (size_t)(j->tok[t].end - j->tok[t].start);
    if (len + 1 > cap) return -1;
    memcpy(buf, j->text + j->tok[t].start, len);
    buf[len] = 0;
    return 0;
}

int mst_json_i64(const mst_json* j, int32_t t, int64_t* out) {
    char buf[32], *end;
    if (t < 0 || j->tok[t].kind != MST_JSON_PRIMITIVE || mst_json_str(j, t, buf, sizeof buf)) return -1;
    errno = 0;
    long long v = strtoll(buf, &end, 10);
    if (errno || *end) return -1;
    *out = v;
    return 0;
}

int mst_json_f64(const mst_json* j, int32_t t, double* out) {
    char buf[64], *end;
    if (t < 0 || j->tok[t].kind != MST_JSON_PRIMITIVE || mst_json_str(j, t, buf, sizeof buf)) return -1;
    errno = 0;
    double v = strtod(buf, &end);
    if (errno || *end) return -1;
    *out = v;
    return 0;
}

void mst_json_write_string(FILE* f, const char* s) {
    fputc('"', f);
    for (const unsigned char* p = (const unsigned char*)s; *p; p++) {
        if (*p == '"' || *p == '\\') fprintf(f, "\\%c", *p);
        else if (*p < 0x20) fprintf(f, "\\u%04x", *p);
        else fputc(*p, f);
    }
    fputc('"', f);
}
