// The update (deggs/numerics/optimizer.py): every pair's noise as int8 matrices for the
// vote GEMMs, vector votes and the overlays (the optimizers' steps: optimizer.cu); and
// the sm90a kernels' copies of the weights, made again after each update.

#include "common.cuh"

// The noise seed of antithetic pair p at a step (deggs.seeds.pair_seed).
__device__ __forceinline__ u32 pair_seed(u32 step_seed, int p) { return step_seed + (u32)p; }

// Four consecutive pairs' noise entries as one word of four int8 lanes, each times its
// pair's fitness (fit: four int8 lanes of -1, 0 or 1), from the entries' hash_mix values
// x0..x3: what four noise() calls and a pack give. Uniform noise (|entry| <= NOISE_MASK
// <= 31) is made four lanes at a time: hash_u32's last step, x ^= x >> 16, only matters
// to the low byte here (byte 0 ^ byte 2), and the sign and fitness are applied to the
// four lanes in one word, about half the instructions a byte.
__device__ __forceinline__ u32 noise_word(u32 x0, u32 x1, u32 x2, u32 x3, u32 fit) {
#if THREE_SAMPLE  // 15 bits a sample: one lane at a time
    const u32 x[4] = {x0, x1, x2, x3};
    u32 word = 0;
    for (int k = 0; k < 4; k++)
        word |= (u32)(unsigned char)(sample_from_bits(x[k] ^ x[k] >> 16) * (int)(signed char)(fit >> 8 * k)) << 8 * k;
    return word;
#else
    const u32 t01 = __byte_perm(x0, x1, 0x6240), t23 = __byte_perm(x2, x3, 0x6240);
    const u32 r = __byte_perm(t01, t23, 0x5410) ^ __byte_perm(t01, t23, 0x7632);  // low bytes
    const u32 keep = ((fit | fit >> 1) & 0x01010101u) * 0xFFu;  // lanes of nonzero fitness
    const u32 mag = (r >> 1) & (NOISE_MASK * 0x01010101u) & keep;  // sample_from_bits
    const u32 neg = ~(r ^ fit >> 7) & 0x01010101u;  // bit 0 clear, or negative fitness: not both
    const u32 ones = neg * 0xFFu;
    // a lane's -mag as (mag ^ 0xFF) + 1 with no carry out of it (0 stays 0): mag < 128
    return (((mag ^ ones) & 0x7F7F7F7Fu) + neg) ^ (ones & 0x80808080u);
#endif
}
#define FITNESS_ONE 0x01010101u  // four lanes of fitness 1: the noise itself

// A parameter's noise seeds for its inputs are those for its outputs plus one wherever
// params.py's b_after is "1" (every parameter but the embedding): the two sides' noise
// of pair p is then that of pairs p and p + 1 at one seed offset, and the kernels below
// take both from the same hashes.

// Eight fitness bytes, of pairs q .. q + 7 (q from -15 on, any alignment: the buffer has
// zero bytes around it, gpu/update.py's FITNESS_PAD), as two words of four int8 lanes.
__device__ __forceinline__ uint2 fitness_at(const i8* fitness, int q) {
    const u64* w = (const u64*)(fitness + (q & ~7));
    const int r = 8 * (q & 7);
    const u64 x = r == 0 ? w[0] : w[0] >> r | w[1] << (64 - r);
    return make_uint2((u32)x, (u32)(x >> 32));
}

// out[j, p] = noise(step_seed + p + off, j) (* fitness[p + shift]) for j < n, and where
// then is given, then[j, p] = noise(step_seed + p + off + 1, j) for j < n_then: a
// matrix's input side beside its output side, nine hashes a thread's eight pairs and
// row where the two sides apart took sixteen. One noise vector per pair, pair-contiguous
// (pairs, the rows' length: a multiple of 8; gpu/update.py's are of 16). A thread takes eight
// pairs, their seeds and fitness once, and rows j = blockIdx.y + k gridDim.y, one 64-bit
// store a row and side: with a thread a byte, the indexing, the fitness loads and the
// byte stores took more time than the hashes.
extern "C" __global__ void noise_matrix(i8* out, i8* then, const i8* fitness, int shift, const u32* step_seed,
                                        u32 off, int n, int n_then, int pairs) {
    const int p = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (p >= pairs) return;
    const u32 seed = pair_seed(step_seed[0], p) + off;
    const uint2 f = fitness ? fitness_at(fitness, p + shift) : make_uint2(FITNESS_ONE, FITNESS_ONE);
    const int rows = then ? max(n, n_then) : n;
    for (int j = blockIdx.y; j < rows; j += gridDim.y) {
        u32 x[9];
#pragma unroll
        for (int k = 0; k < 8; k++) x[k] = hash_mix(seed + k, j);
        if (j < n)
            ((uint2*)(out + (long)j * pairs))[p / 8] =
                make_uint2(noise_word(x[0], x[1], x[2], x[3], f.x), noise_word(x[4], x[5], x[6], x[7], f.y));
        if (then && j < n_then) {
            x[8] = hash_mix(seed + 8, j);
            ((uint2*)(then + (long)j * pairs))[p / 8] = make_uint2(noise_word(x[1], x[2], x[3], x[4], FITNESS_ONE),
                                                                   noise_word(x[5], x[6], x[7], x[8], FITNESS_ONE));
        }
    }
}

// The vector slices' votes, vote[at + j] = sum_p fitness_p * a_p[j] * b_p[j] with a_p[j]
// = noise(step_seed + p + off, j) and b_p[j] = noise(step_seed + p + off + d, j): a
// product of the same two noise entries for every slice whose seeds are off + s apart,
// m_j(s) = noise(step_seed + off + s, j) * noise(step_seed + off + s + d, j), so that a
// slice's vote is the correlation sum_p fitness_p m_j(p + r) at its offset r = off_slice
// - off. A thread takes one entry j and a tile of VOTE_TILE seeds s, hashes each m_j(s)
// once and adds it, times the fitness at p = s - r, into every slice of a cluster (up to
// VOTE_PARAMS slices of one d whose offsets lie within VOTE_SPAN; gpu/update.py's
// VectorClusters): a hash a seed and entry for all of them, where a slice at a time
// hashed every seed for each of them. Where d is 1 (every vector slice today: params.py's
// b_after) m_j(s)'s second entry is m_j(s + 1)'s first, one hash a seed.
//
// Four seeds at a time: m_j(s .. s + 3) as two words of 16-bit lanes (|m| <= 93^2 <
// 2^15) and the four fitness bytes of p = s - r .. s - r + 3 as one word, two dp2a. The
// fitness is read from shared memory, VOTE_WINDOW bytes from pair s0 - span in four
// copies shifted by a byte each, so that every slice's word is aligned. Integer sums:
// exact in any order (the whole vote fits int32: UpdateBuffers checks it).
#define VOTE_WINDOW (VOTE_TILE + VOTE_SPAN + 4)

__device__ __forceinline__ int pack16(int lo, int hi) { return (int)(((u32)lo & 0xFFFFu) | (u32)hi << 16); }

// Entry j's votes of a cluster's first `active` slices (those longer than j: a cluster's
// slices are longest first), P >= active of them added every step without a branch (the
// slices past `active` read slice 0's fitness; their sums are dropped).
template <int P, bool ADJACENT>
__device__ __forceinline__ void vector_entry_votes(int* vote, const int* params, int active, int j, u32 seed,
                                                   u32 d, int span, const i8 (*s_fit)[VOTE_WINDOW]) {
    int acc[P];
    const int* words[P];  // each slice's fitness words for the tile
#pragma unroll
    for (int k = 0; k < P; k++) {
        acc[k] = 0;
        const int shift = span - params[4 * (k < active ? k : 0)];
        words[k] = (const int*)(s_fit[shift & 3] + (shift & ~3));
    }
    int prev = ADJACENT ? noise(seed, j) : 0;  // m_j(s)'s first entry
#pragma unroll 4
    for (int t = 0; t < VOTE_TILE / 4; t++) {
        int m[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const u32 s = seed + 4 * t + u;
            if (ADJACENT) {
                const int next = noise(s + 1, j);
                m[u] = prev * next;
                prev = next;
            } else {
                m[u] = noise(s, j) * noise(s + d, j);
            }
        }
        const int lo = pack16(m[0], m[1]), hi = pack16(m[2], m[3]);
#pragma unroll
        for (int k = 0; k < P; k++) acc[k] = __dp2a_hi(hi, words[k][t], __dp2a_lo(lo, words[k][t], acc[k]));
    }
#pragma unroll
    for (int k = 0; k < P; k++)
        if (k < active) atomicAdd(&vote[params[4 * k + 2] + j], acc[k]);
}

template <bool ADJACENT>
__device__ __forceinline__ void vector_entry_votes(int* vote, const int* params, int active, int j, u32 seed,
                                                   u32 d, int span, const i8 (*s_fit)[VOTE_WINDOW]) {
    static_assert(VOTE_PARAMS <= 32, "at most 32 slices a cluster");
    if (active <= 8)
        vector_entry_votes<8, ADJACENT>(vote, params, active, j, seed, d, span, s_fit);
    else if (active <= 16)
        vector_entry_votes<16, ADJACENT>(vote, params, active, j, seed, d, span, s_fit);
    else
        vector_entry_votes<32, ADJACENT>(vote, params, active, j, seed, d, span, s_fit);
}

// clusters[z]: (off, span, count, d), then count slices (r, length, at, 0), longest
// first, r = the slice's offset - off in [0, span]; VOTE_PARAMS + 1 records of four ints
// a cluster.
// Grid: (tiles of seeds s in [0, pairs + span), entries j by blocks, clusters). vote
// zeroed before.
extern "C" __global__ void vector_votes(int* vote, const i8* fitness, const u32* step_seed, const int* clusters,
                                        int pairs) {
    __shared__ __align__(16) i8 s_fit[4][VOTE_WINDOW];  // copy c: byte i the fitness of pair s0 - span + i + c
    const int* cluster = clusters + 4 * (VOTE_PARAMS + 1) * blockIdx.z;
    const int span = cluster[1], count = cluster[2], s0 = blockIdx.x * VOTE_TILE;
    const int* params = cluster + 4;
    if (s0 >= pairs + span || (int)(blockIdx.y * blockDim.x) >= params[1]) return;  // the whole block
    for (int i = threadIdx.x; i < 4 * VOTE_WINDOW; i += blockDim.x) {
        const int c = i / VOTE_WINDOW, q = s0 - span + i % VOTE_WINDOW + c;
        s_fit[c][i % VOTE_WINDOW] = q >= 0 && q < pairs ? fitness[q] : 0;
    }
    __syncthreads();
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    int active = 0;
    while (active < count && j < params[4 * active + 1]) active++;
    if (active == 0) return;
    const u32 seed = step_seed[0] + (u32)cluster[0] + (u32)s0, d = (u32)cluster[3];
    if (d == 1)
        vector_entry_votes<true>(vote, params, active, j, seed, d, span, s_fit);
    else
        vector_entry_votes<false>(vote, params, active, j, seed, d, span, s_fit);
}

// Piece i of out = piece index[i] of source, in 16-byte pieces, zeros where the index is
// -1: the copies of matrices that the sm90 kernels keep in their shared memory's order
// (gpu/cores.py's CoreCopy). n pieces; both arrays 16-byte aligned.
extern "C" __global__ void gather_pieces(const i8* source, const int* index, i8* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) ((int4*)out)[i] = index[i] < 0 ? make_int4(0, 0, 0, 0) : ((const int4*)source)[index[i]];
}

// Byte i of out = byte index[i] of source: the copies whose matrix inputs are reordered
// as well (gpu/cores.py's in_hidden_order). n bytes.
extern "C" __global__ void gather_bytes(const i8* source, const int* index, i8* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = source[index[i]];
}

// Grow an overlay entry by inc where its weights changed, shrink by dec elsewhere; clears the counts.
extern "C" __global__ void update_overlay(i8* ov, int* counts, int n, int inc, int dec) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int o = ov[i];
    ov[i] = (i8)(counts[i] > 0 ? min(o + inc, MAXV) : max(o - dec, -MAXV));
    counts[i] = 0;
}
