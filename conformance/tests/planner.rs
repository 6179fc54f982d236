//! The memory module: snapshots of the itemised plans of the named configs, properties that hold
//! for any config (items add up to the peak, checkpointing never raises the saved activations,
//! the overlaid phases stay inside the allocation, the failure modes reproduce the spec's
//! figure), and absurd configs refused with a clear error instead of an overflow.

use dflash_optimized::memory::failure::failure_modes;
use dflash_optimized::memory::named::named_configs;
use dflash_optimized::memory::step::{
    optimizer_shard, plan_step, Checkpointing, MemoryPlan, OptimizerShape, StepDims, StepLayout, StepShape,
};
use dflash_optimized::memory::{Lifetime, Region, ALIGN, BF16, F32};
use rstest::rstest;

/// One H200's usable memory, 139.8 GiB (GPU.md, the project's H200 notes).
fn device_bytes() -> u64 {
    (139.8 * (1u64 << 30) as f64) as u64
}

/// The rendered plans of the named configs, per policy, with the failure modes.
#[test]
fn named_plans_snapshot() {
    let mut out = String::new();
    for p in named_configs() {
        out.push_str(&format!("== {}\n", p.name));
        for policy in Checkpointing::ALL {
            out.push_str(&format!("-- {}\n", policy.name()));
            out.push_str(
                &plan_step(&p.config, p.shape, policy, false, (true, 1)).expect("plan").render(device_bytes()),
            );
        }
        let fm = failure_modes(&p.config, p.shape, 256).expect("failure modes");
        out.push_str(&format!(
            "-- failure modes: unfused attention one layer {} bytes; chunked attention all layers {} bytes\n",
            fm.unfused_attention_one_layer, fm.chunked_attention_all_layers
        ));
    }
    insta::assert_snapshot!(out);
}

/// The peak is the sum of the items (the larger overlaid phase counted once); the peak without
/// optimizer drops exactly the fp32 master copy, the accumulator and both AdamW moments; more
/// checkpointing never saves more activations.
#[test]
fn plan_items_add_up_and_policies_order() {
    for p in named_configs() {
        let plans: Vec<_> = Checkpointing::ALL
            .iter()
            .map(|&policy| plan_step(&p.config, p.shape, policy, false, (true, 1)).expect("plan"))
            .collect();
        for plan in &plans {
            let outside: u64 = plan.persistent.iter().chain(&plan.saved).chain(&plan.transient).map(|i| i.bytes).sum();
            let phase = |items: &[dflash_optimized::memory::Item]| items.iter().map(|i| i.bytes).sum::<u64>();
            assert_eq!(outside + phase(&plan.layer_scratch).max(phase(&plan.head_scratch)), plan.peak, "{}", p.name);
            let optimizer: u64 = plan
                .persistent
                .iter()
                .filter(|i| ["master", "AdamW", "accumulated"].iter().any(|p| i.name.starts_with(p)))
                .map(|i| i.bytes)
                .sum();
            assert_eq!(plan.peak - optimizer, plan.peak_without_optimizer, "{}", p.name);
        }
        let saved = |i: usize| plans[i].saved.iter().map(|x| x.bytes).sum::<u64>();
        assert!(saved(0) > saved(1) && saved(1) > saved(2), "{}: saved bytes must fall with checkpointing", p.name);
    }
}

/// Spec section 5, item 7: chunked attention whose autograd graph keeps every chunk's expanded
/// K/V needs about 128 GB at seq 8000 with 1024 anchors (Qwen3-8B drafter, 256-row chunks).
#[test]
fn chunked_attention_failure_mode_matches_the_spec_figure() {
    let qwen = named_configs().into_iter().next().expect("named configs").config;
    let shape = StepShape { context_len: 8000, num_anchors: 1024, lm_chunk_rows: 1024 };
    let gb = failure_modes(&qwen, shape, 256).expect("failure modes").chunked_attention_all_layers as f64 / 1e9;
    assert!((gb - 128.0).abs() / 128.0 < 0.05, "chunked attention peak {gb:.1} GB, the spec says about 128 GB");
}

/// A step that does not fit is refused with an error naming what it needs, the device, what is
/// available and its largest items; one that fits passes. The step calls this before it
/// allocates anything.
#[test]
fn a_step_that_cannot_fit_is_refused_naming_its_largest_items() {
    let p = named_configs().into_iter().next().expect("named configs");
    let layout = StepLayout::new(&p.config, p.shape, Checkpointing::None, true, (BF16, F32)).expect("layout");
    let peak = layout.total_bytes();
    assert!(layout.check_fits(peak, "GPU 0").is_ok(), "exactly the plan fits");
    let err = layout.check_fits(peak - 1, "GPU 0").expect_err("one byte short must be refused").to_string();
    for needle in ["needs 27.", "GPU 0", "available", "AdamW moments", "master weights"] {
        assert!(err.contains(needle), "`{needle}` missing from: {err}");
    }
}

/// Every region of every layout is aligned and inside the allocation; the regions of one phase
/// are disjoint from each other and from every region outside the overlaid phases.
#[test]
fn regions_are_aligned_disjoint_and_inside_the_allocation() {
    for p in named_configs() {
        for policy in Checkpointing::ALL {
            let l = StepLayout::new(&p.config, p.shape, policy, true, (BF16, F32)).expect("layout");
            let opt = l.optimizer.expect("optimizer regions");
            let i = l.input;
            let mut outside: Vec<Region> = vec![
                l.weights,
                l.grads,
                l.lm_head.expect("own head"),
                opt.master,
                opt.grads.accumulator().expect("accumulator"),
                opt.adam_m,
                opt.adam_v,
            ];
            outside.extend([
                i.features,
                i.cos_q,
                i.sin_q,
                i.cos_k,
                i.sin_k,
                i.labels,
                i.weights_ce,
                i.rows_ce,
                i.loss_rows,
                i.block_tokens,
                i.predictions,
            ]);
            outside.extend([l.ctx_pre, l.ctx, l.inv_hidden, l.hf, l.inv_final, l.grad_b]);
            outside.extend(l.residual.iter().copied());
            let acts = |a: &dflash_optimized::memory::step::LayerActs| {
                vec![a.kv_in, a.inv_in, a.q_pre, a.inv_q, a.k_pre, a.inv_k, a.v, a.x_mid, a.inv_post, a.gate_up]
            };
            let s = l.scratch;
            let mut layer_phase = vec![
                s.q,
                s.k,
                s.xn2,
                s.h,
                s.grad_a,
                s.grad_c,
                s.dq,
                s.dk,
                s.dv,
                s.dsum,
                s.dctx,
                s.dw_partial,
                s.norm_partial,
            ];
            // Saved sets (one per layer) lie outside the phases; a recompute set is in the layer phase.
            match policy {
                Checkpointing::None => l.acts.iter().for_each(|a| outside.extend(acts(a))),
                _ => layer_phase.extend(acts(&l.acts[0])),
            }
            match policy {
                Checkpointing::PerLayer => layer_phase.extend([l.attn[0].out, l.attn[0].lse]),
                _ => l.attn.iter().for_each(|t| outside.extend([t.out, t.lse])),
            }
            let head_phase = vec![l.head.rows, l.head.logits, l.head.drows];
            let all = outside.iter().chain(&layer_phase).chain(&head_phase);
            for r in all {
                assert!(
                    r.offset % ALIGN == 0 && r.offset + r.bytes <= l.bytes,
                    "{} {policy:?}: {r:?} of {}",
                    p.name,
                    l.bytes
                );
            }
            for set in [[&outside[..], &layer_phase[..]].concat(), [&outside[..], &head_phase[..]].concat()] {
                let mut spans: Vec<(u64, u64)> = set.iter().map(|r| (r.offset, r.offset + r.bytes)).collect();
                spans.sort();
                for w in spans.windows(2) {
                    assert!(w[0].1 <= w[1].0, "{} {policy:?}: {:?} overlaps {:?}", p.name, w[0], w[1]);
                }
            }
            assert!(l.items.iter().any(|i| i.lifetime == Lifetime::Input), "the key ranges are itemised");
        }
    }
}

/// Absurd configs and shapes are refused with an error naming the field, never a wrapped size or
/// an overflow panic (debug builds check overflow: this test runs in one).
#[rstest]
#[case::hidden_2_pow_62("hidden_size", 1 << 62, 0, 3072, 512, "fit in")]
#[case::hidden_1e9("hidden_size", 1_000_000_000, 0, 3072, 512, "fit in")]
#[case::vocab_2_pow_40("vocab_size", 0, 1 << 40, 3072, 512, "vocab_size")]
#[case::seq_max("seq", 0, 0, usize::MAX, 512, "fit in")]
#[case::anchors_above_seq("anchors", 0, 0, 80, 1000, "anchors")]
#[case::anchors_0("anchors", 0, 0, 80, 0, "anchors")]
#[case::seq_0("seq", 0, 0, 0, 512, "seq")]
fn absurd_configs_are_clear_errors(
    #[case] what: &str,
    #[case] hidden: usize,
    #[case] vocab: usize,
    #[case] seq: usize,
    #[case] anchors: usize,
    #[case] needle: &str,
) {
    let mut config = named_configs().into_iter().next().expect("named configs").config;
    if hidden > 0 {
        config.dims.hidden_size = hidden;
    }
    if vocab > 0 {
        config.dims.vocab_size = vocab;
    }
    let shape = StepShape { context_len: seq, num_anchors: anchors, lm_chunk_rows: 1024 };
    for policy in Checkpointing::ALL {
        let err = plan_step(&config, shape, policy, false, (true, 1)).expect_err(what).to_string();
        assert!(err.contains(needle), "{what}: `{needle}` missing from: {err}");
        // The failure modes are computed in checked arithmetic too: an error or a value, never a panic.
        let _ = failure_modes(&config, shape, 256);
    }
}

/// A Qwen3-8B target's forward (layers 0..=33, the shared embedding and LM head, one launch of
/// S=3072) and its drafter's step at S=3072, N=512 (the LM head shared, no second copy) fit one
/// H200 under every policy.
#[test]
fn qwen3_8b_target_and_its_drafter_fit_one_h200() {
    use dflash_optimized::memory::named::qwen3_8b_target;
    use dflash_optimized::memory::target::TargetLayout;
    use dflash_reference::config::DraftConfig;
    let target = qwen3_8b_target();
    let drafter = DraftConfig::for_target(&target, 5, 16, 151669, 5);
    assert_eq!(drafter.target_layer_ids, vec![1, 9, 17, 25, 33]);
    let layout = TargetLayout::new(&target, &drafter.target_layer_ids, 3072, (BF16, F32), true, true).expect("layout");
    assert_eq!(layout.layers.len(), 34, "layers after the last tapped one are not held");
    let names: Vec<&str> = layout.items.iter().map(|i| i.name).collect();
    assert!(names.iter().any(|n| n.contains("LM head")), "the target holds the shared LM head: {names:?}");
    let shape = StepShape { context_len: 3072, num_anchors: 512, lm_chunk_rows: 1024 };
    for policy in Checkpointing::ALL {
        let plan = plan_step(&drafter, shape, policy, true, (true, 1)).expect("plan");
        assert!(plan.persistent.iter().all(|i| i.name != "frozen LM head"), "a second LM head is planned");
        let total = layout.total_bytes().expect("bytes") + plan.peak;
        assert!(total <= device_bytes(), "{policy:?}: {:.2} GB does not fit", total as f64 / 1e9);
    }
    // The refusal names the largest items, before anything is allocated.
    let mut huge = target.clone();
    huge.dims.hidden_size = 32768;
    huge.dims.intermediate_size = 98304;
    let big = TargetLayout::new(&huge, &[1, 33], 3072, (BF16, F32), true, true).expect("layout");
    let err = big.check_fits(device_bytes(), "NVIDIA H200").expect_err("too big").to_string();
    assert!(err.contains("target layer weights") && err.contains("NVIDIA H200"), "{err}");
}

/// Proves the hybrid planner's weights against the spec's layer math counted by hand: per
/// GatedDeltaNet layer in_proj_qkv (2*16*128 + 48*128 channels) x H, in_proj_z 48*128 x H,
/// in_proj_a/b 48 x H each, the conv taps (channels x 4), A_log, dt_bias (48 each), the output
/// norm (128) and out_proj H x 48*128; per gated attention layer q_proj with its gate 2*24*256 x H,
/// k and v 4*256 x H each, o_proj H x 24*256, q/k norms (256 each); per layer the MLP 3*H*I and 2
/// norms; the embedding and the LM head V x H. Layers 0..=61 run for features [1, 16, 31, 46, 61]
/// (15 attention layers among them: 3, 7, .., 59). At S=4096 it and its drafter fit one H200.
#[test]
fn the_27b_hybrid_and_its_drafter_fit_one_h200_at_4096() {
    use dflash_optimized::memory::hybrid::{hybrid_drafter, HybridTargetPlan, HYBRID_DRAFTER_RECIPE};
    let config = dflash_optimized::memory::named::qwen3_5_27b_target();
    let draft = hybrid_drafter(&config, HYBRID_DRAFTER_RECIPE, 248319).expect("drafter");
    assert_eq!(draft.target_layer_ids, vec![1, 16, 31, 46, 61]);
    let plan = HybridTargetPlan::new(&config, &draft.target_layer_ids, 4096, (BF16, F32)).expect("plan");
    let (h, i, v) = (5120u64, 17408u64, 248320u64);
    let conv = 2 * 16 * 128 + 48 * 128;
    let gdn = conv * h + 48 * 128 * h + 2 * 48 * h + conv * 4 + 2 * 48 + 128 + h * 48 * 128;
    let attention = 2 * 24 * 256 * h + 2 * 4 * 256 * h + h * 24 * 256 + 2 * 256;
    let per_layer = 3 * h * i + 2 * h;
    let params = 2 * v * h + 62 * per_layer + 47 * gdn + 15 * attention;
    assert_eq!(plan.weight_bytes().expect("weights"), 2 * params);
    let step = plan_step(
        &draft,
        StepShape { context_len: 4096, num_anchors: 512, lm_chunk_rows: 1024 },
        Checkpointing::PerLayer,
        true,
        (true, 1),
    )
    .expect("step");
    let total = plan.bytes + step.peak;
    println!(
        "27B hybrid: target {:.2} GB + drafter step {:.2} GB = {:.2} GB",
        plan.bytes as f64 / 1e9,
        step.peak as f64 / 1e9,
        total as f64 / 1e9
    );
    assert!(total <= device_bytes(), "{total} bytes do not fit one H200");
    plan.check_fits(device_bytes(), "one H200").expect("fits");
    assert!(plan.check_fits(plan.bytes - 1, "a smaller GPU").is_err());
}

/// The AdamW state sharded over N drafter workers: each worker's layout holds the fp32 masters
/// and both moments of its shard only (3 x 4 bytes per parameter of the shard), the whole
/// accumulated gradients, and everything else as the unsharded layout; the shards tile the
/// parameters.
#[test]
fn a_sharded_optimizer_state_divides_its_memory_by_the_workers() {
    use dflash_optimized::memory::step::optimizer_shard;
    let p = named_configs().into_iter().next().expect("named configs");
    let whole = StepLayout::new(&p.config, p.shape, Checkpointing::PerLayer, true, (BF16, F32)).expect("layout");
    let params = whole.optimizer.expect("optimizer").shard.1 as u64;
    let optimizer =
        |l: &StepLayout| -> u64 { l.items.iter().filter(|i| i.lifetime == Lifetime::Optimizer).map(|i| i.bytes).sum() };
    for workers in [2, 3, 8] {
        let mut next = 0;
        for k in 0..workers {
            let shard = optimizer_shard(params as usize, k, workers);
            assert_eq!(shard.0, next, "{workers} workers: shard {k} starts where {} ended", k.saturating_sub(1));
            next = shard.1;
            let sharded = Some(OptimizerShape { shard, ..OptimizerShape::whole(0, true) });
            let l = StepLayout::with_head(&p.config, p.shape, Checkpointing::PerLayer, sharded, (BF16, F32), true)
                .expect("layout");
            let held = (shard.1 - shard.0) as u64;
            // Regions start on ALIGN: the three shrunk regions and the alignment padding after
            // them move the totals by less than one ALIGN each.
            let padding = 4 * ALIGN;
            let want = optimizer(&whole) - 3 * 4 * (params - held);
            let got = optimizer(&l);
            assert!(got.abs_diff(want) <= padding, "{workers} workers, shard {k}: {got} vs {want}");
            let rest = |l: &StepLayout| l.total_bytes() - optimizer(l);
            assert!(rest(&l).abs_diff(rest(&whole)) <= padding, "{workers} workers, shard {k}: the rest is unchanged");
        }
        assert_eq!(next as u64, params, "{workers} workers: the shards tile the parameters");
    }
}

/// One row per update on one worker needs no gradient accumulator: the update reads the step's
/// own stored gradients, so the plan drops the accumulator's fp32 item (4 bytes per parameter,
/// up to one ALIGN of padding), and nothing else changes.
#[test]
fn one_row_per_update_plans_no_accumulator() {
    for p in named_configs() {
        for policy in Checkpointing::ALL {
            let with = plan_step(&p.config, p.shape, policy, false, (true, 1)).expect("plan");
            let without = plan_step(&p.config, p.shape, policy, false, (false, 1)).expect("plan");
            let params = StepDims::new(&p.config, p.shape).expect("dims").params as u64;
            let named = |plan: &MemoryPlan, name: &str| {
                plan.persistent.iter().filter(|i| i.name.starts_with(name)).map(|i| i.bytes).sum::<u64>()
            };
            let acc = "accumulated gradients";
            assert_eq!(named(&without, acc), 0, "{}: no accumulator", p.name);
            assert!(named(&with, acc) >= 4 * params && named(&with, acc) < 4 * params + ALIGN, "{}", p.name);
            assert_eq!(
                with.peak - without.peak,
                named(&with, acc),
                "{} {}: only the accumulator differs",
                p.name,
                policy.name()
            );
            assert_eq!(with.persistent.len(), without.persistent.len() + 1, "{}: one item more", p.name);
        }
    }
}

/// The optimizer's state sharded over W workers: a worker's plan holds the largest shard's
/// masters and moments (12 bytes per parameter of `optimizer_shard(P, 0, W)`, up to ALIGN of
/// padding each) and the whole accumulator; nothing else changes (the peak falls by as much).
#[test]
fn a_sharded_plan_holds_the_largest_shard() {
    for p in named_configs() {
        let params = StepDims::new(&p.config, p.shape).expect("dims").params;
        for workers in [2, 3, 8] {
            let whole = plan_step(&p.config, p.shape, Checkpointing::PerLayer, false, (true, 1)).expect("plan");
            let shard = plan_step(&p.config, p.shape, Checkpointing::PerLayer, false, (true, workers)).expect("plan");
            let named = |plan: &MemoryPlan, name: &str| {
                plan.persistent.iter().filter(|i| i.name.starts_with(name)).map(|i| i.bytes).sum::<u64>()
            };
            let (lo, hi) = optimizer_shard(params, 0, workers);
            let state = |plan: &MemoryPlan| named(plan, "master weights") + named(plan, "AdamW moments");
            let want = 12 * (hi - lo) as u64;
            assert!(state(&shard) >= want && state(&shard) < want + 3 * ALIGN, "{} over {workers}", p.name);
            let acc = "accumulated gradients";
            assert_eq!(named(&shard, acc), named(&whole, acc), "{}: the accumulator stays whole", p.name);
            // The items' placement pads each to ALIGN: the peak falls by the state's bytes, to that.
            let (fell, freed) = (whole.peak - shard.peak, state(&whole) - state(&shard));
            assert!(fell.abs_diff(freed) < 3 * ALIGN, "{} over {workers}: {fell} vs {freed}", p.name);
        }
    }
}

/// A hybrid target's absurd config is refused naming the field (each width at most
/// `MAX_WIDTH`), and a launch of absurdly many tokens with an error, never a wrapped size: the
/// 27B's config with one key changed, and its plan at a length past the address space.
#[rstest]
#[case::key_head_dim_2_pow_63("linear_key_head_dim", 1u64 << 63, "linear_num_key_heads x linear_key_head_dim overflows")]
#[case::key_head_dim_2_pow_30("linear_key_head_dim", 1 << 30, "linear_num_key_heads x linear_key_head_dim is")]
#[case::heads_2_pow_59("num_attention_heads", 1 << 59, "num_attention_heads x head_dim x 2")]
#[case::intermediate_2_pow_40("intermediate_size", 1 << 40, "intermediate_size is")]
#[case::conv_channels("linear_key_head_dim", 1 << 19, "field `linear_num_key_heads`: 2 x linear_num_key_heads")]
#[case::layers_1e15("num_hidden_layers", 1_000_000_000_000_000, "above the 4096 layers")]
fn absurd_hybrid_configs_are_clear_errors(#[case] key: &str, #[case] value: u64, #[case] needle: &str) {
    use dflash_reference::hybrid::HybridConfig;
    let mut config = dflash_optimized::memory::named::qwen3_5_27b_target().to_value();
    config[key] = value.into();
    let err = HybridConfig::from_value(std::path::Path::new("config.json"), &config).expect_err(key).to_string();
    assert!(err.contains(needle) && err.contains("config.json"), "{key}: `{needle}` missing from: {err}");
}

#[test]
fn a_hybrid_plan_past_the_address_space_is_an_error() {
    use dflash_optimized::memory::hybrid::{hybrid_drafter, HybridTargetPlan, HYBRID_DRAFTER_RECIPE};
    let config = dflash_optimized::memory::named::qwen3_5_27b_target();
    let draft = hybrid_drafter(&config, HYBRID_DRAFTER_RECIPE, 248319).expect("drafter");
    for tokens in [1usize << 60, usize::MAX / 2, usize::MAX] {
        let plan = HybridTargetPlan::new(&config, &draft.target_layer_ids, tokens, (BF16, F32));
        assert!(plan.is_err(), "{tokens} tokens planned");
    }
}
