/*
 * stash_copy_lab.cu — kernel lab for the paged stash's copies (not part of
 * the library): variants of a paged copy (rows -> pages through a page
 * table, as the stash's save / restore do) timed beside cudaMemcpyAsync of
 * the same bytes, in the same run, the way `moestash bench stash` times
 * (event, launch, event, sync; median after warm-ups).
 *
 *   device: D2D, 2 x bytes counted. ld/st grid-stride variants (unroll,
 *           blocks per SM, cache hints) and a TMA bulk-copy pipeline.
 *   host:   D2H (stores to mapped pinned memory) and H2D (loads from it),
 *           bytes counted once: grid size, unroll, hints, TMA bulk.
 *
 * build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
 *        -o stash_copy_lab dev/stash_copy_lab.cu
 * usage: stash_copy_lab device|d2h|h2d
 */
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <cuda_runtime.h>

#define CK(x)                                                                                \
    do {                                                                                     \
        cudaError_t e_ = (x);                                                                \
        if (e_ != cudaSuccess) {                                                             \
            fprintf(stderr, "%s: %s (%s:%d)\n", #x, cudaGetErrorString(e_), __FILE__, __LINE__); \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

enum Hint { PLAIN = 0, STREAM = 1, L2_256 = 2 };

template <int HINT>
__device__ __forceinline__ uint4 ld16(const uint4* p) {
    uint4 v;
    if (HINT == STREAM) v = __ldcs(p);
    else if (HINT == L2_256)
        asm volatile("ld.global.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    else v = *p;
    return v;
}

template <int HINT>
__device__ __forceinline__ void st16(uint4* p, uint4 v) {
    if (HINT == STREAM) __stcs(p, v);
    else *p = v;
}

/* rows [n_vec] <-> pages: vector u of the rows is vector u % vpp of page
 * table[u / vpp]. TO_PAGES: save direction (rows read, pages written). */
template <int U, int MINB, int HINT, bool TO_PAGES>
__global__ void __launch_bounds__(256, MINB)
    ldst_copy(uint4* rows, uint4* pages, const uint32_t* table, uint32_t vpp, uint32_t n_vec) {
    const uint32_t stride = gridDim.x * blockDim.x;
    for (uint32_t u0 = blockIdx.x * blockDim.x + threadIdx.x; u0 < n_vec; u0 += U * stride) {
        uint4 v[U];
        uint4* to[U];
#pragma unroll
        for (int k = 0; k < U; k++) {
            const uint32_t u = min(u0 + k * stride, n_vec - 1);
            const uint32_t p = u / vpp;
            uint4* pg = pages + (size_t)table[p] * vpp + (u - p * vpp);
            v[k] = ld16<HINT>(TO_PAGES ? rows + u : pg);
            to[k] = TO_PAGES ? pg : rows + u;
        }
#pragma unroll
        for (int k = 0; k < U; k++)
            if (u0 + k * stride < n_vec) st16<HINT>(to[k], v[k]);
    }
}

__device__ __forceinline__ uint32_t sptr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}\n" ::"r"(
            sptr(bar)),
        "r"(parity)
        : "memory");
}

/* TMA bulk pipeline: chunks of C bytes (pages hold whole chunks), chunk c =
 * block + i * grid; thread 0 drives S stages of shared memory. */
template <int S, bool TO_PAGES>
__global__ void __launch_bounds__(32, 1)
    tma_copy(char* rows, char* pages, const uint32_t* table, uint32_t chunk, uint32_t cpp, uint32_t n_chunks) {
    extern __shared__ __align__(128) char smem[];
    __shared__ __align__(8) uint64_t bar[S];
    if (threadIdx.x != 0) return;
    for (int s = 0; s < S; s++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sptr(&bar[s])));
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const uint32_t my = n_chunks > blockIdx.x ? (n_chunks - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    auto addr = [&](uint32_t i, char** from, char** to) {
        const uint32_t c = blockIdx.x + i * gridDim.x, p = c / cpp;
        char* pg = pages + ((size_t)table[p] * cpp + (c - p * cpp)) * chunk;
        char* rw = rows + (size_t)c * chunk;
        *from = TO_PAGES ? rw : pg;
        *to = TO_PAGES ? pg : rw;
    };
    auto load = [&](uint32_t i) {
        char *from, *to;
        addr(i, &from, &to);
        const int s = i % S;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sptr(&bar[s])), "r"(chunk)
                     : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                sptr(smem + (size_t)s * chunk)),
            "l"(from), "r"(chunk), "r"(sptr(&bar[s]))
            : "memory");
    };
    for (uint32_t i = 0; i < my && i < S; i++) load(i);
    for (uint32_t i = 0; i < my; i++) {
        const int s = i % S;
        bar_wait(&bar[s], (i / S) & 1);
        char *from, *to;
        addr(i, &from, &to);
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(to),
                     "r"(sptr(smem + (size_t)s * chunk)), "r"(chunk)
                     : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        if (i >= 1 && i - 1 + S < my) { /* refill the stage of chunk i - 1 once its store has read it */
            asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
            load(i - 1 + S);
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

struct Lab {
    uint4* rows;       /* device [n_vec]                     */
    uint4* pages;      /* device or mapped host [n_vec]      */
    uint32_t* table;   /* device [n_pages]: a permutation    */
    uint32_t vpp, n_vec, n_pages;
    size_t bytes;
    cudaStream_t st;
    cudaEvent_t e0, e1;
    int n_sm;
};

template <class F>
static float timed(Lab& L, F&& op) {
    std::vector<float> t;
    for (int i = 0; i < 18; i++) {
        CK(cudaEventRecord(L.e0, L.st));
        op();
        CK(cudaGetLastError());
        CK(cudaEventRecord(L.e1, L.st));
        CK(cudaEventSynchronize(L.e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, L.e0, L.e1));
        if (i >= 3) t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

/* The pages hold the rows in table order, checked after each variant. */
static bool check(Lab& L, bool to_pages, const std::vector<uint32_t>& table, const std::vector<uint4>& ref) {
    std::vector<uint4> got(L.n_vec);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(got.data(), to_pages ? L.pages : L.rows, L.bytes, cudaMemcpyDefault));
    for (uint32_t u = 0; u < L.n_vec; u++) {
        const uint32_t p = u / L.vpp;
        const size_t at = to_pages ? (size_t)table[p] * L.vpp + (u - p * L.vpp) : u;
        if (memcmp(&got[at], &ref[u], 16) != 0) return false;
    }
    return true;
}

template <int U, int MINB, int HINT, bool TO_PAGES>
static void run_ldst(Lab& L, const char* name, int grid, float base_ms, double moved, const std::vector<uint32_t>& tab,
                     const std::vector<uint4>& ref) {
    if (grid <= 0) {
        int per_sm = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, ldst_copy<U, MINB, HINT, TO_PAGES>, 256, 0));
        grid = L.n_sm * per_sm;
    }
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, ldst_copy<U, MINB, HINT, TO_PAGES>));
    CK(cudaMemset(TO_PAGES ? (void*)L.pages : (void*)L.rows, 0xEE, L.bytes));
    const float ms = timed(L, [&] {
        ldst_copy<U, MINB, HINT, TO_PAGES><<<grid, 256, 0, L.st>>>(L.rows, L.pages, L.table, L.vpp, L.n_vec);
    });
    const bool ok = check(L, TO_PAGES, tab, ref);
    printf("  %-34s grid %5d regs %3d  %8.1f GB/s  ratio %.3f  %s\n", name, grid, fa.numRegs, moved / ms / 1e6,
           base_ms / ms, ok ? "ok" : "WRONG");
}

template <int S, bool TO_PAGES>
static void run_tma(Lab& L, const char* name, uint32_t chunk, float base_ms, double moved,
                    const std::vector<uint32_t>& tab, const std::vector<uint4>& ref) {
    const size_t smem = (size_t)S * chunk;
    CK(cudaFuncSetAttribute(tma_copy<S, TO_PAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const uint32_t page_bytes = L.vpp * 16, cpp = page_bytes / chunk, n_chunks = (uint32_t)(L.bytes / chunk);
    CK(cudaMemset(TO_PAGES ? (void*)L.pages : (void*)L.rows, 0xEE, L.bytes));
    const float ms = timed(L, [&] {
        tma_copy<S, TO_PAGES><<<L.n_sm, 32, smem, L.st>>>((char*)L.rows, (char*)L.pages, L.table, chunk, cpp,
                                                          n_chunks);
    });
    const bool ok = check(L, TO_PAGES, tab, ref);
    printf("  %-34s chunk %6u x %d  %8.1f GB/s  ratio %.3f  %s\n", name, chunk, S, moved / ms / 1e6, base_ms / ms,
           ok ? "ok" : "WRONG");
}

int main(int argc, char** argv) {
    const char* what = argc > 1 ? argv[1] : "device";
    const bool host = strcmp(what, "device") != 0, d2h = strcmp(what, "d2h") == 0;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("lab %s on %s (%d SMs)\n", what, prop.name, prop.multiProcessorCount);
    /* width 4096 bf16, page 64 rows = 512 KiB; 16k and 128k rows (device), 64k (host) */
    const std::vector<uint32_t> sizes_rows = host ? std::vector<uint32_t>{65536} : std::vector<uint32_t>{16384, 131072};
    for (uint32_t rows : sizes_rows) {
        Lab L{};
        L.n_sm = prop.multiProcessorCount;
        L.bytes = (size_t)rows * 8192;
        L.n_vec = (uint32_t)(L.bytes / 16);
        L.vpp = 64 * 8192 / 16;
        L.n_pages = L.n_vec / L.vpp;
        CK(cudaStreamCreateWithFlags(&L.st, cudaStreamNonBlocking));
        CK(cudaEventCreate(&L.e0));
        CK(cudaEventCreate(&L.e1));
        CK(cudaMalloc(&L.rows, L.bytes));
        if (host) CK(cudaHostAlloc((void**)&L.pages, L.bytes, cudaHostAllocMapped | cudaHostAllocPortable));
        else CK(cudaMalloc(&L.pages, L.bytes));
        void* other; /* baseline partner: pinned (host) or device */
        if (host) CK(cudaHostAlloc(&other, L.bytes, cudaHostAllocDefault));
        else CK(cudaMalloc(&other, L.bytes));
        std::vector<uint32_t> tab(L.n_pages);
        for (uint32_t i = 0; i < L.n_pages; i++) tab[i] = i;
        uint64_t s = 12345 + rows;
        for (uint32_t i = L.n_pages - 1; i > 0; i--) { /* random permutation */
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            std::swap(tab[i], tab[(s >> 33) % (i + 1)]);
        }
        CK(cudaMalloc(&L.table, L.n_pages * 4));
        CK(cudaMemcpy(L.table, tab.data(), L.n_pages * 4, cudaMemcpyHostToDevice));
        std::vector<uint4> ref(L.n_vec), pg(L.n_vec);
        for (uint32_t u = 0; u < L.n_vec; u++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            ref[u] = make_uint4((uint32_t)(s >> 32), (uint32_t)s | 1u, u, ~u);
        }
        for (uint32_t u = 0; u < L.n_vec; u++) pg[(size_t)tab[u / L.vpp] * L.vpp + u % L.vpp] = ref[u];
        /* save direction (rows -> pages) for device and d2h; h2d restores (pages -> rows) */
        const bool to_pages = !host || d2h;
        CK(cudaMemcpy(L.rows, ref.data(), L.bytes, cudaMemcpyHostToDevice));
        if (!to_pages) CK(cudaMemcpy(L.pages, pg.data(), L.bytes, cudaMemcpyDefault));
        const double moved = host ? (double)L.bytes : 2.0 * L.bytes;
        const float base_ms = timed(L, [&] {
            if (!host) CK(cudaMemcpyAsync(other, L.rows, L.bytes, cudaMemcpyDeviceToDevice, L.st));
            else if (d2h) CK(cudaMemcpyAsync(other, L.rows, L.bytes, cudaMemcpyDeviceToHost, L.st));
            else CK(cudaMemcpyAsync(L.rows, other, L.bytes, cudaMemcpyHostToDevice, L.st));
        });
        printf(" %u rows x 4096 bf16 (%.0f MiB): cudaMemcpyAsync %.1f GB/s (%.3f ms)\n", rows, L.bytes / 1048576.0,
               moved / base_ms / 1e6, base_ms);
        if (!host) {
            run_ldst<4, 5, PLAIN, true>(L, "ldst u4 5/SM (stash v3)", 0, base_ms, moved, tab, ref);
            run_ldst<4, 5, STREAM, true>(L, "ldst u4 5/SM cs hints", 0, base_ms, moved, tab, ref);
            run_ldst<4, 5, L2_256, true>(L, "ldst u4 5/SM L2::256B", 0, base_ms, moved, tab, ref);
            run_ldst<8, 4, PLAIN, true>(L, "ldst u8 4/SM", 0, base_ms, moved, tab, ref);
            run_ldst<8, 3, PLAIN, true>(L, "ldst u8 3/SM", 0, base_ms, moved, tab, ref);
            run_ldst<8, 4, STREAM, true>(L, "ldst u8 4/SM cs hints", 0, base_ms, moved, tab, ref);
            run_ldst<8, 4, L2_256, true>(L, "ldst u8 4/SM L2::256B", 0, base_ms, moved, tab, ref);
            run_ldst<4, 8, PLAIN, true>(L, "ldst u4 8/SM", 0, base_ms, moved, tab, ref);
            run_ldst<2, 8, PLAIN, true>(L, "ldst u2 8/SM", 0, base_ms, moved, tab, ref);
            run_ldst<4, 5, PLAIN, false>(L, "restore ldst u4 5/SM (v3)", 0, base_ms, moved, tab, ref);
            run_ldst<8, 4, PLAIN, false>(L, "restore ldst u8 4/SM", 0, base_ms, moved, tab, ref);
            run_tma<4, true>(L, "tma", 32768, base_ms, moved, tab, ref);
            run_tma<6, true>(L, "tma", 32768, base_ms, moved, tab, ref);
            run_tma<12, true>(L, "tma", 16384, base_ms, moved, tab, ref);
            run_tma<3, true>(L, "tma", 65536, base_ms, moved, tab, ref);
            run_tma<6, false>(L, "restore tma", 32768, base_ms, moved, tab, ref);
        } else if (d2h) {
            run_ldst<4, 5, PLAIN, true>(L, "d2h ldst u4 (v3 grid 64)", 64, base_ms, moved, tab, ref);
            run_ldst<4, 5, PLAIN, true>(L, "d2h ldst u4", 32, base_ms, moved, tab, ref);
            run_ldst<4, 5, PLAIN, true>(L, "d2h ldst u4", 132, base_ms, moved, tab, ref);
            run_ldst<4, 5, PLAIN, true>(L, "d2h ldst u4", 264, base_ms, moved, tab, ref);
            run_ldst<8, 4, PLAIN, true>(L, "d2h ldst u8", 64, base_ms, moved, tab, ref);
            run_ldst<4, 5, STREAM, true>(L, "d2h ldst u4 cs", 64, base_ms, moved, tab, ref);
            run_tma<4, true>(L, "d2h tma", 32768, base_ms, moved, tab, ref);
            run_tma<8, true>(L, "d2h tma", 16384, base_ms, moved, tab, ref);
        } else {
            run_ldst<4, 5, PLAIN, false>(L, "h2d ldst u4 (v3 grid 64)", 64, base_ms, moved, tab, ref);
            run_ldst<4, 5, PLAIN, false>(L, "h2d ldst u4", 32, base_ms, moved, tab, ref);
            run_ldst<4, 5, PLAIN, false>(L, "h2d ldst u4", 132, base_ms, moved, tab, ref);
            run_ldst<4, 5, PLAIN, false>(L, "h2d ldst u4", 264, base_ms, moved, tab, ref);
            run_ldst<4, 5, PLAIN, false>(L, "h2d ldst u4", 660, base_ms, moved, tab, ref);
            run_ldst<8, 4, PLAIN, false>(L, "h2d ldst u8", 64, base_ms, moved, tab, ref);
            run_ldst<8, 4, PLAIN, false>(L, "h2d ldst u8", 132, base_ms, moved, tab, ref);
            run_ldst<4, 5, L2_256, false>(L, "h2d ldst u4 L2::256B", 64, base_ms, moved, tab, ref);
            run_ldst<4, 5, L2_256, false>(L, "h2d ldst u4 L2::256B", 132, base_ms, moved, tab, ref);
            run_ldst<4, 5, STREAM, false>(L, "h2d ldst u4 cs", 64, base_ms, moved, tab, ref);
            run_tma<4, false>(L, "h2d tma", 32768, base_ms, moved, tab, ref);
            run_tma<8, false>(L, "h2d tma", 16384, base_ms, moved, tab, ref);
            run_tma<3, false>(L, "h2d tma", 65536, base_ms, moved, tab, ref);
        }
        cudaFree(L.rows);
        cudaFree(L.table);
        if (host) cudaFreeHost(L.pages), cudaFreeHost(other);
        else cudaFree(L.pages), cudaFree(other);
    }
    return 0;
}
