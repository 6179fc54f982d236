//! Which documents train and which are held out, and the order of each epoch (spec section 6):
//! both a pure function of the seed, so a resumed run sees the same rows.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Stream of the seed's generator that draws the held-out split (epochs use streams 0, 1, ...
/// of another generator).
const SPLIT_STREAM: u64 = u64::MAX;

/// `(train, held_out)` indices (of conversations), each ascending: `round(fraction * n)` drawn
/// without replacement from `0..n` by `seed`.
pub fn split(n: usize, fraction: f64, seed: u64) -> (Vec<usize>, Vec<usize>) {
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(SPLIT_STREAM);
    order.shuffle(&mut rng);
    let k = ((n as f64) * fraction).round() as usize;
    let (held, train) = order.split_at(k.min(n));
    let (mut held, mut train) = (held.to_vec(), train.to_vec());
    held.sort_unstable();
    train.sort_unstable();
    (train, held)
}

/// The order of `docs` in epoch `epoch`: a permutation drawn from `(seed, epoch)` alone.
pub fn epoch_order(docs: &[usize], seed: u64, epoch: u64) -> Vec<usize> {
    let mut order = docs.to_vec();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(epoch);
    order.shuffle(&mut rng);
    order
}
