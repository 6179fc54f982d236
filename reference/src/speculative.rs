//! Greedy speculative decoding with a target and a drafter (spec section 4), and the plain
//! greedy decoding it must reproduce exactly.

use candle_core::{Tensor, D};

use crate::drafter::{DraftInput, Drafter};
use crate::error::{Error, Result};
use crate::target::Target;

/// The result of a speculative decode.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecOutput {
    /// The generated tokens (prompt excluded): `max_new` of them, or fewer where a stop id came
    /// first (then it is the last token, as engines return it). Those the plain decode emits:
    /// the prefill's token, then each verify step's accepted drafts and the target's token
    /// after them.
    pub tokens: Vec<u32>,
    /// `A + 1` for every verify step (accepted drafts plus the target's token), in `[1, B]`, the
    /// last step's too where `max_new` or a stop id cuts its tokens (spec section 4's tau, as the
    /// published taus count it: the drafter's acceptance, not the budget's or the stop's cut), so
    /// they sum to at least the tokens generated less the prefill's. No step runs once the
    /// tokens end (a stop id, `max_new`), as engines stop.
    pub accept_lengths: Vec<usize>,
}

impl SpecOutput {
    /// Acceptance length `tau`: the mean of `A + 1` over verify steps.
    pub fn tau(&self) -> f64 {
        self.accept_lengths.iter().sum::<usize>() as f64 / self.accept_lengths.len().max(1) as f64
    }

    /// The output after the prefill chose `first`: true when decoding ends there (`first` is a
    /// stop id, or `max_new` is 1 or 0; then no verify step runs).
    pub fn start(&mut self, first: u32, max_new: usize, stop: &[u32]) -> bool {
        self.extend_to(&[first], max_new, stop)
    }

    /// Adds one verify step that emits `emitted` (the `A` accepted drafts and the target's token
    /// after them): its `A + 1` whole, and its tokens up to the first of two cuts, `max_new`
    /// tokens in all or the first id of `stop` (kept as the last token); true when decoding ends
    /// here (either cut reached). Both decoders' one rule for cutting the last step.
    pub fn push_step(&mut self, emitted: &[u32], max_new: usize, stop: &[u32]) -> bool {
        self.accept_lengths.push(emitted.len());
        self.extend_to(emitted, max_new, stop)
    }

    /// `tokens` added up to the cuts of [`Self::push_step`]; whether decoding ends.
    fn extend_to(&mut self, tokens: &[u32], max_new: usize, stop: &[u32]) -> bool {
        let room = max_new.saturating_sub(self.tokens.len());
        let upto = stop_len(tokens, stop);
        self.tokens.extend(&tokens[..upto.min(room)]);
        tokens[..upto].last().is_some_and(|t| stop.contains(t)) || self.tokens.len() >= max_new
    }
}

/// The length of `tokens` through their first id in `stop` (all of them when none is; an empty
/// `stop` never stops).
pub fn stop_len(tokens: &[u32], stop: &[u32]) -> usize {
    tokens.iter().position(|t| stop.contains(t)).map_or(tokens.len(), |i| i + 1)
}

/// The acceptance of many speculative decodes with blocks of `B`.
#[derive(Clone, Debug, PartialEq)]
pub struct Acceptance {
    /// `reached[k]`: verify steps whose `A + 1` is above `k` (`reached[0]` = all steps).
    pub reached: Vec<usize>,
    /// Sum of `A + 1` over all verify steps.
    pub sum: usize,
    /// Each decode's own tau.
    pub per_prompt: Vec<f64>,
}

impl Acceptance {
    pub fn new(block_size: usize) -> Self {
        Acceptance { reached: vec![0; block_size], sum: 0, per_prompt: Vec::new() }
    }

    /// Adds one decode (one that ended at its prefill's token, with no verify step, has no
    /// tau of its own).
    pub fn add(&mut self, out: &SpecOutput) {
        for &a in &out.accept_lengths {
            self.sum += a;
            self.reached.iter_mut().take(a).for_each(|r| *r += 1);
        }
        if !out.accept_lengths.is_empty() {
            self.per_prompt.push(out.tau());
        }
    }

    /// Tau as the mean of `A + 1` over every verify step of every decode.
    pub fn tau_over_steps(&self) -> f64 {
        self.sum as f64 / self.reached[0].max(1) as f64
    }

    /// Tau as the mean of the decodes' own taus.
    pub fn tau_over_prompts(&self) -> f64 {
        self.per_prompt.iter().sum::<f64>() / self.per_prompt.len().max(1) as f64
    }

    /// For block positions `k = 1..B-1`: the fraction of verify steps that accepted draft `k`.
    pub fn per_position(&self) -> Vec<f64> {
        let steps = self.reached[0].max(1) as f64;
        self.reached[1..].iter().map(|&r| r as f64 / steps).collect()
    }
}

/// The argmax token of every row of `logits` `[R, V]` (the kernels' semantics, NaN and Inf
/// included: the decoders refuse such logits first, [`check_finite`]).
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?)
}

/// Why decoding refuses logits holding NaN or Inf (its likely cause): a decoder's argmax of them
/// would be token 0 on both sides, garbage decoded as full acceptance.
pub const NON_FINITE_LOGITS: &str = "NaN or Inf: a model's weights hold non-finite values, or its config is wrong";

/// Refuses logits holding NaN or Inf ([`NON_FINITE_LOGITS`]).
fn check_finite(logits: &Tensor) -> Result<()> {
    let sum = logits.to_dtype(candle_core::DType::F64)?.sum_all()?.to_scalar::<f64>()?;
    match sum.is_finite() {
        true => Ok(()),
        false => Err(Error::invalid("logits", NON_FINITE_LOGITS)),
    }
}

/// How the target picks each token (spec section 4): its argmax, or a seeded sample at a
/// temperature. A sample is the Gumbel-max draw `argmax_v z_v / T + g(seed, position, v)`: a
/// function of the logits and the token's position alone, so speculative decoding (proposals by
/// argmax, accepted while the target's sample at that position equals the proposal) emits exactly
/// the tokens plain sampling emits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    Greedy,
    Temperature { temperature: f64, seed: u64 },
}

impl Sampling {
    /// Checks the temperature (finite, above 0).
    pub fn new(temperature: f64, seed: u64) -> Result<Self> {
        if temperature == 0.0 {
            return Ok(Sampling::Greedy);
        }
        if !(temperature.is_finite() && temperature > 0.0) {
            return Err(Error::invalid(
                "temperature",
                format!("{temperature}: must be 0 (greedy) or a finite value above 0"),
            ));
        }
        Ok(Sampling::Temperature { temperature, seed })
    }

    /// The scores whose argmax is the token at absolute position `position`, from the logits
    /// `row` `[V]` that predict it: the logits (greedy) or `z / T + gumbel(seed, position, v)`.
    pub fn scores(&self, row: &[f64], position: usize) -> Vec<f64> {
        match *self {
            Sampling::Greedy => row.to_vec(),
            Sampling::Temperature { temperature, seed } => {
                row.iter().enumerate().map(|(v, &z)| z / temperature + gumbel(seed, position, v)).collect()
            }
        }
    }

    /// The token at absolute position `position` from the logits `row` `[V]` that predict it:
    /// the first index of the largest score.
    pub fn choose(&self, row: &[f64], position: usize) -> u32 {
        let mut best = (0, f64::NEG_INFINITY);
        for (v, s) in self.scores(row, position).into_iter().enumerate() {
            if s > best.1 {
                best = (v, s);
            }
        }
        best.0 as u32
    }

    /// The tokens at positions `first..first + R` from the rows of `logits` `[R, V]`.
    pub fn choose_rows(&self, logits: &Tensor, first: usize) -> Result<Vec<u32>> {
        check_finite(logits)?;
        match self {
            Sampling::Greedy => argmax_rows(logits),
            Sampling::Temperature { .. } => {
                let rows = logits.to_dtype(candle_core::DType::F64)?.to_vec2::<f64>()?;
                Ok(rows.iter().enumerate().map(|(i, row)| self.choose(row, first + i)).collect())
            }
        }
    }
}

/// The Gumbel draw of token `v` at `position` under `seed`: `-ln(-ln u)` with `u` in (0, 1) from
/// splitmix64 of the three (counter-based: the same value whoever asks, in whatever order).
pub fn gumbel(seed: u64, position: usize, v: usize) -> f64 {
    let x = crate::hash::splitmix64(
        seed ^ (position as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (v as u64).wrapping_mul(0xd1b5_4a32_d192_ed03),
    );
    let u = crate::hash::unit(x) + 0.5 / (1u64 << 53) as f64;
    -(-u.ln()).ln()
}

fn check_prompt(prompt: &[u32]) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::invalid("prompt", "is empty"));
    }
    Ok(())
}

/// Plain greedy decoding: `max_new` tokens, each the target's argmax after all before it.
pub fn greedy_decode(target: &dyn Target, prompt: &[u32], max_new: usize) -> Result<Vec<u32>> {
    plain_decode(target, prompt, max_new, &Sampling::Greedy)
}

/// Plain decoding: `max_new` tokens, each the target's choice under `sampling` after all before.
pub fn plain_decode(target: &dyn Target, prompt: &[u32], max_new: usize, sampling: &Sampling) -> Result<Vec<u32>> {
    plain_decode_until(target, prompt, max_new, sampling, &[])
}

/// [`plain_decode`] that ends after the first token in `stop` (the target's end-of-sequence ids;
/// the stop id is the last token returned, as engines return it) or at `max_new` tokens,
/// whichever comes first; an empty `stop` decodes `max_new` tokens.
pub fn plain_decode_until(
    target: &dyn Target,
    prompt: &[u32],
    max_new: usize,
    sampling: &Sampling,
    stop: &[u32],
) -> Result<Vec<u32>> {
    check_prompt(prompt)?;
    let mut seq = prompt.to_vec();
    for _ in 0..max_new {
        let logits = target.forward(&seq, &[])?.logits;
        let next = sampling.choose_rows(&logits.narrow(0, seq.len() - 1, 1)?, seq.len())?[0];
        seq.push(next);
        if stop.contains(&next) {
            break;
        }
    }
    Ok(seq.split_off(prompt.len()))
}

/// Greedy speculative decoding of `max_new` tokens: draft a block `[t, MASK x (B-1)]` from the
/// committed positions' features, verify it with one target forward, accept the longest
/// prefix the target agrees with, and take the target's next token as the new bonus.
pub fn speculative_decode(
    target: &dyn Target,
    drafter: &Drafter,
    prompt: &[u32],
    max_new: usize,
) -> Result<SpecOutput> {
    speculative_decode_with(target, drafter, prompt, max_new, &Sampling::Greedy)
}

/// Speculative decoding under `sampling` (spec section 4): the drafter proposes by argmax, the
/// target's choice at each verify position (its argmax, or its seeded sample) accepts the
/// longest agreeing prefix, and its choice after it is the new bonus; the output equals
/// [`plain_decode`]'s under the same `sampling`.
pub fn speculative_decode_with(
    target: &dyn Target,
    drafter: &Drafter,
    prompt: &[u32],
    max_new: usize,
    sampling: &Sampling,
) -> Result<SpecOutput> {
    speculative_decode_until(target, drafter, prompt, max_new, sampling, &[])
}

/// [`speculative_decode_with`] that ends after the first token in `stop` (the target's
/// end-of-sequence ids) or at `max_new` tokens: the last verify step's tokens after the first cut
/// are dropped, its `A + 1` counted whole ([`SpecOutput::push_step`]); the output equals
/// [`plain_decode_until`]'s with the same `stop`. An empty `stop` decodes `max_new` tokens.
pub fn speculative_decode_until(
    target: &dyn Target,
    drafter: &Drafter,
    prompt: &[u32],
    max_new: usize,
    sampling: &Sampling,
    stop: &[u32],
) -> Result<SpecOutput> {
    check_prompt(prompt)?;
    target.check_drafter(&drafter.config)?;
    let layer_ids = &drafter.config.target_layer_ids;
    let b = drafter.config.block_size;
    let head = target.frozen_head();
    let prefill = target.forward(prompt, layer_ids)?;
    let mut features = Tensor::cat(&prefill.hidden, 1)?; // [n, F*H], committed positions
    let mut bonus = sampling.choose_rows(&prefill.logits.narrow(0, prompt.len() - 1, 1)?, prompt.len())?[0];
    let mut seq = prompt.to_vec();
    let mut out = SpecOutput { tokens: Vec::new(), accept_lengths: Vec::new() };
    let mut done = out.start(bonus, max_new, stop);
    while !done {
        let n = seq.len();
        let draft_logits = drafter.forward(&head, &DraftInput::inference(features, bonus, b)?)?;
        let draft_logits = draft_logits.narrow(0, 1, b - 1)?;
        check_finite(&draft_logits)?;
        let drafts = argmax_rows(&draft_logits)?; // d_1..d_{B-1}
        let mut verify = seq.clone();
        verify.push(bonus);
        verify.extend(&drafts);
        let checked = target.forward(&verify, layer_ids)?;
        // chosen[i] is the target's token for position n+i+1.
        let chosen = sampling.choose_rows(&checked.logits.narrow(0, n, b)?, n + 1)?;
        let accepted = drafts.iter().zip(&chosen).take_while(|(d, g)| d == g).count();
        seq.push(bonus);
        seq.extend(&drafts[..accepted]);
        let emitted: Vec<u32> = drafts[..accepted].iter().chain([&chosen[accepted]]).copied().collect();
        done = out.push_step(&emitted, max_new, stop);
        bonus = chosen[accepted];
        features = Tensor::cat(&checked.hidden, 1)?.narrow(0, 0, seq.len())?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two decodes, [3, 1] and [1, 1, 4]: both means are 2 (10 over 5 steps; 2 and 2). A third,
    /// [4], makes them differ: 14/6 over the steps, (2 + 2 + 4)/3 over the prompts.
    #[test]
    fn acceptance_counts_steps_and_prompts_apart() {
        let mut a = Acceptance::new(4);
        a.add(&SpecOutput { tokens: vec![], accept_lengths: vec![3, 1] });
        a.add(&SpecOutput { tokens: vec![], accept_lengths: vec![1, 1, 4] });
        assert_eq!(a.reached, vec![5, 2, 2, 1]);
        assert_eq!(a.per_position(), vec![0.4, 0.4, 0.2]);
        assert_eq!(a.tau_over_steps(), 2.0);
        assert_eq!(a.tau_over_prompts(), 2.0);
        a.add(&SpecOutput { tokens: vec![], accept_lengths: vec![4] });
        assert_eq!(a.tau_over_steps(), 14.0 / 6.0);
        assert_eq!(a.tau_over_prompts(), 8.0 / 3.0);
    }

    /// One rule cuts the last verify step: at `max_new` tokens or after the first stop id,
    /// whichever comes first, its `A + 1` counted whole either way; an empty stop set never stops.
    #[test]
    fn a_step_is_cut_at_max_new_or_after_the_first_stop_id() {
        let step = |emitted: &[u32], max_new, stop: &[u32]| {
            let mut out = SpecOutput { tokens: vec![9], accept_lengths: vec![1] };
            let done = out.push_step(emitted, max_new, stop);
            (out.tokens, out.accept_lengths, done)
        };
        assert_eq!(step(&[1, 2, 3], 10, &[]), (vec![9, 1, 2, 3], vec![1, 3], false));
        assert_eq!(step(&[1, 2, 3], 3, &[]), (vec![9, 1, 2], vec![1, 3], true));
        assert_eq!(step(&[1, 2, 3], 10, &[7, 2]), (vec![9, 1, 2], vec![1, 3], true));
        assert_eq!(step(&[1, 2, 3], 10, &[3]), (vec![9, 1, 2, 3], vec![1, 3], true));
        assert_eq!(step(&[1, 2, 3], 2, &[3]), (vec![9, 1], vec![1, 3], true));
        assert_eq!(step(&[1, 2, 3], 10, &[9]), (vec![9, 1, 2, 3], vec![1, 3], false));
        assert_eq!(stop_len(&[4, 5, 4], &[4]), 1);
        assert_eq!(stop_len(&[4, 5, 4], &[]), 3);
        // The prefill's token: no step follows a stop id or a full budget.
        let start = |first, max_new, stop: &[u32]| {
            let mut out = SpecOutput { tokens: vec![], accept_lengths: vec![] };
            let done = out.start(first, max_new, stop);
            (out.tokens, done)
        };
        assert_eq!(start(5, 10, &[]), (vec![5], false));
        assert_eq!(start(5, 10, &[5]), (vec![5], true));
        assert_eq!(start(5, 1, &[]), (vec![5], true));
        assert_eq!(start(5, 0, &[]), (vec![], true));
    }

    /// A decoder's choice refuses logits holding a NaN or an Inf anywhere (their argmax, token 0,
    /// would decode a broken model as full acceptance); finite ones give the first largest
    /// score's index.
    #[test]
    fn non_finite_logits_are_refused() {
        use rand::Rng;
        let mut rng = rand::rng();
        let (r, v) = (rng.random_range(1..5), rng.random_range(2..50));
        let mut values: Vec<f32> = (0..r * v).map(|_| rng.random_range(-3.0..3.0)).collect();
        let t = |values: &[f32]| Tensor::from_vec(values.to_vec(), (r, v), &candle_core::Device::Cpu).unwrap();
        let want: Vec<u32> = values
            .chunks(v)
            .map(|row| row.iter().enumerate().fold(0, |b, (i, &x)| if x > row[b] { i } else { b }) as u32)
            .collect();
        assert_eq!(Sampling::Greedy.choose_rows(&t(&values), 0).unwrap(), want);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let at = rng.random_range(0..r * v);
            let kept = std::mem::replace(&mut values[at], bad);
            let err = Sampling::Greedy.choose_rows(&t(&values), 0).expect_err("non-finite logits").to_string();
            assert!(err.contains("NaN or Inf"), "{err}");
            let sampled = Sampling::Temperature { temperature: 1.0, seed: 1 }.choose_rows(&t(&values), 0);
            assert!(sampled.is_err(), "sampling from non-finite logits");
            values[at] = kept;
        }
    }
}
