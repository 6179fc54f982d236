//! `xtask bench eval` (on the H200): batch-1 greedy decoding with K/V caches
//! (`dflash_optimized::model::speculative`) on a Qwen3-8B-shaped checkpoint (random weights,
//! made in HF format by transformers in the same run) next to transformers' `generate` in the
//! same run; speculative decoding with a drafter on the same checkpoint (tau and per-step cost)
//! and with the trained built-in pair; writes `results/eval-h200.json`.

use std::path::PathBuf;

use candle_core::DType;
use dflash_conformance::decode_cases::builtin_pair;
use dflash_optimized::backend::cuda::Cuda;
use dflash_optimized::device::gpu::Gpu;
use dflash_optimized::model::speculative::{DecodeTarget, SpecDecoder};
use dflash_optimized::model::target_forward::TargetForward;
use dflash_reference::config::{DraftConfig, TargetConfig};
use dflash_reference::drafter::Drafter;
use dflash_reference::io::WeightSet;
use dflash_reference::speculative::SpecOutput;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::args::Options;
use crate::bench_attention::run_python_json;
use crate::bench_target::qwen3_8b_config;
use crate::gpu_bundle;
use crate::gpu_conformance::{open_gpu, utc_now, write_json};

const HELP: &str = "usage: xtask bench eval [options]     (on the GPU machine)

Makes (once) a random Qwen3-8B-shaped checkpoint in HF format with transformers (as `bench
target`), then times batch-1 greedy decoding of N new tokens after a prompt of P random tokens
(prefill included): ours (bf16, K/V caches, the token fed back on the device) against
transformers' generate (bf16, sdpa, do_sample=False) in the same run; then speculative decoding
on the same checkpoint with a random drafter of the Qwen3-8B drafter's shape (5 layers, block 16;
tau near 1: it measures a verify step's cost against a plain step's), and with the GPU built-in
target and its trained drafter (fixtures/drafter-gpu-builtin: tau well above 1) against plain
decoding of that target. Median of CUDA-event timings after warm-up. Writes one JSON object
(first without transformers' figures, so a failing or killed baseline keeps ours) and prints a
table last.

options:
  --target DIR        the checkpoint (made there when it has no config.json)
                                                  (default /tmp/dflash-qwen3-8b-random)
  --prompt-tokens P   prompt length                          (default 128)
  --new-tokens N      tokens generated                       (default 256)
  --warmup N          untimed decodes                        (default 1)
  --iters N           timed decodes, median reported         (default 3)
  --torch yes|no      run transformers' generate             (default yes)
  --random-drafter yes|no  speculative decoding on the 8B shape with a random drafter (default yes)
  --python EXE        Python with PyTorch and transformers   (default python3)
  --script FILE       the baseline script  (default eval_torch.py next to the binary, else
                                            xtask/bench/eval_torch.py)
  --out FILE          results file                           (default results/eval-h200.json)
  --seed N            seed of the prompt and the random drafter (default 0)
  --commit SHA        the commit measured                    (default: commit.txt next to the binary)
  --profile yes|no    print each operation's GPU time over one plain and one speculative decode
                      (random drafter) of 32 tokens of the 8B shape, and over one plain and one
                      speculative decode of the built-in pair                   (default no)";

const OPTIONS: &[&str] = &[
    "target",
    "prompt-tokens",
    "new-tokens",
    "warmup",
    "iters",
    "torch",
    "random-drafter",
    "python",
    "script",
    "out",
    "seed",
    "commit",
    "profile",
];

pub fn run(args: Vec<String>) -> Result<(), String> {
    let Some(opts) = Options::parse(args, OPTIONS)? else {
        println!("{HELP}");
        return Ok(());
    };
    let dir: PathBuf = opts.get("target", PathBuf::from("/tmp/dflash-qwen3-8b-random"))?;
    let (prompt_len, new_tokens): (usize, usize) = (opts.get("prompt-tokens", 128)?, opts.get("new-tokens", 256)?);
    let (warmup, iters, seed): (usize, usize, u64) =
        (opts.get("warmup", 1)?, opts.get("iters", 3)?, opts.get("seed", 0)?);
    if prompt_len == 0 || new_tokens == 0 || iters == 0 {
        return Err("--prompt-tokens, --new-tokens and --iters must be at least 1".into());
    }
    let with_torch = opts.yes_no("torch", true)?;
    let with_random_drafter = opts.yes_no("random-drafter", true)?;
    let profile = opts.yes_no("profile", false)?;
    let python: String = opts.get("python", "python3".to_string())?;
    let script: PathBuf = opts.get("script", gpu_bundle::bundled_file("eval_torch.py", "xtask/bench/eval_torch.py"))?;
    let make_script = gpu_bundle::bundled_file("target_torch.py", "xtask/bench/target_torch.py");
    for s in [&script, &make_script] {
        if !s.is_file() {
            return Err(format!("{}: the transformers script is missing (--script)", s.display()));
        }
    }
    let out: PathBuf = opts.get("out", PathBuf::from("results/eval-h200.json"))?;
    let commit = gpu_bundle::commit(Some(opts.get("commit", String::new())?).filter(|c| !c.is_empty()))?;
    let gpu = open_gpu()?;

    if !dir.join("config.json").is_file() {
        println!("making a random Qwen3-8B-shaped checkpoint in {} with transformers", dir.display());
        let spec = json!({"mode": "make", "model_dir": dir, "config": qwen3_8b_config(), "seed": seed});
        run_python_json(&python, &make_script, &spec)?;
    }
    let config = TargetConfig::from_file(&dir.join("config.json")).map_err(|e| e.to_string())?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let prompt: Vec<u32> = (0..prompt_len).map(|_| rng.random_range(0..config.dims.vocab_size as u32)).collect();
    let timing = Timing { gpu: &gpu, warmup, iters, new_tokens };

    // Ours on the 8B shape: plain, then speculative with a random drafter of the 8B drafter's shape.
    let err = |e: dflash_optimized::Error| e.to_string();
    let draft =
        with_random_drafter.then(|| DraftConfig::for_target(&config, 5, 16, config.dims.vocab_size as u32 - 1, 5));
    let started = std::time::Instant::now();
    let mut decoder =
        SpecDecoder::new(|d| Cuda::new(&gpu, d), &config, draft.as_ref(), prompt_len + new_tokens).map_err(err)?;
    let weights = WeightSet::load_dir(&dir).map_err(|e| e.to_string())?;
    decoder.target.load_weights(|n, s| weights.get(n, s, DType::BF16)).map_err(err)?;
    drop(weights);
    if let (Some(dd), Some(config)) = (decoder.drafter.as_mut(), &draft) {
        let random = Drafter::init(config.clone(), seed, DType::BF16).map_err(|e| e.to_string())?;
        dd.load_weights(|n, _| Ok(random.param(n).clone())).map_err(err)?;
    }
    println!(
        "loaded the 8B-shaped target{} in {:.1}s",
        if draft.is_some() { " and a random drafter" } else { "" },
        started.elapsed().as_secs_f64()
    );
    let (plain_ms, ours_tokens) = timing.plain(&mut decoder, &prompt)?;
    if profile {
        crate::bench::profile_once("one plain decode of 32 tokens (prefill included)", || {
            decoder.greedy_decode(&prompt, 32)
        })?;
    }
    let random_spec = match draft.is_some() {
        true => Some(timing.speculative(&mut decoder, &prompt)?),
        false => None,
    };
    // The same decodes with cuBLAS for every few-row linear layer (`linear_rows`' fallback): what
    // the kernel gains, in plain steps and in verify and drafter blocks.
    let set = |decoder: &SpecDecoder<TargetForward<Cuda>>, on: bool| {
        decoder.target.backend().set_rows_kernel(on);
        if let Some(d) = decoder.drafter.as_ref() {
            d.backend().set_rows_kernel(on);
        }
    };
    set(&decoder, false);
    let cublas_plain = timing.plain(&mut decoder, &prompt).map(|(ms, _)| ms);
    let cublas_spec = match draft.is_some() {
        true => Some(timing.speculative(&mut decoder, &prompt)),
        false => None,
    };
    set(&decoder, true);
    let (cublas_plain, cublas_spec) = (cublas_plain?, cublas_spec.transpose()?);
    if profile && random_spec.is_some() {
        crate::bench::profile_once("one speculative decode of 32 tokens, random drafter (prefill included)", || {
            decoder.speculative_decode(&prompt, 32)
        })?;
    }
    drop(decoder);

    // The trained pair: the GPU built-in target and its drafter, plain and speculative.
    let pair = builtin_pair(DType::F32);
    let builtin_prompt: Vec<u32> = (0..16).map(|_| rng.random_range(0..pair.drafter.config.mask_token_id)).collect();
    let mut decoder =
        SpecDecoder::new(|d| Cuda::new(&gpu, d), &pair.target.config, Some(&pair.drafter.config), 16 + new_tokens)
            .map_err(err)?;
    decoder.target.load_weights(|n, _| pair.target.weight(n)).map_err(err)?;
    decoder
        .drafter
        .as_mut()
        .expect("with a drafter")
        .load_weights(|n, _| Ok(pair.drafter.param(n).clone()))
        .map_err(err)?;
    let (builtin_plain_ms, builtin_greedy) = timing.plain(&mut decoder, &builtin_prompt)?;
    let (builtin_spec_ms, builtin_out) = timing.speculative(&mut decoder, &builtin_prompt)?;
    if builtin_out.tokens != builtin_greedy {
        return Err("the built-in pair's speculative output differs from its greedy decode".into());
    }
    if profile {
        // Against the timed wall clock: GPU time well below it means the host's launches bound it.
        println!("built-in pair: {builtin_plain_ms:.2} ms plain and {builtin_spec_ms:.2} ms speculative, wall clock");
        crate::bench::profile_once(&format!("the built-in pair's plain decode of {new_tokens} tokens"), || {
            decoder.greedy_decode(&builtin_prompt, new_tokens)
        })?;
        crate::bench::profile_once(&format!("the built-in pair's speculative decode of {new_tokens} tokens"), || {
            decoder.speculative_decode(&builtin_prompt, new_tokens)
        })?;
    }

    let rate = |ms: f64| new_tokens as f64 / (ms * 1e-3);
    // Batch-1 decoding reads every weight once per token: the bandwidth ceiling of plain decoding.
    let weight_bytes = 2.0 * decoded_params(&config);
    let ceiling = decode_bytes_per_s(gpu.name()) / weight_bytes;
    // A speculative step reads the target's weights and the drafter's (its layers, and the LM
    // head once more for its proposals): at equal bandwidth, a step costs at least this many plain
    // tokens, so speedup / tau is at most its inverse.
    let drafter_bytes = draft.as_ref().map(|d| {
        let own: usize =
            dflash_reference::drafter::param_shapes(d).iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        2.0 * (own + d.dims.vocab_size * d.dims.hidden_size) as f64
    });
    let bytes_bound = drafter_bytes.map(|d| (weight_bytes + d) / weight_bytes);
    let ours_rate = rate(plain_ms);
    let builtin_tau = builtin_out.tau();
    let builtin_speedup = builtin_plain_ms / builtin_spec_ms;
    // The results with transformers' (none yet: ours are written before it runs, so a failing or
    // killed baseline keeps them).
    let result_with = |hf: Option<&Value>| {
        let hf_ms = hf.and_then(|v| v["ms"].as_f64());
        let agree = hf
            .and_then(|v| v["tokens"].as_array())
            .map(|t| t.iter().zip(&ours_tokens).take_while(|(a, b)| a.as_u64() == Some(**b as u64)).count());
        json!({
            "ours_decode_tokens_per_s": ours_rate,
            "cublas_rows_decode_tokens_per_s": rate(cublas_plain),
            "hf_decode_tokens_per_s": hf_ms.map(rate),
            "decode_vs_hf": hf_ms.map(|h| h / plain_ms),
            "decode_ceiling_tokens_per_s": ceiling,
            "decode_fraction_of_ceiling": ours_rate / ceiling,
            "ours_spec_tokens_per_s": rate(builtin_spec_ms),
            "tau": builtin_tau,
            "speedup": builtin_speedup,
            "speedup_over_tau": builtin_speedup / builtin_tau,
            "spec_pair": "GPU built-in target (hidden 128, 8 layers) and its trained drafter (block 8)",
            "builtin_plain_tokens_per_s": rate(builtin_plain_ms),
            // A step's cost against a plain token's on the 8B shape (what bounds speedup / tau
            // there), and the speedup it gives at the trained pair's tau: a projection, labelled.
            "random_drafter_8b": random_spec.as_ref().map(|(ms, out)| {
                let step_over_token = (ms / out.accept_lengths.len() as f64) / (plain_ms / new_tokens as f64);
                json!({
                    "spec_tokens_per_s": rate(*ms), "tau": out.tau(), "spec_over_plain": plain_ms / ms,
                    "verify_steps": out.accept_lengths.len(),
                    "step_ms_over_plain_token_ms": step_over_token,
                    "drafter_bytes_per_step": drafter_bytes,
                    "step_over_token_bytes_bound": bytes_bound,
                    "projected_speedup_at_builtin_tau": builtin_tau / step_over_token,
                    "cublas_rows_spec_tokens_per_s": cublas_spec.as_ref().map(|(ms, _)| rate(*ms)),
                })
            }),
            "tokens_agreeing_with_hf": agree,
            "prompt_tokens": prompt_len,
            "new_tokens": new_tokens,
            "target": "Qwen3-8B shape, random weights (transformers init), bf16",
            "baseline": hf.map(|v| format!("transformers {} generate, torch {}, bf16, sdpa", v["transformers"], v["torch"])),
            "warmup": warmup,
            "iters": iters,
            "date": utc_now(),
            "gpu": gpu.name(),
            // The built-in pair's decoding is bound by the host's kernel launches.
            "host": crate::bench::host_machine(),
            "commit": commit,
        })
    };
    write_json(&out, &result_with(None))?;
    let hf = match with_torch {
        true => {
            // The same warm-up and median of `iters` as ours.
            let spec = json!({"model_dir": dir, "prompt": prompt, "max_new_tokens": new_tokens, "warmup": warmup, "iters": iters});
            let hf = run_python_json(&python, &script, &spec)?;
            if hf["new_tokens"].as_u64() != Some(new_tokens as u64) {
                return Err(format!("transformers' generate wrote {} tokens, not {new_tokens}", hf["new_tokens"]));
            }
            Some(hf)
        }
        false => None,
    };
    let result = result_with(hf.as_ref());
    write_json(&out, &result)?;
    let f = |v: &Value| v.as_f64().map_or("-".to_string(), |x| format!("{x:.1}"));
    println!("{:<58} {:>10}", "batch-1 decode, Qwen3-8B shape", "tokens/s");
    println!("{:<58} {:>10}", "ours, plain greedy (K/V caches)", f(&result["ours_decode_tokens_per_s"]));
    println!("{:<58} {:>10.1}", "  the same, its linear layers through cuBLAS", rate(cublas_plain));
    println!(
        "{:<58} {:>10}",
        "transformers generate (same checkpoint and prompt)",
        f(&result["hf_decode_tokens_per_s"])
    );
    let label = format!(
        "weight-bandwidth ceiling ({:.1} GB per token at {:.1} TB/s)",
        weight_bytes / 1e9,
        decode_bytes_per_s(gpu.name()) / 1e12
    );
    println!("{label:<58} {ceiling:>10.1}");
    if let Some((ms, out)) = &random_spec {
        println!(
            "{:<58} {:>10.1}  (tau {:.2})",
            "ours, speculative with a random 5-layer drafter",
            rate(*ms),
            out.tau()
        );
        if let Some((ms, _)) = &cublas_spec {
            println!("{:<58} {:>10.1}", "  the same, its blocks' linear layers through cuBLAS", rate(*ms));
        }
        let r = &result["random_drafter_8b"];
        if let (Some(d), Some(bound)) = (drafter_bytes, bytes_bound) {
            println!(
                "a step reads {:.1} GB of target and {:.1} GB of drafter weights: at least {bound:.3} plain tokens, \
                 speedup at most {:.3} x tau",
                weight_bytes / 1e9,
                d / 1e9,
                1.0 / bound
            );
        }
        println!(
            "a verify step costs {:.3} plain tokens on the 8B shape: {:.2}x at the built-in pair's tau {builtin_tau:.2} \
             (projected; goal 0.8 x tau = {:.2}x)",
            r["step_ms_over_plain_token_ms"].as_f64().unwrap_or(f64::NAN),
            r["projected_speedup_at_builtin_tau"].as_f64().unwrap_or(f64::NAN),
            0.8 * builtin_tau
        );
    }
    println!("built-in pair, bound by the host's launches, on: {}", result["host"].as_str().unwrap_or("-"));
    println!("{:<58} {:>10.1}", "built-in pair: plain", rate(builtin_plain_ms));
    println!(
        "{:<58} {:>10.1}  (tau {builtin_tau:.2}, {builtin_speedup:.2}x)",
        "built-in pair: speculative",
        rate(builtin_spec_ms)
    );
    if let Some(a) = result["tokens_agreeing_with_hf"].as_u64() {
        println!("greedy tokens agreeing with transformers' before the first difference: {a} of {new_tokens}");
    }
    println!("wrote {}", out.display());
    Ok(())
}

/// The HBM bandwidth batch-1 decoding can reach on the GPU named `gpu`: on the H200 about 4 TB/s
/// of the 4.8 specified (the basis for the plain-decoding ceiling), on an H100 the same
/// share of its 3.35 TB/s.
fn decode_bytes_per_s(gpu: &str) -> f64 {
    const H200: f64 = 4.0e12;
    match gpu.contains("H100") {
        true => H200 * 3.35 / 4.8,
        false => H200,
    }
}

/// Parameters read per decoded token: every layer, the final norm and the LM head (the embedding
/// table only as the head when tied: one row of it is negligible).
fn decoded_params(config: &TargetConfig) -> f64 {
    let embed_only = !config.tie_word_embeddings;
    dflash_reference::target::target_param_shapes(config)
        .iter()
        .filter(|(name, _)| !(embed_only && name == "model.embed_tokens.weight"))
        .map(|(_, shape)| shape.iter().product::<usize>() as f64)
        .sum()
}

/// How decodes are timed: `warmup` untimed, then the median of `iters` CUDA-event timings.
struct Timing<'a> {
    gpu: &'a Gpu,
    warmup: usize,
    iters: usize,
    new_tokens: usize,
}

// Both decodes run `new_tokens` tokens with no stop (the decoders' entry points without a stop
// set): fixed-length decoding, as transformers' `generate` runs it here (`eos_token_id=None`).
impl Timing<'_> {
    fn plain<T: DecodeTarget>(&self, decoder: &mut SpecDecoder<T>, prompt: &[u32]) -> Result<(f64, Vec<u32>), String> {
        let mut tokens = Vec::new();
        let ms = self
            .gpu
            .time_ms(self.warmup, self.iters, || {
                tokens = decoder.greedy_decode(prompt, self.new_tokens)?;
                Ok(())
            })
            .map_err(|e| e.to_string())?;
        Ok((ms, tokens))
    }

    fn speculative<T: DecodeTarget>(
        &self,
        decoder: &mut SpecDecoder<T>,
        prompt: &[u32],
    ) -> Result<(f64, SpecOutput), String> {
        let mut out = None;
        let ms = self
            .gpu
            .time_ms(self.warmup, self.iters, || {
                out = Some(decoder.speculative_decode(prompt, self.new_tokens)?);
                Ok(())
            })
            .map_err(|e| e.to_string())?;
        Ok((ms, out.expect("timed at least once")))
    }
}
