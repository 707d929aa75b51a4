// up_gelu_sm90: the MLP's up-projection GEMM fused with mlp_up (forward.cu) on Hopper's
// warpgroup MMAs (wgmma.cuh).
//
// Unfused, cuBLAS writes rows x 4 HIDDEN int32 products and mlp_up reads them back: at
// the default config that traffic bounds both. Here a block owns UP_ROWS rows and sweeps
// the up matrix Wt[4 HIDDEN, HIDDEN] in tiles of TILE_N of its rows; each tile is
// finished in registers (rank-1 term, shift, bias, GELU table, the int8 store and the
// down-projection's input dot) while the next tile's products run, and no product is
// written.
//
// The input dot rounds in float over each group of four columns j, j + HIDDEN,
// j + 2 HIDDEN, j + 3 HIDDEN, in that order (mlp_up's). So a tile gathers the matrix
// rows that give every thread whole groups: the thread's tile column 8 nt + 2 tig + jj
// is matrix column  group + sub * HIDDEN, with
//     group = UP_GROUPS * tile + 4 (nt / 2) + tig,   sub = 2 (nt % 2) + jj.
// Tile t covers groups UP_GROUPS t .. UP_GROUPS (t + 1) - 1, in every sub.
//
// Integer sums are exact in any order; every other operation is mlp_up's, in its order:
// the two agree bit for bit (scripts/kernels.py checks both against the CPU).
// gpu.up_gelu_sm90_shared() sizes the dynamic shared memory from the layout below.

#define UP_GROUPS (TILE_N / 4)  // groups of a tile

__device__ __forceinline__ int up_column(int tile, int col) {
    const int nt = col >> 3, tig = (col >> 1) & 3, jj = col & 1;
    return tile * UP_GROUPS + (nt >> 1) * 4 + tig + ((nt & 1) * 2 + jj) * HIDDEN;
}

// The four lanes of a row (4 g .. 4 g + 3) hold byte q = the value of group 4 q + tig;
// afterwards lane tig holds groups 4 tig .. 4 tig + 3: a 4 x 4 byte transpose, as two
// 2 x 2 ones (swap the off-diagonal halves with lane ^ 2, then pairs with lane ^ 1).
__device__ __forceinline__ u32 transpose_bytes(u32 w, int tig) {
    u32 other = __shfl_xor_sync(0xffffffffu, w, 2);
    w = __byte_perm(w, other, (tig & 2) ? 0x3276 : 0x5410);
    other = __shfl_xor_sync(0xffffffffu, w, 1);
    return __byte_perm(w, other, (tig & 1) ? 0x3715 : 0x6240);
}

// Two warpgroups of 64 rows a block and two blocks an SM: in blocks of four warpgroups,
// one an SM, every warp waited at each tile's barrier for the slowest of sixteen, and
// nothing ran beside a block's tables and first loads (5% slower on an H100).
#define UP_THREADS (2 * UP_ROWS)
#define UP_MEMBERS MEMBERS_OF(UP_ROWS)

extern "C" __global__ void __launch_bounds__(UP_THREADS, 512 / UP_THREADS)
up_gelu_sm90(const i8* y, const i8* up_cores, const int* sb_up, const u32* seeds, const int* signs,
             const i8* bias_up, const i8* ov_up_out, const i8* ov_bias_up, const i8* ov_down_in,
             u32 up_a, u32 bias_a, u32 bias_b, u32 down_b, const int* gelu, i8* hidden,
             int* sb_down, int rows) {
    extern __shared__ __align__(128) unsigned char up_gelu_sm90_shared[];
    constexpr int TILES = HIDDEN / UP_GROUPS;
    constexpr int TABLE = UP_MEMBERS * TILE_N;  // one tile's, per member
    i8* s_a = (i8*)up_gelu_sm90_shared;         // UP_ROWS rows, core matrices
    i8* s_b = s_a + UP_ROWS * HIDDEN;           // [2] tiles of TILE_N rows, core matrices
    // Per tile, member and column: the output noise and the perturbed bias, in pairs
    // read together; the down-projection's input noise and factor (dot_entry).
    int2* s_up = (int2*)(s_b + 2 * TILE_N * HIDDEN);       // [TILES][TABLE]
    dot_t* s_down = (dot_t*)(s_up + TILES * TABLE);        // [TILES][TABLE]
    // The GELU table by the clipped value plus 127, in bytes: one load of an address
    // plus a constant, and at most two words a bank for the warp's lookups.
    i8* s_gelu = (i8*)(s_down + TILES * TABLE);            // [255]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tig = lane & 3;
    const int row0 = blockIdx.x * UP_ROWS;
    const int m0 = row0 / SEQ;
    const int n_members = (min(row0 + UP_ROWS, rows) - 1) / SEQ - m0 + 1;
    const i8* s_rows = s_a + (warp >> 2) * 64 * HIDDEN;  // the warpgroup's 64 rows

    rows_to_cores(s_a, y, row0, UP_ROWS, rows);
    copy_commit();  // waited for before the sweep's first products
    for (int i = threadIdx.x; i < 2 * MAXV + 1; i += blockDim.x) s_gelu[i] = (i8)gelu[(i - MAXV) & 0xFF];
    const ThreadRows<2> mine(sb_up, signs, row0, m0, rows);
    // Every tile's tables at once, before the sweep: built tile by tile, their global
    // loads (seeds, overlays, bias) held every warp between two tiles' products.
    for (int i = threadIdx.x; i < TILES * TABLE; i += blockDim.x) {
        const int tile = i / TABLE, member = i % TABLE / TILE_N;
        if (member >= n_members) continue;
        const int m = m0 + member, j = up_column(tile, i % TILE_N);
        const u32 seed = seeds[m];
        s_up[i] = make_int2(output_noise_of(ov_up_out, seed + up_a, j),
                            bias_up[j] + vector_noise(ov_bias_up, seed, bias_a, bias_b, j, signs[m]));
        s_down[i] = dot_entry(ov_down_in, seed + down_b, j);
    }

    // up_cores: the up matrix's rows in the tiles' order (up_column), in the core-matrix
    // layout
    u32 total[2] = {0u, 0u};  // the thread's rows' input dots, over its groups
    sweep_async(TILES, s_rows, s_b, up_cores, [&](const int (&d)[32], int tile) {
        const int at = tile * TABLE;
        int partial[2][4];  // [s][q]: group 4 q + tig's input dot, over its subs in order
#pragma unroll
        for (int sub = 0; sub < 4; sub++) {
            u32 bytes[2];  // [s], byte q: group 4 q + tig
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int nt = 2 * q + (sub >> 1), jj = sub & 1;
                const int col = nt * 8 + tig * 2 + jj;
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    const int2 t = mine.of(s_up + at, s, col);
                    const int out = wrap_add(d[4 * nt + 2 * s + jj], rank1_term(mine.sbs[s], t.x));
                    const int hv = s_gelu[clip8((out >> SHIFT_MLP_UP) + t.y) + MAXV];
                    bytes[s] = q == 0 ? (u32)(unsigned char)hv : bytes[s] | (u32)(unsigned char)hv << (8 * q);
                    partial[s][q] = down_step(sub == 0 ? 0 : partial[s][q], hv, mine.of(s_down + at, s, col));
                }
            }
#pragma unroll
            for (int s = 0; s < 2; s++) {
                const u32 word = transpose_bytes(bytes[s], tig);
                const long row = row0 + 16 * warp + 8 * s + g;
                if (mine.valid[s])
                    *(u32*)(hidden + row * (4 * HIDDEN) + sub * HIDDEN + tile * UP_GROUPS + 4 * tig) = word;
            }
        }
#pragma unroll
        for (int s = 0; s < 2; s++)
#pragma unroll
            for (int q = 0; q < 4; q++) total[s] += (u32)partial[s][q];
    });
#pragma unroll
    for (int s = 0; s < 2; s++) {
        const u32 t = quad_sum(total[s]);
        if (tig == 0 && mine.valid[s]) sb_down[row0 + 16 * warp + 8 * s + g] = (int)t;
    }
}
