/*
 * args.h — the argument parser every subcommand of `moestash` uses: flags as
 * `--flag value` or `--flag=value`, switches without a value, and bad input
 * answered with exit code 2 and one line on stderr naming the flag and its
 * value ("moestash train: --steps 'x': expected an integer"), before any work.
 *
 *   mst_args a;
 *   mst_args_init(&a, "moestash bench gemm", argc, argv);
 *   while (mst_args_next(&a)) {
 *       int rc;
 *       if (mst_args_is(&a, "--reps")) rc = mst_args_int(&a, 1, 100000, &reps);
 *       else if (mst_args_is(&a, "--json")) rc = mst_args_out_file(&a, &json);
 *       else rc = mst_args_unknown(&a);
 *       if (rc) return rc;
 *   }
 * Every mst_args_* that returns int returns 0 or 2 (the line printed).
 */
#ifndef MST_CLI_ARGS_H
#define MST_CLI_ARGS_H

#include <stdint.h>
#include <stdio.h>

#include "moestash.h"

typedef struct mst_args {
    const char* cmd;     /* "moestash train": starts every error line        */
    int argc;
    char** argv;
    int next;            /* index of the next argument                       */
    const char* arg;     /* the current argument as given                    */
    char flag[64];       /* its flag name ("--steps", without "=value")      */
    const char* inline_value; /* the value after '=', or NULL               */
    const char* value;   /* the current flag's value once read, or NULL      */
} mst_args;

void mst_args_init(mst_args* a, const char* cmd, int argc, char** argv);
/* Moves to the next argument; 0 when there is none. */
int mst_args_next(mst_args* a);
/* Is the current argument flag `name` (as `name` or `name=value`)? */
int mst_args_is(const mst_args* a, const char* name);

/* Prints "CMD: FLAG 'VALUE': WHY" on stderr; returns 2. mst_cli_bad is the
 * same line for a check made after parsing (between flags). */
int mst_args_bad(const mst_args* a, const char* value, const char* why);
int mst_cli_bad(const char* cmd, const char* flag, const char* value, const char* why);
/* The current flag's value as given, without reading it: after '=', else
 * the next argument unless that is a flag; NULL when it has none. */
const char* mst_args_peek(const mst_args* a);
/* The current argument is not one of this command's flags. */
int mst_args_unknown(const mst_args* a);

/* A switch: sets *out = 1; a value given with '=' is an error. */
int mst_args_switch(const mst_args* a, int* out);
/* The flag's value (after '=' or the next argument), not empty. */
int mst_args_str(mst_args* a, const char** out);
int mst_args_int(mst_args* a, int64_t lo, int64_t hi, int64_t* out);
int mst_args_int32(mst_args* a, int32_t lo, int32_t hi, int32_t* out);
int mst_args_float(mst_args* a, double lo, double hi, float* out);
/* One word of `words` (NULL-terminated); *out is its index. */
int mst_args_choice(mst_args* a, const char* const* words, int* out);
/* A file the command will write: refused up front when it cannot be
 * created or written (a directory, a missing folder, no permission), with
 * the system's reason. The check leaves an existing file as it was. */
int mst_args_out_file(mst_args* a, const char** out);
/* A file the command will read: a regular file that opens for reading
 * (not a directory, FIFO or device), with the system's reason otherwise. */
int mst_args_in_file(mst_args* a, const char** out);
/* --backend cpu|cuda: a backend that is built in and has a device; the
 * line says why not otherwise. */
int mst_args_backend(mst_args* a, mst_backend_kind* out);

/* The file of a --json checked by mst_args_out_file: opened for writing,
 * NULL after a line naming it; closed with the verdict on every write: 1
 * after a line naming it when a write or the close failed (a full disk). */
FILE* mst_out_open(const char* cmd, const char* path);
int mst_out_close(const char* cmd, const char* path, FILE* f);

/* The backend when no --backend is given: cuda when available, else cpu. */
mst_backend_kind mst_default_backend(void);
/* Why `kind` is not available here (not built in, no device, the driver's
 * error text); "" when it is. */
const char* mst_backend_unavailable_why(mst_backend_kind kind);
/* The value of flag `name` anywhere in argv (`name v` or `name=v`), for a
 * flag read before the others (train's --backend picks the defaults); NULL
 * when absent. */
const char* mst_args_find(int argc, char** argv, const char* name);
/* 1 when --help or -h stands anywhere in argv (asked for before the other
 * flags are checked). */
int mst_args_help(int argc, char** argv);

#endif
