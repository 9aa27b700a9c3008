/*
 * host_device.h — MST_HD: inline functions shared by the CPU reference (C11)
 * and the CUDA kernels (host and device).
 */
#ifndef MST_HOST_DEVICE_H
#define MST_HOST_DEVICE_H

#ifdef __CUDACC__
#define MST_HD static __host__ __device__ __forceinline__
#else
#define MST_HD static inline
#endif

#endif
