// head_loss_sm90: head_loss (head_loss.cu) on Hopper's warpgroup MMAs, for sm_90a only
// (gpu.py compiles this program apart: common.cuh, tiles.cuh, this file).
//
// The arithmetic and the result are head_loss's; only the way the products are made
// differs. head_loss's warps load every MMA fragment from shared memory through their
// registers, for each vocabulary tile again, and the tensor cores wait while the warps
// run a tile's epilogue. Here `wgmma.mma_async` reads both operands straight from
// shared memory, for a warpgroup (4 warps, 64 rows) at a time, and runs asynchronously:
// each warpgroup starts tile t + 1's products into a second set of accumulators and
// then runs tile t's epilogue, so the tensor cores and the warps work at once.
//
// A block is four warpgroups (512 threads) owning TILE_M = 256 rows: the embedding
// table is read from L2 once per 256 rows and pass, as in head_loss. The rows and two
// vocabulary tiles sit in shared memory in wgmma's K-major layout without swizzle:
// "core matrices" of 8 rows x 16 bytes, 128 contiguous bytes each, the core matrix of
// row group r / 8 and bytes k / 16 at ((r / 8) * HIDDEN / 16 + k / 16) * 128. Copying
// 16-byte pieces in that order makes the shared address 16 x the piece's index.
//
// The accumulator of `wgmma m64n64k32` is mma.sync's m16n8 layout once per warp and
// 8-column group: thread (warp w of the group, g = lane / 4, tig = lane % 4) holds rows
// 16 w + g and 16 w + g + 8, columns 8 j + 2 tig and + 1, as d[4 j + 2 s + e].

#define CORE_LBO 128           // bytes from one core matrix to the next along K
#define CORE_SBO (8 * HIDDEN)  // bytes from one row group (8 rows) to the next
#define SM90_THREADS (2 * TILE_M)  // four warpgroups of 64 rows

// Rows [first, first + n) of a K-contiguous int8 matrix into shared memory in the
// core-matrix layout above, asynchronously; rows at or past `valid` are zeros.
__device__ __forceinline__ void rows_to_cores(i8* to, const i8* from, int first, int n, int valid) {
    for (int i = threadIdx.x; i < n * TILE_PIECES; i += blockDim.x) {
        const int r = (i >> 3) / TILE_PIECES * 8 + (i & 7), piece = (i >> 3) % TILE_PIECES;
        if (first + r < valid)
            copy16_async(to + 16 * i, from + (long)(first + r) * HIDDEN + 16 * piece);
        else
            *(int4*)(to + 16 * i) = make_int4(0, 0, 0, 0);
    }
}

// The shared-memory matrix descriptor of wgmma: start address, the two strides (all in
// 16-byte units), no swizzle (bits 62-63 zero).
__device__ __forceinline__ u64 core_descriptor(const i8* at) {
    const u32 a = (u32)__cvta_generic_to_shared(at);
    return (u64)((a & 0x3FFFF) >> 4) | ((u64)(CORE_LBO >> 4) << 16) | ((u64)(CORE_SBO >> 4) << 32);
}

// Writes of the generic proxy (cp.async, plain stores) become visible to wgmma's reads.
__device__ __forceinline__ void fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// d (+)= A[64 rows, 32 bytes] B[64 rows, 32 bytes]^T for the warpgroup; asynchronous
// until wgmma_wait. accumulate 0 overwrites d.
__device__ __forceinline__ void wgmma_64x64x32(int (&d)[32], u64 a, u64 b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p;\n}\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]),
          "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]),
          "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]),
          "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]),
          "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]),
          "+r"(d[31])
        : "l"(a), "l"(b), "r"(accumulate));
}

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

// Waits for the warpgroup's products; d's registers are then the results (the empty
// asm keeps the compiler from reading them before the wait).
__device__ __forceinline__ void tile_product_wait(int (&d)[32]) {
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
    for (int i = 0; i < 32; i++) asm volatile("" : "+r"(d[i])::"memory");
}

extern "C" __global__ void __launch_bounds__(SM90_THREADS, 1)
head_loss_sm90(const i8* y, const i8* emb_t, const int* sb, const int* tokens, const u32* seeds,
               const int* signs, const i8* ov_out, u32 off_a, const int* exp_tab, u32* loss,
               int rows) {
    extern __shared__ __align__(128) unsigned char head_loss_sm90_shared[];
    i8* s_a = (i8*)head_loss_sm90_shared;          // TILE_M rows, core matrices
    i8* s_b = s_a + TILE_M * HIDDEN;               // [2] tiles of TILE_N rows, core matrices
    int* s_av = (int*)(s_b + 2 * TILE_N * HIDDEN);  // [3][TILE_MEMBERS][TILE_N]
    int* s_exp = s_av + 3 * TILE_MEMBERS * TILE_N;  // [LUT_SIZE]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int row0 = blockIdx.x * TILE_M;
    const int m0 = row0 / SEQ;
    const int n_members = (min(row0 + TILE_M, rows) - 1) / SEQ - m0 + 1;
    const int tiles = (VOCAB + TILE_N - 1) / TILE_N;
    const i8* s_rows = s_a + (warp >> 2) * 64 * HIDDEN;  // the warpgroup's 64 rows

    rows_to_cores(s_a, y, row0, TILE_M, rows);
    copy_commit();
    for (int i = threadIdx.x; i < LUT_SIZE; i += blockDim.x) s_exp[i] = exp_tab[i];

    // The thread's two rows, 16 warp + g + 8 s of the block's: input dot times the
    // member's sign (u32: wraps as the CPU's int32), member counted from m0, existence.
    u32 sbs[2];
    int member[2];
    bool valid[2];
#pragma unroll
    for (int s = 0; s < 2; s++) {
        const int row = row0 + 16 * warp + g + 8 * s;
        valid[s] = row < rows;
        const int m = valid[s] ? row / SEQ : m0;
        member[s] = m - m0;
        sbs[s] = valid[s] ? (u32)sb[row] * (u32)signs[m] : 0u;
    }

    auto load_tile = [&](int tile) {
        rows_to_cores(s_b + (tile & 1) * TILE_N * HIDDEN, emb_t, tile * TILE_N, TILE_N, VOCAB);
        copy_commit();
        tile_noise(s_av + (tile % 3) * TILE_MEMBERS * TILE_N, n_members, m0, seeds, off_a, ov_out,
                   tile * TILE_N, VOCAB);
    };

    int peak[2] = {INT_MIN_, INT_MIN_};
    unsigned long long total[2] = {0ull, 0ull};

    // Tile t's epilogue on its products d: pass 0 the rows' peaks, pass 1 their sums.
    auto epilogue = [&](const int (&d)[32], int tile, int pass) {
        const int* av = s_av + (tile % 3) * TILE_MEMBERS * TILE_N;
        const int v0 = tile * TILE_N;
#if TOTAL32
        u32 part[2] = {0u, 0u};
#else
        unsigned long long* part = total;
#endif
#pragma unroll
        for (int j = 0; j < TILE_N / 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = 8 * j + 2 * tig + e;
                if (VOCAB_PAD && v0 + col >= VOCAB) continue;
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    const int m = SEQ % 16 == 0 ? member[0] : member[s];  // a warp's rows share one
                    const int raw = wrap_add(d[4 * j + 2 * s + e], rank1_term(sbs[s], av[m * TILE_N + col]));
                    if (pass == 0) {
                        peak[s] = max(peak[s], raw);
                    } else {
                        const u32 dist = (u32)peak[s] - (u32)(raw >> SHIFT_LOGIT);  // >= 0
                        part[s] += s_exp[min(dist, (u32)(LUT_SIZE - 1))];
                    }
                }
            }
#if TOTAL32
        if (pass == 1)
#pragma unroll
            for (int s = 0; s < 2; s++) total[s] += part[s];
#endif
    };

    // One step of a sweep: tile t's products (in `now`) are waited for; once every
    // warpgroup is past them, tile t + 1's start into `next`, tile t + 2 loads into the
    // buffer t's used, and t's epilogue runs while the tensor cores work.
    auto step = [&](int (&now)[32], int (&next)[32], int tile, int pass) {
        tile_product_wait(now);
        copy_wait<0>();  // tile t + 1, the last copy committed
        fence_async_shared();
        __syncthreads();
        if (tile + 1 < tiles) tile_product_async(next, s_rows, s_b + ((tile + 1) & 1) * TILE_N * HIDDEN);
        if (tile + 2 < tiles) load_tile(tile + 2);
        epilogue(now, tile, pass);
    };

    int d0[32], d1[32];
    for (int pass = 0; pass < 2; pass++) {
        __syncthreads();  // the last pass's epilogue has read its noise tables
        load_tile(0);
        if (tiles > 1) load_tile(1);
        if (tiles > 1) copy_wait<1>(); else copy_wait<0>();
        fence_async_shared();
        __syncthreads();
        tile_product_async(d0, s_rows, s_b);
        for (int tile = 0; tile < tiles; tile += 2) {
            step(d0, d1, tile, pass);
            if (tile + 1 < tiles) step(d1, d0, tile + 1, pass);
        }
        if (pass == 0) {  // the quad of threads holding a row shares its peak
#pragma unroll
            for (int s = 0; s < 2; s++) {
                int p = max(peak[s], __shfl_xor_sync(0xffffffffu, peak[s], 1));
                p = max(p, __shfl_xor_sync(0xffffffffu, p, 2));
                peak[s] = p >> SHIFT_LOGIT;
            }
        }
    }

    // The target's logit: the quad splits the row's dot product with its embedding row.
#pragma unroll
    for (int s = 0; s < 2; s++) {
        unsigned long long t = total[s];
        t += __shfl_xor_sync(0xffffffffu, t, 1);
        t += __shfl_xor_sync(0xffffffffu, t, 2);
        const int r = 16 * warp + g + 8 * s;  // of the block's rows
        const int m = m0 + member[s];
        const int target = valid[s] ? tokens[m * (SEQ + 1) + (row0 + r) % SEQ + 1] : 0;
        const i8* cores = s_a + (r >> 3) * CORE_SBO + (r & 7) * 16 + 4 * tig;
        const i8* e_row = emb_t + (long)target * HIDDEN + 4 * tig;
        int dot = 0;
        for (int piece = 0; piece < TILE_PIECES; piece++)
            dot = __dp4a(*(const int*)(cores + piece * CORE_LBO), *(const int*)(e_row + 16 * piece), dot);
        dot += __shfl_xor_sync(0xffffffffu, dot, 1);
        dot += __shfl_xor_sync(0xffffffffu, dot, 2);
        if (tig == 0 && valid[s])
            add_position_loss(loss + m, t, peak[s], dot, sbs[s], seeds[m] + off_a, ov_out, target);
    }
}
