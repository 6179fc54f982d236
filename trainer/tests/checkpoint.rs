//! Checkpoints and resumption in process: the loop equals the reference loop, a resumed run's
//! losses are bitwise those of an uninterrupted one (both engines), incomplete or corrupt
//! checkpoints are never loaded, the servable folder is spec section 8's, old ones are pruned.

mod common;

use candle_core::DType;
use common::{engine, fresh_seed, inputs, losses, run_to_end, setup, tiny_config};
use dflash_reference::drafter::{param_shapes, Drafter};
use dflash_reference::optim::AdamWConfig;
use dflash_reference::train::{train_with, Autograd, TrainOptions};
use dflash_trainer::checkpoint::{self, find_resumable, RngState};
use dflash_trainer::config::StepKind;
use dflash_trainer::engine::StepEngine;
use dflash_trainer::rows::RowSource;
use dflash_trainer::run::Trainer;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// With one micro-batch per step, the trainer's loop is the reference loop: same rows, anchors,
/// clipping and updates, bitwise the same losses.
#[test]
fn the_loop_is_the_reference_loop() {
    let dir = tempfile::tempdir().unwrap();
    let seed = fresh_seed();
    let c = tiny_config(dir.path(), seed, 9);
    let s = setup(&c);
    let ours = run_to_end(&c, &s, StepKind::Reference);
    let drafter = dflash_trainer::builtin::init_drafter(&c, &s.draft_config).unwrap();
    let opts = TrainOptions {
        steps: 9,
        rows_per_step: c.rows_per_step,
        max_anchors: c.anchors,
        optimizer: AdamWConfig { lr: c.lr, ..AdamWConfig::default() },
        warmup_frac: c.warmup_frac,
        clip_norm: c.clip_norm,
        gamma: c.gamma.unwrap(),
        seed,
    };
    let reference = train_with(&drafter, &s.target.frozen_head(), &s.data, &opts, &mut Autograd, |_| {}).unwrap();
    let reference: Vec<(u64, u64)> = reference.iter().map(|r| (r.step as u64, r.loss.to_bits())).collect();
    assert_eq!(ours, reference, "seed {seed}");
}

/// A run stopped after a checkpoint and resumed in a new trainer and engine gives bitwise the
/// losses of the uninterrupted run, and its metrics.jsonl has each step once.
#[test]
fn resume_is_exact_for_both_engines() {
    for kind in [StepKind::Reference, StepKind::Host] {
        let seed = fresh_seed();
        let steps = 10;
        let whole_dir = tempfile::tempdir().unwrap();
        let c = tiny_config(whole_dir.path(), seed, steps);
        let s = setup(&c);
        let whole = run_to_end(&c, &s, kind);
        assert_eq!(whole.len(), steps);

        let split_dir = tempfile::tempdir().unwrap();
        let stop = rand::rng().random_range(1..steps - 1);
        let mut c2 = tiny_config(split_dir.path(), seed, steps);
        c2.checkpoint_every = stop;
        {
            // The first process: stopped ("killed") a step or two after its first checkpoint,
            // leaving metrics lines past it, and a line cut short.
            let mut e = engine(&c2, &s, kind);
            let mut t = Trainer::new(inputs(&c2, &s)).unwrap();
            let extra = rand::rng().random_range(0..=(steps - stop - 1).min(stop - 1).min(2));
            t.run_steps(&mut e, stop + extra).unwrap();
            let metrics = dflash_trainer::metrics::metrics_file(split_dir.path());
            let mut text = std::fs::read_to_string(&metrics).unwrap();
            assert_eq!(text.lines().count(), stop + extra);
            text.push_str("{\"kind\":\"tr");
            std::fs::write(&metrics, text).unwrap();
        }
        let found = find_resumable(split_dir.path()).unwrap();
        assert_eq!(found.state.step, stop);
        let mut e = engine(&c2, &s, kind);
        let mut t = Trainer::new(inputs(&c2, &s)).unwrap();
        t.resume(&mut e, &found).unwrap();
        t.run(&mut e).unwrap();
        assert_eq!(losses(split_dir.path()), whole, "{kind:?}, seed {seed}, stopped after {stop} steps");
    }
}

/// A checkpoint keeps the run's process count (the launch's, which `run.toml` leaves out);
/// resumed on another count, the resumption says so and that the losses then agree within f32
/// rounding only.
#[test]
fn a_resumption_on_another_process_count_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = tiny_config(dir.path(), fresh_seed(), 4);
    c.checkpoint_every = 2;
    c.world_size = Some(2);
    let s = setup(&c);
    {
        let mut e = engine(&c, &s, StepKind::Host);
        Trainer::new(inputs(&c, &s)).unwrap().run_steps(&mut e, 2).unwrap();
    }
    let found = find_resumable(dir.path()).unwrap();
    assert_eq!(found.state.processes, Some(2));
    for (world_size, noted) in [(Some(2), false), (None, true)] {
        c.world_size = world_size;
        let mut e = engine(&c, &s, StepKind::Host);
        let notes = Trainer::new(inputs(&c, &s)).unwrap().resume(&mut e, &found).unwrap();
        let said = notes.iter().any(|n| n.contains("`world_size` changed from 2 to 1") && n.contains("f32 rounding"));
        assert_eq!(said, noted, "{world_size:?}: {notes:?}");
    }
}

/// A checkpoint of format 1 (the training state beside the servable files) resumes as one of
/// the current format: bitwise the same next losses.
#[test]
fn a_format_1_checkpoint_resumes() {
    let seed = fresh_seed();
    let dir = tempfile::tempdir().unwrap();
    let mut c = tiny_config(dir.path(), seed, 6);
    c.checkpoint_every = 3;
    let s = setup(&c);
    let whole = run_to_end(&c, &s, StepKind::Reference);
    let old = dir.path().join("checkpoint-3");
    let (now, then) = (checkpoint::training_file(checkpoint::FORMAT), checkpoint::training_file(1));
    std::fs::rename(old.join(now), old.join(then)).unwrap();
    std::fs::remove_dir(old.join(now).parent().unwrap()).unwrap();
    let state_file = old.join("state.json");
    let mut state: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&state_file).unwrap()).unwrap();
    state["format"] = 1.into();
    let hash = state["files"].as_object_mut().unwrap().remove(now).unwrap();
    state["files"][then] = hash;
    std::fs::write(&state_file, state.to_string()).unwrap();
    std::fs::remove_dir_all(dir.path().join("checkpoint-6")).unwrap();
    std::fs::write(dir.path().join("latest"), "checkpoint-3\n").unwrap();

    let found = find_resumable(dir.path()).unwrap();
    assert_eq!((found.state.step, found.state.format), (3, 1), "{:?}", found.notes);
    let mut e = engine(&c, &s, StepKind::Reference);
    let mut t = Trainer::new(inputs(&c, &s)).unwrap();
    t.resume(&mut e, &found).unwrap();
    t.run(&mut e).unwrap();
    assert_eq!(losses(dir.path()), whole, "seed {seed}");
    checkpoint::verify(&dir.path().join("checkpoint-6")).expect("written in the current format");
}

/// The RNG state restores the generator exactly, at any position in its stream.
#[test]
fn rng_state_roundtrips() {
    let mut rng = ChaCha8Rng::seed_from_u64(fresh_seed());
    rng.set_stream(rand::rng().random());
    for _ in 0..rand::rng().random_range(0..1000) {
        rng.next_u32();
    }
    let mut restored = RngState::of(&rng).restore().unwrap();
    let (a, b): (Vec<u64>, Vec<u64>) =
        ((0..50).map(|_| rng.next_u64()).collect(), (0..50).map(|_| restored.next_u64()).collect());
    assert_eq!(a, b);
}

/// A leftover `.tmp`, a folder without its marker and a folder with a corrupted file are never
/// loaded: resumption falls back to the newest complete checkpoint and says why.
#[test]
fn incomplete_checkpoints_are_never_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = tiny_config(dir.path(), fresh_seed(), 6);
    (c.checkpoint_every, c.keep_checkpoints) = (2, 5);
    let s = setup(&c);
    run_to_end(&c, &s, StepKind::Reference);
    let out = dir.path();
    for step in [2, 4, 6] {
        checkpoint::verify(&out.join(format!("checkpoint-{step}"))).expect("complete");
    }
    assert_eq!(find_resumable(out).unwrap().state.step, 6);
    assert!(find_resumable(out).unwrap().notes.is_empty());
    // Killed after a checkpoint's rename, before `latest` named it: the newer complete one.
    std::fs::write(out.join("latest"), "checkpoint-4\n").unwrap();
    let found = find_resumable(out).unwrap();
    assert_eq!(found.state.step, 6, "{:?}", found.notes);
    assert!(found.notes.join("\n").contains("newer than checkpoint-4"), "{:?}", found.notes);
    std::fs::write(out.join("latest"), "checkpoint-6\n").unwrap();

    // A complete-looking copy under a temporary name (a checkpoint whose rename never happened).
    copy_dir(&out.join("checkpoint-6"), &out.join(".checkpoint-8.tmp"));
    // The newest: one byte of its optimizer state flipped.
    let training = out.join("checkpoint-6").join(checkpoint::training_file(checkpoint::FORMAT));
    let mut bytes = std::fs::read(&training).unwrap();
    let at = rand::rng().random_range(bytes.len() / 2..bytes.len());
    bytes[at] ^= 0x40;
    std::fs::write(&training, bytes).unwrap();
    let found = find_resumable(out).unwrap();
    assert_eq!(found.state.step, 4, "{:?}", found.notes);
    let notes = found.notes.join("\n");
    assert!(notes.contains("corrupt") && notes.contains("falling back"), "{notes}");

    // The next: no completion marker (killed before state.json).
    std::fs::remove_file(out.join("checkpoint-4/state.json")).unwrap();
    let found = find_resumable(out).unwrap();
    assert_eq!(found.state.step, 2, "{:?}", found.notes);
    assert!(found.notes.join("\n").contains("no state.json"));

    // `latest` naming a folder that is gone, or missing: the newest complete one still.
    std::fs::write(out.join("latest"), "checkpoint-10\n").unwrap();
    let found = find_resumable(out).unwrap();
    assert_eq!(found.state.step, 2);
    assert!(found.notes.join("\n").contains("checkpoint-10: no such folder"), "{:?}", found.notes);
    std::fs::remove_file(out.join("latest")).unwrap();
    assert_eq!(find_resumable(out).unwrap().state.step, 2);
    // A folder in `latest`'s place (the next checkpoint could not replace it): refused at once.
    std::fs::create_dir(out.join("latest")).unwrap();
    let message = find_resumable(out).err().expect("a folder as latest").to_string();
    assert!(message.contains("`latest` is a folder"), "{message}");
    std::fs::remove_dir(out.join("latest")).unwrap();
    // A step count AdamW cannot have reached is not a complete state.
    let state_file = out.join("checkpoint-2/state.json");
    let state = std::fs::read_to_string(&state_file).unwrap();
    let mut bad: serde_json::Value = serde_json::from_str(&state).unwrap();
    bad["adam_t"] = serde_json::json!(-5);
    std::fs::write(&state_file, bad.to_string()).unwrap();
    let message = find_resumable(out).err().expect("adam_t -5").to_string();
    assert!(message.contains("adam_t -5"), "{message}");
    std::fs::write(&state_file, state).unwrap();

    // Resuming from it removes the leftover temporary folder. Its next checkpoint removes the
    // folders of later steps (not usable when it resumed: not of its past).
    let mut e = engine(&c, &s, StepKind::Reference);
    let mut t = Trainer::new(inputs(&c, &s)).unwrap();
    let notes = t.resume(&mut e, &find_resumable(out).unwrap()).unwrap();
    assert!(!out.join(".checkpoint-8.tmp").exists(), "{notes:?}");
    let kept = tempfile::tempdir().unwrap();
    for step in [2, 4, 6] {
        copy_dir(&out.join(format!("checkpoint-{step}")), &kept.path().join(format!("checkpoint-{step}")));
    }
    std::fs::write(kept.path().join("latest"), "checkpoint-2\n").unwrap();
    let mut c_kept = c.clone();
    c_kept.out = kept.path().to_path_buf();
    let mut e = engine(&c_kept, &s, StepKind::Reference);
    let mut t = Trainer::new(inputs(&c_kept, &s)).unwrap();
    t.resume(&mut e, &find_resumable(kept.path()).unwrap()).unwrap();
    t.run_steps(&mut e, 2).unwrap();
    let mut left: Vec<usize> = checkpoint::list_checkpoints(kept.path()).unwrap().into_iter().map(|c| c.0).collect();
    left.sort();
    assert_eq!(left, [2, 4], "the corrupt checkpoint-6 of an abandoned future is gone");
    checkpoint::verify(&kept.path().join("checkpoint-4")).expect("written again");

    // Nothing complete left: an error, never a half-written checkpoint.
    std::fs::remove_file(out.join("checkpoint-2/run.toml")).unwrap();
    let message = find_resumable(out).err().expect("nothing to resume").to_string();
    assert!(message.contains("no complete checkpoint"), "{message}");
}

/// A checkpoint whose data order is not an order of the run's rows (a row twice, or one past
/// the last), or whose epoch or cursor is not where its steps leave the order, is refused naming
/// the checkpoint and state.json, before any step; an untouched one resumes.
#[test]
fn a_checkpoint_with_a_bad_data_order_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = tiny_config(dir.path(), fresh_seed(), 3);
    c.checkpoint_every = 2;
    let s = setup(&c);
    run_to_end(&c, &s, StepKind::Reference);
    type Tamper = fn(&mut checkpoint::TrainState);
    let tampers: [(Tamper, &str); 5] = [
        (|t| t.order[1] = t.order[0], "order"),
        (|t| t.order[0] = t.order.len(), "order"),
        (|t| t.epoch += 1, "is not where 3 steps of 2 rows end (epoch 2, row 2)"),
        (|t| t.epoch = usize::MAX, "epoch 18446744073709551615"),
        (|t| t.cursor -= 1, "at row 1 of its order"),
    ];
    for (i, (tamper, says)) in tampers.into_iter().enumerate() {
        let mut found = find_resumable(dir.path()).unwrap();
        assert_eq!((found.state.step, found.state.epoch, found.state.cursor), (3, 2, 2), "4 rows, 2 per step");
        tamper(&mut found.state);
        let mut e = engine(&c, &s, StepKind::Reference);
        let err = Trainer::new(inputs(&c, &s)).unwrap().resume(&mut e, &found).expect_err("refused").to_string();
        assert!(err.contains("checkpoint-3") && err.contains("state.json") && err.contains(says), "case {i}: {err}");
    }
    let mut e = engine(&c, &s, StepKind::Reference);
    Trainer::new(inputs(&c, &s)).unwrap().resume(&mut e, &find_resumable(dir.path()).unwrap()).expect("resumes");
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        match entry.path().is_dir() {
            true => copy_dir(&entry.path(), &to.join(entry.file_name())),
            false => _ = std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap(),
        }
    }
}

/// A checkpoint's servable folder loads with `Drafter::load`, holds the trained weights (bf16)
/// under spec section 8's keys and config fields; only the newest `keep_checkpoints` remain.
#[test]
fn checkpoint_holds_the_servable_drafter() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = tiny_config(dir.path(), fresh_seed(), 5);
    (c.checkpoint_every, c.keep_checkpoints) = (1, 2);
    let s = setup(&c);
    let mut e = engine(&c, &s, StepKind::Reference);
    Trainer::new(inputs(&c, &s)).unwrap().run(&mut e).unwrap();
    let mut left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("checkpoint"))
        .collect();
    left.sort();
    assert_eq!(left, ["checkpoint-4", "checkpoint-5"]);
    assert_eq!(std::fs::read_to_string(dir.path().join("latest")).unwrap().trim(), "checkpoint-5");

    let folder = dir.path().join("checkpoint-5");
    let loaded = Drafter::load(&folder, DType::F32).expect("servable folder loads");
    let trained = e.drafter().unwrap();
    for (name, p) in trained.named_params() {
        let want = p.as_tensor().to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
        let diff = (loaded.param(name) - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(diff, 0.0, "{name}: the saved weights are the trained ones in bf16");
    }
    // The weights are as readable as the config (a server may run as another user).
    let mode =
        |f: &str| std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(folder.join(f)).unwrap().permissions());
    assert_eq!(mode("model.safetensors"), mode("config.json"), "model.safetensors' permissions");
    let training = checkpoint::training_file(checkpoint::FORMAT);
    assert_eq!(mode(training), mode("config.json"), "{training}'s permissions");
    // vLLM and MLX load every `*.safetensors` beside `config.json`: the model's only.
    let beside: Vec<String> = std::fs::read_dir(&folder)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    assert_eq!(beside, ["model.safetensors"]);
    // transformers before 4.48.2 loads only a file whose header metadata says `"format": "pt"`.
    let bytes = std::fs::read(folder.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    assert_eq!(header["__metadata__"], serde_json::json!({"format": "pt"}), "model.safetensors' metadata");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(folder.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"], serde_json::json!(["DFlashDraftModel"]));
    assert_eq!(config["model_type"], "qwen3");
    assert_eq!(config["block_size"], 8);
    assert_eq!(config["num_target_layers"], 8);
    assert_eq!(config["dflash_config"]["mask_token_id"], 127);
    assert_eq!(config["dflash_config"]["target_layer_ids"], serde_json::json!([1, 3, 5]));
    assert_eq!(config["layer_types"], serde_json::json!(["sliding_attention", "full_attention"]));
    assert_eq!(config["sliding_window"], 32);
    // transformers keeps the window only with `use_sliding_window`; engines run the drafter in
    // the weights' dtype.
    assert_eq!(config["use_sliding_window"], true);
    assert_eq!(config["max_window_layers"], 2);
    assert_eq!(
        (&config["dtype"], &config["torch_dtype"]),
        (&serde_json::json!("bfloat16"), &serde_json::json!("bfloat16"))
    );
    for key in [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "rms_norm_eps",
        "rope_theta",
    ] {
        assert!(config.get(key).is_some(), "config.json lacks `{key}`");
    }
    let tensors = candle_core::safetensors::load(folder.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut expected: Vec<String> = param_shapes(&s.draft_config).into_iter().map(|(n, _)| n).collect();
    expected.sort();
    assert_eq!(names, expected.iter().collect::<Vec<_>>());
    assert!(names.iter().all(|n| !n.starts_with("model.") && !n.contains("embed_tokens") && !n.contains("lm_head")));
    assert!(tensors.values().all(|t| t.dtype() == DType::BF16), "bf16 as spec section 8 says");
    for n in [
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.1.self_attn.q_norm.weight",
        "layers.0.mlp.gate_proj.weight",
    ] {
        assert!(tensors.contains_key(n), "{n}");
    }
}

/// Gradient accumulation: two micro-batches of one row are one batch of two rows (the same
/// weighted loss and update, up to f32 rounding).
#[test]
fn accumulated_micro_batches_equal_one_batch() {
    let seed = fresh_seed();
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let one = tiny_config(d1.path(), seed, 4);
    let mut two = tiny_config(d2.path(), seed, 4);
    (two.rows_per_step, two.grad_accum) = (1, 2);
    let s = setup(&one);
    let (a, b) = (run_to_end(&one, &s, StepKind::Reference), run_to_end(&two, &s, StepKind::Reference));
    for ((sa, la), (sb, lb)) in a.iter().zip(&b) {
        let (la, lb) = (f64::from_bits(*la), f64::from_bits(*lb));
        assert_eq!(sa, sb);
        assert!((la - lb).abs() <= 1e-5 * la.abs(), "seed {seed}, step {sa}: {la} vs {lb}");
    }
}

/// A checkpoint of other training rows (here: sampled with another seed) is refused on resume,
/// naming the data's hashes.
#[test]
fn resume_refuses_other_data() {
    let dir = tempfile::tempdir().unwrap();
    let seed = fresh_seed();
    let mut c = tiny_config(dir.path(), seed, 2);
    c.checkpoint_every = 1;
    let s = setup(&c);
    run_to_end(&c, &s, StepKind::Reference);
    let other = setup(&tiny_config(dir.path(), seed + 1, 2));
    let mut e = engine(&c, &other, StepKind::Reference);
    let mut t = Trainer::new(inputs(&c, &other)).unwrap();
    let message = t.resume(&mut e, &find_resumable(dir.path()).unwrap()).expect_err("refused").to_string();
    assert!(message.contains("training rows (sha256"), "{message}");
}

/// Counts the rows read (their ids and threads); row `fails` (if any) is an error or a panic.
struct Counted<'a> {
    rows: &'a dyn RowSource,
    reads: std::sync::Mutex<Vec<(usize, std::thread::ThreadId)>>,
    fails: Option<(usize, bool)>,
}

impl RowSource for Counted<'_> {
    fn len(&self) -> usize {
        self.rows.len()
    }
    fn row(&self, i: usize) -> dflash_trainer::Result<dflash_reference::data::TrainRow> {
        self.reads.lock().unwrap().push((i, std::thread::current().id()));
        match self.fails {
            Some((bad, true)) if bad == i => panic!("row {i} unreadable"),
            Some((bad, false)) if bad == i => Err(dflash_trainer::Error::option("data", format!("row {i} unreadable"))),
            _ => self.rows.row(i),
        }
    }
    fn sha256(&self) -> dflash_trainer::Result<String> {
        self.rows.sha256()
    }
}

/// Reading the next step's rows ahead (on another thread, while a step runs) gives bitwise the
/// losses and weights of reading them in step, epoch ends mid-step included (7 rows, 2 x 2 per
/// step: the generator shuffles there, so those steps read in step); each row is read once.
#[test]
fn rows_read_ahead_train_as_rows_read_in_step() {
    let dir = tempfile::tempdir().unwrap();
    let seed = fresh_seed();
    let steps = 9;
    let mut c = tiny_config(dir.path(), seed, steps);
    (c.rows, c.grad_accum) = (7, 2);
    let s = setup(&c);
    let mut outcomes = Vec::new();
    for read_ahead in [false, true] {
        let out = dir.path().join(format!("ahead-{read_ahead}"));
        std::fs::create_dir_all(&out).unwrap();
        let c = dflash_trainer::config::RunConfig { out: out.clone(), ..c.clone() };
        let counted = Counted { rows: &s.data, reads: Default::default(), fails: None };
        let mut e = engine(&c, &s, StepKind::Reference);
        let inputs = dflash_trainer::run::RunInputs { data: &counted, read_ahead, ..inputs(&c, &s) };
        Trainer::new(inputs).unwrap().run(&mut e).unwrap();
        let reads = counted.reads.into_inner().unwrap();
        assert_eq!(reads.len(), steps * 4, "seed {seed}, read ahead {read_ahead}: each row read once");
        let elsewhere = reads.iter().filter(|&&(_, t)| t != std::thread::current().id()).count();
        assert_eq!(elsewhere > 0, read_ahead, "seed {seed}: rows read on another thread: {elsewhere}");
        let weights: Vec<Vec<u32>> = e
            .drafter()
            .unwrap()
            .named_params()
            .iter()
            .map(|(_, p)| {
                p.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
            })
            .collect();
        outcomes.push((losses(&out), weights));
    }
    assert_eq!(outcomes[0].0.len(), steps, "seed {seed}");
    assert!(outcomes[0] == outcomes[1], "seed {seed}: reading ahead changed the run");
}

/// A row that cannot be read ahead (an error, or a panic on the reading thread) stops the run
/// with its error at the step that needs it, after the checkpoints of the steps before.
#[test]
fn a_row_read_ahead_that_fails_stops_the_run_at_its_step() {
    let dir = tempfile::tempdir().unwrap();
    let seed = fresh_seed();
    let mut c = tiny_config(dir.path(), seed, 9);
    (c.rows, c.grad_accum, c.checkpoint_every) = (12, 2, 1);
    let s = setup(&c);
    // Which rows each step reads, and which of them are first read ahead (on another thread:
    // steps 1 and 2 of the first epoch's 3).
    let out = dir.path().join("whole");
    std::fs::create_dir_all(&out).unwrap();
    let whole = dflash_trainer::config::RunConfig { out: out.clone(), ..c.clone() };
    let counted = Counted { rows: &s.data, reads: Default::default(), fails: None };
    let mut e = engine(&whole, &s, StepKind::Reference);
    Trainer::new(dflash_trainer::run::RunInputs { data: &counted, read_ahead: true, ..inputs(&whole, &s) })
        .unwrap()
        .run(&mut e)
        .unwrap();
    let reads = counted.reads.into_inner().unwrap();
    let first = |id: usize| reads.iter().position(|&(i, _)| i == id).expect("every row read");
    let ahead: Vec<usize> = (0..c.rows).filter(|&id| reads[first(id)].1 != std::thread::current().id()).collect();
    assert_eq!(ahead.len(), 8, "seed {seed}");
    let bad = ahead[rand::rng().random_range(0..ahead.len())];
    let failing_step = first(bad) / 4;
    for panics in [false, true] {
        let out = dir.path().join(format!("fails-{panics}"));
        std::fs::create_dir_all(&out).unwrap();
        let c = dflash_trainer::config::RunConfig { out: out.clone(), ..c.clone() };
        let failing = Counted { rows: &s.data, reads: Default::default(), fails: Some((bad, panics)) };
        let mut e = engine(&c, &s, StepKind::Reference);
        let err = Trainer::new(dflash_trainer::run::RunInputs { data: &failing, read_ahead: true, ..inputs(&c, &s) })
            .unwrap()
            .run(&mut e)
            .expect_err("the row fails")
            .to_string();
        assert!(err.contains(&format!("row {bad} unreadable")), "seed {seed}, panics {panics}: {err}");
        assert_eq!(panics, err.contains("panicked"), "seed {seed}: {err}");
        assert_eq!(losses(&out).len(), failing_step, "seed {seed}, panics {panics}: the steps before it ran");
        assert_eq!(find_resumable(&out).unwrap().state.step, failing_step, "seed {seed}: and were checkpointed");
    }
}
