// Tiles of rows times matrix rows on the int8 tensor cores, for a kernel that fuses a
// GEMM with its epilogue (head_loss.cu). A block owns TILE_M rows of
// activations (32 a warp, held in shared memory for the whole kernel) and sweeps a
// weight matrix Wt[out, HIDDEN] in tiles of TILE_N rows, loaded with double-buffered
// cp.async; each warp's 32 x TILE_N products stay in registers for the epilogue.
//
// Needs HIDDEN % 32 == 0 and defines TILE_WARPS and TILE_N (64).

#pragma once
#include "common.cuh"

#define TILE_M (32 * TILE_WARPS)            // rows of a block
#define TILE_LD (HIDDEN + 16)               // bytes per row in shared memory: the padding
                                            // makes the fragment loads conflict-free
#define TILE_PIECES (HIDDEN / 16)           // 16-byte pieces of a row
// Members a block of M rows can hold rows of (its rows start at a multiple of M).
#define MEMBERS_OF(M) ((M) % SEQ == 0 ? (M) / SEQ : (M) / SEQ + 2)
#define TILE_MEMBERS MEMBERS_OF(TILE_M)
// Antithetic pairs a block of M rows can hold rows of (a pair's two members share their
// seed, so a table of output noise needs a row a pair): where M is whole members a block
// starts mid-pair only if M / SEQ is odd.
#define PAIRS_OF(M) ((M) % SEQ == 0 ? ((M) / SEQ + 1) / 2 : MEMBERS_OF(M) / 2 + 1)
// __launch_bounds__(TILE_M, 16 / TILE_WARPS): 16 warps an SM, at most 128 registers each

// The shared-space address of a pointer into shared memory, as PTX's shared operands take it.
__device__ __forceinline__ u32 shared_address(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void copy16_async(void* shared, const void* global) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(shared)), "l"(global));
}

__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// 4 bytes (cp.async's L1-cached form, the only one for fewer than 16)
__device__ __forceinline__ void copy4_async(void* shared, const void* global) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(shared_address(shared)), "l"(global));
}

template <int N>
__device__ __forceinline__ void copy_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Rows [first, first + n) of a K-contiguous int8 matrix into shared rows of TILE_LD
// bytes, asynchronously; rows at or past `valid` are zeros.
__device__ __forceinline__ void rows_to_shared(i8* to, const i8* from, int first, int n, int valid) {
    for (int i = threadIdx.x; i < n * TILE_PIECES; i += blockDim.x) {
        const int r = i / TILE_PIECES, c = (i % TILE_PIECES) * 16;
        i8* dst = to + r * TILE_LD + c;
        if (first + r < valid)
            copy16_async(dst, from + (long)(first + r) * HIDDEN + c);
        else
            *(int4*)dst = make_int4(0, 0, 0, 0);
    }
}

// Four 8x8 matrices of 16-bit elements (here: 8 rows x 16 bytes of int8) from shared
// memory in one instruction; lanes 8 i .. 8 i + 7 give the row addresses of matrix i,
// and lane l receives bytes 4 (l % 4) .. + 3 of row l / 4 of each matrix.
__device__ __forceinline__ void load_matrices(u32 (&r)[4], const i8* rows) {
    const u32 at = shared_address(rows);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}

// c = the warp's 32 rows of s_a times the TILE_N rows of s_b (both TILE_LD apart), K =
// HIDDEN. Accumulator c[s >> 1][nt][2 (s & 1) + j] is the thread's row 8 s + g (of the
// warp's) and tile column 8 nt + 2 tig + j, with g = lane / 4, tig = lane % 4.
// The fragments come from ldmatrix: an A fragment (16 rows x 32 bytes) is the four
// matrices rows 0-7 / 8-15 x bytes 0-15 / 16-31; a B pair (two 8-column groups) is
// columns 0-7 x bytes 0-15, 16-31, then columns 8-15 likewise. The padded row stride
// keeps each matrix's eight rows in distinct banks.
__device__ __forceinline__ void warp_tile_product(int (&c)[2][TILE_N / 8][4], const i8* s_a,
                                                  const i8* s_b) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int nt = 0; nt < TILE_N / 8; nt++)
#pragma unroll
            for (int i = 0; i < 4; i++) c[mt][nt][i] = 0;
    const i8* a_rows = s_a + ((threadIdx.x >> 5) * 32 + (lane & 15)) * TILE_LD + (lane >> 4) * 16;
    const i8* b_rows = s_b + ((lane & 7) + (lane >> 4) * 8) * TILE_LD + ((lane >> 3) & 1) * 16;
#pragma unroll 2
    for (int k = 0; k < HIDDEN; k += 32) {
        u32 a[2][4];
        load_matrices(a[0], a_rows + k);
        load_matrices(a[1], a_rows + 16 * TILE_LD + k);
#pragma unroll
        for (int nt = 0; nt < TILE_N / 8; nt += 2) {
            u32 b[4];
            load_matrices(b, b_rows + nt * 8 * TILE_LD + k);
            const u32 lo[2] = {b[0], b[1]}, hi[2] = {b[2], b[3]};
            mma_s8(c[0][nt], a[0], lo);
            mma_s8(c[1][nt], a[1], lo);
            mma_s8(c[0][nt + 1], a[0], hi);
            mma_s8(c[1][nt + 1], a[1], hi);
        }
    }
}

// The thread's N rows (row0 + warp * 8 N + 8 s + g, s < N: four in head_loss's mma.sync
// tiles, two in a warpgroup MMA's): their input dot times their member's sign (u32:
// wraps as the CPU's int32), their member counted from the block's first (m0), and
// whether they exist.
template <int N>
struct ThreadRows {
    u32 sbs[N];
    int member[N];
    int pair[N];  // counted from the pair of the block's first member
    bool valid[N];
    __device__ __forceinline__ ThreadRows(const int* sb, const int* signs, int row0, int m0, int rows) {
#pragma unroll
        for (int s = 0; s < N; s++) {
            const int row = row0 + (threadIdx.x >> 5) * 8 * N + 8 * s + ((threadIdx.x & 31) >> 2);
            valid[s] = row < rows;
            const int m = valid[s] ? row / SEQ : m0;
            member[s] = m - m0;
            pair[s] = m / 2 - m0 / 2;
            sbs[s] = valid[s] ? (u32)sb[row] * (u32)signs[m] : 0u;
        }
    }
    // A per-member table entry of row s, the members `stride` apart (a warp's 8 N rows
    // share one where SEQ is a multiple of them).
    template <typename T>
    __device__ __forceinline__ T of(const T* table, int s, int col, int stride = TILE_N) const {
        return table[(SEQ % (8 * N) == 0 ? member[0] : member[s]) * stride + col];
    }
    // The same from a per-pair table (tile_noise's by_pair).
    template <typename T>
    __device__ __forceinline__ T of_pair(const T* table, int s, int col, int stride) const {
        return table[(SEQ % (8 * N) == 0 ? pair[0] : pair[s]) * stride + col];
    }
};

#define VOCAB_PAD (VOCAB % TILE_N != 0)  // the last tile has columns past the vocabulary
// A thread's per-tile partial sum of one row (2 TILE_N / 8 entries) fits 32 bits.
#define TOTAL32 (EXP_MAX * (TILE_N / 4) < 4294967296)  // preprocessor: 64-bit

// sequence_loss's loss of one position, added to its member's (an unsigned atomic: the
// member's sum wraps like the CPU's int32 sum, in any order): total is the row's sum of
// exp-table entries, peak its largest shifted logit, dot the target's product before
// its rank-1 term, seed the member's seed plus the head's offset.
__device__ __forceinline__ void add_position_loss(u32* member_loss, unsigned long long total, int peak,
                                                  int dot, u32 sbs, u32 seed, const i8* ov_out,
                                                  int target) {
    const int a_v = output_noise_of(ov_out, seed, target);
    const int lt = wrap_add(dot, rank1_term(sbs, a_v)) >> SHIFT_LOGIT;
    long long log_sum = 0;
    if (total > 0) log_sum = ((long long)(63 - __clzll(total)) << 4) - ((long long)SCALE_BIT << 4);
    atomicAdd(member_loss, (u32)((log_sum >> 1) + peak - lt));
}

// A word of shared memory at a shared-space address. Written out, a lookup's address is
// one IMAD (the index times 4 EXP_COPIES plus the lane's copy); indexing an array, the
// compiler made it a shift, a merge of the lane's bits and an LEA.
__device__ __forceinline__ int shared_word(u32 at) {
    int v;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(at));
    return v;
}

// The per-member output noise of `width` columns (a tile's by default), av[member][col]
// = (int)(a_j * factor_j) for the matrix columns j = j0 + col (0 past `limit`), members
// m0.. of the block; by_pair: av[pair][col], a row for each of n pairs from the pair of
// member m0 (ThreadRows::of_pair), made from the seed of the pair's first member in the
// block. tables_noise makes P matrices' at once (offsets off_a[p], overlays ov_out[p];
// matrix p's entries at av + p * stride). A thread loads the seeds and overlay bytes of
// BATCH entries, of any of the matrices, before it computes them: made entry by entry,
// or a matrix at a time, each one's loads were waited for in turn (qkv_rope_sm90's
// three tables: 12% of its stall samples).
template <int P, typename T>
__device__ __forceinline__ void tables_noise(T* av, int stride, int n, int m0, const u32* seeds,
                                             const u32 (&off_a)[P], const i8* const (&ov_out)[P], int j0,
                                             int limit, int width, bool by_pair) {
    constexpr int BATCH = P == 1 ? 4 : 8;
    const int entries = n * width;  // a matrix's
    // matrix p's value of a (p from the entry: selects, not a local array)
    auto pick = [](const auto& a, int p) {
        auto v = a[0];
#pragma unroll
        for (int q = 1; q < P; q++)
            if (p == q) v = a[q];
        return v;
    };
    for (int first = threadIdx.x; first < P * entries; first += BATCH * blockDim.x) {
        u32 seed[BATCH];
        int o[BATCH];
#pragma unroll
        for (int b = 0; b < BATCH; b++) {
            const int i = first + b * blockDim.x, p = P == 1 ? 0 : i / entries, e = P == 1 ? i : i % entries;
            const int j = j0 + e % width, r = e / width;
            const bool used = i < P * entries && j < limit;
            const int m = by_pair ? max(m0, (m0 & ~1) + 2 * r) : m0 + r;
            seed[b] = used ? seeds[m] + pick(off_a, p) : 0u;
            o[b] = used ? overlay_byte(pick(ov_out, p), j) : 0;
        }
#pragma unroll
        for (int b = 0; b < BATCH; b++) {
            const int i = first + b * blockDim.x, p = P == 1 ? 0 : i / entries, e = P == 1 ? i : i % entries;
            const int j = j0 + e % width;
            if (i < P * entries) av[p * stride + e] = j < limit ? (T)dot_term(1, dot_entry_of(o[b], seed[b], j)) : 0;
        }
    }
}

template <typename T>
__device__ __forceinline__ void tile_noise(T* av, int n, int m0, const u32* seeds, u32 off_a, const i8* ov_out,
                                           int j0, int limit, int width = TILE_N, bool by_pair = false) {
    tables_noise<1>(av, 0, n, m0, seeds, {off_a}, {ov_out}, j0, limit, width, by_pair);
}

// One sweep over n tiles: load(t, buf) starts tile t's copy into buffer buf (and
// commits it); body(c, t, buf) gets the warp's product with tile t while tile t + 1
// loads into the other buffer.
template <typename Load, typename Body>
__device__ __forceinline__ void sweep(int n, const i8* s_a, const i8* s_b, Load load, Body body) {
    load(0, 0);
    for (int tile = 0; tile < n; tile++) {
        const int buf = tile & 1;
        if (tile + 1 < n) {
            load(tile + 1, buf ^ 1);
            copy_wait<1>();
        } else {
            copy_wait<0>();
        }
        __syncthreads();
        int c[2][TILE_N / 8][4];
        warp_tile_product(c, s_a, s_b + buf * TILE_N * TILE_LD);
        body(c, tile, buf);
        __syncthreads();  // before the next load overwrites this buffer
    }
}
