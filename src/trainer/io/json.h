/*
 * json.h — a small JSON reader (and a string writer) for the files the trainer reads back (its
 * checkpoints' trainer.json and safetensors headers): the text is split into
 * tokens in one pass, each value knowing its extent, so a lookup walks the
 * token array without building a tree. Strings are returned raw (no escape
 * decoding): the files read here hold names and numbers only.
 */
#ifndef MST_JSON_H
#define MST_JSON_H

#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

typedef enum mst_json_kind { MST_JSON_OBJECT, MST_JSON_ARRAY, MST_JSON_STRING, MST_JSON_PRIMITIVE } mst_json_kind;

typedef struct mst_json_tok {
    mst_json_kind kind;
    int32_t start, end;  /* byte range in the text (strings: without quotes)   */
    int32_t n_children;  /* object: keys + values; array: items                */
    int32_t next;        /* index of the token after this value and its children */
} mst_json_tok;

typedef struct mst_json {
    const char* text;    /* [n_text] not owned                                 */
    int32_t n_text;
    mst_json_tok* tok;   /* [n_tok] owned                                      */
    int32_t n_tok;
} mst_json;

/* Tokenizes text [n]; 0 on success, else -1 with *err_at the byte offset of
 * the first error. Free with mst_json_free. */
int mst_json_parse(const char* text, size_t n, mst_json* out, size_t* err_at);
void mst_json_free(mst_json* j);

/* The value of key `key` in the object at token `obj`, or -1. */
int32_t mst_json_get(const mst_json* j, int32_t obj, const char* key);
/* Token t's text equals s. */
int mst_json_eq(const mst_json* j, int32_t t, const char* s);
/* Copies token t's text into buf [cap] (NUL-terminated); -1 if it does not fit. */
int mst_json_str(const mst_json* j, int32_t t, char* buf, size_t cap);
/* A primitive token as a number: 0 on success (the whole token parsed). */
int mst_json_i64(const mst_json* j, int32_t t, int64_t* out);
int mst_json_f64(const mst_json* j, int32_t t, double* out);

/* Writes s as a JSON string: quotes, backslashes and control bytes escaped. */
void mst_json_write_string(FILE* f, const char* s);

#endif
