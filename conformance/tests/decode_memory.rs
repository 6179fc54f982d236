//! The decoders' memory on the CPU twins, from a counting allocator: building them allocates
//! their two layouts (the target's decoding layout, the drafter's) and little else, and decoding
//! allocates nothing beyond the host attention's scratch of its largest call and a few kB (the
//! step's plans, the ids read back, the output).

use candle_core::DType;
use dflash_conformance::decode_cases::{builtin_pair, random_prompt};
use dflash_conformance::heap::{measure, CountingAllocator};
use dflash_optimized::backend::host::Host;
use dflash_optimized::memory::attention::host_attention_bytes;
use dflash_optimized::model::speculative::SpecDecoder;
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

#[test]
fn decoding_allocates_its_layouts_and_the_attention_scratch_only() {
    let pair = builtin_pair(DType::F64);
    let (prompt_len, max_new) = (16, 40);
    let context = prompt_len + max_new;
    let host = || Ok(Host::<f64>::default());
    let (decoder, built) =
        measure(|| SpecDecoder::new(host, &pair.target.config, Some(&pair.drafter.config), context).expect("decoder"));
    let mut decoder = decoder;
    let draft_layout = &decoder.drafter.as_ref().expect("drafter").layout;
    let layouts = decoder.target.layout.bytes + draft_layout.bytes;
    // While building, each RoPE table pair is made in f64 (cos and sin) and converted one at a
    // time: three tables of the positions held, `[positions, d]` f64, for each model.
    let held = |positions: usize, d: usize| 3 * (positions * d * 8) as u64;
    let target_held = decoder.target.layout.decode.as_ref().expect("decoding layout").context;
    let tables = held(target_held, pair.target.config.dims.head_dim)
        + held(draft_layout.dims.c + draft_layout.dims.b, draft_layout.dims.d);
    println!("built: {built} bytes, layouts {layouts}, RoPE temporaries {tables}");
    let bound = layouts + tables + BOOKKEEPING_BYTES;
    assert!(built as u64 >= layouts && built as u64 <= bound, "built {built}, layouts {layouts}, bound {bound}");

    decoder.target.load_weights(|name, _| pair.target.weight(name)).expect("target weights");
    let drafter = decoder.drafter.as_mut().expect("drafter");
    drafter.load_weights(|name, _| Ok(pair.drafter.param(name).clone())).expect("drafter weights");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let prompt = random_prompt(prompt_len, pair.target.config.dims.vocab_size, &mut rng);
    let (out, decoding) = measure(|| decoder.speculative_decode(&prompt, max_new).expect("decode"));
    // The largest attention calls: the verify block and the draft at the longest context.
    let (t, d) = (&pair.target.config.dims, &pair.drafter.config);
    let longest = context + d.block_size;
    let shape = |dims: &dflash_reference::config::ModelDims| AttnShape {
        num_heads: dims.num_heads,
        num_kv_heads: dims.num_kv_heads,
        head_dim: dims.head_dim,
    };
    let verify = KeyRanges::causal_after(longest, d.block_size, AttnKind::Full, 1).expect("plan");
    let block = BlockLayout::new(longest, d.block_size, vec![longest], vec![true], None).expect("layout");
    let draft = KeyRanges::dflash(&block, AttnKind::Full).expect("plan");
    let prefill = KeyRanges::causal(prompt_len, AttnKind::Full, 1).expect("plan");
    let scratch = [
        host_attention_bytes(&verify, shape(t), 8),
        host_attention_bytes(&draft, shape(&d.dims), 8),
        host_attention_bytes(&prefill, shape(t), 8),
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
