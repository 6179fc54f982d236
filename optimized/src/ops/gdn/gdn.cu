// GatedDeltaNet kernels of the hybrid target's forward (optimized/src/model/hybrid_forward.rs, spec
// section 10): bf16 stored values; fp32 gates, state, chunk scratch and accumulation; the chunk's
// matrix products on the tensor cores (mma.sync m16n8k16, bf16 operands, fp32 accumulators). Their
// CPU twins are optimized/src/ops/gdn/twin.rs (GdnTwin), by the same names; `gated_delta` is the
// three kernels `gated_delta_prepare` (chunks in parallel: W and U), `gated_delta_state` (the state
// carried through the chunks: each chunk's entering state, Delta) and `gated_delta_output` (chunks
// in parallel: O). `xtask gpu-conformance` checks each against its twin on the H200. The GDN_*
// constants come from the host's prelude (optimized/src/ops/constants.rs).
//
// Segments (documents and padding runs tiling 0..T, each restarting the conv window and the
// state) come as the host's segment table (ops/gdn/mod.rs `segment_table`, u32): per token the
// start of its segment [T], then each chunk of GDN_CHUNK tokens from its segment's start as
// (begin, end, starts its segment) triples. A delta-rule launch runs the chunks chunk0..chunk0+count of the table (a
// group: at most `slots`). Its scratch (ops/gdn/mod.rs `DeltaScratch`), per value head: W
// [T, d_k] (bf16), U and then Delta [T, d_v] (fp32), the states entering the group's chunks
// [slots, d_k, d_v] (bf16) and the carried state [d_k, d_v] (fp32).
//
// Shared tiles are row-major with GDN_PAD extra bf16 columns (rows 16 bytes apart, 32-bit fragment
// loads free of bank conflicts), filled by cp.async where no conversion is needed. Chunk rows from
// n on (a chunk's end) are zero.

#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;
typedef unsigned int u32;

#define WARP 32
#define FULL 0xffffffffu

__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 to_bf(float x) { return __float2bfloat16_rn(x); }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o /= 2) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

// ---- mma.sync m16n8k16 (row.col, bf16 x bf16 -> fp32) and its fragments --------------------------
// A [16 x 16]: a[0] (row g, cols 2q, 2q+1), a[1] (row g+8), a[2] (row g, cols +8), a[3] (row g+8,
// cols +8); B [16 x 8]: b[0] (rows 2q, 2q+1, col g), b[1] (rows +8); C [16 x 8]: c[0], c[1] (row g,
// cols 2q, 2q+1), c[2], c[3] (row g+8); g = lane / 4, q = lane % 4. A pair's lower index is the
// lower half of its register.

struct Lane {
    int g, q;
    __device__ Lane() : g((threadIdx.x & 31) >> 2), q(threadIdx.x & 3) {}
};

__device__ __forceinline__ u32 pack_pair(bf16 lo, bf16 hi) {
    __nv_bfloat162 v;
    v.x = lo;
    v.y = hi;
    return *reinterpret_cast<u32*>(&v);
}

__device__ __forceinline__ u32 lds32(const bf16* p) { return *reinterpret_cast<const u32*>(p); }

// Asynchronous copies global -> shared of 16 and 4 bytes, zero-filled when not `valid` (the
// source address must still be mapped).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const u32 addr = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
    const u32 addr = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(addr), "l"(gmem), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void mma(float d[4], const u32 a[4], const u32 b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// A at (row0, k0) of m [rows][ld] (k contiguous).
__device__ __forceinline__ void frag_a(u32 a[4], const bf16* m, int ld, int row0, int k0) {
    const Lane l;
    const bf16* p = m + (row0 + l.g) * ld + k0 + 2 * l.q;
    a[0] = lds32(p);
    a[1] = lds32(p + 8 * ld);
    a[2] = lds32(p + 8);
    a[3] = lds32(p + 8 * ld + 8);
}

// A at (row0, k0) of the transpose of m [k][ld] (rows contiguous).
__device__ __forceinline__ void frag_a_t(u32 a[4], const bf16* m, int ld, int row0, int k0) {
    const Lane l;
    const bf16* p = m + (k0 + 2 * l.q) * ld + row0 + l.g;
    a[0] = pack_pair(p[0], p[ld]);
    a[1] = pack_pair(p[8], p[ld + 8]);
    a[2] = pack_pair(p[8 * ld], p[9 * ld]);
    a[3] = pack_pair(p[8 * ld + 8], p[9 * ld + 8]);
}

// B at (k0, n0) with B[k][n] = m[n][k] (m [n][ld], k contiguous).
__device__ __forceinline__ void frag_b_nk(u32 b[2], const bf16* m, int ld, int k0, int n0) {
    const Lane l;
    const bf16* p = m + (n0 + l.g) * ld + k0 + 2 * l.q;
    b[0] = lds32(p);
    b[1] = lds32(p + 8);
}

// B at (k0, n0) with B[k][n] = m[k][n] (m [k][ld], n contiguous).
__device__ __forceinline__ void frag_b_kn(u32 b[2], const bf16* m, int ld, int k0, int n0) {
    const Lane l;
    const bf16* p = m + (k0 + 2 * l.q) * ld + n0 + l.g;
    b[0] = pack_pair(p[0], p[ld]);
    b[1] = pack_pair(p[8 * ld], p[9 * ld]);
}

// Row (0 or 1: g or g + 8) and column (0 or 1: 2q or 2q + 1) of accumulator value r.
__device__ __forceinline__ int acc_row(int r) { return Lane().g + 8 * (r >> 1); }
__device__ __forceinline__ int acc_col(int r) { return 2 * Lane().q + (r & 1); }

// ---- chunk loads --------------------------------------------------------------------------------

// Starts copying rows 0..rows of dst [rows][ld] (bf16) from columns col0..col0+d of src's rows
// begin..begin+n (`stride` values apart), zero from n on; d a multiple of 8, every address 16-byte
// aligned.
__device__ void async_rows_bf16(bf16* dst, int ld, const bf16* __restrict__ src, long stride, int begin, int n,
                                int col0, int d, int rows = GDN_CHUNK) {
    const int vecs = d / 8;
    for (int e = threadIdx.x; e < rows * vecs; e += blockDim.x) {
        const int i = e / vecs, c = (e % vecs) * 8;
        cp_async16(dst + i * ld + c, src + (begin + (i < n ? i : 0)) * stride + col0 + c, i < n);
    }
}

// As async_rows_bf16 for fp32 rows; d a multiple of 4.
__device__ void async_rows_f32(float* dst, int ld, const float* __restrict__ src, long stride, int begin, int n,
                               int col0, int d) {
    const int vecs = d / 4;
    for (int e = threadIdx.x; e < GDN_CHUNK * vecs; e += blockDim.x) {
        const int i = e / vecs, c = (e % vecs) * 4;
        cp_async16(dst + i * ld + c, src + (begin + (i < n ? i : 0)) * stride + col0 + c, i < n);
    }
}

// Rows 0..GDN_CHUNK of dst [GDN_CHUNK][ld] (bf16) from the fp32 columns col0..col0+d of src's rows
// begin..begin+n, rounded, zero from n on; d a multiple of 4 up to GDN_MAX_HEAD_DIM; every load
// issued before the first store.
__device__ void load_rows_f32(bf16* dst, int ld, const float* __restrict__ src, long stride, int begin, int n,
                              int col0, int d) {
    constexpr int MAX = GDN_CHUNK * GDN_MAX_HEAD_DIM / 4 / GDN_THREADS;
    const int vecs = d / 4;
    float4 v[MAX];
#pragma unroll
    for (int r = 0; r < MAX; ++r) {
        const int e = threadIdx.x + r * GDN_THREADS, i = e / vecs, c = (e % vecs) * 4;
        v[r] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (e < GDN_CHUNK * vecs && i < n) v[r] = *reinterpret_cast<const float4*>(src + (begin + i) * stride + col0 + c);
    }
#pragma unroll
    for (int r = 0; r < MAX; ++r) {
        const int e = threadIdx.x + r * GDN_THREADS, i = e / vecs, c = (e % vecs) * 4;
        if (e < GDN_CHUNK * vecs) {
            bf16* o = dst + i * ld + c;
            *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(v[r].x, v[r].y);
            *reinterpret_cast<__nv_bfloat162*>(o + 2) = __floats2bfloat162_rn(v[r].z, v[r].w);
        }
    }
}

// inv[i] = scale / sqrt(sum of row i's d squares + eps) for every row of m [GDN_CHUNK][ld];
// blockDim / GDN_CHUNK adjacent lanes per row (a power of two dividing d / 2), each over a
// contiguous part of it.
__device__ void inv_norms(float* inv, const bf16* m, int ld, int d, float eps, float scale) {
    const int per_row = blockDim.x / GDN_CHUNK, i = threadIdx.x / per_row, part = threadIdx.x % per_row;
    const int len = d / per_row;
    const bf16* row = m + i * ld + part * len;
    float ss = 0.f;
    for (int c = 0; c < len; c += 2) {
        const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(row + c));
        ss += v.x * v.x + v.y * v.y;
    }
    for (int o = per_row / 2; o > 0; o /= 2) ss += __shfl_xor_sync(FULL, ss, o);
    if (part == 0) inv[i] = scale / sqrtf(ss + eps);
}

// Warp 0: gam[i] = g[0] + ... + g[i] over the chunk's values g[0..GDN_CHUNK) (0 from n on).
__device__ void scan_gates(float* gam, const float* g, int n) {
    if (threadIdx.x >= WARP) return;
    const int lane = threadIdx.x;
    float carry = 0.f;
    for (int base = 0; base < GDN_CHUNK; base += WARP) {
        const int i = base + lane;
        float v = i < n ? g[i] : 0.f;
#pragma unroll
        for (int o = 1; o < WARP; o *= 2) {
            const float u = __shfl_up_sync(FULL, v, o);
            if (lane >= o) v += u;
        }
        gam[i] = i < n ? carry + v : 0.f;
        carry += __shfl_sync(FULL, v, WARP - 1);
    }
}

// Starts copying g of value head h for the chunk's tokens (0 from n on) into dst [GDN_CHUNK], and
// beta into bet when it is not null.
__device__ void async_gates(float* dst, float* bet, const float* __restrict__ g, const float* __restrict__ beta,
                            int begin, int n, int heads, int h) {
    for (int i = threadIdx.x; i < GDN_CHUNK; i += blockDim.x) {
        const long at = (long)(begin + (i < n ? i : 0)) * heads + h;
        cp_async4(dst + i, g + at, i < n);
        if (bet) cp_async4(bet + i, beta + at, i < n);
    }
}

// The qkv columns of value head h's q, k and v (key head h / (H_v / H_k)).
struct DeltaHead {
    int channels, q0, k0, v0;
    __device__ DeltaHead(int h, int key_heads, int value_heads, int dk, int dv) {
        const int kh = h / (value_heads / key_heads);
        channels = 2 * key_heads * dk + value_heads * dv;
        q0 = kh * dk;
        k0 = key_heads * dk + kh * dk;
        v0 = 2 * key_heads * dk + h * dv;
    }
};

// Chunk `c` of the segment table: its first token, its length and whether it starts its segment.
struct Chunk {
    int begin, n;
    bool restart;
};
__device__ __forceinline__ Chunk chunk_of(const unsigned* __restrict__ table, int tokens, int c) {
    const unsigned* e = table + tokens + 3 * c;
    const int begin = (int)e[0];
    return Chunk{begin, (int)e[1] - begin, e[2] != 0u};
}

// ---- kernels --------------------------------------------------------------------------------------

// Twin: conv1d_silu. x [T, C] -> y [T, C] = silu(sum over lags l < min(K, t - start + 1) of
// w[c, K-1-l] x[t-l, c]), with w [C, K], K <= GDN_MAX_CONV; y must not overlap x. Grid
// (ceil(C / 8 / blockDim), ceil(T / GDN_CONV_TOKENS)): a thread runs 8 channels (16-byte loads)
// over GDN_CONV_TOKENS tokens, keeping its last K inputs in registers.
extern "C" __global__ void conv1d_silu(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* __restrict__ y,
                                       const unsigned* __restrict__ table, int tokens, int channels, int kernel) {
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 8, t0 = blockIdx.y * GDN_CONV_TOKENS;
    if (c0 >= channels) return;
    // taps[l][j]: the weight of lag l for channel c0 + j; win[l][j]: x[t - l, c0 + j].
    float taps[GDN_MAX_CONV][8], win[GDN_MAX_CONV][8];
#pragma unroll
    for (int l = 0; l < GDN_MAX_CONV; ++l)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            taps[l][j] = l < kernel ? to_f(w[(c0 + j) * kernel + kernel - 1 - l]) : 0.f;
            win[l][j] = 0.f;
        }
    auto load8 = [&](float* dst, int t) {
        const uint4 v = *reinterpret_cast<const uint4*>(x + (long)t * channels + c0);
        const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 f = __bfloat1622float2(p[j]);
            dst[2 * j] = f.x;
            dst[2 * j + 1] = f.y;
        }
    };
#pragma unroll
    for (int l = 1; l < GDN_MAX_CONV; ++l)
        if (l < kernel && t0 - l >= 0) load8(win[l], t0 - l);
    const int t1 = min(tokens, t0 + GDN_CONV_TOKENS);
#pragma unroll 4
    for (int t = t0; t < t1; ++t) {
        load8(win[0], t);
        const int lags = min(kernel, t - (int)table[t] + 1);
        float acc[8] = {};
#pragma unroll
        for (int l = 0; l < GDN_MAX_CONV; ++l)
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (l < lags) acc[j] += taps[l][j] * win[l][j];
        uint4 o;
        __nv_bfloat162* q = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
        for (int j = 0; j < 4; ++j)
            q[j] = __floats2bfloat162_rn(acc[2 * j] * sigmoid(acc[2 * j]), acc[2 * j + 1] * sigmoid(acc[2 * j + 1]));
        *reinterpret_cast<uint4*>(y + (long)t * channels + c0) = o;
#pragma unroll
        for (int l = GDN_MAX_CONV - 1; l > 0; --l)
#pragma unroll
            for (int j = 0; j < 8; ++j) win[l][j] = win[l - 1][j];
    }
}

// Twin: gdn_gates. b, a [T, H_v], a_log, dt_bias [H_v] -> beta = sigmoid(b),
// g = -exp(a_log) softplus(a + dt_bias) (fp32 [T, H_v]).
extern "C" __global__ void gdn_gates(const bf16* __restrict__ b, const bf16* __restrict__ a,
                                     const bf16* __restrict__ a_log, const bf16* __restrict__ dt_bias,
                                     float* __restrict__ beta, float* __restrict__ g, int tokens, int heads) {
    const int n = tokens * heads;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int h = i % heads;
        beta[i] = sigmoid(to_f(b[i]));
        const float v = to_f(a[i]) + to_f(dt_bias[h]);
        g[i] = -expf(to_f(a_log[h])) * (fmaxf(v, 0.f) + log1pf(expf(-fabsf(v))));
    }
}

// Twin: gated_delta (its chunk-parallel first half). Grid (count, H_v), GDN_THREADS threads; shared
// memory `prepare_shared_bytes` (cuda.rs). Per chunk of n tokens and value head h, with k L2-normed
// (inv), gamma the chunk's cumulative g:
//   A = strictly lower beta_i exp(gamma_i - gamma_j) k_i.k_j,  T = (I + A)^-1 (column by column),
//   W = T (beta exp(gamma) K) (bf16, to w),  U = T (beta V) (fp32, to u).
extern "C" __global__ void __launch_bounds__(GDN_THREADS)
    gated_delta_prepare(const bf16* __restrict__ qkv, const float* __restrict__ beta, const float* __restrict__ g,
                        const unsigned* __restrict__ table, bf16* __restrict__ w, float* __restrict__ u, int tokens,
                        int chunk0, int key_heads, int value_heads, int dk, int dv, float eps) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int kld = dk + GDN_PAD, vld = dv + GDN_PAD, tld = GDN_CHUNK + GDN_PAD, ald = GDN_CHUNK + 1;
    bf16* kb = reinterpret_cast<bf16*>(smem);                    // [C][kld] k
    bf16* vb = kb + GDN_CHUNK * kld;                             // [C][vld] v
    bf16* tw = vb + GDN_CHUNK * vld;                             // [C][tld] T diag(beta exp(gamma) inv)
    bf16* tu = tw + GDN_CHUNK * tld;                             // [C][tld] T diag(beta)
    float* am = reinterpret_cast<float*>(tu + GDN_CHUNK * tld);  // [C][ald] A
    float* tm = am + GDN_CHUNK * ald;                            // [C][ald] T
    float* gam = tm + GDN_CHUNK * ald;
    float* bet = gam + GDN_CHUNK;
    float* inv = bet + GDN_CHUNK;
    float* graw = inv + GDN_CHUNK;
    const int h = blockIdx.y, tid = threadIdx.x, warp = tid / WARP;
    const Chunk chunk = chunk_of(table, tokens, chunk0 + blockIdx.x);
    const int begin = chunk.begin, n = chunk.n;
    const DeltaHead hd(h, key_heads, value_heads, dk, dv);
    async_rows_bf16(kb, kld, qkv, hd.channels, begin, n, hd.k0, dk);
    async_rows_bf16(vb, vld, qkv, hd.channels, begin, n, hd.v0, dv);
    async_gates(graw, bet, g, beta, begin, n, value_heads, h);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    scan_gates(gam, graw, n);
    inv_norms(inv, kb, kld, dk, eps, 1.f);
    // K K^T: warp (row tile warp % 4, columns 32 (warp / 4) ..+32).
    float acc[4][4] = {};
    const int rt = warp % 4, n0 = (warp / 4) * 32;
    for (int k0 = 0; k0 < dk; k0 += 16) {
        u32 a[4];
        frag_a(a, kb, kld, rt * 16, k0);
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            u32 b[2];
            frag_b_nk(b, kb, kld, k0, n0 + nt * 8);
            mma(acc[nt], a, b);
        }
    }
    __syncthreads();  // inv, gam
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int i = rt * 16 + acc_row(r), j = n0 + nt * 8 + acc_col(r);
            am[i * ald + j] =
                j < i && i < n ? bet[i] * expf(gam[i] - gam[j]) * acc[nt][r] * inv[i] * inv[j] : 0.f;
        }
    __syncthreads();
    // T = (I + A)^-1 by blocks of 16 (A strictly lower): the diagonal blocks D_b = (I + A_bb)^-1
    // by forward substitution, column m by the 4 lanes 4m..4m+3 (T_im = -sum_{m <= j < i} A_ij T_jm,
    // T_mm = 1); then the blocks below by distance d = 1, 2, 3:
    // T_ij = -D_i (sum_{j <= k < i} A_ik T_kj), the sums in x (over tw, free until its turn).
    {
        constexpr int B = 16, NB = GDN_CHUNK / B;
        for (int e = tid; e < GDN_CHUNK * GDN_CHUNK; e += blockDim.x)
            if (e / GDN_CHUNK / B != e % GDN_CHUNK / B) tm[(e / GDN_CHUNK) * ald + e % GDN_CHUNK] = 0.f;
        const int m = tid / 4, p = tid % 4, b0 = m / B * B;
        for (int i = b0; i < b0 + B; ++i) {
            float s = 0.f;
            if (i > m)
                for (int j = m + p; j < i; j += 4) s += am[i * ald + j] * tm[j * ald + m];
            s += __shfl_xor_sync(FULL, s, 1);
            s += __shfl_xor_sync(FULL, s, 2);
            if (p == 0) tm[i * ald + m] = i < m ? 0.f : (i == m ? 1.f : -s);
            __syncwarp();
        }
        __syncthreads();
        float* x = reinterpret_cast<float*>(tw);  // [NB - 1][B][B]
        for (int d = 1; d < NB; ++d) {
            const int blocks = NB - d;
            for (int e = tid; e < blocks * B * B; e += blockDim.x) {
                const int bi = d + e / (B * B), bj = bi - d, r = e / B % B, c = e % B;
                float acc = 0.f;
                for (int k = bj * B; k < bi * B; ++k) acc += am[(bi * B + r) * ald + k] * tm[k * ald + bj * B + c];
                x[e] = acc;
            }
            __syncthreads();
            for (int e = tid; e < blocks * B * B; e += blockDim.x) {
                const int bi = d + e / (B * B), bj = bi - d, r = e / B % B, c = e % B;
                float acc = 0.f;
                for (int q = 0; q < B; ++q) acc += tm[(bi * B + r) * ald + bi * B + q] * x[(e / (B * B)) * B * B + q * B + c];
                tm[(bi * B + r) * ald + bj * B + c] = -acc;
            }
            __syncthreads();
        }
    }
    for (int j = tid; j < GDN_CHUNK; j += blockDim.x) graw[j] = bet[j] * expf(gam[j]) * inv[j];
    __syncthreads();
    for (int e = tid; e < GDN_CHUNK * GDN_CHUNK; e += blockDim.x) {
        const int i = e / GDN_CHUNK, j = e % GDN_CHUNK;
        const float t = tm[i * ald + j];
        tw[i * tld + j] = to_bf(t * graw[j]);
        tu[i * tld + j] = to_bf(t * bet[j]);
    }
    __syncthreads();
    // [W | U] = [tw K | tu V]: warp (row tile warp % 4, 8-column tiles 8 (warp / 4) + 16s ..+8).
    bf16* w_rows = w + (long)h * tokens * dk;
    float* u_rows = u + (long)h * tokens * dv;
    const int width = dk + dv, tiles = width / 8;
    for (int t0 = (warp / 4) * 8; t0 < tiles; t0 += 16) {
        float o[8][4] = {};
        for (int k0 = 0; k0 < GDN_CHUNK; k0 += 16) {
            u32 aw[4], au[4];
            frag_a(aw, tw, tld, rt * 16, k0);
            frag_a(au, tu, tld, rt * 16, k0);
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                const int c = (t0 + nt) * 8;
                if (c >= width) continue;
                u32 b[2];
                if (c < dk) {
                    frag_b_kn(b, kb, kld, k0, c);
                    mma(o[nt], aw, b);
                } else {
                    frag_b_kn(b, vb, vld, k0, c - dk);
                    mma(o[nt], au, b);
                }
            }
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int i = rt * 16 + acc_row(2 * half), c = (t0 + nt) * 8 + acc_col(0);
                if (i >= n || c >= width) continue;
                const float lo = o[nt][2 * half], hi = o[nt][2 * half + 1];
                if (c < dk)
                    *reinterpret_cast<__nv_bfloat162*>(w_rows + (long)(begin + i) * dk + c) = __floats2bfloat162_rn(lo, hi);
                else
                    *reinterpret_cast<float2*>(u_rows + (long)(begin + i) * dv + c - dk) = make_float2(lo, hi);
            }
    }
}

// Twin: gated_delta (its sequential part). Grid (H_v, ceil(d_v / GDN_STATE_COLS)),
// GDN_STATE_THREADS threads; shared memory `state_shared_bytes` (cuda.rs). Each CTA carries the
// state columns c0..c0+GDN_STATE_COLS of value head h, S [d_k, GDN_STATE_COLS] in registers (fp32;
// from the carry, zero at each segment's start), through the group's chunks in order, the next
// chunk's W, k, U and g copied in (cp.async, two stages) while it works on one:
//   slot i <- bf16(S);  Delta = U - W S (over U);  S <- exp(gamma_n) S + (exp(gamma_n - gamma) K)^T Delta;
// the carry <- S after the last chunk.
extern "C" __global__ void __launch_bounds__(GDN_STATE_THREADS)
    gated_delta_state(const bf16* __restrict__ qkv, const float* __restrict__ g, const unsigned* __restrict__ table,
                      const bf16* __restrict__ w, float* __restrict__ u, bf16* __restrict__ states,
                      float* __restrict__ carry, int tokens, int chunk0, int count, int slots, int key_heads,
                      int value_heads, int dk, int dv, float eps) {
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int NT = GDN_STATE_COLS / 8;
    constexpr int WARPS = GDN_STATE_THREADS / WARP;
    constexpr int RT = GDN_MAX_HEAD_DIM / 16 / WARPS;
    const int kld = dk + GDN_PAD, uld = GDN_STATE_COLS + 4, cld = GDN_STATE_COLS + GDN_PAD;
    // Per stage: W and k [C][kld] (bf16), U [C][uld] and g [C] (fp32).
    const int stage_bytes = 2 * 2 * GDN_CHUNK * kld + 4 * GDN_CHUNK * (uld + 1);
    bf16* sb = reinterpret_cast<bf16*>(smem + 2 * stage_bytes);  // [GDN_STATE_COLS][kld] S^T
    bf16* db = sb + GDN_STATE_COLS * kld;                         // [C][cld] Delta inv exp(gamma_n - gamma)
    float* gam = reinterpret_cast<float*>(db + GDN_CHUNK * cld);
    float* inv = gam + GDN_CHUNK;
    auto wb = [&](int st) { return reinterpret_cast<bf16*>(smem + st * stage_bytes); };
    auto kb = [&](int st) { return wb(st) + GDN_CHUNK * kld; };
    auto ub = [&](int st) { return reinterpret_cast<float*>(kb(st) + GDN_CHUNK * kld); };
    auto gb = [&](int st) { return ub(st) + GDN_CHUNK * uld; };
    const int h = blockIdx.x, c0 = blockIdx.y * GDN_STATE_COLS, warp = threadIdx.x / WARP;
    const int row_tiles = dk / 16, cols = min(GDN_STATE_COLS, dv - c0);
    const DeltaHead hd(h, key_heads, value_heads, dk, dv);
    const bf16* w_rows = w + (long)h * tokens * dk;
    float* u_rows = u + (long)h * tokens * dv;
    bf16* head_states = states + (long)h * slots * dk * dv;
    float* head_carry = carry + (long)h * dk * dv;
    auto issue = [&](const Chunk& c, int st) {
        async_rows_bf16(wb(st), kld, w_rows, dk, c.begin, c.n, 0, dk);
        async_rows_bf16(kb(st), kld, qkv, hd.channels, c.begin, c.n, hd.k0, dk);
        async_rows_f32(ub(st), uld, u_rows, dv, c.begin, c.n, c0, cols);
        async_gates(gb(st), nullptr, g, nullptr, c.begin, c.n, value_heads, h);
        cp_async_commit();
    };
    // The chunk in work, the next one (its tiles copied in meanwhile) and the one after (its table
    // entry read meanwhile): no table read waits in the loop.
    Chunk chunk = chunk_of(table, tokens, chunk0);
    Chunk next = count > 1 ? chunk_of(table, tokens, chunk0 + 1) : chunk;
    issue(chunk, 0);
    // S value r of tile (rr, nt): row (warp + WARPS rr) 16 + acc_row(r), column c0 + 8 nt + acc_col(r).
    float s[RT][NT][4];
#pragma unroll
    for (int rr = 0; rr < RT; ++rr)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int a = (warp + WARPS * rr) * 16 + acc_row(r), c = c0 + nt * 8 + acc_col(r);
                s[rr][nt][r] = warp + WARPS * rr < row_tiles && c < dv ? head_carry[a * dv + c] : 0.f;
            }
    for (int ci = 0; ci < count; ++ci) {
        const int st = ci % 2;
        cp_async_wait_all();
        __syncthreads();  // this chunk's tiles are in; the last chunk's work is done
        const Chunk after = ci + 2 < count ? chunk_of(table, tokens, chunk0 + ci + 2) : next;
        if (ci + 1 < count) issue(next, st ^ 1);
        const int begin = chunk.begin, n = chunk.n;
        const bool restart = chunk.restart;
        bf16* slot = head_states + (long)ci * dk * dv;
#pragma unroll
        for (int rr = 0; rr < RT; ++rr)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                if (warp + WARPS * rr >= row_tiles) continue;
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    if (restart) s[rr][nt][r] = 0.f;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int a = (warp + WARPS * rr) * 16 + acc_row(2 * half), cc = nt * 8 + acc_col(0);
                    const float lo = s[rr][nt][2 * half], hi = s[rr][nt][2 * half + 1];
                    if (c0 + cc < dv)
                        *reinterpret_cast<__nv_bfloat162*>(slot + a * dv + c0 + cc) = __floats2bfloat162_rn(lo, hi);
                    sb[cc * kld + a] = to_bf(c0 + cc < dv ? lo : 0.f);
                    sb[(cc + 1) * kld + a] = to_bf(c0 + cc < dv ? hi : 0.f);
                }
            }
        scan_gates(gam, gb(st), n);
        inv_norms(inv, kb(st), kld, dk, eps, 1.f);
        __syncthreads();  // sb, gam, inv
        // W S: warp (row tile warp, every column tile); GDN_CHUNK / 16 == WARPS.
        float ws[NT][4] = {};
        for (int k0 = 0; k0 < dk; k0 += 16) {
            u32 a[4];
            frag_a(a, wb(st), kld, warp * 16, k0);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                u32 b[2];
                frag_b_nk(b, sb, kld, k0, nt * 8);
                mma(ws[nt], a, b);
            }
        }
        const float last = gam[n - 1];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int i = warp * 16 + acc_row(2 * half), cc = nt * 8 + acc_col(0);
                float2 delta = make_float2(0.f, 0.f);
                if (i < n && c0 + cc < dv) {
                    delta.x = ub(st)[i * uld + cc] - ws[nt][2 * half];
                    delta.y = ub(st)[i * uld + cc + 1] - ws[nt][2 * half + 1];
                    *reinterpret_cast<float2*>(u_rows + (long)(begin + i) * dv + c0 + cc) = delta;
                }
                const float f = i < n ? inv[i] * expf(last - gam[i]) : 0.f;
                *reinterpret_cast<__nv_bfloat162*>(db + i * cld + cc) = __floats2bfloat162_rn(delta.x * f, delta.y * f);
            }
        __syncthreads();  // db
        const float decay = expf(last);
#pragma unroll
        for (int rr = 0; rr < RT; ++rr) {
            if (warp + WARPS * rr >= row_tiles) continue;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) s[rr][nt][r] *= decay;
            for (int k0 = 0; k0 < GDN_CHUNK; k0 += 16) {
                u32 a[4];
                frag_a_t(a, kb(st), kld, (warp + WARPS * rr) * 16, k0);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    u32 b[2];
                    frag_b_kn(b, db, cld, k0, nt * 8);
                    mma(s[rr][nt], a, b);
                }
            }
        }
        chunk = next;
        next = after;
    }
#pragma unroll
    for (int rr = 0; rr < RT; ++rr)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int a = (warp + WARPS * rr) * 16 + acc_row(r), c = c0 + nt * 8 + acc_col(r);
                if (warp + WARPS * rr < row_tiles && c < dv) head_carry[a * dv + c] = s[rr][nt][r];
            }
}

// Twin: gated_delta (its chunk-parallel second half). Grid (count, H_v), GDN_THREADS threads; shared
// memory `output_shared_bytes` (cuda.rs). Per chunk, with q, k L2-normed (q scaled by `scale`), S
// the state entering the chunk (its slot, bf16) and Delta (from u):
//   O = exp(gamma) (Q S) + P Delta,  P = lower (j <= i) exp(gamma_i - gamma_j) q_i.k_j,
// to out [T, H_v, d_v] (bf16).
extern "C" __global__ void __launch_bounds__(GDN_THREADS)
    gated_delta_output(const bf16* __restrict__ qkv, const float* __restrict__ g, const unsigned* __restrict__ table,
                       const float* __restrict__ u, const bf16* __restrict__ states, bf16* __restrict__ out,
                       int tokens, int chunk0, int slots, int key_heads, int value_heads, int dk, int dv, float eps,
                       float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int kld = dk + GDN_PAD, dld = dv + GDN_PAD, pld = GDN_CHUNK + GDN_PAD;
    bf16* qb = reinterpret_cast<bf16*>(smem);  // [C][kld] q
    bf16* kb = qb + GDN_CHUNK * kld;           // [C][kld] k
    bf16* sb = kb + GDN_CHUNK * kld;           // [d_k][dld] S
    bf16* db = sb + dk * dld;                  // [C][dld] Delta
    bf16* pb = db + GDN_CHUNK * dld;           // [C][pld] P
    float* gam = reinterpret_cast<float*>(pb + GDN_CHUNK * pld);
    float* iq = gam + GDN_CHUNK;
    float* ik = iq + GDN_CHUNK;
    float* graw = ik + GDN_CHUNK;
    const int ci = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, warp = tid / WARP;
    const Chunk chunk = chunk_of(table, tokens, chunk0 + ci);
    const int begin = chunk.begin, n = chunk.n;
    const DeltaHead hd(h, key_heads, value_heads, dk, dv);
    async_rows_bf16(qb, kld, qkv, hd.channels, begin, n, hd.q0, dk);
    async_rows_bf16(kb, kld, qkv, hd.channels, begin, n, hd.k0, dk);
    async_rows_bf16(sb, dld, states + ((long)h * slots + ci) * dk * dv, dv, 0, dk, 0, dv, dk);
    async_gates(graw, nullptr, g, nullptr, begin, n, value_heads, h);
    cp_async_commit();
    load_rows_f32(db, dld, u + (long)h * tokens * dv, dv, begin, n, 0, dv);
    cp_async_wait_all();
    __syncthreads();
    scan_gates(gam, graw, n);
    inv_norms(iq, qb, kld, dk, eps, scale);
    inv_norms(ik, kb, kld, dk, eps, 1.f);
    // Q K^T: warp (row tile warp % 4, columns 32 (warp / 4) ..+32).
    const int rt = warp % 4, n0 = (warp / 4) * 32;
    {
        float acc[4][4] = {};
        for (int k0 = 0; k0 < dk; k0 += 16) {
            u32 a[4];
            frag_a(a, qb, kld, rt * 16, k0);
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                u32 b[2];
                frag_b_nk(b, kb, kld, k0, n0 + nt * 8);
                mma(acc[nt], a, b);
            }
        }
        __syncthreads();  // iq, ik, gam
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = rt * 16 + acc_row(r), j = n0 + nt * 8 + acc_col(r);
                const float p = j <= i && i < n ? expf(gam[i] - gam[j]) * acc[nt][r] * iq[i] * ik[j] : 0.f;
                pb[i * pld + j] = to_bf(p);
            }
    }
    __syncthreads();
    // O: warp (row tile warp % 4, 8-column tiles 8 (warp / 4) + 16s ..+8).
    const int tiles = dv / 8;
    for (int t0 = (warp / 4) * 8; t0 < tiles; t0 += 16) {
        float o[8][4] = {};
        for (int k0 = 0; k0 < dk; k0 += 16) {
            u32 a[4];
            frag_a(a, qb, kld, rt * 16, k0);
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                if (t0 + nt >= tiles) continue;
                u32 b[2];
                frag_b_kn(b, sb, dld, k0, (t0 + nt) * 8);
                mma(o[nt], a, b);
            }
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int i = rt * 16 + acc_row(r);
                o[nt][r] *= expf(gam[i]) * iq[i];
            }
        for (int k0 = 0; k0 < GDN_CHUNK; k0 += 16) {
            u32 a[4];
            frag_a(a, pb, pld, rt * 16, k0);
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                if (t0 + nt >= tiles) continue;
                u32 b[2];
                frag_b_kn(b, db, dld, k0, (t0 + nt) * 8);
                mma(o[nt], a, b);
            }
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int i = rt * 16 + acc_row(2 * half), c = (t0 + nt) * 8 + acc_col(0);
                if (i < n && t0 + nt < tiles) {
                    __nv_bfloat162 v = __floats2bfloat162_rn(o[nt][2 * half], o[nt][2 * half + 1]);
                    *reinterpret_cast<__nv_bfloat162*>(out + ((long)(begin + i) * value_heads + h) * dv + c) = v;
                }
            }
    }
}

// Twin: gated_rms_norm. o, z [rows = T*H_v, d_v], w [d_v] -> y = o / rms(o) * w * silu(z), one warp
// per row; y may be o.
extern "C" __global__ void gated_rms_norm(const bf16* o, const bf16* __restrict__ z, const bf16* __restrict__ w,
                                          bf16* y, int rows, int dv, float eps) {
    const int lane = threadIdx.x % WARP;
    const long row = (long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    if (row >= rows) return;
    float v[GDN_NORM_LANE_ELEMS];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < GDN_NORM_LANE_ELEMS; ++k) {
        const int i = lane + k * WARP;
        v[k] = i < dv ? to_f(o[row * dv + i]) : 0.f;
        ss += v[k] * v[k];
    }
    const float inv = 1.f / sqrtf(warp_sum(ss) / dv + eps);
#pragma unroll
    for (int k = 0; k < GDN_NORM_LANE_ELEMS; ++k) {
        const int i = lane + k * WARP;
        if (i < dv) {
            const float zi = to_f(z[row * dv + i]);
            y[row * dv + i] = to_bf(v[k] * inv * to_f(w[i]) * (zi * sigmoid(zi)));
        }
    }
}

// Twin: partial_rope. x [T, heads, d] -> y: rotate-half RoPE on dims 0..rotary with cos, sin
// [T, rotary] (fp32), dims rotary..d copied; one thread per pair (k, k + rotary/2) or copied
// value; y may be x.
extern "C" __global__ void partial_rope(const bf16* x, const float* __restrict__ cos, const float* __restrict__ sin,
                                        bf16* y, int tokens, int heads, int d, int rotary) {
    const int half = rotary / 2, per_row = d - half;
    const long n = (long)tokens * heads * per_row;
    for (long e = blockIdx.x * (long)blockDim.x + threadIdx.x; e < n; e += (long)gridDim.x * blockDim.x) {
        const long row = e / per_row;
        const int k = (int)(e % per_row), t = (int)(row / heads);
        const long base = row * d;
        if (k < half) {
            const float a = to_f(x[base + k]), b = to_f(x[base + k + half]);
            const long c = (long)t * rotary + k, s = c + half;
            y[base + k] = to_bf(a * cos[c] - b * sin[c]);
            y[base + k + half] = to_bf(b * cos[s] + a * sin[s]);
        } else {
            y[base + k + half] = x[base + k + half];
        }
    }
}

// Twin: output_gate. y [n] = x * sigmoid(gate); y may be x.
extern "C" __global__ void output_gate(const bf16* x, const bf16* __restrict__ gate, bf16* y, long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        y[i] = to_bf(to_f(x[i]) * sigmoid(to_f(gate[i])));
}
