/*
 * grouped_gemm_wgmma.cu — the Hopper (sm_90a) grouped GEMM: a persistent,
 * warp-specialized kernel of three warpgroups. Warpgroup 0 (one thread)
 * feeds a ring of shared-memory stages with TMA (cp.async.bulk.tensor,
 * 128-byte swizzle) completing on mbarriers; warpgroups 1 and 2 multiply
 * with wgmma straight from shared memory (M/N-major operands through the
 * descriptor's transpose bit). Both consumers share one 128 x 256 tile (64
 * rows each, wgmma.m64n256k16); in forward and dgrad a consumer whose 64
 * rows all lie past the group's count skips its MMAs and stores, so a tile
 * of at most 64 rows (a small group, a group's last rows) costs half.
 * Tiles come from the device schedule (see "tile hand-out").
 *
 * Output goes through shared memory: each consumer stages its 64 x 256
 * block in chunks of 64 rows x 128 bytes and hands each to a TMA store, so
 * the writes run while the next tile's MMAs do. wgrad ACCUMULATE uses the
 * TMA reduce-add: every main_grad element gets exactly one add per call,
 * from one tile, so the result is old + dW rounded once, as with a
 * load-add-store, whatever the timing. Forward and dgrad row blocks that
 * reach past the group's count are stored from registers, masked (a TMA
 * box would write the next group's rows).
 *
 * Rows: TMA boxes are placed at the group's first row, so a box may run
 * into the next group's rows (or padding rows up to max_rows; TMA zero-fills
 * past max_rows). For forward and dgrad such rows only reach accumulator rows
 * that the epilogue never stores. For wgrad, where rows are the K dimension,
 * the consumer zeroes the stage rows past the group's count before the MMA,
 * so no row outside the group contributes. wgrad's k-blocks start at the
 * multiple of 64 rows at or before the group's first row (gg_align_k), so
 * that x may come from the pages of a stash (one page per k-block, the same
 * bits as from memory); the rows in front are dropped through dy.
 */
#include <cuda.h>

#include "grouped_gemm.cuh"
#include "ptx.cuh"

namespace {

constexpr int BM = 128, BN = 256, BK = 64;            /* CTA tile; BK = one 128-byte swizzle row */
constexpr int STAGES = 4;                             /* ring stages of A and B */
constexpr int THREADS = 384;                          /* producer WG + 2 consumer WGs */
constexpr int CONSUMERS = 256;
constexpr uint32_t A_BYTES = BM * BK * 2;             /* 16 KiB per stage */
constexpr uint32_t B_BYTES = BN * BK * 2;             /* 32 KiB per stage */
constexpr uint32_t BOX_BYTES = 64 * BK * 2;           /* one [BK rows][64] M/N-major box */
constexpr uint32_t ROW_BYTES = 128;                   /* one swizzled smem row */
constexpr uint32_t C_BYTES = 64 * 128;                /* one output chunk: 64 rows of 128 B */
constexpr int C_BUFS = 2;                             /* output chunk buffers per consumer */
constexpr size_t SMEM_BYTES = STAGES * (A_BYTES + B_BYTES) + 2 * C_BUFS * C_BYTES + 1024; /* + 1024-byte alignment slack */

template <int OP>
struct layout {
    static constexpr int A_MN = OP == GG_WGRAD; /* A is M-major (transposed) */
    static constexpr int B_MN = OP != GG_FWD;   /* B is N-major (transposed) */
};

/* ---- wgmma ---- */
/* Shared-memory matrix descriptor, 128-byte swizzle: lbo / sbo in bytes. */
__device__ __forceinline__ uint64_t desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | (uint64_t)((lbo >> 4) & 0x3FFF) << 16 |
           (uint64_t)((sbo >> 4) & 0x3FFF) << 32 | 1ull << 62;
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* Keeps the compiler from moving accumulator reads or writes across the
 * asynchronous MMA (a dependency on every register). */
__device__ __forceinline__ void fence_acc(float (&d)[128]) {
#pragma unroll
    for (int i = 0; i < 128; i++) asm volatile("" : "+f"(d[i])::"memory");
}

/* D[OFF, OFF + 128) += A B: one wgmma.m64n256k16 (TA / TB: operand M / N-major). */
template <int TA, int TB, int OFF>
__device__ __forceinline__ void wgmma_n256(float (&d)[128], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
        "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
        "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
        : "+f"(d[OFF + 0]), "+f"(d[OFF + 1]), "+f"(d[OFF + 2]), "+f"(d[OFF + 3]), "+f"(d[OFF + 4]), "+f"(d[OFF + 5]), "+f"(d[OFF + 6]), "+f"(d[OFF + 7]), "+f"(d[OFF + 8]), "+f"(d[OFF + 9]), "+f"(d[OFF + 10]), "+f"(d[OFF + 11]), "+f"(d[OFF + 12]), "+f"(d[OFF + 13]), "+f"(d[OFF + 14]), "+f"(d[OFF + 15]), "+f"(d[OFF + 16]), "+f"(d[OFF + 17]), "+f"(d[OFF + 18]), "+f"(d[OFF + 19]), "+f"(d[OFF + 20]), "+f"(d[OFF + 21]), "+f"(d[OFF + 22]), "+f"(d[OFF + 23]), "+f"(d[OFF + 24]), "+f"(d[OFF + 25]), "+f"(d[OFF + 26]), "+f"(d[OFF + 27]), "+f"(d[OFF + 28]), "+f"(d[OFF + 29]), "+f"(d[OFF + 30]), "+f"(d[OFF + 31]), "+f"(d[OFF + 32]), "+f"(d[OFF + 33]), "+f"(d[OFF + 34]), "+f"(d[OFF + 35]), "+f"(d[OFF + 36]), "+f"(d[OFF + 37]), "+f"(d[OFF + 38]), "+f"(d[OFF + 39]), "+f"(d[OFF + 40]), "+f"(d[OFF + 41]), "+f"(d[OFF + 42]), "+f"(d[OFF + 43]), "+f"(d[OFF + 44]), "+f"(d[OFF + 45]), "+f"(d[OFF + 46]), "+f"(d[OFF + 47]), "+f"(d[OFF + 48]), "+f"(d[OFF + 49]), "+f"(d[OFF + 50]), "+f"(d[OFF + 51]), "+f"(d[OFF + 52]), "+f"(d[OFF + 53]), "+f"(d[OFF + 54]), "+f"(d[OFF + 55]), "+f"(d[OFF + 56]), "+f"(d[OFF + 57]), "+f"(d[OFF + 58]), "+f"(d[OFF + 59]), "+f"(d[OFF + 60]), "+f"(d[OFF + 61]), "+f"(d[OFF + 62]), "+f"(d[OFF + 63]), "+f"(d[OFF + 64]), "+f"(d[OFF + 65]), "+f"(d[OFF + 66]), "+f"(d[OFF + 67]), "+f"(d[OFF + 68]), "+f"(d[OFF + 69]), "+f"(d[OFF + 70]), "+f"(d[OFF + 71]), "+f"(d[OFF + 72]), "+f"(d[OFF + 73]), "+f"(d[OFF + 74]), "+f"(d[OFF + 75]), "+f"(d[OFF + 76]), "+f"(d[OFF + 77]), "+f"(d[OFF + 78]), "+f"(d[OFF + 79]), "+f"(d[OFF + 80]), "+f"(d[OFF + 81]), "+f"(d[OFF + 82]), "+f"(d[OFF + 83]), "+f"(d[OFF + 84]), "+f"(d[OFF + 85]), "+f"(d[OFF + 86]), "+f"(d[OFF + 87]), "+f"(d[OFF + 88]), "+f"(d[OFF + 89]), "+f"(d[OFF + 90]), "+f"(d[OFF + 91]), "+f"(d[OFF + 92]), "+f"(d[OFF + 93]), "+f"(d[OFF + 94]), "+f"(d[OFF + 95]), "+f"(d[OFF + 96]), "+f"(d[OFF + 97]), "+f"(d[OFF + 98]), "+f"(d[OFF + 99]), "+f"(d[OFF + 100]), "+f"(d[OFF + 101]), "+f"(d[OFF + 102]), "+f"(d[OFF + 103]), "+f"(d[OFF + 104]), "+f"(d[OFF + 105]), "+f"(d[OFF + 106]), "+f"(d[OFF + 107]), "+f"(d[OFF + 108]), "+f"(d[OFF + 109]), "+f"(d[OFF + 110]), "+f"(d[OFF + 111]), "+f"(d[OFF + 112]), "+f"(d[OFF + 113]), "+f"(d[OFF + 114]), "+f"(d[OFF + 115]), "+f"(d[OFF + 116]), "+f"(d[OFF + 117]), "+f"(d[OFF + 118]), "+f"(d[OFF + 119]), "+f"(d[OFF + 120]), "+f"(d[OFF + 121]), "+f"(d[OFF + 122]), "+f"(d[OFF + 123]), "+f"(d[OFF + 124]), "+f"(d[OFF + 125]), "+f"(d[OFF + 126]), "+f"(d[OFF + 127])
        : "l"(da), "l"(db), "r"(1), "n"(TA), "n"(TB));
}

/* Descriptors of k-step kk (16 columns of K) for the 64-row half h of A.
 * K-major tiles: rows of 64 K values (128 B), 8-row atoms 1024 B apart; a
 * k-step moves 32 B inside the row. M/N-major tiles: boxes of [BK][64],
 * BOX_BYTES apart along M/N (leading offset), 8-row atoms 1024 B apart
 * along K (stride offset); a k-step moves 16 rows. */
template <int OP>
__device__ __forceinline__ uint64_t desc_a(uint32_t sa, int h, int kk) {
    if (layout<OP>::A_MN) return desc(sa + h * BOX_BYTES + kk * 16 * ROW_BYTES, BOX_BYTES, 8 * ROW_BYTES);
    return desc(sa + h * 64 * ROW_BYTES + kk * 32, 16, 8 * ROW_BYTES);
}
template <int OP>
__device__ __forceinline__ uint64_t desc_b(uint32_t sb, int kk) {
    if (layout<OP>::B_MN) return desc(sb + kk * 16 * ROW_BYTES, BOX_BYTES, 8 * ROW_BYTES);
    return desc(sb + kk * 32, 16, 8 * ROW_BYTES);
}

/* wgrad, x in pages: the id of the page that holds the k-block of rows
 * [r0, + BK) (0xffffffff past the table). The producer issues the load
 * before it waits for a free stage (volatile: it stays there), so that it
 * lands during the wait. */
__device__ __forceinline__ uint32_t lookup_page(const gg_paged& pg, int r0) {
    const uint32_t q = (uint32_t)r0 >> pg.page_shift;
    uint32_t id = 0xffffffffu;
    if (q < (uint32_t)pg.table_pages) asm volatile("ld.global.nc.u32 %0, [%1];\n" : "=r"(id) : "l"(pg.table + q));
    return id;
}

/* The k-block of x rows [r0, + BK) (inside page `id`) x cols [n0, + BN)
 * into the B stage sb, from the device or the host block (each mapped as
 * [pages][page_rows][I]); an id past its block loads zeros (the box one
 * page past the end of the map: wholly out of bounds, as rows past
 * max_rows are). */
__device__ __forceinline__ void load_paged(uint8_t* sb, const CUtensorMap* mbd, const CUtensorMap* mbh,
                                           const gg_paged& pg, uint32_t id, int r0, int n0, uint64_t* full) {
    int host;
    const uint32_t i = (uint32_t)mst_page_decode(id, &host);
    const int page = i < (uint32_t)(host ? pg.n_pages[1] : pg.n_pages[0]) ? (int)i /* selects: no local copy of pg */
                                                                           : host ? pg.map_pages[1] : pg.map_pages[0];
    const int row = (int)((uint32_t)r0 & ((1u << pg.page_shift) - 1));
    const CUtensorMap* m = host ? mbh : mbd;
#pragma unroll
    for (int j = 0; j < BN / 64; j++) mst_tma_3d(sb + j * BOX_BYTES, m, n0 + 64 * j, row, page, full);
}

/* The producer's loads of k-block k0 of tile t into one stage. */
template <int OP>
__device__ __forceinline__ void load_stage(const CUtensorMap* ma, const CUtensorMap* mb, const CUtensorMap* mbh,
                                           const gg_paged& pg, uint32_t page, const gg_tile& t, int k0,
                                           uint8_t* sa, uint8_t* sb, uint64_t* full) {
    mst_mbar_expect_tx(full, A_BYTES + B_BYTES);
    if (OP == GG_WGRAD) { /* A: dy rows [row0 + k0, +BK) x cols [m0, m0 + BM), two boxes */
        mst_tma_2d(sa, ma, t.m0, t.row0 + k0, full);
        mst_tma_2d(sa + BOX_BYTES, ma, t.m0 + 64, t.row0 + k0, full);
    } else { /* A: rows [row0 + m0, +BM) x K [k0, +BK), one box */
        mst_tma_2d(sa, ma, k0, t.row0 + t.m0, full);
    }
    if (OP == GG_FWD) { /* B: W[g] rows [n0, +BN) x K [k0, +BK), one box */
        mst_tma_3d(sb, mb, k0, t.n0, t.g, full);
    } else {
        if (OP == GG_WGRAD && pg.table) { /* x rows from pages: the k-block lies in one page */
            load_paged(sb, mb, mbh, pg, page, t.row0 + k0, t.n0, full);
            return;
        }
#pragma unroll
        for (int j = 0; j < BN / 64; j++) {
            if (OP == GG_DGRAD) mst_tma_3d(sb + j * BOX_BYTES, mb, t.n0 + 64 * j, k0, t.g, full); /* W[g] [O][I] */
            else mst_tma_2d(sb + j * BOX_BYTES, mb, t.n0 + 64 * j, t.row0 + k0, full);          /* x rows */
        }
    }
}

/* wgrad: zero the stage rows outside [lo, hi) of every box (rows before
 * the group's first row or past its count), then make the writes visible to
 * the tensor cores and wait for the other consumer (named barrier 1). */
__device__ __forceinline__ void zero_rows(uint8_t* sa, uint8_t* sb, int lo, int hi, int ct) {
    const int n = lo + BK - hi, per_box = n * (ROW_BYTES / 16);
    const int boxes = (int)((A_BYTES + B_BYTES) / BOX_BYTES);
    for (int i = ct; i < boxes * per_box; i += CONSUMERS) {
        int box = i / per_box, rem = i % per_box, row = rem / 8;
        uint8_t* base = box < 2 ? sa + box * BOX_BYTES : sb + (box - 2) * BOX_BYTES;
        *(uint4*)(base + (row < lo ? row : hi + row - lo) * ROW_BYTES + (rem % 8) * 16) = make_uint4(0, 0, 0, 0);
    }
    mst_fence_proxy_async();
    asm volatile("bar.sync 1, %0;\n" ::"n"(CONSUMERS) : "memory");
}

/* wgrad, a k-block with only head rows to drop (rows [0, lo) belong to the
 * groups before: data, not padding): consumer cw zeroes them in its own A
 * box only (a zero row of dy drops the row), then syncs its warpgroup
 * (named barrier 2 + cw) instead of both consumers. */
__device__ __forceinline__ void zero_head(uint8_t* sa, int lo, int cw, int wt) {
    for (int i = wt; i < lo * (int)(ROW_BYTES / 16); i += 128)
        *(uint4*)(sa + cw * BOX_BYTES + (i / 8) * ROW_BYTES + (i % 8) * 16) = make_uint4(0, 0, 0, 0);
    mst_fence_proxy_async();
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + cw) : "memory");
}

/* One k-block of MMAs for consumer warpgroup cw: rows [64 cw, +64) x 256. */
template <int OP>
__device__ __forceinline__ void mma_block(float (&acc)[128], uint32_t a, uint32_t b, int cw) {
    constexpr int TA = layout<OP>::A_MN, TB = layout<OP>::B_MN;
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) wgmma_n256<TA, TB, 0>(acc, desc_a<OP>(a, cw, kk), desc_b<OP>(b, kk));
}

/* Accumulator fragment 4i .. 4i+3 of thread wt of a consumer warpgroup
 * holds rows r, r + 8 and columns c, c + 1 of column block i (8 wide) of
 * the warpgroup's 64 x 256 block (m64nNk16 layout). */
__device__ __forceinline__ int frag_row(int wt) { return (wt >> 5) * 16 + ((wt & 31) >> 2); }
__device__ __forceinline__ int frag_col(int wt) { return (wt & 3) * 2; }

/* The forward's bias terms of this thread's fragment: bias[g] at columns
 * (8 i + c, + 1) of the tile and the scales of rows r, r + 8 (1 without a
 * scale). Loaded before the mainloop, which hides their latency; zero
 * without a bias or past the extents. */
struct frag_bias {
    __nv_bfloat162 b[BN / 8];
    float s0, s1;
};
template <int OP>
__device__ __forceinline__ void load_bias(const gg_problem& p, const gg_tile& t, int cw, int wt,
                                          frag_bias& fb) {
    if (OP != GG_FWD || !p.bias) return;
    const int m = t.m0 + 64 * cw + frag_row(wt), c = frag_col(wt);
    const __nv_bfloat16* bias = (const __nv_bfloat16*)p.bias + (int64_t)t.g * p.N + t.n0 + c; /* [8 i] */
    const __nv_bfloat16 zero = __float2bfloat16_rn(0.0f);
#pragma unroll
    for (int i = 0; i < BN / 8; i++) { /* N is a multiple of 8 here (p.vec): c + 1 is in when c is */
        const int in = t.n0 + 8 * i + c < t.n_lim;
        fb.b[i] = __halves2bfloat162(in ? bias[8 * i] : zero, in ? bias[8 * i + 1] : zero);
    }
    fb.s0 = p.scale && m < t.m_lim ? p.scale[t.row0 + m] : 1.0f;
    fb.s1 = p.scale && m + 8 < t.m_lim ? p.scale[t.row0 + m + 8] : 1.0f;
}
/* v0 .. v3 of column block i += bias * scale (forward with a bias). */
template <int OP>
__device__ __forceinline__ void add_bias(const gg_problem& p, const frag_bias& fb, int i, float& v0, float& v1,
                                         float& v2, float& v3) {
    if (OP != GG_FWD || !p.bias) return;
    const float b0 = __low2float(fb.b[i]), b1 = __high2float(fb.b[i]);
    v0 += b0 * fb.s0, v1 += b1 * fb.s0, v2 += b0 * fb.s1, v3 += b1 * fb.s1;
}

/* Epilogue of forward and dgrad for row blocks that reach past the group's
 * count: stored from registers, masked. */
template <int OP>
__device__ __forceinline__ void epilogue(const gg_problem& p, const gg_tile& t, float (&acc)[128],
                                         const frag_bias& fb, int cw, int wt) {
    const int m = t.m0 + 64 * cw + frag_row(wt), n = t.n0 + frag_col(wt);
#pragma unroll
    for (int i = 0; i < BN / 8; i++) {
        float v0 = acc[4 * i], v1 = acc[4 * i + 1], v2 = acc[4 * i + 2], v3 = acc[4 * i + 3];
        add_bias<OP>(p, fb, i, v0, v1, v2, v3);
        gg_put_pair<OP>(p, t, m, n + 8 * i, v0, v1);
        gg_put_pair<OP>(p, t, m + 8, n + 8 * i, v2, v3);
    }
}

/* Writes pair (row r, cols c, c + 1) of a 128-byte-per-row chunk ([64][CC]
 * fp32 for wgrad, bf16 otherwise) as TMA's 128-byte swizzle reads it: the
 * 16-byte unit u of row r sits at u ^ (r % 8). */
template <int OP>
__device__ __forceinline__ void put_pair(uint8_t* chunk, int r, int c, float v0, float v1) {
    if (OP == GG_WGRAD)
        *(float2*)(chunk + r * 128 + (((c >> 2) ^ (r & 7)) << 4) + (c & 3) * 4) = make_float2(v0, v1);
    else
        *(__nv_bfloat162*)(chunk + r * 128 + (((c >> 3) ^ (r & 7)) << 4) + (c & 7) * 2) =
            __floats2bfloat162_rn(v0, v1);
}

/* The output staging of consumer warpgroup cw (thread wt of it): C_BUFS
 * chunk buffers used in turn; n counts the chunks sent so far. chunk_begin:
 * thread 0 waits until the copy that last used the next buffer has read it;
 * then every thread writes its part. chunk_end: thread 0 hands the chunk to
 * a TMA store at (c0, c1, c2) of `map` (reduce-add when `add`), which clips
 * it to the tensor's extents. */
struct out_ring {
    uint8_t* buf; /* [C_BUFS][C_BYTES] */
    int n, cw, wt;
};
__device__ __forceinline__ uint8_t* chunk_begin(out_ring& o) {
    if (o.wt == 0) mst_bulk_wait_read<C_BUFS - 1>();
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + o.cw) : "memory");
    return o.buf + (o.n % C_BUFS) * C_BYTES;
}
__device__ __forceinline__ void chunk_end(out_ring& o, const CUtensorMap* map, const uint8_t* chunk, int c0, int c1,
                                          int c2, int add) {
    mst_fence_proxy_async();
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + o.cw) : "memory");
    if (o.wt == 0) mst_tma_out_3d(map, chunk, c0, c1, c2, add);
    o.n++;
}

/* Epilogue through shared memory for consumer o.cw: its rows [64 cw, +64)
 * x 256 columns go out in 128-byte-wide chunks. Forward adds bias[g] *
 * scale[r]; wgrad ACCUMULATE reduce-adds. */
template <int OP>
__device__ __forceinline__ void epilogue_tma(const gg_problem& p, const CUtensorMap* mc, const gg_tile& t,
                                             float (&acc)[128], const frag_bias& fb, out_ring& o) {
    const int cw = o.cw, wt = o.wt;
    constexpr int CC = OP == GG_WGRAD ? 32 : 64; /* columns of one chunk */
    const int r = frag_row(wt), c = frag_col(wt);
    const int row = OP == GG_WGRAD ? t.m0 + 64 * cw : t.row0 + t.m0 + 64 * cw; /* C row of chunk row 0 */
#pragma unroll
    for (int j = 0; j < BN / CC; j++) {
        uint8_t* chunk = chunk_begin(o);
#pragma unroll
        for (int i = 0; i < CC / 8; i++) {
            const float* f = acc + 4 * (j * (CC / 8) + i);
            float v0 = f[0], v1 = f[1], v2 = f[2], v3 = f[3];
            add_bias<OP>(p, fb, j * (CC / 8) + i, v0, v1, v2, v3);
            put_pair<OP>(chunk, r, 8 * i + c, v0, v1);
            put_pair<OP>(chunk, r + 8, 8 * i + c, v2, v3);
        }
        chunk_end(o, mc, chunk, t.n0 + j * CC, row, OP == GG_WGRAD ? t.g : 0, OP == GG_WGRAD && p.accumulate);
    }
}

/* ---- tile hand-out ----
 * The producer thread draws every tile of its CTA from the schedule's
 * counters (integer atomics) and passes the id to the consumers through a
 * ring of TSLOTS ids in shared memory (mbarriers as for the stages); -1 ends
 * the work. Drawing, not striding, lets the CTAs that start late (their SM
 * busy with a stash copy on a side stream) or drew short tiles share the
 * work. wgrad: `back` CTAs draw from the back of the schedule (smallest
 * groups: bound by their main_grad traffic), the rest from the front
 * (largest groups: long K, tensor-core bound), so both kinds run at every
 * moment, and the tiles of a large group start together and walk its K
 * in step, sharing their operands in L2. */
constexpr int TSLOTS = 4;
constexpr int BACK_PCT = 30; /* wgrad CTAs drawing from the back, % of the grid
                                (H100, skewed E=32 / E=64: 24 % and 33 % gave
                                0.77-0.79 of the roof, 42 % 0.75, 50 % 0.73) */
struct tile_pipe {
    uint64_t full[TSLOTS], empty[TSLOTS];
    int32_t id[TSLOTS];
};

template <int OP>
__global__ void __launch_bounds__(THREADS, 1)
    wgmma_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                 const __grid_constant__ CUtensorMap map_c, const __grid_constant__ CUtensorMap map_bh,
                 const gg_problem p, const gg_sched s, const gg_paged pg, int back) {
    extern __shared__ uint8_t smem_raw[];
    __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
    __shared__ tile_pipe tp;
    uint8_t* smem = (uint8_t*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023); /* swizzle atoms */
    uint8_t* sa = smem;                      /* [STAGES][A_BYTES]   */
    uint8_t* sb = smem + STAGES * A_BYTES;   /* [STAGES][B_BYTES]   */
    uint8_t* sc = sb + STAGES * B_BYTES;     /* [2 consumers][C_BUFS][C_BYTES] output chunks */
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (int i = 0; i < STAGES; i++) {
            mst_mbar_init(&full[i], 1);
            mst_mbar_init(&empty[i], CONSUMERS / 32); /* one arrival per consumer warp */
        }
        for (int i = 0; i < TSLOTS; i++) {
            mst_mbar_init(&tp.full[i], 1);
            mst_mbar_init(&tp.empty[i], CONSUMERS / 32);
        }
        mst_mbar_init_fence();
    }
    __syncthreads();
    const int32_t n_tiles = s.hdr[GG_H_TILES];

    if (wg == 0) { /* producer: every tile of this CTA, in order, through the rings */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
        if (threadIdx.x != 0) return;
        const int from_back = (int)blockIdx.x < back;
        int st = 0, ts = 0;
        uint32_t ph = 0, tph = 0;
        for (;;) {
            const int32_t ti = gg_next_tile(s, n_tiles, from_back);
            mst_mbar_wait(&tp.empty[ts], tph ^ 1);
            tp.id[ts] = ti;
            mst_mbar_arrive(&tp.full[ts]);
            if (++ts == TSLOTS) ts = 0, tph ^= 1;
            if (ti < 0) break;
            gg_tile t = gg_decode(p, s, ti, BM, BN);
            if (OP == GG_WGRAD) gg_align_k(t);
            for (int k0 = 0; k0 < t.k_len; k0 += BK) {
                const uint32_t page = OP == GG_WGRAD && pg.table ? lookup_page(pg, t.row0 + k0) : 0;
                mst_mbar_wait(&empty[st], ph ^ 1);
                load_stage<OP>(&map_a, &map_b, &map_bh, pg, page, t, k0, sa + st * A_BYTES, sb + st * B_BYTES,
                               &full[st]);
                if (++st == STAGES) st = 0, ph ^= 1;
            }
        }
        return;
    }

    /* consumers */
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int cw = wg - 1, ct = threadIdx.x - 128, lane = threadIdx.x & 31;
    float acc[128];
    frag_bias fb;
    out_ring out = {sc + cw * C_BUFS * C_BYTES, 0, cw, ct & 127};
    int st = 0, ts = 0;
    uint32_t ph = 0, tph = 0;
    for (;;) {
        mst_mbar_wait(&tp.full[ts], tph);
        const int32_t ti = tp.id[ts];
        __syncwarp();
        if (lane == 0) mst_mbar_arrive(&tp.empty[ts]);
        if (++ts == TSLOTS) ts = 0, tph ^= 1;
        if (ti < 0) break;
        gg_tile t = gg_decode(p, s, ti, BM, BN);
        const int head = OP == GG_WGRAD ? gg_align_k(t) : 0;
        const int nk = gg_cdiv(t.k_len, BK);
        /* forward / dgrad: a warpgroup whose 64 rows all lie past the
         * group's count (a tile of at most 64 rows) multiplies nothing and
         * stores nothing; the other then has the tensor cores to itself */
        const int idle = OP != GG_WGRAD && t.m0 + 64 * cw >= t.m_lim;
        load_bias<OP>(p, t, cw, ct & 127, fb);
#pragma unroll
        for (int i = 0; i < 128; i++) acc[i] = 0.0f;
        fence_acc(acc);
        int prev = -1;
        for (int kb = 0; kb < nk; kb++) {
            mst_mbar_wait(&full[st], ph);
            uint8_t* a = sa + st * A_BYTES;
            uint8_t* b = sb + st * B_BYTES;
            const int lo = kb ? 0 : head, hi = min(t.k_len - kb * BK, BK);
            if (OP == GG_WGRAD && hi < BK) zero_rows(a, b, lo, hi, ct);
            else if (OP == GG_WGRAD && lo > 0) zero_head(a, lo, cw, ct & 127);
            if (!idle) {
                wgmma_fence();
                mma_block<OP>(acc, mst_smem_u32(a), mst_smem_u32(b), cw);
                wgmma_commit();
            }
            wgmma_wait<1>(); /* the previous stage's MMAs are done: hand it back */
            fence_acc(acc);
            if (prev >= 0 && lane == 0) mst_mbar_arrive(&empty[prev]);
            prev = st;
            if (++st == STAGES) st = 0, ph ^= 1;
        }
        wgmma_wait<0>();
        fence_acc(acc);
        if (prev >= 0 && lane == 0) mst_mbar_arrive(&empty[prev]);
        /* forward / dgrad rows past the group's count must not be written:
         * a warpgroup with such rows stores from registers, masked */
        const int staged = OP == GG_WGRAD || (p.staged_out && t.m0 + 64 * (cw + 1) <= t.m_lim);
        if (idle) continue;
        if (staged) epilogue_tma<OP>(p, &map_c, t, acc, fb, out);
        else epilogue<OP>(p, t, acc, fb, cw, ct & 127);
    }
    if ((ct & 127) == 0) mst_bulk_wait_all(); /* staging buffers read, C written */
}

/* ---- host ---- */

/* cuTensorMapEncodeTiled through the runtime's driver entry point, so the
 * library does not link libcuda (CPU-only machines load it without one). */
typedef CUresult (*encode_tiled_fn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                    const cuuint64_t*, const cuuint32_t*, const cuuint32_t*,
                                    CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                    CUtensorMapFloatOOBfill);

mst_status encoder(encode_tiled_fn* out) {
    static encode_tiled_fn fn = NULL;
    if (!fn) {
        cudaDriverEntryPointQueryResult q;
        void* f = NULL;
        MST_CUDA_TRY(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
        if (q != cudaDriverEntryPointSuccess || !f)
            return mst_set_error(MST_ERR_BACKEND, "cuTensorMapEncodeTiled not found in the driver (query %d)", (int)q);
        fn = (encode_tiled_fn)f;
    }
    *out = fn;
    return MST_OK;
}

/* A tensor map of rank 2 ([rows][cols]) or 3 ([groups][rows][cols]) of
 * bf16 (elem 2) or fp32 (elem 4) with a box of box_cols (one 128-byte
 * swizzle row at most) x box_rows. */
mst_status make_map(CUtensorMap* map, const void* base, int elem, int rank, int64_t cols, int64_t rows,
                    int64_t groups, uint32_t box_cols, uint32_t box_rows) {
    cuuint64_t dim[3] = {(cuuint64_t)cols, (cuuint64_t)rows, (cuuint64_t)groups};
    cuuint64_t stride[2] = {(cuuint64_t)(cols * elem), (cuuint64_t)(cols * rows * elem)};
    cuuint32_t box[3] = {box_cols, box_rows, 1}, estride[3] = {1, 1, 1};
    encode_tiled_fn encode = NULL;
    MST_TRY(encoder(&encode));
    const CUtensorMapDataType type = elem == 4 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    CUresult r = encode(map, type, (cuuint32_t)rank, (void*)base, dim,
                                        stride, box, estride, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return mst_set_error(MST_ERR_BACKEND, "cuTensorMapEncodeTiled (%lld x %lld x %lld, box %u x %u) failed: %d",
                             (long long)groups, (long long)rows, (long long)cols, box_rows, box_cols, (int)r);
    return MST_OK;
}

/* wgrad's x in pages: maps of the device and the host block as [pages]
 * [page_rows][I] (boxes of BK rows x 64), and the kernel's view. A block
 * without pages gets the other's map (no id reaches it). */
mst_status make_paged(const gg_problem* p, const mst_pages* x, CUtensorMap* mbd, CUtensorMap* mbh, gg_paged* pg) {
    CUtensorMap* maps[2] = {mbd, mbh};
    for (int b = 0; b < 2; b++)
        if (x->n_pages[b] > 0)
            MST_TRY(make_map(maps[b], x->block[b], 2, 3, p->ldb, x->page_rows, x->n_pages[b], 64, BK));
    if (x->n_pages[0] == 0) *mbd = *mbh;
    if (x->n_pages[1] == 0) *mbh = *mbd;
    pg->table = x->table;
    while ((1ll << pg->page_shift) < x->page_rows) pg->page_shift++;
    pg->table_pages = (int32_t)(x->table_rows / x->page_rows);
    pg->n_pages[0] = (int32_t)x->n_pages[0];
    pg->n_pages[1] = (int32_t)x->n_pages[1];
    for (int b = 0; b < 2; b++) pg->map_pages[b] = pg->n_pages[pg->n_pages[b] > 0 ? b : 1 - b];
    return MST_OK;
}

/* Tensor maps of the op's operands (K-major boxes are [BM or BN rows][BK],
 * M/N-major boxes [BK rows][64]) and of C (boxes of 64 rows x 128 bytes). */
mst_status make_maps(const gg_problem* p, int64_t max_rows, CUtensorMap* ma, CUtensorMap* mb, CUtensorMap* mc) {
    const int64_t E = p->n_groups;
    if (p->op == GG_FWD) { /* x [R][I], W [E][O][I] */
        MST_TRY(make_map(ma, p->a, 2, 2, p->lda, max_rows, 1, BK, BM));
        MST_TRY(make_map(mc, p->c, 2, 3, p->ldc, max_rows, 1, 64, 64)); /* y [1][R][O] */
        return make_map(mb, p->b, 2, 3, p->ldb, p->N, E, BK, BN);
    }
    if (p->op == GG_DGRAD) { /* dy [R][O], W [E][O][I] */
        MST_TRY(make_map(ma, p->a, 2, 2, p->lda, max_rows, 1, BK, BM));
        MST_TRY(make_map(mc, p->c, 2, 3, p->ldc, max_rows, 1, 64, 64)); /* dx [1][R][I] */
        return make_map(mb, p->b, 2, 3, p->ldb, p->K, E, 64, BK);
    }
    MST_TRY(make_map(ma, p->a, 2, 2, p->lda, max_rows, 1, 64, BK));      /* dy [R][O] */
    if (p->b) MST_TRY(make_map(mb, p->b, 2, 2, p->ldb, max_rows, 1, 64, BK)); /* x [R][I], unless paged */
    return make_map(mc, p->c, 4, 3, p->ldc, p->M, E, 32, 64);            /* main_grad [E][O][I] */
}

template <int OP>
mst_status setup() {
    MST_CUDA_TRY(cudaFuncSetAttribute(wgmma_kernel<OP>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM_BYTES));
    return MST_OK;
}

template <int OP>
mst_status launch(const gg_problem* p, const gg_sched* s, int64_t max_rows, const mst_cuda_impl* c,
                  const mst_pages* x_pages) {
    CUtensorMap ma, mb, mc, mbh;
    gg_paged pg = {};
    MST_TRY(make_maps(p, max_rows, &ma, &mb, &mc));
    if (x_pages) MST_TRY(make_paged(p, x_pages, &mb, &mbh, &pg));
    else mbh = mb;
    const int back = OP == GG_WGRAD ? c->n_sm * BACK_PCT / 100 : 0;
    wgmma_kernel<OP><<<c->n_sm, THREADS, SMEM_BYTES, c->stream>>>(ma, mb, mc, mbh, *p, *s, pg, back);
    MST_CUDA_LAUNCHED();
    return MST_OK;
}

} // namespace

extern "C" mst_status gg_wgmma_setup(void) {
    MST_TRY(setup<GG_FWD>());
    MST_TRY(setup<GG_DGRAD>());
    return setup<GG_WGRAD>();
}

extern "C" mst_status gg_launch_wgmma(const gg_problem* p, const gg_sched* s, int64_t max_rows,
                                      const mst_cuda_impl* c, const mst_pages* x_pages) {
    switch (p->op) {
    case GG_FWD: return launch<GG_FWD>(p, s, max_rows, c, NULL);
    case GG_DGRAD: return launch<GG_DGRAD>(p, s, max_rows, c, NULL);
    default: return launch<GG_WGRAD>(p, s, max_rows, c, x_pages);
    }
}

extern "C" void gg_wgmma_tile(int* bm, int* bn) {
    *bm = BM;
    *bn = BN;
}
