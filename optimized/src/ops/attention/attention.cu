// Fused attention over KeyRanges (optimized/src/ops/attention/ranges.rs) on Hopper
// (compute_90a): bf16 inputs, fp32 accumulation, warpgroup MMA (wgmma) with both operands in
// shared memory, or A (q, dout, the probabilities, ds) in registers. The CPU twin is
// optimized/src/ops/attention/twin.rs: the same tiling (KV tiles of FORWARD_TILE_K keys in the
// forward, TILE_K in the backward), the same online softmax, the same key-major dK/dV and
// query-major dQ passes.
//
// Layouts: q, out, dout, dq [Q, nh, HEAD_DIM]; k, v, dk, dv [K, nkv, HEAD_DIM]; lse, dsum [nh, Q].
// The query-major kernels give each row group of each KV head its rows times the nh/nkv query
// heads of that KV head (row rho -> head rho / R, row rho % R), so every K/V tile loaded serves
// all query heads of the GQA group. A warpgroup (4 warps) owns 64 rows, warp w of it rows
// 16w..16w+15 in the accumulator layout of mma.sync m16n8k16. Shared tiles are 128-byte swizzled: a
// [rows][HEAD_DIM] tile is stored as PANELS panels [rows][64] (one 128-byte line per row), the
// 16-byte chunk c of row r at chunk c ^ (r % 8); every tile starts 1024-byte aligned. HEAD_DIM (a
// multiple of 64), DKDV_STAGE_BYTES and FORWARD_TILE_K are defined per head dim, and the shared
// constants (TILE_K, WG_ROWS, DKDV_CHUNK, KV_STAGES) for every kernel, by the host before
// compilation (optimized/src/ops/sources.rs, constants.rs).

#include <cuda_bf16.h>

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif

#define INFINITY __int_as_float(0x7f800000)
#define LOG2E 1.4426950408889634f
#define DK (HEAD_DIM / 16)   // k-steps over the head dim
#define DN (HEAD_DIM / 8)    // n-tiles over the head dim

typedef unsigned int u32;
typedef __nv_bfloat16 bf16;
struct RowGroup {
    u32 ctx_lo, ctx_hi, hi_step, win_base, blk_lo, blk_len;
};

// The two key intervals [lo, hi) and [blo, bhi) that row r of group g sees (ranges.rs row_intervals).
struct RowBounds {
    int lo, hi, blo, bhi;
};

__device__ __forceinline__ RowBounds row_bounds(const RowGroup& g, int r, int window, int causal_in_block) {
    RowBounds b;
    b.hi = (int)g.ctx_hi + r * (int)g.hi_step;
    b.lo = (int)g.ctx_lo;
    if (window > 0) b.lo = max(b.lo, (int)g.win_base + r + 1 - window);
    if (b.hi < b.lo) b.hi = b.lo;
    b.blo = (int)g.blk_lo;
    int len = g.blk_len == 0 ? 0 : (causal_in_block ? min(r + 1, (int)g.blk_len) : (int)g.blk_len);
    b.bhi = b.blo + len;
    return b;
}

__device__ __forceinline__ bool sees(const RowBounds& b, int key) {
    return (key >= b.lo && key < b.hi) || (key >= b.blo && key < b.bhi);
}

// 2^x with the hardware approximation (2 ulp; exact 0 for -inf), ample for bf16 probabilities.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
}

__device__ __forceinline__ u32 lds32(const bf16* p) { return *reinterpret_cast<const u32*>(p); }

__device__ __forceinline__ void cp_async16(bf16* smem, const bf16* gmem, bool valid) {
    u32 addr = (u32)__cvta_generic_to_shared(smem);
    int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all_but_one() { asm volatile("cp.async.wait_group 1;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

// The KV tiles of TK keys a query-major CTA visits: context tiles [ct0, ct1) then block tiles
// [bt0, bt1), a tile straddling both visited once; and the context keys every valid row sees
// ([full_lo, full_hi)).
template <int TK>
struct TileWalk {
    int ct0, ct1, bt0, bt1, full_lo, full_hi;
    __device__ int count() const { return (ct1 - ct0) + (bt1 - bt0); }
    __device__ int tile(int i) const { return i < ct1 - ct0 ? ct0 + i : bt0 + (i - (ct1 - ct0)); }
    __device__ bool full(int t) const { return t < ct1 && t * TK >= full_lo && (t + 1) * TK <= full_hi; }
};

template <int TK>
__device__ TileWalk<TK> tile_walk(const RowGroup& g, int rows_valid, int window) {
    TileWalk<TK> w;
    int lo_min = (int)g.ctx_lo, lo_max = (int)g.ctx_lo;
    if (window > 0) {
        lo_min = max(lo_min, (int)g.win_base + 1 - window);
        lo_max = max(lo_max, (int)g.win_base + rows_valid - window);
    }
    int hi_min = (int)g.ctx_hi, hi_max = (int)g.ctx_hi + (rows_valid - 1) * (int)g.hi_step;
    if (hi_max > lo_min && rows_valid > 0) {
        w.ct0 = lo_min / TK;
        w.ct1 = (hi_max + TK - 1) / TK;
    } else {
        w.ct0 = w.ct1 = 0;
    }
    if (g.blk_len > 0 && rows_valid > 0) {
        w.bt0 = max((int)g.blk_lo / TK, w.ct1);
        w.bt1 = max(((int)g.blk_lo + (int)g.blk_len + TK - 1) / TK, w.bt0);
    } else {
        w.bt0 = w.bt1 = 0;
    }
    w.full_lo = lo_max;
    w.full_hi = hi_min;
    return w;
}

// This lane's two rows (fragment rows gq and gq+8 of its warp) in a query-major CTA.
struct LaneRows {
    int q[2], h[2];
    bool ok[2];
    RowBounds b[2];
};

// rho_warp: the group row of the warp's first fragment row.
__device__ LaneRows lane_rows(const RowGroup& g, int group, int R, int G, int kh, int num_queries, int window,
                              int causal_in_block, int rho_warp) {
    LaneRows lr;
    const int lane = threadIdx.x % 32;
    const int rows_valid = min(R, num_queries - group * R);
    for (int i = 0; i < 2; i++) {
        int rho = rho_warp + lane / 4 + 8 * i;
        int hh = rho / R, r = rho % R;
        lr.ok[i] = hh < G && r < rows_valid;
        lr.q[i] = group * R + r;
        lr.h[i] = kh * G + hh;
        lr.b[i] = row_bounds(g, r, window, causal_in_block);
        if (!lr.ok[i]) lr.b[i].lo = lr.b[i].hi = lr.b[i].blo = lr.b[i].bhi = 0;
    }
    return lr;
}

// A-fragments of this warp's 16 rows of x ([Q, nh, HEAD_DIM]); zero for padding rows.
__device__ __forceinline__ void load_row_frags(u32 frag[DK][4], const bf16* x, const LaneRows& lr, int nh) {
    const int tq = (threadIdx.x % 32) % 4;
#pragma unroll
    for (int kk = 0; kk < DK; kk++) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const bf16* row = x + ((size_t)lr.q[i] * nh + lr.h[i]) * HEAD_DIM + kk * 16 + 2 * tq;
            frag[kk][i] = lr.ok[i] ? lds32(row) : 0u;
            frag[kk][2 + i] = lr.ok[i] ? lds32(row + 8) : 0u;
        }
    }
}

// Masks s (scores of this lane's two rows) to -inf where the row does not see the key.
template <int TK>
__device__ __forceinline__ void mask_scores(float s[TK / 8][4], const LaneRows& lr, int key0) {
    const int tq = (threadIdx.x % 32) % 4;
#pragma unroll
    for (int nt = 0; nt < TK / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int key = key0 + nt * 8 + 2 * tq + (e & 1);
            if (!sees(lr.b[e >> 1], key)) s[nt][e] = -INFINITY;
        }
}

// The A fragment (16 rows x 16 columns, k-step kk) of fp32 accumulator tiles p rounded to bf16.
__device__ __forceinline__ void pack_a(u32 a[4], const float p[][4], int kk) {
    a[0] = pack_bf16(p[2 * kk][0], p[2 * kk][1]);
    a[1] = pack_bf16(p[2 * kk][2], p[2 * kk][3]);
    a[2] = pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    a[3] = pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3]);
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffff, x, 1);
    return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// One online-softmax step of this lane's two rows over a tile of raw scores s (masked keys at
// -inf): s becomes the probabilities exp2(s * scale_log2 - m) against the running max m (log2
// domain), which moves to the tile's max only when that exceeds it by more than
// RESCALE_SLACK_LOG2 (probabilities stay at most 2^RESCALE_SLACK_LOG2); l is rescaled to it and so
// is acc, unless no row of the warp moved its max.
template <int TK>
__device__ __forceinline__ void online_softmax(float s[TK / 8][4], float acc[DN][4], float m[2], float l[2],
                                               float scale_log2) {
    float alpha[2];
#pragma unroll
    for (int i2 = 0; i2 < 2; i2++) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < TK / 8; nt++) mx = fmaxf(mx, fmaxf(s[nt][2 * i2], s[nt][2 * i2 + 1]));
        const float mt = quad_max(mx) * scale_log2;
        const float m_new = mt > m[i2] + (float)RESCALE_SLACK_LOG2 ? mt : m[i2];
        const float base = m_new == -INFINITY ? 0.f : m_new;
        alpha[i2] = fast_exp2(m[i2] - base);
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < TK / 8; nt++) {
            s[nt][2 * i2] = fast_exp2(fmaf(s[nt][2 * i2], scale_log2, -base));
            s[nt][2 * i2 + 1] = fast_exp2(fmaf(s[nt][2 * i2 + 1], scale_log2, -base));
            sum += s[nt][2 * i2] + s[nt][2 * i2 + 1];
        }
        l[i2] = l[i2] * alpha[i2] + sum;
        m[i2] = m_new;
    }
    if (__any_sync(0xffffffff, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int nd = 0; nd < DN; nd++) {
            acc[nd][0] *= alpha[0];
            acc[nd][1] *= alpha[0];
            acc[nd][2] *= alpha[1];
            acc[nd][3] *= alpha[1];
        }
    }
}

// The forward's epilogue: out = acc / l and lse (natural log; -inf for rows that see nothing).
__device__ __forceinline__ void write_forward_rows(const float acc[DN][4], const float m[2], const float l[2],
                                                   const LaneRows& lr, bf16* out, float* lse, int num_queries, int nh,
                                                   int tq) {
#pragma unroll
    for (int i2 = 0; i2 < 2; i2++) {
        const float total = quad_sum(l[i2]);
        if (!lr.ok[i2]) continue;
        const float inv = total > 0.f ? 1.f / total : 0.f;
        bf16* orow = out + ((size_t)lr.q[i2] * nh + lr.h[i2]) * HEAD_DIM + 2 * tq;
#pragma unroll
        for (int nd = 0; nd < DN; nd++)
            *reinterpret_cast<u32*>(orow + nd * 8) = pack_bf16(acc[nd][2 * i2] * inv, acc[nd][2 * i2 + 1] * inv);
        if (tq == 0) lse[(size_t)lr.h[i2] * num_queries + lr.q[i2]] = total > 0.f ? (m[i2] + log2f(total)) / LOG2E : -INFINITY;
    }
}

// dsum[h, q] = sum_d dout[q, h, d] * out[q, h, d]. One warp per (q, h).
extern "C" __global__ void attention_backward_dsum(const bf16* __restrict__ out, const bf16* __restrict__ dout,
                                                   float* __restrict__ dsum, int num_queries, int nh) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= num_queries * nh) return;
    const int qi = row / nh, h = row % nh;
    const bf16* o = out + (size_t)row * HEAD_DIM;
    const bf16* d = dout + (size_t)row * HEAD_DIM;
    float sum = 0.f;
    for (int c = lane; c < HEAD_DIM; c += 32) sum += __bfloat162float(o[c]) * __bfloat162float(d[c]);
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, off);
    if (lane == 0) dsum[(size_t)h * num_queries + qi] = sum;
}

// p of this lane's two rows over a tile of raw scores s (keys key0..), in place:
// p = exp2(s * scale_log2 - lse2), zero where the row does not see the key.
__device__ __forceinline__ void query_major_probs(float s[TILE_K / 8][4], const LaneRows& lr, const float lse2[2],
                                                  int key0, bool full, float scale_log2) {
    const int tq = threadIdx.x % 4;
#pragma unroll
    for (int nt = 0; nt < TILE_K / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int key = key0 + nt * 8 + 2 * tq + (e & 1);
            float p = fast_exp2(s[nt][e] * scale_log2 - lse2[e >> 1]);
            if (!full && !sees(lr.b[e >> 1], key)) p = 0.f;
            s[nt][e] = p;
        }
}

// ds = p (dp - dsum) of this lane's two rows, in place of p.
__device__ __forceinline__ void query_major_ds(float p[TILE_K / 8][4], const float dp[TILE_K / 8][4],
                                               const float ds_row[2]) {
#pragma unroll
    for (int nt = 0; nt < TILE_K / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) p[nt][e] *= dp[nt][e] - ds_row[e >> 1];
}

// The dQ pass's epilogue: dq = scale * acc for this lane's two rows.
__device__ __forceinline__ void write_dq_rows(const float acc[DN][4], const LaneRows& lr, bf16* dq, int nh, float scale,
                                              int tq) {
#pragma unroll
    for (int i2 = 0; i2 < 2; i2++) {
        if (!lr.ok[i2]) continue;
        bf16* row = dq + ((size_t)lr.q[i2] * nh + lr.h[i2]) * HEAD_DIM + 2 * tq;
#pragma unroll
        for (int nd = 0; nd < DN; nd++)
            *reinterpret_cast<u32*>(row + nd * 8) = pack_bf16(acc[nd][2 * i2] * scale, acc[nd][2 * i2 + 1] * scale);
    }
}

// The key-major pass's epilogue for this lane's two keys: dk = scale * dK and dv = dV.
__device__ __forceinline__ void write_dkdv_rows(const float dK[DN][4], const float dV[DN][4], const int my_key[2],
                                                int num_keys, int nkv, int kh, bf16* dk, bf16* dv, float scale) {
    const int tq = threadIdx.x % 4;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int key = my_key[h];
        if (key >= num_keys) continue;
        const size_t at = ((size_t)key * nkv + kh) * HEAD_DIM + 2 * tq;
#pragma unroll
        for (int nd = 0; nd < DN; nd++) {
            *reinterpret_cast<u32*>(dk + at + nd * 8) = pack_bf16(dK[nd][2 * h] * scale, dK[nd][2 * h + 1] * scale);
            *reinterpret_cast<u32*>(dv + at + nd * 8) = pack_bf16(dV[nd][2 * h], dV[nd][2 * h + 1]);
        }
    }
}

#define PANELS (HEAD_DIM / 64)
typedef unsigned long long u64;

// Element offset of (row, col) in a swizzled tile of `rows` rows.
__device__ __forceinline__ int swz(int row, int col, int rows) {
    return (col >> 6) * rows * 64 + row * 64 + ((((col >> 3) & 7) ^ (row & 7)) << 3) + (col & 7);
}

__device__ __forceinline__ bf16* align_1024(unsigned char* p) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    return reinterpret_cast<bf16*>(p + ((1024 - (a & 1023)) & 1023));
}

// wgmma matrix descriptor of a 128-byte-swizzled operand at p: 8-row groups 1024 bytes apart,
// `lbo` bytes between 64-column panels (read by MN-major operands only).
__device__ __forceinline__ u64 smem_desc(const bf16* p, u32 lbo) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    return (u64)((a & 0x3FFFF) >> 4) | ((u64)((lbo >> 4) & 0x3FFF) << 16) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}

// desc moved `elems` bf16 further on in shared memory: its address field (bits 0-13, the address
// / 16) grows by elems / 8, in the low word only (shared addresses stay below 2^18: no carry), so
// the k-steps of one tile cost one add each.
__device__ __forceinline__ u64 desc_advance(u64 desc, u32 elems) {
    return (desc & 0xFFFFFFFF00000000ull) | (u32)((u32)desc + (elems >> 3));
}

// K-major operand: tile rows as M (or N), the head dim as K; k-step kk = columns 16kk..16kk+15.
__device__ __forceinline__ u64 desc_kmajor(const bf16* tile, int rows, int kk) {
    return desc_advance(smem_desc(tile, 0), (kk >> 2) * rows * 64 + (kk & 3) * 16);
}

// MN-major operand: tile rows as K (k-step kk = rows 16kk..16kk+15), head-dim panel p as N.
__device__ __forceinline__ u64 desc_mnmajor(const bf16* tile, int rows, int kk, int p) {
    return desc_advance(smem_desc(tile, rows * 128), p * rows * 64 + kk * 16 * 64);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void wg_commit_wait() {
    wg_commit();
    wg_wait<0>();
}
// Makes this thread's generic-proxy shared writes (cp.async) visible to wgmma's async proxy.
__device__ __forceinline__ void fence_async_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d (64 x 64) = A (64 x 16, K-major at a) . B (16 x 64, K-major at b: [n][k] rows), plus d when
// `accumulate` (else d's old values are ignored).
__device__ __forceinline__ void wgmma_ss(float d[8][4], u64 a, u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
                 : "l"(a), "l"(b), "r"(accumulate));
}

// d (64 x 64) += A (64 x 16, this warp's 16 rows in registers) . B (16 x 64, MN-major at b).
__device__ __forceinline__ void wgmma_rs(float d[8][4], const u32 a[4], u64 b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d (64 x 128) += A (64 x 16, this warp's 16 rows in registers) . B (16 x 128, MN-major at b: two
// 64-column panels, b's leading byte offset apart), d the two 64-column accumulators in a row.
__device__ __forceinline__ void wgmma_rs_n128(float d[16][4], const u32 a[4], u64 b) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d (64 x 64) = A (64 x 16, this warp's 16 rows in registers) . B (16 x 64, K-major at b: [n][k]
// rows), plus d when `accumulate`.
__device__ __forceinline__ void wgmma_rs_kmajor(float d[8][4], const u32 a[4], u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

// d (64 x 128) = A (64 x 16, this warp's 16 rows in registers) . B (16 x 128, K-major at b: [n][k]
// rows), plus d when `accumulate`.
__device__ __forceinline__ void wgmma_rs_kmajor_n128(float d[16][4], const u32 a[4], u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

// d (64 x 64) = A . B^T over the head dim, A and B K-major [64][HEAD_DIM] swizzled tiles (d's
// old values are ignored).
__device__ __forceinline__ void tile_times_tile_t(float d[8][4], const bf16* a, const bf16* b) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; kk++) wgmma_ss(d, desc_kmajor(a, 64, kk), desc_kmajor(b, 64, kk), kk > 0);
}

// d (64 rows x TK keys, TK 64 or 128) = A . tile^T over the head dim, A in registers
// (load_row_frags), the tile a K-major [TK][HEAD_DIM] swizzled tile (d's old values are ignored).
template <int TK>
__device__ __forceinline__ void frags_times_tile_t(float d[TK / 8][4], const u32 a[DK][4], const bf16* tile) {
#pragma unroll
    for (int kk = 0; kk < DK; kk++) {
        if constexpr (TK == 128) wgmma_rs_kmajor_n128(d, a[kk], desc_kmajor(tile, TK, kk), kk > 0);
        else wgmma_rs_kmajor(d, a[kk], desc_kmajor(tile, TK, kk), kk > 0);
    }
}

// acc (64 x HEAD_DIM) += A (64 x 16, k-step kk, in registers) . tile rows 16kk..16kk+15: one
// wgmma over both panels at head dim 128 (half the instructions and descriptors), one a panel
// otherwise (at 192 and 256 the wide accumulators cost registers ptxas does not have).
template <int ROWS>
__device__ __forceinline__ void frag_times_tile_rows(float acc[DN][4], const u32 a[4], const bf16* tile, int kk) {
#if HEAD_DIM == 128
    wgmma_rs_n128(acc, a, desc_mnmajor(tile, ROWS, kk, 0));
#else
#pragma unroll
    for (int pn = 0; pn < PANELS; pn++) wgmma_rs(acc + 8 * pn, a, desc_mnmajor(tile, ROWS, kk, pn));
#endif
}

// acc (64 x HEAD_DIM) += P (64 x ROWS in accumulator layout, rounded to bf16) . tile (ROWS x HEAD_DIM).
template <int ROWS = 64>
__device__ __forceinline__ void regs_times_tile(float acc[DN][4], const float p[ROWS / 8][4], const bf16* tile) {
#pragma unroll
    for (int kk = 0; kk < ROWS / 16; kk++) {
        u32 a[4];
        pack_a(a, p, kk);
        frag_times_tile_rows<ROWS>(acc, a, tile, kk);
    }
}

// acc (64 x HEAD_DIM) += P (64 x ROWS, its k-steps' A fragments pa, pack_a) . tile (ROWS x HEAD_DIM).
template <int ROWS>
__device__ __forceinline__ void frags_times_tile(float acc[DN][4], const u32 pa[ROWS / 16][4], const bf16* tile) {
#pragma unroll
    for (int kk = 0; kk < ROWS / 16; kk++) frag_times_tile_rows<ROWS>(acc, pa[kk], tile, kk);
}

// Row rho of a group as (head hh, row r), rho = hh * R + r, through a float reciprocal of R:
// exact for rho < 2^20 (the product stays within 0.5 / R of hh + (r + 0.5) / R).
__device__ __forceinline__ void split_row(int rho, int R, float inv_R, int& hh, int& r) {
    hh = __float2int_rz(((float)rho + 0.5f) * inv_R);
    r = rho - hh * R;
}

// Starts loading KV tile t (keys TK t..TK t + TK - 1; zero past num_keys) of k and v, KV head kh,
// into swizzled [TK][HEAD_DIM] tiles; the CTA's THREADS threads.
template <int THREADS, int TK = TILE_K>
__device__ __forceinline__ void load_kv_tiles_async(bf16* tK, bf16* tV, const bf16* k, const bf16* v, int t,
                                                    int num_keys, int nkv, int kh) {
    constexpr int CPR = HEAD_DIM / 8;    // 16-byte chunks per row
    constexpr int RPP = THREADS / CPR;   // rows one pass of the threads covers
    const int tid = threadIdx.x % THREADS, col = (tid % CPR) * 8;
    // The chunk of a key row at global offset `at` (`valid`: else zeros) into tile offset `to`.
    auto load = [&](int to, size_t at, bool valid) {
        cp_async16(tK + to, k + at, valid);
        cp_async16(tV + to, v + at, valid);
    };
    if (THREADS % CPR == 0 && RPP % 8 == 0) {
        // A thread's rows are RPP apart, a multiple of 8: the same swizzle phase, so one address
        // of each kind, then strides (half the instructions of the general loop below).
        const int row0 = tid / CPR, key0 = t * TK + row0;
        const size_t step = (size_t)RPP * nkv * HEAD_DIM;
        const int to = swz(row0, col, TK);
        size_t at = ((size_t)key0 * nkv + kh) * HEAD_DIM + col;
#pragma unroll
        for (int j = 0; j < TK / RPP; j++, at += step) {
            const bool valid = key0 + j * RPP < num_keys;
            load(to + j * RPP * 64, valid ? at : 0, valid);
        }
        return;
    }
#pragma unroll
    for (int row = tid / CPR; row < TK; row += RPP) {
        const int key = t * TK + row;
        const bool valid = key < num_keys;
        load(swz(row, col, TK), ((size_t)(valid ? key : 0) * nkv + kh) * HEAD_DIM + col, valid);
    }
}

// Waits for this thread's cp.async groups but the newest `pending` (0 or 1), then makes every
// thread's landed tiles visible to wgmma.
__device__ __forceinline__ void land_tiles(int pending) {
    if (pending) cp_async_wait_all_but_one();
    else cp_async_wait_all();
    fence_async_proxy();
    __syncthreads();
}

template <int TK>
__device__ __forceinline__ bool visits(const TileWalk<TK>& w, int t) {
    return (t >= w.ct0 && t < w.ct1) || (t >= w.bt0 && t < w.bt1);
}

// The walk over the union of two walks' tiles (each tile once).
template <int TK>
__device__ TileWalk<TK> walk_union(TileWalk<TK> a, const TileWalk<TK>& b) {
    if (b.ct1 > b.ct0) {
        if (a.ct1 > a.ct0) {
            a.ct0 = min(a.ct0, b.ct0);
            a.ct1 = max(a.ct1, b.ct1);
        } else {
            a.ct0 = b.ct0;
            a.ct1 = b.ct1;
        }
    }
    if (b.bt1 > b.bt0) {
        if (a.bt1 > a.bt0) {
            a.bt0 = min(a.bt0, b.bt0);
            a.bt1 = max(a.bt1, b.bt1);
        } else {
            a.bt0 = b.bt0;
            a.bt1 = b.bt1;
        }
    }
    a.bt0 = max(a.bt0, a.ct1);
    a.bt1 = max(a.bt1, a.bt0);
    return a;
}

// KV_STAGES (3) K/V stages of the query-major kernels: tile i loads into stage (i + 1) % 3 while
// tile i is computed; that stage last held tile i - 2, which every thread finished before passing
// tile i - 1's landing barrier: one barrier per tile, and warpgroups may drift apart by a tile.
// (Ping-pong, PINGPONG below: tile i + 1 loads after tile i's barrier instead, walk_kv_tiles.)

// A CTA of the query-major kernels: a group of R * G rows takes ceil(R * G / 64) (at most
// two) warpgroups, and a CTA computes with two warpgroups: one or two groups, which share each
// K/V tile (the warp-specialised forward's third warpgroup only loads). Grid (nkv, ceil(groups / groups per CTA)), CTAs launched last-first (later
// groups see more).
template <int TK>
struct WgRows {
    int group, row0;        // this warpgroup's group and its first row in the group
    TileWalk<TK> own, all;  // the tiles its group visits; the tiles the CTA visits
};

template <int TK>
__device__ WgRows<TK> wg_rows(const RowGroup* groups, int R, int G, int num_queries, int window) {
    const int wpg = (R * G + WG_ROWS - 1) / WG_ROWS, gpc = 2 / wpg;
    const int num_groups = (num_queries + R - 1) / R, first = (gridDim.y - 1 - blockIdx.y) * gpc;
    const int wg = threadIdx.x / 128;
    WgRows<TK> w;
    w.group = first + wg / wpg;
    w.row0 = (wg % wpg) * WG_ROWS;
    TileWalk<TK> none;
    none.ct0 = none.ct1 = none.bt0 = none.bt1 = none.full_lo = none.full_hi = 0;
    w.own = w.all = none;
    for (int j = first; j < min(first + gpc, num_groups); j++) {
        const TileWalk<TK> tw = tile_walk<TK>(groups[j], min(R, num_queries - j * R), window);
        if (j == w.group) w.own = tw;
        w.all = walk_union(w.all, tw);
    }
    return w;
}

// This lane's two rows in warpgroup rows w (a row group's rows, or none past the last group).
template <int TK>
__device__ __forceinline__ LaneRows wg_lane_rows(const RowGroup* groups, const WgRows<TK>& w, int R, int G, int kh,
                                                 int num_queries, int window, int causal_in_block) {
    const RowGroup g = groups[w.group < (num_queries + R - 1) / R ? w.group : 0];
    return lane_rows(g, w.group, R, G, kh, num_queries, window, causal_in_block, w.row0 + (threadIdx.x / 32) % 4 * 16);
}

// Starts loading walk tile i (of n; nothing past the last) into K/V stage i % KV_STAGES, as one
// cp.async group.
template <int TK>
__device__ __forceinline__ void kv_ring_load(bf16* sK, bf16* sV, const TileWalk<TK>& walk, int i, int n, const bf16* k,
                                             const bf16* v, int num_keys, int nkv, int kh) {
    if (i >= n) return;
    const int stage = i % KV_STAGES;
    load_kv_tiles_async<256, TK>(sK + stage * TK * HEAD_DIM, sV + stage * TK * HEAD_DIM, k, v, walk.tile(i),
                             num_keys, nkv, kh);
    cp_async_commit();
}

// Up to head dim 128 the dQ pass runs its odd warpgroups half a tile behind the even ones
// (ping-pong; the forward is warp-specialised there): each of their tiles' last product (dS.K)
// waits for the next tile's landing barrier, where it runs while the even warpgroup's first
// products of that tile run, and their first products run during the even one's softmax; the
// ring still holds a tile one tile later (walk_kv_tiles' LATE). The same products in the same
// order. Above 128 the deferred fragments cost registers ptxas does not have (it serialises the
// wgmma, note C7512).
#define PINGPONG (HEAD_DIM <= 128)

// Whether this warpgroup runs behind. Read through a shuffle from lane 0, which ptxas knows is
// warp-uniform: a branch on a thread index around wgmma serialises every wgmma of the kernel
// (ptxas note C7519).
__device__ __forceinline__ bool runs_behind() {
    return PINGPONG && __shfl_sync(0xffffffffu, (int)(threadIdx.x / 128) % 2, 0) == 1;
}

// A tile's last product deferred into the next tile's step: acc += p . tile (TK keys), p kept as
// its TK / 16 k-steps' bf16 A fragments.
template <int TK>
struct DeferredProduct {
    u32 pa[TK / 16][4];
    const bf16* tile = nullptr;

    __device__ __forceinline__ void defer(const float p[TK / 8][4], const bf16* t) {
#pragma unroll
        for (int kk = 0; kk < TK / 16; kk++) pack_a(pa[kk], p, kk);
        tile = t;
    }

    // A tile's last product acc += p . t: deferred when this warpgroup runs behind, else run now.
    __device__ __forceinline__ void last_product(bool behind, float acc[DN][4], const float p[TK / 8][4], const bf16* t) {
        if (behind) {
            defer(p, t);
        } else {
            wg_fence();
            regs_times_tile<TK>(acc, p, t);
            wg_commit_wait();
        }
    }

    // Runs the deferred product, if any, into acc.
    __device__ __forceinline__ void run(float acc[DN][4]) {
        if (!tile) return;
        wg_fence();
        frags_times_tile<TK>(acc, pa, tile);
        wg_commit_wait();
        tile = nullptr;
    }
};

// Walks the CTA's K/V tiles through the stage ring: body(t, own, tK, tV) for every tile t of the
// CTA's walk once it has landed for the whole CTA (own: this warpgroup's walk visits it, uniform
// across the warpgroup); then waits for every load. With LATE (a body reads tile i - 1's K or V
// during tile i), tile i + 1 starts loading after tile i's landing barrier instead of before it:
// its stage last held tile i - 2, which every thread finished before that barrier.
template <int TK, bool LATE, typename Body>
__device__ __forceinline__ void walk_kv_tiles(const WgRows<TK>& w, bf16* sK, bf16* sV, const bf16* k, const bf16* v,
                                              int num_keys, int nkv, int kh, Body body) {
    const int n = w.all.count();
    kv_ring_load(sK, sV, w.all, 0, n, k, v, num_keys, nkv, kh);
    for (int i = 0; i < n; i++) {
        const int t = w.all.tile(i);
        if (LATE) {
            land_tiles(0);
            kv_ring_load(sK, sV, w.all, i + 1, n, k, v, num_keys, nkv, kh);
        } else {
            kv_ring_load(sK, sV, w.all, i + 1, n, k, v, num_keys, nkv, kh);
            land_tiles(i + 1 < n);
        }
        body(t, visits(w.own, t), sK + (i % KV_STAGES) * TK * HEAD_DIM, sV + (i % KV_STAGES) * TK * HEAD_DIM);
    }
    cp_async_wait_all();
}

// mbarrier helpers (shared::cta): init with an arrival count, arrive (release), wait on a phase
// parity (acquire).
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"((u32)__cvta_generic_to_shared(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"((u32)__cvta_generic_to_shared(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
    const u32 a = (u32)__cvta_generic_to_shared(bar);
    u32 done = 0;
    while (!done) {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(a), "r"(parity)
                     : "memory");
    }
}

// One KV tile of the forward for a warpgroup whose walk visits it: scores s = q k^T (TK keys),
// the mask where the tile is not fully allowed, the online softmax, then acc += p v.
template <int TK>
__device__ __forceinline__ void forward_tile(float acc[DN][4], float m[2], float l[2], const u32 qa[DK][4],
                                             const LaneRows& lr, bool full, int t, const bf16* tK, const bf16* tV,
                                             float scale_log2) {
    float s[TK / 8][4];
    wg_fence();
    frags_times_tile_t<TK>(s, qa, tK);
    wg_commit_wait();
    if (!full) mask_scores<TK>(s, lr, t * TK);
    online_softmax<TK>(s, acc, m, l, scale_log2);
    wg_fence();
    regs_times_tile<TK>(acc, s, tV);
    wg_commit_wait();
}

// Forward: out and lse (natural log) of every row. FORWARD_THREADS 384 (head dim up to 128):
// warp-specialised, warpgroup 2 (threads 256..383, 24 registers) loads the CTA's K/V tiles into
// the KV_STAGES ring and marks each landed (full[stage], 128 arrivals); warpgroups 0 and 1 (240
// registers) compute on their own time and release each stage once their last product on it has
// retired (empty[stage], 256 arrivals), no CTA barrier per tile. setmaxnreg moves registers
// within the CTA's allocation (384 x 168): 2 x 240 + 24 = 3 x 168 exactly; a larger producer
// share leaves the consumers' increase waiting forever (a first try with 32 hung on the device).
// FORWARD_THREADS 256: the two computing warpgroups load the ring themselves (walk_kv_tiles).
extern "C" __global__ void __launch_bounds__(FORWARD_THREADS, 1) attention_forward(
    const RowGroup* __restrict__ groups, int group_rows, int num_queries, int num_keys, int window, int causal_in_block,
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, bf16* __restrict__ out,
    float* __restrict__ lse, int nh, int nkv, float scale) {
    extern __shared__ __align__(1024) unsigned char smem[];
    constexpr int TK = FORWARD_TILE_K;
    bf16* sK = align_1024(smem);                // [KV_STAGES][TK][HEAD_DIM]
    bf16* sV = sK + KV_STAGES * TK * HEAD_DIM;  // [KV_STAGES][TK][HEAD_DIM]
    const int kh = blockIdx.x;
#if FORWARD_THREADS == 384
    u64* full = reinterpret_cast<u64*>(sV + KV_STAGES * TK * HEAD_DIM);  // [KV_STAGES]
    u64* empty = full + KV_STAGES;                                       // [KV_STAGES]
    if (threadIdx.x == 0) {
        for (int st = 0; st < KV_STAGES; st++) {
            mbar_init(full + st, 128);
            mbar_init(empty + st, 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
#endif
    const WgRows<TK> w = wg_rows<TK>(groups, group_rows, nh / nkv, num_queries, window);
#if FORWARD_THREADS == 384
    const int n = w.all.count();
    if (__shfl_sync(0xffffffffu, (int)threadIdx.x / 128, 0) == 2) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
        for (int i = 0; i < n; i++) {
            const int st = i % KV_STAGES;
            if (i >= KV_STAGES) mbar_wait(empty + st, (i / KV_STAGES - 1) & 1);
            load_kv_tiles_async<128, TK>(sK + st * TK * HEAD_DIM, sV + st * TK * HEAD_DIM, k, v, w.all.tile(i),
                                         num_keys, nkv, kh);
            cp_async_commit();
            if (i > 0) {
                cp_async_wait_all_but_one();
                fence_async_proxy();
                mbar_arrive(full + (i - 1) % KV_STAGES);
            }
        }
        if (n > 0) {
            cp_async_wait_all();
            fence_async_proxy();
            mbar_arrive(full + (n - 1) % KV_STAGES);
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");
#endif
    const int tq = threadIdx.x % 4;
    const LaneRows lr = wg_lane_rows(groups, w, group_rows, nh / nkv, kh, num_queries, window, causal_in_block);
    const float scale_log2 = scale * LOG2E;
    u32 qa[DK][4];
    load_row_frags(qa, q, lr, nh);

    float acc[DN][4];
#pragma unroll
    for (int nd = 0; nd < DN; nd++) acc[nd][0] = acc[nd][1] = acc[nd][2] = acc[nd][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

#if FORWARD_THREADS == 384
    for (int i = 0; i < n; i++) {
        const int t = w.all.tile(i), st = i % KV_STAGES;
        mbar_wait(full + st, (i / KV_STAGES) & 1);
        if (visits(w.own, t))
            forward_tile<TK>(acc, m, l, qa, lr, w.own.full(t), t, sK + st * TK * HEAD_DIM, sV + st * TK * HEAD_DIM,
                             scale_log2);
        mbar_arrive(empty + st);
    }
#else
    walk_kv_tiles<TK, false>(w, sK, sV, k, v, num_keys, nkv, kh, [&](int t, bool own, const bf16* tK, const bf16* tV) {
        if (own) forward_tile<TK>(acc, m, l, qa, lr, w.own.full(t), t, tK, tV, scale_log2);
    });
#endif
    write_forward_rows(acc, m, l, lr, out, lse, num_queries, nh, tq);
}

// dQ, query-major like the forward: dq = scale * sum_k ds k, ds = p (dp - dsum), dp = dout . v.
extern "C" __global__ void __launch_bounds__(256) attention_backward_dq(
    const RowGroup* __restrict__ groups, int group_rows, int num_queries, int num_keys, int window, int causal_in_block,
    const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v, const bf16* __restrict__ dout,
    const float* __restrict__ lse, const float* __restrict__ dsum, bf16* __restrict__ dq, int nh, int nkv, float scale) {
    extern __shared__ __align__(1024) unsigned char smem[];
    bf16* sK = align_1024(smem);                    // [KV_STAGES][TILE_K][HEAD_DIM]
    bf16* sV = sK + KV_STAGES * TILE_K * HEAD_DIM;  // [KV_STAGES][TILE_K][HEAD_DIM]
    const int kh = blockIdx.x, tq = threadIdx.x % 4;
    const WgRows<TILE_K> w = wg_rows<TILE_K>(groups, group_rows, nh / nkv, num_queries, window);
    const LaneRows lr = wg_lane_rows(groups, w, group_rows, nh / nkv, kh, num_queries, window, causal_in_block);
    const float scale_log2 = scale * LOG2E;
    u32 qa[DK][4], da[DK][4];
    load_row_frags(qa, q, lr, nh);
    load_row_frags(da, dout, lr, nh);
    float lse2[2], ds_row[2];
    for (int i = 0; i < 2; i++) {
        const size_t at = (size_t)lr.h[i] * num_queries + lr.q[i];
        lse2[i] = lr.ok[i] ? lse[at] * LOG2E : INFINITY;
        ds_row[i] = lr.ok[i] ? dsum[at] : 0.f;
    }
    float acc[DN][4];
#pragma unroll
    for (int nd = 0; nd < DN; nd++) acc[nd][0] = acc[nd][1] = acc[nd][2] = acc[nd][3] = 0.f;

    const bool behind = runs_behind();
    DeferredProduct<TILE_K> deferred;
    walk_kv_tiles<TILE_K, PINGPONG>(w, sK, sV, k, v, num_keys, nkv, kh, [&](int t, bool own, const bf16* tK, const bf16* tV) {
        deferred.run(acc);
        if (!own) return;
        float s[TILE_K / 8][4], dp[TILE_K / 8][4];
        wg_fence();
        frags_times_tile_t<TILE_K>(s, qa, tK);
        wg_commit();
        frags_times_tile_t<TILE_K>(dp, da, tV);
        wg_commit();
        wg_wait<1>();  // s; p is computed while dp's matmul runs
        query_major_probs(s, lr, lse2, t * TILE_K, w.own.full(t), scale_log2);
        wg_wait<0>();
        query_major_ds(s, dp, ds_row);
        deferred.last_product(behind, acc, s, tK);
    });
    deferred.run(acc);
    write_dq_rows(acc, lr, dq, nh, scale, tq);
}

// One staged chunk of the key-major pass, all loaded with cp.async (no blocking global load
// per chunk): swizzled q and dout tiles [DKDV_CHUNK][HEAD_DIM], lse (natural log) and dsum of
// the rows (zero for padding rows), and the chunk's RowGroup; stages of DKDV_STAGE_BYTES, 1024-byte
// aligned.
struct ChunkStage {
    bf16* q;
    bf16* dout;
    float* lse;
    float* dsum;
    RowGroup* g;
};

__device__ __forceinline__ ChunkStage chunk_stage(unsigned char* base) {
    ChunkStage c;
    c.q = reinterpret_cast<bf16*>(base);
    c.dout = c.q + DKDV_CHUNK * HEAD_DIM;
    c.lse = reinterpret_cast<float*>(c.dout + DKDV_CHUNK * HEAD_DIM);
    c.dsum = c.lse + DKDV_CHUNK;
    c.g = reinterpret_cast<RowGroup*>(c.dsum + DKDV_CHUNK);
    return c;
}

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
    u32 addr = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(addr), "l"(gmem), "r"(valid ? 4 : 0));
}

// Starts loading rows c0..c0+DKDV_CHUNK-1 of `group` (row rho: query group*R + r, head kh*G + hh) of
// q and dout into a stage, with their lse and dsum (zero for padding rows) and the group's
// RowGroup; the CTA's 128 threads.
__device__ __forceinline__ void load_chunk_async(const ChunkStage& st, const RowGroup* groups, int group, int c0,
                                                    int R, float inv_R, int G, int kh, int num_queries, const bf16* q,
                                                    const bf16* dout, const float* lse, const float* dsum, int nh) {
    constexpr int CPR = HEAD_DIM / 8;  // 16-byte chunks per row
    constexpr int RPP = 128 / CPR;     // rows one pass of the threads covers
    const int tid = threadIdx.x, col = (tid % CPR) * 8;
    const int rows_valid = min(R, num_queries - group * R);
    const size_t group_at = (size_t)group * R * nh * HEAD_DIM + col;
    if (128 % CPR == 0 && RPP % 8 == 0 && R >= RPP) {
        // A thread's rows are RPP apart (the same swizzle phase): its (head, row) steps by RPP
        // rows, wrapping at most once into the next head, instead of a division each.
        const int rr0 = tid / CPR, to = swz(rr0, col, DKDV_CHUNK);
        int hh, r;
        split_row(c0 + rr0, R, inv_R, hh, r);
#pragma unroll
        for (int j = 0; j < DKDV_CHUNK / RPP; j++) {
            const bool ok = hh < G && r < rows_valid;
            const size_t at = ok ? group_at + (size_t)((r * nh + kh * G + hh) * HEAD_DIM) : 0;
            cp_async16(st.q + to + j * RPP * 64, q + at, ok);
            cp_async16(st.dout + to + j * RPP * 64, dout + at, ok);
            r += RPP;
            if (r >= R) {
                r -= R;
                hh++;
            }
        }
    } else {
#pragma unroll
        for (int rr = tid / CPR; rr < DKDV_CHUNK; rr += RPP) {
            int hh, r;
            split_row(c0 + rr, R, inv_R, hh, r);
            const bool ok = hh < G && r < rows_valid;
            const size_t at = ok ? group_at + (size_t)((r * nh + kh * G + hh) * HEAD_DIM) : 0;
            const int to = swz(rr, col, DKDV_CHUNK);
            cp_async16(st.q + to, q + at, ok);
            cp_async16(st.dout + to, dout + at, ok);
        }
    }
    if (tid < DKDV_CHUNK) {
        int hh, r;
        split_row(c0 + tid, R, inv_R, hh, r);
        const bool ok = hh < G && r < rows_valid;
        const size_t at = ok ? (size_t)(kh * G + hh) * num_queries + group * R + r : 0;
        cp_async4(st.lse + tid, lse + at, ok);
        cp_async4(st.dsum + tid, dsum + at, ok);
    } else if (tid < DKDV_CHUNK + 6) {
        cp_async4(reinterpret_cast<u32*>(st.g) + (tid - DKDV_CHUNK), reinterpret_cast<const u32*>(groups + group) + (tid - DKDV_CHUNK), true);
    }
}

// p^T of this lane's two keys over a staged chunk (rows c0.. of a group seen through g), from raw
// scores s^T, in place: p = exp2(s * scale_log2 - lse * log2 e); unless `full` (every row valid
// and seeing the whole tile), zero where the row is padding or does not see the key.
__device__ __forceinline__ void key_major_probs(float sT[DKDV_CHUNK / 8][4], const ChunkStage& st, const RowGroup& g,
                                                   int c0, int rows_valid, int R, float inv_R, int G, int window,
                                                   int causal_in_block, const int my_key[2], bool full,
                                                   float scale_log2) {
    const int tq = threadIdx.x % 4;
#pragma unroll
    for (int nt = 0; nt < DKDV_CHUNK / 8; nt++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            const int rr = nt * 8 + 2 * tq + c;
            const float lse2 = st.lse[rr] * LOG2E;
            bool seen[2] = {true, true};
            if (!full) {
                int hh, r;
                split_row(c0 + rr, R, inv_R, hh, r);
                const RowBounds b = row_bounds(g, r, window, causal_in_block);
                const bool ok = hh < G && r < rows_valid;
                seen[0] = ok && sees(b, my_key[0]);
                seen[1] = ok && sees(b, my_key[1]);
            }
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float p = fast_exp2(fmaf(sT[nt][2 * h + c], scale_log2, -lse2));
                sT[nt][2 * h + c] = seen[h] ? p : 0.f;
            }
        }
}

// ds^T = p^T (dp^T - dsum) over a staged chunk, in place of dp^T.
__device__ __forceinline__ void key_major_ds(float dpT[DKDV_CHUNK / 8][4], const float pT[DKDV_CHUNK / 8][4],
                                                const ChunkStage& st) {
    const int tq = threadIdx.x % 4;
#pragma unroll
    for (int nt = 0; nt < DKDV_CHUNK / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) dpT[nt][e] = pT[nt][e] * (dpT[nt][e] - st.dsum[nt * 8 + 2 * tq + (e & 1)]);
}

// dK, dV, key-major: a CTA (one warpgroup, 128 threads; warp w keys 16w..16w+15) owns one KV
// tile of TILE_K keys of one KV head and walks the row groups that may see it (kv_ranges[tile]),
// DKDV_CHUNK rows at a time, the next chunk loading while this one computes: dv += p^T dout,
// dk += scale * ds^T q. Grid (nkv, kv tiles): the early context tiles, seen by the most groups,
// start first. Two independent CTAs per SM overlap each other's matmuls and element-wise work
// (one CTA of two warpgroups, in lock-step on shared chunks, measured 45% slower).
extern "C" __global__ void __launch_bounds__(128) attention_backward_dkdv(
    const RowGroup* __restrict__ groups, const u32* __restrict__ kv_ranges, int group_rows, int num_queries,
    int num_keys, int window, int causal_in_block, const bf16* __restrict__ q, const bf16* __restrict__ k,
    const bf16* __restrict__ v, const bf16* __restrict__ dout, const float* __restrict__ lse,
    const float* __restrict__ dsum, bf16* __restrict__ dk, bf16* __restrict__ dv, int nh, int nkv, float scale) {
    extern __shared__ __align__(1024) unsigned char smem[];
    bf16* sK = align_1024(smem);           // [TILE_K][HEAD_DIM]
    bf16* sV = sK + TILE_K * HEAD_DIM;     // [TILE_K][HEAD_DIM]
    unsigned char* stages = reinterpret_cast<unsigned char*>(sV + TILE_K * HEAD_DIM);  // [2 stages]
    const int tile = blockIdx.y, kh = blockIdx.x, G = nh / nkv, R = group_rows;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane / 4;
    const float scale_log2 = scale * LOG2E, inv_R = 1.f / (float)R;

    load_kv_tiles_async<128>(sK, sV, k, v, tile, num_keys, nkv, kh);

    float dK[DN][4], dV[DN][4];
#pragma unroll
    for (int nd = 0; nd < DN; nd++)
#pragma unroll
        for (int e = 0; e < 4; e++) dK[nd][e] = dV[nd][e] = 0.f;

    const int g_first = (int)kv_ranges[2 * tile], g_end = (int)kv_ranges[2 * tile + 1];
    const int chunks = (R * G + DKDV_CHUNK - 1) / DKDV_CHUNK;
    const int items = (g_end - g_first) * chunks;
    const int my_key[2] = {tile * TILE_K + warp * 16 + gq, tile * TILE_K + warp * 16 + gq + 8};
    if (items > 0) {
        load_chunk_async(chunk_stage(stages), groups, g_first, 0, R, inv_R, G, kh,
                            num_queries, q, dout, lse, dsum, nh);
    }
    cp_async_commit();
    for (int i = 0; i < items; i++) {
        const int group = g_first + i / chunks, c0 = (i % chunks) * DKDV_CHUNK;
        if (i + 1 < items) {
            load_chunk_async(chunk_stage(stages + ((i + 1) & 1) * DKDV_STAGE_BYTES), groups,
                                g_first + (i + 1) / chunks, ((i + 1) % chunks) * DKDV_CHUNK, R, inv_R, G, kh, num_queries, q, dout,
                                lse, dsum, nh);
            cp_async_commit();
        }
        land_tiles(i + 1 < items);
        const ChunkStage st = chunk_stage(stages + (i & 1) * DKDV_STAGE_BYTES);
        const RowGroup g = *st.g;
        const int rows_valid = min(R, num_queries - group * R);
        const bool full = tile_walk<TILE_K>(g, rows_valid, window).full(tile) && rows_valid == R && c0 + DKDV_CHUNK <= R * G;
        float sT[DKDV_CHUNK / 8][4], dpT[DKDV_CHUNK / 8][4];
        wg_fence();
        tile_times_tile_t(sT, sK, st.q);
        wg_commit();
        tile_times_tile_t(dpT, sV, st.dout);
        wg_commit();
        wg_wait<1>();  // s^T; p is computed while dp^T's matmul runs
        key_major_probs(sT, st, g, c0, rows_valid, R, inv_R, G, window, causal_in_block, my_key, full, scale_log2);
        wg_fence();
        regs_times_tile(dV, sT, st.dout);
        wg_commit();
        wg_wait<1>();  // dp^T; ds is computed while dV's matmul runs
        key_major_ds(dpT, sT, st);
        wg_fence();
        regs_times_tile(dK, dpT, st.q);
        wg_commit_wait();
        __syncthreads();
    }
    cp_async_wait_all();
    write_dkdv_rows(dK, dV, my_key, num_keys, nkv, kh, dk, dv, scale);
}

