// up_gelu_sm90: the MLP's up-projection GEMM fused with mlp_up (forward.cu) on Hopper's
// warpgroup MMAs (wgmma.cuh).
//
// Unfused, cuBLAS writes rows x 4 HIDDEN int32 products and mlp_up reads them back: at
// the default config that traffic bounds both. Here a block owns UP_ROWS rows (UP_WG_ROWS
// a warpgroup) and sweeps the up matrix Wt[4 HIDDEN, HIDDEN] in tiles of TILE_N (64: the
// MMA's rows) of its rows; each tile is finished in registers (rank-1 term, shift, bias,
// GELU table, the int8 store and the down-projection's input dot) while the next tile's
// products run, and no product is written.
//
// The products are taken transposed: the tile's matrix rows are the MMA's rows (A) and
// the warpgroup's activation rows its columns (B), so that a thread holds two features
// for UP_RPT rows (8 or 16), and their per-member entries (output noise, bias, the
// down-projection's input noise) are loaded once a tile for all of them. The other way
// round (a thread holding sixteen features of two rows) each product needed its own
// loads, and shared-memory loads bounded the kernel.
//
// The input dot rounds in float over each group of four features j, j + HIDDEN,
// j + 2 HIDDEN, j + 3 HIDDEN, in that order (mlp_up's), so a thread takes whole groups
// over two tiles: in tiles 2 u + h, tile row 16 w + 8 s + g (warp w of the warpgroup,
// g = lane / 4) is feature G + (2 h + s) HIDDEN of group G = 32 u + 8 w + g (gpu/cores.py's
// up_order), and thread (w, g) holds its features (the accumulator's rows g, g + 8) for
// its rows 8 j + 2 tig + e (the columns; j < UP_WG_ROWS / 8, e < 2). Tile 2 u + 1
// finishes what tile 2 u began.
//
// The hidden row is written group by group, byte 4 G + sub for feature G + sub HIDDEN
// (gpu/cores.py's hidden_order), a thread's four bytes at once: the down-projection reads it
// with its matrix's inputs in the same order (gpu/state.py's copies of it).
//
// Integer sums are exact in any order; every other operation is mlp_up's, in its order:
// the two agree bit for bit (scripts/kernels.py checks both against the CPU).
// gpu/plan.py's up_gelu_sm90_shared() sizes the dynamic shared memory from the layout below.

#include "common.cuh"
#include "tiles.cuh"
#include "wgmma.cuh"

// UP_WG_ROWS (gpu/plan.py): rows a warpgroup, the MMA's N: 64 where a warpgroup's rows
// are one member's and the entries are not packed, so that each MMA reads the tile's
// bytes from shared memory once for 64 rows (at 32, shared memory bounded the kernel);
// else 32, two warpgroups a block.
#ifndef UP_WG_ROWS
#define UP_WG_ROWS 32
#endif
static_assert(UP_WG_ROWS == 32 || UP_WG_ROWS == 64, "m64n32k32 or m64n64k32");
#define UP_THREADS (128 * UP_ROWS / UP_WG_ROWS)  // a warpgroup of 128 threads a UP_WG_ROWS rows
#define UP_RPT (UP_WG_ROWS / 4)                   // rows a thread holds
#define UP_ACC (UP_WG_ROWS / 2)                   // accumulators a tile
// The GELU table's index clip8((out >> SHIFT_MLP_UP) + bias) + MAXV is
// clamp(key, 0, 255 2^Q - 1) >> Q for key = the folded term (common.cuh's folded_term)
// + (bias + MAXV) 2^Q, Q = SHIFT_MLP_UP + MSHIFT (a shift is monotone): two
// multiply-adds on the FMA pipe, where the integer pipe bounds the epilogue, where
// FOLD_FITS with |bias + MAXV| <= 255 + NOISE_N^2 < 2^14. The table holds (bias + MAXV)
// 2^Q then.
#ifndef UP_FOLD
#define UP_FOLD (!UP_PACK && FOLD_FITS(SHIFT_MLP_UP, 16384ll << (SHIFT_MLP_UP + MSHIFT)))
#endif
#define UP_Q (SHIFT_MLP_UP + MSHIFT)
// UP_PACK (gpu/plan.py: where the rows, two tiles and 8-byte entries do not fit shared
// memory, as at hidden 1024): a feature's output noise and perturbed bias in one word,
// 16 bits each (modes 0 and 1: |a| <= NOISE_N, |bias| <= 2^7 + NOISE_N^2; unfolded).
#ifndef UP_PACK
#define UP_PACK 0
#endif
static_assert(!UP_PACK || (ADAPTIVE_MODE != 2 && !UP_FOLD), "UP_PACK: 16-bit entries");
#if UP_PACK
typedef int up_entry_t;
__device__ __forceinline__ up_entry_t make_up_entry(int a, int bias) { return (a & 0xFFFF) | (int)((u32)bias << 16); }
__device__ __forceinline__ int2 up_entry(up_entry_t v) { return make_int2((short)(v & 0xFFFF), v >> 16); }
#else
typedef int2 up_entry_t;
__device__ __forceinline__ up_entry_t make_up_entry(int a, int bias) { return make_int2(a, bias); }
__device__ __forceinline__ int2 up_entry(up_entry_t v) { return v; }
#endif
#define UP_MEMBERS MEMBERS_OF(UP_ROWS)
// UP_BLOCKS (gpu/plan.py: 3 where they fit, else 2; 1 with UP_PACK) blocks an SM:
// three (80 registers a thread) 6% faster than two (96 registers) at the default, and
// blocks of 128 rows, one an SM, 16% slower (0.65, 0.69 and 0.81 ms at 8,192 members on
// an H100).

// The tile's TILE_N = 64 matrix rows (s_tile) times the warpgroup's UP_WG_ROWS rows
// (s_rows), K = HIDDEN, into d[4 j + 2 s + e] = tile row 16 w + 8 s + g times row 8 j +
// 2 tig + e: issued and committed as one group, not waited for.
template <int K = 0>
__device__ __forceinline__ void features_product_async(int (&d)[UP_ACC], const i8* s_tile, const i8* s_rows) {
    if (K == 0) asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    const u64 tile = core_descriptor(s_tile);
    wgmma_64xNx32<K>(d, (u32)tile, (u32)core_descriptor(s_rows), (u32)(tile >> 32), K > 0);
    if constexpr (K + 1 < TILE_PIECES / 2)
        features_product_async<K + 1>(d, s_tile, s_rows);
    else
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// One warpgroup of 64 rows or two of 32 a block, UP_BLOCKS blocks an SM: in blocks of
// sixteen warps, one an SM, every warp waited at each tile's barrier for the slowest of
// sixteen, and nothing ran beside a block's tables and first loads.
template <bool UNIT>
__device__ __forceinline__ void up_gelu_rows(const i8* y, const i8* up_cores, const int* sb_up, const u32* seeds,
                                             const int* signs, const i8* bias_up, const i8* ov_up_out,
                                             const i8* ov_bias_up, const i8* ov_down_in, u32 up_a, u32 bias_a,
                                             u32 bias_b, u32 down_b, const int* gelu, i8* hidden, int* sb_down,
                                             int rows) {
    extern __shared__ __align__(128) unsigned char up_gelu_sm90_shared[];
    constexpr int TILES = 4 * HIDDEN / TILE_N;
    constexpr int TABLE = 4 * HIDDEN;    // a member's entries, 4 G + sub for feature G + sub HIDDEN
    i8* s_a = (i8*)up_gelu_sm90_shared;  // UP_ROWS rows, core matrices
    i8* s_b = s_a + UP_ROWS * HIDDEN;    // [2] tiles of TILE_N matrix rows, core matrices
    // Per member and feature: the output noise and the perturbed bias, in pairs read
    // together; the down-projection's input noise and factor (dot_entry).
    up_entry_t* s_up = (up_entry_t*)(s_b + 2 * TILE_N * HIDDEN);  // [UP_MEMBERS][TABLE]
    dot_t* s_down = (dot_t*)(s_up + UP_MEMBERS * TABLE);  // [UP_MEMBERS][TABLE]
    // The GELU table by the clipped value plus 127, in bytes: one load of an address
    // plus a constant, and at most two words a bank for the warp's lookups.
    i8* s_gelu = (i8*)(s_down + UP_MEMBERS * TABLE);  // [255]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3, w = warp & 3;
    const int row0 = blockIdx.x * UP_ROWS;
    const int m0 = row0 / SEQ;
    const int n_members = (min(row0 + UP_ROWS, rows) - 1) / SEQ - m0 + 1;
    const int wg_row = UP_WG_ROWS * (warp >> 2);  // the warpgroup's first row, of the block's

    rows_to_cores(s_a, y, row0, UP_ROWS, rows);
    copy_commit();  // waited for before the sweep's first products
    for (int i = threadIdx.x; i < 2 * MAXV + 1; i += blockDim.x) s_gelu[i] = (i8)gelu[(i - MAXV) & 0xFF];
    // The thread's UP_RPT rows, 8 j + 2 tig + e as r = 2 j + e; their input dots times
    // their member's sign (u32: wraps as the CPU's int32).
    const int first_row = row0 + wg_row + 2 * tig, rows_left = rows - first_row;
    auto row_of = [&](int r) { return first_row + 8 * (r >> 1) + (r & 1); };
    u32 sbs[UP_RPT];
#pragma unroll
    for (int r = 0; r < UP_RPT; r++) {
        const int row = row_of(r);
        sbs[r] = row < rows ? (u32)sb_up[row] * (u32)signs[row / SEQ] : 0u;
    }
    // Where row r's member's entries start (a warpgroup's rows are one member's where SEQ
    // is a multiple of UP_WG_ROWS; rows past the last take the last member's)
    auto entries = [&](int r) { return (min(row_of(r), rows - 1) / SEQ - m0) * TABLE; };
    // Every member's entries at once, before the sweep: built tile by tile, their global
    // loads (seeds, overlays, bias) held every warp between two tiles' products.
    // Member by member: its seed and sign loaded once, and the loads that do not depend
    // on the member (overlays, bias) hoisted out of the loop by the compiler.
#pragma unroll 1
    for (int member = 0; member < n_members; member++) {
        const u32 seed = seeds[m0 + member];
        const int sign = signs[m0 + member];
        // unrolled: every round's global loads issue before the first is waited for
#pragma unroll
        for (int k = 0; k < (TABLE + UP_THREADS - 1) / UP_THREADS; k++) {
            const int e = threadIdx.x + k * UP_THREADS, i = member * TABLE + e, j = e / 4 + e % 4 * HIDDEN;
            if (TABLE % UP_THREADS != 0 && e >= TABLE) break;
            const int bias = bias_up[j] + vector_noise(ov_bias_up, seed, bias_a, bias_b, j, sign);
#if UP_FOLD
            s_up[i] = make_up_entry(output_noise_of(ov_up_out, seed + up_a, j), (int)((u32)(bias + MAXV) << UP_Q));
#else
            s_up[i] = make_up_entry(output_noise_of(ov_up_out, seed + up_a, j), bias);
#endif
            s_down[i] = dot_entry(ov_down_in, seed + down_b, j);
        }
    }

    // Carried from tile 2 u to 2 u + 1, per row: the GELU'd bytes of subs 0 and 1, the
    // input dot's partial sum over them; over all tiles, the rows' input dots.
    u32 bytes[UP_RPT], total[UP_RPT] = {};
    int partial[UP_RPT];  // (UNIT: the terms go to total directly)
    // the warpgroup's rows from warpgroup_index(), so that their descriptors stay in
    // uniform registers (wg_row made so too spilled 16 bytes)
    const i8* s_rows = s_a + UP_WG_ROWS * warpgroup_index() * HIDDEN;
    sweep_async<TILE_N * HIDDEN, UP_ACC, UP_THREADS>(
        TILES, s_b, up_cores, [&](int (&d)[UP_ACC], const i8* tile) { features_product_async(d, tile, s_rows); },
        [&](const int (&d)[UP_ACC], int tile) {
            const int h = tile & 1, group = tile / 2 * 32 + 8 * w + g;
            int2 up[2];  // [s]: sub 2 h + s
            dot_t down[2];
            auto load = [&](int r) {
                const int at = entries(r) + 4 * group + 2 * h;
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    up[s] = up_entry(s_up[at + s]);
                    down[s] = s_down[at + s];
                }
            };
            if (SEQ % UP_WG_ROWS == 0) load(0);
#pragma unroll
            for (int r = 0; r < UP_RPT; r++) {
                if (SEQ % UP_WG_ROWS != 0) load(r);
                if (!UNIT && h == 0) partial[r] = 0;
                int hv[2];  // the GELU'd values of subs 2 h and 2 h + 1
#pragma unroll
                for (int s = 0; s < 2; s++) {
#if UP_FOLD
                    const u32 key = folded_term(d[4 * (r >> 1) + 2 * s + (r & 1)], sbs[r], up[s].x) + (u32)up[s].y;
                    hv[s] = s_gelu[min(max((int)key, 0), (2 * MAXV + 1) * (1 << UP_Q) - 1) >> UP_Q];
#else
                    const int out = wrap_add(d[4 * (r >> 1) + 2 * s + (r & 1)], rank1_term(sbs[r], up[s].x));
                    hv[s] = s_gelu[clip8((out >> SHIFT_MLP_UP) + up[s].y) + MAXV];
#endif
                    if constexpr (UNIT)
                        total[r] = dot_add<true>(total[r], hv[s], down[s]);
                    else
                        partial[r] = down_step(partial[r], hv[s], down[s]);
                }
                // bytes 0 and 1 of a word by a permute (put in place one by one, each
                // value was taken twice: loaded unsigned for its byte, signed for the dot)
                const u32 pair = __byte_perm(hv[0], hv[1], 0x0040);
                bytes[r] = h == 0 ? pair : __byte_perm(bytes[r], pair, 0x5410);
                if (h == 1) {
                    if (!UNIT) total[r] += (u32)partial[r];
                    // one address and the rows' constant offsets: an address a row kept
                    // over the sweep spilled registers
                    const int offset = 8 * (r >> 1) + (r & 1);
                    if (offset < rows_left)
                        *(u32*)(hidden + (long)(first_row + offset) * (4 * HIDDEN) + 4 * group) = bytes[r];
                }
            }
        });
    // A row's dot over its groups: the thread's, then its warp's eight lanes g, then the
    // warpgroup's four warps (through s_b, free after the sweep).
    u32* s_sums = (u32*)s_b;  // [UP_ROWS][4]
#pragma unroll
    for (int r = 0; r < UP_RPT; r++) {
        u32 t = total[r];
        for (int o = 4; o < 32; o <<= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
        if (g == 0) s_sums[(row_of(r) - row0) * 4 + w] = t;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < UP_ROWS && row0 + i < rows; i += blockDim.x) {
        const u32* sums = s_sums + 4 * i;
        sb_down[row0 + i] = dot_value<UNIT>(sums[0] + sums[1] + sums[2] + sums[3]);
    }
}

extern "C" __global__ void __launch_bounds__(UP_THREADS, UP_BLOCKS)
up_gelu_sm90(const i8* y, const i8* up_cores, const int* sb_up, const u32* seeds, const int* signs,
             const i8* bias_up, const i8* ov_up_out, const i8* ov_bias_up, const i8* ov_down_in,
             u32 up_a, u32 bias_a, u32 bias_b, u32 down_b, const int* gelu, i8* hidden,
             int* sb_down, int rows) {
    // the down-projection's input dot by unit factors where they all are (common.cuh)
    if (UNIT_FITS(UP) && __syncthreads_and(unit_share(ov_down_in, UP)))
        up_gelu_rows<true>(y, up_cores, sb_up, seeds, signs, bias_up, ov_up_out, ov_bias_up, ov_down_in, up_a,
                           bias_a, bias_b, down_b, gelu, hidden, sb_down, rows);
    else
        up_gelu_rows<false>(y, up_cores, sb_up, seeds, signs, bias_up, ov_up_out, ov_bias_up, ov_down_in, up_a,
                            bias_a, bias_b, down_b, gelu, hidden, sb_down, rows);
}
