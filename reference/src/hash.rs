//! splitmix64: the counter-based hash behind every seeded draw that must come out the same
//! whoever computes it and in whatever order (the Gumbel draws of sampled decoding, random
//! weights made on the device, the held-out split).

/// splitmix64's finaliser of `z` (plus its increment): a well-mixed 64-bit hash; `mix64` of the
/// kernel source.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The top 53 bits of `x` as a uniform draw in [0, 1) (a double holds them exactly).
pub fn unit(x: u64) -> f64 {
    (x >> 11) as f64 / (1u64 << 53) as f64
}
