//! Greedy speculative decoding (spec section 4) on a backend, with K/V caches for the target and
//! the drafter, and the plain greedy decoding it must reproduce: the twins of
//! `dflash_reference::speculative::{greedy_decode, speculative_decode}`.
//!
//! One verify step: the drafter writes its proposals straight into the target's token buffer
//! after the bonus, the target verifies the block against its cache and takes the argmax of every
//! row on the device, and the host reads those `2B` ids back for the accept/reject decision (the
//! one round trip per step). The target keeps the accepted prefix of the block ([`DecodeTarget`]:
//! the dense target's K/V caches roll back by decoding the next block at the accepted length, the
//! hybrid's GatedDeltaNet states advance by the accepted tokens); the accepted positions'
//! features extend the drafter's context cache as the next draft's first rows.

use dflash_reference::config::{DraftConfig, TargetConfig};
use dflash_reference::hybrid::HybridConfig;
use dflash_reference::speculative::{Sampling, SpecOutput};
use dflash_reference::target::TargetKind;

use crate::backend::{download, Allocation, Backend};
use crate::memory::drafter_decode::DrafterDecodeLayout;
use crate::memory::hybrid::HybridLayout;
use crate::memory::target::TargetLayout;
use crate::model::drafter_decode::{ContextRows, DrafterDecode};
use crate::model::hybrid_forward::{HybridDecodePlans, HybridForward};
use crate::model::target_forward::{DecodePlans, TargetForward};
use crate::ops::{bytes_of, bytes_of_mut};
use crate::{Error, Result};

/// Tokens per prefill launch unless the block is longer: long prompts run in chunks of this.
pub const PREFILL_CHUNK: usize = 512;

/// With a stop set, plain greedy decoding reads its tokens back every this many tokens to look
/// for a stop id (a host round trip each time; without a stop set, once at the end).
pub const STOP_CHECK: usize = 8;

/// A target laid out for decoding (spec section 4): the dense [`TargetForward`] or the hybrid
/// [`HybridForward`]. Launches of new tokens after cached positions write their features and the
/// argmax of their last rows' logits; a kept launch extends the cache, a verify launch keeps only
/// the prefix [`DecodeTarget::keep`] then names.
pub trait DecodeTarget {
    type Backend: Backend;
    /// The causal plans of one launch.
    type Plans;
    fn backend(&self) -> &Self::Backend;
    fn vocab_size(&self) -> usize;
    /// Tokens of one launch at most.
    fn launch_tokens(&self) -> usize;
    /// Where a launch's token ids (u32 `[t]`) go.
    fn tokens_addr(&self) -> u64;
    /// Where the next tokens (u32 `[R]`) of the last launch live.
    fn next_addr(&self) -> Result<u64>;
    /// The last launch's features `[t, F*H]`.
    fn features_addr(&self) -> u64;
    /// The embedding table and the LM head `[V, H]` (stored) the drafter shares.
    fn head_tables(&self) -> (u64, u64);
    /// The plans of `t` tokens after `past` cached positions (made before a step queues work).
    fn decode_plans(&self, past: usize, t: usize) -> Result<Self::Plans>;
    /// Decodes and keeps `t` tokens at positions `past..past+t` (`past` 0: a new sequence), the
    /// argmax of the last `logit_rows` rows to the next tokens.
    fn decode(&mut self, t: usize, past: usize, logit_rows: usize) -> Result<()>;
    /// Decodes the launch of `plans`, of which [`DecodeTarget::keep`] keeps a prefix.
    fn verify(&mut self, plans: &Self::Plans, logit_rows: usize) -> Result<()>;
    /// Keeps the first `kept` tokens of the last verify launch.
    fn keep(&mut self, kept: usize) -> Result<()>;
    /// The last launch's `rows` logit rows on the host, as f64 `[rows][V]`.
    fn logits_to_host(&self, rows: usize) -> Result<Vec<Vec<f64>>>;
    /// The bytes of the target's one allocation (its decoding layout).
    fn allocated_bytes(&self) -> u64;
}

impl<B: Backend> DecodeTarget for TargetForward<B> {
    type Backend = B;
    type Plans = DecodePlans<B>;
    fn backend(&self) -> &B {
        TargetForward::backend(self)
    }
    fn vocab_size(&self) -> usize {
        self.config.dims.vocab_size
    }
    fn launch_tokens(&self) -> usize {
        self.layout.dims.t
    }
    fn tokens_addr(&self) -> u64 {
        TargetForward::tokens_addr(self)
    }
    fn next_addr(&self) -> Result<u64> {
        TargetForward::next_addr(self)
    }
    fn features_addr(&self) -> u64 {
        TargetForward::features_addr(self)
    }
    fn head_tables(&self) -> (u64, u64) {
        let (embed, head) = self.frozen_tables();
        (embed, head.expect("a decoding layout holds its LM head"))
    }
    fn decode_plans(&self, past: usize, t: usize) -> Result<DecodePlans<B>> {
        TargetForward::decode_plans(self, past, t)
    }
    fn decode(&mut self, t: usize, past: usize, logit_rows: usize) -> Result<()> {
        TargetForward::decode(self, t, past, logit_rows)
    }
    fn verify(&mut self, plans: &DecodePlans<B>, logit_rows: usize) -> Result<()> {
        self.decode_with(plans, logit_rows)
    }
    /// Nothing to do: the next launch at `past + kept` overwrites the rest of the K/V caches.
    fn keep(&mut self, _kept: usize) -> Result<()> {
        Ok(())
    }
    fn logits_to_host(&self, rows: usize) -> Result<Vec<Vec<f64>>> {
        TargetForward::logits_to_host(self, rows)
    }
    fn allocated_bytes(&self) -> u64 {
        self.layout.bytes
    }
}

impl<B: Backend> DecodeTarget for HybridForward<B> {
    type Backend = B;
    type Plans = HybridDecodePlans<B>;
    fn backend(&self) -> &B {
        HybridForward::backend(self)
    }
    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }
    fn launch_tokens(&self) -> usize {
        self.layout.tokens
    }
    fn tokens_addr(&self) -> u64 {
        HybridForward::tokens_addr(self)
    }
    fn next_addr(&self) -> Result<u64> {
        HybridForward::next_addr(self)
    }
    fn features_addr(&self) -> u64 {
        HybridForward::features_addr(self)
    }
    fn head_tables(&self) -> (u64, u64) {
        let (embed, head) = self.frozen_tables();
        (embed, head.expect("a decoding layout holds its LM head"))
    }
    fn decode_plans(&self, past: usize, t: usize) -> Result<HybridDecodePlans<B>> {
        HybridForward::decode_plans(self, past, t)
    }
    fn decode(&mut self, t: usize, past: usize, logit_rows: usize) -> Result<()> {
        HybridForward::decode(self, t, past, logit_rows)
    }
    fn verify(&mut self, plans: &HybridDecodePlans<B>, logit_rows: usize) -> Result<()> {
        HybridForward::verify(self, plans, logit_rows)
    }
    fn keep(&mut self, kept: usize) -> Result<()> {
        HybridForward::keep(self, kept)
    }
    fn logits_to_host(&self, rows: usize) -> Result<Vec<Vec<f64>>> {
        HybridForward::logits_to_host(self, rows)
    }
    fn allocated_bytes(&self) -> u64 {
        self.layout.bytes
    }
}

/// A target, optionally a drafter, and their caches for contexts of up to `context` positions.
pub struct SpecDecoder<T: DecodeTarget> {
    pub target: T,
    pub drafter: Option<DrafterDecode<T::Backend>>,
    context: usize,
    /// The plain decode's tokens (u32) and their capacity, kept on the device until the end.
    history: Option<(<T::Backend as Backend>::Alloc, usize)>,
}

/// The decoders' sizes for `drafter` and contexts of `context`: `(tokens per launch, positions
/// held, the block, the tapped layers)`.
fn decoder_sizes(drafter: Option<&DraftConfig>, context: usize) -> Result<(usize, usize, usize, Vec<usize>)> {
    let block = drafter.map_or(1, |d| d.block_size);
    let launch = PREFILL_CHUNK.max(block).min(context.max(block));
    // The drafter's verify blocks may run past the last kept token: room for one more block.
    let held = context.checked_add(block).ok_or_else(|| Error::invalid("context", "overflows"))?;
    Ok((launch, held, block, drafter.map_or(vec![0], |d| d.target_layer_ids.clone())))
}

/// The device bytes of the decoders of `target` and `drafter` (checked against it) for contexts
/// of `context` positions, `widths = (stored, arithmetic)` bytes per value: both decoding layouts
/// and what lies beside them, planned without allocating (the layouts the constructors make).
pub fn decoders_bytes(target: &TargetKind, drafter: &DraftConfig, context: usize, widths: (u64, u64)) -> Result<u64> {
    target.check_drafter(drafter)?;
    let (launch, held, block, layer_ids) = decoder_sizes(Some(drafter), context)?;
    let target = match target {
        TargetKind::Dense(c) => TargetLayout::decoding(c, &layer_ids, launch, held, block, widths)?.total_bytes()?,
        TargetKind::Hybrid(c) => HybridLayout::decoding(c, &layer_ids, launch, held, block, widths)?.total_bytes()?,
    };
    let drafter = DrafterDecodeLayout::new(drafter, held, launch, widths)?.bytes;
    target.checked_add(drafter).ok_or_else(|| Error::Memory("the decoders' bytes overflow".into()))
}

impl<B: Backend> SpecDecoder<TargetForward<B>> {
    /// The decoders of the dense `target` (and of `drafter`, checked against it) for prompts plus
    /// new tokens of up to `context` positions, each on a backend from `make(d)` (the same device,
    /// its attention built for heads of `d`: the target's, then the drafter's);
    /// refused before allocating what cannot fit.
    pub fn new(
        make: impl Fn(usize) -> Result<B>,
        target: &TargetConfig,
        drafter: Option<&DraftConfig>,
        context: usize,
    ) -> Result<Self> {
        if let Some(d) = drafter {
            d.check_target(target)?;
        }
        let (launch, held, block, layer_ids) = decoder_sizes(drafter, context)?;
        let dev = make(target.dims.head_dim)?;
        let target = TargetForward::decoding(dev, target, &layer_ids, launch, held, block)?;
        Self::with_target(make, target, drafter, context)
    }
}

impl<B: Backend> SpecDecoder<HybridForward<B>> {
    /// [`SpecDecoder::new`] for a hybrid target (spec section 10).
    pub fn hybrid(
        make: impl Fn(usize) -> Result<B>,
        target: &HybridConfig,
        drafter: Option<&DraftConfig>,
        context: usize,
    ) -> Result<Self> {
        if let Some(d) = drafter {
            target.check_drafter(d)?;
        }
        let (launch, held, block, layer_ids) = decoder_sizes(drafter, context)?;
        let target = HybridForward::decoding(make(target.head_dim)?, target, &layer_ids, launch, held, block)?;
        Self::with_target(make, target, drafter, context)
    }
}

impl<T: DecodeTarget> SpecDecoder<T> {
    fn with_target(
        make: impl Fn(usize) -> Result<T::Backend>,
        target: T,
        drafter: Option<&DraftConfig>,
        context: usize,
    ) -> Result<Self> {
        let (launch, held, _, _) = decoder_sizes(drafter, context)?;
        let drafter = match drafter {
            Some(d) => Some(DrafterDecode::new(make(d.dims.head_dim)?, d, held, launch, target.head_tables())?),
            None => None,
        };
        Ok(SpecDecoder { target, drafter, context, history: None })
    }

    fn check_prompt(&self, prompt: &[u32], max_new: usize) -> Result<()> {
        if prompt.is_empty() {
            return Err(Error::invalid("prompt", "is empty"));
        }
        let vocab = self.target.vocab_size();
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::invalid("prompt", format!("token id {bad} is not below the vocab size {vocab}")));
        }
        if prompt.len().checked_add(max_new).is_none_or(|n| n > self.context) {
            return Err(Error::invalid(
                "prompt",
                format!(
                    "{} prompt tokens + {max_new} new exceed the decoder's context of {}",
                    prompt.len(),
                    self.context
                ),
            ));
        }
        Ok(())
    }

    /// The target's tokens at positions `first..first+rows` from the last launch's logit rows
    /// under `sampling` (the argmax on the device when greedy; a sample from the logits read
    /// back, written over the argmax, otherwise).
    fn choose(&self, sampling: &Sampling, rows: usize, first: usize) -> Result<Vec<u32>> {
        let next = self.target.next_addr()?;
        if let Sampling::Greedy = sampling {
            return download::<u32, T::Backend>(self.target.backend(), next, rows);
        }
        let chosen: Vec<u32> = self
            .target
            .logits_to_host(rows)?
            .iter()
            .enumerate()
            .map(|(i, row)| sampling.choose(row, first + i))
            .collect();
        self.target.backend().upload(next, bytes_of(&chosen))?;
        Ok(chosen)
    }

    /// A verify step's proposals `d_1..d_{B-1}` (at the launch's tokens after the bonus) and the
    /// target's `B` tokens from `first` on ([`SpecDecoder::choose`]); greedy reads both back with
    /// one wait.
    fn read_step(&self, sampling: &Sampling, b: usize, first: usize) -> Result<(Vec<u32>, Vec<u32>)> {
        let dev = self.target.backend();
        let drafts_at = self.target.tokens_addr() + 4;
        if let Sampling::Greedy = sampling {
            let (mut drafts, mut chosen) = (vec![0u32; b - 1], vec![0u32; b]);
            dev.download_parts(&mut [
                (drafts_at, bytes_of_mut(&mut drafts)),
                (self.target.next_addr()?, bytes_of_mut(&mut chosen)),
            ])?;
            return Ok((drafts, chosen));
        }
        let drafts = download::<u32, T::Backend>(dev, drafts_at, b - 1)?;
        Ok((drafts, self.choose(sampling, b, first)?))
    }

    /// Runs the prompt through the target in chunks (and into the drafter's context); the
    /// target's next token after it (at the device's next tokens, row 0). Its logits are read
    /// back once per prompt, to refuse NaN or Inf (non-finite weights) as the reference does,
    /// before a greedy argmax of them decodes garbage as full acceptance.
    fn prefill(&mut self, prompt: &[u32], sampling: &Sampling) -> Result<u32> {
        let chunk = self.target.launch_tokens();
        for (i, part) in prompt.chunks(chunk).enumerate() {
            let past = i * chunk;
            self.target.backend().upload(self.target.tokens_addr(), bytes_of(part))?;
            self.target.decode(part.len(), past, 1)?;
            if let Some(d) = &self.drafter {
                d.append_context(self.target.features_addr(), past, part.len())?;
            }
        }
        if let Sampling::Greedy = sampling {
            self.target.logits_to_host(1)?;
        }
        Ok(self.choose(sampling, 1, prompt.len())?[0])
    }

    /// Plain greedy decoding: `max_new` tokens, each the target's argmax after all before it
    /// (every step's token fed back on the device; read back once at the end).
    pub fn greedy_decode(&mut self, prompt: &[u32], max_new: usize) -> Result<Vec<u32>> {
        self.greedy_decode_until(prompt, max_new, &[])
    }

    /// [`SpecDecoder::greedy_decode`] that ends after the first token in `stop` (kept as the last
    /// token) or at `max_new` tokens (the reference's `plain_decode_until` twin).
    pub fn greedy_decode_until(&mut self, prompt: &[u32], max_new: usize, stop: &[u32]) -> Result<Vec<u32>> {
        Ok(self.greedy_decode_counted(prompt, max_new, stop)?.0)
    }

    /// [`SpecDecoder::greedy_decode_until`] with the number of tokens decoded (what a rate
    /// counts). The tokens stay on the device: with a `stop`, they are read back every
    /// [`STOP_CHECK`] tokens to look for one, so up to `STOP_CHECK - 1` tokens after it are
    /// decoded and dropped; an empty `stop` reads them once at the end.
    fn greedy_decode_counted(&mut self, prompt: &[u32], max_new: usize, stop: &[u32]) -> Result<(Vec<u32>, usize)> {
        self.check_prompt(prompt, max_new)?;
        if max_new == 0 {
            return Ok((Vec::new(), 0));
        }
        let first = self.prefill(prompt, &Sampling::Greedy)?;
        let mut out = vec![first]; // the tokens read back so far
        if stop.contains(&first) {
            return Ok((out, 1));
        }
        let dev = self.target.backend();
        if self.history.as_ref().is_none_or(|(_, len)| *len < max_new) {
            self.history = Some((dev.alloc("decoded tokens", max_new * 4)?, max_new));
        }
        let history = self.history.as_ref().expect("allocated above").0.ptr();
        dev.upload(history, bytes_of(&[first]))?;
        for i in 1..max_new {
            let dev = self.target.backend();
            dev.copy(self.target.tokens_addr(), history + (i as u64 - 1) * 4, 4)?;
            self.target.decode(1, prompt.len() + i - 1, 1)?;
            self.target.backend().copy(history + i as u64 * 4, self.target.next_addr()?, 4)?;
            let written = i + 1;
            if written == max_new || (!stop.is_empty() && written % STOP_CHECK == 0) {
                let read = out.len();
                let at = history + read as u64 * 4;
                out.extend(download::<u32, T::Backend>(self.target.backend(), at, written - read)?);
                if let Some(s) = out[read..].iter().position(|t| stop.contains(t)) {
                    out.truncate(read + s + 1);
                    return Ok((out, written));
                }
            }
        }
        let decoded = out.len();
        Ok((out, decoded))
    }

    /// Plain decoding under `sampling` (greedy: [`SpecDecoder::greedy_decode`]; sampled: each
    /// token chosen on the host from its logits, the reference's `plain_decode` twin).
    pub fn plain_decode(&mut self, prompt: &[u32], max_new: usize, sampling: &Sampling) -> Result<Vec<u32>> {
        self.plain_decode_until(prompt, max_new, sampling, &[])
    }

    /// [`SpecDecoder::plain_decode`] that ends after the first token in `stop` (kept as the last
    /// token) or at `max_new` tokens (the reference's `plain_decode_until` twin).
    pub fn plain_decode_until(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> Result<Vec<u32>> {
        Ok(self.plain_decode_counted(prompt, max_new, sampling, stop)?.0)
    }

    /// [`SpecDecoder::plain_decode_until`] with the number of tokens decoded, dropped ones
    /// included ([`SpecDecoder::greedy_decode_counted`]; sampling drops none).
    pub fn plain_decode_counted(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> Result<(Vec<u32>, usize)> {
        if let Sampling::Greedy = sampling {
            return self.greedy_decode_counted(prompt, max_new, stop);
        }
        self.check_prompt(prompt, max_new)?;
        let mut out = Vec::with_capacity(max_new);
        if max_new > 0 {
            out.push(self.prefill(prompt, sampling)?);
        }
        while out.len() < max_new && !stop.contains(out.last().expect("one token at least")) {
            let last = *out.last().expect("one token at least");
            self.target.backend().upload(self.target.tokens_addr(), bytes_of(&[last]))?;
            self.target.decode(1, prompt.len() + out.len() - 1, 1)?;
            out.push(self.choose(sampling, 1, prompt.len() + out.len())?[0]);
        }
        let decoded = out.len();
        Ok((out, decoded))
    }

    /// Greedy speculative decoding of `max_new` tokens (spec section 4): the output equals
    /// [`SpecDecoder::greedy_decode`]'s; `A + 1` of every verify step.
    pub fn speculative_decode(&mut self, prompt: &[u32], max_new: usize) -> Result<SpecOutput> {
        Ok(self.speculative_decode_traced(prompt, max_new, &Sampling::Greedy)?.0)
    }

    /// Speculative decoding under `sampling` (the reference's `speculative_decode_with` twin)
    /// with every verify step's proposals `d_1..d_{B-1}`.
    pub fn speculative_decode_traced(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
    ) -> Result<(SpecOutput, Vec<Vec<u32>>)> {
        self.speculative_decode_until(prompt, max_new, sampling, &[])
    }

    /// [`SpecDecoder::speculative_decode_traced`] that ends after the first token in `stop` or at
    /// `max_new` tokens, the last step's tokens after the first cut dropped and its `A + 1`
    /// counted whole (`SpecOutput::push_step`, the reference's `speculative_decode_until` twin).
    pub fn speculative_decode_until(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> Result<(SpecOutput, Vec<Vec<u32>>)> {
        self.check_prompt(prompt, max_new)?;
        let Some(drafter) = &self.drafter else {
            return Err(Error::invalid("drafter", "this decoder was built without a drafter"));
        };
        let b = drafter.config.block_size;
        let mut out = SpecOutput { tokens: Vec::new(), accept_lengths: Vec::new() };
        let mut proposals = Vec::new();
        if max_new == 0 {
            return Ok((out, proposals));
        }
        let bonus = self.prefill(prompt, sampling)?;
        let mut n = prompt.len();
        let verify = self.target.tokens_addr();
        // The bonus's id on the device: the target's next token `accepted` of the last launch.
        let mut bonus_at = self.target.next_addr()?;
        let mut pending = None; // the context rows of the last verify step, not yet appended
        let mut done = out.start(bonus, max_new, stop);
        while !done {
            let drafter = self.drafter.as_ref().expect("checked above");
            let (draft_plans, verify_plans) = (drafter.plans(n)?, self.target.decode_plans(n, b)?);
            let appended =
                pending.take().map(|(past, rows)| ContextRows { features: self.target.features_addr(), past, rows });
            drafter.draft(&draft_plans, appended, bonus_at, verify + 4)?;
            if proposals.is_empty() {
                // Once per prompt, as the prefill's: a drafter with non-finite weights is refused
                // (as the reference refuses it), not decoded as proposals of token 0.
                drafter.logits_to_host(1)?;
            }
            self.target.backend().copy(verify, bonus_at, 4)?;
            self.target.verify(&verify_plans, b)?;
            // chosen[i]: the target's token at n + i + 1.
            let (drafts, chosen) = self.read_step(sampling, b, n + 1)?;
            let accepted = drafts.iter().zip(&chosen).take_while(|(d, g)| d == g).count();
            self.target.keep(accepted + 1)?;
            pending = Some((n, accepted + 1));
            let emitted: Vec<u32> = drafts[..accepted].iter().chain([&chosen[accepted]]).copied().collect();
            done = out.push_step(&emitted, max_new, stop);
            n += accepted + 1;
            bonus_at = self.target.next_addr()? + 4 * accepted as u64;
            proposals.push(drafts);
        }
        Ok((out, proposals))
    }
}
