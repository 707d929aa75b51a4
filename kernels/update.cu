// The update (deggs/numerics/optimizer.py): every pair's noise as int8 matrices for the
// vote GEMMs, vector votes and the overlays (the optimizers' steps: optimizer.cu); and
// the sm90a kernels' copies of the weights, made again after each update.

#include "common.cuh"

// The noise seed of antithetic pair p at a step (deggs.seeds.pair_seed).
__device__ __forceinline__ u32 pair_seed(u32 step_seed, int p) { return step_seed + (u32)p; }

// Four consecutive pairs' noise entry idx (seeds seed .. seed + 3), each times its pair's
// fitness (fit: four int8 lanes of -1, 0 or 1), as one word of four int8 lanes: what
// four noise() calls and a pack give. Uniform noise (|entry| <= NOISE_MASK <= 31) is
// made four lanes at a time once the hashes are mixed: hash_u32's last step, x ^= x >>
// 16, only matters to the low byte here (byte 0 ^ byte 2), and the sign and fitness
// are applied to the four lanes in one word, about half the instructions a byte.
__device__ __forceinline__ u32 noise4(u32 seed, u32 idx, u32 fit) {
#if THREE_SAMPLE  // 15 bits a sample: one lane at a time
    u32 word = 0;
    for (int k = 0; k < 4; k++)
        word |= (u32)(unsigned char)(noise(seed + k, idx) * (int)(signed char)(fit >> 8 * k)) << 8 * k;
    return word;
#else
    u32 x[4];
    for (int k = 0; k < 4; k++) x[k] = hash_mix(seed + k, idx);
    const u32 t01 = __byte_perm(x[0], x[1], 0x6240), t23 = __byte_perm(x[2], x[3], 0x6240);
    const u32 r = __byte_perm(t01, t23, 0x5410) ^ __byte_perm(t01, t23, 0x7632);  // low bytes
    const u32 keep = ((fit | fit >> 1) & 0x01010101u) * 0xFFu;  // lanes of nonzero fitness
    const u32 mag = (r >> 1) & (NOISE_MASK * 0x01010101u) & keep;  // sample_from_bits
    const u32 neg = ~(r ^ fit >> 7) & 0x01010101u;  // bit 0 clear, or negative fitness: not both
    const u32 ones = neg * 0xFFu;
    // a lane's -mag as (mag ^ 0xFF) + 1 with no carry out of it (0 stays 0): mag < 128
    return (((mag ^ ones) & 0x7F7F7F7Fu) + neg) ^ (ones & 0x80808080u);
#endif
}

// out[j, p] = noise(step_seed + p + off, j) (* fitness[p]): one noise vector per pair,
// pair-contiguous (pairs: a multiple of 8; UpdateBuffers pads it to 16). A thread takes
// eight pairs, their seeds and fitness once, and rows j = blockIdx.y + k gridDim.y, one
// 64-bit store a row: with a thread a byte, the indexing, the fitness loads and the byte
// stores took more time than the hashes.
extern "C" __global__ void noise_matrix(i8* out, const i8* fitness, const u32* step_seed, u32 off,
                                        int n, int pairs) {
    const int p = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (p >= pairs) return;
    const u32 seed = pair_seed(step_seed[0], p) + off;
    const uint2 f = fitness ? ((const uint2*)fitness)[p / 8] : make_uint2(0x01010101u, 0x01010101u);
    for (int j = blockIdx.y; j < n; j += gridDim.y)
        ((uint2*)(out + (long)j * pairs))[p / 8] = make_uint2(noise4(seed, j, f.x), noise4(seed + 4, j, f.y));
}

// vote[i] += sum_p fitness_p * a_p[j] * b_p[j] over this block's share of the pairs, for
// entry i of every vector parameter slice at once: entries[4 i ..] = (its slice's seed
// offsets of a and b, j its index in the slice, 0). One launch for all: a launch a slice
// (31 at the default, most of 256 entries) ran a short wave each. vote zeroed before;
// integer adds in any order. A thread an entry, four pairs at a time: their noise as int8
// lanes (the a side times the fitness) and one dp4a. The pairs' fitness and seeds are the
// same across the warp, so four pairs of fitness 0 are skipped by whole warps, and the sum
// needs no reduction. The sum fits int32 (gpu/update.py's UpdateBuffers checks n_pairs *
// bound^2 < 2^31). pairs_per_block and pairs: multiples of 4.
extern "C" __global__ void vector_votes(int* vote, const i8* fitness, const u32* step_seed,
                                        const u32* entries, int n, int pairs_per_block, int pairs) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const uint4 e = ((const uint4*)entries)[i];  // four u32 an entry
    const int first = blockIdx.y * pairs_per_block, last = min(pairs, first + pairs_per_block);
    const u32 base = step_seed[0];
    int s = 0;
    for (int p = first; p < last; p += 4) {
        const u32 fit = ((const u32*)fitness)[p / 4];
        if (fit) {
            const u32 seed = pair_seed(base, p);
            s = __dp4a((int)noise4(seed + e.x, e.z, fit), (int)noise4(seed + e.y, e.z, 0x01010101u), s);
        }
    }
    atomicAdd(&vote[i], s);
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
