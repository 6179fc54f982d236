//! The built-in tiny setup of `cargo xtask train`: a random Qwen3 target built in code, its
//! tiny drafter, training and held-out rows sampled from the target, and the prompts of the
//! speculative-decoding tau. Everything follows from the config's seed and data options, so a
//! resumed run regenerates the same rows (checked by their sha256).

use candle_core::DType;
use dflash_reference::builtin::{
    generate_rows, gpu_target, random_prompt, target_entropy, tiny_draft_config, tiny_target,
};
use dflash_reference::config::DraftConfig;
use dflash_reference::data::TrainRow;
use dflash_reference::drafter::{param_shapes, Drafter};
use dflash_reference::optim::AdamWConfig;
use dflash_reference::speculative::{greedy_decode, speculative_decode};
use dflash_reference::target::TargetModel;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::config::{BuiltinTarget, RunConfig};
use crate::error::{Error, Result};

/// The tiny target, its drafter's config, the rows and the tau prompts.
pub struct BuiltinSetup {
    pub target: TargetModel,
    pub draft_config: DraftConfig,
    pub data: Vec<TrainRow>,
    pub held_out: Vec<TrainRow>,
    pub prompts: Vec<Vec<u32>>,
    /// The target's next-token entropy over the training rows (nats): the offset-1 loss floor.
    pub entropy: f64,
}

/// The built-in drafter's config for the built-in target `c` names (no weights are made).
pub fn draft_config(c: &RunConfig) -> DraftConfig {
    tiny_draft_config(&target_config(c))
}

/// The built-in target's config.
pub fn target_config(c: &RunConfig) -> dflash_reference::config::TargetConfig {
    match c.builtin_target {
        BuiltinTarget::Tiny => dflash_reference::builtin::tiny_target_config(),
        BuiltinTarget::Gpu => dflash_reference::builtin::gpu_target_config(),
    }
}

/// Trainable parameters of a drafter config.
pub fn num_params(config: &DraftConfig) -> usize {
    param_shapes(config).iter().map(|(_, s)| s.iter().product::<usize>()).sum()
}

/// The tiny target (seed), then `rows` training rows, `eval_rows` held-out rows and
/// `tau_prompts` prompts from one generator (seed + 2).
pub fn setup(c: &RunConfig) -> Result<BuiltinSetup> {
    let target = match c.builtin_target {
        BuiltinTarget::Tiny => tiny_target(c.seed, DType::F32)?,
        BuiltinTarget::Gpu => gpu_target(c.seed, DType::F32)?,
    };
    let draft_config = tiny_draft_config(&target.config);
    let mut rng = ChaCha8Rng::seed_from_u64(c.seed + 2);
    let (p, g, t) = (c.prompt_len, c.continuation_len, c.temperature);
    let data = generate_rows(&target, &draft_config, c.rows, p, g, t, &mut rng)?;
    let held_out = generate_rows(&target, &draft_config, c.eval_rows, p, g, t, &mut rng)?;
    let entropy = target_entropy(&target, &data, t)?;
    let vocab = target.config.dims.vocab_size;
    let prompts = (0..c.tau_prompts).map(|_| random_prompt(p, vocab, draft_config.mask_token_id, &mut rng)).collect();
    Ok(BuiltinSetup { target, draft_config, data, held_out, prompts, entropy })
}

/// The drafter at its init (seed + 1), f32.
pub fn init_drafter(c: &RunConfig, config: &DraftConfig) -> Result<Drafter> {
    Ok(Drafter::init(config.clone(), c.seed + 1, DType::F32)?)
}

/// AdamW's hyper-parameters of the config.
pub fn adamw_config(c: &RunConfig) -> AdamWConfig {
    AdamWConfig { lr: c.lr, beta1: c.beta1, beta2: c.beta2, eps: c.eps, weight_decay: c.weight_decay }
}

/// Mean tau of greedy speculative decoding over `prompts` (`new_tokens` each); checks that the
/// output is identical to plain greedy decoding.
pub fn mean_tau(target: &TargetModel, drafter: &Drafter, prompts: &[Vec<u32>], new_tokens: usize) -> Result<f64> {
    let mut sum = 0.0;
    for prompt in prompts {
        let spec = speculative_decode(target, drafter, prompt, new_tokens)?;
        let greedy = greedy_decode(target, prompt, new_tokens)?;
        if spec.tokens != greedy {
            return Err(Error::option("speculative decoding", "output differs from plain greedy decoding"));
        }
        sum += spec.tau();
    }
    Ok(sum / prompts.len().max(1) as f64)
}
