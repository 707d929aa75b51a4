// o_terms_sm90 and down_terms_sm90: the o- and the down-projection's GEMMs on Hopper's
// warpgroup MMAs (wgmma.cuh), writing residual_norm's terms (forward.cu) instead of
// their products.
//
// Unfused, cuBLAS writes rows x HIDDEN int32 products and residual_norm reads them back.
// Here each product becomes its term of the residual,
//     (g + rank-1 term) >> shift,
// which gpu/plan.py's projection_terms_fit() proves fits 16 bits for every input of the config,
// and goes out as such: residual_norm reads half the bytes of a product in its place.
//
// A GEMM pipelined along K: the down-projection's 4 HIDDEN inputs do not fit shared
// memory whole, nor its matrix (256 KB at the default). One block an SM (persistent:
// it takes tiles blockIdx.x, + gridDim.x, ...) of two warpgroups, each on 64 rows of a
// 128-row tile and all HIDDEN columns at once (HIDDEN / 64 accumulators, 128 registers
// a thread at 256). A tile's K is taken in slices of SLICE bytes through SLICE_STAGES
// buffers: the rows' slice (16-byte pieces copied by every thread with cp.async, in
// wgmma's 128-byte swizzle) and the matrix's (one bulk copy from gpu/cores.py's
// sliced_core_pieces copy, in the core-matrix layout, completing on the stage's
// mbarrier). Slices are copied
// SLICE_AHEAD ahead of the products, across tiles; a stage is refilled once both
// warpgroups have waited for the products that read it (the block barrier of the next
// slice). After a tile's last slice its terms go out through each warp's staging rows
// in shared memory to 16-byte stores (the accumulator holds two columns of eight rows a
// thread), while the next tile's slices load.
//
// Integer sums are exact in any order, and these are integer sums only: the terms are
// residual_norm's, bit for bit (scripts/kernels.py checks them against the CPU).
// gpu/plan.py's terms_sm90_shared() sizes the dynamic shared memory.

#include "common.cuh"
#include "tiles.cuh"
#include "wgmma.cuh"

// SLICE, SLICE_STAGES, TERMS_ROWS (gpu/plan.py: 128, rows a tile, two warpgroups of 64)
#define SLICE_AHEAD (SLICE_STAGES - 2)  // slices copied ahead of the one multiplied
#define SLICE_SBO (SLICE / 16 * 128)    // bytes between the matrix slice's 8-row groups
#define TERMS_MEMBERS MEMBERS_OF(TERMS_ROWS)
#define TERMS_LD (TILE_N / 2 + 4)       // words a staged row: with the padding, the quad's
                                        // word stores of eight rows hit distinct banks

// The descriptor of 128-byte-swizzled K-major rows (128 bytes of K a row, 8-row atoms of
// 1024 bytes, 1024-byte aligned): layout type 1 in bits 62-63, the atoms 1024 bytes
// apart; a K step of 32 bytes adds 2 to the start address (in 16-byte units), and the
// hardware swizzles the address it makes.
__device__ __forceinline__ u64 rows_descriptor(const i8* at) {
    return (u64)((shared_address(at) & 0x3FFFF) >> 4) | (1ull << 16) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_wait_one() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }

template <int K>
__device__ __forceinline__ void projection_terms(const i8* a, const i8* w_cores, const int* sb, const u32* seeds,
                                                 const int* signs, const i8* ov_out, u32 off_a, int shift,
                                                 short* terms, int rows) {
    constexpr int KS = K / SLICE;             // slices of a tile
    constexpr int PIECES = SLICE / 16;        // 16-byte pieces of a row's slice
    constexpr int A_BYTES = TERMS_ROWS * SLICE;
    constexpr int B_BYTES = HIDDEN * SLICE;
    constexpr int CHUNKS = HIDDEN / TILE_N;   // accumulators of 64 columns
    // 1024-byte aligned for the rows' swizzled layout (the static shared memory is
    // padded to it; aligned by hand, the pointer cost ptxas 60 registers and spills)
    extern __shared__ __align__(1024) unsigned char terms_sm90_shared[];
    i8* s_a = (i8*)terms_sm90_shared;                     // [SLICE_STAGES][A_BYTES]
    if (shared_address(s_a) & 1023) __trap();  // never: the swizzle would mix rows
    i8* s_b = s_a + SLICE_STAGES * A_BYTES;               // [SLICE_STAGES][B_BYTES]
    u32* s_stage = (u32*)(s_b + SLICE_STAGES * B_BYTES);  // [warp][16][TERMS_LD]
    // [TERMS_MEMBERS][HIDDEN] output noise, 32 bits an entry (whatever av_t is): a column
    // pair's two in one 8-byte load, no halves to unpack
    int* s_av = (int*)(s_stage + (2 * TERMS_ROWS / 32) * 16 * TERMS_LD);
    // What a tile's tables are made of, copied with its first slice (so no global load
    // waits in the tile loop; TILE_INPUTS buffers, as a tile's are copied up to
    // SLICE_AHEAD tiles ahead): its members' seeds and signs, its rows' input dots
    constexpr int TILE_INPUTS = SLICE_AHEAD + 1;
    u32* s_seed = (u32*)(s_av + TERMS_MEMBERS * HIDDEN);        // [TILE_INPUTS][TERMS_MEMBERS]
    int* s_sign = (int*)(s_seed + TILE_INPUTS * TERMS_MEMBERS);  // [TILE_INPUTS][TERMS_MEMBERS]
    int* s_sb = s_sign + TILE_INPUTS * TERMS_MEMBERS;            // [TILE_INPUTS][TERMS_ROWS]
    i8* s_ov = (i8*)(s_sb + TILE_INPUTS * TERMS_ROWS);           // [HIDDEN] the output noise's overlay
    __shared__ __align__(8) u64 full[SLICE_STAGES];  // stage s holds its matrix slice
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int tiles = (rows + TERMS_ROWS - 1) / TERMS_ROWS;
    const int total = tiles > (int)blockIdx.x ? ((tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1) * KS : 0;
    auto first_row = [&](int i) { return ((int)blockIdx.x + i / KS * (int)gridDim.x) * TERMS_ROWS; };

    // Slice i into stage i % SLICE_STAGES; every thread commits one cp.async group a
    // slice, with or without pieces, so that the groups count slices. A row's slice (128
    // bytes) is contiguous in shared memory, its 16-byte piece c at (c ^ (row % 8)) 16
    // (wgmma's 128-byte swizzle, ROWS_DESCRIPTOR), so that eight lanes copy a row's 128
    // contiguous bytes and write eight banks' worth apart: in the core-matrix layout a
    // warp's pieces of eight rows cost each quarter-warp its own sectors (ncu: twice
    // the ideal L2 sectors). A thread's pieces are piece threadIdx.x % 8 of rows
    // ROW_STEP apart.
    static_assert(SLICE == 128, "the rows' slices are 128-byte swizzled");
    constexpr int THREADS = 2 * TERMS_ROWS, ROW_STEP = THREADS / PIECES;
    const int my_row = threadIdx.x / PIECES, my_chunk = threadIdx.x % PIECES;
    const i8* my_piece = a + (long)my_row * K + 16 * my_chunk;
    // (ROW_STEP is a multiple of 8: a row's place within its 8 is the same for every u)
    const int my_place = my_row * SLICE + 16 * (my_chunk ^ (my_row & 7));
    auto load = [&](int i) {
        const int stage = i % SLICE_STAGES, k = i % KS, row0 = first_row(i);
        if (threadIdx.x == 0) bulk_copy(s_b + stage * B_BYTES, w_cores + k * B_BYTES, B_BYTES, &full[stage]);
        if (k == 0) {  // the tile's inputs
            const int at = i / KS % TILE_INPUTS, m0 = row0 / SEQ;
            const int n_members = (min(row0 + TERMS_ROWS, rows) - 1) / SEQ - m0 + 1;
            for (int r = threadIdx.x; r < min(TERMS_ROWS, rows - row0); r += blockDim.x)
                copy4_async(s_sb + at * TERMS_ROWS + r, sb + row0 + r);
            for (int m = threadIdx.x; m < n_members; m += blockDim.x) {
                copy4_async(s_seed + at * TERMS_MEMBERS + m, seeds + m0 + m);
                copy4_async(s_sign + at * TERMS_MEMBERS + m, signs + m0 + m);
            }
        }
        i8* to = s_a + stage * A_BYTES + my_place;
        const i8* from = my_piece + (long)row0 * K + k * SLICE;
#pragma unroll
        for (int u = 0; u < A_BYTES / 16 / THREADS; u++) {
            if (row0 + my_row + u * ROW_STEP < rows)
                copy16_async(to + u * ROW_STEP * SLICE, from + (long)u * ROW_STEP * K);
            else
                *(int4*)(to + u * ROW_STEP * SLICE) = make_int4(0, 0, 0, 0);
        }
    };
    if (threadIdx.x == 0)
        for (int s = 0; s < SLICE_STAGES; s++) barrier_init(&full[s]);
    for (int j = threadIdx.x; j < HIDDEN; j += blockDim.x) s_ov[j] = (i8)overlay_byte(ov_out, j);
    __syncthreads();
    for (int i = 0; i < SLICE_AHEAD; i++) {
        if (i < total) load(i);
        copy_commit();
    }

    int d[CHUNKS][32];
    u32* staged = s_stage + warp * 16 * TERMS_LD;  // the warp's 16 rows
    int i = 0;  // slices taken so far; the tile loop's inner loop is unrolled, so ptxas
                // sees which products are in flight at every wait (no C7517 wait)
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int row0 = tile * TERMS_ROWS;
        u32 sbs[2];           // the thread's rows' input dots times their members' signs
        const int* av[2];     // and their members' output noise
#pragma unroll
        for (int k = 0; k < KS; k++, i++) {
            const int stage = i % SLICE_STAGES;
            copy_wait<SLICE_AHEAD - 1>();  // this thread's pieces of slice i
            fence_async_shared();
            __syncthreads();  // every piece of slice i; every product of slice i - 2 waited for
            if (i + SLICE_AHEAD < total) load(i + SLICE_AHEAD);  // into slice i - 2's stage
            copy_commit();
            barrier_wait(&full[stage], (i / SLICE_STAGES) & 1);
            const i8* rows_slice = s_a + stage * A_BYTES + (warp >> 2) * 64 * SLICE;  // the warpgroup's 64 rows
            const i8* w_slice = s_b + stage * B_BYTES;
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < SLICE / 32; kk++)
#pragma unroll
                for (int c = 0; c < CHUNKS; c++)
                    wgmma_64x64x32(d[c], rows_descriptor(rows_slice) + 2 * kk,
                                   core_descriptor(w_slice + c * 8 * SLICE_SBO + 2 * CORE_LBO * kk, SLICE_SBO),
                                   k > 0 || kk > 0);
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            if (k == 0) {  // the tile's rows' input dots and its members' output noise
                const int at = i / KS % TILE_INPUTS, m0 = row0 / SEQ;
                const int n_members = (min(row0 + TERMS_ROWS, rows) - 1) / SEQ - m0 + 1;
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    const int r = 16 * warp + 8 * s + g;
                    // (a warp's 16 rows are one member's where SEQ is a multiple of 16)
                    const int member = row0 + r < rows ? (row0 + (SEQ % 16 == 0 ? r - 8 * s : r)) / SEQ - m0 : 0;
                    av[s] = s_av + member * HIDDEN;
                    sbs[s] = row0 + r < rows ? (u32)s_sb[at * TERMS_ROWS + r] * (u32)s_sign[at * TERMS_MEMBERS + member] : 0u;
                }
                // (from the seeds and the overlay in shared memory)
                tile_noise(s_av, n_members, 0, s_seed + at * TERMS_MEMBERS, off_a, s_ov, 0, HIDDEN, HIDDEN);
            } else {
                wgmma_wait_one();  // slice i - 1's products
            }
        }
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) tile_product_wait(d[c]);
        if (KS == 1) __syncthreads();  // the tables, built in this slice (else a barrier ago)
        // d[c][4 j + 2 s + e]: row 16 warp + 8 s + g, column TILE_N c + 8 j + 2 tig + e
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) {
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    const int col = TILE_N * c + 8 * j + 2 * tig;
                    const int2 noise2 = *(const int2*)(av[s] + col);
                    const int a_v[2] = {noise2.x, noise2.y};
                    int t[2];
#pragma unroll
                    for (int e = 0; e < 2; e++)
                        t[e] = wrap_add(d[c][4 * j + 2 * s + e], rank1_term(sbs[s], a_v[e])) >> shift;
                    staged[(8 * s + g) * TERMS_LD + 4 * j + tig] = (u32)(t[0] & 0xFFFF) | (u32)t[1] << 16;
                }
            __syncwarp();
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int r = 4 * q + (lane >> 3), piece = lane & 7;
                const long row = row0 + 16 * warp + r;
                if (row < rows)
                    *(uint4*)(terms + row * HIDDEN + TILE_N * c + 8 * piece) = *(const uint4*)(staged + r * TERMS_LD + 4 * piece);
            }
            __syncwarp();  // before the next chunk is staged
        }
    }
    __syncthreads();  // no thread waits on the barriers any more
    if (threadIdx.x == 0)
        for (int s = 0; s < SLICE_STAGES; s++) barrier_inval(&full[s]);
}

#define TERMS_FIT (HIDDEN % SLICE == 0 && HIDDEN <= 256)  // else the plan never launches them

// The o-projection's (K = HIDDEN): the inputs are attention's mixed rows
extern "C" __global__ void __launch_bounds__(2 * TERMS_ROWS, 1)
o_terms_sm90(const i8* inputs, const i8* w_cores, const int* sb, const u32* seeds, const int* signs,
             const i8* ov_out, u32 off_a, int shift, short* terms, int rows) {
#if TERMS_FIT
    projection_terms<HIDDEN>(inputs, w_cores, sb, seeds, signs, ov_out, off_a, shift, terms, rows);
#else
    __trap();
#endif
}

// The down-projection's (K = 4 HIDDEN): the inputs are the GELU'd hidden rows
extern "C" __global__ void __launch_bounds__(2 * TERMS_ROWS, 1)
down_terms_sm90(const i8* inputs, const i8* w_cores, const int* sb, const u32* seeds, const int* signs,
                const i8* ov_out, u32 off_a, int shift, short* terms, int rows) {
#if TERMS_FIT
    projection_terms<UP>(inputs, w_cores, sb, seeds, signs, ov_out, off_a, shift, terms, rows);
#else
    __trap();
#endif
}
