// The optimizers' steps (deggs/numerics/optimizer.py's AdamW and ThresholdSgd): one
// kernel each, launched by its optimizer in deggs/numerics/gpu/update.py on a whole
// parameter slice held as [outer, inner] (a matrix Wt[out, in], or a vector), with its
// vote. Each computes its step direction; `quantize_step` is the quantised step they
// share. Every float operation is written out (--fmad=false): the same roundings as the
// CPU's, fused multiply-adds where the reference's nvcc emitted them.

#include "common.cuh"

// acc moves by -lr * xs; the weight moves by one where acc crosses +-1 (clamped at
// +-MAXV, where acc stays at +-1); counts the change per inner index (row_counts), per
// outer index (col_counts, may be null) and in total.
__device__ __forceinline__ void quantize_step(i8* w, float* acc, long e, int wi, float xs, int inner,
                                              const float* lr_buf, int lr_index, int* row_counts,
                                              int* col_counts, u64* changes) {
    float a = __fmaf_rn(-lr_buf[lr_index], xs, acc[e]);
    const bool up = a >= 1.0f, down = a <= -1.0f;
    const bool cu = up && wi < MAXV, cd = down && wi > -MAXV;
    if (cu) a = __fsub_rn(a, 1.0f);
    else if (up) a = 1.0f;
    if (cd) a = __fadd_rn(a, 1.0f);
    else if (down) a = -1.0f;
    acc[e] = a;
    if (cu || cd) {
        w[e] = (i8)(wi + (cu ? 1 : -1));
        atomicAdd(changes, 1ull);
        atomicAdd(&row_counts[e % inner], 1);
        if (col_counts) atomicAdd(&col_counts[e / inner], 1);
    }
}

// AdamW: the moments from the gradient g = -vote, then m / (sqrt(v) + eps) plus weight decay.
extern "C" __global__ void adamw_step(i8* w, float* m, float* v, float* acc, const int* vote, int n,
                                      int inner, const float* lr_buf, int lr_index, int* row_counts,
                                      int* col_counts, u64* changes, float b1, float omb1, float b2,
                                      float omb2, float eps, float wd) {
    const long e = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const float g = -__int2float_rn(vote[e]);
    const int wi = w[e];
    const float wf = (float)wi;
    const float mm = __fmaf_rn(b1, m[e], __fmul_rn(omb1, g));
    const float vv = __fmaf_rn(omb2, __fmul_rn(g, g), __fmul_rn(b2, v[e]));
    m[e] = mm;
    v[e] = vv;
    const float xs = __fmaf_rn(wd, wf, __fdiv_rn(mm, __fadd_rn(__fsqrt_rn(vv), eps)));
    quantize_step(w, acc, e, wi, xs, inner, lr_buf, lr_index, row_counts, col_counts, changes);
}

// Threshold SGD: the scaled gradient plus weight decay; no moments.
extern "C" __global__ void sgd_step(i8* w, float* acc, const int* vote, int n, int inner,
                                    const float* lr_buf, int lr_index, int* row_counts,
                                    int* col_counts, u64* changes, float wd, float sgd_scale) {
    const long e = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const float g = -__int2float_rn(vote[e]);
    const int wi = w[e];
    const float wf = (float)wi;
    const float xs = __fmaf_rn(wd, wf, __fmul_rn(sgd_scale, g));
    quantize_step(w, acc, e, wi, xs, inner, lr_buf, lr_index, row_counts, col_counts, changes);
}
