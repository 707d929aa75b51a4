// Warpgroup MMAs on Hopper (sm_90a only: gpu/plan.py's PROGRAMS["sm90a"] is a program of
// their own), for the kernels that fuse a GEMM with its epilogue: head_loss_sm90.cu,
// up_gelu_sm90.cu, qkv_rope_sm90.cu, residual_sm90.cu.
//
// A block's warpgroups own 64 rows each (head_loss_sm90: four or two, HEAD_ROWS rows;
// qkv_rope_sm90: one, which takes a whole matrix's products at once and does not sweep;
// residual_sm90.cu's: two, taking all columns at once and K in slices, its own pipeline;
// up_gelu_sm90: one, or two of 32 rows, UP_WG_ROWS, so that two or three blocks share an
// SM, its products transposed: the matrix's rows as the MMA's rows); head_loss_sm90 and
// up_gelu_sm90 sweep a weight matrix Wt[out, HIDDEN] in tiles of TILE_N rows.
// `wgmma.mma_async` reads both operands straight from shared memory (head_loss_sm90's
// rows from registers: tile_product_regs) and runs asynchronously: each warpgroup
// starts tile t + 1's products into a second set of accumulators, then runs tile t's
// epilogue, so the tensor cores and the warps work at once (`sweep_async`).
// That holds only if ptxas sees every product it waits for issued on every path: where
// one is issued under a condition (the last tile's "next"), ptxas cannot tell at the loop
// edge which accumulators are in flight and injects a wait after each product (its
// message C7517; tests/test_kernels.py fails on it). So the product after the last tile
// is issued anyway, into accumulators that are then dropped.
//
// The rows and the tiles sit in shared memory in wgmma's K-major layout without
// swizzle: "core matrices" of 8 rows x 16 bytes, 128 contiguous bytes each, the core
// matrix of row group r / 8 and bytes k / 16 at ((r / 8) * HIDDEN / 16 + k / 16) * 128
// (residual_sm90.cu's matrix slices: SLICE bytes of K in place of HIDDEN; its rows'
// slices are in the 128-byte swizzle instead, residual_sm90.cu's rows_descriptor).
// Copying 16-byte pieces in that order makes the shared address 16 x the piece's index.
//
// The accumulator of `wgmma m64n64k32` is mma.sync's m16n8 layout once per warp and
// 8-column group: thread (warp w of the group, g = lane / 4, tig = lane % 4) holds rows
// 16 w + g and 16 w + g + 8, columns 8 j + 2 tig and + 1, as d[4 j + 2 s + e].

#pragma once
#include "common.cuh"
#include "tiles.cuh"

#define CORE_LBO 128           // bytes from one core matrix to the next along K
#define CORE_SBO (8 * HIDDEN)  // bytes from one row group (8 rows) to the next

// Rows [first, first + n) of a K-contiguous int8 matrix into shared memory in the
// core-matrix layout above, asynchronously; rows at or past `valid` are zeros. For the
// activation rows only: the weights are kept on the device in that layout already, in
// the order the kernel's tiles take their rows (gpu/cores.py's CoreCopy), and copied whole by
// bulk_copy below; gathering each piece from a row-major matrix took a third of
// qkv_rope_sm90's warp samples.
__device__ __forceinline__ void rows_to_cores(i8* to, const i8* from, int first, int n, int valid) {
    for (int i = threadIdx.x; i < n * TILE_PIECES; i += blockDim.x) {
        const int r = (i >> 3) / TILE_PIECES * 8 + (i & 7), piece = (i >> 3) % TILE_PIECES;
        if (first + r < valid)
            copy16_async(to + 16 * i, from + (long)(first + r) * HIDDEN + 16 * piece);
        else
            *(int4*)(to + 16 * i) = make_int4(0, 0, 0, 0);
    }
}

// The shared-memory matrix descriptor of wgmma: start address, the two strides (bytes
// to the next core matrix along K, and to the next 8 rows; all in 16-byte units), no
// swizzle (bits 62-63 zero). Rows of K = HIDDEN bytes by default.
__device__ __forceinline__ u64 core_descriptor(const i8* at, u32 sbo = CORE_SBO) {
    const u32 a = shared_address(at);
    return (u64)((a & 0x3FFFF) >> 4) | ((u64)(CORE_LBO >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}
// The descriptor of the operand `bytes` further on: the start address field (14 bits,
// 16-byte units) holds every shared address, so one add (from the address, ptxas
// remade a descriptor in five instructions).
__device__ __forceinline__ u64 descriptor_plus(u64 descriptor, int bytes) { return descriptor + bytes / 16; }

// The thread's warpgroup in its block, as lane 0 of its warp has it: the compiler then
// knows the value is the warp's (threadIdx.x / 128 it treats as the thread's own) and keeps
// the MMA descriptors made from it in uniform registers, where each MMA had moved its
// descriptor there from ordinary registers (two R2UR an MMA, in the instructions' path).
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, threadIdx.x / 128, 0); }

// Writes of the generic proxy (cp.async, plain stores) become visible to wgmma's reads.
__device__ __forceinline__ void fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The asm operands of a warpgroup's 16 or 32 accumulators (%0 on) and their text.
#define ACC16(d)                                                                                    \
    "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), \
        "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]),     \
        "+r"(d[15])
#define ACC32(d)                                                                                      \
    ACC16(d), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]),           \
        "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]),    \
        "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
#define ACC16_TEXT "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define ACC32_TEXT                                                                      \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, " \
    "%18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

// d (+)= A[64 rows, 32 bytes] B[64 rows, 32 bytes]^T for the warpgroup; asynchronous
// until wgmma_wait. accumulate 0 overwrites d.
__device__ __forceinline__ void wgmma_64x64x32(int (&d)[32], u64 a, u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 " ACC32_TEXT ", %32, %33, p;\n}\n"
                 : ACC32(d)
                 : "l"(a), "l"(b), "r"(accumulate));
}

// The same with A from registers: a, wgmma's A fragment of the step (rows_to_fragments).
__device__ __forceinline__ void wgmma_64x64x32(int (&d)[32], const u32 (&a)[4], u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 " ACC32_TEXT ", {%32, %33, %34, %35}, %36, p;\n}\n"
                 : ACC32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

// The same with B's descriptor at K step K (32 bytes a step) made in the asm from the
// low word at step 0 and the high word (as wgmma_64xNx32 below): at hidden 1024 the
// 32 steps' descriptors, made before the products, spilled head_loss_sm90's registers.
template <int K>
__device__ __forceinline__ void wgmma_64x64x32(int (&d)[32], const u32 (&a)[4], u32 b, u32 high, int accumulate) {
    asm volatile("{\n.reg .pred p;\n.reg .b32 lb;\n.reg .b64 db;\n"
                 "setp.ne.b32 p, %38, 0;\n"
                 "add.u32 lb, %36, %39;\nmov.b64 db, {lb, %37};\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 " ACC32_TEXT ", {%32, %33, %34, %35}, db, p;\n}\n"
                 : ACC32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b), "r"(high), "r"(accumulate),
                   "n"(2 * CORE_LBO / 16 * K));
}

// d = A[64 rows, 32 bytes] B[N rows, 32 bytes]^T, or d += it (accumulate), N = 32 (16
// accumulators) or 64 (32), at K step K (32 bytes a step) of descriptors a and b given by
// their low words at step 0 (core_descriptor's) and their common high word: made in the
// asm, so that the compiler keeps three registers and not every step's two 64-bit
// descriptors (up_gelu_sm90 spilled them).
// (A, B, H, P, O: the asm's operand numbers of a, b, high, accumulate and the offset)
#define WGMMA_64XNX32(N, ACC, TEXT, A, B, H, P, O)                                          \
    asm volatile("{\n.reg .pred p;\n.reg .b32 la, lb;\n.reg .b64 da, db;\n"               \
                 "setp.ne.b32 p, %" P ", 0;\n"                                               \
                 "add.u32 la, %" A ", %" O ";\nadd.u32 lb, %" B ", %" O ";\n"                \
                 "mov.b64 da, {la, %" H "};\nmov.b64 db, {lb, %" H "};\n"                    \
                 "wgmma.mma_async.sync.aligned.m64n" N "k32.s32.s8.s8 " TEXT ", da, db, p;\n}\n" \
                 : ACC(d)                                                                   \
                 : "r"(a), "r"(b), "r"(high), "r"(accumulate), "n"(2 * CORE_LBO / 16 * K))
template <int K>
__device__ __forceinline__ void wgmma_64xNx32(int (&d)[16], u32 a, u32 b, u32 high, int accumulate) {
    WGMMA_64XNX32("32", ACC16, ACC16_TEXT, "16", "17", "18", "19", "20");
}
template <int K>
__device__ __forceinline__ void wgmma_64xNx32(int (&d)[32], u32 a, u32 b, u32 high, int accumulate) {
    WGMMA_64XNX32("64", ACC32, ACC32_TEXT, "32", "33", "34", "35", "36");
}
#undef WGMMA_64XNX32

// d (+)= A[64 rows, 32 bytes] B[N rows, 32 bytes]^T for N = 128 or 256 (N / 2
// accumulators: columns 64 c + 8 j + 2 tig + e in d[32 c + 4 j + 2 s + e], as N / 64
// m64n64k32 products side by side), both operands' descriptors given. One MMA reads A's
// bytes from shared memory once for all N columns, where N / 64 products read them N / 64
// times.
#define R10(t) "%" t "0, %" t "1, %" t "2, %" t "3, %" t "4, %" t "5, %" t "6, %" t "7, %" t "8, %" t "9"
#define ACC8(d, o) "+r"(d[o]), "+r"(d[o + 1]), "+r"(d[o + 2]), "+r"(d[o + 3]), "+r"(d[o + 4]), \
    "+r"(d[o + 5]), "+r"(d[o + 6]), "+r"(d[o + 7])
#define ACC64(d, o) ACC8(d, o), ACC8(d, o + 8), ACC8(d, o + 16), ACC8(d, o + 24), ACC8(d, o + 32), \
    ACC8(d, o + 40), ACC8(d, o + 48), ACC8(d, o + 56)
__device__ __forceinline__ void wgmma_64xNx32(int (&d)[64], u64 a, u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, "
                 R10("1") ", " R10("2") ", " R10("3") ", " R10("4") ", " R10("5") ", %60, %61, %62, %63}, "
                 "%64, %65, p;\n}\n"
                 : ACC64(d, 0)
                 : "l"(a), "l"(b), "r"(accumulate));
}
__device__ __forceinline__ void wgmma_64xNx32(int (&d)[128], u64 a, u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, "
                 R10("1") ", " R10("2") ", " R10("3") ", " R10("4") ", " R10("5") ", " R10("6") ", " R10("7") ", "
                 R10("8") ", " R10("9") ", " R10("10") ", " R10("11") ", %120, %121, %122, %123, %124, %125, %126, "
                 "%127}, %128, %129, p;\n}\n"
                 : ACC64(d, 0), ACC64(d, 64)
                 : "l"(a), "l"(b), "r"(accumulate));
}
#undef R10
#undef ACC8
#undef ACC64

// The warpgroup's 64 rows (s_a) times a tile's TILE_N rows (s_b), K = HIDDEN, into d:
// issued and committed as one group, not waited for.
__device__ __forceinline__ void tile_product_async(int (&d)[32], const i8* s_a, const i8* s_b) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int k = 0; k < TILE_PIECES / 2; k++)  // 32 bytes of K a step: two core matrices
        wgmma_64x64x32(d, core_descriptor(s_a + 2 * CORE_LBO * k),
                       core_descriptor(s_b + 2 * CORE_LBO * k), k > 0);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// The warpgroup's 64 rows (s_a) times T tiles of TILE_N rows side by side (s_b), K =
// HIDDEN, into d[c] for tile c (as tile_product_async's): one MMA a K step where its
// shape exists (T = 2 or 4), issued and committed as one group, not waited for.
template <int T>
__device__ __forceinline__ void tiles_product_async(int (&d)[T][32], const i8* s_a, const i8* s_b) {
    if constexpr (T == 2 || T == 4) {
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int k = 0; k < TILE_PIECES / 2; k++)
            wgmma_64xNx32(reinterpret_cast<int(&)[T * 32]>(d), core_descriptor(s_a + 2 * CORE_LBO * k),
                          core_descriptor(s_b + 2 * CORE_LBO * k), k > 0);
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    } else {
#pragma unroll
        for (int c = 0; c < T; c++) tile_product_async(d[c], s_a, s_b + c * TILE_N * HIDDEN);
    }
}

// Steps K.. of a product with A from registers (tile_product_regs), B's descriptors made
// in the asm.
template <int K = 0, int STEPS>
__device__ __forceinline__ void tile_product_steps(int (&d)[32], const u32 (&a)[STEPS][4], u32 b, u32 high) {
    if constexpr (K < STEPS) {
        wgmma_64x64x32<K>(d, a[K], b, high, K > 0);
        tile_product_steps<K + 1>(d, a, b, high);
    }
}

// As tile_product_async with the warpgroup's rows from registers (a, rows_to_fragments's)
// rather than shared memory: its products then read only the tile there, half the
// bytes a product, where shared memory's bandwidth and not the tensor cores had set
// their pace.
template <int STEPS>
__device__ __forceinline__ void tile_product_regs(int (&d)[32], const u32 (&a)[STEPS][4], const i8* s_b) {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    const u64 b = core_descriptor(s_b);
    if constexpr (STEPS > 8) {
        tile_product_steps(d, a, (u32)b, (u32)(b >> 32));
    } else {  // a uniform 64-bit add a step
#pragma unroll
        for (int k = 0; k < STEPS; k++) wgmma_64x64x32(d, a[k], descriptor_plus(b, 2 * CORE_LBO * k), k > 0);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// The warpgroup's 64 rows of K = 32 STEPS bytes (s_rows, the core-matrix layout) as
// wgmma's A fragments, step k's in a[k]: thread (warp w of the group, g = lane / 4,
// tig = lane % 4) holds rows 16 w + g and + 8, bytes 4 tig to 4 tig + 3 and those 16
// further, in the order (g, 0), (g + 8, 0), (g, 16), (g + 8, 16) (CUTLASS's
// ALayout_64x32).
template <int STEPS>
__device__ __forceinline__ void rows_to_fragments(u32 (&a)[STEPS][4], const i8* s_rows) {
    static_assert(32 * STEPS == HIDDEN, "CORE_SBO: rows of K = HIDDEN bytes");
    const int lane = threadIdx.x & 31, w = (threadIdx.x >> 5) & 3;
    const i8* at = s_rows + 2 * w * CORE_SBO + (lane >> 2) * 16 + 4 * (lane & 3);
#pragma unroll
    for (int k = 0; k < STEPS; k++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            a[k][i] = *(const u32*)(at + (i & 1) * CORE_SBO + (2 * k + (i >> 1)) * CORE_LBO);
}

// Waits for the warpgroup's products; d's registers are then the results (the empty
// asm keeps the compiler from reading them before the wait).
template <int N>
__device__ __forceinline__ void tile_product_wait(int (&d)[N]) {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+r"(d[i])::"memory");
}

// Bulk copies (the TMA unit's cp.async.bulk) that complete on a shared-memory barrier
// (mbarrier): one thread starts a whole tile's copy, and the warps wait for the barrier's
// phase to flip. Copy and wgmma both act through the async proxy, so no proxy fence
// stands between them, and no warp issues or waits for per-piece copies.

// One arrival a phase (the copy's thread); the fence makes the barrier visible to the
// async proxy. The block's other threads wait on it only after a __syncthreads.
__device__ __forceinline__ void barrier_init(u64* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(shared_address(bar)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void barrier_inval(u64* bar) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(shared_address(bar)) : "memory");
}

// BYTES (a multiple of 16) from global to shared memory; bar's phase completes with them.
__device__ __forceinline__ void bulk_copy(void* to, const void* from, u32 bytes, u64* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     shared_address(to)),
                 "l"(from), "r"(bytes), "r"(shared_address(bar))
                 : "memory");
}

// Until bar has completed the phase of this parity (0 its first, 1 its second, ...).
__device__ __forceinline__ void barrier_wait(u64* bar, u32 parity) {
    u32 done = 0;
    while (!done)
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(shared_address(bar)), "r"(parity)
            : "memory");
}

// A shared counter's value before one is added, ordered (acquire and release) with the
// block's other memory operations around it.
__device__ __forceinline__ u32 count_arrival(u32* counter) {
    u32 before;
    asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], 1;\n"
                 : "=r"(before)
                 : "r"(shared_address(counter))
                 : "memory");
    return before;
}

// One sweep over n tiles of a weight matrix kept in the order the sweep takes it
// (tiles: tile t's BYTES at t BYTES, in the core-matrix layout; gpu/cores.py's
// CoreCopy), through s_b's two buffers. product(d, tile) starts the warpgroup's
// products with the tile in shared memory into its ACC accumulators d
// (tile_product_async, as one committed group); epilogue(d, t) gets them for tile t and
// may overwrite them (the next product into d starts from zero, behind wgmma.fence).
// The block's rows (the operand product reads besides the tile) must be in shared
// memory, their cp.async copy committed before. THREADS is the block's size as
// launched: the refills count its warps. Tables the epilogues read are best
// built before: between two tiles, a global load's wait stalls every warp.
template <u32 BYTES, int ACC, int THREADS, typename Product, typename Epilogue>
__device__ __forceinline__ void sweep_async(int n, i8* s_b, const i8* tiles, Product product,
                                            Epilogue epilogue) {
    __shared__ __align__(8) u64 full[2];  // buffer b holds its tile
    __shared__ u32 done[2];               // warps done with buffer b's products, over the sweep
    __syncthreads();  // the last sweep's epilogue is done with its buffers and tables
    if (threadIdx.x == 0) {
        done[0] = done[1] = 0;
        barrier_init(&full[0]);
        barrier_init(&full[1]);
        bulk_copy(s_b, tiles, BYTES, &full[0]);
        if (n > 1) bulk_copy(s_b + BYTES, tiles + BYTES, BYTES, &full[1]);
    }
    copy_wait<0>();  // the rows
    fence_async_shared();
    __syncthreads();  // the rows in place, the barriers initialised
    barrier_wait(&full[0], 0);
    // Tile t's products (in `now`) are waited for, and tile t + 1's copy; tile t + 1's
    // products start into `next` (past the last tile, a stale buffer's, never read); the
    // block's last warp past t's products copies tile t + 2 into the buffer t used (a
    // count, not a barrier: a warpgroup whose epilogue ran long holds up no other until
    // they need tile t + 2), and t's epilogue runs. Tile t is buffer t % 2's (t / 2)-th
    // fill.
    // A block of one warpgroup, whose warps issue each MMA together anyway, takes a
    // barrier instead (the count made up_gelu_sm90 8% slower).
    constexpr u32 WARPS = THREADS / 32;
    auto step = [&](int (&now)[ACC], int (&next)[ACC], int tile) {
        tile_product_wait(now);
        if (tile + 1 < n) barrier_wait(&full[(tile + 1) & 1], ((tile + 1) >> 1) & 1);
        if (WARPS == 4) __syncthreads();
        product(next, s_b + ((tile + 1) & 1) * BYTES);
        auto refill = [&] {  // tile t + 2 into the buffer t used
            bulk_copy(s_b + (tile & 1) * BYTES, tiles + (long)(tile + 2) * BYTES, BYTES, &full[tile & 1]);
        };
        if (WARPS == 4) {
            if (tile + 2 < n && threadIdx.x == 0) refill();
        } else if (tile < n && (threadIdx.x & 31) == 0) {
            if (count_arrival(&done[tile & 1]) % WARPS == WARPS - 1 && tile + 2 < n) refill();
        }
        if (tile < n) epilogue(now, tile);
    };
    int d0[ACC], d1[ACC];
    product(d0, s_b);
    for (int tile = 0; tile < n; tile += 2) {
        step(d0, d1, tile);
        step(d1, d0, tile + 1);
    }
    tile_product_wait(d0);  // the products past the last tile
    __syncthreads();        // no warp waits on the barriers any more
    // (compute-sanitizer's racecheck pairs a second sweep's first copies with this one's
    // last, across the invalidation: every phase was waited for before this barrier)
    if (threadIdx.x == 0) {
        barrier_inval(&full[0]);
        barrier_inval(&full[1]);
    }
}
