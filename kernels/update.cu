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

// out[j, p] = noise(step_seed + p + off, j) (* fitness[p]) for j < n, and where then is
// given, then[j, p] = noise(step_seed + p + off + 1, j) for j < n_then: a matrix's input
// side beside its output side, nine hashes a thread's eight pairs and row where the two
// sides apart took sixteen. One noise vector per pair, pair-contiguous (pairs: a
// multiple of 8; UpdateBuffers pads it to 16). A thread takes eight pairs, their seeds
// and fitness once, and rows j = blockIdx.y + k gridDim.y, one 64-bit store a row and
// side: with a thread a byte, the indexing, the fitness loads and the byte stores took
// more time than the hashes.
extern "C" __global__ void noise_matrix(i8* out, i8* then, const i8* fitness, const u32* step_seed, u32 off,
                                        int n, int n_then, int pairs) {
    const int p = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (p >= pairs) return;
    const u32 seed = pair_seed(step_seed[0], p) + off;
    const uint2 f = fitness ? ((const uint2*)fitness)[p / 8] : make_uint2(FITNESS_ONE, FITNESS_ONE);
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

// An entry's sum of fitness_p * a_p[j] * b_p[j] over pairs first..last (e: its seed
// offsets of a and b, j), four pairs at a time: their noise as int8 lanes (the a side
// times the fitness) and one dp4a. ADJACENT: b's offset is a's plus one, so the a side's
// last three hashes are the b side's first three (five hashes, not eight). The pairs'
// fitness and seeds are the same across the warp: four pairs of fitness 0 are skipped by
// whole warps.
template <bool ADJACENT>
__device__ __forceinline__ int entry_votes(uint4 e, const i8* fitness, u32 step_seed, int first, int last) {
    int s = 0;
    for (int p = first; p < last; p += 4) {
        const u32 fit = ((const u32*)fitness)[p / 4];
        if (fit) {
            const u32 seed = pair_seed(step_seed, p);
            u32 x[8];  // the a side's hashes, then the b side's
#pragma unroll
            for (int k = 0; k < 4; k++) x[k] = hash_mix(seed + e.x + k, e.z);
#pragma unroll
            for (int k = 0; k < 4; k++) x[4 + k] = ADJACENT && k < 3 ? x[k + 1] : hash_mix(seed + e.y + k, e.z);
            const u32 a = noise_word(x[0], x[1], x[2], x[3], fit);
            s = __dp4a((int)a, (int)noise_word(x[4], x[5], x[6], x[7], FITNESS_ONE), s);
        }
    }
    return s;
}

// vote[i] += entry i's sum over this block's share of the pairs, for entry i of every
// vector parameter slice at once: entries[4 i ..] = (its slice's seed offsets of a and
// b, j its index in the slice, 0). One launch for all: a launch a slice (31 at the
// default, most of 256 entries) ran a short wave each. vote zeroed before; integer adds
// in any order. A thread an entry: the sum needs no reduction, and fits int32
// (gpu/update.py's UpdateBuffers checks n_pairs * bound^2 < 2^31). pairs_per_block and
// pairs: multiples of 4.
extern "C" __global__ void vector_votes(int* vote, const i8* fitness, const u32* step_seed,
                                        const u32* entries, int n, int pairs_per_block, int pairs) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const uint4 e = ((const uint4*)entries)[i];  // four u32 an entry
    const int first = blockIdx.y * pairs_per_block, last = min(pairs, first + pairs_per_block);
    const u32 base = step_seed[0];
    atomicAdd(&vote[i], e.y == e.x + 1 ? entry_votes<true>(e, fitness, base, first, last)
                                       : entry_votes<false>(e, fitness, base, first, last));
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
