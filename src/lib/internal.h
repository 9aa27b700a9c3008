/*
 * internal.h — the one door from the trainer, the program, the benchmarks
 * and the tests into the library's internals (docs/DESIGN.md §3.1). Nothing
 * outside src/lib/ includes another file of src/lib/; what ships to users is
 * include/moestash.h alone.
 *
 * What passes through it: the context (core/context.h, with the backend
 * table and the device-flag bits), the one clock and the one PRNG, the
 * expert-parallel communicator's internals (ep/ep.h), the memory manager's
 * test hooks, the fp8 page format (backend/fp8_page.h), and the backends'
 * own kernels' helpers: the CPU backend's GEMM
 * (cpu_ops.h) and, in CUDA sources, the CUDA backend's common device code
 * (cuda_common.cuh, ptx.cuh) and its op declarations (cuda_ops.h).
 */
#ifndef MST_LIB_INTERNAL_H
#define MST_LIB_INTERNAL_H

#include "core/clock.h"
#include "core/context.h"
#include "core/rng.h"
#include "ep/ep.h"
#include "stash/memmgr_debug.h"
#include "stash/stash.h"
#include "backend/fp8_page.h"
#include "backend/cpu/cpu_ops.h"
#ifdef __CUDACC__
#include "backend/cuda/cuda_common.cuh"
#include "backend/cuda/ptx.cuh"
#endif
#ifdef MST_HAVE_CUDA
#include "backend/cuda/cuda_ops.h"
#endif

#endif
