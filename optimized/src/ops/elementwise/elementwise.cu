// Elementwise and reduction kernels of the GPU training step (optimized/src/model/drafter_step.rs):
// bf16 activations and step gradients, fp32 arithmetic, fp32 optimizer state. Their CPU twins are
// optimized/src/ops/elementwise/twin.rs, by the same names; `xtask gpu-conformance` checks every
// kernel against its twin on the H200. VEC and MAX_* come from the host's prelude
// (optimized/src/ops/constants.rs).
//
// Conventions: row-major tensors, shapes in comments; `rows` is the leading dim. Norm-weight
// gradients are reduced deterministically: a kernel writes one fp32 partial per CTA
// (`dw_partial [gridDim.x, n]`) and `column_sum` adds the partials in a fixed order (no atomics,
// bit-identical from run to run).

#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

#define WARP 32
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ bf16 to_bf(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum of `v` over the CTA (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// `scratch` holds 32 floats; the call synchronises the CTA twice.
__device__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < warps; ++w) total += scratch[w];
    return total;
}

// VEC (8) bf16 values moved as one 16-byte load or store.
union Bf16x8 {
    uint4 raw;
    __nv_bfloat162 h2[4];
};

__device__ __forceinline__ void load8(const bf16* p, float* out) {
    Bf16x8 v;
    v.raw = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 f = __bfloat1622float2(v.h2[k]);
        out[2 * k] = f.x;
        out[2 * k + 1] = f.y;
    }
}

__device__ __forceinline__ void store8(bf16* p, const float* in) {
    Bf16x8 v;
#pragma unroll
    for (int k = 0; k < 4; ++k) v.h2[k] = __floats2bfloat162_rn(in[2 * k], in[2 * k + 1]);
    *reinterpret_cast<uint4*>(p) = v.raw;
}

// rms_norm_backward: n <= MAX_CHUNKS_PER_THREAD * VEC * blockDim.x (both from the prelude).

// Twin: twin.rs rms_norm_backward (+ the residual gradient `dres`, may be null). Each CTA
// takes a contiguous range of rows; thread t holds 8-column chunks t, t + blockDim.x, ... of a
// row in registers (one read of dy and x per row; n a multiple of 8, rows 16-byte aligned);
// dx may alias dy or dres.
// dy, x [rows, n], w [n], inv [rows] -> dx [rows, n] = r*(g - x*r^2*mean(g*x)) + dres with g = dy*w,
// dw_partial [gridDim.x, n] = this CTA's sum over its rows of dy*x*r.
extern "C" __global__ void rms_norm_backward(const bf16* dy, const bf16* __restrict__ x, const bf16* __restrict__ w,
                                             const float* __restrict__ inv, const bf16* dres, bf16* dx,
                                             float* __restrict__ dw_partial, int rows, int n) {
    __shared__ float scratch[WARP];
    float acc[MAX_CHUNKS_PER_THREAD][VEC];
#pragma unroll
    for (int c = 0; c < MAX_CHUNKS_PER_THREAD; ++c)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[c][e] = 0.f;
    const int chunks = n / VEC;
    const int per_cta = (rows + gridDim.x - 1) / gridDim.x;
    const int lo = blockIdx.x * per_cta, hi = min(rows, lo + per_cta);
    for (int row = lo; row < hi; ++row) {
        const size_t base = (size_t)row * n;
        const float r = inv[row];
        float g[MAX_CHUNKS_PER_THREAD][VEC], xv[MAX_CHUNKS_PER_THREAD][VEC];
        float dot = 0.f;
#pragma unroll
        for (int c = 0; c < MAX_CHUNKS_PER_THREAD; ++c) {
            const int chunk = threadIdx.x + c * blockDim.x;
            if (chunk < chunks) {
                float wv[VEC];
                load8(dy + base + chunk * VEC, g[c]);
                load8(x + base + chunk * VEC, xv[c]);
                load8(w + chunk * VEC, wv);
#pragma unroll
                for (int e = 0; e < VEC; ++e) dot += g[c][e] * wv[e] * xv[c][e];
            }
        }
        const float coeff = r * r * r * block_sum(dot, scratch) / n;
#pragma unroll
        for (int c = 0; c < MAX_CHUNKS_PER_THREAD; ++c) {
            const int chunk = threadIdx.x + c * blockDim.x;
            if (chunk < chunks) {
                float wv[VEC], d[VEC], res[VEC];
                load8(w + chunk * VEC, wv);
                if (dres != nullptr) {
                    load8(dres + base + chunk * VEC, res);
                } else {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) res[e] = 0.f;
                }
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    acc[c][e] += g[c][e] * xv[c][e] * r;
                    d[e] = r * g[c][e] * wv[e] - xv[c][e] * coeff + res[e];
                }
                store8(dx + base + chunk * VEC, d);
            }
        }
    }
#pragma unroll
    for (int c = 0; c < MAX_CHUNKS_PER_THREAD; ++c) {
        const int chunk = threadIdx.x + c * blockDim.x;
        if (chunk < chunks)
#pragma unroll
            for (int e = 0; e < VEC; ++e) dw_partial[(size_t)blockIdx.x * n + chunk * VEC + e] = acc[c][e];
    }
}

// out [n] = bf16(sum over p of partial [parts, n]), in order p = 0, 1, ... (deterministic).
extern "C" __global__ void column_sum(const float* __restrict__ partial, bf16* __restrict__ out, int parts, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = 0.f;
    for (int p = 0; p < parts; ++p) s += partial[(size_t)p * n + i];
    out[i] = to_bf(s);
}

// Lane `lane` of a head row of d = 32 N holds its N contiguous elements from `lane * N`: loaded
// and stored as bf16 pairs (d a multiple of 64, so N is even); the RoPE partner of element i
// (i +- d/2) sits in lane `lane ^ 16` at the same position.
template <int N>
__device__ __forceinline__ void load_lane(const bf16* row, int lane, float* v) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(row + lane * N);
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {
        const float2 f = __bfloat1622float2(p[k]);
        v[2 * k] = f.x;
        v[2 * k + 1] = f.y;
    }
}

// This lane's N fp32 values of row (from lane * N on) in 16-byte loads (8-byte when N is not a
// multiple of 4); rows of RoPE tables, 32 N values apart from 256-byte-aligned regions.
template <int N>
__device__ __forceinline__ void load_lane_f32(const float* row, int lane, float* v) {
    constexpr int W = N % 4 == 0 ? 4 : 2;  // floats a load
    struct alignas(4 * W) Chunk {
        float f[W];
    };
    const Chunk* p = reinterpret_cast<const Chunk*>(row + lane * N);
#pragma unroll
    for (int k = 0; k < N / W; ++k) {
        const Chunk c = p[k];
#pragma unroll
        for (int j = 0; j < W; ++j) v[W * k + j] = c.f[j];
    }
}

template <int N>
__device__ __forceinline__ void store_lane(bf16* row, int lane, const float* v) {
    __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(row + lane * N);
#pragma unroll
    for (int k = 0; k < N / 2; ++k) p[k] = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
}

// The forward head kernels' body for heads of d = 32 N: HEAD_LANE_VALUES / N (token, head) rows a
// warp (4 at d = 128), every row's x loaded (and its token's cos/sin rows prefetched to L1) before any
// arithmetic, so that a warp has all its rows' loads in flight at once (one row a warp waited for
// its row, then for its tables). Per row: with NORM, RMSNorm over the head dim (x * w /
// sqrt(mean(x^2) + eps), inv = the reciprocal), then neox RoPE (out = v*cos + rotate_half(v)*sin,
// the partner half from lane ^ 16). Rows past the last (the grid's tail) load the last row again
// and store nothing.
// x [T, heads, d] (token t's heads at x + t * x_row), w [d], cos/sin [T, d] (fp32)
// -> y [T, heads, d], inv [T*heads] (NORM).
template <bool NORM, int N>
__device__ __forceinline__ void norm_rope_rows(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                               const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                               bf16* __restrict__ y, float* __restrict__ inv, int tokens, int heads,
                                               int x_row, float eps) {
    constexpr int R = HEAD_LANE_VALUES / N, D = N * WARP;
    const int rows = tokens * heads, lane = threadIdx.x % WARP;
    const int row0 = (blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP) * R;
    if (row0 >= rows) return;  // the whole warp: every lane has the same row0
    float v[R][N];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row = min(row0 + r, rows - 1);
        load_lane<N>(x + (size_t)(row / heads) * x_row + (size_t)(row % heads) * D, lane, v[r]);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const size_t at = (size_t)(min(row0 + r, rows - 1) / heads) * D + lane * N;
        asm volatile("prefetch.global.L1 [%0];" ::"l"(cos_t + at));
        asm volatile("prefetch.global.L1 [%0];" ::"l"(sin_t + at));
    }
    float wv[N];
    if (NORM) load_lane<N>(w, lane, wv);
    const float sign = lane < WARP / 2 ? -1.f : 1.f;  // rotate_half: [-x2, x1]
#pragma unroll
    for (int r = 0; r < R; ++r) {
        float scale = 1.f;
        if (NORM) {
            float ss = 0.f;
#pragma unroll
            for (int k = 0; k < N; ++k) ss += v[r][k] * v[r][k];
            scale = 1.f / sqrtf(warp_sum(ss) / D + eps);
#pragma unroll
            for (int k = 0; k < N; ++k) v[r][k] *= scale * wv[k];
        }
        const int row = min(row0 + r, rows - 1);
        float c[N], s[N], out[N];
        load_lane_f32<N>(cos_t + (size_t)(row / heads) * D, lane, c);
        load_lane_f32<N>(sin_t + (size_t)(row / heads) * D, lane, s);
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const float partner = __shfl_xor_sync(0xffffffffu, v[r][k], WARP / 2);
            out[k] = v[r][k] * c[k] + sign * partner * s[k];
        }
        if (row0 + r < rows) {
            store_lane<N>(y + (size_t)(row0 + r) * D, lane, out);
            if (NORM && lane == 0) inv[row0 + r] = scale;
        }
    }
}

// norm_rope_rows for the head dim d (64, 128, 192 or 256: checked by the launchers).
template <bool NORM>
__device__ __forceinline__ void norm_rope_rows_of(const bf16* x, const bf16* w, const float* cos_t,
                                                  const float* sin_t, bf16* y, float* inv, int tokens, int heads,
                                                  int d, int x_row, float eps) {
    switch (d / WARP) {
        case 2: norm_rope_rows<NORM, 2>(x, w, cos_t, sin_t, y, inv, tokens, heads, x_row, eps); break;
        case 4: norm_rope_rows<NORM, 4>(x, w, cos_t, sin_t, y, inv, tokens, heads, x_row, eps); break;
        case 6: norm_rope_rows<NORM, 6>(x, w, cos_t, sin_t, y, inv, tokens, heads, x_row, eps); break;
        case 8: norm_rope_rows<NORM, 8>(x, w, cos_t, sin_t, y, inv, tokens, heads, x_row, eps); break;
    }
}

// Twin: twin.rs head_norm_rope_forward (RMSNorm over the head dim, then RoPE): norm_rope_rows.
extern "C" __global__ void head_norm_rope_forward(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                                  const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                                  bf16* __restrict__ y, float* __restrict__ inv, int tokens, int heads,
                                                  int d, int x_row, float eps) {
    norm_rope_rows_of<true>(x, w, cos_t, sin_t, y, inv, tokens, heads, d, x_row, eps);
}

// Twin: twin.rs rope_forward (RoPE alone, for targets without q/k norms): norm_rope_rows.
extern "C" __global__ void rope_forward(const bf16* __restrict__ x, const float* __restrict__ cos_t,
                                        const float* __restrict__ sin_t, bf16* __restrict__ y, int tokens, int heads,
                                        int d, int x_row) {
    norm_rope_rows_of<false>(x, nullptr, cos_t, sin_t, y, nullptr, tokens, heads, d, x_row, 0.f);
}

// head_norm_rope_backward for heads of d = 32 N. Warp w of the grid takes rows w, w + stride,
// ... (stride: the grid's warps), HEAD_LANE_VALUES / (2 N) of them at a time (2 at d = 128)
// with all their loads in flight before any arithmetic, and adds each row's dw in row order
// (the same order, so the same bits, whatever the number at a time); cta_dw: shared [d].
template <int N>
__device__ __forceinline__ void head_norm_rope_backward_rows(const bf16* dy, const bf16* __restrict__ x,
                                                             const bf16* __restrict__ w,
                                                             const float* __restrict__ inv,
                                                             const float* __restrict__ cos_t,
                                                             const float* __restrict__ sin_t, bf16* dx,
                                                             float* __restrict__ dw_partial, int tokens, int heads,
                                                             float* cta_dw) {
    constexpr int R = HEAD_LANE_VALUES / (2 * N) > 0 ? HEAD_LANE_VALUES / (2 * N) : 1, D = N * WARP;
    const int lane = threadIdx.x % WARP, warps = blockDim.x / WARP, rows = tokens * heads;
    const int first = lane * N, stride = gridDim.x * warps;
    for (int i = threadIdx.x; i < D; i += blockDim.x) cta_dw[i] = 0.f;
    __syncthreads();
    float acc[N], wv[N];
    load_lane<N>(w, lane, wv);
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = 0.f;
    const float sign = lane < WARP / 2 ? 1.f : -1.f;  // rotate_half^T: [u2, -u1]
    for (int row0 = blockIdx.x * warps + threadIdx.x / WARP; row0 < rows; row0 += R * stride) {
        float g[R][N], xv[R][N];
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int row = min(row0 + r * stride, rows - 1);
            load_lane<N>(dy + (size_t)row * D, lane, g[r]);
            load_lane<N>(x + (size_t)row * D, lane, xv[r]);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int row = row0 + r * stride;
            if (row >= rows) break;  // the whole warp: rows are per warp
            float c[N], sn[N];
            load_lane_f32<N>(cos_t + (size_t)(row / heads) * D, lane, c);
            load_lane_f32<N>(sin_t + (size_t)(row / heads) * D, lane, sn);
            // dxn = dy*cos + rotate_half^T(dy*sin): the gradient of the normed, pre-RoPE values.
            float dot = 0.f, out[N];
#pragma unroll
            for (int k = 0; k < N; ++k) {
                const float u = g[r][k] * sn[k];
                const float partner = __shfl_xor_sync(0xffffffffu, u, WARP / 2);
                g[r][k] = g[r][k] * c[k] + sign * partner;
                dot += g[r][k] * wv[k] * xv[r][k];
            }
            const float ri = inv[row];
            const float coeff = ri * ri * ri * warp_sum(dot) / D;
#pragma unroll
            for (int k = 0; k < N; ++k) {
                acc[k] += g[r][k] * xv[r][k] * ri;
                out[k] = ri * g[r][k] * wv[k] - xv[r][k] * coeff;
            }
            store_lane<N>(dx + (size_t)row * D, lane, out);
        }
    }
    // Lanes of different warps hold the same columns: add them in shared memory in warp order.
    for (int wi = 0; wi < warps; ++wi) {
        if (threadIdx.x / WARP == wi) {
#pragma unroll
            for (int k = 0; k < N; ++k) cta_dw[first + k] += acc[k];
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < D; i += blockDim.x) dw_partial[(size_t)blockIdx.x * D + i] = cta_dw[i];
}

// Twin: twin.rs head_norm_rope_backward (through RoPE, then the head RMSNorm):
// head_norm_rope_backward_rows for the head dim d (64, 128, 192 or 256: checked by the launcher);
// dx may alias dy.
// dy, x [T, heads, d] (x before the norm), w [d], inv [T*heads], cos/sin [T, d]
// -> dx [T, heads, d], dw_partial [gridDim.x, d].
extern "C" __global__ void head_norm_rope_backward(const bf16* dy, const bf16* __restrict__ x,
                                                   const bf16* __restrict__ w, const float* __restrict__ inv,
                                                   const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                                   bf16* dx, float* __restrict__ dw_partial, int tokens, int heads,
                                                   int d) {
    __shared__ float cta_dw[MAX_HEAD_LANE_ELEMS * WARP];
    switch (d / WARP) {
        case 2: head_norm_rope_backward_rows<2>(dy, x, w, inv, cos_t, sin_t, dx, dw_partial, tokens, heads, cta_dw); break;
        case 4: head_norm_rope_backward_rows<4>(dy, x, w, inv, cos_t, sin_t, dx, dw_partial, tokens, heads, cta_dw); break;
        case 6: head_norm_rope_backward_rows<6>(dy, x, w, inv, cos_t, sin_t, dx, dw_partial, tokens, heads, cta_dw); break;
        case 8: head_norm_rope_backward_rows<8>(dy, x, w, inv, cos_t, sin_t, dx, dw_partial, tokens, heads, cta_dw); break;
    }
}

__device__ __forceinline__ float sigmoid(float g) { return 1.f / (1.f + expf(-g)); }

__device__ __forceinline__ float silu_of(float g) { return g * sigmoid(g); }

// `V` values at `p` (V = 8: one 16-byte load; V = 1: one value).
template <int V>
__device__ __forceinline__ void load_v(const bf16* p, float* out) {
    if (V == VEC) {
        load8(p, out);
    } else {
        out[0] = to_f(p[0]);
    }
}

template <int V>
__device__ __forceinline__ void store_v(bf16* p, const float* in) {
    if (V == VEC) {
        store8(p, in);
    } else {
        p[0] = to_bf(in[0]);
    }
}

template <int V>
__device__ void swiglu_forward_rows(const bf16* __restrict__ gu, bf16* __restrict__ h, int rows, int inter) {
    for (long long r = blockIdx.y; r < rows; r += gridDim.y)
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < inter / V; c += gridDim.x * blockDim.x) {
            const long long col = (long long)c * V;
            float g[V], u[V], out[V];
            load_v<V>(gu + r * 2 * inter + col, g);
            load_v<V>(gu + r * 2 * inter + inter + col, u);
#pragma unroll
            for (int e = 0; e < V; ++e) out[e] = silu_of(g[e]) * u[e];
            store_v<V>(h + r * inter + col, out);
        }
}

// Twin: twin.rs swiglu_forward. gu [rows, 2I] holds each row's gate then up (one matmul
// with the stacked weight [W_gate; W_up]) -> h [rows, I] = silu(gate) * up. Grid (chunks of a
// row, rows); 8-value chunks when I % 8 == 0 (16-byte loads), else single values.
extern "C" __global__ void swiglu_forward(const bf16* __restrict__ gu, bf16* __restrict__ h, int rows, int inter) {
    if (inter % VEC == 0) {
        swiglu_forward_rows<VEC>(gu, h, rows, inter);
    } else {
        swiglu_forward_rows<1>(gu, h, rows, inter);
    }
}

// dgate = dh*up*silu'(g), dup = dh*silu(g) with s = sigmoid(g), silu' = s*(1 + g*(1 - s)).
__device__ __forceinline__ void swiglu_grad(float d, float g, float u, float* dg, float* du) {
    const float s = sigmoid(g);
    *dg = d * u * s * (1.f + g * (1.f - s));
    *du = d * g * s;
}

template <int V>
__device__ void swiglu_backward_rows(const bf16* __restrict__ dh, bf16* __restrict__ gu, int rows, int inter) {
    for (long long r = blockIdx.y; r < rows; r += gridDim.y)
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < inter / V; c += gridDim.x * blockDim.x) {
            const long long col = (long long)c * V;
            bf16* g_ptr = gu + r * 2 * inter + col;
            float d[V], g[V], u[V], dg[V], du[V];
            load_v<V>(dh + r * inter + col, d);
            load_v<V>(g_ptr, g);
            load_v<V>(g_ptr + inter, u);
#pragma unroll
            for (int e = 0; e < V; ++e) swiglu_grad(d[e], g[e], u[e], &dg[e], &du[e]);
            store_v<V>(g_ptr, dg);
            store_v<V>(g_ptr + inter, du);
        }
}

// Twin: twin.rs swiglu_backward. dh [rows, I], gu [rows, 2I] -> gu := [dgate | dup] per row,
// in place (grid and chunks as forward).
extern "C" __global__ void swiglu_backward(const bf16* __restrict__ dh, bf16* __restrict__ gu, int rows, int inter) {
    if (inter % VEC == 0) {
        swiglu_backward_rows<VEC>(dh, gu, rows, inter);
    } else {
        swiglu_backward_rows<1>(dh, gu, rows, inter);
    }
}

// Online max and sum of exp over a row of logits, `V` at a time; merged over the CTA.
template <int V>
__device__ void row_max_sum(const bf16* zr, int vocab, float* m_out, float* s_out) {
    float m = NEG_INF, s = 0.f;
    for (int c = threadIdx.x; c < vocab / V; c += blockDim.x) {
        float v[V];
        load_v<V>(zr + c * V, v);
        float cm = v[0];
#pragma unroll
        for (int e = 1; e < V; ++e) cm = fmaxf(cm, v[e]);
        const float mm = fmaxf(m, cm);
        float cs = 0.f;
#pragma unroll
        for (int e = 0; e < V; ++e) cs += expf(v[e] - mm);
        s = (m == NEG_INF ? 0.f : s * expf(m - mm)) + cs;
        m = mm;
    }
    *m_out = m;
    *s_out = s;
}

// z := sw * (exp(z - lse) - onehot(y)), `V` at a time.
template <int V>
__device__ void row_ce_grad(bf16* zr, int vocab, float lse, unsigned y, float sw) {
    for (int c = threadIdx.x; c < vocab / V; c += blockDim.x) {
        float v[V];
        load_v<V>(zr + c * V, v);
#pragma unroll
        for (int e = 0; e < V; ++e) v[e] = sw * (expf(v[e] - lse) - (c * V + e == (int)y ? 1.f : 0.f));
        store_v<V>(zr + c * V, v);
    }
}

// Twin: twin.rs ce_grad_rows. One CTA per row; z is overwritten in place, 8
// logits per load when vocab % 8 == 0 (rows 16-byte aligned), else one at a time.
// z [rows, vocab] logits, labels [rows], weights [rows] -> z := scale*w*(softmax(z) - onehot(y)),
// loss [rows] = w*(logsumexp(z) - z[y]) (unscaled).
extern "C" __global__ void ce_grad_rows(bf16* __restrict__ z, const unsigned* __restrict__ labels,
                                        const float* __restrict__ weights, float* __restrict__ loss, int rows,
                                        int vocab, float scale) {
    __shared__ float scratch_m[WARP], scratch_s[WARP];
    const int row = blockIdx.x;
    if (row >= rows) return;
    bf16* zr = z + (size_t)row * vocab;
    const bool vec = vocab % VEC == 0;
    float m, s;
    if (vec) {
        row_max_sum<VEC>(zr, vocab, &m, &s);
    } else {
        row_max_sum<1>(zr, vocab, &m, &s);
    }
#pragma unroll
    for (int o = WARP / 2; o > 0; o /= 2) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        const float mm = fmaxf(m, m2);
        s = (m == NEG_INF ? 0.f : s * expf(m - mm)) + (m2 == NEG_INF ? 0.f : s2 * expf(m2 - mm));
        m = mm;
    }
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    if (lane == 0) {
        scratch_m[warp] = m;
        scratch_s[warp] = s;
    }
    __syncthreads();
    float gm = NEG_INF;
    for (int wi = 0; wi < warps; ++wi) gm = fmaxf(gm, scratch_m[wi]);
    float gs = 0.f;
    for (int wi = 0; wi < warps; ++wi)
        if (scratch_m[wi] != NEG_INF) gs += scratch_s[wi] * expf(scratch_m[wi] - gm);
    const float lse = gm + logf(gs);
    const unsigned y = labels[row];
    const float w = weights[row], zy = to_f(zr[y]);
    __syncthreads();
    if (vec) {
        row_ce_grad<VEC>(zr, vocab, lse, y, scale * w);
    } else {
        row_ce_grad<1>(zr, vocab, lse, y, scale * w);
    }
    if (threadIdx.x == 0) loss[row] = w * (lse - zy);
}

// Whether candidate (v, i) of a row's argmax beats the best so far (bv, bi): a larger value, or an
// equal one at a smaller index; index -1 is no candidate (a NaN value never becomes one). A total
// order on the candidates, so the reduction's result does not depend on its order.
__device__ __forceinline__ bool argmax_beats(float v, int i, float bv, int bi) {
    return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

// This thread's best (value, index) over its `V`-value chunks of a row, NaNs skipped: AHEAD
// chunks loaded before any is compared (one CTA reads a 151,936-logit row at the bandwidth the
// loads in flight allow, not one load's latency at a time). `argmax_beats` is a total order of
// the values that are not NaN, so the order of comparisons does not change the result.
template <int V>
__device__ void row_argmax(const bf16* zr, int vocab, float* v_out, int* i_out) {
    constexpr int AHEAD = 4;
    float bv = NEG_INF;
    int bi = -1;
    const int chunks = vocab / V;
    for (int c0 = threadIdx.x; c0 < chunks; c0 += AHEAD * blockDim.x) {
        float v[AHEAD][V];
#pragma unroll
        for (int u = 0; u < AHEAD; ++u)
            if (c0 + u * (int)blockDim.x < chunks) load_v<V>(zr + (c0 + u * blockDim.x) * V, v[u]);
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {
            const int c = c0 + u * blockDim.x;
            if (c >= chunks) continue;
#pragma unroll
            for (int e = 0; e < V; ++e)
                if (!isnan(v[u][e]) && argmax_beats(v[u][e], c * V + e, bv, bi)) {
                    bv = v[u][e];
                    bi = c * V + e;
                }
        }
    }
    *v_out = bv;
    *i_out = bi;
}

// Twin: twin.rs rms_norm_forward. One CTA per row, 8 values per 16-byte load (a decoding row of
// 4096 is two loads per thread); n % 8 == 0 and 16-byte aligned rows (checked by the launcher).
// x [rows, n], w [n] -> y [rows, n] (bf16), inv [rows] = 1/sqrt(mean(x^2) + eps).
extern "C" __global__ void rms_norm_forward(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                            bf16* __restrict__ y, float* __restrict__ inv, int rows, int n,
                                            float eps) {
    __shared__ float scratch[WARP];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const bf16* xr = x + (size_t)row * n;
    bf16* yr = y + (size_t)row * n;
    float ss = 0.f;
    for (int c = threadIdx.x * VEC; c < n; c += blockDim.x * VEC) {
        float v[VEC];
        load8(xr + c, v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) ss += v[j] * v[j];
    }
    const float r = 1.f / sqrtf(block_sum(ss, scratch) / n + eps);
    for (int c = threadIdx.x * VEC; c < n; c += blockDim.x * VEC) {
        float v[VEC], g[VEC];
        load8(xr + c, v);
        load8(w + c, g);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[j] = v[j] * r * g[j];
        store8(yr + c, v);
    }
    if (threadIdx.x == 0) inv[row] = r;
}

// d += a b on the tensor cores (mma.sync m16n8k16, row.col, bf16 operands, fp32 accumulators).
// Fragments (g = lane / 4, t = lane % 4): a[0] (row g, k 2t, 2t+1), a[1] (row g+8), a[2] (row g,
// k 2t+8, 2t+9), a[3] (row g+8, k +8); b[0] (k 2t, 2t+1, col g), b[1] (k +8); d[0], d[1] (row g,
// cols 2t, 2t+1), d[2], d[3] (row g+8).
__device__ __forceinline__ void mma_bf16(float d[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Twin: ops/matmul/twin.rs matmul of up to LINEAR_ROWS rows (`Backend::linear` on the host). The
// linear layers of batch-1 decoding (a plain step's one row, a verify block's and the drafter
// block's 16), bound by reading the weight once, on the tensor cores: a CTA owns 8 output columns
// (one mma's) and its LINEAR_ROWS_WARPS warps split k in chunks of 32, chunk c added into chain
// c % LINEAR_ROWS_CHAINS, two chains a warp taken by turns (two independent mma chains: 2 to 13%
// faster per layer at 16 rows on the H100 than one); a warp loads AHEAD chunks (the weight bytes
// in flight) before multiplying them. A lane loads 16 bytes of a weight row and of x rows g and
// g+8 at the same 8 k and feeds two mmas with them: k is permuted alike in both operands (mma k
// 2t+e and 2t+8+e are phys 8t+e and 8t+2+e, then 8t+4+e and 8t+6+e), which leaves every dot
// product unchanged. Rows at or past m are zeros. A chain adds its chunks in k order; the chains'
// sums are added in chain order through shared memory (deterministic), and a row's result does
// not depend on the other rows, so every m gives a row the same bits. Measured on the H100
// (bench gemm, results/gemm-h100-linear-rows-*.json) against CTAs of 16 and 32 columns, 16 warps,
// passes double-buffered in registers, a persistent grid (x kept in L1 across a CTA's tiles) and
// x staged in shared memory: none was faster by more than 2% on any of the 8B shape's layers at
// 16 rows, most were slower; at one row it is within 0.5% of a warp-per-output kernel on the LM
// head and 0.2 to 36% faster on the other layers.
// x [m, k], w [n, k] -> y [m, n] = x w^T + beta * y (bf16); 1 <= m <= LINEAR_ROWS, k % 8 == 0,
// x and w 16-byte aligned. A CTA per 8 columns (a smaller grid walks the tiles).
extern "C" __global__ void __launch_bounds__(LINEAR_ROWS_WARPS * WARP, 2)
    linear_rows(const bf16* __restrict__ x, const bf16* __restrict__ w, bf16* __restrict__ y, int m, int n, int k,
                float beta) {
    constexpr int AHEAD = 8, CHAINS = LINEAR_ROWS_CHAINS, WARPS = LINEAR_ROWS_WARPS, HELD = CHAINS / WARPS;
    static_assert(CHAINS % WARPS == 0 && AHEAD % HELD == 0, "a warp's chunks cycle through its chains");
    __shared__ float partial[CHAINS][4][WARP];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int g = lane / 4, t = lane % 4;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const bf16* x_lo = x + (size_t)g * k;
    const bf16* x_hi = x + (size_t)(g + 8) * k;
    const int chunks = (k + 31) / 32;
    for (int col0 = blockIdx.x * 8; col0 < n; col0 += gridDim.x * 8) {
        // acc[s]: chain warp + s * WARPS (chunk c0 + u * WARPS of a pass is in acc[u % HELD]).
        float acc[HELD][4];
#pragma unroll
        for (int s = 0; s < HELD; ++s)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[s][r] = 0.f;
        const bool col_in = col0 + g < n;
        const bf16* w_row = w + (size_t)(col_in ? col0 + g : 0) * k;
        for (int c0 = warp; c0 < chunks; c0 += WARPS * AHEAD) {
            uint4 wv[AHEAD], lo[AHEAD], hi[AHEAD];
#pragma unroll
            for (int u = 0; u < AHEAD; ++u) {
                const int kk = 32 * (c0 + u * WARPS) + 8 * t;
                const bool in_k = kk < k;
                wv[u] = in_k && col_in ? __ldcs(reinterpret_cast<const uint4*>(w_row + kk)) : zero;
                lo[u] = in_k && g < m ? *reinterpret_cast<const uint4*>(x_lo + kk) : zero;
                hi[u] = in_k && g + 8 < m ? *reinterpret_cast<const uint4*>(x_hi + kk) : zero;
            }
#pragma unroll
            for (int u = 0; u < AHEAD; ++u) {
                mma_bf16(acc[u % HELD], lo[u].x, hi[u].x, lo[u].y, hi[u].y, wv[u].x, wv[u].y);
                mma_bf16(acc[u % HELD], lo[u].z, hi[u].z, lo[u].w, hi[u].w, wv[u].z, wv[u].w);
            }
        }
#pragma unroll
        for (int s = 0; s < HELD; ++s)
#pragma unroll
            for (int r = 0; r < 4; ++r) partial[warp + s * WARPS][r][lane] = acc[s][r];
        __syncthreads();
        // Value v of the tile: accumulator r = v / WARP of lane v % WARP.
        if (threadIdx.x < 4 * WARP) {
            const int r = threadIdx.x / WARP, from = threadIdx.x % WARP;
            float sum = 0.f;
#pragma unroll
            for (int q = 0; q < CHAINS; ++q) sum += partial[q][r][from];
            const int row = from / 4 + (r >= 2 ? 8 : 0);
            const int col = col0 + 2 * (from % 4) + (r % 2);
            if (row < m && col < n) {
                bf16* out = y + (size_t)row * n + col;
                *out = to_bf(beta == 0.f ? sum : sum + beta * to_f(*out));
            }
        }
        __syncthreads();
    }
}

// Twin: twin.rs argmax_rows (candle's argmax: the first index of the maximum, NaNs skipped; a
// row whose value 0 is NaN gives 0, as candle keeps a NaN it starts from). One CTA per row, 8
// logits per load when vocab % 8 == 0 (rows 16-byte aligned), else one at a time; a (value,
// index) reduction over the warp, then over the warps in order.
// z [rows, vocab] -> out [rows] (u32).
extern "C" __global__ void argmax_rows(const bf16* __restrict__ z, unsigned* __restrict__ out, int rows, int vocab) {
    __shared__ float scratch_v[WARP];
    __shared__ int scratch_i[WARP];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const bf16* zr = z + (size_t)row * vocab;
    float bv;
    int bi;
    if (vocab % VEC == 0) {
        row_argmax<VEC>(zr, vocab, &bv, &bi);
    } else {
        row_argmax<1>(zr, vocab, &bv, &bi);
    }
#pragma unroll
    for (int o = WARP / 2; o > 0; o /= 2) {
        const float v2 = __shfl_xor_sync(0xffffffffu, bv, o);
        const int i2 = __shfl_xor_sync(0xffffffffu, bi, o);
        if (argmax_beats(v2, i2, bv, bi)) {
            bv = v2;
            bi = i2;
        }
    }
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    if (lane == 0) {
        scratch_v[warp] = bv;
        scratch_i[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int wi = 1; wi < warps; ++wi)
            if (argmax_beats(scratch_v[wi], scratch_i[wi], bv, bi)) {
                bv = scratch_v[wi];
                bi = scratch_i[wi];
            }
        out[row] = (bi < 0 || isnan(to_f(zr[0]))) ? 0u : (unsigned)bi;
    }
}

// dst [count, cols] = src [idx[r], cols] for r < count.
extern "C" __global__ void gather_rows(const bf16* __restrict__ src, const unsigned* __restrict__ idx,
                                       bf16* __restrict__ dst, int count, int cols) {
    const int r = blockIdx.x;
    if (r >= count) return;
    const bf16* s = src + (size_t)idx[r] * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) dst[(size_t)r * cols + i] = s[i];
}

// dst [idx[r], cols] = src [r, cols] for r < count.
extern "C" __global__ void scatter_rows(const bf16* __restrict__ src, const unsigned* __restrict__ idx,
                                        bf16* __restrict__ dst, int count, int cols) {
    const int r = blockIdx.x;
    if (r >= count) return;
    bf16* d = dst + (size_t)idx[r] * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) d[i] = src[(size_t)r * cols + i];
}

__device__ __forceinline__ float as_float(float x) { return x; }
__device__ __forceinline__ float as_float(bf16 x) { return to_f(x); }

__device__ __forceinline__ bool aligned_to(const void* p, unsigned bytes) {
    return reinterpret_cast<unsigned long long>(p) % bytes == 0;
}

// 4 consecutive values as floats, one 16-byte (fp32) or 8-byte (bf16) access.
__device__ __forceinline__ void load4(const float* p, float out[4]) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
}
__device__ __forceinline__ void load4(const bf16* p, float out[4]) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
}
__device__ __forceinline__ void store4(float* p, const float in[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
}
__device__ __forceinline__ void store4(bf16* p, const float in[4]) {
    const __nv_bfloat162 a = __floats2bfloat162_rn(in[0], in[1]), b = __floats2bfloat162_rn(in[2], in[3]);
    uint2 raw;
    raw.x = *reinterpret_cast<const unsigned*>(&a);
    raw.y = *reinterpret_cast<const unsigned*>(&b);
    *reinterpret_cast<uint2*>(p) = raw;
}

// partial [gridDim.x] = this CTA's share of sum(x^2) over x [n] (NaN and Inf propagate): 4 values
// per access where x is aligned to them, then the rest one at a time.
template <typename T>
__device__ void sum_squares(const T* __restrict__ x, float* __restrict__ partial, long long n) {
    __shared__ float scratch[WARP];
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    float s = 0.f;
    long long done = 0;
    if (aligned_to(x, 4 * sizeof(T))) {
        for (long long q = first; q < n / 4; q += stride) {
            float v[4];
            load4(x + 4 * q, v);
            s += v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3];
        }
        done = n / 4 * 4;
    }
    for (long long i = done + first; i < n; i += stride) {
        const float v = as_float(x[i]);
        s += v * v;
    }
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

extern "C" __global__ void sum_squares_f32(const float* __restrict__ x, float* __restrict__ partial, long long n) {
    sum_squares(x, partial, n);
}

extern "C" __global__ void sum_squares_bf16(const bf16* __restrict__ x, float* __restrict__ partial, long long n) {
    sum_squares(x, partial, n);
}

// acc [n] += g [n]: a step's bf16 gradients into the optimizer's fp32 accumulator.
extern "C" __global__ void accumulate_bf16(float* __restrict__ acc, const bf16* __restrict__ g, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        acc[i] += to_f(g[i]);
}

// Twin: twin.rs adamw_update (dflash_reference::optim::AdamW::step on one parameter), its
// gradient first scaled by `grad_scale` (global-norm clipping). p, m, v [n] fp32, g [n] fp32 or
// bf16 (a step's own gradients, read where the backward wrote them) -> updated p, m, v and
// p_bf16 = bf16(p). m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2; p -= lr*((m/bc1) / (sqrt(v/bc2) + eps) + wd*p).
// One value's update (`adamw`'s arithmetic, in one place for both of its loops).
struct AdamWStep {
    float lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale;
    __device__ __forceinline__ void apply(float g, float& p, float& m, float& v) const {
        const float gi = g * grad_scale;
        m = beta1 * m + (1.f - beta1) * gi;
        v = beta2 * v + (1.f - beta2) * gi * gi;
        p = p - lr * ((m / bc1) / (sqrtf(v / bc2) + eps) + weight_decay * p);
    }
};

// 4 values per thread and access where every buffer is aligned to them (bound by HBM: 28 bytes a
// value with bf16 gradients), then the rest one at a time.
template <typename G>
__device__ void adamw(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
                      bf16* __restrict__ p_bf16, long long n, const AdamWStep step) {
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (aligned_to(p, 16) && aligned_to(m, 16) && aligned_to(v, 16) && aligned_to(g, 4 * sizeof(G)) &&
        aligned_to(p_bf16, 8)) {
        for (long long q = first; q < n / 4; q += stride) {
            float pv[4], gv[4], mv[4], vv[4];
            load4(p + 4 * q, pv);
            load4(g + 4 * q, gv);
            load4(m + 4 * q, mv);
            load4(v + 4 * q, vv);
#pragma unroll
            for (int j = 0; j < 4; ++j) step.apply(gv[j], pv[j], mv[j], vv[j]);
            store4(m + 4 * q, mv);
            store4(v + 4 * q, vv);
            store4(p + 4 * q, pv);
            store4(p_bf16 + 4 * q, pv);
        }
        done = n / 4 * 4;
    }
    for (long long i = done + first; i < n; i += stride) {
        float pi = p[i], mi = m[i], vi = v[i];
        step.apply(as_float(g[i]), pi, mi, vi);
        m[i] = mi;
        v[i] = vi;
        p[i] = pi;
        p_bf16[i] = to_bf(pi);
    }
}

extern "C" __global__ void adamw_update(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                                        float* __restrict__ v, bf16* __restrict__ p_bf16, long long n, float lr,
                                        float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2,
                                        float grad_scale) {
    adamw(p, g, m, v, p_bf16, n, AdamWStep{lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale});
}

extern "C" __global__ void adamw_update_bf16_grad(float* __restrict__ p, const bf16* __restrict__ g,
                                                  float* __restrict__ m, float* __restrict__ v,
                                                  bf16* __restrict__ p_bf16, long long n, float lr, float beta1,
                                                  float beta2, float eps, float weight_decay, float bc1, float bc2,
                                                  float grad_scale) {
    adamw(p, g, m, v, p_bf16, n, AdamWStep{lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale});
}

// splitmix64: a well-mixed 64-bit hash of `z`.
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Twin: twin.rs fill_normal (normal_at). dst [n] = bf16(mean + std * z_i), z_i a standard normal
// (Box-Muller) from the hash of (seed, i): random weights and inputs made on the device.
extern "C" __global__ void fill_normal_bf16(bf16* __restrict__ dst, long long n, unsigned long long seed, float mean,
                                            float std) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const unsigned long long h = mix64(seed ^ mix64((unsigned long long)i));
        const float u1 = (float)((h >> 40) + 1) * 5.9604645e-8f;  // (0, 1]
        const float u2 = (float)(h & 0xffffffull) * 5.9604645e-8f;  // [0, 1)
        dst[i] = to_bf(mean + std * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
    }
}
