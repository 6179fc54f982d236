//! Bad checkpoints give a clear `dflash_reference::Error`, never a panic, whose text names the
//! file at fault and the field or tensor. Each case copies a good fixture into a temporary
//! folder and breaks exactly one thing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use dflash_conformance::fixtures_dir;
use dflash_conformance::setups::randn;
use dflash_reference::drafter::Drafter;
use dflash_reference::target::TargetModel;
use dflash_reference::Error;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rstest::rstest;
use serde_json::{json, Value};
use tempfile::TempDir;

/// A temporary copy of the files of `fixtures/<fixture>` (not its sub-folders).
fn copy_fixture(fixture: &str) -> TempDir {
    let tmp = tempfile::tempdir().expect("temporary folder");
    for entry in std::fs::read_dir(fixtures_dir().join(fixture)).expect("fixture folder") {
        let path = entry.expect("fixture entry").path();
        if path.is_dir() {
            continue;
        }
        std::fs::copy(&path, tmp.path().join(path.file_name().unwrap())).expect("copy fixture");
    }
    tmp
}

/// Loads the model in `dir` the way its fixture is loaded (drafter or target), expecting an
/// error. A panic inside the loader fails the test by itself.
fn load_error(fixture: &str, dir: &Path) -> Error {
    let result = if fixture == "drafter" {
        Drafter::load(dir, DType::F32).map(|_| ())
    } else {
        TargetModel::load(dir, DType::F32).map(|_| ())
    };
    match result {
        Ok(()) => panic!("loading the broken {fixture} in {} succeeded", dir.display()),
        Err(e) => e,
    }
}

/// Asserts that the error's text names `file` and contains every one of `names`.
fn assert_names(err: &Error, file: &Path, names: &[&str]) {
    let text = err.to_string();
    let file = file.display().to_string();
    assert!(text.contains(&file), "`{text}` does not name the file {file}");
    for name in names {
        assert!(text.contains(name), "`{text}` does not name {name}");
    }
}

/// Sets (or with `None` removes) the value at JSON pointer `pointer` in `dir/file`.
fn edit_json(dir: &Path, file: &str, pointer: &str, value: Option<Value>) {
    let path = dir.join(file);
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let (parent, key) = pointer.rsplit_once('/').expect("pointer has a '/'");
    let parent = json
        .pointer_mut(parent)
        .and_then(Value::as_object_mut)
        .unwrap_or_else(|| panic!("{file} has no object at `{parent}`"));
    match value {
        Some(v) => parent.insert(key.to_owned(), v),
        None => parent.remove(key),
    };
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
}

/// Rewrites the safetensors file `dir/file` through `edit`.
fn edit_safetensors(dir: &Path, file: &str, edit: impl FnOnce(&mut HashMap<String, Tensor>)) {
    let path = dir.join(file);
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    edit(&mut tensors);
    candle_core::safetensors::save(&tensors, &path).unwrap();
}

/// One broken `config.json` field gives `Error::Field` naming config.json and the field's full
/// path (`dflash_config.` prefix, list index).
#[rstest]
#[case::missing_hidden_size("target-qwen3", "/hidden_size", None, "hidden_size")]
#[case::missing_vocab_size("drafter", "/vocab_size", None, "vocab_size")]
#[case::layers_as_string("target-qwen3", "/num_hidden_layers", Some(json!("3")), "num_hidden_layers")]
#[case::layers_1e15("target-qwen3", "/num_hidden_layers", Some(json!(1_000_000_000_000_000u64)), "num_hidden_layers")]
#[case::negative_heads("target-llama", "/num_attention_heads", Some(json!(-4)), "num_attention_heads")]
#[case::eps_as_string("target-llama", "/rms_norm_eps", Some(json!("small")), "rms_norm_eps")]
#[case::tie_as_string("target-qwen3", "/tie_word_embeddings", Some(json!("yes")), "tie_word_embeddings")]
#[case::architectures_not_a_list("target-qwen3", "/architectures", Some(json!("Qwen3ForCausalLM")), "architectures")]
#[case::mistral("target-qwen3", "/architectures", Some(json!(["MistralForCausalLM"])), "architectures")]
#[case::drafter_arch("drafter", "/architectures", Some(json!(["Qwen3ForCausalLM"])), "architectures")]
#[case::model_type_mismatch("target-qwen3", "/model_type", Some(json!("llama")), "model_type")]
#[case::attention_bias("target-llama", "/attention_bias", Some(json!(true)), "attention_bias")]
#[case::gelu("target-qwen3", "/hidden_act", Some(json!("gelu")), "hidden_act")]
#[case::kv_heads_not_dividing("target-qwen3", "/num_key_value_heads", Some(json!(3)), "num_key_value_heads")]
#[case::odd_head_dim("target-qwen3", "/head_dim", Some(json!(15)), "head_dim")]
#[case::layer_id_too_big("drafter", "/dflash_config/target_layer_ids", Some(json!([1, 8])), "dflash_config.target_layer_ids[1]")]
#[case::layer_id_not_int("drafter", "/dflash_config/target_layer_ids", Some(json!([1, "5"])), "dflash_config.target_layer_ids[1]")]
#[case::layer_ids_empty("drafter", "/dflash_config/target_layer_ids", Some(json!([])), "dflash_config.target_layer_ids")]
#[case::mask_id_is_vocab("drafter", "/dflash_config/mask_token_id", Some(json!(64)), "dflash_config.mask_token_id")]
#[case::missing_mask_id("drafter", "/dflash_config/mask_token_id", None, "dflash_config.mask_token_id")]
#[case::missing_dflash_config("drafter", "/dflash_config", None, "dflash_config")]
#[case::missing_num_target_layers("drafter", "/num_target_layers", None, "num_target_layers")]
#[case::block_size_one("drafter", "/block_size", Some(json!(1)), "block_size")]
#[case::layer_types_too_long("drafter", "/layer_types", Some(json!(["sliding_attention", "full_attention", "full_attention"])), "layer_types")]
#[case::unknown_layer_type("drafter", "/layer_types", Some(json!(["sliding_attention", "chunked_attention"])), "layer_types[1]")]
#[case::sliding_without_window("drafter", "/sliding_window", None, "sliding_window")]
#[case::sliding_window_zero("drafter", "/sliding_window", Some(json!(0)), "sliding_window")]
#[case::sliding_turned_off("drafter", "/use_sliding_window", Some(json!(false)), "use_sliding_window")]
#[case::rope_longrope("target-qwen3", "/rope_parameters/rope_type", Some(json!("longrope")), "rope_parameters.rope_type")]
#[case::rope_yarn_negative_factor("target-qwen3", "/rope_parameters", Some(json!({"rope_type": "yarn", "rope_theta": 1e4, "factor": -2.0})), "rope_parameters.factor")]
#[case::rope_partial_rotary("target-qwen3", "/rope_parameters/partial_rotary_factor", Some(json!(0.5)), "rope_parameters.partial_rotary_factor")]
#[case::rope_partial_rotary_top("target-qwen3", "/partial_rotary_factor", Some(json!(0.25)), "partial_rotary_factor")]
#[case::rope_scaling_linear_without_factor("target-llama", "/rope_scaling", Some(json!({"type": "linear"})), "rope_scaling.factor")]
#[case::rope_llama3_bands_inverted("target-llama", "/rope_scaling", Some(json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0})), "rope_scaling.high_freq_factor")]
#[case::drafter_rope_scaled("drafter", "/rope_scaling", Some(json!({"rope_type": "linear", "factor": 2.0})), "rope_scaling")]
#[case::rope_scaling_dynamic("drafter", "/rope_scaling", Some(json!({"rope_type": "dynamic", "factor": 2.0})), "rope_scaling.rope_type")]
#[case::rope_factor_without_type("target-llama", "/rope_parameters", Some(json!({"rope_theta": 5e5, "factor": 2.0})), "rope_parameters.rope_type")]
#[case::rope_keys_disagree("target-qwen3", "/rope_scaling", Some(json!({"rope_type": "linear", "factor": 2.0})), "rope_parameters")]
#[case::max_positions_zero("target-qwen3", "/max_position_embeddings", Some(json!(0)), "max_position_embeddings")]
fn bad_config_field_is_named(
    #[case] fixture: &str,
    #[case] pointer: &str,
    #[case] value: Option<Value>,
    #[case] field: &str,
) {
    let tmp = copy_fixture(fixture);
    edit_json(tmp.path(), "config.json", pointer, value);
    let err = load_error(fixture, tmp.path());
    let config = tmp.path().join("config.json");
    assert!(
        matches!(&err, Error::Field { file, field: f, .. } if *file == config && f == field),
        "expected a Field error on `{field}` of {}, got {err:?}",
        config.display()
    );
    assert_names(&err, &config, &[&format!("`{field}`")]);
}

/// A config.json that is not JSON names the file, and the line and column of the fault.
#[rstest]
#[case::drafter("drafter")]
#[case::target("target-qwen3")]
fn invalid_json_names_line_and_column(#[case] fixture: &str) {
    let tmp = copy_fixture(fixture);
    let config = tmp.path().join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines[4] = "  oops,"; // line 5, the stray word starts at column 3
    std::fs::write(&config, lines.join("\n")).unwrap();
    let err = load_error(fixture, tmp.path());
    assert!(
        matches!(&err, Error::Json { file, line: 5, column: 3, .. } if *file == config),
        "expected a JSON error at line 5, column 3 of {}, got {err:?}",
        config.display()
    );
    assert_names(&err, &config, &["line 5", "column 3"]);
}

/// A config.json that is JSON but not an object, or absent, names config.json.
#[rstest]
#[case::a_list(Some("[1, 2, 3]"), "<top level>")]
#[case::absent(None, "")]
fn config_not_an_object_or_absent(#[case] text: Option<&str>, #[case] what: &str) {
    let tmp = copy_fixture("target-qwen3");
    let config = tmp.path().join("config.json");
    match text {
        Some(text) => std::fs::write(&config, text).unwrap(),
        None => std::fs::remove_file(&config).unwrap(),
    }
    let err = load_error("target-qwen3", tmp.path());
    assert_names(&err, &config, &[what]);
}

/// A weight file with one tensor missing, of the wrong shape or of a non-float dtype gives
/// `Error::Tensor` naming the safetensors file and the tensor (and the shapes / dtype).
#[rstest]
#[case::missing("layers.1.mlp.up_proj.weight", None, &["missing"])]
#[case::wrong_shape("fc.weight", Some((vec![32, 32], DType::F32)), &["[32, 32]", "[32, 64]"])]
#[case::transposed("layers.0.mlp.down_proj.weight", Some((vec![48, 32], DType::F32)), &["[48, 32]", "[32, 48]"])]
#[case::dtype_i64("layers.0.self_attn.q_norm.weight", Some((vec![8], DType::I64)), &["I64"])]
#[case::dtype_u8("norm.weight", Some((vec![32], DType::U8)), &["U8"])]
fn bad_drafter_tensor_is_named(
    #[case] tensor: &str,
    #[case] replacement: Option<(Vec<usize>, DType)>,
    #[case] details: &[&str],
) {
    let tmp = copy_fixture("drafter");
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    edit_safetensors(tmp.path(), "model.safetensors", |tensors| {
        tensors.remove(tensor).expect("fixture has the tensor");
        if let Some((shape, dtype)) = replacement {
            let values = randn(&shape, &mut rng, DType::F32).unwrap();
            let values = match dtype {
                DType::F32 => values,
                _ => values.affine(10.0, 20.0).unwrap().to_dtype(dtype).unwrap(),
            };
            tensors.insert(tensor.to_owned(), values);
        }
    });
    let err = load_error("drafter", tmp.path());
    let file = tmp.path().join("model.safetensors");
    assert!(
        matches!(&err, Error::Tensor { file: f, tensor: t, .. } if *f == file && t == tensor),
        "expected a Tensor error on `{tensor}` of {}, got {err:?}",
        file.display()
    );
    assert_names(&err, &file, &[&format!("`{tensor}`")]);
    assert_names(&err, &file, details);
}

/// An untied target without `lm_head.weight` names the tensor and the weight file.
#[test]
fn untied_target_without_lm_head() {
    let tmp = copy_fixture("target-qwen3");
    edit_safetensors(tmp.path(), "model.safetensors", |t| {
        t.remove("lm_head.weight").expect("fixture has lm_head");
    });
    let err = load_error("target-qwen3", tmp.path());
    assert_names(&err, &tmp.path().join("model.safetensors"), &["`lm_head.weight`"]);
}

/// How a weight file is damaged.
#[derive(Clone, Copy, Debug)]
enum Damage {
    /// Cut to half its length.
    Truncate,
    /// The first 64 bytes (header length and header start) replaced by random bytes.
    Garbage,
    /// Replaced by an empty file.
    Empty,
}

fn damage(file: &Path, how: Damage) {
    let mut bytes = std::fs::read(file).unwrap();
    match how {
        Damage::Truncate => bytes.truncate(bytes.len() / 2),
        Damage::Garbage => {
            let mut rng = ChaCha8Rng::seed_from_u64(11);
            rng.fill(&mut bytes[..64]);
        }
        Damage::Empty => bytes.clear(),
    }
    std::fs::write(file, bytes).unwrap();
}

/// A truncated or corrupt safetensors file (a drafter's only file, or one shard of a sharded
/// target) gives an error that names that file.
#[rstest]
fn corrupt_safetensors_names_the_file(
    #[values(Damage::Truncate, Damage::Garbage, Damage::Empty)] how: Damage,
    #[values(
        ("drafter", "model.safetensors"),
        ("target-qwen3", "model.safetensors"),
        ("target-llama", "model-00003-of-00004.safetensors")
    )]
    target: (&str, &str),
) {
    let (fixture, file) = target;
    let tmp = copy_fixture(fixture);
    let path = tmp.path().join(file);
    damage(&path, how);
    let err = load_error(fixture, tmp.path());
    assert!(
        matches!(&err, Error::Tensor { file: f, .. } if *f == path),
        "expected a Tensor error on {}, got {err:?}",
        path.display()
    );
    assert_names(&err, &path, &["safetensors"]);
}

/// A sharded model whose index lists a shard that is not on disk names the missing shard.
#[test]
fn sharded_model_with_missing_shard() {
    let tmp = copy_fixture("target-llama");
    let shard: PathBuf = tmp.path().join("model-00002-of-00004.safetensors");
    std::fs::remove_file(&shard).unwrap();
    let err = load_error("target-llama", tmp.path());
    assert!(
        matches!(&err, Error::Io { file, .. } if *file == shard),
        "expected an Io error on {}, got {err:?}",
        shard.display()
    );
    assert_names(&err, &shard, &[]);
}

/// A broken `model.safetensors.index.json` names the index file and the field: `weight_map`
/// absent or not an object, a shard name that is not a string, or invalid JSON.
#[rstest]
#[case::no_weight_map("/weight_map", None, "weight_map")]
#[case::weight_map_list("/weight_map", Some(json!(["model-00001-of-00004.safetensors"])), "weight_map")]
#[case::shard_not_a_string("/weight_map/model.norm.weight", Some(json!(4)), "weight_map.model.norm.weight")]
fn bad_shard_index_is_named(#[case] pointer: &str, #[case] value: Option<Value>, #[case] field: &str) {
    let tmp = copy_fixture("target-llama");
    edit_json(tmp.path(), "model.safetensors.index.json", pointer, value);
    let err = load_error("target-llama", tmp.path());
    let index = tmp.path().join("model.safetensors.index.json");
    assert!(
        matches!(&err, Error::Field { file, field: f, .. } if *file == index && f == field),
        "expected a Field error on `{field}` of {}, got {err:?}",
        index.display()
    );
    assert_names(&err, &index, &[&format!("`{field}`")]);
}

/// An index that is not JSON names the index file, line and column.
#[test]
fn shard_index_not_json() {
    let tmp = copy_fixture("target-llama");
    let index = tmp.path().join("model.safetensors.index.json");
    std::fs::write(&index, "{\n  \"weight_map\": {\n    \"a\": }\n}\n").unwrap();
    let err = load_error("target-llama", tmp.path());
    assert!(
        matches!(&err, Error::Json { file, line: 3, .. } if *file == index),
        "expected a JSON error at line 3 of {}, got {err:?}",
        index.display()
    );
    assert_names(&err, &index, &["line 3"]);
}

/// A tensor missing from every shard of a sharded model names the tensor and the index that
/// promised it.
#[test]
fn sharded_model_missing_a_tensor() {
    let tmp = copy_fixture("target-llama");
    let index = tmp.path().join("model.safetensors.index.json");
    let map: Value = serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    let name = "model.layers.1.self_attn.k_proj.weight";
    let shard = map["weight_map"][name].as_str().expect("tensor is in the index");
    edit_safetensors(tmp.path(), shard, |t| {
        t.remove(name).expect("shard holds the tensor");
    });
    let err = load_error("target-llama", tmp.path());
    assert!(
        matches!(&err, Error::Tensor { file, tensor, .. } if *file == index && tensor == name),
        "expected a Tensor error on `{name}` of {}, got {err:?}",
        index.display()
    );
    assert_names(&err, &index, &[&format!("`{name}`"), "missing"]);
}

/// A drafter that does not match its target is refused naming the field and both values.
#[rstest]
#[case::hidden("hidden_size")]
#[case::heads("num_attention_heads")]
#[case::kv_heads("num_key_value_heads")]
#[case::head_dim("head_dim")]
#[case::vocab("vocab_size")]
#[case::target_layers("num_target_layers")]
#[case::mask_id("mask_token_id")]
fn a_drafter_of_another_target_is_named(#[case] field: &str) {
    let target = dflash_reference::builtin::tiny_target_config();
    let mut drafter = dflash_reference::builtin::tiny_draft_config(&target);
    assert!(drafter.check_target(&target).is_ok(), "the built-in pair matches");
    let d = &mut drafter.dims;
    match field {
        "hidden_size" => d.hidden_size += 2,
        "num_attention_heads" => d.num_heads *= 2,
        "num_key_value_heads" => d.num_kv_heads = 1,
        "head_dim" => d.head_dim += 2,
        "vocab_size" => d.vocab_size += 1,
        "num_target_layers" => drafter.num_target_layers += 1,
        _ => drafter.mask_token_id = target.dims.vocab_size as u32,
    }
    let err = drafter.check_target(&target).expect_err(field).to_string();
    assert!(err.contains(field), "`{field}` missing from: {err}");
}
