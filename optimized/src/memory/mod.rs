//! Memory (DESIGN.md, "Know memory before spending it"): every byte formula of the project, as
//! pure functions of configs, shapes and policies, in checked arithmetic. The step's memory is a
//! typed layout over one allocation ([`step::StepLayout`]) that the step consumes as it is; the
//! attention's scratch ([`attention`]), the known failure modes ([`failure`]) and the named
//! configurations ([`named`]) live next to it.

pub mod attention;
pub mod drafter_decode;
pub mod failure;
pub mod hybrid;
pub mod named;
pub mod step;
pub mod target;

use crate::{Error, Result};

/// Bytes of one bf16 value, and of one f32 or u32 value.
pub const BF16: u64 = 2;
pub const F32: u64 = 4;

/// `dims[0] * dims[1] * ... * elem_bytes`, or an error naming `what` when it does not fit in 64
/// bits.
pub fn bytes_of(what: &str, dims: &[usize], elem_bytes: u64) -> Result<u64> {
    dims.iter()
        .try_fold(elem_bytes, |acc, &d| acc.checked_mul(d as u64))
        .ok_or_else(|| Error::invalid(what, format!("{dims:?} x {elem_bytes} bytes does not fit in 64 bits")))
}

/// `a + b`, or an error naming `what` on overflow.
pub fn add(what: &str, a: u64, b: u64) -> Result<u64> {
    a.checked_add(b).ok_or_else(|| Error::invalid(what, format!("{a} + {b} bytes does not fit in 64 bits")))
}

/// `a + b` for sizes in elements, or an error naming `what` on overflow.
pub fn add_usize(what: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_add(b).ok_or_else(|| Error::invalid(what, format!("{a} + {b} does not fit in {} bits", usize::BITS)))
}

/// `a * b` for sizes in elements, or an error naming `what` on overflow.
pub fn mul_usize(what: &str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| Error::invalid(what, format!("{a} x {b} does not fit in {} bits", usize::BITS)))
}

/// Bytes of a model's `[V, H]` table (the embedding table, or an LM head) stored at `width`
/// bytes per value (saturating: a size past 64 bits reads as never fitting).
pub fn table_bytes(dims: &dflash_reference::config::ModelDims, width: u64) -> u64 {
    (dims.vocab_size as u64).saturating_mul(dims.hidden_size as u64).saturating_mul(width)
}

/// Renders `bytes` as GB (1e9 bytes) with 3 decimals.
pub fn gb(bytes: u64) -> String {
    format!("{:.3} GB", bytes as f64 / 1e9)
}

/// When a buffer is needed; decides where a plan itemises it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lifetime {
    /// For the whole run: weights, one step's gradients, the frozen LM head.
    Model,
    /// For the whole run, only when training: fp32 master weights, AdamW moments, and the
    /// accumulated gradients when there are several rows or workers to sum.
    Optimizer,
    /// From the forward to the backward: inputs, context, saved activations.
    Saved,
    /// Scratch used in the layer phases and the LM-head phase.
    Transient,
    /// Scratch of one layer's forward or backward, reused by every layer; overlays
    /// [`Lifetime::Head`] (the two phases never overlap).
    Layer,
    /// Scratch of one LM-head chunk; overlays [`Lifetime::Layer`].
    Head,
    /// Uploaded with each input next to the allocation (the attention's key ranges).
    Input,
}

/// One itemised line of a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    pub name: &'static str,
    pub lifetime: Lifetime,
    pub bytes: u64,
}

/// `bytes` bytes at byte `offset` of an allocation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Region {
    pub offset: u64,
    pub bytes: u64,
}

impl Region {
    /// The region's address in an allocation at `base`.
    pub fn at(self, base: u64) -> u64 {
        base + self.offset
    }

    /// The part of the region from byte `offset` on (as an address offset; `offset <= bytes`).
    pub fn skip(self, offset: u64) -> Region {
        debug_assert!(offset <= self.bytes);
        Region { offset: self.offset + offset, bytes: self.bytes - offset }
    }
}

/// Alignment of every region, in bytes (the kernels' 16-byte vector loads, cuBLAS's 256).
pub const ALIGN: u64 = 256;

/// Lays regions out one after another in one allocation, itemising each.
#[derive(Debug, Default)]
pub struct Arena {
    end: u64,
    pub items: Vec<Item>,
}

impl Arena {
    /// A region of `dims` values of `elem_bytes` each, itemised under `item`; `what` names it in
    /// errors.
    pub fn take(
        &mut self,
        item: &'static str,
        lifetime: Lifetime,
        what: &str,
        dims: &[usize],
        elem_bytes: u64,
    ) -> Result<Region> {
        let bytes = bytes_of(what, dims, elem_bytes)?;
        let offset = self.end;
        let aligned = bytes
            .div_ceil(ALIGN)
            .checked_mul(ALIGN)
            .ok_or_else(|| Error::invalid(what, format!("{bytes} bytes do not fit in 64 bits once aligned")))?;
        self.end = add(what, offset, aligned)?;
        self.count(item, lifetime, bytes);
        Ok(Region { offset, bytes })
    }

    /// Adds `bytes` to `item` without placing them (e.g. memory held next to the allocation).
    pub fn count(&mut self, name: &'static str, lifetime: Lifetime, bytes: u64) {
        match self.items.iter_mut().find(|i| i.name == name && i.lifetime == lifetime) {
            Some(i) => i.bytes = i.bytes.saturating_add(bytes),
            None => self.items.push(Item { name, lifetime, bytes }),
        }
    }

    /// Two phases that never overlap in time, laid over the same bytes: `first` and `second`
    /// each start at the current end; the arena then ends after the larger.
    pub fn overlay<A, B>(
        &mut self,
        first: impl FnOnce(&mut Arena) -> Result<A>,
        second: impl FnOnce(&mut Arena) -> Result<B>,
    ) -> Result<(A, B)> {
        let start = self.end;
        let a = first(self)?;
        let (a_end, b_start) = (self.end, start);
        self.end = b_start;
        let b = second(self)?;
        self.end = self.end.max(a_end);
        Ok((a, b))
    }

    /// The allocation's size: every region with its alignment.
    pub fn bytes(&self) -> u64 {
        self.end
    }
}

/// Refuses a decoding layout's sizes unless `1 <= logit_rows <= tokens <= context`.
pub fn check_decoding_sizes(tokens: usize, context: usize, logit_rows: usize) -> Result<()> {
    if logit_rows == 0 || logit_rows > tokens || context < tokens {
        return Err(Error::invalid(
            "decoding layout",
            format!("{logit_rows} logit rows, {tokens} tokens per launch and a context of {context}: need 1 <= rows <= tokens <= context"),
        ));
    }
    Ok(())
}

/// Refuses `what`'s `needed` bytes when only `available` are free, before anything is allocated:
/// the error names the total, the device, the largest `items`, and what to try (`hint`).
pub fn check_fits(what: &str, needed: u64, items: &[Item], available: u64, device: &str, hint: &str) -> Result<()> {
    if needed <= available {
        return Ok(());
    }
    let mut largest: Vec<&Item> =
        items.iter().filter(|i| !matches!(i.lifetime, Lifetime::Layer | Lifetime::Head)).collect();
    largest.sort_by_key(|i| std::cmp::Reverse(i.bytes));
    let names: Vec<String> = largest.iter().take(4).map(|i| format!("{} {}", i.name, gb(i.bytes))).collect();
    Err(Error::Memory(format!(
        "{what} needs {} but {device} has {} available; largest items: {}; {hint}",
        gb(needed),
        gb(available),
        names.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_aligns_and_overlays_phases() {
        let mut a = Arena::default();
        let r0 = a.take("x", Lifetime::Model, "x", &[3], 4).unwrap();
        let (r1, r2) = a
            .overlay(
                |a| a.take("layer", Lifetime::Layer, "l", &[100], 4),
                |a| a.take("head", Lifetime::Head, "h", &[1000], 1),
            )
            .unwrap();
        assert_eq!((r0.offset, r0.bytes), (0, 12));
        assert_eq!((r1.offset, r2.offset), (ALIGN, ALIGN));
        assert_eq!(a.bytes(), ALIGN + 1000u64.div_ceil(ALIGN) * ALIGN);
        assert!(a.take("big", Lifetime::Model, "big", &[usize::MAX, 2], 2).is_err());
    }
}
