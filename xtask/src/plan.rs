//! `cargo xtask plan`: the memory planner's itemised peak for the named configs (or a drafter
//! `config.json`), per checkpointing policy, and the peaks of the known failure modes.

use std::path::PathBuf;

use dflash_optimized::memory::failure::failure_modes;
use dflash_optimized::memory::named::{named_configs, DEFAULT_LM_CHUNK_ROWS};
use dflash_optimized::memory::step::{plan_step, Checkpointing, StepShape, POLICY_HEADROOM};
use dflash_optimized::memory::{gb, table_bytes};
use dflash_reference::config::DraftConfig;
use dflash_reference::target::TargetKind;

use crate::args::Options;

const HELP: &str = "usage: cargo xtask plan [options]

Prints the itemised predicted memory of one bf16 training step (fp32 master weights and AdamW
state; one row per update, so no fp32 gradient accumulator) for each checkpointing policy,
whether it fits the device, and the peaks of the known failure modes (unfused attention
backward; chunked attention without checkpointing).

With --target DIR (an HF target folder), plans that target's forward (its weights up to the last
tapped layer, the shared embedding table and LM head, one launch of S tokens) next to the step of
its drafter (the recipe: 5 layers, block 16, the 5-feature layer rule, the LM head shared; or the
--config drafter, checked against the target) on the same GPU, and says whether both fit; --seq
beyond the target's positions is refused. A Qwen3.5/3.6 hybrid target (GatedDeltaNet + gated attention)
is planned with its GatedDeltaNet state and chunk scratch, next to its published drafter (4
sliding layers + 1 full, heads of 128), with the topology it calls for.

options:
  --target DIR      a target folder (config.json): plan the target and its drafter together
  --config FILE     a drafter config.json (default: the two named configs, or with
                    --target the recipe's drafter for it)
  --seq N           context length S with --config or --target  (default 3072)
  --anchors N       anchors per row N with --config or --target (default 512)
  --lm-chunk N      LM-head rows per chunk                    (default 1024)
  --device-gib X    device memory to fit, GiB                 (default 139.8, one H200)
  --chunk-rows N    query rows per chunk of the chunked-attention failure mode (default 256)";

/// Device memory of one H200 a run may plan for, GiB (`--device-gib`'s default).
pub const H200_GIB: f64 = 139.8;

const OPTIONS: &[&str] = &["target", "config", "seq", "anchors", "lm-chunk", "device-gib", "chunk-rows"];

/// The shape of `--seq` and `--anchors`, held to `train`'s rule: an anchor needs a token after it.
fn shape_option(opts: &Options, lm_chunk_rows: usize) -> Result<StepShape, String> {
    let shape =
        StepShape { context_len: opts.get("seq", 3072)?, num_anchors: opts.get("anchors", 512)?, lm_chunk_rows };
    if shape.context_len >= 2 && shape.num_anchors > shape.context_len - 1 {
        return Err(format!(
            "option `--anchors`: {}: a row of {} tokens holds at most {} anchors",
            shape.num_anchors,
            shape.context_len,
            shape.context_len - 1
        ));
    }
    Ok(shape)
}

pub fn run(args: Vec<String>) -> Result<(), String> {
    let Some(opts) = Options::parse(args, OPTIONS)? else {
        println!("{HELP}");
        return Ok(());
    };
    let lm_chunk_rows: usize = opts.get("lm-chunk", DEFAULT_LM_CHUNK_ROWS)?;
    let device_gib: f64 = opts.get("device-gib", H200_GIB)?;
    let chunk_rows: usize = opts.get("chunk-rows", 256)?;
    if lm_chunk_rows == 0 || chunk_rows == 0 || !(device_gib > 0.0 && device_gib.is_finite()) {
        return Err("--lm-chunk and --chunk-rows must be at least 1, --device-gib a finite number above 0".into());
    }
    let device_bytes = (device_gib * (1u64 << 30) as f64) as u64;
    let target: PathBuf = opts.get("target", PathBuf::new())?;
    let draft_file: PathBuf = opts.get("config", PathBuf::new())?;
    // An option the chosen plan would not read is a mistake, not a default.
    let ignored = match (target.as_os_str().is_empty(), draft_file.as_os_str().is_empty()) {
        (true, true) => ["seq", "anchors"]
            .iter()
            .find(|o| opts.has(o))
            .map(|o| (o, "needs --config or --target (the named configs have their own S and N)")),
        (false, _) => opts.has("chunk-rows").then_some((&"chunk-rows", "is not used with --target (no failure modes)")),
        (true, false) => None,
    };
    if let Some((option, why)) = ignored {
        return Err(format!("option `--{option}` {why}"));
    }
    if !target.as_os_str().is_empty() {
        let shape = shape_option(&opts, lm_chunk_rows)?;
        let draft = match draft_file.as_os_str().is_empty() {
            true => None,
            false => Some(DraftConfig::from_file(&draft_file).map_err(|e| e.to_string())?),
        };
        return plan_target(&target, draft, shape, device_bytes);
    }
    let configs: Vec<(String, DraftConfig, StepShape)> = match draft_file {
        path if path.as_os_str().is_empty() => named_configs()
            .into_iter()
            .map(|p| (p.name.to_string(), p.config, StepShape { lm_chunk_rows, ..p.shape }))
            .collect(),
        path => {
            let config = DraftConfig::from_file(&path).map_err(|e| e.to_string())?;
            let shape = shape_option(&opts, lm_chunk_rows)?;
            vec![(path.display().to_string(), config, shape)]
        }
    };
    for (name, config, shape) in configs {
        println!(
            "== {name}: S={} N={} B={}; the GPU step (bf16 weights, activations and step gradients) ==",
            shape.context_len, shape.num_anchors, config.block_size
        );
        // Every size is checked: an absurd config is an error naming its field, before any output.
        let plans = Checkpointing::ALL
            .iter()
            .map(|&policy| Ok((policy, plan_step(&config, shape, policy, false, (ONE_ROW_ACCUMULATES, 1))?)))
            .collect::<dflash_optimized::Result<Vec<_>>>()
            .map_err(|e| format!("{name}: {e}"))?;
        let fm = failure_modes(&config, shape, chunk_rows).map_err(|e| format!("{name}: {e}"))?;
        for (policy, plan) in plans {
            println!("-- checkpointing: {}", policy.name());
            print!("{}", plan.render(device_bytes));
        }
        println!("-- known failure modes (why they run out of memory):");
        println!(
            "  unfused attention backward, scores materialised, one layer: at least {}",
            gb(fm.unfused_attention_one_layer)
        );
        println!(
            "  chunked attention ({} rows per chunk) without checkpointing, all layers: {}",
            fm.chunk_rows,
            gb(fm.chunked_attention_all_layers)
        );
        println!();
    }
    Ok(())
}

/// Whether `xtask plan` counts the gradient accumulator: not for the recipe's one row per update
/// on one worker (`train --plan` counts it for the run's own rows and workers).
const ONE_ROW_ACCUMULATES: bool = false;

/// `xtask plan --target`'s plan: every policy at `shape` on one device of `device_bytes`.
fn every_policy(shape: StepShape, device_bytes: u64) -> PlanFor<'static> {
    PlanFor {
        shape,
        device_bytes,
        beside: 0,
        policies: &Checkpointing::ALL,
        accumulate: ONE_ROW_ACCUMULATES,
        shards: 1,
    }
}

/// The target's forward and its drafter's step on one GPU: each itemised, then the sum per policy.
fn plan_target(
    dir: &std::path::Path,
    draft: Option<DraftConfig>,
    shape: StepShape,
    device_bytes: u64,
) -> Result<(), String> {
    let file = dir.join("config.json");
    let kind = TargetKind::from_file(&file).map_err(|e| e.to_string())?;
    kind.check_row_len(shape.context_len, &file).map_err(|why| format!("option `--seq`: {why}"))?;
    if let Some(draft) = &draft {
        kind.check_drafter(draft)
            .map_err(|e| format!("option `--config`: the drafter does not fit the target: {e}"))?;
        dflash_reference::config::check_feature_layers(&draft.target_layer_ids, kind.num_layers())
            .map_err(|why| format!("option `--config`: dflash_config.target_layer_ids: {why}"))?;
    }
    let target = match kind {
        TargetKind::Hybrid(config) => {
            use dflash_optimized::memory::hybrid::{hybrid_drafter, HYBRID_DRAFTER_RECIPE};
            let (layers, block, features) = HYBRID_DRAFTER_RECIPE;
            let recipe = (layers, block, features.min(config.num_layers()));
            let draft = match draft {
                Some(draft) => draft,
                None => hybrid_drafter(&config, recipe, (config.vocab_size - 1) as u32)
                    .map_err(|e| format!("{}: its published drafter: {e}", file.display()))?,
            };
            print_hybrid_plan(&file.display().to_string(), &config, &draft, &every_policy(shape, device_bytes))?;
            return Ok(());
        }
        TargetKind::Dense(target) => target,
    };
    let t = &target.dims;
    let config = draft.unwrap_or_else(|| DraftConfig::for_target(&target, 5, 16, (t.vocab_size - 1) as u32, 5));
    if !target.arch.runs_here() {
        // Known by its sizes: it trains from a feature cache only.
        println!(
            "{}: {} trains from a feature cache (its forward does not run here)",
            file.display(),
            target.arch.hf_name()
        );
        print_offline_plan(&config, &every_policy(shape, device_bytes))?;
        return Ok(());
    }
    print_target_plan(&file.display().to_string(), &target, &config, &every_policy(shape, device_bytes))?;
    Ok(())
}

/// The label of a plan's total: `what`, and the real tau's decoders when `beside` holds them.
fn totals_label(what: &str, beside: u64) -> String {
    match beside {
        0 => what.to_string(),
        _ => format!("{what} + real tau decoders"),
    }
}

/// What a plan is made for: the step's `shape` on one device of `device_bytes` with `beside`
/// more bytes on it (the real tau's decoders; 0: none), the checkpointing `policies` to try
/// (fastest first), and whether the step keeps the gradient accumulator (`accumulate`).
pub struct PlanFor<'a> {
    pub shape: StepShape,
    pub device_bytes: u64,
    pub beside: u64,
    pub policies: &'a [Checkpointing],
    pub accumulate: bool,
    /// Drafter workers the optimizer's state is sharded over (1: each holds the whole).
    pub shards: usize,
}

/// An offline run's step (from a feature cache: no target on the device) under each policy of
/// `run`, with its own LM head, and the embedding table beside it (each row's features go
/// straight into the step's input); returns the first policy that fits with `POLICY_HEADROOM` to
/// spare (what `DeviceEngine` picks).
pub fn print_offline_plan(config: &DraftConfig, run: &PlanFor) -> Result<Option<Checkpointing>, String> {
    let c = &config.dims;
    let tables = table_bytes(c, dflash_optimized::memory::BF16);
    println!("== offline (features from the cache; no target on the device): embedding table {}", gb(tables));
    print_steps(config, run, tables, false, "drafter step + embedding table")
}

/// The `gpu` step with target workers on `target_gpus` (one entry per worker) and drafter workers
/// on `drafter_gpus`: a target worker holds the forward of `target` (`name`; no LM head where it
/// is untied) and `slots` feature slots `[S, F*H]`; a drafter worker the step with its own LM
/// head and the embedding table (each row's features are copied into the step's input, from
/// another GPU peer to peer). Prints each GPU's target workers, and the drafter's step under
/// each policy of `run` beside the most target workers a drafter's GPU holds. Returns the first
/// policy under which every GPU fits with `POLICY_HEADROOM` to spare (what `DeviceEngine` picks),
/// `None` when a GPU of target workers alone does not fit.
pub fn print_workers_plan(
    name: &str,
    target: &TargetKind,
    draft: &DraftConfig,
    run: &PlanFor,
    (target_gpus, drafter_gpus): (&[usize], &[usize]),
    slots: usize,
) -> Result<Option<Checkpointing>, String> {
    use dflash_optimized::memory::{BF16, F32};
    let (s, ids, err) = (run.shape.context_len, &draft.target_layer_ids, |e: dflash_optimized::Error| e.to_string());
    let forward = match target {
        TargetKind::Dense(t) => {
            let layout = dflash_optimized::memory::target::TargetLayout::new(t, ids, s, (BF16, F32), false, true);
            layout.and_then(|l| l.total_bytes()).map_err(err)?
        }
        TargetKind::Hybrid(t) => {
            dflash_optimized::memory::hybrid::HybridTargetPlan::new(t, ids, s, (BF16, F32)).map_err(err)?.bytes
        }
    };
    let slot = (s * draft.num_features() * draft.dims.hidden_size) as u64 * BF16;
    let worker = forward.saturating_add(slot.saturating_mul(slots as u64));
    println!(
        "== a target worker: {name}'s forward over layers 0..={} ({}) and {slots} feature slots of {}: {}",
        ids.iter().max().unwrap_or(&0),
        gb(forward),
        gb(slot),
        gb(worker)
    );
    let mut gpus: Vec<usize> = target_gpus.iter().chain(drafter_gpus).copied().collect();
    gpus.sort_unstable();
    gpus.dedup();
    let on = |g: usize| target_gpus.iter().filter(|&&t| t == g).count() as u64;
    let mut alone_fit = true;
    for &g in gpus.iter().filter(|g| !drafter_gpus.contains(g)) {
        let total = worker.saturating_mul(on(g));
        let fits = total.saturating_add(POLICY_HEADROOM) <= run.device_bytes;
        alone_fit &= fits;
        println!(
            "  GPU {g}: {} target worker(s) {:>12}  {} in {}",
            on(g),
            gb(total),
            if fits { "fits" } else { "DOES NOT FIT" },
            gb(run.device_bytes)
        );
    }
    if !alone_fit {
        println!(
            "a GPU of target workers does not fit: fewer target workers on it (`--gpus`), a shorter --max-len, or the features cached offline first (`xtask features`)"
        );
    }
    let beside = drafter_gpus.iter().map(|&g| on(g)).max().unwrap_or(0);
    let tables = table_bytes(&draft.dims, BF16);
    println!(
        "== a drafter worker's GPU: the embedding table {} and {beside} target worker(s) beside it {}",
        gb(tables),
        gb(worker.saturating_mul(beside))
    );
    let fixed = tables.saturating_add(worker.saturating_mul(beside));
    let chosen = print_steps(draft, run, fixed, false, "drafter step + embedding table + target workers")?;
    Ok(chosen.filter(|_| alone_fit))
}

/// The drafter's step under each policy of `run` (reading the target's LM head when
/// `shared_head`, else its own) next to `fixed` bytes on the device: each plan itemised and the
/// sum, labelled `what`; returns the first policy that fits with `POLICY_HEADROOM` to spare (what
/// `DeviceEngine` picks).
fn print_steps(
    config: &DraftConfig,
    run: &PlanFor,
    fixed: u64,
    shared_head: bool,
    what: &str,
) -> Result<Option<Checkpointing>, String> {
    let (shape, device_bytes, beside) = (run.shape, run.device_bytes, run.beside);
    let (policies, optimizer) = (run.policies, (run.accumulate, run.shards));
    let mut chosen = None;
    for &policy in policies {
        let plan = plan_step(config, shape, policy, shared_head, optimizer).map_err(|e| e.to_string())?;
        println!(
            "-- drafter step ({} policy, S={} N={}, {}):",
            policy.name(),
            shape.context_len,
            shape.num_anchors,
            if shared_head { "LM head shared with the target" } else { "its own LM head" }
        );
        print!("{}", plan.render(device_bytes));
        let total = fixed.saturating_add(plan.peak).saturating_add(beside);
        if chosen.is_none() && total.saturating_add(POLICY_HEADROOM) <= device_bytes {
            chosen = Some(policy);
        }
        let verdict = if total <= device_bytes { "fits" } else { "DOES NOT FIT" };
        println!("  {:<58} {:>12}  {verdict} in {}", totals_label(what, beside), gb(total), gb(device_bytes));
    }
    Ok(chosen)
}

/// Prints the target's forward (`name`) for `config`'s layers and the drafter's step under each
/// policy of `run`; returns the first policy that fits with `POLICY_HEADROOM` to spare (what
/// `DeviceEngine` picks).
pub fn print_target_plan(
    name: &str,
    target: &dflash_reference::config::TargetConfig,
    config: &DraftConfig,
    run: &PlanFor,
) -> Result<Option<Checkpointing>, String> {
    let shape = run.shape;
    use dflash_optimized::memory::target::TargetLayout;
    use dflash_optimized::memory::{BF16, F32};
    let t = &target.dims;
    let layout = TargetLayout::new(target, &config.target_layer_ids, shape.context_len, (BF16, F32), true, true)
        .map_err(|e| format!("{name}: {e}"))?;
    let target_bytes = layout.total_bytes().map_err(|e| e.to_string())?;
    println!(
        "== target {name} ({} layers, hidden {}, vocab {}): forward over layers 0..={} for features of {:?}, {} tokens per launch ==",
        t.num_layers(),
        t.hidden_size,
        t.vocab_size,
        config.target_layer_ids.iter().max().unwrap_or(&0),
        config.target_layer_ids,
        shape.context_len
    );
    print!("{}", layout.render());
    let chosen = print_steps(config, run, target_bytes, true, "target + drafter step")?;
    print_topology(config, run, chosen, target_bytes, &format!("the target ({} with one launch)", gb(target_bytes)))?;
    Ok(chosen)
}

/// The topology a target of `target_bytes` on the device (`what`) and its drafter call for, given
/// the policy `chosen` for both on one device: one GPU for both; target workers on GPUs of their
/// own (or an offline cache) when the target fits alone; an offline cache when it does not; and
/// whether the drafter's step (its own LM head and the embedding table beside it, the most
/// frugal policy of `run`) fits a GPU on its own at all.
fn print_topology(
    draft: &DraftConfig,
    run: &PlanFor,
    chosen: Option<Checkpointing>,
    target_bytes: u64,
    what: &str,
) -> Result<(), String> {
    let frugal = *run.policies.last().expect("a policy");
    // A drafter worker beside target workers keeps the gradient accumulator.
    let step = plan_step(draft, run.shape, frugal, false, (true, run.shards)).map_err(|e| e.to_string())?.peak;
    let tables = table_bytes(&draft.dims, dflash_optimized::memory::BF16);
    let drafter_alone = step.saturating_add(tables).saturating_add(POLICY_HEADROOM) <= run.device_bytes;
    let shared =
        plan_step(draft, run.shape, frugal, true, (run.accumulate, run.shards)).map_err(|e| e.to_string())?.peak;
    let without_decoders = target_bytes.saturating_add(shared).saturating_add(POLICY_HEADROOM) <= run.device_bytes;
    if chosen.is_some() {
        println!("topology: one GPU holds both (the single-GPU trainer); more GPUs add data-parallel pairs");
    } else if run.beside > 0 && without_decoders {
        println!(
            "topology: one GPU holds both without the real tau's decoders ({}): `--tau-prompts 0`, or shorter rows or fewer anchors",
            gb(run.beside)
        );
    } else if !drafter_alone {
        println!(
            "topology: the drafter's step alone ({} under the {} policy, with its own LM head and the embedding table {}) does not fit one GPU at S={} N={}, whatever holds the target: shorter rows or fewer anchors",
            gb(step),
            frugal.name(),
            gb(tables),
            run.shape.context_len,
            run.shape.num_anchors
        );
    } else if target_bytes.saturating_add(POLICY_HEADROOM) <= run.device_bytes {
        println!(
            "topology: {what} does not share a GPU with the drafter: target workers on GPUs of their own, each a whole replica, and drafter workers on others, their features copied peer to peer (`train --target-workers T --drafter-workers D --gpus LIST`, target GPUs first); or its features cached offline first (`xtask features`)"
        );
    } else {
        println!(
            "topology: {what} does not fit one GPU, and a target worker holds a whole replica: cache its features offline first (`xtask features`)"
        );
    }
    Ok(())
}

/// A Qwen3.5/3.6 hybrid target (spec section 10) `name` and the step of its drafter `draft`
/// under each policy of `run`, each itemised, the sum per policy, and the topology it calls for;
/// returns the first policy under which all fit with `POLICY_HEADROOM` to spare (what
/// `DeviceEngine` picks).
pub fn print_hybrid_plan(
    name: &str,
    config: &dflash_reference::hybrid::HybridConfig,
    draft: &DraftConfig,
    run: &PlanFor,
) -> Result<Option<Checkpointing>, String> {
    let (shape, device_bytes, beside) = (run.shape, run.device_bytes, run.beside);
    let (policies, optimizer) = (run.policies, (run.accumulate, run.shards));
    use dflash_optimized::memory::hybrid::HybridTargetPlan;
    use dflash_optimized::memory::{BF16, F32};
    let err = |e: dflash_optimized::Error| e.to_string();
    let plan = HybridTargetPlan::new(config, &draft.target_layer_ids, shape.context_len, (BF16, F32)).map_err(err)?;
    let linear = config.layer_kinds.iter().filter(|k| **k == dflash_reference::hybrid::HybridLayerKind::Linear).count();
    println!(
        "== hybrid target {name} ({} layers: {linear} GatedDeltaNet + {} gated attention; hidden {}, vocab {}): forward over layers 0..={} for features of {:?}, {} tokens of one sequence ==",
        config.num_layers(),
        config.num_layers() - linear,
        config.hidden_size,
        config.vocab_size,
        plan.layers - 1,
        draft.target_layer_ids,
        shape.context_len
    );
    print!("{}", plan.render());
    use dflash_reference::config::AttnKind;
    let kinds = &draft.dims.layer_kinds;
    let full = kinds.iter().filter(|k| **k == AttnKind::Full).count();
    let layers = match kinds.iter().find_map(|k| match k {
        AttnKind::Sliding { window } => Some(*window),
        AttnKind::Full => None,
    }) {
        Some(window) => format!("{} sliding layers (window {window}) + {full} full", kinds.len() - full),
        None => format!("{full} full layers"),
    };
    println!(
        "-- its drafter: {layers}, {}/{} heads of {}, rope theta {:.0e}, block {}",
        draft.dims.num_heads, draft.dims.num_kv_heads, draft.dims.head_dim, draft.dims.rope_theta, draft.block_size
    );
    let mut chosen = None;
    for &policy in policies {
        let step = plan_step(draft, shape, policy, true, optimizer).map_err(err)?;
        let total = plan.bytes.saturating_add(step.peak).saturating_add(beside);
        let fits = total <= device_bytes;
        if chosen.is_none() && total.saturating_add(POLICY_HEADROOM) <= device_bytes {
            chosen = Some(policy);
        }
        let what = format!("target + drafter step ({} policy: step {})", policy.name(), gb(step.peak));
        println!(
            "  {:<58} {:>12}  {} in {}",
            totals_label(&what, beside),
            gb(total),
            if fits { "fits" } else { "DOES NOT FIT" },
            gb(device_bytes)
        );
    }
    let weights = plan.weight_bytes().map_err(err)?;
    let what = format!("the target ({} of weights, {} with one launch)", gb(weights), gb(plan.bytes));
    print_topology(draft, run, chosen, plan.bytes, &what)?;
    Ok(chosen)
}
