//! [`RunConfig`]: every option of a training run, read from a TOML file and `--key value`
//! overrides, validated before any work.
//!
//! Layers, each overriding the one before: a preset ([`RunConfig::builtin`] for the built-in
//! tiny default, [`RunConfig::default`] = the spec's recipe for real runs), then the keys of
//! `--config FILE`, then `--key value` on the command line (the key with `-` for `_`). Unknown
//! keys are errors naming the key (and the file and line).

use std::io::Write;
use std::path::{Path, PathBuf};

use dflash_optimized::memory::step::Checkpointing;
use dflash_reference::loss::default_gamma;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Where a step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepKind {
    /// candle autograd of the reference drafter (f32).
    Reference,
    /// The GPU step's driver and layout on the CPU twins (f32, per-layer checkpointing).
    Host,
    /// The optimized step on the GPU (bf16, fp32 masters and AdamW on the device).
    Gpu,
}

impl StepKind {
    pub const ALL: [StepKind; 3] = [StepKind::Reference, StepKind::Host, StepKind::Gpu];

    pub fn name(self) -> &'static str {
        match self {
            StepKind::Reference => "reference",
            StepKind::Host => "host",
            StepKind::Gpu => "gpu",
        }
    }
}

/// The drafter step's activation checkpointing on the device (the `host` and `gpu` steps): one
/// policy, or `auto`, the fastest whose step fits the device's free memory. The policies give
/// the same gradients (tests), so the choice moves speed and memory only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckpointingChoice {
    Auto,
    None,
    Selective,
    PerLayer,
}

impl CheckpointingChoice {
    /// The policies to lay the step out with, fastest first (`DeviceEngine` takes the first
    /// that fits).
    pub fn policies(self) -> Vec<Checkpointing> {
        match self {
            CheckpointingChoice::Auto => Checkpointing::ALL.to_vec(),
            CheckpointingChoice::None => vec![Checkpointing::None],
            CheckpointingChoice::Selective => vec![Checkpointing::Selective],
            CheckpointingChoice::PerLayer => vec![Checkpointing::PerLayer],
        }
    }
}

/// The built-in target the built-in default trains against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BuiltinTarget {
    /// Hidden 64, heads of 16: minutes on the CPU.
    Tiny,
    /// Hidden 128, heads of 64 (the GPU kernels' granule): the GPU built-in default.
    Gpu,
    /// A Qwen3.5-style hybrid (GatedDeltaNet + gated attention, spec section 10) of the GPU
    /// built-in's size.
    Hybrid,
}

/// Every option of a run. `steps` or `epochs` sets the length (not both; `steps` wins when a
/// later layer sets it); `gamma` defaults to the block size's ([`default_gamma`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epochs: Option<f64>,
    /// Rows of one micro-batch.
    pub rows_per_step: usize,
    /// Micro-batches accumulated into one optimizer step.
    pub grad_accum: usize,
    /// `N_max`, anchors drawn per row (re-drawn every step).
    pub anchors: usize,
    pub lr: f64,
    pub warmup_frac: f64,
    pub clip_norm: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gamma: Option<f64>,
    pub seed: u64,
    pub step: StepKind,
    pub checkpointing: CheckpointingChoice,
    /// The built-in target (`tiny` or `gpu`).
    pub builtin_target: BuiltinTarget,
    pub out: PathBuf,
    /// A checkpoint every this many steps (0: only at the end).
    pub checkpoint_every: usize,
    pub keep_checkpoints: usize,
    pub log_every: usize,
    /// Held-out evaluation every this many steps (0: only before and after).
    pub eval_every: usize,
    pub eval_rows: usize,
    /// Held-out prompts and tokens per prompt of the tau measured by speculative decoding.
    pub tau_prompts: usize,
    pub tau_tokens: usize,
    pub max_nonfinite_in_a_row: usize,
    /// Built-in data: rows sampled from the tiny target, at this temperature (0 = greedy),
    /// each a random prompt (not supervised) and the target's continuation.
    pub rows: usize,
    pub temperature: f64,
    pub prompt_len: usize,
    pub continuation_len: usize,
    /// Real runs: the target's HF folder (config.json, weights, tokenizer, chat template);
    /// unset: the built-in default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<PathBuf>,
    /// Real runs: the jsonl conversation files.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub data: Vec<PathBuf>,
    /// Real runs: train from this feature cache (`xtask features`) instead of running the target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub features: Option<PathBuf>,
    /// Real runs: `S`, tokens per document and per packed row.
    pub max_len: usize,
    /// Real runs: pack documents into rows (false: one per row, padded to `max_len`).
    pub packing: bool,
    /// Real runs: the chat template's `enable_thinking`.
    pub thinking: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    /// Real runs: the held-out conversations: a fraction, or a jsonl file.
    pub held_out: String,
    /// Real runs: the tokenized data's cache folder (default `OUT/data-cache`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_cache: Option<PathBuf>,
    /// Real runs: the drafter's mask token (default: the first id past the tokenizer's
    /// vocabulary, as the published Qwen3 drafters use).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mask_token_id: Option<u32>,
    /// Real runs: the drafter's layers and block size.
    pub draft_layers: usize,
    pub block_size: usize,
    /// Real runs: the target layers whose outputs are the features (default: the spec's rule
    /// for 5 features, or the feature cache's layers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_layer_ids: Option<Vec<usize>>,
    /// Data-parallel drafter workers (`dist::DataParallel`; `host` step: one thread each).
    pub drafter_workers: usize,
    /// Real runs, online: target workers computing the rows' features for the drafter workers
    /// (`dist::feed`); 0: each drafter worker runs the target itself.
    pub target_workers: usize,
    /// Shard the AdamW state (fp32 masters and moments) over the drafter workers: each holds and
    /// updates its shard, and the workers gather each other's updated weights.
    pub shard_optimizer: bool,
    /// The `gpu` step: one GPU per worker, target workers first (empty: every worker on GPU 0).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<usize>,
    /// Several processes training as one (`dist::group`): this process's rank, the number of
    /// processes, rank 0's address and port. Unset: the torchrun variables (`RANK`,
    /// `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), else one process. Never saved with a
    /// checkpoint ([`LAUNCH_OPTIONS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master_addr: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub master_port: Option<usize>,
}

impl Default for RunConfig {
    /// The spec's recipe (section 3): AdamW lr 6e-4, betas 0.9/0.999, eps 1e-8, no weight decay,
    /// warmup 4% then cosine to 0, clip 1, 6 epochs, 512 anchors.
    fn default() -> Self {
        RunConfig {
            steps: None,
            epochs: Some(6.0),
            rows_per_step: 1,
            grad_accum: 1,
            anchors: 512,
            lr: 6e-4,
            warmup_frac: 0.04,
            clip_norm: 1.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            gamma: None,
            seed: 0,
            step: StepKind::Gpu,
            checkpointing: CheckpointingChoice::Auto,
            builtin_target: BuiltinTarget::Tiny,
            out: PathBuf::from("runs/drafter"),
            checkpoint_every: 1000,
            keep_checkpoints: 3,
            log_every: 10,
            eval_every: 1000,
            eval_rows: 64,
            tau_prompts: 0,
            tau_tokens: 128,
            max_nonfinite_in_a_row: 5,
            rows: 64,
            temperature: 0.5,
            prompt_len: 16,
            continuation_len: 80,
            target: None,
            data: Vec::new(),
            features: None,
            max_len: 3072,
            packing: true,
            thinking: false,
            system_prompt: None,
            held_out: "0.05".into(),
            data_cache: None,
            mask_token_id: None,
            draft_layers: 5,
            block_size: 16,
            target_layer_ids: None,
            drafter_workers: 1,
            target_workers: 0,
            shard_optimizer: false,
            gpus: Vec::new(),
            rank: None,
            world_size: None,
            master_addr: None,
            master_port: None,
        }
    }
}

/// The value type of an option on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Int,
    Float,
    Text,
    /// `yes`/`no` (or `true`/`false`).
    Bool,
    /// Comma-separated whole numbers.
    Ints,
    /// Several paths (`--data A B ...`).
    Paths,
}

/// Every option: name (TOML key; `--name` with `-` for `_`), type and meaning.
pub const FIELDS: &[(&str, Kind, &str)] = &[
    ("steps", Kind::Int, "optimizer steps (or `epochs`)"),
    ("epochs", Kind::Float, "passes over the training rows (or `steps`)"),
    ("rows_per_step", Kind::Int, "rows per micro-batch"),
    ("grad_accum", Kind::Int, "micro-batches accumulated per optimizer step"),
    ("anchors", Kind::Int, "anchors drawn per row (N_max), re-drawn every step"),
    ("lr", Kind::Float, "peak learning rate (AdamW)"),
    ("warmup_frac", Kind::Float, "fraction of the steps warming up linearly, in [0, 1); then cosine to 0"),
    ("clip_norm", Kind::Float, "global gradient-norm clip"),
    ("beta1", Kind::Float, "AdamW beta1"),
    ("beta2", Kind::Float, "AdamW beta2"),
    ("eps", Kind::Float, "AdamW epsilon"),
    ("weight_decay", Kind::Float, "AdamW decoupled weight decay"),
    ("gamma", Kind::Float, "loss decay over block offsets (default: 7 for blocks of 16, 5 for 10, 4 for 8)"),
    ("seed", Kind::Int, "seed of the target, the drafter's init, the data and the anchors"),
    ("step", Kind::Text, "the step: `reference` (candle autograd), `host` (the GPU step on the CPU twins) or `gpu`"),
    ("checkpointing", Kind::Text, "the `host` and `gpu` steps' activation checkpointing: `auto` (the fastest policy whose step fits the device's free memory), `none`, `selective` or `per-layer`"),
    ("builtin_target", Kind::Text, "built-in target: `tiny` (CPU), `gpu` (heads of 64, which the GPU kernels need) or `hybrid` (a Qwen3.5-style GatedDeltaNet hybrid of the `gpu` one's size)"),
    ("out", Kind::Text, "run folder: checkpoints, metrics.jsonl, training.svg, drafter/"),
    ("checkpoint_every", Kind::Int, "a checkpoint every N steps (0: only at the end)"),
    ("keep_checkpoints", Kind::Int, "checkpoints kept (older ones deleted once a new one is complete)"),
    ("log_every", Kind::Int, "a metrics line every N steps"),
    ("eval_every", Kind::Int, "held-out loss, accuracy and tau_hat every N steps (0: before and after only)"),
    ("eval_rows", Kind::Int, "held-out rows"),
    ("tau_prompts", Kind::Int, "held-out prompts of the real tau (greedy speculative decoding with the step's cached decoders: on the GPU in bf16, beside the step with their own copy of the target; the reference decoders with the reference step) at each evaluation; 0: none (real runs' default)"),
    ("tau_tokens", Kind::Int, "tokens generated per tau prompt"),
    ("max_nonfinite_in_a_row", Kind::Int, "stop after this many skipped non-finite steps in a row"),
    ("rows", Kind::Int, "built-in data: training rows sampled from the tiny target"),
    ("temperature", Kind::Float, "built-in data: sampling temperature (0 = greedy)"),
    ("prompt_len", Kind::Int, "built-in data: random prompt tokens per row (not supervised)"),
    ("continuation_len", Kind::Int, "built-in data: tokens the target continues each prompt with"),
    ("target", Kind::Text, "real runs: the target's HF folder (config.json, safetensors, tokenizer, chat template): Qwen3, Llama or a Qwen3.5/3.6 hybrid"),
    ("data", Kind::Paths, "real runs: jsonl conversation files (`--data A B ...`)"),
    (
        "features",
        Kind::Text,
        "real runs: train from this feature cache (`xtask features`) instead of running the target",
    ),
    ("max_len", Kind::Int, "real runs: S, tokens per document and per packed row"),
    ("packing", Kind::Bool, "real runs: pack documents into rows (no: one per row, padded)"),
    ("thinking", Kind::Bool, "real runs: the chat template's enable_thinking"),
    ("system_prompt", Kind::Text, "real runs: system message for conversations without one"),
    ("held_out", Kind::Text, "real runs: held-out conversations, a fraction or a jsonl file"),
    ("data_cache", Kind::Text, "real runs: the tokenized data's cache folder (default OUT/data-cache)"),
    (
        "mask_token_id",
        Kind::Int,
        "real runs: the mask token (default: the first id past the tokenizer's vocabulary)",
    ),
    ("draft_layers", Kind::Int, "real runs: drafter layers"),
    ("block_size", Kind::Int, "real runs: tokens per block"),
    (
        "target_layer_ids",
        Kind::Ints,
        "real runs: target layers of the features, e.g. 1,9,17,25,33 (default: the spec's rule)",
    ),
    (
        "drafter_workers",
        Kind::Int,
        "data-parallel drafter workers (the host step: one thread each; the global batch is unchanged)",
    ),
    (
        "target_workers",
        Kind::Int,
        "real runs, online: target workers feeding the drafter workers (0: each drafter worker runs the target)",
    ),
    (
        "shard_optimizer",
        Kind::Bool,
        "shard the AdamW state over the drafter workers (its memory divided by their count)",
    ),
    (
        "gpus",
        Kind::Ints,
        "gpu step: one GPU per worker, target workers first, e.g. 0,0 for a target and a drafter worker on GPU 0",
    ),
    ("rank", Kind::Int, "several processes: this process's rank, below world_size (default: $RANK, or 0)"),
    ("world_size", Kind::Int, "several processes training as one: how many (default: $WORLD_SIZE, or 1)"),
    ("master_addr", Kind::Text, "several processes: rank 0's address (default: $MASTER_ADDR, or 127.0.0.1)"),
    ("master_port", Kind::Int, "several processes: rank 0's TCP port (default: $MASTER_PORT, or 29500)"),
];

/// The most passes over the data a run may make (more is a typo, and its step count would not
/// fit the checkpoint's TOML integers).
pub const MAX_EPOCHS: f64 = 1e6;

/// The most drafter (or target) workers of one process: one thread each, a GPU each on the GPU
/// (nodes hold 8 to 16).
pub const MAX_WORKERS: usize = 64;

/// Options only the built-in default reads (its target and sampled rows).
const BUILTIN_ONLY: &[&str] = &["builtin_target", "rows", "temperature", "prompt_len", "continuation_len"];

/// Options only a real run reads (its data, rows and derived drafter).
const REAL_ONLY: &[&str] = &[
    "max_len",
    "packing",
    "thinking",
    "system_prompt",
    "held_out",
    "data_cache",
    "mask_token_id",
    "draft_layers",
    "block_size",
    "target_layer_ids",
];

/// How a process joins the others of its run (`dist::group::Launch`): options of one process,
/// not of the run, so a checkpoint neither saves nor hashes them ([`RunConfig::without_launch`]).
pub const LAUNCH_OPTIONS: &[&str] = &["rank", "world_size", "master_addr", "master_port"];

/// Options that may change between a checkpoint and its resumption: they do not change the
/// steps already taken or the next ones' losses (`steps` / `epochs` change the schedule of the
/// steps not yet taken, which is the point of extending a run; `drafter_workers` groups the
/// gradients' f32 sums otherwise, so the losses agree within its rounding).
pub const RESUMABLE_CHANGES: &[&str] = &[
    "steps",
    "checkpointing",
    "epochs",
    "out",
    "checkpoint_every",
    "keep_checkpoints",
    "log_every",
    "eval_every",
    "eval_rows",
    "tau_prompts",
    "tau_tokens",
    "max_nonfinite_in_a_row",
    "data_cache",
    "drafter_workers",
    "shard_optimizer",
    "target_workers",
    "gpus",
    "rank",
    "world_size",
    "master_addr",
    "master_port",
];

/// The most optimizer steps a run takes (a bound against absurd values; the plan counts its rows
/// and tokens in u128).
pub const MAX_STEPS: usize = 1 << 40;
/// The most rows of one update (`rows_per_step` x `grad_accum`): every one is held on the host.
pub const MAX_ROWS_PER_UPDATE: usize = 1 << 16;
/// The most held-out prompts of the real tau (each decoded at every evaluation).
pub const MAX_TAU_PROMPTS: usize = 1 << 16;

/// The block size of the built-in tiny drafter.
pub const BUILTIN_BLOCK_SIZE: usize = 8;
/// Positions the built-in tiny target supports (`max_position_embeddings`).
pub const BUILTIN_MAX_POSITIONS: usize = 1024;

impl RunConfig {
    /// The built-in tiny default of `cargo xtask train`: 600 steps of 4 rows x 16 anchors, peak
    /// lr 3e-3, 64 rows of 16+80 tokens sampled at temperature 0.5; the rest as the spec.
    pub fn builtin() -> Self {
        RunConfig {
            steps: Some(600),
            epochs: None,
            step: StepKind::Reference,
            rows_per_step: 4,
            anchors: 16,
            lr: 3e-3,
            out: PathBuf::from("runs/tiny-drafter"),
            checkpoint_every: 200,
            log_every: 20,
            eval_every: 200,
            eval_rows: 8,
            tau_prompts: 4,
            tau_tokens: 48,
            ..RunConfig::default()
        }
    }

    /// `base` with the keys of the TOML file `file` over it.
    pub fn from_file(base: &RunConfig, file: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(file).map_err(|e| Error::io(file, e))?;
        Self::from_toml(base, &text, file)
    }

    /// `base` with the keys of the TOML `text` over it; `file` names it in errors.
    pub fn from_toml(base: &RunConfig, text: &str, file: &Path) -> Result<Self> {
        let file_error = |e: toml::de::Error| Error::ConfigFile { file: file.to_path_buf(), message: e.to_string() };
        // Parsed once as the whole struct: unknown keys and mistyped values with their line.
        let _: RunConfig = toml::from_str(text).map_err(file_error)?;
        let table: toml::Table = toml::from_str(text).map_err(file_error)?;
        if table.contains_key("steps") && table.contains_key("epochs") {
            return Err(Error::ConfigFile {
                file: file.to_path_buf(),
                message: "sets both `steps` and `epochs`; set one".into(),
            });
        }
        let mut merged = base.to_table()?;
        overlay(&mut merged, table);
        Self::from_table(merged)
    }

    /// `self` with `--key value` pairs over it (keys as on the command line, `-` for `_`).
    pub fn with_overrides(&self, overrides: &[(String, String)]) -> Result<Self> {
        let mut layer = toml::Table::new();
        for (flag, value) in overrides {
            let key = flag.replace('-', "_");
            let kind = FIELDS.iter().find(|(name, _, _)| *name == key).map(|&(_, kind, _)| kind).ok_or_else(|| {
                Error::Unknown { what: format!("option `--{flag}`"), known: known_flags().join(", ") }
            })?;
            if key == "step" && !["reference", "host", "gpu"].contains(&value.as_str()) {
                return Err(Error::option("--step", format!("unknown step `{value}` (reference, host or gpu)")));
            }
            if key == "checkpointing" && !["auto", "none", "selective", "per-layer"].contains(&value.as_str()) {
                return Err(Error::option(
                    "--checkpointing",
                    format!("unknown policy `{value}` (auto, none, selective or per-layer)"),
                ));
            }
            if key == "builtin_target" && !["tiny", "gpu", "hybrid"].contains(&value.as_str()) {
                return Err(Error::option(
                    "--builtin-target",
                    format!("unknown target `{value}` (tiny, gpu or hybrid)"),
                ));
            }
            layer.insert(key, parse_value(flag, kind, value)?);
        }
        if layer.contains_key("steps") && layer.contains_key("epochs") {
            return Err(Error::option("--steps", "set `--steps` or `--epochs`, not both"));
        }
        let mut merged = self.to_table()?;
        overlay(&mut merged, layer);
        Self::from_table(merged)
    }

    fn from_table(table: toml::Table) -> Result<Self> {
        toml::Value::Table(table).try_into().map_err(|e: toml::de::Error| Error::option("config", e.to_string()))
    }

    /// The config as a TOML table.
    pub fn to_table(&self) -> Result<toml::Table> {
        toml::Table::try_from(self).map_err(|e| Error::option("config", e.to_string()))
    }

    /// The config as TOML text (what `--plan` prints and a checkpoint stores).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a RunConfig always serializes")
    }

    /// The config without the [`LAUNCH_OPTIONS`] (what a checkpoint saves and hashes: a run
    /// resumes on any number of processes).
    pub fn without_launch(&self) -> RunConfig {
        RunConfig { rank: None, world_size: None, master_addr: None, master_port: None, ..self.clone() }
    }

    /// The config with its input paths (`target`, `data`, `features`, `data_cache`, a `held_out`
    /// file) made absolute against the working directory, so that a checkpoint's `run.toml`
    /// names the same files whichever folder the run is resumed from. `out` stays as given (a
    /// resumed run's is its `--resume` folder).
    pub fn with_absolute_paths(&self) -> Result<Self> {
        let absolute = |name: &str, p: &Path| {
            std::path::absolute(p).map_err(|e| Error::option(name, format!("{}: {e}", p.display())))
        };
        let mut c = self.clone();
        c.target = c.target.as_deref().map(|p| absolute("target", p)).transpose()?;
        c.data = c.data.iter().map(|p| absolute("data", p)).collect::<Result<_>>()?;
        c.features = c.features.as_deref().map(|p| absolute("features", p)).transpose()?;
        c.data_cache = c.data_cache.as_deref().map(|p| absolute("data_cache", p)).transpose()?;
        if c.held_out.parse::<f64>().is_err() {
            c.held_out = absolute("held_out", Path::new(&c.held_out))?.display().to_string();
        }
        Ok(c)
    }

    /// `gamma`, or the block size's default.
    pub fn gamma_for(&self, block_size: usize) -> f64 {
        self.gamma.unwrap_or_else(|| default_gamma(block_size))
    }

    /// The config with `gamma` filled in for `block_size` and `steps` computed from `epochs`
    /// over `train_rows` rows (so that it reads the same whatever layer set the length).
    pub fn resolved(&self, block_size: usize, train_rows: usize) -> Self {
        let mut c = self.clone();
        c.gamma = Some(self.gamma_for(block_size));
        c.steps = Some(self.total_steps(train_rows));
        c.epochs = None;
        c
    }

    /// Refuses a run whose `epochs` over `train_rows` rows come to more than [`MAX_STEPS`] steps
    /// (an explicit `steps` is checked by [`RunConfig::validate`]).
    pub fn check_total_steps(&self, train_rows: usize) -> Result<()> {
        match self.total_steps(train_rows) {
            s if s > MAX_STEPS => Err(Error::option(
                "epochs",
                format!("{} over {train_rows} rows: {s} steps, at most {MAX_STEPS}", self.epochs.unwrap_or(1.0)),
            )),
            _ => Ok(()),
        }
    }

    /// Which workers of a run of `world_size` processes would have no row of an update: fewer
    /// rows per update than drafter workers (or target workers) over all processes; `None` when
    /// each can have one.
    pub fn workers_without_rows(&self, world_size: usize) -> Option<String> {
        let rows = self.rows_per_update();
        let drafters = self.drafter_workers.saturating_mul(world_size);
        let (workers, what) = match self.target_workers.saturating_mul(world_size) {
            t if t > drafters => (t, "target workers"),
            _ => (drafters, "drafter workers"),
        };
        (rows < workers).then(|| {
            format!(
                "{} x grad_accum {} = {rows} rows per update for {workers} {what}{}",
                self.rows_per_step,
                self.grad_accum,
                if world_size > 1 { format!(" over {world_size} processes") } else { String::new() }
            )
        })
    }

    /// Refuses a run whose workers would not each have a row of every update
    /// ([`RunConfig::workers_without_rows`]).
    pub fn check_rows_for_workers(&self, world_size: usize) -> Result<()> {
        let need = self.drafter_workers.max(self.target_workers).saturating_mul(world_size);
        match self.workers_without_rows(world_size) {
            Some(why) => Err(Error::option(
                "rows_per_step",
                format!("{why}: each needs a row of every update (--rows-per-step {need} or more)"),
            )),
            None => Ok(()),
        }
    }

    /// Rows one optimizer step consumes.
    pub fn rows_per_update(&self) -> usize {
        self.rows_per_step.saturating_mul(self.grad_accum)
    }

    /// Whether the step sums gradients in an fp32 accumulator on its device: several rows per
    /// update, or a run of workers (several drafter workers, target workers feeding them, or
    /// several processes: `world_size`, the launch's, from options or torchrun's variables),
    /// whose gradients go through a reduction group.
    pub fn accumulates_gradients(&self, world_size: usize) -> bool {
        self.rows_per_update() > 1 || self.drafter_workers > 1 || self.target_workers > 0 || world_size > 1
    }

    /// Optimizer steps of the run over `train_rows` rows: `steps`, or `epochs` worth of rows.
    pub fn total_steps(&self, train_rows: usize) -> usize {
        match (self.steps, self.epochs) {
            (Some(s), _) => s,
            (None, Some(e)) => ((e * train_rows as f64) / self.rows_per_update() as f64).ceil().max(1.0) as usize,
            (None, None) => 1,
        }
    }

    /// Tokens of one built-in row.
    pub fn builtin_row_len(&self) -> usize {
        self.prompt_len.saturating_add(self.continuation_len)
    }

    /// The `gpu` step's GPUs: (target workers', drafter workers'), every worker on GPU 0
    /// unless `gpus` lists them.
    pub fn topology(&self) -> (Vec<usize>, Vec<usize>) {
        let t = self.target_workers;
        match self.gpus.is_empty() {
            true => (vec![0; t], vec![0; self.drafter_workers]),
            false => (self.gpus[..t.min(self.gpus.len())].to_vec(), self.gpus[t.min(self.gpus.len())..].to_vec()),
        }
    }

    /// `gpus` against the workers: one GPU per worker, drafter workers on distinct GPUs (one
    /// NCCL rank each); target workers anywhere (their features are copied into a drafter's
    /// step on the same GPU, or peer to peer from another).
    fn validate_gpus(&self) -> Result<()> {
        let workers = self.target_workers + self.drafter_workers;
        if !self.gpus.is_empty() && self.step != StepKind::Gpu {
            return Err(Error::option(
                "gpus",
                format!("GPUs for the `{}` step: `gpus` places the `gpu` step's workers", self.step.name()),
            ));
        }
        if self.step != StepKind::Gpu {
            return Ok(());
        }
        if !self.gpus.is_empty() && self.gpus.len() != workers {
            return Err(Error::option(
                "gpus",
                format!(
                    "{} GPUs for {} target + {} drafter workers: list one GPU per worker, target workers first",
                    self.gpus.len(),
                    self.target_workers,
                    self.drafter_workers
                ),
            ));
        }
        let (_, drafters) = self.topology();
        if let Some(g) = drafters.iter().enumerate().find_map(|(i, g)| drafters[..i].contains(g).then_some(g)) {
            return Err(Error::option(
                "gpus",
                format!("two drafter workers on GPU {g}: each drafter worker needs a GPU of its own (one NCCL rank each); list them with `gpus`"),
            ));
        }
        Ok(())
    }

    /// Range-checks every option (no file is touched): an error names the option.
    pub fn validate(&self) -> Result<()> {
        let at_least = |name: &str, value: usize, min: usize| {
            if value < min {
                Err(Error::option(name, format!("{value}: must be at least {min}")))
            } else {
                Ok(())
            }
        };
        let finite = |name: &str, value: f64| {
            if value.is_finite() {
                Ok(())
            } else {
                Err(Error::option(name, format!("{value}: must be a finite number")))
            }
        };
        match (self.steps, self.epochs) {
            (Some(_), Some(_)) => return Err(Error::option("steps", "set `steps` or `epochs`, not both")),
            (None, None) => return Err(Error::option("steps", "set `steps` or `epochs`")),
            (Some(s), None) => {
                at_least("steps", s, 1)?;
                if s > MAX_STEPS {
                    return Err(Error::option("steps", format!("{s}: at most {MAX_STEPS}")));
                }
            }
            (None, Some(e)) => {
                finite("epochs", e)?;
                if e <= 0.0 || e > MAX_EPOCHS {
                    return Err(Error::option("epochs", format!("{e}: must be above 0 and at most {MAX_EPOCHS}")));
                }
            }
        }
        // The prefill gives the first token; verify steps (tau) the ones after it.
        at_least("tau_tokens", self.tau_tokens, 2)?;
        if self.tau_prompts > MAX_TAU_PROMPTS {
            return Err(Error::option("tau_prompts", format!("{}: at most {MAX_TAU_PROMPTS}", self.tau_prompts)));
        }
        if self.step == StepKind::Reference && self.checkpointing != CheckpointingChoice::Auto {
            return Err(Error::option(
                "checkpointing",
                "the `reference` step keeps every activation (autograd): checkpointing is the `host` and `gpu` steps'",
            ));
        }
        // A step's rows are all held on the host at once (a cached row is 126 MB for the 8B).
        if self.rows_per_step.checked_mul(self.grad_accum).is_none_or(|n| n > MAX_ROWS_PER_UPDATE) {
            return Err(Error::option(
                "rows_per_step",
                format!(
                    "{} x grad_accum {}: at most {MAX_ROWS_PER_UPDATE} rows per update",
                    self.rows_per_step, self.grad_accum
                ),
            ));
        }
        for (name, value) in [("drafter_workers", self.drafter_workers), ("target_workers", self.target_workers)] {
            if value > MAX_WORKERS {
                return Err(Error::option(name, format!("{value}: at most {MAX_WORKERS} (one thread per worker)")));
            }
        }
        // An empty path is the working folder by accident (files of the run strewn there).
        let paths = [("out", Some(&self.out)), ("target", self.target.as_ref()), ("features", self.features.as_ref())];
        let paths = paths.into_iter().chain([("data_cache", self.data_cache.as_ref())]);
        let paths = paths.chain(self.data.iter().map(|d| ("data", Some(d))));
        if let Some((name, _)) = paths.into_iter().find(|(_, p)| p.is_some_and(|p| p.as_os_str().is_empty())) {
            return Err(Error::option(name, "an empty path"));
        }
        for (name, value) in [
            ("rows_per_step", self.rows_per_step),
            ("grad_accum", self.grad_accum),
            ("anchors", self.anchors),
            ("keep_checkpoints", self.keep_checkpoints),
            ("log_every", self.log_every),
            ("eval_rows", self.eval_rows),
            ("max_nonfinite_in_a_row", self.max_nonfinite_in_a_row),
            ("drafter_workers", self.drafter_workers),
            ("rows", self.rows),
            ("prompt_len", self.prompt_len),
        ] {
            at_least(name, value, 1)?;
        }
        at_least("continuation_len", self.continuation_len, 2)?;
        if self.drafter_workers > 1 && self.step == StepKind::Reference {
            return Err(Error::option(
                "drafter_workers",
                format!(
                    "{} workers with the `reference` step: several drafter workers run the `host` step (one thread each) or the `gpu` step (one GPU each)",
                    self.drafter_workers
                ),
            ));
        }
        if self.target_workers > 0
            && (self.step == StepKind::Reference || self.target.is_none() || self.features.is_some())
        {
            return Err(Error::option(
                "target_workers",
                "target workers compute features online in a real run with the `host` or `gpu` step (`--target`, no `--features`)",
            ));
        }
        if self.shard_optimizer && (self.drafter_workers < 2 || self.step == StepKind::Reference) {
            return Err(Error::option(
                "shard_optimizer",
                format!(
                    "with {} drafter worker(s) and the `{}` step: the AdamW state is sharded over 2 or more drafter workers of the `host` or `gpu` step",
                    self.drafter_workers,
                    self.step.name()
                ),
            ));
        }
        self.validate_gpus()?;
        if self.target.is_none() && self.step == StepKind::Gpu && self.builtin_target == BuiltinTarget::Tiny {
            return Err(Error::option(
                "step",
                "`gpu` needs `builtin_target = gpu` or `hybrid` (the tiny target's heads of 16 are below the GPU kernels' 64)",
            ));
        }
        for (name, value) in [
            ("lr", self.lr),
            ("warmup_frac", self.warmup_frac),
            ("clip_norm", self.clip_norm),
            ("beta1", self.beta1),
            ("beta2", self.beta2),
            ("eps", self.eps),
            ("weight_decay", self.weight_decay),
            ("temperature", self.temperature),
        ] {
            finite(name, value)?;
        }
        let positive = |name: &str, value: f64| {
            if value > 0.0 {
                Ok(())
            } else {
                Err(Error::option(name, format!("{value}: must be above 0")))
            }
        };
        positive("lr", self.lr)?;
        positive("clip_norm", self.clip_norm)?;
        positive("eps", self.eps)?;
        if let Some(g) = self.gamma {
            finite("gamma", g)?;
            positive("gamma", g)?;
        }
        for (name, value) in [("warmup_frac", self.warmup_frac), ("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&value) {
                return Err(Error::option(name, format!("{value}: must be in [0, 1)")));
            }
        }
        if self.weight_decay < 0.0 {
            return Err(Error::option("weight_decay", format!("{}: must be at least 0", self.weight_decay)));
        }
        if self.temperature < 0.0 {
            return Err(Error::option("temperature", format!("{}: must be at least 0 (0 = greedy)", self.temperature)));
        }
        // Options of the other kind of run are refused, not ignored (both presets leave them at
        // the recipe's values; [`RunConfig::check_given`] refuses one given at that value).
        let (set, recipe) = (self.to_table()?, RunConfig::default().to_table()?);
        let (others, why) = self.other_kind();
        if let Some(name) = others.iter().find(|&&name| set.get(name) != recipe.get(name)) {
            return Err(Error::option(*name, why));
        }
        let row_len = match &self.target {
            None => {
                if !self.data.is_empty() || self.features.is_some() {
                    return Err(Error::option(
                        if self.data.is_empty() { "features" } else { "data" },
                        "needs `target` (the target folder whose data and features these are)",
                    ));
                }
                let row_len = self.builtin_row_len();
                if row_len > BUILTIN_MAX_POSITIONS {
                    return Err(Error::option(
                        "prompt_len + continuation_len",
                        format!(
                            "rows of {} + {} = {row_len} tokens exceed the built-in target's {BUILTIN_MAX_POSITIONS} positions",
                            self.prompt_len, self.continuation_len
                        ),
                    ));
                }
                // The real tau decodes a prompt's tokens, then up to `tau_tokens` and a block.
                let decoded = self.prompt_len.saturating_add(self.tau_tokens).saturating_add(BUILTIN_BLOCK_SIZE - 1);
                if self.tau_prompts > 0 && decoded > BUILTIN_MAX_POSITIONS {
                    return Err(Error::option(
                        "tau_tokens",
                        format!(
                            "{}: prompts of {} tokens + {} new + a block of {BUILTIN_BLOCK_SIZE} exceed the built-in target's {BUILTIN_MAX_POSITIONS} positions",
                            self.tau_tokens, self.prompt_len, self.tau_tokens
                        ),
                    ));
                }
                row_len
            }
            Some(_) => {
                if self.data.is_empty() {
                    return Err(Error::option("data", "a real run (`target` set) needs `--data FILE...`"));
                }
                at_least("max_len", self.max_len, 2)?;
                at_least("block_size", self.block_size, 2)?;
                if self.block_size > self.max_len {
                    return Err(Error::option(
                        "block_size",
                        format!("{}: a block longer than a row of max_len {} tokens", self.block_size, self.max_len),
                    ));
                }
                at_least("draft_layers", self.draft_layers, 1)?;
                if self.draft_layers > dflash_reference::config::MAX_LAYERS {
                    return Err(Error::option(
                        "draft_layers",
                        format!("{}: at most {}", self.draft_layers, dflash_reference::config::MAX_LAYERS),
                    ));
                }
                match self.held_out.parse::<f64>() {
                    Ok(f) if !(0.0..1.0).contains(&f) => {
                        return Err(Error::option("held_out", format!("{f}: a fraction in [0, 1), or a jsonl file")));
                    }
                    Ok(f) if f == 0.0 && self.tau_prompts > 0 => {
                        return Err(Error::option(
                            "tau_prompts",
                            format!("{}, but `held_out` is 0: the real tau decodes held-out prompts (`--tau-prompts 0` trains without it)", self.tau_prompts),
                        ));
                    }
                    Ok(_) => {}
                    Err(_) if !Path::new(&self.held_out).is_file() => {
                        return Err(Error::option(
                            "held_out",
                            format!("`{}`: neither a fraction in [0, 1) nor a jsonl file that exists", self.held_out),
                        ));
                    }
                    Err(_) => {}
                }
                self.max_len
            }
        };
        if self.anchors > row_len - 1 {
            return Err(Error::option(
                "anchors",
                format!("{}: a row of {row_len} tokens holds at most {} anchors", self.anchors, row_len - 1),
            ));
        }
        if self.seed > i64::MAX as u64 {
            return Err(Error::option("seed", format!("{}: must be at most {}", self.seed, i64::MAX)));
        }
        Ok(())
    }

    /// The options only the other kind of run reads (a real run's with the built-in default and
    /// the reverse), and why they do not apply to this one.
    fn other_kind(&self) -> (&'static [&'static str], &'static str) {
        match self.target {
            None => (REAL_ONLY, "applies to real runs (`--target`) only"),
            Some(_) => (BUILTIN_ONLY, "applies to the built-in default only (a real run's rows come from `--data`)"),
        }
    }

    /// Refuses an option of the other kind of run among `given` (keys, `_` spelt), even one
    /// given at its default value.
    pub fn check_given(&self, given: &[String]) -> Result<()> {
        let (others, why) = self.other_kind();
        match given.iter().find(|key| others.contains(&key.as_str())) {
            Some(name) => Err(Error::option(name, why)),
            None => Ok(()),
        }
    }

    /// Checks that `out` is a folder this process can write (creating it if needed): an
    /// existing file, or a folder where a probe file cannot be created, is an error.
    pub fn check_out(&self) -> Result<()> {
        let out = &self.out;
        let err = |message: String| Error::option("out", format!("{}: {message}", out.display()));
        if out.exists() && !out.is_dir() {
            return Err(err("exists and is not a folder".into()));
        }
        std::fs::create_dir_all(out).map_err(|e| err(format!("cannot create the folder: {e}")))?;
        let probe = out.join(format!(".write-probe-{}", std::process::id()));
        let written = std::fs::File::create(&probe).and_then(|mut f| f.write_all(b"probe"));
        let _ = std::fs::remove_file(&probe);
        written.map_err(|e| err(format!("not writable: {e}")))
    }

    /// The options whose values differ between `self` and `saved`, with both values, and whether
    /// each may change on resumption ([`RESUMABLE_CHANGES`]).
    pub fn differences(&self, saved: &RunConfig) -> Vec<(String, String, String, bool)> {
        let (a, b) = (self.to_table().unwrap_or_default(), saved.to_table().unwrap_or_default());
        let mut out = Vec::new();
        for &(name, _, _) in FIELDS {
            let (x, y) = (a.get(name), b.get(name));
            if x != y {
                let show = |v: Option<&toml::Value>| v.map_or("(unset)".to_string(), |v| v.to_string());
                out.push((name.to_string(), show(x), show(y), RESUMABLE_CHANGES.contains(&name)));
            }
        }
        out
    }
}

/// Sets `layer`'s keys in `merged`; a layer that sets `steps` unsets `epochs` and vice versa.
fn overlay(merged: &mut toml::Table, layer: toml::Table) {
    for (key, value) in layer {
        match key.as_str() {
            "steps" => drop(merged.remove("epochs")),
            "epochs" => drop(merged.remove("steps")),
            _ => {}
        }
        merged.insert(key, value);
    }
}

/// A command-line value as the TOML value of an option of `kind`.
fn parse_value(flag: &str, kind: Kind, value: &str) -> Result<toml::Value> {
    let bad = |what: &str| Error::option(format!("--{flag}"), format!("cannot parse `{value}` ({what} expected)"));
    Ok(match kind {
        Kind::Int => {
            let v: u64 = value.parse().map_err(|_| bad("a whole number >= 0"))?;
            toml::Value::Integer(i64::try_from(v).map_err(|_| bad("a number at most 2^63-1"))?)
        }
        Kind::Float => toml::Value::Float(value.parse().map_err(|_| bad("a number"))?),
        Kind::Text => toml::Value::String(value.to_string()),
        Kind::Bool => toml::Value::Boolean(match value {
            "yes" | "true" => true,
            "no" | "false" => false,
            _ => return Err(bad("yes or no")),
        }),
        Kind::Ints => toml::Value::Array(
            value
                .split(',')
                .map(|x| {
                    let v: u32 = x.trim().parse().map_err(|_| bad("comma-separated whole numbers"))?;
                    Ok(toml::Value::Integer(v.into()))
                })
                .collect::<Result<_>>()?,
        ),
        Kind::Paths => toml::Value::Array(value.split('\n').map(|p| toml::Value::String(p.to_string())).collect()),
    })
}

/// Every option as a `--flag`.
pub fn known_flags() -> Vec<String> {
    FIELDS.iter().map(|(name, _, _)| format!("--{}", name.replace('_', "-"))).collect()
}

/// The options' help, one per line: `--name`, meaning, built-in default.
pub fn options_help() -> String {
    let (builtin, recipe) =
        (RunConfig::builtin().to_table().unwrap_or_default(), RunConfig::default().to_table().unwrap_or_default());
    FIELDS
        .iter()
        .map(|&(name, _, help)| {
            let flag = format!("--{}", name.replace('_', "-"));
            let default = match (builtin.get(name), recipe.get(name)) {
                (Some(b), Some(r)) if b != r => format!(" (default {b}; real runs {r})"),
                (Some(b), None) => format!(" (default {b}; real runs none)"),
                (None, Some(r)) => format!(" (real runs {r})"),
                (Some(b), _) => format!(" (default {b})"),
                (None, None) => String::new(),
            };
            format!("  {flag:<26} {help}{default}")
        })
        .collect::<Vec<_>>()
        .join("\n")
}
