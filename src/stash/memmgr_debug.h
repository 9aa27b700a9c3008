/*
 * memmgr_debug.h — test hooks of the memory manager (private).
 */
#ifndef MST_MEMMGR_DEBUG_H
#define MST_MEMMGR_DEBUG_H

#include "../backend/backend.h"

/* Slows stream `sel` down by a spin of `cycles` clock cycles (0: off) on a
 * backend with streams: on a side stream before each of its pool operations,
 * on main at each layer call. A missing event edge then shows as a wrong
 * result. MST_ERR_UNSUPPORTED where the backend cannot spin. */
mst_status mst_memmgr_debug_slow(mst_memmgr_t* m, mst_stream_sel sel, int64_t cycles);

#endif
