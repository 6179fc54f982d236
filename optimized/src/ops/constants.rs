//! Constants shared by the launchers, the CPU twins and the CUDA kernels: defined once here and
//! injected into every NVRTC compile as `#define`s ([`prelude`]), so the two sides cannot drift.

/// Keys per KV tile of the attention kernels and their twin.
pub const TILE_K: usize = 64;
/// Query rows a warpgroup of the attention kernels holds.
pub const WG_ROWS: usize = 64;
/// Query rows staged per step of the key-major attention backward.
pub const DKDV_CHUNK: usize = 64;
/// K/V stages of the query-major attention kernels.
pub const KV_STAGES: usize = 3;
/// bf16 values per 16-byte vector load of the elementwise kernels.
pub const VEC: usize = 8;
/// 8-column chunks one thread of `rms_norm_backward` holds: rows of at most this many x
/// `VEC` x `ROW_THREADS` columns.
pub const MAX_CHUNKS_PER_THREAD: usize = 4;
/// Elements one lane of a head kernel keeps: head dims of at most this many x 32.
pub const MAX_HEAD_LANE_ELEMS: usize = 8;
/// Threads per CTA of the row kernels (`rms_norm_*`, `ce_grad_rows`, copies).
pub const ROW_THREADS: u32 = 256;
/// CTAs of the kernels that reduce a parameter gradient into per-CTA partials: the number of
/// partial rows `column_sum` adds up.
pub const GRAD_PARTS: usize = 528;
/// Partials per parameter of the gradient-norm reduction (`sum_squares`).
pub const NORM_PARTS: usize = 64;
/// CTAs of the grid-stride elementwise kernels (2 waves of 132 SMs x 8).
pub const ELEMENTWISE_CTAS: u32 = 2112;

/// The `#define`s every kernel source is compiled with (and hashed with).
pub fn prelude() -> String {
    [
        ("TILE_K", TILE_K),
        ("WG_ROWS", WG_ROWS),
        ("DKDV_CHUNK", DKDV_CHUNK),
        ("KV_STAGES", KV_STAGES),
        ("VEC", VEC),
        ("MAX_CHUNKS_PER_THREAD", MAX_CHUNKS_PER_THREAD),
        ("MAX_HEAD_LANE_ELEMS", MAX_HEAD_LANE_ELEMS),
    ]
    .iter()
    .map(|(name, value)| format!("#define {name} {value}\n"))
    .collect()
}
