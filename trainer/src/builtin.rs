//! The built-in tiny setup of `cargo xtask train`: a random target built in code (a Qwen3, or a
//! Qwen3.5-style hybrid), its tiny drafter, training and held-out rows sampled from the target,
//! and the prompts of the speculative-decoding tau. Everything follows from the config's seed and
//! data options, so a resumed run regenerates the same rows (checked by their sha256).

use candle_core::DType;
use dflash_reference::builtin::{
    generate_rows, gpu_target, gpu_target_config, hybrid_draft_config, hybrid_target, hybrid_target_config,
    random_prompt, target_entropy, tiny_draft_config, tiny_target, tiny_target_config,
};
use dflash_reference::config::DraftConfig;
use dflash_reference::data::TrainRow;
use dflash_reference::drafter::{param_shapes, Drafter};
use dflash_reference::hybrid::hybrid_param_shapes;
use dflash_reference::optim::AdamWConfig;
use dflash_reference::speculative::{plain_decode_until, speculative_decode_until, Acceptance, Sampling};
use dflash_reference::target::Target;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::config::{BuiltinTarget, RunConfig};
use crate::error::{Error, Result};

/// The tiny target, its drafter's config, the rows and the tau prompts.
pub struct BuiltinSetup {
    pub target: Box<dyn Target>,
    pub draft_config: DraftConfig,
    pub data: Vec<TrainRow>,
    pub held_out: Vec<TrainRow>,
    pub prompts: Vec<Vec<u32>>,
    /// The target's next-token entropy over the training rows (nats): the offset-1 loss floor.
    pub entropy: f64,
}

/// The built-in drafter's config for the built-in target `c` names (no weights are made).
pub fn draft_config(c: &RunConfig) -> DraftConfig {
    match c.builtin_target {
        BuiltinTarget::Tiny => tiny_draft_config(&tiny_target_config()),
        BuiltinTarget::Gpu => tiny_draft_config(&gpu_target_config()),
        BuiltinTarget::Hybrid => hybrid_draft_config(&hybrid_target_config()),
    }
}

/// What the built-in target `c` names is, in words, and its parameters (no weights are made).
pub fn target_summary(c: &RunConfig) -> (String, usize) {
    match c.builtin_target {
        BuiltinTarget::Tiny | BuiltinTarget::Gpu => {
            let t = match c.builtin_target {
                BuiltinTarget::Tiny => tiny_target_config(),
                _ => gpu_target_config(),
            };
            let d = &t.dims;
            let params = d.num_layers()
                * (4 * d.hidden_size * d.num_heads * d.head_dim + 3 * d.hidden_size * d.intermediate_size)
                + d.hidden_size * d.vocab_size;
            let text = format!(
                "Qwen3 (random, built in) hidden {} x {} layers, vocab {}",
                d.hidden_size,
                d.num_layers(),
                d.vocab_size
            );
            (text, params)
        }
        BuiltinTarget::Hybrid => {
            let t = hybrid_target_config();
            let params = hybrid_param_shapes(&t)
                .iter()
                .filter(|(name, _)| name != "model.embed_tokens.weight")
                .map(|(_, s)| s.iter().product::<usize>())
                .sum();
            let linear =
                t.layer_kinds.iter().filter(|k| **k == dflash_reference::hybrid::HybridLayerKind::Linear).count();
            let text = format!(
                "Qwen3.5-style hybrid (random, built in) hidden {} x {} layers ({linear} GatedDeltaNet + {} gated attention), vocab {}",
                t.hidden_size,
                t.num_layers(),
                t.num_layers() - linear,
                t.vocab_size
            );
            (text, params)
        }
    }
}

/// Trainable parameters of a drafter config.
pub fn num_params(config: &DraftConfig) -> usize {
    param_shapes(config).iter().map(|(_, s)| s.iter().product::<usize>()).sum()
}

/// The tiny target (seed), then `rows` training rows, `eval_rows` held-out rows and
/// `tau_prompts` prompts from one generator (seed + 2).
pub fn setup(c: &RunConfig) -> Result<BuiltinSetup> {
    let target: Box<dyn Target> = match c.builtin_target {
        BuiltinTarget::Tiny => Box::new(tiny_target(c.seed, DType::F32)?),
        BuiltinTarget::Gpu => Box::new(gpu_target(c.seed, DType::F32)?),
        BuiltinTarget::Hybrid => Box::new(hybrid_target(c.seed, DType::F32)?),
    };
    let draft_config = draft_config(c);
    let mut rng = ChaCha8Rng::seed_from_u64(c.seed + 2);
    let (p, g, t) = (c.prompt_len, c.continuation_len, c.temperature);
    let data = generate_rows(target.as_ref(), &draft_config, c.rows, p, g, t, &mut rng)?;
    let held_out = generate_rows(target.as_ref(), &draft_config, c.eval_rows, p, g, t, &mut rng)?;
    let entropy = target_entropy(target.as_ref(), &data, t)?;
    let vocab = target.vocab_size();
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

/// The tau of greedy speculative decoding over `prompts` (up to `new_tokens` each, ending after
/// an id of `stop`: the target's end-of-turn ids) as spec section 4 defines it: the mean of
/// `A + 1` over all verify steps of all prompts; checks that the output is identical to plain
/// greedy decoding.
pub fn mean_tau(
    target: &dyn Target,
    drafter: &Drafter,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    stop: &[u32],
) -> Result<f64> {
    let mut acceptance = Acceptance::new(drafter.config.block_size);
    for prompt in prompts {
        let spec = speculative_decode_until(target, drafter, prompt, new_tokens, &Sampling::Greedy, stop)?;
        let greedy = plain_decode_until(target, prompt, new_tokens, &Sampling::Greedy, stop)?;
        if spec.tokens != greedy {
            return Err(Error::option("speculative decoding", "output differs from plain greedy decoding"));
        }
        acceptance.add(&spec);
    }
    Ok(acceptance.tau_over_steps())
}
