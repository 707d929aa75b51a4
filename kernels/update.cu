// The update (deggs/numerics/optimizer.py): every pair's noise as int8 matrices for the
// vote GEMMs, vector votes and the overlays (the optimizers' steps: optimizer.cu); and
// the sm90a kernels' copies of the weights, made again after each update.

#include "common.cuh"

// The noise seed of antithetic pair p at a step (deggs.seeds.pair_seed).
__device__ __forceinline__ u32 pair_seed(u32 step_seed, int p) { return step_seed + (u32)p; }

// out[j, p] = noise(step_seed + p + off, j) (* fitness[p]): one noise vector per pair,
// pair-contiguous (pairs: a multiple of 4; UpdateBuffers pads it to 16). A thread takes four
// pairs, their seeds and fitness once, and rows j = blockIdx.y + k gridDim.y, one 32-bit
// store a row: with a thread a byte, the indexing, the fitness loads and the byte stores
// took more time than the hashes.
extern "C" __global__ void noise_matrix(i8* out, const i8* fitness, const u32* step_seed, u32 off,
                                        int n, int pairs) {
    const int p = 4 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (p >= pairs) return;
    const u32 seed = pair_seed(step_seed[0], p) + off;
    const char4 f = fitness ? ((const char4*)fitness)[p / 4] : make_char4(1, 1, 1, 1);
    for (int j = blockIdx.y; j < n; j += gridDim.y) {
        const u32 word = (u32)(unsigned char)(noise(seed, j) * f.x) |
                         (u32)(unsigned char)(noise(seed + 1, j) * f.y) << 8 |
                         (u32)(unsigned char)(noise(seed + 2, j) * f.z) << 16 |
                         (u32)(unsigned char)(noise(seed + 3, j) * f.w) << 24;
        ((u32*)(out + (long)j * pairs))[p / 4] = word;
    }
}

// vote[i] += sum_p fitness_p * a_p[i] * b_p[i] over this block's share of the pairs (vote
// zeroed before; integer adds in any order). A thread an entry: a pair's fitness and seed
// are the same across the warp, so pairs of fitness 0 are skipped by whole warps, and
// the sum needs no reduction. The sum fits int32 (gpu/update.py's UpdateBuffers checks
// n_pairs * bound^2 < 2^31); a block an entry over all pairs, summing in 64 bits, was
// slower.
extern "C" __global__ void vector_votes(int* vote, const i8* fitness, const u32* step_seed,
                                        u32 off_a, u32 off_b, int n, int pairs_per_block, int pairs) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int first = blockIdx.y * pairs_per_block, last = min(pairs, first + pairs_per_block);
    const u32 base = step_seed[0];
    int s = 0;
    for (int p = first; p < last; p++) {
        const int f = fitness[p];
        if (f) {
            const u32 seed = pair_seed(base, p);
            s += f * noise(seed + off_a, i) * noise(seed + off_b, i);
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
