// head_loss_sm90: head_loss (head_loss.cu) on Hopper's warpgroup MMAs (wgmma.cuh).
//
// The arithmetic and the result are head_loss's; only the way the products are made
// differs. head_loss's warps load every MMA fragment from shared memory through their
// registers, for each vocabulary tile again, and the tensor cores wait while the warps
// run a tile's epilogue; here the products of the next tile run during the epilogue.
// A block of 256 rows reads the embedding table from L2 once per pass, as head_loss.

#include "common.cuh"
#include "tiles.cuh"
#include "wgmma.cuh"

// The warpgroup's rows as registers (wgmma's A fragments, HIDDEN / 8 a thread) where
// they fit beside two tiles' accumulators; else read from shared memory by each product.
#define HEAD_REGS_A (HIDDEN <= 256)
// The second pass's lookups shift the folded term (common.cuh's folded_term, one
// multiply-add) by SHIFT_LOGIT + MSHIFT rather than the logit before its shift by
// SHIFT_LOGIT, where FOLD_FITS.
#ifndef HEAD_FOLD
#define HEAD_FOLD (HEAD_REGS_A && FOLD_FITS(SHIFT_LOGIT, 0))
#endif
#if HEAD_FOLD
#define LOOKUP_SHIFT (SHIFT_LOGIT + MSHIFT)
#else
#define LOOKUP_SHIFT SHIFT_LOGIT
#endif

extern "C" __global__ void __launch_bounds__(SM90_THREADS, 1)
head_loss_sm90(const i8* y, const i8* emb_t, const i8* emb_cores, const int* sb, const int* tokens,
               const u32* seeds, const int* signs, const i8* ov_out, u32 off_a, const int* exp_tab,
               u32* loss, int rows) {
    extern __shared__ __align__(128) unsigned char head_loss_sm90_shared[];
    i8* s_a = (i8*)head_loss_sm90_shared;          // TILE_M rows, core matrices
    i8* s_b = s_a + TILE_M * HIDDEN;               // [2] tiles of TILE_N rows, core matrices
    constexpr int TILES = (VOCAB + TILE_N - 1) / TILE_N;
    // The output noise a pair (its members share their seed), 32 bits an entry whatever
    // av_t is: a thread's two columns in one 8-byte load, no halves to unpack
    int* s_av = (int*)(s_b + 2 * TILE_N * HIDDEN);                   // [PAIRS_OF(TILE_M)][TILES * TILE_N]
    int* s_exp = s_av + PAIRS_OF(TILE_M) * TILES * TILE_N;            // [EXP_LAST + 1][EXP_COPIES]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int row0 = blockIdx.x * TILE_M;
    const int m0 = row0 / SEQ;
    const int n_members = (min(row0 + TILE_M, rows) - 1) / SEQ - m0 + 1;
    const i8* s_rows = s_a + (warp >> 2) * 64 * HIDDEN;  // the warpgroup's 64 rows

    rows_to_cores(s_a, y, row0, TILE_M, rows);
    copy_commit();  // waited for before the rows' fragments are loaded, or the first products
    for (int i = threadIdx.x; i < (EXP_LAST + 1) * EXP_COPIES; i += blockDim.x)
        s_exp[i] = exp_tab[i / EXP_COPIES];
    const u32 my_exp = shared_address(s_exp + lane % EXP_COPIES);

    const ThreadRows<2> mine(sb, signs, row0, m0, rows);
#if HEAD_REGS_A
    copy_wait<0>();
    __syncthreads();
    u32 a[HIDDEN / 32][4];
    rows_to_fragments(a, s_rows);
#endif

    // emb_cores: the embedding in the core-matrix layout, zero rows past the vocabulary.
    // The members' output noise over the whole vocabulary, once for both passes: built
    // tile by tile, its global loads stalled every warp between two tiles' products.
    const int n_pairs = (m0 + n_members - 1) / 2 - m0 / 2 + 1;
    tile_noise(s_av, n_pairs, m0, seeds, off_a, ov_out, 0, VOCAB, TILES * TILE_N, true);

    int peak[2] = {INT_MIN_, INT_MIN_};
    unsigned long long total[2] = {0ull, 0ull};

    // Tile t's epilogue on its products d: pass 0 the rows' peaks, pass 1 their sums.
    auto epilogue = [&](const int (&d)[32], int tile, int pass) {
        const int* av = s_av + tile * TILE_N;
        const int v0 = tile * TILE_N;
#if HEAD_REGS_A
        // Pass 1's lookups in a clamp, a shift and a multiply-add a logit (the integer
        // pipe bounds this epilogue): entry min(peak - (key >> LOOKUP_SHIFT), EXP_LAST) is
        // at last - (max(key, lowest) >> LOOKUP_SHIFT) entries, last the address of entry
        // peak (wrapping) and lowest the least key whose logit is peak - EXP_LAST or more
        // (an arithmetic shift is monotone), or INT_MIN. (At HIDDEN > 256, rows read from
        // shared memory, last and lowest spilled registers: the plain lookup there.)
        u32 last[2];
        int lowest[2];
#pragma unroll
        for (int s = 0; s < 2; s++) {
            last[s] = my_exp + (u32)peak[s] * (4 * EXP_COPIES);
            lowest[s] = (int)max(((long long)peak[s] - EXP_LAST) * (1ll << LOOKUP_SHIFT), (long long)INT_MIN_);
        }
#endif
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
                    const int a_v = mine.of_pair(av, s, col, TILES * TILE_N);
                    const int raw = wrap_add(d[4 * j + 2 * s + e], rank1_term(mine.sbs[s], a_v));
                    if (pass == 0) {
                        peak[s] = max(peak[s], raw);
                        continue;
                    }
#if HEAD_REGS_A
#if HEAD_FOLD
                    const int key = (int)folded_term(d[4 * j + 2 * s + e], mine.sbs[s], a_v);
#else
                    const int key = raw;
#endif
                    part[s] += shared_word(last[s] - (u32)(max(key, lowest[s]) >> LOOKUP_SHIFT) * (4 * EXP_COPIES));
#else
                    const u32 dist = (u32)peak[s] - (u32)(raw >> SHIFT_LOGIT);  // >= 0
                    part[s] += shared_word(my_exp + min(dist, (u32)EXP_LAST) * (4 * EXP_COPIES));
#endif
                }
            }
#if TOTAL32
        if (pass == 1)
#pragma unroll
            for (int s = 0; s < 2; s++) total[s] += part[s];
#endif
    };

    // Unrolled, so that `pass` is a constant in each copy (as in head_loss).
#pragma unroll
    for (int pass = 0; pass < 2; pass++) {
        sweep_async<TILE_N * HIDDEN>(
            TILES, s_b, emb_cores, [&](int (&d)[32], const i8* tile) {
#if HEAD_REGS_A
                tile_product_regs(d, a, tile);
#else
                tile_product_async(d, s_rows, tile);
#endif
            },
            [&](const int (&d)[32], int tile) { epilogue(d, tile, pass); });
        if (pass == 0) {  // the quad of threads holding a row shares its peak
#pragma unroll
            for (int s = 0; s < 2; s++) {
                peak[s] = quad_max(peak[s]) >> SHIFT_LOGIT;
            }
        }
    }

    // The target's logit: the quad splits the row's dot product with its embedding row.
#pragma unroll
    for (int s = 0; s < 2; s++) {
        const unsigned long long t = quad_sum(total[s]);
        const int r = 16 * warp + g + 8 * s;  // of the block's rows
        const int m = m0 + mine.member[s];
        const int target = mine.valid[s] ? tokens[m * (SEQ + 1) + (row0 + r) % SEQ + 1] : 0;
        const i8* cores = s_a + (r >> 3) * CORE_SBO + (r & 7) * 16 + 4 * tig;
        const i8* e_row = emb_t + (long)target * HIDDEN + 4 * tig;
        int dot = 0;
        for (int piece = 0; piece < TILE_PIECES; piece++)
            dot = __dp4a(*(const int*)(cores + piece * CORE_LBO), *(const int*)(e_row + 16 * piece), dot);
        dot = quad_sum(dot);
        if (tig == 0 && mine.valid[s])
            add_position_loss(loss + m, t, peak[s], dot, mine.sbs[s], seeds[m] + off_a, ov_out, target);
    }
}
