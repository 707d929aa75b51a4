// head_loss: the head's logits GEMM fused with sequence_loss on the int8 tensor cores.
//
// Unfused, cuBLAS writes every int32 logit (rows x VOCAB) to memory and sequence_loss
// (forward.cu) reads them back: at the default config that traffic, not the arithmetic,
// is most of their time. Here a block owns TILE_M rows (32 a warp, held in shared memory
// for the whole kernel) and sweeps the vocabulary in tiles of TILE_N embedding rows with
// mma.sync (m16n8k32, int8 in, int32 out); the epilogue finishes each tile in registers
// and no logit is written.
//
// Integer sums are exact in any order (|g| <= HIDDEN * 127 * 127 < 2^31), every other
// operation is sequence_loss's: the two agree bit for bit (scripts/kernels.py checks
// both against the CPU).
//
// Built on tiles.cuh; needs EXP_MAX (the exp table's largest entry), EXP_LAST and
// EXP_COPIES (below); gpu/plan.py's head_loss_shared() sizes the dynamic shared memory from the
// layout.

#include "common.cuh"
#include "tiles.cuh"

// Two sweeps of the vocabulary:
//   pass 1: the row's peak, max_j (g_j + term_j), shifted once at the end (an arithmetic
//           shift is monotone, so this is the peak of the shifted logits);
//   pass 2: total = sum_j exp_tab[min(peak - logit_j, LUT_SIZE - 1)].
// Pass 2's lookups, one a logit, are the kernel's busiest shared-memory reads. The table
// is held as its entries 0..EXP_LAST (past EXP_LAST all are zero, like entry EXP_LAST:
// gpu.exp_last), so lanes whose logits are far below their peak read one word, and in
// EXP_COPIES interleaved copies, lane l reading copy l % EXP_COPIES, so lanes reading
// different entries mostly read different banks.
// A LUT-rounded exponential cannot be rescaled when the peak moves, so the peak must be
// known before the sum: the tile products are recomputed rather than stored. The
// target's logit is one dot product per row. Each row's loss is added to its member's
// with an unsigned atomic: the member sum wraps like the CPU's int32 sum, in any order.

extern "C" __global__ void __launch_bounds__(TILE_M, 16 / TILE_WARPS)
head_loss(const i8* y, const i8* emb_t, const int* sb, const int* tokens, const u32* seeds,
          const int* signs, const i8* ov_out, u32 off_a, const int* exp_tab, u32* loss, int rows) {
    extern __shared__ __align__(16) unsigned char head_loss_shared[];
    i8* s_a = (i8*)head_loss_shared;                            // [TILE_M][TILE_LD] the rows
    i8* s_b = s_a + TILE_M * TILE_LD;                       // [2][TILE_N][TILE_LD] tiles
    av_t* s_av = (av_t*)(s_b + 2 * TILE_N * TILE_LD);       // [2][TILE_MEMBERS][TILE_N]
    int* s_exp = (int*)(s_av + 2 * TILE_MEMBERS * TILE_N);  // [EXP_LAST + 1][EXP_COPIES]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int row0 = blockIdx.x * TILE_M;
    const int m0 = row0 / SEQ;
    const int n_members = (min(row0 + TILE_M, rows) - 1) / SEQ - m0 + 1;
    const int tiles = (VOCAB + TILE_N - 1) / TILE_N;

    rows_to_shared(s_a, y, row0, TILE_M, rows);
    for (int i = threadIdx.x; i < (EXP_LAST + 1) * EXP_COPIES; i += blockDim.x)
        s_exp[i] = exp_tab[i / EXP_COPIES];
    const u32 my_exp = shared_address(s_exp + lane % EXP_COPIES);
    const ThreadRows<4> mine(sb, signs, row0, m0, rows);

    // One tile's embedding rows (async) and its members' output noise.
    auto load_tile = [&](int tile, int buf) {
        rows_to_shared(s_b + buf * TILE_N * TILE_LD, emb_t, tile * TILE_N, TILE_N, VOCAB);
        copy_commit();
        tile_noise(s_av + buf * TILE_MEMBERS * TILE_N, n_members, m0, seeds, off_a, ov_out,
                   tile * TILE_N, VOCAB);
    };

    int peak[4];
    unsigned long long total[4] = {0ull, 0ull, 0ull, 0ull};
#pragma unroll
    for (int s = 0; s < 4; s++) peak[s] = INT_MIN_;

    // Unrolled, so that `pass` is a constant in each copy: a runtime pass split every
    // column pair of the epilogue into its own block, each waiting on its own lookups.
#pragma unroll
    for (int pass = 0; pass < 2; pass++) {
        sweep(tiles, s_a, s_b, load_tile, [&](int (&c)[2][TILE_N / 8][4], int tile, int buf) {
            const av_t* av = s_av + buf * TILE_MEMBERS * TILE_N;
            const int v0 = tile * TILE_N;
#if TOTAL32
            u32 part[4] = {0u, 0u, 0u, 0u};
#else
            unsigned long long* part = total;
#endif
#pragma unroll
            for (int nt = 0; nt < TILE_N / 8; nt++)
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int col = nt * 8 + tig * 2 + j;
                    if (VOCAB_PAD && v0 + col >= VOCAB) continue;
#pragma unroll
                    for (int s = 0; s < 4; s++) {
                        const int term = rank1_term(mine.sbs[s], mine.of(av, s, col));
                        const int raw = wrap_add(c[s >> 1][nt][2 * (s & 1) + j], term);
                        if (pass == 0) {
                            peak[s] = max(peak[s], raw);
                        } else {
                            const u32 d = (u32)peak[s] - (u32)(raw >> SHIFT_LOGIT);  // >= 0
                            part[s] += shared_word(my_exp + min(d, (u32)EXP_LAST) * (4 * EXP_COPIES));
                        }
                    }
                }
#if TOTAL32
            if (pass == 1)
#pragma unroll
                for (int s = 0; s < 4; s++) total[s] += part[s];
#endif
        });
        if (pass == 0) {  // the quad of threads holding a row shares its peak
#pragma unroll
            for (int s = 0; s < 4; s++) {
                peak[s] = quad_max(peak[s]) >> SHIFT_LOGIT;
            }
        }
    }

    // The target's logit: the quad splits the row's dot product with its embedding row.
#pragma unroll
    for (int s = 0; s < 4; s++) {
        const unsigned long long t = quad_sum(total[s]);
        const int row = row0 + warp * 32 + 8 * s + g;
        const int m = m0 + mine.member[s];
        const int target = mine.valid[s] ? tokens[m * (SEQ + 1) + row % SEQ + 1] : 0;
        const i8* a_row = s_a + (warp * 32 + 8 * s + g) * TILE_LD;
        const i8* e_row = emb_t + (long)target * HIDDEN;
        int dot = 0;
        for (int k = tig * 4; k < HIDDEN; k += 16)
            dot = __dp4a(*(const int*)(a_row + k), *(const int*)(e_row + k), dot);
        dot = quad_sum(dot);
        if (tig == 0 && mine.valid[s])
            add_position_loss(loss + m, t, peak[s], dot, mine.sbs[s], seeds[m] + off_a, ov_out, target);
    }
}
