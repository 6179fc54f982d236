//! `cargo xtask eval`: a drafter measured by greedy speculative decoding with its target (spec
//! section 4) on prompts in the data formats, each decode ending at the target's end-of-sequence
//! ids (or not: `--ignore-eos`): per prompt tau, the tokens and whether they equal the target's
//! own plain decode; in total tau two ways, acceptance per block position and the decode speeds.
//! On the GPU the cached decoders (`dflash_optimized::model::speculative`, bf16);
//! on the CPU the reference decoders (f32, every step recomputed: small targets).

use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType, Tensor};
use dflash_data::mask::RenderOptions;
use dflash_data::prompts::read_prompts;
use dflash_data::target::TargetTokenizer;
use dflash_optimized::backend::cuda::Cuda;
use dflash_optimized::backend::Backend;
use dflash_optimized::model::speculative::{DecodeTarget, SpecDecoder};
use dflash_reference::config::DraftConfig;
use dflash_reference::drafter::Drafter;
use dflash_reference::io::WeightSet;
use dflash_reference::speculative::{plain_decode_until, speculative_decode_until, Acceptance, Sampling, SpecOutput};
use dflash_reference::target::{Target, TargetKind};
use serde_json::{json, Value};

use crate::args::Options;
use crate::data::take_files;
use crate::gpu_conformance::{utc_now, write_json};

const HELP: &str = "usage: cargo xtask eval --target DIR --drafter DIR --prompts FILE... [options]

Speculative decoding of every prompt with the target and the drafter, and plain decoding with
the target alone, greedy or (--temperature) seeded sampling; checks that both give the same
tokens (on the CPU an error when not; on the GPU in bf16 a note, as a near-tie of two logits may
round either way). Both end after the target's end-of-sequence ids (the tokenizer's eos_token
and generation_config.json's eos_token_id; kept as the last token) or at --max-new-tokens;
--ignore-eos yes decodes --max-new-tokens always. Prompts are jsonl lines in the data formats: a
conversation up to its first assistant turn, rendered with the target's chat template and the
generation prompt; `text` as it is; `input_ids` as given, or up to the first supervised token
when a `loss_mask` comes with them (a training row without its answer).

Prints a line per prompt (tokens generated, tau, tokens/s, identical to the plain decode or not)
and the totals: tau as the mean of A+1 over all verify steps, and as the mean of the prompts'
own taus (engines report one or the other), the acceptance of each block position, decode
tokens/s (tokens generated over the time) with and without the drafter, and the speed-up.
Writes the same as JSON.

On the GPU (--device gpu) the target and the drafter decode in bf16 with K/V caches: the
target's cache rolled back to the accepted length after each verify (a Qwen3.5 hybrid's
GatedDeltaNet states advanced by the accepted tokens only), the drafter's holding the
committed positions' context K/V, its block recomputed each step; one host round trip per verify
step. On the CPU (--device cpu) the reference decoders run in f32, each step recomputed from the
start: for small targets.

options:
  --target DIR          the target's HF folder (config.json, weights, tokenizer, chat template)
  --drafter DIR         the drafter folder a training run saved (config.json, model.safetensors)
  --prompts FILE...     jsonl prompt files
  --max-new-tokens N    tokens generated per prompt at most             (default 128)
  --ignore-eos yes|no   yes: no stop at the end-of-sequence ids, always --max-new-tokens
                        tokens (fixed-length decoding)                   (default no)
  --max-prompts N       prompts used, in file order                     (default all)
  --thinking yes|no     the chat template's enable_thinking             (default no)
  --system-prompt T     system message for conversations without one    (default none)
  --temperature T       0: greedy; above 0: seeded sampling (argmax proposals, accepted while
                        the target's sample at that position equals them)     (default 0)
  --seed N              the sampling seed                                   (default 0)
  --device gpu|cpu      where the decoders run            (default gpu when one is found, else cpu)
  --out FILE            the JSON report                 (default DRAFTER/eval.json)";

const OPTIONS: &[&str] = &[
    "target",
    "drafter",
    "max-new-tokens",
    "ignore-eos",
    "max-prompts",
    "thinking",
    "system-prompt",
    "temperature",
    "seed",
    "device",
    "out",
];

pub fn run(args: Vec<String>) -> Result<(), String> {
    let (files, rest) = take_files(args, "--prompts");
    let Some(opts) = Options::parse(rest, OPTIONS)? else {
        println!("{HELP}");
        return Ok(());
    };
    let dir = |name: &str| -> Result<PathBuf, String> {
        let d: PathBuf = opts.get(name, PathBuf::new())?;
        if d.as_os_str().is_empty() {
            return Err(format!("--{name} DIR is required"));
        }
        if !d.is_dir() {
            return Err(format!("option `--{name}`: {} is not a folder", d.display()));
        }
        Ok(d)
    };
    let (target_dir, drafter_dir) = (dir("target")?, dir("drafter")?);
    if files.is_empty() {
        return Err("--prompts FILE... is required".into());
    }
    let max_new: usize = opts.get("max-new-tokens", 128)?;
    let ignore_eos = opts.yes_no("ignore-eos", false)?;
    let max_prompts: usize = opts.get("max-prompts", usize::MAX)?;
    if max_prompts == 0 {
        return Err("--max-prompts must be at least 1".into());
    }
    // The prefill gives the first token; verify steps (tau) the ones after it.
    if max_new < 2 {
        return Err(format!("--max-new-tokens {max_new}: at least 2 (a verify step follows the prefill's token)"));
    }
    let sampling = Sampling::new(opts.get("temperature", 0.0)?, opts.get("seed", 0)?)
        .map_err(|e| format!("option `--temperature`: {e}"))?;
    let default_device = if crate::gpu_conformance::open_gpu().is_ok() { "gpu" } else { "cpu" };
    let on_gpu = match opts.get("device", default_device.to_string())?.as_str() {
        "cpu" => false,
        "gpu" => true,
        other => return Err(format!("option `--device`: `{other}` (gpu or cpu)")),
    };
    let out: PathBuf = opts.get("out", drafter_dir.join("eval.json"))?;
    crate::gpu_conformance::check_json_out(&out)?;
    let render = RenderOptions {
        thinking: opts.yes_no("thinking", false)?,
        system_prompt: Some(opts.get("system-prompt", String::new())?).filter(|s| !s.is_empty()),
    };

    // Everything checked before decoding: the drafter against the target, every prompt's length.
    let err = |e: dflash_reference::Error| e.to_string();
    let target_config = TargetKind::from_file(&target_dir.join("config.json")).map_err(err)?;
    if let TargetKind::Dense(t) = &target_config {
        t.check_runs_here("`eval`").map_err(err)?;
    }
    let draft_config = DraftConfig::from_file(&drafter_dir.join("config.json")).map_err(|e| {
        match drafter_dir.join("drafter/config.json").is_file() {
            true => format!("{e} (a run folder? its final drafter is {})", drafter_dir.join("drafter").display()),
            false => e.to_string(),
        }
    })?;
    target_config
        .check_drafter(&draft_config)
        .map_err(|e| format!("{} does not fit the target {}: {e}", drafter_dir.display(), target_dir.display()))?;
    // The layers as engines read them (in increasing order, below the last): as training checks.
    dflash_reference::config::check_feature_layers(&draft_config.target_layer_ids, target_config.num_layers())
        .map_err(|why| {
            format!(
                "{}: dflash_config.target_layer_ids {:?}: {why}",
                drafter_dir.join("config.json").display(),
                draft_config.target_layer_ids
            )
        })?;
    // Every weight there with its shape, the target's and the drafter's, before the prompts are
    // read or a weight loaded.
    let drafter_shapes = dflash_reference::drafter::param_shapes(&draft_config);
    dflash_reference::io::check_checkpoint(&drafter_dir, &drafter_shapes, |_| {
        Some("not a weight of this drafter config".to_string())
    })
    .map_err(err)?;
    let unused = target_config.check_checkpoint(&target_dir).map_err(err)?;
    if let Some(note) = dflash_trainer::real::unused_note(&unused) {
        println!("{note}");
    }
    let tokenizer = TargetTokenizer::load(&target_dir).map_err(|e| e.to_string())?;
    let prompts = read_prompts(&tokenizer, &files, &render, max_prompts).map_err(|e| e.to_string())?;
    // Decoding ends after the first of these (none with --ignore-eos).
    let stop: Vec<u32> = if ignore_eos { Vec::new() } else { tokenizer.end_ids.clone() };
    let b = draft_config.block_size;
    let context = target_config.max_positions();
    for p in &prompts {
        // A verify step runs while a token is still to emit, so it starts at most at P + max_new
        // - 2 and its block (the target's verify and the drafter's) covers B positions from
        // there; P + max_new + B - 1 positions are enough with one to spare.
        let need = p.tokens.len().checked_add(max_new).and_then(|n| n.checked_add(b - 1));
        if need.is_none_or(|need| need > context) {
            return Err(format!(
                "{} line {}: {} prompt tokens + {max_new} new + the {} more positions a verify block of {b} reaches exceed the target's {context} positions",
                p.file.display(),
                p.line,
                p.tokens.len(),
                b - 1
            ));
        }
        if p.tokens.contains(&draft_config.mask_token_id) {
            return Err(format!(
                "{} line {}: the prompt holds the drafter's mask token {}",
                p.file.display(),
                p.line,
                draft_config.mask_token_id
            ));
        }
    }
    let longest = prompts.iter().map(|p| p.tokens.len()).max().unwrap_or(0);
    let mut decoders = match (&target_config, on_gpu) {
        (t, true) => Decoders::gpu(&target_dir, &drafter_dir, t, &draft_config, longest + max_new)?,
        (_, false) => Decoders::Reference {
            target: target_config.load_model(&target_dir, DType::F32).map_err(err)?,
            drafter: Box::new(Drafter::load(&drafter_dir, DType::F32).map_err(err)?),
        },
    };

    println!(
        "{} prompts x up to {max_new} new tokens ({}), {}; drafter {} (block {b}, layers {:?} of the target)",
        prompts.len(),
        match stop.is_empty() {
            true if ignore_eos => "--ignore-eos: no stop".to_string(),
            true => "the tokenizer names no end-of-sequence id: no stop".to_string(),
            false => format!("stop after end-of-sequence ids {stop:?}"),
        },
        match sampling {
            Sampling::Greedy => "greedy".to_string(),
            Sampling::Temperature { temperature, seed } =>
                format!("sampled at temperature {temperature} (seed {seed})"),
        },
        drafter_dir.display(),
        draft_config.target_layer_ids
    );
    println!("decoders: {}", decoders.describe());
    println!(
        "{:>5} {:>7} {:>9} {:>7} {:>11} {:>11} {:>9}",
        "#", "prompt", "generated", "tau", "spec tok/s", "plain tok/s", "identical"
    );
    if on_gpu {
        // Untimed decodes of each kind: the first launches load kernels and cuBLAS's heuristics,
        // and the plain decode allocates its token history.
        decoders.speculative(&prompts[0].tokens, 2.min(max_new), &sampling, &stop)?;
        decoders.plain(&prompts[0].tokens, max_new, &sampling, &stop)?;
    }
    let mut acceptance = Acceptance::new(b);
    let (mut spec_secs, mut plain_secs) = (0.0, 0.0);
    // The plain rate counts the tokens decoded: on the GPU a stop is looked for every few
    // tokens, so a few past it are decoded (and dropped) too.
    let (mut spec_tokens, mut plain_tokens, mut plain_decoded) = (0, 0, 0);
    let mut per_prompt = Vec::new();
    let mut parted = 0;
    for (i, p) in prompts.iter().enumerate() {
        let started = Instant::now();
        let spec = decoders.speculative(&p.tokens, max_new, &sampling, &stop)?;
        let s = started.elapsed().as_secs_f64();
        let started = Instant::now();
        let (plain, decoded) = decoders.plain(&p.tokens, max_new, &sampling, &stop)?;
        let g = started.elapsed().as_secs_f64();
        let identical = spec.tokens == plain;
        parted += usize::from(!identical);
        (spec_secs, plain_secs) = (spec_secs + s, plain_secs + g);
        spec_tokens += spec.tokens.len();
        (plain_tokens, plain_decoded) = (plain_tokens + plain.len(), plain_decoded + decoded);
        acceptance.add(&spec);
        let (spec_rate, plain_rate) = (spec.tokens.len() as f64 / s, decoded as f64 / g);
        // No tau of its own where the answer ended at the prefill's token (no verify step).
        let tau = (!spec.accept_lengths.is_empty()).then(|| spec.tau());
        println!(
            "{i:>5} {:>7} {:>9} {:>7} {:>11.1} {:>11.1} {:>9}",
            p.tokens.len(),
            spec.tokens.len(),
            tau.map_or("-".to_string(), |t| format!("{t:.3}")),
            spec_rate,
            plain_rate,
            if identical { "yes" } else { "NO" }
        );
        per_prompt.push(json!({
            "file": p.file, "line": p.line, "prompt_tokens": p.tokens.len(),
            "generated_tokens": spec.tokens.len(), "plain_generated_tokens": plain.len(),
            "plain_decoded_tokens": decoded, "tau": tau,
            "accept_lengths": spec.accept_lengths, "tokens": spec.tokens, "identical_to_plain": identical,
            "spec_tokens_per_s": spec_rate, "plain_tokens_per_s": plain_rate,
        }));
    }
    let (spec_rate, plain_rate) = (spec_tokens as f64 / spec_secs, plain_decoded as f64 / plain_secs);
    // Verify steps over all prompts: none (no tau) when every answer ended at its first token.
    let steps = acceptance.reached[0];
    let report = json!({
        "target": target_dir, "drafter": drafter_dir, "device": decoders.describe(),
        "prompts": prompts.len(), "max_new_tokens": max_new, "stop_ids": stop, "ignore_eos": ignore_eos,
        "generated_tokens": spec_tokens, "plain_generated_tokens": plain_tokens, "plain_decoded_tokens": plain_decoded,
        "block_size": b, "sampling": sampling_json(&sampling),
        "tau_over_steps": (steps > 0).then(|| acceptance.tau_over_steps()),
        "tau_over_prompts": (steps > 0).then(|| acceptance.tau_over_prompts()),
        "acceptance_per_position": (steps > 0).then(|| acceptance.per_position()), "verify_steps": steps,
        "spec_tokens_per_s": spec_rate, "plain_tokens_per_s": plain_rate, "speedup": spec_rate / plain_rate,
        "all_identical_to_plain": parted == 0, "per_prompt": Value::Array(per_prompt), "date": utc_now(),
    });
    write_json(&out, &report)?;
    if steps > 0 {
        println!(
            "tau: {:.3} (mean of A+1 over all {steps} verify steps), {:.3} (mean of the prompts' taus)",
            acceptance.tau_over_steps(),
            acceptance.tau_over_prompts()
        );
        let positions: Vec<String> = acceptance.per_position().iter().map(|a| format!("{:.0}", a * 100.0)).collect();
        println!("accepted % at block positions 1..{}: [{}]", b - 1, positions.join(" "));
    } else {
        println!("tau: - (no verify step: every answer ended at its first token)");
    }
    println!(
        "decode: {spec_rate:.1} tokens/s speculative, {plain_rate:.1} tokens/s plain ({:.2}x; {spec_tokens} tokens generated; {})",
        spec_rate / plain_rate,
        decoders.describe()
    );
    println!("wrote {}", out.display());
    if parted > 0 {
        if on_gpu {
            // bf16: a verify step (B rows) and a plain step (one row) round differently, so where
            // the target's two best logits nearly tie, the two decodes may take different tokens.
            println!(
                "note: {parted} of {} prompts part from plain decoding; in bf16 a verify step and a plain step round the logits differently, so a near-tie can go either way (`--device cpu` runs the exact reference decoders)",
                prompts.len()
            );
        } else {
            return Err(
                "speculative decoding changed the output of some prompt: it differs from the plain decode (see `identical`)"
                    .into(),
            );
        }
    }
    Ok(())
}

/// The sampling of a report: `{"temperature": 0}` when greedy, else the temperature and seed.
fn sampling_json(sampling: &Sampling) -> Value {
    match *sampling {
        Sampling::Greedy => json!({"temperature": 0.0}),
        Sampling::Temperature { temperature, seed } => json!({"temperature": temperature, "seed": seed}),
    }
}

/// The decoders of one evaluation: the cached ones on the GPU, or the reference on the CPU.
enum Decoders {
    Gpu(Box<dyn CachedDecoder>),
    Reference { target: Box<dyn Target>, drafter: Box<Drafter> },
}

/// The cached decoders of a dense or a hybrid target (`SpecDecoder` on any backend), as an
/// evaluation or a training run's real tau uses them.
pub trait CachedDecoder {
    fn device(&self) -> String;
    /// Loads the drafter's weights from `get(name, shape)`.
    fn load_drafter(
        &mut self,
        get: &dyn Fn(&str, &[usize]) -> dflash_reference::Result<Tensor>,
    ) -> dflash_optimized::Result<()>;
    /// Speculative decoding of up to `max_new` tokens, ending after the first id in `stop` (none:
    /// `max_new` tokens).
    fn speculative_until(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> dflash_optimized::Result<SpecOutput>;
    /// Plain decoding of up to `max_new` tokens, ending after the first id in `stop`; with the
    /// number of tokens decoded, those decoded past the stop before it was seen included.
    fn plain_until(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> dflash_optimized::Result<(Vec<u32>, usize)>;
}

impl<T: DecodeTarget> CachedDecoder for SpecDecoder<T> {
    fn device(&self) -> String {
        self.target.backend().name().to_string()
    }
    fn load_drafter(
        &mut self,
        get: &dyn Fn(&str, &[usize]) -> dflash_reference::Result<Tensor>,
    ) -> dflash_optimized::Result<()> {
        self.drafter.as_mut().expect("built with a drafter").load_weights(get)
    }
    fn speculative_until(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> dflash_optimized::Result<SpecOutput> {
        Ok(self.speculative_decode_until(prompt, max_new, sampling, stop)?.0)
    }
    fn plain_until(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> dflash_optimized::Result<(Vec<u32>, usize)> {
        self.plain_decode_counted(prompt, max_new, sampling, stop)
    }
}

/// The cached decoders of the target in `dir` (its weights loaded in `dtype`) and of a drafter of
/// `draft` (weights not loaded) for contexts of `context` positions, on backends from
/// `make(head_dim)`; refused before allocating what cannot fit.
pub fn cached_decoders<B: Backend + 'static>(
    make: impl Fn(usize) -> dflash_optimized::Result<B>,
    (dir, target): (&std::path::Path, &TargetKind),
    draft: &DraftConfig,
    context: usize,
    dtype: DType,
) -> Result<Box<dyn CachedDecoder>, String> {
    let err = |e: dflash_optimized::Error| e.to_string();
    let w = WeightSet::load_dir(dir).map_err(|e| e.to_string())?;
    let get = |n: &str, s: &[usize]| w.get(&target.checkpoint_name(n), s, dtype);
    Ok(match target {
        TargetKind::Dense(config) => {
            let mut decoder = SpecDecoder::new(make, config, Some(draft), context).map_err(err)?;
            decoder.target.load_weights(get).map_err(err)?;
            Box::new(decoder)
        }
        TargetKind::Hybrid(config) => {
            let mut decoder = SpecDecoder::hybrid(make, config, Some(draft), context).map_err(err)?;
            decoder.target.load_weights(get).map_err(err)?;
            Box::new(decoder)
        }
    })
}

impl Decoders {
    /// The cached decoders on the GPU for contexts of `context` positions, loaded in bf16.
    fn gpu(
        target_dir: &std::path::Path,
        drafter_dir: &std::path::Path,
        target: &TargetKind,
        draft: &DraftConfig,
        context: usize,
    ) -> Result<Self, String> {
        let gpu = crate::gpu_conformance::open_gpu()?;
        let mut decoder = cached_decoders(|d| Cuda::new(&gpu, d), (target_dir, target), draft, context, DType::BF16)?;
        let w = WeightSet::load_dir(drafter_dir).map_err(|e| e.to_string())?;
        decoder.load_drafter(&|n, s| w.get(n, s, DType::BF16)).map_err(|e| e.to_string())?;
        Ok(Decoders::Gpu(decoder))
    }

    fn describe(&self) -> String {
        match self {
            Decoders::Gpu(d) => format!("{} (bf16, K/V caches)", d.device()),
            Decoders::Reference { .. } => "cpu (reference decoders, f32, every step recomputed)".to_string(),
        }
    }

    fn speculative(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> Result<SpecOutput, String> {
        match self {
            Decoders::Gpu(d) => d.speculative_until(prompt, max_new, sampling, stop).map_err(|e| e.to_string()),
            Decoders::Reference { target, drafter } => {
                speculative_decode_until(target.as_ref(), drafter, prompt, max_new, sampling, stop)
                    .map_err(|e| e.to_string())
            }
        }
    }

    /// [`CachedDecoder::plain_until`]: the tokens and the number decoded.
    fn plain(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        sampling: &Sampling,
        stop: &[u32],
    ) -> Result<(Vec<u32>, usize), String> {
        match self {
            Decoders::Gpu(d) => d.plain_until(prompt, max_new, sampling, stop).map_err(|e| e.to_string()),
            Decoders::Reference { target, .. } => {
                let tokens =
                    plain_decode_until(target.as_ref(), prompt, max_new, sampling, stop).map_err(|e| e.to_string())?;
                let decoded = tokens.len();
                Ok((tokens, decoded))
            }
        }
    }
}
