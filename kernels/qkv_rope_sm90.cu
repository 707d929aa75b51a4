// qkv_rope_sm90: a layer's q, k and v projections fused with qkv_rope (forward.cu) on
// Hopper's warpgroup MMAs (wgmma.cuh).
//
// Unfused, cuBLAS writes rows x 3 HIDDEN int32 products and qkv_rope reads them back:
// 16 GB a layer at the default chunk, the time of both. Here a block is one warpgroup
// of 64 rows. For each of q, k and v in turn it holds that matrix (HIDDEN rows of Wt)
// in shared memory and takes the products of all HIDDEN columns at once: max-abs
// normalisation needs the whole row, so the warpgroup's 64 x HIDDEN products stay in
// its registers (HIDDEN / 2 a thread, hence HIDDEN <= 256, a multiple of TILE_N). Then
// qkv_rope's arithmetic runs on them there: the rank-1 term, RoPE on q and k (a thread
// holds whole feature pairs: accumulator columns 2 tig and 2 tig + 1), the row's peak
// over its quad, and the scaled bytes go through shared memory to 16-byte stores. The
// next matrix is copied in during the epilogue; two blocks share an SM (at the
// default; at short seq_len the noise tables of a block's many members can leave room
// for one), so one's products run during the other's epilogue.
//
// Integer sums are exact in any order; every other operation is qkv_rope's, in its
// order (scripts/kernels.py checks both against the CPU). gpu/plan.py's qkv_rope_sm90_shared()
// sizes the dynamic shared memory from the layout below.

#include "common.cuh"
#include "tiles.cuh"
#include "wgmma.cuh"

// A compile-time flag for a generic lambda: its code is built once with, once without.
template <bool B>
struct Flag {
    static constexpr bool value = B;
};

// QKV_ROWS (gpu/plan.py): rows a block, one warpgroup's
#define QKV_THREADS (2 * QKV_ROWS)
#define QKV_TILES (HIDDEN / TILE_N)   // wgmma tiles of a matrix's columns
#define QKV_MEMBERS MEMBERS_OF(QKV_ROWS)
#define QKV_LD (HIDDEN + 16)          // bytes a row of the staged output: with the
                                      // padding, a warp's 2-byte stores hit distinct banks

extern "C" __global__ void __launch_bounds__(QKV_THREADS, 2)
qkv_rope_sm90(const i8* y, const i8* w_cores, const int* sb, i8* out, const u32* seeds,
              const int* signs, const i8* ov_q, const i8* ov_k, const i8* ov_v, u32 q_a,
              u32 k_a, u32 v_a, const int* rope_tab, int rows) {
#if HIDDEN % TILE_N == 0 && HIDDEN <= 256  // else the plan never launches it
    static_assert(QKV_ROWS == 64, "a block is one warpgroup of 64 rows");
    extern __shared__ __align__(128) unsigned char qkv_rope_sm90_shared[];
    i8* s_a = (i8*)qkv_rope_sm90_shared;     // QKV_ROWS rows, core matrices
    i8* s_w = s_a + QKV_ROWS * HIDDEN;       // one matrix, HIDDEN rows, core matrices
    i8* s_out = s_w + HIDDEN * HIDDEN;       // [QKV_ROWS][QKV_LD]: the bytes before they go out
    // [3][QKV_MEMBERS][HIDDEN] output noise, 32 bits an entry (whatever av_t is): a
    // column pair's two in one 8-byte load, with no halves to unpack
    int* s_av = (int*)(s_out + QKV_ROWS * QKV_LD);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int row0 = blockIdx.x * QKV_ROWS;
    const int m0 = row0 / SEQ;
    const int n_members = (min(row0 + QKV_ROWS, rows) - 1) / SEQ - m0 + 1;

    // q's matrix, then k's and v's each into the same place once the last products are
    // done (w_cores: the three in the core-matrix layout), each a bulk copy that
    // completes `full`'s phase (wgmma.cuh): matrix p is its phase of parity p % 2
    __shared__ __align__(8) u64 full;
    auto load_matrix = [&](int p) { bulk_copy(s_w, w_cores + p * HIDDEN * HIDDEN, HIDDEN * HIDDEN, &full); };
    rows_to_cores(s_a, y, row0, QKV_ROWS, rows);
    copy_commit();  // waited for before the first products
    if (threadIdx.x == 0) {
        barrier_init(&full);
        load_matrix(0);
    }
    tables_noise<3>(s_av, QKV_MEMBERS * HIDDEN, n_members, m0, seeds, {q_a, k_a, v_a}, {ov_q, ov_k, ov_v}, 0, HIDDEN,
                    HIDDEN, false);
    // The thread's two rows' positions, for RoPE
    int position[2];
#pragma unroll
    for (int s = 0; s < 2; s++) position[s] = (row0 + 16 * warp + 8 * s + g) % SEQ;
    const int2* rope = (const int2*)rope_tab;  // [position][HEAD_DIM / 2]: cos, sin
    copy_wait<0>();
    fence_async_shared();
    __syncthreads();  // the rows and tables in place, the barrier initialised

#pragma unroll 1
    for (int p = 0; p < 3; p++) {
        // The rows' input dots and signs, loaded before the products that hide their
        // latency (after them, 7% of the kernel's stall samples waited on these loads)
        const ThreadRows<2> mine(sb + p * rows, signs, row0, m0, rows);
        barrier_wait(&full, p & 1);  // the matrix in place
        int d[QKV_TILES][32];
        tiles_product_async(d, s_a, s_w);
#pragma unroll
        for (int c = 0; c < QKV_TILES; c++) tile_product_wait(d[c]);
        __syncthreads();  // every warp's products are done reading the matrix
        if (threadIdx.x == 0) {
            if (p < 2)
                load_matrix(p + 1);
            else
                barrier_inval(&full);  // no warp waits on it any more
        }

        // The rank-1 term of every product, then RoPE on q and k, and the rows' peaks.
        // d[c][4 j + 2 s + e]: row 16 warp + 8 s + g, column TILE_N c + 8 j + 2 tig + e.
        const int* av = s_av + p * QKV_MEMBERS * HIDDEN;
        u32 peak[2] = {0u, 0u};
        auto finish = [&](auto with_rope) {
#pragma unroll
            for (int c = 0; c < QKV_TILES; c++)
#pragma unroll
                for (int j = 0; j < 8; j++)
#pragma unroll
                    for (int s = 0; s < 2; s++) {
                        const int col = TILE_N * c + 8 * j + 2 * tig;
                        int even = wrap_add(d[c][4 * j + 2 * s], rank1_term(mine.sbs[s], mine.of(av, s, col, HIDDEN)));
                        int odd = wrap_add(d[c][4 * j + 2 * s + 1], rank1_term(mine.sbs[s], mine.of(av, s, col + 1, HIDDEN)));
                        if constexpr (decltype(with_rope)::value) {
                            const int2 cs = rope[position[s] * (HEAD_DIM / 2) + (col % HEAD_DIM) / 2];
                            const long long half = 1ll << (ROPE_SHIFT - 1);
                            const long long e = (long long)even * cs.x - (long long)odd * cs.y + half;
                            const long long o = (long long)even * cs.y + (long long)odd * cs.x + half;
                            even = (int)(e >> ROPE_SHIFT);
                            odd = (int)(o >> ROPE_SHIFT);
                        }
                        d[c][4 * j + 2 * s] = even;
                        d[c][4 * j + 2 * s + 1] = odd;
                        peak[s] = max(peak[s], max(abs_u32(even), abs_u32(odd)));
                    }
        };
        if (p < 2)
            finish(Flag<true>());
        else
            finish(Flag<false>());

        // max_abs_normalize of each row (its quad shares the peak), staged as bytes
        i8* out_p = out + (long)p * rows * HIDDEN;
#pragma unroll
        for (int s = 0; s < 2; s++) {
            const float scale = peak_scale(quad_max(peak[s]));
            unsigned char* staged = (unsigned char*)s_out + (16 * warp + 8 * s + g) * QKV_LD + 2 * tig;
#pragma unroll
            for (int c = 0; c < QKV_TILES; c++)
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const u32 lo = (u32)scaled_int(d[c][4 * j + 2 * s], scale);
                    const u32 hi = (u32)scaled_int(d[c][4 * j + 2 * s + 1], scale);
                    *(unsigned short*)(staged + TILE_N * c + 8 * j) = (unsigned short)__byte_perm(lo, hi, 0x40);
                }
        }
        __syncwarp();  // a warp stages and stores its own 16 rows
        // every piece read before any is stored: a piece's load and store in turn, under
        // its own branch, waited for each load (11% of the stall samples)
        constexpr int PIECES = HIDDEN / 32;  // a lane's 16-byte pieces of the 16 rows
        int4 piece_of[PIECES];
#pragma unroll
        for (int k = 0; k < PIECES; k++) {
            const int i = lane + 32 * k, r = i / (HIDDEN / 16), piece = i % (HIDDEN / 16);
            piece_of[k] = *(const int4*)(s_out + (16 * warp + r) * QKV_LD + 16 * piece);
        }
#pragma unroll
        for (int k = 0; k < PIECES; k++) {
            const int i = lane + 32 * k, r = i / (HIDDEN / 16), piece = i % (HIDDEN / 16);
            const long row = row0 + 16 * warp + r;
            if (row < rows) *(int4*)(out_p + row * HIDDEN + 16 * piece) = piece_of[k];
        }
        __syncwarp();  // before the next matrix's bytes are staged
    }
#else
    __trap();
#endif
}
