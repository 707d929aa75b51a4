// Generation (deggs/numerics/sampling.py): the forward.cu row kernels run one
// unperturbed sequence as a member of sign 0; these two replace attention_mix and
// sequence_loss there.

#include "common.cuh"

// attention_mix of the rows at positions pos0 + t over the key/value cache (normalised
// keys and values of positions 0.., [position, HIDDEN]). Block per (row, head);
// dynamic shared memory: one int per visible key.
extern "C" __global__ void cached_attention(const i8* q, const i8* k_cache, const i8* v_cache,
                                            i8* mixed, int pos0, const int* exp_tab) {
    extern __shared__ int s_w[];  // scores, then weights
    const int t = blockIdx.x, h = blockIdx.y;
    const int n_keys = pos0 + t + 1;
    const i8* qr = q + (long)t * HIDDEN + h * HEAD_DIM;
    int peak = INT_MIN_;
    for (int s = threadIdx.x; s < n_keys; s += blockDim.x) {
        const i8* kr = k_cache + (long)s * HIDDEN + h * HEAD_DIM;
        int score = 0;
        for (int i = 0; i < HEAD_DIM; i++) score += qr[i] * kr[i];
        s_w[s] = score;
        peak = max(peak, score);
    }
    peak = block_max_int(peak);
    const int top = peak >> SHIFT_ATTN;
    long long total = 0;
    for (int s = threadIdx.x; s < n_keys; s += blockDim.x) {
        int idx = top - (s_w[s] >> SHIFT_ATTN);
        idx = idx < 0 ? 0 : (idx > LUT_SIZE - 1 ? LUT_SIZE - 1 : idx);
        s_w[s] = exp_tab[idx];
        total += s_w[s];
    }
    total = block_sum_ll(total);  // its barriers publish s_w
    if (total == 0) total = 1;
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        long long acc = 0;
        for (int s = 0; s < n_keys; s++) acc += (long long)s_w[s] * v_cache[(long)s * HIDDEN + h * HEAD_DIM + d];
        mixed[(long)t * HIDDEN + h * HEAD_DIM + d] = (i8)clip8((int)(acc / total));
    }
}

// A token's weight in choose_token: its logit minus the largest, divided by the
// temperature in float32 and truncated; dropped below the min-p limit; exp table.
__device__ __forceinline__ int token_weight(long long shifted, float temperature, int min_p_limit,
                                            const int* exp_tab) {
    const long long scaled = __float2ll_rz(__fdiv_rn(__ll2float_rn(shifted), temperature));
    if (scaled < min_p_limit) return 0;
    const long long idx = -scaled;
    return exp_tab[idx < 0 ? 0 : (idx > LUT_SIZE - 1 ? LUT_SIZE - 1 : idx)];
}

// choose_token for position t: g holds the position's logits before >> SHIFT_LOGIT,
// tokens[0..t] the sequence so far; writes tokens[t + 1]. The seed is read from device
// memory, so that a generation's launches replay as one CUDA graph (gpu/generate.py)
// with each call's seed. The reference runs one block of
// HIDDEN threads: thread j owns tokens j, j + HIDDEN, ... (scan_order), and the running
// sum of weights visits the threads in order. We run CT_THREADS threads (at most 1024),
// each playing HIDDEN / CT_THREADS consecutive reference threads. Dynamic shared memory:
// the earlier occurrences of each token, 16 bits each (t < 65535), two to a word.
#define CT_PER (HIDDEN / CT_THREADS)
extern "C" __global__ void choose_token(const int* g, int* tokens, int t, const u32* seed, int penalty,
                                        float temperature, int min_p_limit, const int* exp_tab) {
    extern __shared__ u32 s_count2[];
    __shared__ long long s_start[HIDDEN + 1];  // each reference thread's first running sum
    for (int w = threadIdx.x; w < (VOCAB + 1) / 2; w += blockDim.x) s_count2[w] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i <= t; i += blockDim.x) {
        const int tok = tokens[i];
        if ((unsigned)tok < VOCAB) atomicAdd(&s_count2[tok >> 1], 1u << (16 * (tok & 1)));
    }
    __syncthreads();
#define COUNT(v) ((int)((s_count2[(v) >> 1] >> (16 * ((v) & 1))) & 0xFFFFu))
#define LOGIT(v) ((long long)(g[v] >> SHIFT_LOGIT) - (long long)penalty * COUNT(v))
    long long peak = -0x7FFFFFFFFFFFFFFFll - 1;
    for (int v = threadIdx.x; v < VOCAB; v += blockDim.x) peak = max(peak, LOGIT(v));
    peak = block_max_ll(peak);
    for (int c = 0; c < CT_PER; c++) {
        const int j = threadIdx.x * CT_PER + c;
        long long own = 0;
        for (int v = j; v < VOCAB; v += HIDDEN)
            own += token_weight(LOGIT(v) - peak, temperature, min_p_limit, exp_tab);
        s_start[j] = own;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // exclusive prefix sums of the threads' weights, in thread order
        long long running = 0;
        for (int i = 0; i < HIDDEN; i++) {
            const long long w = s_start[i];
            s_start[i] = running;
            running += w;
        }
        s_start[HIDDEN] = running;
        if (running <= 0) tokens[t + 1] = 0;
    }
    __syncthreads();
    const long long total = s_start[HIDDEN];
    if (total <= 0) return;
    const long long threshold = (long long)(hash_u32(*seed + (u32)t * (u32)SAMPLE_STRIDE, 0) % (u64)total);
    for (int c = 0; c < CT_PER; c++) {
        const int j = threadIdx.x * CT_PER + c;
        long long running = s_start[j];
        if (threshold < running || threshold >= s_start[j + 1]) continue;
        for (int v = j; v < VOCAB; v += HIDDEN) {  // the first token where the sum exceeds it
            running += token_weight(LOGIT(v) - peak, temperature, min_p_limit, exp_tab);
            if (running > threshold) {
                tokens[t + 1] = v;
                return;
            }
        }
    }
#undef LOGIT
#undef COUNT
}
