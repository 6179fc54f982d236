//! `cargo xtask features` through the binary, on the CPU twins: a small random Qwen3 target with
//! the fixture tokenizer over the fixture conversations. The cache holds every document with the
//! reference's features; a run killed with SIGKILL and rerun gives the same bytes as one that was
//! not, as does a rerun over a truncated or lost shard; a cache of other provenance is refused by
//! name. The documents export for the transformers writer holds the cache's documents.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use dflash_conformance::cli_args;
use dflash_conformance::target_cases::{copy_target_folder, write_target_folder};
use dflash_conformance::tolerance::{rel_error, GPU_KERNEL_BF16};
use dflash_data::features::FeatureCache;
use dflash_reference::target::Target;

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

fn command(target: &Path, out: &Path, data_cache: &Path, extra: &[&str]) -> Command {
    let data = repo("fixtures/data/conversations.jsonl");
    let base = [
        ["--device", "cpu", "--target", target.to_str().unwrap(), "--data", data.to_str().unwrap()].as_slice(),
        &["--out", out.to_str().unwrap(), "--cache", data_cache.to_str().unwrap()],
        &["--max-len", "512", "--shard-gb", "0.00002", "--layer-ids", "0,1"],
    ]
    .concat();
    let mut c = Command::new(env!("CARGO_BIN_EXE_xtask"));
    c.arg("features").args(cli_args(&base, extra));
    c
}

fn run(mut c: Command) -> Output {
    c.output().expect("run xtask")
}

fn ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "xtask features failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

/// Every file of a cache folder, by name (but its writer's lock, which names the process).
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap() != dflash_data::lock::LOCK_FILE)
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap()))
        .collect();
    v.sort();
    v
}

#[test]
fn the_cache_holds_every_document_with_the_reference_features() {
    let tmp = tempfile::tempdir().unwrap();
    let (target, out, data) = (tmp.path().join("target"), tmp.path().join("cache"), tmp.path().join("data"));
    let model = write_target_folder(&target, 1).unwrap();
    let stdout = ok(&run(command(&target, &out, &data, &[])));
    assert!(stdout.contains("documents,") && stdout.contains("free at"), "size estimate missing:\n{stdout}");
    assert!(stdout.contains("documents/s, ETA "), "progress lines (stdout is not a terminal) missing:\n{stdout}");
    let cache = FeatureCache::open(&out, None).unwrap();
    assert!(cache.index.shards.len() > 2, "several shards expected, got {}", cache.index.shards.len());
    assert_eq!(cache.index.layer_ids, vec![0, 1]);
    let fw = cache.index.feature_width();
    let mut total = 0;
    for i in 0..cache.len() {
        let doc = cache.doc(i).unwrap();
        total += doc.tokens.len();
        if i % 7 != 0 {
            continue;
        }
        let want = model.features(&doc.tokens, &[0, 1]).unwrap();
        let got: Vec<f32> = doc.features.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect();
        let got = Tensor::from_vec(got, (doc.tokens.len(), fw), &candle_core::Device::Cpu).unwrap();
        let err = rel_error(&got, &want);
        assert!(err <= GPU_KERNEL_BF16.rel, "document {i}: features off by {err:.2e}");
    }
    assert_eq!(total as u64, cache.index.tokens);

    // The documents export for the transformers writer, to a bare file name (in the current
    // folder): the header's data key and counts, then each cached document's tokens and mask.
    let mut c = Command::new(env!("CARGO_BIN_EXE_xtask"));
    c.current_dir(tmp.path()).arg("features").args(["--target", target.to_str().unwrap()]);
    c.args(["--data", repo("fixtures/data/conversations.jsonl").to_str().unwrap()]);
    c.args(["--cache", data.to_str().unwrap(), "--max-len", "512", "--export-documents", "docs.jsonl"]);
    ok(&run(c));
    let text = std::fs::read_to_string(tmp.path().join("docs.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[0]["data"].as_str(), Some(cache.index.provenance["data"].as_str()));
    assert_eq!(
        (lines[0]["documents"].as_u64(), lines[0]["tokens"].as_u64()),
        (Some(cache.len() as u64), Some(total as u64))
    );
    assert_eq!(lines.len(), cache.len() + 1);
    for (i, line) in lines[1..].iter().enumerate() {
        let doc = cache.doc(i).unwrap();
        let mask: Vec<bool> = line["loss_mask"].as_array().unwrap().iter().map(|m| m == 1).collect();
        assert_eq!(line["input_ids"], serde_json::json!(doc.tokens), "document {i}");
        assert_eq!(mask, doc.loss_mask, "document {i}");
    }
    // A target `train --features` cannot read (a Mixtral's config): refused before the data is
    // read (a Qwen3 MoE's is read: `train_cli.rs`, an_moe_target_trains_from_a_feature_cache...).
    let other = tmp.path().join("mixtral");
    copy_target_folder(&target, &other, |config| {
        config["architectures"] = serde_json::json!(["MixtralForCausalLM"]);
        config["model_type"] = "mixtral".into();
    });
    let mut c = Command::new(env!("CARGO_BIN_EXE_xtask"));
    c.current_dir(tmp.path()).arg("features").args(["--target", other.to_str().unwrap()]);
    c.args([
        "--data",
        repo("fixtures/data/conversations.jsonl").to_str().unwrap(),
        "--export-documents",
        "other.jsonl",
    ]);
    let refused = run(c);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && stderr.contains("MixtralForCausalLM") && stderr.contains("train --features"),
        "{stderr}"
    );
    assert!(!tmp.path().join("other.jsonl").exists());
}

/// Waits until `out/index.json` lists a shard, then SIGKILLs `child` (the writer pauses after
/// each shard under the test hook, so it is mid-run).
fn kill_after_first_shard(mut child: Child, out: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let listed = std::fs::read_to_string(out.join("index.json")).is_ok_and(|t| t.contains("shard-00000"));
        if listed || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().expect("SIGKILL");
    child.wait().unwrap();
}

#[test]
fn a_killed_run_resumes_to_the_same_cache_and_bad_caches_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let (target, data) = (tmp.path().join("target"), tmp.path().join("data"));
    write_target_folder(&target, 2).unwrap();
    let (whole, resumed) = (tmp.path().join("whole"), tmp.path().join("resumed"));
    ok(&run(command(&target, &whole, &data, &[])));

    let mut c = command(&target, &resumed, &data, &[]);
    c.env("DFLASH_TEST_FEATURES_PAUSE_MS", "300").stdout(Stdio::null()).stderr(Stdio::null());
    kill_after_first_shard(c.spawn().unwrap(), &resumed);
    let stdout = ok(&run(command(&target, &resumed, &data, &[])));
    assert!(stdout.contains("continuing after document"), "the rerun did not continue:\n{stdout}");
    assert_eq!(files(&whole), files(&resumed), "a resumed cache differs from an uninterrupted one");

    // Another layer choice is another provenance: refused, naming it.
    let out = run(command(&target, &resumed, &data, &["--layer-ids", "1"]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("provenance.layer_ids"), "{stderr}");
    // Another shard size: refused, naming both sizes.
    let out = run(command(&target, &resumed, &data, &["--shard-gb", "0.00003"]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("shard_bytes (--shard-gb) 20000 in the cache, 30000 now"),
        "{stderr}"
    );
    // A cache another writer holds (its lock taken here): refused, naming the holder; the
    // user's own `.tmp` files in the folder are never touched.
    std::fs::write(resumed.join("notes.tmp"), "mine").unwrap();
    let lock = std::fs::File::open(resumed.join(dflash_data::lock::LOCK_FILE)).unwrap();
    lock.try_lock().unwrap();
    let out = run(command(&target, &resumed, &data, &[]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("in use by another run"), "{stderr}");
    drop(lock);
    ok(&run(command(&target, &resumed, &data, &[])));
    assert!(resumed.join("notes.tmp").exists(), "a file the writer did not make was removed");
    std::fs::remove_file(resumed.join("notes.tmp")).unwrap();

    // A truncated shard is named by the reader; a rerun writes it (and those after it) again,
    // saying so, to the same bytes. A lost shard file is the same case.
    let shard = resumed.join("shard-00001.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 10]).unwrap();
    let err = FeatureCache::open(&resumed, None).err().expect("a truncated shard must not open").to_string();
    assert!(err.contains("shard-00001.safetensors") && err.contains("truncated"), "{err}");
    let stdout = ok(&run(command(&target, &resumed, &data, &[])));
    assert!(stdout.contains("shard-00001.safetensors") && stdout.contains("writing it again"), "{stdout}");
    assert_eq!(files(&whole), files(&resumed), "a repaired cache differs from an uninterrupted one");
    std::fs::remove_file(resumed.join("shard-00000.safetensors")).unwrap();
    let stdout = ok(&run(command(&target, &resumed, &data, &[])));
    assert!(stdout.contains("shard-00000.safetensors: cannot be read"), "{stdout}");
    assert_eq!(files(&whole), files(&resumed), "a repaired cache differs from an uninterrupted one");

    // An index whose shards are not consecutive documents of files in its folder is named.
    let index_file = whole.join("index.json");
    let index = std::fs::read_to_string(&index_file).unwrap();
    let edits: [(&str, serde_json::Value, &str); 2] = [
        ("first_doc", serde_json::json!(5), "shards[1].first_doc"),
        ("file", serde_json::json!("/etc/passwd"), "shards[1].file"),
    ];
    for (field, value, named) in edits {
        let mut bad: serde_json::Value = serde_json::from_str(&index).unwrap();
        bad["shards"][1][field] = value;
        std::fs::write(&index_file, bad.to_string()).unwrap();
        let err = FeatureCache::open(&whole, None).err().expect("a bad index must not open").to_string();
        assert!(err.contains("index.json") && err.contains(named), "{err}");
    }
    std::fs::write(&index_file, &index).unwrap();

    // A header whose byte range of a tensor is not its shape's size (a valid safetensors file
    // otherwise, of the listed size) is named, not read past or misread.
    let shard = whole.join("shard-00000.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let end = header["doc_offsets"]["data_offsets"][1].as_u64().unwrap();
    header["doc_offsets"]["data_offsets"][1] = (end - 3).into();
    let mut text = serde_json::to_vec(&header).unwrap();
    text.resize(n, b' ');
    bytes[8..8 + n].copy_from_slice(&text);
    std::fs::write(&shard, &bytes).unwrap();
    let err = FeatureCache::open(&whole, None).err().expect("a misdescribed tensor must not open").to_string();
    assert!(
        err.contains("shard-00000.safetensors") && err.contains("tensor `doc_offsets`: data offsets span"),
        "{err}"
    );

    // --out naming a file is refused before any work.
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let out = run(command(&target, &file, &data, &[]));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a folder"));
}

#[test]
fn bad_options_are_refused_before_any_work() {
    let tmp = tempfile::tempdir().unwrap();
    let (target, out, data) = (tmp.path().join("target"), tmp.path().join("cache"), tmp.path().join("data"));
    write_target_folder(&target, 3).unwrap();
    let cases: [(&[&str], &str); 8] = [
        (&["--layer-ids", "9"], "layer 9 is out of range for the target's 3 layers"),
        (&["--max-len", "100000"], "option `--max-len`: rows of 100000 tokens exceed the target's 4096 positions"),
        (&["--layer-ids", "1,x"], "`x` is not a layer number"),
        (&["--shard-gb", "0"], "option `--shard-gb`"),
        (&["--shard-gb", "1000"], "at most 64 GB"),
        (&["--device", "tpu"], "option `--device`: `tpu`"),
        (&["--launch-tokens", "100"], "below --max-len 512"),
        (&["--bogus", "1"], "unknown option `--bogus`"),
    ];
    for (extra, needle) in cases {
        let out_run = run(command(&target, &out, &data, extra));
        let stderr = String::from_utf8_lossy(&out_run.stderr);
        assert!(!out_run.status.success() && stderr.contains(needle), "{extra:?}: `{needle}` missing from: {stderr}");
        assert!(!out.exists() && !data.exists(), "{extra:?}: work was done before the error");
    }
    // A forward that does not fit the device's free memory (the CPU's, 10 kB by the test hook):
    // refused naming `--launch-tokens`, before the data is read.
    let mut small = command(&target, &out, &data, &[]);
    small.env(dflash_optimized::backend::host::HOST_AVAILABLE_ENV, "10000");
    let refused = run(small);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("--launch-tokens") && stderr.contains("free"), "{stderr}");
    assert!(!out.exists() && !data.exists(), "work was done before the error");
    // The GPU (the default device) is checked before the data is read: without one (CI), the
    // run is refused naming `--device` and nothing is written; with one, this target's heads of
    // 8 are refused by the GPU kernels.
    let mut c = Command::new(env!("CARGO_BIN_EXE_xtask"));
    c.arg("features").args(["--target", target.to_str().unwrap()]);
    c.args(["--data", repo("fixtures/data/conversations.jsonl").to_str().unwrap()]);
    c.args(["--out", out.to_str().unwrap(), "--cache", data.to_str().unwrap(), "--max-len", "512"]);
    let gpu = run(c);
    let stderr = String::from_utf8_lossy(&gpu.stderr);
    assert!(!gpu.status.success(), "heads of 8 on the GPU");
    match stderr.contains("no CUDA GPU here") {
        true => assert!(stderr.contains("option `--device`") && !out.exists() && !data.exists(), "{stderr}"),
        false => assert!(stderr.contains("head_dim"), "{stderr}"),
    }
    let mut c = Command::new(env!("CARGO_BIN_EXE_xtask"));
    c.args(["features", "--target", target.to_str().unwrap(), "--data", "x.jsonl"]);
    let stderr = String::from_utf8_lossy(&run(c).stderr).into_owned();
    assert!(stderr.contains("--out CACHE is required"), "{stderr}");
    // A checkpoint without one of its weights: named before the data is read or a cache begun.
    let damaged = tmp.path().join("damaged");
    write_target_folder(&damaged, 3).unwrap();
    let weights = damaged.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &candle_core::Device::Cpu).unwrap();
    let name = "model.layers.1.mlp.up_proj.weight";
    tensors.remove(name).unwrap();
    candle_core::safetensors::save(&tensors, &weights).unwrap();
    let refused = run(command(&damaged, &out, &data, &[]));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains(name), "{stderr}");
    assert!(!out.exists() && !data.exists(), "work was done before the error");
    // A target with a non-finite weight: its features are refused, not cached.
    let broken = tmp.path().join("broken");
    write_target_folder(&broken, 3).unwrap();
    let weights = broken.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&weights, &candle_core::Device::Cpu).unwrap();
    let w = &tensors["model.layers.0.mlp.up_proj.weight"];
    let (dims, dtype) = (w.dims().to_vec(), w.dtype());
    let mut values = w.flatten_all().unwrap().to_dtype(candle_core::DType::F32).unwrap().to_vec1::<f32>().unwrap();
    values[0] = f32::NAN;
    let w = Tensor::from_vec(values, dims, &candle_core::Device::Cpu).unwrap().to_dtype(dtype).unwrap();
    tensors.insert("model.layers.0.mlp.up_proj.weight".into(), w);
    candle_core::safetensors::save(&tensors, &weights).unwrap();
    let nan_out = tmp.path().join("nan-cache");
    let refused = run(command(&broken, &nan_out, &data, &[]));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("NaN or Inf"), "{stderr}");

    // A cache begun with no shard (its run failed at once) is begun again by another run.
    std::fs::create_dir_all(&out).unwrap();
    let begun = serde_json::json!({"format": dflash_data::features::FORMAT, "provenance": {"target_weights": "other"},
        "hidden_size": 1, "layer_ids": [0], "shard_bytes": 1, "documents": 1, "tokens": 1, "shards": []});
    std::fs::write(out.join("index.json"), begun.to_string()).unwrap();
    let again = run(command(&target, &out, &data, &[]));
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
}
