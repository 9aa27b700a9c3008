/*
 * safetensors.h — one .safetensors file, read and written strictly
 * (https://github.com/huggingface/safetensors: an 8-byte little-endian
 * header length N, N bytes of JSON, then the tensors' bytes).
 *
 * Reading checks the whole header before any tensor is read: every entry's
 * dtype is known, its shape's byte count equals its data_offsets' extent,
 * and the entries, sorted by offset, tile the data exactly: the first
 * starts at 0, each starts where the one before ends (no gap, no overlap),
 * the last ends at the end of the file (a shorter file is truncated, a
 * longer one has trailing bytes). No name twice. Each failure is
 * MST_ERR_INVALID naming the file, the tensor and the offsets.
 *
 * Written files carry in __metadata__ "fnv1a": the FNV-1a (mst_fnv1a) of the
 * tensors' bytes folded tensor by tensor in file order; a file that has it
 * is checked against it by mst_st_verify. Files are fsync'ed before close.
 */
#ifndef MST_SAFETENSORS_H
#define MST_SAFETENSORS_H

#include <stdio.h>

#include "lib/internal.h"

typedef enum mst_st_dtype {
    MST_ST_F32 = 0, MST_ST_BF16, MST_ST_F16, MST_ST_I32, MST_ST_F64, MST_ST_I64, MST_ST_I16, MST_ST_I8, MST_ST_U8,
    MST_ST_BOOL, MST_ST_N_DTYPES
} mst_st_dtype;
const char* mst_st_dtype_str(mst_st_dtype d); /* "F32", "BF16", ... */
size_t mst_st_dtype_bytes(mst_st_dtype d);

enum { MST_ST_MAX_DIMS = 4, MST_ST_NAME = 160 };

typedef struct mst_st_entry {
    char name[MST_ST_NAME];
    mst_st_dtype dtype;
    int32_t nd;
    int64_t dims[MST_ST_MAX_DIMS];
    uint64_t begin, end;   /* data_offsets: bytes from the first data byte */
} mst_st_entry;

int64_t mst_st_numel(const mst_st_entry* e);

/* An open file's header (the file itself is opened for each read). */
typedef struct mst_st_file {
    char* path;            /* owned                                          */
    uint64_t data_at;      /* 8 + N: the file offset of data byte 0           */
    uint64_t data_bytes;   /* file size - data_at                            */
    mst_st_entry* e;       /* [n] sorted by name                              */
    int32_t n;
    int32_t has_hash;      /* __metadata__ had "fnv1a"                        */
    uint64_t fnv1a;
} mst_st_file;

/* Reads and checks path's header (above). */
mst_status mst_st_open(const char* path, mst_st_file* out);
void mst_st_close(mst_st_file* f);
/* The entry named name, or NULL. */
const mst_st_entry* mst_st_find(const mst_st_file* f, const char* name);
/* Entry e's elements converted into out: MST_ST_F32 (float [numel]) from
 * F32, BF16 or F16, MST_ST_BF16 (uint16_t [numel]: F32 and F16 rounded to
 * nearest even) from the same, or MST_ST_I32 from I32 only. */
mst_status mst_st_read(const mst_st_file* f, const mst_st_entry* e, mst_st_dtype to, void* out);
/* Reads the whole data section and checks it against "fnv1a" (a file
 * without one: MST_OK). */
mst_status mst_st_verify(const mst_st_file* f);

/* ---- writing ---- */
typedef struct mst_st_writer {
    FILE* f;
    char* path;            /* owned                                          */
    uint64_t hash;         /* over the tensors written so far                */
    long hash_at;          /* file offset of the 16 hex digits to patch       */
    uint64_t left;         /* data bytes still to come                       */
} mst_st_writer;

/* Creates path and writes its header: entries e [n] laid out in the given
 * order (their begin / end set here). Then each tensor's bytes in that
 * order with mst_st_write_data (one call per tensor), then
 * mst_st_write_end. On any failure the file is removed. */
mst_status mst_st_write_begin(mst_st_writer* w, const char* path, mst_st_entry* e, int32_t n);
mst_status mst_st_write_data(mst_st_writer* w, const void* p, size_t bytes);
/* Patches the hash in, flushes, fsyncs, closes. */
mst_status mst_st_write_end(mst_st_writer* w);
/* Closes and removes a file not finished (after a failure; safe twice). */
void mst_st_write_abort(mst_st_writer* w);

/* fsync of a directory (after renames into it). */
mst_status mst_fsync_dir(const char* dir);

#endif
