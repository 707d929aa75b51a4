// head_loss_sm90: head_loss (head_loss.cu) on Hopper's warpgroup MMAs (wgmma.cuh).
//
// The arithmetic and the result are head_loss's; only the way the products are made
// differs. head_loss's warps load every MMA fragment from shared memory through their
// registers, for each vocabulary tile again, and the tensor cores wait while the warps
// run a tile's epilogue; here the products of the next tile run during the epilogue.
// A block of HEAD_ROWS rows reads the embedding table from L2 once per pass, as head_loss.
//
// One pass where it is sure (deggs/numerics/gpu/one_pass.py says why): the sweep sums
// against each row's running peak, its quad sharing it tile by tile, and keeps an
// interval for the terms summed before the peak last rose. A row needs floor(log2) of
// its sum only; where the interval leaves that open, the row is summed again with its
// peak known: on the CUDA cores where the block has at most OPEN_ROWS such rows, else
// by a second sweep (head_loss's second pass). again[0] counts the blocks that swept
// twice, again[1] the rows summed on the CUDA cores.

#include "common.cuh"
#include "tiles.cuh"
#include "wgmma.cuh"

// Rows a block (gpu/plan.py's HEAD_ROWS): 256, four warpgroups, where the rows, two
// tiles and the output noise fit shared memory; else 128 (HEAD_WIDE, up to hidden
// 1024): two warpgroups holding their rows in registers (HIDDEN / 8 a thread, of 255),
// the tiles then filling the shared memory the rows were staged in.
#define HEAD_THREADS (2 * HEAD_ROWS)
#define HEAD_WIDE (HEAD_ROWS == 128)
static_assert(HEAD_ROWS == 256 || (HEAD_WIDE && HIDDEN <= 1024), "HEAD_ROWS");
// The warpgroup's rows as registers (wgmma's A fragments, HIDDEN / 8 a thread) where
// they fit beside two tiles' accumulators; else read from shared memory by each product.
#define HEAD_REGS_A (HIDDEN <= 256 || HEAD_WIDE)
// The output noise in shared memory: 32 bits an entry (a thread's two columns in one
// 8-byte load), or av_t's 16 where the vocabulary's would not fit so (HEAD_WIDE).
#if HEAD_WIDE
typedef av_t head_av_t;
#else
typedef int head_av_t;
#endif
// The lookups (both passes) shift the folded term (common.cuh's folded_term, one
// multiply-add) by SHIFT_LOGIT + MSHIFT rather than the logit before its shift by
// SHIFT_LOGIT, where FOLD_FITS.
#ifndef HEAD_FOLD
#define HEAD_FOLD (HEAD_REGS_A && FOLD_FITS(SHIFT_LOGIT, 0))
#endif
// One pass where sure (below); beside rows read from shared memory the interval's
// registers spill: two passes there.
#ifndef HEAD_ONE_PASS
#define HEAD_ONE_PASS HEAD_REGS_A
#endif
// Open rows a block sums again on the CUDA cores, a group of TILE_N threads each (the
// embedding read once for all), at most one a group; with more it sweeps again (with
// HEAD_WIDE always: the rows are no longer in shared memory, and a dot product of wide
// rows on the CUDA cores reads the embedding from L2 as a sweep does). The embedding's
// tiles come OPEN_DEPTH ahead of the products (its reads from L2 bound this; at narrow
// rows a deeper ring spills the sweep's registers).
#ifndef OPEN_ROWS
#define OPEN_ROWS (HEAD_WIDE ? 0 : HEAD_THREADS / TILE_N)
#endif
#ifndef OPEN_DEPTH
#define OPEN_DEPTH (HIDDEN >= 256 ? 4 : 1)
#endif
static_assert((HEAD_WIDE ? OPEN_ROWS == 0 : OPEN_ROWS >= 1 && OPEN_ROWS <= HEAD_THREADS / TILE_N) &&
                  TILE_N % 32 == 0,
              "OPEN_ROWS");
// HEAD_LIVE (gpu/plan.py: wide blocks where the table's entry EXP_LAST is 0): a move's
// error counts the live values only (below), which the lookups of HEAD_REGS_A count.
#ifndef HEAD_LIVE
#define HEAD_LIVE 0
#endif
static_assert(!HEAD_LIVE || HEAD_REGS_A, "HEAD_LIVE");
#if HEAD_FOLD
#define LOOKUP_SHIFT (SHIFT_LOGIT + MSHIFT)
#else
#define LOOKUP_SHIFT SHIFT_LOGIT
#endif

#define ROW32 (EXP_MAX * ((VOCAB + TILE_N - 1) / TILE_N * TILE_N / 4) < 4294967296)  // preprocessor: 64-bit
#if ROW32
typedef u32 row_sum_t;
#else
typedef unsigned long long row_sum_t;
#endif

// A quad's sum of one float each, rounded down or up (each thread gets the same sum).
__device__ __forceinline__ float quad_sum_rd(float v) {
    v = __fadd_rd(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return __fadd_rd(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum_ru(float v) {
    v = __fadd_ru(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return __fadd_ru(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

extern "C" __global__ void __launch_bounds__(HEAD_THREADS, 1)
head_loss_sm90(const i8* y, const i8* emb_t, const i8* emb_cores, const int* sb, const int* tokens,
               const u32* seeds, const int* signs, const i8* ov_out, u32 off_a, const int* exp_tab,
               const float* exp_bounds, u32* loss, u64* again, int rows) {
    extern __shared__ __align__(128) unsigned char head_loss_sm90_shared[];
    i8* s_a = (i8*)head_loss_sm90_shared;                     // HEAD_ROWS rows, core matrices
    i8* s_b = HEAD_WIDE ? s_a : s_a + HEAD_ROWS * HIDDEN;     // [2] tiles of TILE_N rows, core matrices
    constexpr int TILES = (VOCAB + TILE_N - 1) / TILE_N;
    static_assert(!HEAD_WIDE || HEAD_ROWS >= 2 * TILE_N, "the tiles fit where the rows were staged");
    constexpr int STAGED = (HEAD_WIDE ? HEAD_ROWS : HEAD_ROWS + 2 * TILE_N) * HIDDEN;
    // The output noise a pair (its members share their seed)
    head_av_t* s_av = (head_av_t*)(s_a + STAGED);                // [PAIRS_OF(HEAD_ROWS)][TILES * TILE_N]
    int* s_exp = (int*)(s_av + PAIRS_OF(HEAD_ROWS) * TILES * TILE_N);  // [EXP_LAST + 1][EXP_COPIES]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int row0 = blockIdx.x * HEAD_ROWS;
    const int m0 = row0 / SEQ;
    const int n_members = (min(row0 + HEAD_ROWS, rows) - 1) / SEQ - m0 + 1;
    // the warpgroup's 64 rows (not from warpgroup_index(), as up_gelu_sm90's: at hidden
    // 512, where the products read them here, their descriptors then spilled 160 bytes)
    const i8* s_rows = s_a + (warp >> 2) * 64 * HIDDEN;

    rows_to_cores(s_a, y, row0, HEAD_ROWS, rows);
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
    // (HEAD_WIDE: the tiles' bulk copies, through the async proxy, overwrite the rows
    // once the block is past the barrier that opens the sweep)
    if (HEAD_WIDE) fence_async_shared();
#endif

    // emb_cores: the embedding in the core-matrix layout, zero rows past the vocabulary.
    // The members' output noise over the whole vocabulary, once for both passes: built
    // tile by tile, its global loads stalled every warp between two tiles' products.
    const int n_pairs = (m0 + n_members - 1) / 2 - m0 / 2 + 1;
    tile_noise(s_av, n_pairs, m0, seeds, off_a, ov_out, 0, VOCAB, TILES * TILE_N, true);

    int peak[2] = {INT_MIN_, INT_MIN_};  // the rows' running peaks, shifted logits
    // exact, since the peak last rose: a thread's whole row fits 32 bits where ROW32
    row_sum_t total[2] = {0, 0};
    float lo[2] = {0.f, 0.f}, hi[2] = {0.f, 0.f};  // the terms summed before
    // HEAD_LIVE: values summed at an entry of at most EXP_LAST. The rest sit at that
    // zero entry under every later peak and move exactly, so only these count towards
    // a move's error (one_pass.py); counting all values left 1.3% of hidden-1024 rows
    // open, and a wide block sweeps again for one
    u32 live[2] = {0u, 0u};
#if HEAD_REGS_A
    // The lookups in a clamp, a shift and a multiply-add a logit (the integer pipe
    // bounds this epilogue): entry min(peak - (key >> LOOKUP_SHIFT), EXP_LAST) is at
    // last - (max(key, lowest) >> LOOKUP_SHIFT) entries, last the address of entry peak
    // (wrapping) and lowest the least key whose logit is peak - EXP_LAST or more (an
    // arithmetic shift is monotone), or INT_MIN. Made again only when a peak rises (made
    // every tile, they were 15 instructions a tile and row). (Beside rows read from
    // shared memory, last and lowest spilled registers: the plain lookup there.)
    u32 last[2];
    int lowest[2];
    auto set_lookup = [&](int s) {
        last[s] = my_exp + (u32)peak[s] * (4 * EXP_COPIES);
        lowest[s] = (int)max(((long long)peak[s] - EXP_LAST) * (1ll << LOOKUP_SHIFT), (long long)INT_MIN_);
    };
    set_lookup(0);
    set_lookup(1);
#endif

    // A value's key: its logit is key >> LOOKUP_SHIFT (HEAD_FOLD: the folded term).
    auto key_of = [&](const int (&d)[32], auto av, int j, int e, int s) {
        const int a_v = mine.of_pair(av, s, 8 * j + 2 * tig + e, TILES * TILE_N);
#if HEAD_FOLD
        return (int)folded_term(d[4 * j + 2 * s + e], mine.sbs[s], a_v);
#else
        return wrap_add(d[4 * j + 2 * s + e], rank1_term(mine.sbs[s], a_v));
#endif
    };

    // Tile t's epilogue on its products d: pass 0 moves the peaks, then both passes sum.
    // Pass 0 writes the keys over d (the products are dead once their keys are made),
    // so its lookups neither load the noise again nor redo the multiply-add: the
    // epilogue's shared-memory reads, beside the MMAs' reads of the tiles, bound it.
    auto epilogue = [&](int (&d)[32], int tile, int pass) {
        const head_av_t* av = s_av + tile * TILE_N;
        const int v0 = tile * TILE_N;
        if (pass == 0) {
            int top[2] = {INT_MIN_, INT_MIN_};
#pragma unroll
            for (int j = 0; j < TILE_N / 8; j++)
#pragma unroll
                for (int e = 0; e < 2; e++)
#pragma unroll
                    for (int s = 0; s < 2; s++)
                        if (!VOCAB_PAD || v0 + 8 * j + 2 * tig + e < VOCAB) {
                            d[4 * j + 2 * s + e] = key_of(d, av, j, e, s);
                            top[s] = max(top[s], d[4 * j + 2 * s + e]);
                        }
            // Both rows' peaks before one branch (with a branch a row, ptxas put the second
            // row's maximum after the first's branch, one latency chain after the other)
#pragma unroll
            for (int s = 0; s < 2; s++) top[s] = quad_max(top[s]) >> LOOKUP_SHIFT;
            if (top[0] > peak[0] || top[1] > peak[1]) {
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    if (top[s] <= peak[s]) continue;
                    if (HEAD_ONE_PASS && tile > 0) {  // move what the thread summed: exp_bounds' row d
                        // (the rise in u32: logits 2^31 or more apart, at LOOKUP_SHIFT 0, wrap an int)
                        const u32 rise = min((u32)top[s] - (u32)peak[s], (u32)EXP_LAST);
                        const float4 b = __ldg((const float4*)exp_bounds + rise);
                        const float n = HEAD_LIVE ? (float)live[s] : (float)(tile * (TILE_N / 4));  // >= terms
                        const float x_lo = __fadd_rd(lo[s], __ull2float_rd(total[s]));
                        const float x_hi = __fadd_ru(hi[s], __ull2float_ru(total[s]));
                        lo[s] = fmaxf(0.f, __fmaf_rd(b.x, x_lo, -__fmul_ru(n, b.y)));
                        hi[s] = __fmaf_ru(b.x, x_hi, __fmul_ru(n, b.z));
                        total[s] = 0;
                    }
                    peak[s] = top[s];
#if HEAD_REGS_A
                    set_lookup(s);
#endif
                }
            }
            if (!HEAD_ONE_PASS) return;
        }
#if TOTAL32
        u32 part[2] = {0u, 0u};
#else
        row_sum_t* part = total;
#endif
#pragma unroll
        for (int j = 0; j < TILE_N / 8; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int col = 8 * j + 2 * tig + e;
                if (VOCAB_PAD && v0 + col >= VOCAB) continue;
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    const int key = pass == 0 ? d[4 * j + 2 * s + e] : key_of(d, av, j, e, s);
#if HEAD_REGS_A
                    part[s] += shared_word(last[s] - (u32)(max(key, lowest[s]) >> LOOKUP_SHIFT) * (4 * EXP_COPIES));
                    if (HEAD_LIVE && pass == 0) live[s] += key >= lowest[s];
#else
                    const u32 dist = (u32)peak[s] - (u32)(key >> LOOKUP_SHIFT);  // >= 0
                    part[s] += shared_word(my_exp + min(dist, (u32)EXP_LAST) * (4 * EXP_COPIES));
#endif
                }
            }
#if TOTAL32
#pragma unroll
        for (int s = 0; s < 2; s++) total[s] += part[s];
#endif
    };

    auto products = [&](int (&d)[32], const i8* tile) {
#if HEAD_REGS_A
        tile_product_regs(d, a, tile);
#else
        tile_product_async(d, s_rows, tile);
#endif
    };
    // `pass` a constant in each sweep's epilogue, as in head_loss
    sweep_async<TILE_N * HIDDEN, 32, HEAD_THREADS>(TILES, s_b, emb_cores, products,
                                 [&](int (&d)[32], int tile) { epilogue(d, tile, 0); });
    // A row's sum: exact where no term was moved, else 2^floor(log2) where the interval
    // [lo, hi] leaves one (it holds the sum, which is at least the peak's 2^SCALE_BIT).
    unsigned long long sums[2];
    bool open[2] = {false, false};
#pragma unroll
    for (int s = 0; s < 2; s++) {
        sums[s] = quad_sum((unsigned long long)total[s]);
        const float l = quad_sum_rd(lo[s]), h = quad_sum_ru(hi[s]);
        if (h == 0.f) continue;
        const float low = fmaxf(__fadd_rd(l, __ull2float_rd(sums[s])), (float)(1u << SCALE_BIT));
        const int e_low = __float_as_int(low) >> 23;
        open[s] = mine.valid[s] && e_low != __float_as_int(__fadd_ru(h, __ull2float_ru(sums[s]))) >> 23;
        sums[s] = 1ull << (e_low - 127);
    }

    // Rows left open: up to OPEN_ROWS summed again on the CUDA cores, more by a sweep.
    __shared__ int s_open;
    constexpr int OPEN_SLOTS = OPEN_ROWS > 0 ? OPEN_ROWS : 1;
    __shared__ int s_open_row[OPEN_SLOTS], s_open_peak[OPEN_SLOTS];  // of the block's rows
    __shared__ unsigned long long s_open_sum[OPEN_SLOTS];
    if (threadIdx.x == 0) s_open = 0;
    __syncthreads();
    int slot[2] = {-1, -1};
#pragma unroll
    for (int s = 0; s < 2; s++) {
        if (!open[s] || tig != 0) continue;
        slot[s] = atomicAdd(&s_open, 1);
        if (slot[s] >= OPEN_ROWS) continue;
        s_open_row[slot[s]] = 16 * warp + g + 8 * s;
        s_open_peak[slot[s]] = peak[s];
        s_open_sum[slot[s]] = 0ull;
    }
    __syncthreads();
    const int n_open = HEAD_ONE_PASS ? s_open : OPEN_ROWS + 1;  // block-uniform
    if (n_open > OPEN_ROWS) {  // sweep_async synchronizes the block
        if (threadIdx.x == 0) atomicAdd(again, 1ull);
        total[0] = total[1] = 0;
        sweep_async<TILE_N * HIDDEN, 32, HEAD_THREADS>(TILES, s_b, emb_cores, products,
                                     [&](int (&d)[32], int tile) { epilogue(d, tile, 1); });
#pragma unroll
        for (int s = 0; s < 2; s++) sums[s] = quad_sum((unsigned long long)total[s]);
    } else if (OPEN_ROWS > 0 && n_open > 0) {
        if (threadIdx.x == 0) atomicAdd(again + 1, (unsigned long long)n_open);
        // The embedding a tile at a time into s_b (the sweeps are done with it), its rows
        // padded by 16 bytes so that lanes reading their own rows use every bank; the
        // next tile's loads in flight during this one's products. Thread (i, vr) makes
        // the logit of vocabulary row vr of the tile for open row i, and its entry.
        constexpr int LD = HIDDEN + 16, PIECES = TILE_N * TILE_PIECES;
        constexpr int PER = (PIECES + HEAD_THREADS - 1) / HEAD_THREADS;
        const int vr = threadIdx.x % TILE_N, i = threadIdx.x / TILE_N;  // warp-uniform i
        const bool active = i < n_open;
        const int r = active ? s_open_row[i] : 0, row = row0 + r, m = row / SEQ;
        const u32 sbs = active ? (u32)sb[row] * (u32)signs[m] : 0u;
        const head_av_t* av = s_av + (m / 2 - m0 / 2) * (TILES * TILE_N);
        const u32 top = active ? (u32)s_open_peak[i] : 0u;
        const i8* x = s_a + (r >> 3) * CORE_SBO + (r & 7) * 16;
        auto load = [&](int4 (&w)[PER], int tile) {
#pragma unroll
            for (int k = 0; k < PER; k++) {
                const int at = threadIdx.x + k * HEAD_THREADS, v = tile * TILE_N + at / TILE_PIECES;
                w[k] = at < PIECES && v < VOCAB ? __ldg((const int4*)(emb_t + (long)v * HIDDEN) + at % TILE_PIECES)
                                                 : make_int4(0, 0, 0, 0);
            }
        };
        int4 ring[OPEN_DEPTH][PER];  // tile t's loads in ring[t % OPEN_DEPTH]
#pragma unroll
        for (int k = 0; k < OPEN_DEPTH; k++) load(ring[k], k);
        unsigned long long part = 0ull;
        for (int t0 = 0; t0 < TILES; t0 += OPEN_DEPTH)
#pragma unroll
            for (int k = 0; k < OPEN_DEPTH; k++) {  // unrolled: ring's index a constant
                const int tile = t0 + k;
                if (tile >= TILES) break;
                __syncthreads();  // the tile before is read
#pragma unroll
                for (int q = 0; q < PER; q++) {
                    const int at = threadIdx.x + q * HEAD_THREADS;
                    if (at < PIECES) *(int4*)(s_b + at / TILE_PIECES * LD + at % TILE_PIECES * 16) = ring[k][q];
                }
                __syncthreads();
                load(ring[k], tile + OPEN_DEPTH);
                const int v = tile * TILE_N + vr;
                if (!active || v >= VOCAB) continue;
                int dot = 0;
                for (int piece = 0; piece < TILE_PIECES; piece++) {
                    const int4 e = *(const int4*)(s_b + vr * LD + piece * 16);
                    const int4 y4 = *(const int4*)(x + piece * CORE_LBO);
                    dot = __dp4a(y4.w, e.w, __dp4a(y4.z, e.z, __dp4a(y4.y, e.y, __dp4a(y4.x, e.x, dot))));
                }
                const int logit = wrap_add(dot, rank1_term(sbs, av[v])) >> SHIFT_LOGIT;
                part += shared_word(my_exp + min(top - (u32)logit, (u32)EXP_LAST) * (4 * EXP_COPIES));
            }
        if (active) {
            for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
            if (lane == 0) atomicAdd(&s_open_sum[i], part);
        }
        __syncthreads();
#pragma unroll
        for (int s = 0; s < 2; s++) {
            const int i = __shfl_sync(0xffffffffu, slot[s], lane & ~3);  // the quad's tig 0
            if (i >= 0) sums[s] = s_open_sum[i];
        }
    }

    // The target's logit: the quad splits the row's dot product with its embedding row
    // (HEAD_WIDE: the row from global memory, the tiles having overwritten it).
#pragma unroll
    for (int s = 0; s < 2; s++) {
        const unsigned long long t = sums[s];
        const int r = 16 * warp + g + 8 * s;  // of the block's rows
        const int m = m0 + mine.member[s];
        const int target = mine.valid[s] ? tokens[m * (SEQ + 1) + (row0 + r) % SEQ + 1] : 0;
        const i8* x = HEAD_WIDE ? y + (long)(mine.valid[s] ? row0 + r : 0) * HIDDEN + 4 * tig
                                : s_a + (r >> 3) * CORE_SBO + (r & 7) * 16 + 4 * tig;
        const int x_step = HEAD_WIDE ? 16 : CORE_LBO;
        const i8* e_row = emb_t + (long)target * HIDDEN + 4 * tig;
        int dot = 0;
        for (int piece = 0; piece < TILE_PIECES; piece++)
            dot = __dp4a(*(const int*)(x + piece * x_step), *(const int*)(e_row + 16 * piece), dot);
        dot = quad_sum(dot);
        if (tig == 0 && mine.valid[s])
            add_position_loss(loss + m, t, peak[s], dot, mine.sbs[s], seeds[m] + off_a, ov_out, target);
    }
}
