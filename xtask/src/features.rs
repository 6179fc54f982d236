//! `cargo xtask features`: the offline feature cache (`dflash_data::features`) of a target and a
//! data set: every document through the target's forward (GPU, or the CPU twins for small
//! targets), written in shards with an index and provenance; a killed run continues where it
//! stopped.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use dflash_data::features::{export_documents, free_bytes, provenance, Entry, FeatureIndex, FeatureWriter};
use dflash_data::target::TargetTokenizer;
use dflash_data::Dataset;
use dflash_optimized::backend::cuda::Cuda;
use dflash_optimized::backend::host::{host_available_bytes, Host};
use dflash_optimized::backend::Backend;
use dflash_optimized::memory::gb;
use dflash_optimized::model::TargetFeatures;
use dflash_reference::config::training_target_layer_ids;
use dflash_reference::data::Row;
use dflash_reference::target::TargetKind;
use dflash_trainer::metrics::{eta, size_text};
use dflash_trainer::real::{load_forward, unused_note};

use crate::data::{data_options, parse_data_args};
use crate::train::{forward_bytes, storage_widths};
use dflash_trainer::config::StepKind;

const HELP: &str = "usage: cargo xtask features --target DIR --data FILE... --out CACHE [options]

Runs the target over every document of the data set (the tokenized, masked documents of `cargo
xtask data`, training and held-out) and writes their features (the outputs of the layers
--layer-ids, concatenated per token, bf16) to CACHE: safetensors shards of about --shard-gb
each and index.json with the provenance (hashes of the target's config and weight files, the
tokenizer, template, special tokens, end-of-turn ids, data files and options, the layer ids).
Prints the size first and refuses when the disk cannot hold it. A killed run continues where
it stopped when rerun with the same arguments; a cache made from anything else is refused
(write a new one to another --out, or delete it). Train from it with `train --features CACHE`.

options:
  --target DIR         HF folder: config.json, safetensors weights, tokenizer, chat template
                       (Qwen3, Llama, or a Qwen3.5/3.6 hybrid)
  --data FILE...       jsonl conversations (as `cargo xtask data` reads them)
  --out CACHE          the cache folder
  --layer-ids LIST     comma-separated target layers        (default: the 5-feature rule of spec 1)
  --shard-gb X         feature bytes per shard, GB, at most 64 (default 4)
  --device gpu|cpu     the GPU, or the CPU twins in f32 (small targets only)  (default gpu)
  --launch-tokens N    tokens per forward (several documents) (default: --max-len)
  --export-documents FILE  write the documents (and the data's provenance) as jsonl for
                       xtask/scripts/features_transformers.py (any target transformers runs)
                       instead of running the target; --out is then not needed
  --max-len N, --thinking yes|no, --system-prompt T, --held-out X, --seed N, --cache DIR
                       the data options of `cargo xtask data`";

const OPTIONS: &[&str] = &[
    "target",
    "out",
    "layer-ids",
    "shard-gb",
    "device",
    "launch-tokens",
    "max-len",
    "packing",
    "thinking",
    "system-prompt",
    "held-out",
    "seed",
    "cache",
    "export-documents",
];

/// The largest shard `--shard-gb` may ask for (the writer holds a shard in host memory).
const MAX_SHARD_GB: f64 = 64.0;

pub fn run(args: Vec<String>) -> Result<(), String> {
    let Some((files, opts)) = parse_data_args(args, OPTIONS, HELP)? else { return Ok(()) };
    let export: PathBuf = opts.get("export-documents", PathBuf::new())?;
    if !export.as_os_str().is_empty() {
        // Before the data is read: the file's folder must be there, the file not a folder.
        let folder = export.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        if export.is_dir() || !folder.is_dir() {
            return Err(format!(
                "option `--export-documents`: {} is a folder, or its folder is missing",
                export.display()
            ));
        }
        let (target_dir, data_opts) = data_options(&opts)?;
        // A cache is made to train from, and `train --features` reads the target's config (sizes,
        // RoPE, vocabulary) and its embedding and LM head: a target it cannot read is refused
        // before any feature is computed.
        TargetKind::from_file(&target_dir.join("config.json")).map_err(|e| {
            format!(
                "{e}: `train --features` reads the target's config and takes Qwen3, Llama, Qwen3 MoE and \
                 Qwen3.5/3.6 hybrids only, so no run could train from this target's cache yet; nothing exported"
            )
        })?;
        let tokenizer = TargetTokenizer::load(&target_dir).map_err(|e| e.to_string())?;
        let data = Dataset::prepare(&tokenizer, &files, &data_opts).map_err(|e| e.to_string())?;
        if let Some(warning) = data.stats().unended_warning() {
            println!("data: {warning}");
        }
        let (docs, tokens) = export_documents(&data.cache, &export).map_err(|e| e.to_string())?;
        println!("wrote {docs} documents ({tokens} tokens) to {}", export.display());
        return Ok(());
    }
    let out: PathBuf = opts.get("out", PathBuf::new())?;
    if out.as_os_str().is_empty() {
        return Err("--out CACHE is required".into());
    }
    if out.exists() && !out.is_dir() {
        return Err(format!("option `--out`: {} exists and is not a folder", out.display()));
    }
    let shard_gb: f64 = opts.get("shard-gb", 4.0)?;
    // A shard is assembled in host memory before it is written.
    if !(shard_gb.is_finite() && shard_gb > 0.0 && shard_gb <= MAX_SHARD_GB) {
        return Err(format!("option `--shard-gb`: {shard_gb}; a positive size of at most {MAX_SHARD_GB} GB expected (a shard is held in memory until written)"));
    }
    let device: String = opts.get("device", "gpu".to_string())?;
    if !["gpu", "cpu"].contains(&device.as_str()) {
        return Err(format!("option `--device`: `{device}` (gpu or cpu)"));
    }
    let (target_dir, data_opts) = data_options(&opts)?;
    let config = TargetKind::from_file(&target_dir.join("config.json")).map_err(|e| e.to_string())?;
    if let TargetKind::Dense(t) = &config {
        t.check_runs_here("`features` without `--export-documents`").map_err(|e| e.to_string())?;
    }
    let layers = config.num_layers();
    let layer_ids: Vec<usize> = match opts.get("layer-ids", String::new())? {
        s if s.is_empty() => training_target_layer_ids(layers, 5),
        s => s
            .split(',')
            .map(|x| x.trim().parse().map_err(|_| format!("option `--layer-ids`: `{x}` is not a layer number")))
            .collect::<Result<_, _>>()?,
    };
    dflash_reference::config::check_feature_layers(&layer_ids, layers)
        .map_err(|e| format!("option `--layer-ids`: {e} ({})", target_dir.join("config.json").display()))?;
    // As `train` checks them: rows within the target's positions, every weight there with its
    // shape (before the data is read or a cache is begun).
    config
        .check_row_len(data_opts.max_len, &target_dir.join("config.json"))
        .map_err(|why| format!("option `--max-len`: {why}"))?;
    let unused = config.check_checkpoint(&target_dir).map_err(|e| e.to_string())?;
    if let Some(note) = unused_note(&unused) {
        println!("{note}");
    }
    let launch_tokens: usize = opts.get("launch-tokens", data_opts.max_len)?;
    if launch_tokens < data_opts.max_len {
        return Err(format!(
            "option `--launch-tokens`: {launch_tokens} is below --max-len {} (a document must fit one forward)",
            data_opts.max_len
        ));
    }

    if device == "gpu" {
        // Before the data is read.
        crate::gpu_conformance::check_gpus("--device", &[0]).map_err(|e| e.to_string())?;
    }
    // The forward against the device's free memory, before the data is read (the GPU, opened
    // once, runs the forward below).
    let gpu = match device.as_str() {
        "gpu" => Some(crate::gpu_conformance::open_gpu()?),
        _ => None,
    };
    let (step, device_name, free) = match &gpu {
        Some(gpu) => (StepKind::Gpu, gpu.name().to_string(), gpu.available_bytes().map_err(|e| e.to_string())?),
        None => (StepKind::Host, "the CPU".to_string(), host_available_bytes().unwrap_or(u64::MAX)),
    };
    let needed = forward_bytes(&config, &layer_ids, launch_tokens, storage_widths(step), false)?;
    if needed > free {
        return Err(format!(
            "memory: the target's forward of {launch_tokens} tokens per launch (`--launch-tokens`) needs {} on {device_name}, which has {} free: fewer tokens per launch (at least --max-len {})",
            size_text(needed),
            size_text(free),
            data_opts.max_len
        ));
    }
    let started = Instant::now();
    let tokenizer = TargetTokenizer::load(&target_dir).map_err(|e| e.to_string())?;
    let data = Dataset::prepare(&tokenizer, &files, &data_opts).map_err(|e| e.to_string())?;
    if let Some(warning) = data.stats().unended_warning() {
        println!("data: {warning}");
    }
    let docs = data.cache.len();
    let tokens: u64 = (0..docs).map(|i| data.cache.doc_len(i) as u64).sum();
    let width = layer_ids.len() * config.hidden_size();
    let index = FeatureIndex {
        format: String::new(),
        provenance: provenance(&target_dir, &layer_ids, &data.cache.key).map_err(|e| e.to_string())?,
        hidden_size: config.hidden_size(),
        layer_ids: layer_ids.clone(),
        shard_bytes: (shard_gb * 1e9) as u64,
        documents: docs,
        tokens,
        shards: vec![],
    };
    let mut writer = FeatureWriter::open(&out, index).map_err(|e| e.to_string())?;
    let total = FeatureIndex::estimate_bytes(tokens, width);
    let done: u64 = writer.index.shards.iter().map(|s| s.bytes).sum();
    let needed = total.saturating_sub(done);
    let free = free_bytes(&out).map_err(|e| e.to_string())?;
    println!(
        "{docs} documents, {tokens} tokens; features of layers {layer_ids:?} ({width} values per token, bf16): {} in all, \
         {} still to write, {} free at {}",
        gb(total),
        gb(needed),
        gb(free),
        out.display()
    );
    if needed > free {
        return Err(format!(
            "{}: the cache needs {} more but the disk has {} free; free space or choose another --out",
            out.display(),
            gb(needed),
            gb(free)
        ));
    }
    if let Some(why) = &writer.rewritten {
        println!("{why}");
    }
    if writer.next_doc() > 0 {
        println!("continuing after document {} ({} complete shards)", writer.next_doc(), writer.index.shards.len());
    }
    let err = |e: dflash_trainer::Error| e.to_string();
    match &gpu {
        Some(gpu) => {
            let cuda = Cuda::new(gpu, config.head_dim()).map_err(|e| e.to_string())?;
            let load = (false, candle_core::DType::BF16);
            let mut forward = load_forward(cuda, &config, &target_dir, &layer_ids, launch_tokens, load).map_err(err)?;
            write_all(forward.as_mut(), &data, &mut writer)?;
        }
        None => {
            let load = (false, candle_core::DType::F32);
            let mut forward =
                load_forward(Host::<f32>::default(), &config, &target_dir, &layer_ids, launch_tokens, load)
                    .map_err(err)?;
            write_all(forward.as_mut(), &data, &mut writer)?;
        }
    }
    let index = writer.finish().map_err(|e| e.to_string())?;
    println!(
        "wrote {} ({} shards, {}) in {:.1}s",
        out.display(),
        index.shards.len(),
        gb(index.shards.iter().map(|s| s.bytes).sum()),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Every document from the writer's next on, several per forward, into the cache; a progress
/// bar (documents/s, ETA) on a terminal, a line per shard otherwise.
fn write_all<B: Backend>(
    forward: &mut dyn TargetFeatures<Backend = B>,
    data: &Dataset,
    writer: &mut FeatureWriter,
) -> Result<(), String> {
    let docs = data.cache.len();
    let first = writer.next_doc();
    let (capacity, width) = forward.feature_shape();
    let bar = if std::io::stdout().is_terminal() {
        let bar = indicatif::ProgressBar::new((docs - first) as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} documents, {per_sec}, ETA {eta}")
                .map_err(|e| e.to_string())?,
        );
        Some(bar)
    } else {
        None
    };
    let started = Instant::now();
    let mut next = first;
    let mut shards = writer.index.shards.len();
    // Test hook (the kill-and-resume test): a pause after each completed shard, in ms.
    let pause = std::env::var("DFLASH_TEST_FEATURES_PAUSE_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(0u64);
    while next < docs {
        // One launch: consecutive documents up to the capacity.
        let mut rows = Vec::new();
        let mut tokens = 0;
        while next + rows.len() < docs {
            let doc = data.cache.document(next + rows.len()).map_err(|e| e.to_string())?;
            if !rows.is_empty() && tokens + doc.tokens.len() > capacity {
                break;
            }
            tokens += doc.tokens.len();
            let n = doc.tokens.len();
            rows.push(Row {
                tokens: doc.tokens,
                loss_mask: doc.loss_mask,
                doc_ids: vec![0; n],
                positions: (0..n).collect(),
            });
        }
        let refs: Vec<&Row> = rows.iter().collect();
        forward.run(&refs).map_err(|e| format!("documents {next}..{}: {e}", next + rows.len()))?;
        // bf16 bits: the GPU's stored values exactly, the CPU's f32 rounded to nearest.
        let features: Vec<u16> = forward
            .features_to_host()
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|x| half::bf16::from_f64(x).to_bits())
            .collect();
        let mut at = 0;
        for row in &rows {
            let n = row.tokens.len();
            let entry = Entry {
                tokens: &row.tokens,
                loss_mask: &row.loss_mask,
                features: &features[at * width..(at + n) * width],
            };
            writer.push(entry).map_err(|e| e.to_string())?;
            at += n;
        }
        next += rows.len();
        if pause > 0 && writer.index.shards.len() > shards {
            std::thread::sleep(std::time::Duration::from_millis(pause));
        }
        if let Some(bar) = &bar {
            bar.set_position((next - first) as u64);
        } else if writer.index.shards.len() > shards {
            let elapsed = started.elapsed().as_secs_f64();
            let rate = (next - first) as f64 / elapsed.max(1e-9);
            let left = eta(elapsed, next - first, docs - next);
            println!(
                "shard {} complete: {next}/{docs} documents, {rate:.1} documents/s, ETA {left}",
                writer.index.shards.len()
            );
        }
        shards = writer.index.shards.len();
    }
    if let Some(bar) = bar {
        bar.finish();
    }
    Ok(())
}
