/*
 * memmgr_debug.h — test hooks of the memory manager (private).
 */
#ifndef MST_MEMMGR_DEBUG_H
#define MST_MEMMGR_DEBUG_H

#include "../backend/backend.h"

/* Slows stream `sel` down (cycles 0: not). On a backend with streams, by a
 * spin of `cycles` clock cycles: on a side stream before each of its pool
 * operations, on main at each layer call (MST_ERR_UNSUPPORTED where the
 * backend cannot spin). On a backend without streams a side stream is
 * deferred instead: each operation runs only when an event wait needs it
 * (main: MST_ERR_UNSUPPORTED). A missing event edge then shows as a wrong
 * result. Between steps. */
mst_status mst_memmgr_debug_slow(mst_memmgr_t* m, mst_stream_sel sel, int64_t cycles);

#endif
