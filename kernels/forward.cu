// The forward pass of a batch of population members: epilogues of the cuBLAS GEMMs,
// one thread block per member (attention: per member and head).

#include "common.cuh"

#define LPT ((VOCAB + NT - 1) / NT)  // logits per thread of sequence_loss
#ifndef LOSS_BACKWARD
#define LOSS_BACKWARD 1  // sequence_loss's second read of a row from its end (below)
#endif

// The embedding's rank-1 term of a row (token) entry and a column (feature) entry,
// (int)((float)(a b) factor_row factor_col). In modes 0 and 1 the factors are k / 64 and
// both float products are exact while |a b k_r k_c| < 2^24 (dot_term's reasoning), so it
// is the integer (a k_r)(b k_c) / 4096 of the two dot entries, truncated as C divides.
#define EMBED_INT (INT_FACTOR && NOISE_N * NOISE_N * 4096 < (1 << 24))
#if EMBED_INT
typedef int embed_entry;
__device__ __forceinline__ embed_entry embed_entry_of(const i8* ov, u32 seed, u32 j) { return dot_entry(ov, seed, j); }
__device__ __forceinline__ int embed_term(embed_entry row, embed_entry col) { return row * col / 4096; }
#else
typedef int2 embed_entry;  // the noise and the bits of its float factor
__device__ __forceinline__ embed_entry embed_entry_of(const i8* ov, u32 seed, u32 j) {
    return make_int2(noise(seed, j), __float_as_int(adaptive_factor(ov, seed, j)));
}
__device__ __forceinline__ int embed_term(embed_entry row, embed_entry col) {
    const float ab = __int2float_rn(row.x * col.x);
    return __float2int_rz(__fmul_rn(__fmul_rn(ab, __int_as_float(row.y)), __int_as_float(col.y)));
}
#endif

// standard_norm with perturbed weight and bias, then up to three input dot products
// sb[p][row] = sum_i dot_term(y_i, entry_i) for the projections that read y: per-member
// tables and a row, device functions that embed_norm and residual_norm run.

// The member's tables in s_norm (at most 8 HIDDEN words), lane-major (common.cuh's
// lane_slot): weight and bias with their noise, and each input dot's entries
// (dot_t[3][HIDDEN]: 1 or 2 words each); and s_magic[d], Divisor's multiplier of each
// mean d a row can have (0..MEAN_MAX).
__device__ __forceinline__ void norm_tables(int* s_norm, u32* s_magic, u32 seed, int sign, const i8* w,
                                            const i8* b, const i8* ov_w, const i8* ov_b, u32 w_a, u32 w_b,
                                            u32 b_a, u32 b_b, int ndots, const i8* ov0, const i8* ov1,
                                            const i8* ov2, u32 off0, u32 off1, u32 off2) {
    const i8* ovs[3] = {ov0, ov1, ov2};
    const u32 offs[3] = {off0, off1, off2};
    dot_t* s_dot = (dot_t*)(s_norm + 2 * HIDDEN);
    // Loops over the dots run to 3 with a test, unrolled: runtime-indexed arrays would
    // live in local memory, read and written for every element.
    for (int f = threadIdx.x; f < HIDDEN; f += blockDim.x) {
        const int at = lane_slot(f);
        s_norm[at] = (w[f] + vector_noise(ov_w, seed, w_a, w_b, f, sign)) * NORM_SCALE;
        s_norm[HIDDEN + at] = b[f] + vector_noise(ov_b, seed, b_a, b_b, f, sign);
#pragma unroll
        for (int p = 0; p < 3; p++)
            if (p < ndots) s_dot[p * HIDDEN + at] = dot_entry(ovs[p], seed + offs[p], f);
    }
    for (int d = threadIdx.x; d <= MEAN_MAX; d += blockDim.x) s_magic[d] = divisor_magic(d);
}

// standard_norm of the row a warp holds (lane: features LANE + 32 i of xv) into yr, and
// its NDOTS input dots into sb[p * rows + row].
template <int NDOTS>
__device__ __forceinline__ void norm_row_dots(const int* xv, i8* yr, int* sb, long row, int rows,
                                              const int* s_norm, const u32* s_magic) {
    const dot_t* s_dot = (const dot_t*)(s_norm + 2 * HIDDEN);
    u32 s = 0;
#pragma unroll
    for (int i = 0; i < FPL; i++) s += (u32)abs(xv[i]);
    // The mean is at most MEAN_MAX (xv are bytes), and in modes 0 and 1 |xv w| < 2^21:
    // |w| <= 127 + 93^2 (a weight and its vector noise), as Divisor's multiply needs
    // (the table's w is NORM_SCALE times it).
    const int mean = (int)(warp_sum_u32(s) / HIDDEN);
    const Divisor by_mean(mean == 0 ? 1 : mean, s_magic[mean]);
    u32 dots[3] = {0u, 0u, 0u};
#pragma unroll
    for (int j = 0; j < FPL / RUN; j++) {
        const Run<int> wr = lane_run(s_norm, j), br = lane_run(s_norm + HIDDEN, j);
        Run<dot_t> dr[3];
#pragma unroll
        for (int p = 0; p < NDOTS; p++) dr[p] = lane_run(s_dot + p * HIDDEN, j);
#pragma unroll
        for (int c = 0; c < RUN; c++) {
            const int i = RUN * j + c;
            const int v = clip8(by_mean(xv[i] * wr.v[c]) + br.v[c]);
            yr[LANE + 32 * i] = (i8)v;
#pragma unroll
            for (int p = 0; p < NDOTS; p++) dots[p] += (u32)dot_term(v, dr[p].v[c]);
        }
    }
#pragma unroll
    for (int p = 0; p < NDOTS; p++) {
        const u32 total = warp_sum_u32(dots[p]);
        if (LANE == 0) sb[(long)p * rows + row] = (int)total;
    }
}

// The dot count as a constant of the row's code: with the runtime count in the
// element loop, every element issued all three dots' instructions, predicated off.
__device__ __forceinline__ void norm_row(const int* xv, i8* yr, int* sb, long row, int rows, int ndots,
                                         const int* s_norm, const u32* s_magic) {
    switch (ndots) {
        case 0: norm_row_dots<0>(xv, yr, sb, row, rows, s_norm, s_magic); break;
        case 1: norm_row_dots<1>(xv, yr, sb, row, rows, s_norm, s_magic); break;
        case 2: norm_row_dots<2>(xv, yr, sb, row, rows, s_norm, s_magic); break;
        default: norm_row_dots<3>(xv, yr, sb, row, rows, s_norm, s_magic);
    }
}

// The embedding and the first norm, a warp a row: the row's token's table row plus the
// embedding bias and the rank-1 term, each with its perturbation, into x; then
// standard_norm's row of the registers into y and its input dots into sb. One kernel:
// x is not read back, and the row's rank-1 entry is hashed once a row.
extern "C" __global__ void embed_norm(const int* tokens, const u32* seeds, const int* signs,
                                      const i8* emb_t, const i8* emb_bias, const i8* ov_row,
                                      const i8* ov_col, const i8* ov_bias, u32 off_emb,
                                      u32 off_bias_a, u32 off_bias_b, i8* x, i8* y, const i8* w,
                                      const i8* b, const i8* ov_w, const i8* ov_b, u32 w_a, u32 w_b,
                                      u32 b_a, u32 b_b, int ndots, const i8* ov0, const i8* ov1,
                                      const i8* ov2, u32 off0, u32 off1, u32 off2, int* sb, int seq,
                                      int rows) {
    extern __shared__ __align__(32) int s_norm[];  // dynamic: 8 HIDDEN words (gpu.shared_memory)
    __shared__ __align__(16) int s_bias[HIDDEN];        // lane-major, as s_norm
    __shared__ __align__(32) embed_entry s_col[HIDDEN];  // lane-major
    __shared__ u32 s_magic[MEAN_MAX + 1];
    const int m = blockIdx.x;
    const u32 seed = seeds[m];
    const int sign = signs[m];
    for (int f = threadIdx.x; f < HIDDEN; f += blockDim.x) {
        s_bias[lane_slot(f)] = emb_bias[f] + vector_noise(ov_bias, seed, off_bias_a, off_bias_b, f, sign);
        s_col[lane_slot(f)] = embed_entry_of(ov_col, seed + off_emb + HIDDEN, f);
    }
    norm_tables(s_norm, s_magic, seed, sign, w, b, ov_w, ov_b, w_a, w_b, b_a, b_b, ndots, ov0, ov1, ov2,
                off0, off1, off2);
    // A row's token and table row, loaded ahead where ROW_PREFETCH (common.cuh)
    constexpr bool PREFETCH = ROW_PREFETCH;
    int tok_next = 0, w_next[FPL];
    auto fetch = [&](int t) {
        if (t >= seq) return;
        tok_next = tokens[m * (seq + 1) + t];
        const i8* table_row = emb_t + (long)tok_next * HIDDEN;
#pragma unroll
        for (int i = 0; i < FPL; i++) w_next[i] = table_row[LANE + 32 * i];
    };
    if (PREFETCH) fetch(WARP);
    __syncthreads();
    for (int t = WARP; t < seq; t += NWARPS) {
        const long row = (long)m * seq + t;
        if (!PREFETCH) fetch(t);
        const embed_entry row_entry = embed_entry_of(ov_row, seed + off_emb, tok_next);
        int v[FPL];
#pragma unroll
        for (int j = 0; j < FPL / RUN; j++) {
            const Run<int> bias_run = lane_run(s_bias, j);
            const Run<embed_entry> col_run = lane_run(s_col, j);
#pragma unroll
            for (int c = 0; c < RUN; c++) {
                const int i = RUN * j + c;
                v[i] = clip8(w_next[i] + bias_run.v[c] + ((embed_term(row_entry, col_run.v[c]) * sign) >> MSHIFT32));
            }
        }
        if (PREFETCH) fetch(t + NWARPS);
#pragma unroll
        for (int i = 0; i < FPL; i++) x[row * HIDDEN + LANE + 32 * i] = (i8)v[i];
        norm_row(v, y + row * HIDDEN, sb, row, rows, ndots, s_norm, s_magic);
    }
}

// Per-member output side of a projection: av[j] = (int)(a_j * factor_j).
template <typename T>
__device__ __forceinline__ void output_noise(T* av, int n, const i8* ov, u32 seed) {
    for (int j = threadIdx.x; j < n; j += blockDim.x)
        av[j] = (T)output_noise_of(ov, seed, j);
}

// Q, K, V: rank-1 terms, RoPE on Q and K, max-abs normalisation of each.
// g is [rows, 3 * HIDDEN] (q | k | v), sb is [3][rows], out is [3][rows, HIDDEN];
// rope_tab starts at the position of each member's row 0.
extern "C" __global__ void qkv_rope(const int* g, const int* sb, i8* out, const u32* seeds,
                                    const int* signs, const i8* ov_q, const i8* ov_k, const i8* ov_v,
                                    u32 q_a, u32 k_a, u32 v_a, const int* rope_tab, int seq, int rows) {
    __shared__ int s_av[3][HIDDEN];
    const int m = blockIdx.x;
    const u32 seed = seeds[m];
    const int sign = signs[m];
    output_noise(s_av[0], HIDDEN, ov_q, seed + q_a);
    output_noise(s_av[1], HIDDEN, ov_k, seed + k_a);
    output_noise(s_av[2], HIDDEN, ov_v, seed + v_a);
    __syncthreads();
    const long long half = 1ll << (ROPE_SHIFT - 1);
    for (int t = WARP; t < seq; t += NWARPS) {
        const long row = (long)m * seq + t;
        // The row's loads first, all in flight together (see mlp_up), where they take at
        // most 24 registers; else the next projection's beside the one in use (at hidden
        // 1024 all three took 167 registers: one block an SM)
        constexpr int AHEAD = FPL <= 8 ? 3 : 2;
        int gv[AHEAD][FPL];
        auto load = [&](int p, int b) {
#pragma unroll
            for (int i = 0; i < FPL; i++) gv[b][i] = g[row * 3 * HIDDEN + p * HIDDEN + LANE + 32 * i];
        };
#pragma unroll
        for (int p = 0; p < (AHEAD == 3 ? 3 : 1); p++) load(p, p);
#pragma unroll
        for (int p = 0; p < 3; p++) {
            const int b = AHEAD == 3 ? p : p & 1;
            if (AHEAD == 2 && p < 2) load(p + 1, (p + 1) & 1);
            const int s = sb[(long)p * rows + row];
            int v[FPL];
#pragma unroll
            for (int i = 0; i < FPL; i++) {
                const int f = LANE + 32 * i;
                v[i] = wrap_add(gv[b][i], output_term(s, s_av[p][f], sign));
            }
            if (p < 2) {
#pragma unroll
                for (int i = 0; i < FPL; i++) {
                    const int f = LANE + 32 * i;
                    const int other = __shfl_xor_sync(0xffffffffu, v[i], 1);
                    const int pi = (f % HEAD_DIM) >> 1;
                    const long long c = rope_tab[(t * (HEAD_DIM / 2) + pi) * 2];
                    const long long sn = rope_tab[(t * (HEAD_DIM / 2) + pi) * 2 + 1];
                    const long long even = (f & 1) ? other : v[i], odd = (f & 1) ? v[i] : other;
                    const long long r = (f & 1) ? (even * sn + odd * c + half) : (even * c - odd * sn + half);
                    v[i] = (int)(r >> ROPE_SHIFT);
                }
            }
            max_abs_normalize_warp(v, out + (long)p * rows * HIDDEN + row * HIDDEN);
        }
    }
}

// q . k over one head: packed int8 words, four per 128-bit shared load.
__device__ __forceinline__ int qk_dot(const int* qw, const int* kw) {
    int sc[4] = {0, 0, 0, 0};  // four independent chains (integer sums: order is free)
#pragma unroll
    for (int w4 = 0; w4 < HEAD_DIM / 16; w4++) {
        const int4 kk = ((const int4*)kw)[w4];
        sc[0] = __dp4a(qw[4 * w4], kk.x, sc[0]);
        sc[1] = __dp4a(qw[4 * w4 + 1], kk.y, sc[1]);
        sc[2] = __dp4a(qw[4 * w4 + 2], kk.z, sc[2]);
        sc[3] = __dp4a(qw[4 * w4 + 3], kk.w, sc[3]);
    }
    return (sc[0] + sc[1]) + (sc[2] + sc[3]);
}

// Causal integer softmax attention, block per (member, head): ATT_SPLIT threads per
// query, each accumulating ATT_DIMS of the head's dimensions. Writes the mixed values
// and adds their o-projection input dot into sb_o (zeroed before).
#define ATT_SPLIT 2
#define ATT_DIMS (HEAD_DIM / ATT_SPLIT)
extern "C" __global__ void attention_mix(const i8* q, const i8* k, const i8* v, i8* mixed,
                                         int* sb_o, const u32* seeds, const i8* ov_o_in, u32 o_b,
                                         const int* exp_tab) {
    // dynamic: keys then values of the head, packed int8, SEQ x HEAD_DIM / 4 words each
    extern __shared__ __align__(16) int s_kv[];
    int* s_k = s_kv;
    int* s_v = s_kv + SEQ * (HEAD_DIM / 4);
    __shared__ int s_exp[LUT_SIZE];
    __shared__ dot_t s_dot[HEAD_DIM];  // o's input dot entries
    const int m = blockIdx.x, h = blockIdx.y;
    const u32 seed = seeds[m];
    for (int i = threadIdx.x; i < SEQ * (HEAD_DIM / 16); i += blockDim.x) {
        const int s = i / (HEAD_DIM / 16), w = i % (HEAD_DIM / 16);
        const long at = ((long)m * SEQ + s) * HIDDEN + h * HEAD_DIM;
        ((int4*)(s_k + s * (HEAD_DIM / 4)))[w] = ((const int4*)(k + at))[w];
        ((int4*)(s_v + s * (HEAD_DIM / 4)))[w] = ((const int4*)(v + at))[w];
    }
    for (int i = threadIdx.x; i < LUT_SIZE; i += blockDim.x) s_exp[i] = exp_tab[i];
    for (int i = threadIdx.x; i < HEAD_DIM; i += blockDim.x)
        s_dot[i] = dot_entry(ov_o_in, seed + o_b, h * HEAD_DIM + i);
    __syncthreads();
    const int t = threadIdx.x % SEQ, part = threadIdx.x / SEQ;
    if (part >= ATT_SPLIT) return;
    const long row = (long)m * SEQ + t;
    int qw[HEAD_DIM / 4];
#pragma unroll
    for (int w4 = 0; w4 < HEAD_DIM / 16; w4++) {
        const int4 qq = ((const int4*)(q + row * HIDDEN + h * HEAD_DIM))[w4];
        qw[4 * w4] = qq.x;
        qw[4 * w4 + 1] = qq.y;
        qw[4 * w4 + 2] = qq.z;
        qw[4 * w4 + 3] = qq.w;
    }
    int peak = INT_MIN_;
#pragma unroll 4
    for (int s = 0; s <= t; s++) peak = max(peak, qk_dot(qw, s_k + s * (HEAD_DIM / 4)));
    const int d0 = part * ATT_DIMS;
    attn_acc acc[ATT_DIMS];
#pragma unroll
    for (int d = 0; d < ATT_DIMS; d++) acc[d] = 0;
    int total = 0;
    const int top = peak >> SHIFT_ATTN;
#pragma unroll 2
    for (int s = 0; s <= t; s++) {
        int idx = top - (qk_dot(qw, s_k + s * (HEAD_DIM / 4)) >> SHIFT_ATTN);
        idx = idx < 0 ? 0 : (idx > LUT_SIZE - 1 ? LUT_SIZE - 1 : idx);
        const int wgt = s_exp[idx];
        total += wgt;
        const int4* vrow = (const int4*)(s_v + s * (HEAD_DIM / 4) + d0 / 4);
#pragma unroll
        for (int d16 = 0; d16 < ATT_DIMS / 16; d16++) {
            const int4 vv = vrow[d16];
            const int words[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int wd = words[c];
                acc[16 * d16 + 4 * c] += (attn_acc)wgt * ((wd << 24) >> 24);
                acc[16 * d16 + 4 * c + 1] += (attn_acc)wgt * ((wd << 16) >> 24);
                acc[16 * d16 + 4 * c + 2] += (attn_acc)wgt * ((wd << 8) >> 24);
                acc[16 * d16 + 4 * c + 3] += (attn_acc)wgt * (wd >> 24);
            }
        }
    }
    if (total == 0) total = 1;
    u32 dot = 0;
#pragma unroll
    for (int d = 0; d < ATT_DIMS; d++) {
        const int dd = d0 + d;
        const int val = clip8((int)(acc[d] / (attn_acc)total));
        mixed[row * HIDDEN + h * HEAD_DIM + dd] = (i8)val;
        dot += (u32)dot_term(val, s_dot[dd]);
    }
    atomicAdd((u32*)&sb_o[row], dot);
}

// Residual after a projection to HIDDEN outputs, then the next block's standard_norm
// of the new x (one kernel: x's row is normalised from registers, not read back):
// x = max_abs_normalize(x + (out >> shift) [+ bias + its noise]) in place, out = g +
// rank-1 term (its input dot sb_in); then y = standard_norm(x) and its input dots in
// sb_out, as its norm arguments say. (residual_sm90.cu fuses it with the o- and
// the down-projection's GEMMs.)
extern "C" __global__ void residual_norm(const int* g, const int* sb_in, i8* x,
                                         const u32* seeds, const int* signs, const i8* ov_out, u32 off_a, int shift,
                                         const i8* bias, const i8* ov_bias, u32 bias_a, u32 bias_b,
                                         i8* y, const i8* w, const i8* b, const i8* ov_w,
                                         const i8* ov_b, u32 w_a, u32 w_b, u32 b_a, u32 b_b,
                                         int ndots, const i8* ov0, const i8* ov1, const i8* ov2,
                                         u32 off0, u32 off1, u32 off2, int* sb_out, int seq,
                                         int rows) {
    extern __shared__ __align__(32) int s_norm[];  // dynamic: 8 HIDDEN words (gpu.shared_memory)
    __shared__ __align__(16) int s_av[HIDDEN];    // lane-major, as s_norm
    __shared__ __align__(16) int s_bias[HIDDEN];  // lane-major
    __shared__ u32 s_magic[MEAN_MAX + 1];
    const int m = blockIdx.x;
    const u32 seed = seeds[m];
    const int sign = signs[m];
    for (int f = threadIdx.x; f < HIDDEN; f += blockDim.x) {
        s_av[lane_slot(f)] = output_noise_of(ov_out, seed + off_a, f);
        s_bias[lane_slot(f)] = bias ? bias[f] + vector_noise(ov_bias, seed, bias_a, bias_b, f, sign) : 0;
    }
    norm_tables(s_norm, s_magic, seed, sign, w, b, ov_w, ov_b, w_a, w_b, b_a, b_b, ndots, ov0, ov1, ov2,
                off0, off1, off2);
    // A row's loads (its products, x and input dot), made ahead where ROW_PREFETCH
    // (common.cuh; scripts/kernels.py residual_norm times it against the memory bandwidth)
    constexpr bool PREFETCH = ROW_PREFETCH;
    int g_next[FPL], x_next[FPL], sb_next = 0;
    auto fetch = [&](int t) {
        if (t >= seq) return;
        const long row = (long)m * seq + t;
        sb_next = sb_in[row];
#pragma unroll
        for (int i = 0; i < FPL; i++) {
            const long at = row * HIDDEN + LANE + 32 * i;
            g_next[i] = g[at];
            x_next[i] = x[at];
        }
    };
    if (PREFETCH) fetch(WARP);
    __syncthreads();
    for (int t = WARP; t < seq; t += NWARPS) {
        const long row = (long)m * seq + t;
        if (!PREFETCH) fetch(t);
        const u32 sbs = (u32)sb_next * (u32)sign;
        int v[FPL];
#pragma unroll
        for (int j = 0; j < FPL / RUN; j++) {
            const Run<int> bias_run = lane_run(s_bias, j), av_run = lane_run(s_av, j);
#pragma unroll
            for (int c = 0; c < RUN; c++) {
                const int i = RUN * j + c;
                const int term = wrap_add(g_next[i], rank1_term(sbs, av_run.v[c])) >> shift;
                v[i] = x_next[i] + term + bias_run.v[c];
            }
        }
        if (PREFETCH) fetch(t + NWARPS);
        int xv[FPL];
        max_abs_normalize_warp(v, x + row * HIDDEN, xv);
        norm_row(xv, y + row * HIDDEN, sb_out, row, rows, ndots, s_norm, s_magic);
    }
}

// MLP up-projection epilogue: rank-1 term, >> SHIFT_MLP_UP, bias (+ noise), GELU table;
// then the down-projection's input dot as the reference's threads sum it (down_step).
extern "C" __global__ void mlp_up(const int* g, const int* sb_up, i8* hidden, int* sb_down,
                                  const u32* seeds, const int* signs, const i8* bias_up,
                                  const i8* ov_up_out, const i8* ov_bias_up, const i8* ov_down_in,
                                  u32 up_a, u32 bias_a, u32 bias_b, u32 down_b, const int* gelu,
                                  int seq) {
    extern __shared__ int s_mlp[];  // dynamic: 4 UP words (gpu.shared_memory)
    int* s_av = s_mlp;
    int* s_bias = s_mlp + UP;
    dot_t* s_down = (dot_t*)(s_mlp + 2 * UP);
    __shared__ int s_gelu[256];
    const int m = blockIdx.x;
    const u32 seed = seeds[m];
    const int sign = signs[m];
    output_noise(s_av, UP, ov_up_out, seed + up_a);
    for (int j = threadIdx.x; j < UP; j += blockDim.x) {
        s_bias[j] = bias_up[j] + vector_noise(ov_bias_up, seed, bias_a, bias_b, j, sign);
        s_down[j] = dot_entry(ov_down_in, seed + down_b, j);
    }
    for (int i = threadIdx.x; i < 256; i += blockDim.x) s_gelu[i] = gelu[i];
    __syncthreads();
    for (int t = WARP; t < seq; t += NWARPS) {
        const long row = (long)m * seq + t;
        const int s = sb_up[row];
        // The row's loads first, all in flight together: the byte stores to `hidden`
        // below could alias g as far as the compiler knows, and would keep each load
        // waiting for the stores before it. At most 8 features a lane at a time (at
        // hidden 1024 all 32 took 160 registers: one block an SM), the next group's
        // loads issued before this group's stores (80 registers there, three blocks an
        // SM; not in adaptive mode 2, where they take 96: two).
        constexpr int GROUP = FPL <= 8 ? FPL : FPL % 8 == 0 ? 8 : FPL % 4 == 0 ? 4 : FPL % 2 == 0 ? 2 : 1;
        constexpr bool AHEAD = FPL > GROUP && ADAPTIVE_MODE != 2;
        u32 total = 0;
        int gv[AHEAD ? 2 : 1][GROUP][4];
        auto load = [&](int b, int i0) {
#pragma unroll
            for (int i = 0; i < GROUP; i++)
#pragma unroll
                for (int sub = 0; sub < 4; sub++) gv[b][i][sub] = g[row * UP + LANE + 32 * (i0 + i) + sub * HIDDEN];
        };
        if (AHEAD) load(0, 0);
#pragma unroll
        for (int i0 = 0; i0 < FPL; i0 += GROUP) {
            const int b = AHEAD ? (i0 / GROUP) & 1 : 0;
            if (!AHEAD) load(0, i0);
            if (AHEAD && i0 + GROUP < FPL) load(b ^ 1, i0 + GROUP);
#pragma unroll
            for (int i = 0; i < GROUP; i++) {
                const int j0 = LANE + 32 * (i0 + i);
                int partial = 0;
#pragma unroll
                for (int sub = 0; sub < 4; sub++) {
                    const int j = j0 + sub * HIDDEN;
                    const int out = wrap_add(gv[b][i][sub], output_term(s, s_av[j], sign));
                    const int pre = (out >> SHIFT_MLP_UP) + s_bias[j];
                    const int hv = s_gelu[(unsigned char)(i8)clip8(pre)];
                    hidden[row * UP + j] = (i8)hv;
                    partial = down_step(partial, hv, s_down[j]);
                }
                total += (u32)partial;
            }
        }
        total = warp_sum_u32(total);
        if (LANE == 0) sb_down[row] = (int)total;
    }
}

// Four entries of a table of output noise (av_t), from one aligned load.
__device__ __forceinline__ void av4(const short* p, int (&a)[4]) {
    const short4 v = *(const short4*)p;
    a[0] = v.x, a[1] = v.y, a[2] = v.z, a[3] = v.w;
}
__device__ __forceinline__ void av4(const int* p, int (&a)[4]) {
    const int4 v = *(const int4*)p;
    a[0] = v.x, a[1] = v.y, a[2] = v.z, a[3] = v.w;
}

// Logits with their rank-1 term, >> SHIFT_LOGIT, and the integer cross-entropy of each
// position, summed per member. Dynamic shared memory: VOCAB av_t (the output noise).
// Up to LOSS_REGISTER_LPT logits a thread stay in registers. Past that a row is read
// once where it can be (LOSS_BINS, below), twice where not; again[0] counts the rows
// read twice.
//
// One read: a logit's term depends only on how far below the row's peak it lies, so the
// row's sum is a histogram's: T = sum over d of count[d] e[min(peak - ref - d,
// LUT_SIZE - 1)], d = l - ref for a reference logit ref of the row. ref is the larger of
// the row's input token's logit and its target's, read first (at the initial weights
// the input token's is the peak, the embedding being tied; a trained model's target's
// is likely near it). The table is 0 from entry EXP_LAST on, so a logit EXP_LAST or
// more below ref adds nothing, and the bins hold d from 1 - EXP_LAST to LOSS_BINS -
// EXP_LAST; a row whose peak lies above that is read again with its peak known.
// (LOSS_BINS > 0 where that holds, logits are shifted at least once, so that d fits 32
// bits, and the bins fit shared memory: plan.loss_bins_work; else every row is read
// twice.)
extern "C" __global__ void sequence_loss(const int* g, const int* sb, const int* tokens,
                                         const u32* seeds, const int* signs, const i8* ov_out,
                                         u32 off_a, const int* exp_tab, int* loss, u64* again) {
    extern __shared__ av_t s_av_vocab[];
    av_t* s_av = s_av_vocab;
    __shared__ int s_exp[LUT_SIZE];
    const int m = blockIdx.x;
    const u32 seed = seeds[m];
    const int sign = signs[m];
    output_noise(s_av, VOCAB, ov_out, seed + off_a);
    for (int i = threadIdx.x; i < LUT_SIZE; i += blockDim.x) s_exp[i] = exp_tab[i];
#if LPT > LOSS_REGISTER_LPT && LOSS_BINS > 0
    __shared__ int s_bins[LOSS_BINS];
    for (int i = threadIdx.x; i < LOSS_BINS; i += blockDim.x) s_bins[i] = 0;
#endif
    __syncthreads();
    u32 member_loss = 0;
    for (int t = 0; t < SEQ; t++) {
        const long row = (long)m * SEQ + t;
        const int s = sb[row];
        const int* gr = g + row * VOCAB;
        const int target = tokens[m * (SEQ + 1) + t + 1];
        // A logit from its product and output noise; the exp table's term of a logit
        auto logit = [&](int g_j, int av_j) { return wrap_add(g_j, output_term(s, av_j, sign)) >> SHIFT_LOGIT; };
        int peak = INT_MIN_;
        auto term = [&](long long below) {  // of a logit `below` under the peak
            return s_exp[below < 0 ? 0 : (below > LUT_SIZE - 1 ? LUT_SIZE - 1 : below)];
        };
        long long total = 0;
#if LPT <= LOSS_REGISTER_LPT
        int lg[LPT];
#pragma unroll
        for (int i = 0; i < LPT; i++) {
            const int j = threadIdx.x + i * NT;
            if (j < VOCAB) {
                lg[i] = logit(gr[j], s_av[j]);
                peak = max(peak, lg[i]);
            }
        }
        peak = block_max_int(peak);
#pragma unroll
        for (int i = 0; i < LPT; i++) {
            const int j = threadIdx.x + i * NT;
            if (j < VOCAB) total += term((long long)peak - lg[i]);
        }
#else
#if VOCAB % 4 == 0
        // Four logits a load (16 bytes of the row, 8 or 16 of the noise), four loads in
        // flight: a logit a load kept too few bytes in flight (at vocab 32,768 the kernel
        // moved 1.2 of the card's 3.35 TB/s). `backward` reads the row from its end.
        auto each_logit = [&](bool backward, auto&& f) {
            constexpr int QUADS = VOCAB / 4, LOADS = 4;
            for (int q0 = threadIdx.x; q0 < QUADS; q0 += LOADS * NT) {
                int4 w[LOADS];  // the loads first: the counts' atomics would hold them back
#pragma unroll
                for (int k = 0; k < LOADS; k++) {
                    const int q = backward ? QUADS - 1 - (q0 + k * NT) : q0 + k * NT;
                    if (q0 + k * NT < QUADS) w[k] = ((const int4*)gr)[q];
                }
#pragma unroll
                for (int k = 0; k < LOADS; k++) {
                    const int q = backward ? QUADS - 1 - (q0 + k * NT) : q0 + k * NT;
                    if (q0 + k * NT >= QUADS) break;
                    int a[4];
                    av4(s_av + 4 * q, a);
                    f(logit(w[k].x, a[0])), f(logit(w[k].y, a[1])), f(logit(w[k].z, a[2])), f(logit(w[k].w, a[3]));
                }
            }
        };
#else
        auto each_logit = [&](bool, auto&& f) {
            for (int j = threadIdx.x; j < VOCAB; j += NT) f(logit(gr[j], s_av[j]));
        };
#endif
#if LOSS_BINS > 0
        const int input = tokens[m * (SEQ + 1) + t];
        const int ref = max(logit(gr[input], s_av[input]), logit(gr[target], s_av[target]));
        int top = ref;
        each_logit(false, [&](int l) {
            top = max(top, l);
            const u32 bin = (u32)l - (u32)ref + (u32)(EXP_LAST - 1);  // d + EXP_LAST - 1
            if (bin < (u32)LOSS_BINS) atomicAdd(s_bins + bin, 1);
        });
        peak = block_max_int(top);  // its barrier: every count is in
        const long long above = (long long)peak - ref;  // the peak's d; the same in every thread
        for (int i = threadIdx.x; i < LOSS_BINS; i += NT) {
            total += (long long)s_bins[i] * term(above - (i - (EXP_LAST - 1)));
            s_bins[i] = 0;  // for the next row, after block_sum_ll's barriers
        }
        const bool read_again = above > LOSS_BINS - EXP_LAST;
#else
        each_logit(false, [&](int l) { peak = max(peak, l); });
        peak = block_max_int(peak);
        const bool read_again = true;
#endif
        if (read_again) {
            // The second read from the row's end back (LOSS_BACKWARD): its last bytes are
            // the likeliest still in L2 (the rows of the blocks an SM runs, 128 KB each at
            // vocab 32,768, pass the L2's size). Integer sums: any order.
            total = 0;
            each_logit(LOSS_BACKWARD, [&](int l) { total += term((long long)peak - l); });
            if (threadIdx.x == 0) atomicAdd(again, 1ull);
        }
#endif
        total = block_sum_ll(total);
        if (threadIdx.x == 0) {
            const int lt = logit(gr[target], s_av[target]);
            long long log_sum = 0;
            if (total > 0) log_sum = ((long long)(63 - __clzll(total)) << 4) - ((long long)SCALE_BIT << 4);
            const long long per_position = (log_sum >> 1) + peak - lt;
            member_loss += (u32)per_position;
        }
    }
    if (threadIdx.x == 0) loss[m] = (int)member_loss;
}
