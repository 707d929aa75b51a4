// o_residual_sm90 and down_residual_sm90: the o- and the down-projection's GEMMs on
// Hopper's warpgroup MMAs (wgmma.cuh), each with the whole of residual_norm (forward.cu)
// as its epilogue: no product or term goes to memory.
//
// Unfused, cuBLAS writes rows x HIDDEN int32 products and residual_norm reads them back
// with x. Here each product becomes its term of the residual, (g + rank-1 term) >>
// shift, in the registers that held it; then the row's new x = max_abs_normalize(x +
// term [+ bias]) and the next norm's y and input dots, as residual_norm computes them,
// go out. A row's accumulators lie in the four threads of a quad, so its peak, its
// mean and its dots are quad reductions. The matrix's output columns are permuted
// (gpu/cores.py's residual_order) so that a thread's HIDDEN / 4 features of a row are
// contiguous: x and y move in 16-byte pieces, and the per-member tables are read four
// features a load.
//
// A GEMM pipelined along K: the down-projection's 4 HIDDEN inputs do not fit shared
// memory whole, nor its matrix (256 KB at the default). One block an SM (persistent:
// it takes tiles blockIdx.x, + gridDim.x, ...) of two warpgroups, each on 64 rows of a
// 128-row tile and all HIDDEN columns at once (HIDDEN / 64 accumulators, 128 registers
// a thread at 256). A tile's K is taken in slices of SLICE bytes through SLICE_STAGES
// buffers: the rows' slice (16-byte pieces copied by every thread with cp.async, in
// wgmma's 128-byte swizzle) and the matrix's (one bulk copy from gpu/cores.py's
// sliced_core_pieces copy, in the core-matrix layout, completing on the stage's
// mbarrier). Slices are copied SLICE_AHEAD ahead of the products, across tiles, so the
// next tile's first slices load during this tile's epilogue; a stage is refilled once
// both warpgroups have waited for the products that read it (the block barrier of the
// next slice). A tile's per-member tables (output noise, bias, norm weight and bias,
// the next input dots' entries) are made while its first slice's products run.
//
// Integer sums are exact in any order, and the float steps are residual_norm's, value
// by value: x, y and the dots are residual_norm's bit for bit (scripts/kernels.py
// checks them against the CPU). gpu/plan.py's residual_sm90_shared() sizes the dynamic
// shared memory.

#include "common.cuh"
#include "tiles.cuh"
#include "wgmma.cuh"

// What residual_norm takes besides the GEMM: the residual's bias and the next norm.
struct ResidualArgs {
    const i8 *bias, *ov_bias;
    u32 bias_a, bias_b;
    i8 *x, *y;
    const i8 *w, *b, *ov_w, *ov_b;
    u32 w_a, w_b, b_a, b_b;
    const i8 *ov0, *ov1, *ov2;
    u32 off0, off1, off2;
    int* sb_out;
};

// Whole slices, a row's products in registers, one-word dot entries (modes 0 and 1):
// elsewhere the plan never launches the kernels, and their bodies are not compiled.
#define RESIDUAL_FIT (HIDDEN % SLICE == 0 && HIDDEN <= 256 && ADAPTIVE_MODE != 2)
#if RESIDUAL_FIT

// SLICE, SLICE_STAGES, RESIDUAL_ROWS (gpu/plan.py: 128, rows a tile, two warpgroups of 64)
#define SLICE_AHEAD (SLICE_STAGES - 2)  // slices copied ahead of the one multiplied
#define SLICE_SBO (SLICE / 16 * 128)    // bytes between the matrix slice's 8-row groups
#define RESIDUAL_MEMBERS MEMBERS_OF(RESIDUAL_ROWS)
#define FPT (HIDDEN / 4)                // features of a row a thread holds: FPT tig ..
// A member's tables: output noise, bias, norm weight, norm bias, then the dots' entries,
// each HIDDEN words with 4 words of padding after every FPT (the quad's four 16-byte
// loads of one table hit distinct banks).
#define TABLE_LD (HIDDEN + 16)
#define TABLES 7
#define VECTORS 10  // bytes a feature copied once: the parameters and overlays the tables read

// The descriptor of 128-byte-swizzled K-major rows (128 bytes of K a row, 8-row atoms of
// 1024 bytes, 1024-byte aligned): layout type 1 in bits 62-63, the atoms 1024 bytes
// apart; a K step of 32 bytes adds 2 to the start address (in 16-byte units), and the
// hardware swizzles the address it makes.
__device__ __forceinline__ u64 rows_descriptor(const i8* at) {
    return (u64)((shared_address(at) & 0x3FFFF) >> 4) | (1ull << 16) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_wait_one() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }

// Byte k of a word, sign-extended.
__device__ __forceinline__ int byte_of(u32 word, int k) { return (int)(word << (24 - 8 * k)) >> 24; }

// The epilogue of one row (row < rows where `valid`): a thread's FPT features FPT tig +
// i, i = 16 c + 2 j + e, whose products are acc(c, 4 j + e) (d[c][4 j + 2 s + e]);
// `tab` the member's tables at this thread's features, xq its bytes of x. Every lane
// runs it (quad shuffles); only valid rows are stored.
template <int NDOTS, bool UNIT, typename Acc>
__device__ __forceinline__ void residual_row(Acc acc, const uint4 (&xq)[FPT / 16], u32 sbs, int shift,
                                             const int* tab, const u32* s_magic, const ResidualArgs& r,
                                             long row, int rows, int tig, bool valid) {
    const u32* xw = (const u32*)xq;
    int v[FPT];
#pragma unroll
    for (int q = 0; q < FPT / 4; q++) {
        const int4 av = *(const int4*)(tab + 4 * q), bias = *(const int4*)(tab + TABLE_LD + 4 * q);
        const int a4[4] = {av.x, av.y, av.z, av.w}, b4[4] = {bias.x, bias.y, bias.z, bias.w};
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = 4 * q + u, c = i / 16, j = i % 16 / 2, e = i % 2;
            const int term = wrap_add(acc(c, 4 * j + e), rank1_term(sbs, a4[u])) >> shift;
            v[i] = byte_of(xw[q], u) + term + b4[u];
        }
    }
    u32 peak = 0;
#pragma unroll
    for (int i = 0; i < FPT; i++) peak = max(peak, abs_u32(v[i]));
    const float scale = peak_scale(quad_max(peak));
    u32 words[FPT / 4], total = 0;
#pragma unroll
    for (int q = 0; q < FPT / 4; q++) {
        words[q] = 0;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            v[4 * q + u] = scaled_int(v[4 * q + u], scale);  // the new x
            words[q] |= (u32)(v[4 * q + u] & 0xFF) << (8 * u);
            total += (u32)abs(v[4 * q + u]);
        }
    }
    const long at = row * HIDDEN + FPT * tig;
    if (valid)
#pragma unroll
        for (int p = 0; p < FPT / 16; p++) *(uint4*)(r.x + at + 16 * p) = ((const uint4*)words)[p];
    // standard_norm of the new x (norm_row_dots's steps)
    const int mean = (int)(quad_sum(total) / HIDDEN);
    const Divisor by_mean(mean == 0 ? 1 : mean, s_magic[mean]);
    u32 dots[3] = {0u, 0u, 0u};
#pragma unroll
    for (int q = 0; q < FPT / 4; q++) {
        const int4 w = *(const int4*)(tab + 2 * TABLE_LD + 4 * q), b = *(const int4*)(tab + 3 * TABLE_LD + 4 * q);
        const int w4[4] = {w.x, w.y, w.z, w.w}, b4[4] = {b.x, b.y, b.z, b.w};
        int4 dr[3];
#pragma unroll
        for (int p = 0; p < NDOTS; p++) dr[p] = *(const int4*)(tab + (4 + p) * TABLE_LD + 4 * q);
        words[q] = 0;
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int y = clip8(by_mean(v[4 * q + u] * w4[u]) + b4[u]);
            words[q] |= (u32)(y & 0xFF) << (8 * u);
#pragma unroll
            for (int p = 0; p < NDOTS; p++) {
                const int e4[4] = {dr[p].x, dr[p].y, dr[p].z, dr[p].w};
                dots[p] = dot_add<UNIT>(dots[p], y, e4[u]);
            }
        }
    }
    if (valid)
#pragma unroll
        for (int p = 0; p < FPT / 16; p++) *(uint4*)(r.y + at + 16 * p) = ((const uint4*)words)[p];
#pragma unroll
    for (int p = 0; p < NDOTS; p++) {
        const u32 sum = quad_sum(dots[p]);
        if (valid && tig == 0) r.sb_out[(long)p * rows + row] = dot_value<UNIT>(sum);
    }
}

template <int K, int NDOTS, bool UNIT>
__device__ __forceinline__ void projection_residual(const i8* a, const i8* w_cores, const int* sb, const u32* seeds,
                                                    const int* signs, const i8* ov_out, u32 off_a, int shift,
                                                    const ResidualArgs& r, int rows) {
    constexpr int KS = K / SLICE;             // slices of a tile
    constexpr int PIECES = SLICE / 16;        // 16-byte pieces of a row's slice
    constexpr int A_BYTES = RESIDUAL_ROWS * SLICE;
    constexpr int B_BYTES = HIDDEN * SLICE;
    constexpr int CHUNKS = HIDDEN / TILE_N;   // accumulators of 64 columns
    static_assert(FPT == 16 * CHUNKS, "a thread's features of a row: 16 of each accumulator");
    // 1024-byte aligned for the rows' swizzled layout (the static shared memory is
    // padded to it; aligned by hand, the pointer cost ptxas 60 registers and spills)
    extern __shared__ __align__(1024) unsigned char residual_sm90_shared[];
    i8* s_a = (i8*)residual_sm90_shared;                  // [SLICE_STAGES][A_BYTES]
    if (shared_address(s_a) & 1023) __trap();  // never: the swizzle would mix rows
    i8* s_b = s_a + SLICE_STAGES * A_BYTES;               // [SLICE_STAGES][B_BYTES]
    int* s_tab = (int*)(s_b + SLICE_STAGES * B_BYTES);    // [RESIDUAL_MEMBERS][TABLES][TABLE_LD]
    // What a tile's tables are made of, copied with its first slice (so no global load
    // waits in the tile loop; TILE_INPUTS buffers, as a tile's are copied up to
    // SLICE_AHEAD tiles ahead): its members' seeds and signs, its rows' input dots
    constexpr int TILE_INPUTS = SLICE_AHEAD + 1;
    u32* s_seed = (u32*)(s_tab + RESIDUAL_MEMBERS * TABLES * TABLE_LD);  // [TILE_INPUTS][RESIDUAL_MEMBERS]
    int* s_sign = (int*)(s_seed + TILE_INPUTS * RESIDUAL_MEMBERS);        // [TILE_INPUTS][RESIDUAL_MEMBERS]
    int* s_sb = s_sign + TILE_INPUTS * RESIDUAL_MEMBERS;                  // [TILE_INPUTS][RESIDUAL_ROWS]
    // [VECTORS][HIDDEN]: the output noise's overlay, the bias, the norm's weight and
    // bias, their overlays, the dots' overlays (copied once: a tile's tables read no
    // global memory)
    i8* s_vec = (i8*)(s_sb + TILE_INPUTS * RESIDUAL_ROWS);
    __shared__ u32 s_magic[MEAN_MAX + 1];
    __shared__ __align__(8) u64 full[SLICE_STAGES];  // stage s holds its matrix slice
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warpgroup_index();
    const int g = lane >> 2, tig = lane & 3;
    const int tiles = (rows + RESIDUAL_ROWS - 1) / RESIDUAL_ROWS;
    const int total = tiles > (int)blockIdx.x ? ((tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1) * KS : 0;
    auto first_row = [&](int i) { return ((int)blockIdx.x + i / KS * (int)gridDim.x) * RESIDUAL_ROWS; };

    // Slice i into stage i % SLICE_STAGES; every thread commits one cp.async group a
    // slice, with or without pieces, so that the groups count slices. A row's slice (128
    // bytes) is contiguous in shared memory, its 16-byte piece c at (c ^ (row % 8)) 16
    // (wgmma's 128-byte swizzle, ROWS_DESCRIPTOR), so that eight lanes copy a row's 128
    // contiguous bytes and write eight banks' worth apart: in the core-matrix layout a
    // warp's pieces of eight rows cost each quarter-warp its own sectors (ncu: twice
    // the ideal L2 sectors). A thread's pieces are piece threadIdx.x % 8 of rows
    // ROW_STEP apart.
    static_assert(SLICE == 128, "the rows' slices are 128-byte swizzled");
    constexpr int THREADS = 2 * RESIDUAL_ROWS, ROW_STEP = THREADS / PIECES;
    const int my_row = threadIdx.x / PIECES, my_chunk = threadIdx.x % PIECES;
    const i8* my_piece = a + (long)my_row * K + 16 * my_chunk;
    // (ROW_STEP is a multiple of 8: a row's place within its 8 is the same for every u)
    const int my_place = my_row * SLICE + 16 * (my_chunk ^ (my_row & 7));
    auto load = [&](int i) {
        const int stage = i % SLICE_STAGES, k = i % KS, row0 = first_row(i);
        if (threadIdx.x == 0) bulk_copy(s_b + stage * B_BYTES, w_cores + k * B_BYTES, B_BYTES, &full[stage]);
        if (k == 0) {  // the tile's inputs
            const int at = i / KS % TILE_INPUTS, m0 = row0 / SEQ;
            const int n_members = (min(row0 + RESIDUAL_ROWS, rows) - 1) / SEQ - m0 + 1;
            for (int r = threadIdx.x; r < min(RESIDUAL_ROWS, rows - row0); r += blockDim.x)
                copy4_async(s_sb + at * RESIDUAL_ROWS + r, sb + row0 + r);
            for (int m = threadIdx.x; m < n_members; m += blockDim.x) {
                copy4_async(s_seed + at * RESIDUAL_MEMBERS + m, seeds + m0 + m);
                copy4_async(s_sign + at * RESIDUAL_MEMBERS + m, signs + m0 + m);
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
    {
        const i8* vectors[VECTORS] = {ov_out, r.bias, r.w, r.b, r.ov_bias, r.ov_w, r.ov_b, r.ov0, r.ov1, r.ov2};
        for (int f = threadIdx.x; f < HIDDEN; f += blockDim.x) {
            s_vec[f] = (i8)overlay_byte(ov_out, f);
            s_vec[HIDDEN + f] = r.bias ? r.bias[f] : 0;
            s_vec[2 * HIDDEN + f] = r.w[f];
            s_vec[3 * HIDDEN + f] = r.b[f];
#pragma unroll
            for (int v = 4; v < VECTORS; v++)  // overlays (unread in mode 0; a dot's past NDOTS)
                s_vec[v * HIDDEN + f] = (v < 7 + NDOTS && (v != 4 || r.bias)) ? (i8)overlay_byte(vectors[v], f) : 0;
        }
    }
    for (int m = threadIdx.x; m <= MEAN_MAX; m += blockDim.x) s_magic[m] = divisor_magic(m);
    __syncthreads();
    for (int i = 0; i < SLICE_AHEAD; i++) {
        if (i < total) load(i);
        copy_commit();
    }
    // a tile's member tables, entry by entry (the output noise and the dots' entries as
    // residual_norm's and norm_tables'), at TABLE_LD-padded places
    auto make_tables = [&](const u32* seed_of, const int* sign_of, int n_members) {
        const u32 offs[3] = {r.off0, r.off1, r.off2};
        for (int e = threadIdx.x; e < n_members * HIDDEN; e += blockDim.x) {
            const int m = e / HIDDEN, f = e % HIDDEN;
            const u32 seed = seed_of[m];
            const int sign = sign_of[m];
            int* t = s_tab + m * TABLES * TABLE_LD + f + 4 * (f / FPT);
            t[0] = output_noise_of(s_vec, seed + off_a, f);
            t[TABLE_LD] = r.bias ? s_vec[HIDDEN + f] + vector_noise(s_vec + 4 * HIDDEN, seed, r.bias_a, r.bias_b, f, sign) : 0;
            t[2 * TABLE_LD] = (s_vec[2 * HIDDEN + f] + vector_noise(s_vec + 5 * HIDDEN, seed, r.w_a, r.w_b, f, sign)) * NORM_SCALE;
            t[3 * TABLE_LD] = s_vec[3 * HIDDEN + f] + vector_noise(s_vec + 6 * HIDDEN, seed, r.b_a, r.b_b, f, sign);
#pragma unroll
            for (int p = 0; p < NDOTS; p++) t[(4 + p) * TABLE_LD] = dot_entry(s_vec + (7 + p) * HIDDEN, seed + offs[p], f);
        }
    };

    int d[CHUNKS][32];
    int i = 0;  // slices taken so far; the tile loop's inner loop is unrolled, so ptxas
                // sees which products are in flight at every wait (no C7517 wait)
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int row0 = tile * RESIDUAL_ROWS;
        u32 sbs[2];  // the thread's rows' input dots times their members' signs
        int member[2];
#pragma unroll
        for (int k = 0; k < KS; k++, i++) {
            const int stage = i % SLICE_STAGES;
            copy_wait<SLICE_AHEAD - 1>();  // this thread's pieces of slice i
            fence_async_shared();
            __syncthreads();  // every piece of slice i; every product of slice i - 2 waited for
            if (i + SLICE_AHEAD < total) load(i + SLICE_AHEAD);  // into slice i - 2's stage
            copy_commit();
            barrier_wait(&full[stage], (i / SLICE_STAGES) & 1);
            // The slice's two descriptors, each product's an offset from them
            const u64 rows_slice = rows_descriptor(s_a + stage * A_BYTES + wg * 64 * SLICE);  // the warpgroup's 64 rows
            const u64 w_slice = core_descriptor(s_b + stage * B_BYTES, SLICE_SBO);
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < SLICE / 32; kk++)  // all HIDDEN columns in one MMA
                wgmma_64xNx32(reinterpret_cast<int(&)[CHUNKS * 32]>(d), descriptor_plus(rows_slice, 32 * kk),
                              descriptor_plus(w_slice, 2 * CORE_LBO * kk), k > 0 || kk > 0);
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            if (k == 0) {  // the tile's rows' input dots and its members' tables
                const int at = i / KS % TILE_INPUTS, m0 = row0 / SEQ;
                const int n_members = (min(row0 + RESIDUAL_ROWS, rows) - 1) / SEQ - m0 + 1;
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    const int rr = 16 * warp + 8 * s + g;
                    // (a warp's 16 rows are one member's where SEQ is a multiple of 16)
                    member[s] = row0 + rr < rows ? (row0 + (SEQ % 16 == 0 ? rr - 8 * s : rr)) / SEQ - m0 : 0;
                    sbs[s] = row0 + rr < rows ? (u32)s_sb[at * RESIDUAL_ROWS + rr] * (u32)s_sign[at * RESIDUAL_MEMBERS + member[s]] : 0u;
                }
                // x's rows into L2 for the epilogue: a 128-byte line a thread
                const long bytes = (long)(min(row0 + RESIDUAL_ROWS, rows) - row0) * HIDDEN;
                if (128l * threadIdx.x < bytes)
                    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(r.x + (long)row0 * HIDDEN + 128l * threadIdx.x));
                make_tables(s_seed + at * RESIDUAL_MEMBERS, s_sign + at * RESIDUAL_MEMBERS, n_members);
            } else {
                wgmma_wait_one();  // slice i - 1's products
            }
        }
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) tile_product_wait(d[c]);
        if (KS == 1) __syncthreads();  // the tables, made in this slice (else a barrier ago)
        // d[c][4 j + 2 s + e]: row 16 warp + 8 s + g, column TILE_N c + 8 j + 2 tig + e,
        // which is feature FPT tig + 16 c + 2 j + e (residual_order)
        uint4 xq[2][FPT / 16];
#pragma unroll
        for (int s = 0; s < 2; s++) {
            const long row = row0 + 16 * warp + 8 * s + g;
#pragma unroll
            for (int p = 0; p < FPT / 16; p++)
                xq[s][p] = row < rows ? *(const uint4*)(r.x + row * HIDDEN + FPT * tig + 16 * p) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int s = 0; s < 2; s++) {
            const long row = row0 + 16 * warp + 8 * s + g;
            const int* tab = s_tab + member[s] * TABLES * TABLE_LD + (FPT + 4) * tig;
            residual_row<NDOTS, UNIT>([&](int c, int n) { return d[c][n + 2 * s]; }, xq[s], sbs[s], shift, tab,
                                      s_magic, r, row, rows, tig, row < rows);
        }
    }
    __syncthreads();  // no thread waits on the barriers any more
    if (threadIdx.x == 0)
        for (int s = 0; s < SLICE_STAGES; s++) barrier_inval(&full[s]);
}

#endif  // RESIDUAL_FIT

// The next norm's dot count as a constant of the code: 1 (the MLP's up-projection, the
// final norm's embedding) or 3 (q, k and v)
template <int K>
__device__ __forceinline__ void residual_kernel(const i8* inputs, const i8* w_cores, const int* sb, const u32* seeds,
                                                const int* signs, const i8* ov_out, u32 off_a, int shift,
                                                const ResidualArgs& r, int ndots, int rows) {
#if RESIDUAL_FIT
    // the next norm's dots by unit factors where they all are (common.cuh)
    const bool unit = UNIT_FITS(HIDDEN) && __syncthreads_and(unit_share(r.ov0, HIDDEN) &&
                                                             (ndots == 1 || (unit_share(r.ov1, HIDDEN) &&
                                                                             unit_share(r.ov2, HIDDEN))));
    if (ndots == 1 && unit)
        projection_residual<K, 1, true>(inputs, w_cores, sb, seeds, signs, ov_out, off_a, shift, r, rows);
    else if (ndots == 1)
        projection_residual<K, 1, false>(inputs, w_cores, sb, seeds, signs, ov_out, off_a, shift, r, rows);
    else if (ndots == 3 && unit)
        projection_residual<K, 3, true>(inputs, w_cores, sb, seeds, signs, ov_out, off_a, shift, r, rows);
    else if (ndots == 3)
        projection_residual<K, 3, false>(inputs, w_cores, sb, seeds, signs, ov_out, off_a, shift, r, rows);
    else
        __trap();
#else
    __trap();
#endif
}

// Two entry points, so that a profile tells the two projections apart; each spells out
// its parameters (the launchers read them from this text, deggs/numerics/launch.py).
// The o-projection's (K = HIDDEN): the inputs are attention's mixed rows
extern "C" __global__ void __launch_bounds__(2 * RESIDUAL_ROWS, 1)
o_residual_sm90(const i8* inputs, const i8* w_cores, const int* sb, const u32* seeds, const int* signs,
                const i8* ov_out, u32 off_a, int shift, const i8* bias, const i8* ov_bias, u32 bias_a,
                u32 bias_b, i8* x, i8* y, const i8* w, const i8* b, const i8* ov_w, const i8* ov_b, u32 w_a,
                u32 w_b, u32 b_a, u32 b_b, int ndots, const i8* ov0, const i8* ov1, const i8* ov2, u32 off0,
                u32 off1, u32 off2, int* sb_out, int rows) {
    const ResidualArgs r{bias, ov_bias, bias_a, bias_b, x, y, w, b, ov_w, ov_b, w_a,
                         w_b, b_a, b_b, ov0, ov1, ov2, off0, off1, off2, sb_out};
    residual_kernel<HIDDEN>(inputs, w_cores, sb, seeds, signs, ov_out, off_a, shift, r, ndots, rows);
}

// The down-projection's (K = 4 HIDDEN): the inputs are the GELU'd hidden rows
extern "C" __global__ void __launch_bounds__(2 * RESIDUAL_ROWS, 1)
down_residual_sm90(const i8* inputs, const i8* w_cores, const int* sb, const u32* seeds, const int* signs,
                   const i8* ov_out, u32 off_a, int shift, const i8* bias, const i8* ov_bias, u32 bias_a,
                   u32 bias_b, i8* x, i8* y, const i8* w, const i8* b, const i8* ov_w, const i8* ov_b, u32 w_a,
                   u32 w_b, u32 b_a, u32 b_b, int ndots, const i8* ov0, const i8* ov1, const i8* ov2, u32 off0,
                   u32 off1, u32 off2, int* sb_out, int rows) {
    const ResidualArgs r{bias, ov_bias, bias_a, bias_b, x, y, w, b, ov_w, ov_b, w_a,
                         w_b, b_a, b_b, ov0, ov1, ov2, off0, off1, off2, sb_out};
    residual_kernel<UP>(inputs, w_cores, sb, seeds, signs, ov_out, off_a, shift, r, ndots, rows);
}
