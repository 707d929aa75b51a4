// o_residual_sm90: the attention block's o-projection fused with residual_norm
// (forward.cu) on Hopper's warpgroup MMAs (wgmma.cuh), so no int32 product of it is
// written: unfused, cuBLAS writes rows x HIDDEN of them and residual_norm reads them
// back, 5.4 GB a layer at the default chunk.
//
// The o matrix (HIDDEN x HIDDEN bytes) stays in shared memory for the whole kernel, and
// each warpgroup of a block takes 64 rows at a time (persistent: the blocks loop over
// the rows): their mixed values into shared memory, the member's tables, the products of
// the whole row width (HIDDEN / 64 accumulators of 64 columns). Each product's term of
// the residual, (g + rank-1 term) >> shift, goes to shared memory as 16 bits; then each
// warp runs residual_norm's own row code on its rows (the residual, max-abs
// normalisation, the next norm and its input dots: the same functions, in the same
// order, so the same bits).
//
// Needs SEQ % 64 == 0 (a warpgroup's 64 rows are one member's), HIDDEN % 64 == 0 and
// HIDDEN <= 256 (a row's products in at most 128 registers a thread), and every term
// within 16 bits (gpu.o_residual_sm90_fits: adaptive modes 0 and 1, where the noise is
// bounded, and a large enough shift); gpu.py runs it where those hold.

// 64-column products of a row (one where HIDDEN < 64: compiled, never launched); O_GROUPS
// warpgroups a block
#define OR_CHUNKS (HIDDEN >= 64 ? HIDDEN / 64 : 1)

// The 128 threads of warpgroup `group` wait for each other (named barrier 1 + group).
__device__ __forceinline__ void group_sync(int group) {
    asm volatile("bar.sync %0, 128;\n" ::"r"(group + 1) : "memory");
}

extern "C" __global__ void __launch_bounds__(128 * O_GROUPS, 1)
o_residual_sm90(const i8* mixed, const i8* w_o, const int* sb_in, i8* x, const u32* seeds,
                const int* signs, const i8* ov_out, u32 off_a, int shift, i8* y, const i8* w,
                const i8* b, const i8* ov_w, const i8* ov_b, u32 w_a, u32 w_b, u32 b_a, u32 b_b,
                int ndots, const i8* ov0, const i8* ov1, const i8* ov2, u32 off0, u32 off1,
                u32 off2, int* sb_out, int rows) {
    extern __shared__ __align__(128) unsigned char o_residual_sm90_shared[];
    const int group = threadIdx.x >> 7, tid = threadIdx.x & 127;
    i8* s_w = (i8*)o_residual_sm90_shared;  // the o matrix, HIDDEN rows, core matrices
    // Each warpgroup's: its 64 rows of mixed values (core matrices), their terms (16
    // bits, rows), the member's norm tables (8 HIDDEN words) and the o matrix's output
    // noise (HIDDEN).
    i8* s_rows = s_w + HIDDEN * HIDDEN + group * (64 * HIDDEN + 2 * 64 * HIDDEN + 36 * HIDDEN);
    short* s_term = (short*)(s_rows + 64 * HIDDEN);
    int* s_norm = (int*)(s_term + 64 * HIDDEN);
    int* s_av = s_norm + 8 * HIDDEN;
    const int lane = threadIdx.x & 31, wr = tid >> 5, tig = lane & 3;
    const int r[2] = {16 * wr + (lane >> 2), 16 * wr + (lane >> 2) + 8};  // the thread's rows

    rows_to_cores(s_w, HIDDEN, [&](int row) { return w_o + (long)row * HIDDEN; });
    copy_commit();
    copy_wait<0>();
    fence_async_shared();
    __syncthreads();

    for (int tile = blockIdx.x * O_GROUPS + group; tile * 64 < rows; tile += gridDim.x * O_GROUPS) {
        const long row0 = (long)tile * 64;
        const int m = (int)(row0 / SEQ);
        rows_to_cores(s_rows, mixed, (int)row0, 64, rows, tid, 128);
        copy_commit();
        const u32 seed = seeds[m];
        const int sign = signs[m];
        norm_tables(s_norm, seed, sign, w, b, ov_w, ov_b, w_a, w_b, b_a, b_b, ndots, ov0, ov1, ov2, off0, off1,
                    off2, tid, 128);
        output_noise(s_av, HIDDEN, ov_out, seed + off_a, tid, 128);
        const u32 sbs[2] = {(u32)sb_in[row0 + r[0]] * (u32)sign, (u32)sb_in[row0 + r[1]] * (u32)sign};
        copy_wait<0>();
        fence_async_shared();
        group_sync(group);
        int d[OR_CHUNKS][32];
#pragma unroll
        for (int c = 0; c < OR_CHUNKS; c++) tile_product_async(d[c], s_rows, s_w + c * 64 * HIDDEN);
#pragma unroll
        for (int c = 0; c < OR_CHUNKS; c++) tile_product_wait(d[c]);
        // residual_norm's (g + rank-1 term) >> shift of each product
#pragma unroll
        for (int c = 0; c < OR_CHUNKS; c++)
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    const int col = 64 * c + 8 * j + 2 * tig;
                    const int t0 = wrap_add(d[c][4 * j + 2 * s], rank1_term(sbs[s], s_av[col])) >> shift;
                    const int t1 = wrap_add(d[c][4 * j + 2 * s + 1], rank1_term(sbs[s], s_av[col + 1])) >> shift;
                    *(u32*)(s_term + r[s] * HIDDEN + col) = (u32)(t0 & 0xFFFF) | (u32)t1 << 16;
                }
        group_sync(group);
        // residual_norm's rows, a warp to each
        for (int lr = wr; lr < 64; lr += 4) {
            const long row = row0 + lr;
            int v[FPL];
#pragma unroll
            for (int i = 0; i < FPL; i++) {
                const int f = LANE + 32 * i;
                v[i] = (int)x[row * HIDDEN + f] + s_term[lr * HIDDEN + f];
            }
            int xv[FPL];
            max_abs_normalize_warp(v, x + row * HIDDEN, xv);
            norm_row(xv, y + row * HIDDEN, sb_out, row, rows, ndots, s_norm);
        }
        group_sync(group);  // before the next rows overwrite this warpgroup's buffers
    }
}
