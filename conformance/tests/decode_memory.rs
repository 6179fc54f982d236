//! The decoders' memory on the CPU twins, from a counting allocator, for a dense and a hybrid
//! target: building them allocates their two layouts (the target's decoding layout, the
//! drafter's) and little else, and decoding
//! allocates nothing beyond the host attention's scratch of its largest call and a few kB (the
//! step's plans, the ids read back, the output).

use candle_core::DType;
use dflash_conformance::decode_cases::{builtin_pair, hybrid_pairs, random_prompt, DecodedTarget, Pair};
use dflash_conformance::heap::{measure, CountingAllocator};
use dflash_optimized::backend::host::Host;
use dflash_optimized::memory::attention::host_attention_bytes;
use dflash_optimized::model::speculative::{decoders_bytes, DecodeTarget};
use dflash_optimized::ops::attention::ranges::KeyRanges;
use dflash_optimized::ops::attention::AttnShape;
use dflash_reference::config::AttnKind;
use dflash_reference::mask::BlockLayout;
use rand::SeedableRng;

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Heap besides the layouts: their item lists, the decoder's vectors, a step's plans and the ids
/// read back; 64 KiB bounds them.
const BOOKKEEPING_BYTES: u64 = 64 << 10;

/// The built-in target with its trained drafter (dense; RoPE on whole heads).
#[test]
fn decoding_allocates_its_layouts_and_the_attention_scratch_only() {
    let pair = builtin_pair(DType::F64);
    let t = &pair.target.config.dims;
    let shape = AttnShape { num_heads: t.num_heads, num_kv_heads: t.num_kv_heads, head_dim: t.head_dim };
    check_decoding_memory(&pair, (t.head_dim, shape), t.vocab_size, (16, 40));
}

/// A hybrid target with a drafter (partial RoPE; GatedDeltaNet states and verify saves in the
/// layout, the twins allocating nothing while decoding).
#[test]
fn hybrid_decoding_allocates_its_layouts_and_the_attention_scratch_only() {
    let pair = hybrid_pairs(5, 8, DType::F64).remove(0);
    let c = &pair.target.config;
    let shape = AttnShape { num_heads: c.num_heads, num_kv_heads: c.num_kv_heads, head_dim: c.head_dim };
    check_decoding_memory(&pair, (c.rope.rotary_dim, shape), c.vocab_size, (30, 40));
}

/// Builds the decoders of `pair` for a prompt of `prompt_len` tokens and `max_new` new ones on the
/// f64 twins and decodes one random prompt: building allocates the two layouts (at most the
/// planner's `decoders_bytes`), the RoPE tables' temporaries (`rope`: the target's rotary dims) and bookkeeping; decoding, the host attention's
/// scratch of its largest call (`shape`: the target's attention) and bookkeeping.
fn check_decoding_memory<T: DecodedTarget>(
    pair: &Pair<T>,
    (rope, shape): (usize, AttnShape),
    vocab: usize,
    (prompt_len, max_new): (usize, usize),
) {
    let context = prompt_len + max_new;
    let host = |_| Ok(Host::<f64>::default());
    let (decoder, built) = measure(|| pair.target.decoder(host, &pair.drafter.config, context).expect("decoder"));
    let mut decoder = decoder;
    let draft_layout = &decoder.drafter.as_ref().expect("drafter").layout;
    let layouts = decoder.target.allocated_bytes() + draft_layout.bytes;
    // While building, each RoPE table pair is made in f64 (cos and sin) and converted one at a
    // time: three tables of the positions held, `[positions, d]` f64, for each model.
    let d = &pair.drafter.config;
    let held = |positions: usize, d: usize| 3 * (positions * d * 8) as u64;
    let tables =
        held(context + d.block_size, rope) + held(draft_layout.dims.c + draft_layout.dims.b, draft_layout.dims.d);
    // The planner's bytes of the decoders (what `train --plan` shows for the real tau).
    let planned = decoders_bytes(&pair.target.kind(), d, context, (8, 8)).expect("planned");
    println!("built: {built} bytes, layouts {layouts}, planned {planned}, RoPE temporaries {tables}");
    let bound = planned + tables + BOOKKEEPING_BYTES;
    assert!(planned >= layouts, "planned {planned} below the layouts' {layouts}");
    assert!(built as u64 >= layouts && built as u64 <= bound, "built {built}, layouts {layouts}, bound {bound}");

    pair.target.load_into(&mut decoder.target).expect("target weights");
    let drafter = decoder.drafter.as_mut().expect("drafter");
    drafter.load_weights(|name, _| Ok(pair.drafter.param(name).clone())).expect("drafter weights");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let prompt = random_prompt(prompt_len, vocab, &mut rng);
    let (out, decoding) = measure(|| decoder.speculative_decode(&prompt, max_new).expect("decode"));
    // The largest attention calls: the verify block and the draft at the longest context.
    let longest = context + d.block_size;
    let draft_shape =
        AttnShape { num_heads: d.dims.num_heads, num_kv_heads: d.dims.num_kv_heads, head_dim: d.dims.head_dim };
    let verify = KeyRanges::causal_after(longest, d.block_size, AttnKind::Full, 1).expect("plan");
    let block = BlockLayout::new(longest, d.block_size, vec![longest], vec![true], None).expect("layout");
    let draft = KeyRanges::dflash(&block, AttnKind::Full).expect("plan");
    let prefill = KeyRanges::causal(prompt_len, AttnKind::Full, 1).expect("plan");
    let scratch = [
        host_attention_bytes(&verify, shape, 8),
        host_attention_bytes(&draft, draft_shape, 8),
        host_attention_bytes(&prefill, shape, 8),
    ]
    .into_iter()
    .max()
    .expect("three calls");
    println!("decoding {} tokens (tau {:.2}): {decoding} bytes, attention scratch bound {scratch}", max_new, out.tau());
    assert!(
        decoding as u64 <= scratch + BOOKKEEPING_BYTES,
        "decoding took {decoding} bytes; bound {}",
        scratch + BOOKKEEPING_BYTES
    );
}
