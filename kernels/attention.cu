// attention_mma: attention_mix (forward.cu) on the int8 tensor cores.
//
// attention_mix spends its time on CUDA-core dot products: every query's scores twice
// (peak, then weights) and a multiply-add per key and dimension for the mix. Here a
// block takes a (member, head) at a time, with the head's queries, keys and values in
// shared memory, and its warps take tiles of 16 queries. Per tile and 32-key chunk, the
// scores S = Q K^T are mma.sync products (m16n8k32, int8 in, int32 out); pass 1 finds
// each query's peak, pass 2 recomputes S (cheaper than keeping it) and turns it into LUT
// weights. A weight is at most EXP_MAX (2^18 at the default), too wide for an int8
// operand, so the mix W V runs once per byte of the weights (ATT_PLANES unsigned byte
// planes, u8 x s8 MMAs) and acc = sum_p (W_p V) << 8 p. Integer sums are exact in any
// order (ATTN_ACC_LL picks 64 bits where the sum could pass 2^31, as attention_mix
// does); the division (by a multiply, Quotient, where the sums are 32-bit), the clip and
// the o-projection's input dot are attention_mix's, so the two agree bit for bit.
//
// The mix sums over keys, so within a chunk the keys may be taken in any order both
// operands agree on: the weights stay where S's accumulator fragment put them (thread
// tig of a quad holds keys 8 j + 2 tig + e, j < 4, e < 2) and become the A fragment as
// they are, and the values are stored transposed with each key at that slot (key_slot).
//
// A block is resident for the whole launch and takes (member, head) items in turn
// (gpu/plan.py's attention_per_sm: as many as fit the SMs at once): while it scores one
// item, the next item's queries, keys and values arrive by cp.async into the other of
// two staging buffers. With a block an item, each waited for those loads twice (keys
// and values, then queries) before its first product: a quarter of the warps' samples.
// The warps of the first query tiles, which score fewer keys, then transpose the next
// item's values into the other of two prepared buffers while the rest still score:
// with every warp doing it after an item's barrier, the first ones waited there. Where
// two of each do not fit (long sequences: gpu/plan.py's ATT_BUFFERS), one of each, and
// the next item is loaded after this one.
//
// Needs HEAD_DIM % 32 == 0; defines ATT_WARPS (warps a block), ATT_BUFFERS (1 or 2) and
// EXP_MAX; gpu/plan.py's attention_shared() sizes the dynamic shared memory from the
// layout below.

#include "common.cuh"
#include "tiles.cuh"

#define ATT_TILES ((SEQ + 15) / 16)      // 16-query tiles of a sequence
#define ATT_KEYS ((SEQ + 31) / 32 * 32)  // keys, padded to whole 32-key chunks (zeros)
#define ATT_LDK (HEAD_DIM + 16)          // bytes a key row, a value column in shared
#define ATT_LDV (ATT_KEYS + 16)          // memory: the padding spreads a fragment's
                                         // 32 loads over the 32 banks
#define ATT_PLANES (EXP_MAX < 256 ? 1 : EXP_MAX < 65536 ? 2 : EXP_MAX < 16777216 ? 3 : 4)
#define ATT_DG (ATTN_ACC_LL || HEAD_DIM < 64 ? 32 : 64)  // value dimensions a pass mixes

// Where key s (< 32) of a chunk sits in the A fragment of the mix, as a k index.
__device__ __forceinline__ int key_slot(int s) {
    const int j = s >> 3, r = s & 7;  // r = 2 tig + e
    return (j >> 1) * 16 + (r >> 1) * 4 + (j & 1) * 2 + (r & 1);
}

// C's truncating n / t for one t (1 <= t < 2^31) and any int n, by a multiply: a query's
// weight sum divides its HEAD_DIM mixed values. With l = ceil(log2 t) and M =
// ceil(2^(31 + l) / t) < 2^32, |n| M / 2^(31 + l) = |n| / t + |n| e / (t 2^(31 + l)) for
// some 0 <= e < t: e = 0 where t = 2^l, else the second part is below 2^-l < 1 / t as
// |n| <= 2^31, so the floor is |n| / t's (tests/test_kernels.py checks the identity at
// its edges). M is a 64-bit division (two lanes of a quad make a query's); a value
// then takes a wide multiply and a shift, where ptxas's int division took some twelve
// instructions.
struct Quotient {
    u32 magic;
    int shift;
    __device__ __forceinline__ explicit Quotient(u32 t) {
        shift = 31 + (32 - __clz(t - 1u));
        magic = (u32)((((u64)1 << shift) + t - 1u) / t);
    }
    // Lane `from`'s (of the warp, all 32 here)
    __device__ __forceinline__ Quotient(const Quotient& q, int from)
        : magic(__shfl_sync(0xffffffffu, q.magic, from)), shift(__shfl_sync(0xffffffffu, q.shift, from)) {}
    __device__ __forceinline__ int operator()(int n) const {
        const u32 a = n < 0 ? 0u - (u32)n : (u32)n;
        const u32 q = (u32)(((u64)a * magic) >> shift);
        return (int)(n < 0 ? 0u - q : q);  // (negated as u32: q may be 2^31)
    }
};

// Byte `p` of four weights, packed into one fragment register (sel = p | (4 + p) << 4).
__device__ __forceinline__ u32 byte_plane(u32 w0, u32 w1, u32 w2, u32 w3, u32 sel) {
    return __byte_perm(__byte_perm(w0, w1, sel), __byte_perm(w2, w3, sel), 0x5410);
}

#define ATT_QROWS (ATT_TILES * 16)  // query rows, padded to whole tiles (zeros)
// With two buffers (ATT_BUFFERS), the first ATT_PREP warps stage and prepare the next
// item after scoring their tiles of this one: where the warps take one tile each, as at
// the default, those of the first tiles (fewer keys) while the others score more keys.
// With one (where two do not fit shared memory beside each other), every warp does,
// after the item.
#define ATT_PREP (ATT_BUFFERS == 1 ? ATT_WARPS : ATT_WARPS > 1 ? ATT_WARPS / 2 : 1)
#define ATT_PREP_BARRIER 1  // a named barrier of the ATT_PREP warps (0: __syncthreads)
// Rows of staged queries: with one buffer none, the queries read from global memory
// (the layout of two at the longest sequences would not fit shared memory)
#define ATT_QROWS_STAGED (ATT_BUFFERS == 2 ? ATT_QROWS : 0)

// Item `item`'s queries, keys and values (member item / N_HEADS, head item % N_HEADS) into
// one staging buffer, 16 bytes a copy by each of `threads` threads; rows past SEQ stay the
// zeros written at the start.
__device__ __forceinline__ void stage_item(i8* s_q, i8* s_k, i8* s_v, const i8* q, const i8* k,
                                           const i8* v, int item, int threads) {
    const long head = (long)(item / N_HEADS) * SEQ * HIDDEN + item % N_HEADS * HEAD_DIM;
    for (int i = threadIdx.x; i < SEQ * (HEAD_DIM / 16); i += threads) {
        const int s = i / (HEAD_DIM / 16), c = (i % (HEAD_DIM / 16)) * 16;
        const long at = head + (long)s * HIDDEN + c;
        if (ATT_QROWS_STAGED) copy16_async(s_q + s * ATT_LDK + c, q + at);
        copy16_async(s_k + s * ATT_LDK + c, k + at);
        copy16_async(s_v + s * HEAD_DIM + c, v + at);
    }
    copy_commit();
}

// A staged item's values transposed into s_vt (key_slot order) and o's input dot
// entries of its head h (seed: its member's plus o's offset), by `threads` threads.
__device__ __forceinline__ void prepare_item(i8* s_vt, dot_t* s_dot, const i8* s_v, const i8* ov_o_in,
                                             u32 seed, int h, int threads) {
    for (int i = threadIdx.x; i < SEQ * (HEAD_DIM / 16); i += threads) {
        const int s = i / (HEAD_DIM / 16), c = (i % (HEAD_DIM / 16)) * 16;
        const int4 vv = *(const int4*)(s_v + s * HEAD_DIM + c);
        const int slot = (s & ~31) + key_slot(s & 31);
        const u32 words[4] = {(u32)vv.x, (u32)vv.y, (u32)vv.z, (u32)vv.w};
#pragma unroll
        for (int e = 0; e < 16; e++) s_vt[(c + e) * ATT_LDV + slot] = (i8)(words[e >> 2] >> (8 * (e & 3)));
    }
    for (int i = threadIdx.x; i < HEAD_DIM; i += threads) s_dot[i] = dot_entry(ov_o_in, seed, h * HEAD_DIM + i);
}

// The kernel's body; UNIT: o's input dot by unit factors (common.cuh). Each head's
// share of the dot is then (sum of v e) / 64 exactly (every entry e is 64 n), so the
// heads' shares still add up to the dot.
template <bool UNIT>
__device__ __forceinline__ void attention_items(const i8* q, const i8* k, const i8* v, i8* mixed, int* sb_o,
                                                const u32* seeds, const i8* ov_o_in, u32 o_b, const int* exp_tab,
                                                int items) {
    extern __shared__ __align__(16) unsigned char attention_shared[];
    // [ATT_BUFFERS] staging buffers: queries [ATT_QROWS_STAGED][ATT_LDK], keys
    // [ATT_KEYS][ATT_LDK] (the scores read both there), values as they lie in memory
    // [SEQ][HEAD_DIM]; [ATT_BUFFERS] of the prepared values and dot entries
    constexpr int STAGE = (ATT_QROWS_STAGED + ATT_KEYS) * ATT_LDK + SEQ * HEAD_DIM;
    constexpr int VT = HEAD_DIM * ATT_LDV;
    i8* s_stage = (i8*)attention_shared;
    i8* s_vts = s_stage + ATT_BUFFERS * STAGE;                 // [HEAD_DIM][ATT_LDV]: key_slot order
    dot_t* s_dots = (dot_t*)(s_vts + ATT_BUFFERS * VT);         // [HEAD_DIM] o's input dot entries
    int* s_exp = (int*)(s_dots + ATT_BUFFERS * HEAD_DIM);      // [LUT_SIZE]
    auto queries = [&](int buf) { return s_stage + buf * STAGE; };
    auto keys = [&](int buf) { return queries(buf) + ATT_QROWS_STAGED * ATT_LDK; };
    auto values = [&](int buf) { return keys(buf) + ATT_KEYS * ATT_LDK; };

    // The padding rows, zeros for good: past SEQ in every buffer's queries and keys, and
    // the padded keys' slots of the transposed values
    for (int buf = 0; buf < ATT_BUFFERS; buf++) {
        for (int i = SEQ * ATT_LDK + threadIdx.x; i < ATT_QROWS_STAGED * ATT_LDK; i += blockDim.x) queries(buf)[i] = 0;
        for (int i = SEQ * ATT_LDK + threadIdx.x; i < ATT_KEYS * ATT_LDK; i += blockDim.x) keys(buf)[i] = 0;
#if ATT_KEYS > SEQ
        for (int i = threadIdx.x; i < HEAD_DIM * (ATT_KEYS - SEQ); i += blockDim.x) {
            const int d = i / (ATT_KEYS - SEQ), s = SEQ + i % (ATT_KEYS - SEQ);
            s_vts[buf * VT + d * ATT_LDV + (s & ~31) + key_slot(s & 31)] = 0;
        }
#endif
    }
    for (int i = threadIdx.x; i < LUT_SIZE; i += blockDim.x) s_exp[i] = exp_tab[i];
    if (blockIdx.x >= items) return;
    // The first item, by every thread
    stage_item(queries(0), keys(0), values(0), q, k, v, blockIdx.x, blockDim.x);
    copy_wait<0>();
    __syncthreads();
    prepare_item(s_vts, s_dots, values(0), ov_o_in, seeds[blockIdx.x / N_HEADS] + o_b, blockIdx.x % N_HEADS,
                 blockDim.x);

    const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
    const bool prep = threadIdx.x < 32 * ATT_PREP;
#pragma unroll 1
    for (int item = blockIdx.x, buf = 0; item < items; item += gridDim.x, buf ^= ATT_BUFFERS - 1) {
        // Item `item` staged and prepared in `buf`, every warp done with the item before
        // (whose staging and prepared buffers are the other ones, with two)
        __syncthreads();
        const int next = item + gridDim.x, to = buf ^ (ATT_BUFFERS - 1);  // the next one's buffers
        if (ATT_BUFFERS == 2 && prep && next < items)
            stage_item(queries(to), keys(to), values(to), q, k, v, next, 32 * ATT_PREP);
        const int m = item / N_HEADS, h = item % N_HEADS;
        const long head = (long)m * SEQ * HIDDEN + h * HEAD_DIM;  // (member, position 0, head)
        const i8* s_q = queries(buf);
        const i8* s_k = keys(buf);
        const i8* s_vt = s_vts + buf * VT;
        const dot_t* s_dot = s_dots + buf * HEAD_DIM;

        for (int tile = threadIdx.x >> 5; tile < ATT_TILES; tile += ATT_WARPS) {
            const int tq[2] = {tile * 16 + g, tile * 16 + g + 8};  // the thread's two queries
            u32 qa[HEAD_DIM / 32][4];  // Q's A fragments
#pragma unroll
            for (int kc = 0; kc < HEAD_DIM / 32; kc++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int t = tq[i & 1], at = kc * 32 + 4 * tig + 16 * (i >> 1);
                    if (ATT_QROWS_STAGED)
                        qa[kc][i] = *(const u32*)(s_q + t * ATT_LDK + at);
                    else
                        qa[kc][i] = t < SEQ ? *(const u32*)(q + head + (long)t * HIDDEN + at) : 0u;
                }
            const int chunks = min(tile * 16 + 15, SEQ - 1) / 32 + 1;

            // sc[j][i]: score of key 32 c + 8 j + 2 tig + (i & 1) for query tq[i >> 1].
            auto scores = [&](int (&sc)[4][4], int c) {
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int i = 0; i < 4; i++) sc[j][i] = 0;
#pragma unroll
                for (int kc = 0; kc < HEAD_DIM / 32; kc++)
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const i8* p = s_k + (c * 32 + 8 * j + g) * ATT_LDK + kc * 32 + 4 * tig;
                        const u32 b[2] = {*(const u32*)p, *(const u32*)(p + 16)};
                        mma_s8(sc[j], qa[kc], b);
                    }
            };
#define ATT_KEY(c, j, i) ((c) * 32 + 8 * (j) + 2 * tig + ((i) & 1))

            int top[2] = {INT_MIN_, INT_MIN_};  // pass 1: the peaks, then peak >> SHIFT_ATTN
            for (int c = 0; c < chunks; c++) {
                int sc[4][4];
                scores(sc, c);
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int i = 0; i < 4; i++)
                        if (ATT_KEY(c, j, i) <= tq[i >> 1]) top[i >> 1] = max(top[i >> 1], sc[j][i]);
            }
#pragma unroll
            for (int r = 0; r < 2; r++) {
                top[r] = quad_max(top[r]) >> SHIFT_ATTN;
            }

            u32 total[2] = {0u, 0u};  // the weights' sums (int in attention_mix: wraps alike)
            for (int d0 = 0; d0 < HEAD_DIM; d0 += ATT_DG) {
                attn_acc acc[ATT_DG / 8][4];
#pragma unroll
                for (int nt = 0; nt < ATT_DG / 8; nt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) acc[nt][i] = 0;
                for (int c = 0; c < chunks; c++) {
                    int sc[4][4];
                    scores(sc, c);
                    u32 w[4][4];
#pragma unroll
                    for (int j = 0; j < 4; j++)
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            // >= 0 for a visible key (the peak is of those), so one
                            // unsigned min clamps it; a future key's is dropped below
                            const u32 idx = min((u32)(top[i >> 1] - (sc[j][i] >> SHIFT_ATTN)), LUT_SIZE - 1u);
                            w[j][i] = ATT_KEY(c, j, i) <= tq[i >> 1] ? (u32)s_exp[idx] : 0u;
                            if (d0 == 0) total[i >> 1] += w[j][i];
                        }
#pragma unroll
                    for (int p = 0; p < ATT_PLANES; p++) {
                        const u32 sel = p | ((4 + p) << 4);
                        const u32 a[4] = {byte_plane(w[0][0], w[0][1], w[1][0], w[1][1], sel),
                                          byte_plane(w[0][2], w[0][3], w[1][2], w[1][3], sel),
                                          byte_plane(w[2][0], w[2][1], w[3][0], w[3][1], sel),
                                          byte_plane(w[2][2], w[2][3], w[3][2], w[3][3], sel)};
#pragma unroll
                        for (int nt = 0; nt < ATT_DG / 8; nt++) {
                            const i8* pb = s_vt + (d0 + nt * 8 + g) * ATT_LDV + c * 32 + 4 * tig;
                            const u32 b[2] = {*(const u32*)pb, *(const u32*)(pb + 16)};
#if !ATTN_ACC_LL
                            // the low plane's products added by the MMA itself (its C):
                            // every partial sum is a sum of w v over bits of w, below
                            // the whole one's bound, 2^31, so the int32 sum is exact
                            if (p == 0) {
                                mma_u8s8(acc[nt], a, b);
                                continue;
                            }
#endif
                            int part[4] = {0, 0, 0, 0};
                            mma_u8s8(part, a, b);
#pragma unroll
                            for (int i = 0; i < 4; i++)
#if ATTN_ACC_LL
                                acc[nt][i] += (long long)part[i] * (1ll << (8 * p));
#else
                                acc[nt][i] = (int)((u32)acc[nt][i] + ((u32)part[i] << (8 * p)));
#endif
                        }
                    }
                }
                if (d0 == 0)
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        total[r] = quad_sum(total[r]);
                        if (total[r] == 0u) total[r] = 1u;
                    }

                // Epilogue: the thread's two queries, dimensions d0 + 8 nt + 2 tig + (0, 1).
#if !ATTN_ACC_LL
                // a quad's lanes share their two queries: each makes one's, and takes both
                const Quotient made(tig & 1 ? total[1] : total[0]);  // (total[tig & 1]: local memory)
                const Quotient by_total[2] = {Quotient(made, lane & ~3), Quotient(made, (lane & ~3) + 1)};
#endif
                u32 dot[2] = {0u, 0u};
#pragma unroll
                for (int nt = 0; nt < ATT_DG / 8; nt++)
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        const int d = d0 + nt * 8 + 2 * tig;
#if ATTN_ACC_LL
                        const attn_acc div = (attn_acc)(int)total[r];
                        const int v0 = clip8((int)(acc[nt][2 * r] / div));
                        const int v1 = clip8((int)(acc[nt][2 * r + 1] / div));
#else
                        const int v0 = clip8(by_total[r](acc[nt][2 * r]));
                        const int v1 = clip8(by_total[r](acc[nt][2 * r + 1]));
#endif
                        dot[r] = dot_add<UNIT>(dot_add<UNIT>(dot[r], v0, s_dot[d]), v1, s_dot[d + 1]);
                        if (tq[r] < SEQ)
                            *(unsigned short*)(mixed + head + (long)tq[r] * HIDDEN + d) =
                                (unsigned short)((v0 & 255) | ((v1 & 255) << 8));
                    }
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    const u32 total_dot = (u32)dot_value<UNIT>(quad_sum(dot[r]));
                    if (tig == 0 && tq[r] < SEQ) atomicAdd((u32*)&sb_o[(long)m * SEQ + tq[r]], total_dot);
                }
            }
#undef ATT_KEY
        }
        if (ATT_BUFFERS == 1 && next < items) {  // every warp done with this item first
            __syncthreads();
            stage_item(queries(to), keys(to), values(to), q, k, v, next, 32 * ATT_PREP);
        }
        if (prep && next < items) {
            copy_wait<0>();
            asm volatile("bar.sync %0, %1;\n" ::"n"(ATT_PREP_BARRIER), "n"(32 * ATT_PREP) : "memory");
            prepare_item(s_vts + to * VT, s_dots + to * HEAD_DIM, values(to), ov_o_in, seeds[next / N_HEADS] + o_b,
                         next % N_HEADS, 32 * ATT_PREP);
        }
    }
}

// The kernel and its twin for unit factors (gpu/plan.py's UNIT_TWINS): both are
// launched, and the one whose case the overlay of o's inputs is not returns after its
// block's vote, one function for both so that exactly one runs. In one kernel, the two
// bodies spilled registers at hidden 512 and with 64-bit sums.
__device__ __forceinline__ bool o_dot_unit(const i8* ov_o_in) {
    return UNIT_FITS(HEAD_DIM) && __syncthreads_and(unit_share(ov_o_in, HIDDEN));
}
extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS, 16 / ATT_WARPS)
attention_mma(const i8* q, const i8* k, const i8* v, i8* mixed, int* sb_o, const u32* seeds,
              const i8* ov_o_in, u32 o_b, const int* exp_tab, int items) {
    if (!o_dot_unit(ov_o_in)) attention_items<false>(q, k, v, mixed, sb_o, seeds, ov_o_in, o_b, exp_tab, items);
}
extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS, 16 / ATT_WARPS)
attention_mma_unit(const i8* q, const i8* k, const i8* v, i8* mixed, int* sb_o, const u32* seeds,
                   const i8* ov_o_in, u32 o_b, const int* exp_tab, int items) {
    if constexpr (UNIT_FITS(HEAD_DIM))  // (else no body is compiled)
        if (o_dot_unit(ov_o_in)) attention_items<true>(q, k, v, mixed, sb_o, seeds, ov_o_in, o_b, exp_tab, items);
}
