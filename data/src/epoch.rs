//! Which documents train and which are held out, and the order of each epoch (spec section 6):
//! both a pure function of the seed (and each conversation's text), so a resumed run sees the
//! same rows.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Whether the conversation of content hash `content` is held out: `fraction` of the hash
/// space, mixed with `seed` (splitmix64). A function of the conversation's own text and the seed
/// alone, so adding or removing other lines or files, or changing an option that keeps or drops
/// other conversations, never moves it between training and held-out; equal lines go together.
pub fn held_out(content: u64, fraction: f64, seed: u64) -> bool {
    use dflash_reference::hash::{splitmix64, unit};
    unit(splitmix64(seed ^ splitmix64(content))) < fraction
}

/// The order of `docs` in epoch `epoch`: a permutation drawn from `(seed, epoch)` alone.
pub fn epoch_order(docs: &[usize], seed: u64, epoch: u64) -> Vec<usize> {
    let mut order = docs.to_vec();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(epoch);
    order.shuffle(&mut rng);
    order
}
