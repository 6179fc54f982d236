//! Constants shared by the launchers, the CPU twins and the CUDA kernels: defined once here and
//! injected into every NVRTC compile as `#define`s ([`prelude`]), so the two sides cannot drift.

/// Keys per KV tile of the attention kernels and their twin (the forward's: [`forward_tile_k`]).
pub const TILE_K: usize = 64;
/// Query rows a warpgroup of the attention kernels holds.
pub const WG_ROWS: usize = 64;
/// Query rows staged per step of the key-major attention backward.
pub const DKDV_CHUNK: usize = 64;
/// How far (log2 units) a tile's largest score may exceed the attention forward's running max
/// before the max moves: probabilities stay at most 2^8, and the accumulator is rescaled only
/// when the max moves by more (the kernel and its twin; exact, since the row's sum and
/// accumulator are both taken against the same max).
pub const RESCALE_SLACK_LOG2: usize = 8;
/// K/V stages of the query-major attention kernels.
pub const KV_STAGES: usize = 3;
/// bf16 values per 16-byte vector load of the elementwise kernels.
pub const VEC: usize = 8;
/// 8-column chunks one thread of `rms_norm_backward` holds: rows of at most this many x
/// `VEC` x `ROW_THREADS` columns.
pub const MAX_CHUNKS_PER_THREAD: usize = 4;
/// Elements one lane of a head kernel keeps: head dims of at most this many x 32.
pub const MAX_HEAD_LANE_ELEMS: usize = 8;
/// Values of x a lane of the forward head kernels (`head_norm_rope_forward`, `rope_forward`)
/// holds, its warp's rows' loads in flight together: a warp takes `HEAD_LANE_VALUES / (d / 32)`
/// (token, head) rows (4 at d = 128).
pub const HEAD_LANE_VALUES: usize = 16;
/// Threads per CTA of the row kernels (`rms_norm_*`, `ce_grad_rows`, copies).
pub const ROW_THREADS: u32 = 256;
/// CTAs of the kernels that reduce a parameter gradient into per-CTA partials: the number of
/// partial rows `column_sum` adds up.
pub const GRAD_PARTS: usize = 528;
/// Partials per parameter of the gradient-norm reduction (`sum_squares`): its CTAs, one wave
/// of 132 SMs x 8 (64 CTAs read the Qwen3-8B drafter's 1.05B bf16 gradients in 25 ms, 84 GB/s,
/// a tenth of its step's time on the H200).
pub const NORM_PARTS: usize = 1056;
/// Most rows `linear_rows` takes: one mma's 16 (a verify block of 16 tokens, the drafter's block).
pub const LINEAR_ROWS: usize = 16;
/// Output columns of a `linear_rows` CTA (one mma's 8).
pub const LINEAR_ROWS_COLUMNS: usize = 8;
/// Warps of a `linear_rows` CTA, splitting k.
pub const LINEAR_ROWS_WARPS: usize = 8;
/// Accumulator chains of `linear_rows` (chunk c of 32 k into chain c % 16; two a warp).
pub const LINEAR_ROWS_CHAINS: usize = 16;
/// CTAs of the grid-stride elementwise kernels (2 waves of 132 SMs x 8).
pub const ELEMENTWISE_CTAS: u32 = 2112;

/// Rows per chunk of the chunked GatedDeltaNet forward (the WY/UT form), its kernels and twin.
pub const GDN_CHUNK: usize = 64;

/// Threads of the chunk-parallel delta-rule CTAs (`gated_delta_prepare`, `gated_delta_output`):
/// 8 warps, and 4 lanes per column of the chunk's UT inverse.
pub const GDN_THREADS: usize = 4 * GDN_CHUNK;
/// Threads of a `gated_delta_state` CTA: a warp per 16 rows of the chunk.
pub const GDN_STATE_THREADS: usize = 2 * GDN_CHUNK;
/// State columns (of `d_v`) one `gated_delta_state` CTA carries through the chunks.
pub const GDN_STATE_COLS: usize = 32;
/// Largest key and value head dims of the delta-rule kernels (multiples of 16; Qwen3.5/3.6: 128).
pub const GDN_MAX_HEAD_DIM: usize = 128;
/// Extra bf16 columns of the delta-rule kernels' shared tiles (rows 16 bytes apart, fragment loads
/// free of bank conflicts).
pub const GDN_PAD: usize = 8;
/// Most taps of the GPU's causal conv (`conv1d_silu` keeps them in registers; Qwen3.5/3.6: 4).
pub const GDN_MAX_CONV: usize = 4;
/// Tokens one `conv1d_silu` thread runs through (its last inputs in registers).
pub const GDN_CONV_TOKENS: usize = 32;
/// Values one lane of `gated_rms_norm` holds: value head dims of at most this many x 32.
pub const GDN_NORM_LANE_ELEMS: usize = 8;

/// Keys per KV tile of the attention forward and its twin at `head_dim` (injected per head dim as
/// `FORWARD_TILE_K`): two of the backward's tiles up to head dim 128, where a warpgroup's 64 x 128
/// scores fit its registers beside the accumulator (half the tile barriers and softmax row
/// steps); `TILE_K` above.
pub fn forward_tile_k(head_dim: usize) -> usize {
    if head_dim <= 128 {
        MAX_FORWARD_TILE_K
    } else {
        TILE_K
    }
}

/// The largest [`forward_tile_k`] (the twin's row of scores lives on the stack at this size).
pub const MAX_FORWARD_TILE_K: usize = 2 * TILE_K;

/// Threads of the attention forward's CTA (injected per head dim as `FORWARD_THREADS`): up to
/// head dim 128, two computing warpgroups and a loading one (warp-specialised; the computing
/// ones' 240 registers hold a 64 x 128 tile of scores beside the accumulator); above, the two
/// computing warpgroups load their own tiles, as 240 registers would spill their accumulator.
pub fn forward_threads(head_dim: usize) -> usize {
    if head_dim <= 128 {
        3 * 128
    } else {
        2 * 128
    }
}

/// The `#define`s every kernel source is compiled with (and hashed with).
pub fn prelude() -> String {
    [
        ("TILE_K", TILE_K),
        ("WG_ROWS", WG_ROWS),
        ("DKDV_CHUNK", DKDV_CHUNK),
        ("KV_STAGES", KV_STAGES),
        ("RESCALE_SLACK_LOG2", RESCALE_SLACK_LOG2),
        ("VEC", VEC),
        ("MAX_CHUNKS_PER_THREAD", MAX_CHUNKS_PER_THREAD),
        ("MAX_HEAD_LANE_ELEMS", MAX_HEAD_LANE_ELEMS),
        ("HEAD_LANE_VALUES", HEAD_LANE_VALUES),
        ("LINEAR_ROWS", LINEAR_ROWS),
        ("LINEAR_ROWS_WARPS", LINEAR_ROWS_WARPS),
        ("LINEAR_ROWS_CHAINS", LINEAR_ROWS_CHAINS),
        ("GDN_CHUNK", GDN_CHUNK),
        ("GDN_THREADS", GDN_THREADS),
        ("GDN_STATE_THREADS", GDN_STATE_THREADS),
        ("GDN_STATE_COLS", GDN_STATE_COLS),
        ("GDN_MAX_HEAD_DIM", GDN_MAX_HEAD_DIM),
        ("GDN_PAD", GDN_PAD),
        ("GDN_MAX_CONV", GDN_MAX_CONV),
        ("GDN_CONV_TOKENS", GDN_CONV_TOKENS),
        ("GDN_NORM_LANE_ELEMS", GDN_NORM_LANE_ELEMS),
    ]
    .iter()
    .map(|(name, value)| format!("#define {name} {value}\n"))
    .collect()
}
