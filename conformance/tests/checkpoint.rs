//! Checkpoints and configs: save -> load round trips are exact, saves are atomic (no temporary
//! files left behind), and the spec's default target layer ids.

use std::collections::BTreeSet;
use std::path::Path;

use candle_core::{DType, Tensor};
use dflash_conformance::fixtures_dir;
use dflash_conformance::setups::{random_draft_case, random_target_config};
use dflash_reference::config::{
    check_feature_layers, default_target_layer_ids, training_target_layer_ids, AttnKind, DraftConfig, TargetConfig,
};
use dflash_reference::drafter::Drafter;
use dflash_reference::target::TargetModel;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rstest::rstest;

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// The bit patterns of an f32 tensor's values.
fn bits(t: &Tensor) -> candle_core::Result<Vec<u32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
}

/// The names in `dir`.
fn listing(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .expect("read folder")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect()
}

/// A drafter to save: the fixture's, or `random_draft_case(seed)`'s.
fn drafter_to_save(seed: Option<u64>) -> dflash_reference::Result<Drafter> {
    let Some(seed) = seed else {
        return Drafter::load(&fixtures_dir().join("drafter"), DType::F32);
    };
    Ok(random_draft_case(seed, DType::F32)?.drafter)
}

/// Drafter save -> load gives the same config and bit-identical f32 parameters, and the save
/// leaves exactly `config.json` and `model.safetensors` (no temporary files), also when it
/// overwrites an earlier save.
#[rstest]
#[case::fixture(None)]
#[case::random_1(Some(1))]
#[case::random_2(Some(2))]
#[case::random_3(Some(3))]
fn drafter_save_load_round_trip(#[case] seed: Option<u64>) -> TestResult {
    let drafter = drafter_to_save(seed)?;
    let tmp = tempfile::tempdir()?;
    drafter.save(tmp.path())?;
    drafter.save(tmp.path())?; // overwrite in place
    let files: BTreeSet<String> = ["config.json", "model.safetensors"].map(String::from).into();
    assert_eq!(listing(tmp.path()), files, "files left by Drafter::save");

    let back = Drafter::load(tmp.path(), DType::F32)?;
    assert_eq!(back.config, drafter.config);
    assert_eq!(back.named_params().len(), drafter.named_params().len());
    for ((name, var), (back_name, back_var)) in drafter.named_params().iter().zip(back.named_params()) {
        assert_eq!(name, back_name, "parameter order");
        assert_eq!(
            bits(var.as_tensor())?,
            bits(back_var.as_tensor())?,
            "{name} is not bit-identical after save -> load"
        );
    }
    Ok(())
}

/// A target saved with `TargetModel::save` and loaded back has the same config and gives
/// bit-identical logits and layer outputs on random tokens; the save leaves no temporary files.
#[rstest]
#[case::qwen3("target-qwen3", 21)]
#[case::llama_bf16_sharded_tied("target-llama", 22)]
fn target_save_load_round_trip(#[case] fixture: &str, #[case] seed: u64) -> TestResult {
    let model = TargetModel::load(&fixtures_dir().join(fixture), DType::F32)?;
    let tmp = tempfile::tempdir()?;
    model.save(tmp.path())?;
    let files: BTreeSet<String> = ["config.json", "model.safetensors"].map(String::from).into();
    assert_eq!(listing(tmp.path()), files, "files left by TargetModel::save");
    let back = TargetModel::load(tmp.path(), DType::F32)?;
    assert_eq!(back.config, model.config);

    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let vocab = model.config.dims.vocab_size as u32;
    let tokens: Vec<u32> = (0..17).map(|_| rng.random_range(0..vocab)).collect();
    let layers: Vec<usize> = (0..model.config.dims.num_layers()).collect();
    let (a, b) = (model.forward(&tokens, &layers)?, back.forward(&tokens, &layers)?);
    assert_eq!(bits(&a.logits)?, bits(&b.logits)?, "logits after save -> load");
    for (l, (x, y)) in a.hidden.iter().zip(&b.hidden).enumerate() {
        assert_eq!(bits(x)?, bits(y)?, "layer {l} output after save -> load");
    }
    Ok(())
}

/// The fixture configs survive `to_value` -> `from_value` unchanged (including the HF
/// transformers-5 `rope_parameters` spelling of the targets, written back as `rope_theta`).
#[rstest]
#[case::qwen3("target-qwen3")]
#[case::llama("target-llama")]
fn fixture_target_config_round_trip(#[case] fixture: &str) -> TestResult {
    let file = fixtures_dir().join(fixture).join("config.json");
    let config = TargetConfig::from_file(&file)?;
    assert_eq!(TargetConfig::from_value(&file, &config.to_value())?, config);
    Ok(())
}

/// Fields transformers reads that a config may give in other places: a `rope_theta` inside
/// `rope_scaling` (it wins over the top level's, and two objects must agree), and Qwen3's
/// window without `layer_types` (`use_sliding_window`, `sliding_window`, `max_window_layers`:
/// the layers from `max_window_layers` on slide; none without `use_sliding_window` or a window).
#[test]
fn target_config_fields_read_as_transformers_reads_them() -> TestResult {
    let file = fixtures_dir().join("target-qwen3").join("config.json");
    let base: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file)?)?;
    let parse = |edit: &dyn Fn(&mut serde_json::Map<String, serde_json::Value>)| {
        let mut v = base.clone();
        let map = v.as_object_mut().expect("an object");
        map.remove("rope_parameters");
        map.remove("layer_types");
        edit(map);
        TargetConfig::from_value(&file, &v)
    };
    let theta = parse(&|m| {
        m.insert("rope_theta".into(), serde_json::json!(1e4));
        m.insert("rope_scaling".into(), serde_json::json!({"rope_type": "default", "rope_theta": 1e6}));
    })?;
    assert_eq!(theta.dims.rope_theta, 1e6);
    let disagree = parse(&|m| {
        m.insert("rope_scaling".into(), serde_json::json!({"rope_type": "default", "rope_theta": 1e6}));
        m.insert("rope_parameters".into(), serde_json::json!({"rope_type": "default", "rope_theta": 1e4}));
    });
    assert!(disagree.is_err_and(|e| e.to_string().contains("rope_parameters.rope_theta")));
    let window = |use_it: bool| {
        parse(&|m| {
            m.insert("use_sliding_window".into(), serde_json::json!(use_it));
            m.insert("sliding_window".into(), serde_json::json!(40));
            m.insert("max_window_layers".into(), serde_json::json!(1));
        })
    };
    let w = AttnKind::Sliding { window: 40 };
    assert_eq!(window(true)?.dims.layer_kinds, [AttnKind::Full, w, w]);
    assert_eq!(window(false)?.dims.layer_kinds, [AttnKind::Full; 3]);
    // No window (null) with `use_sliding_window`: transformers keeps none, every layer full.
    let unset = parse(&|m| {
        m.insert("use_sliding_window".into(), serde_json::json!(true));
        m.insert("sliding_window".into(), serde_json::Value::Null);
    })?;
    assert_eq!(unset.dims.layer_kinds, [AttnKind::Full; 3]);
    Ok(())
}

/// The fixture drafter config survives `to_value` -> `from_value` unchanged.
#[test]
fn fixture_draft_config_round_trip() -> TestResult {
    let file = fixtures_dir().join("drafter").join("config.json");
    let config = DraftConfig::from_file(&file)?;
    assert_eq!(config.dims.layer_kinds, [AttnKind::Sliding { window: 6 }, AttnKind::Full]);
    assert_eq!(DraftConfig::from_value(&file, &config.to_value())?, config);
    Ok(())
}

/// Random target and drafter configs of `conformance::setups` (both architectures, tied or
/// not, full and sliding layers; windows made HF-expressible) survive `to_value` ->
/// `from_value` unchanged.
#[test]
fn random_configs_round_trip() -> TestResult {
    let file = Path::new("random/config.json");
    let mut sliding = 0;
    for seed in 0..64 {
        let target = random_target_config(&mut ChaCha8Rng::seed_from_u64(seed));
        let back = TargetConfig::from_value(file, &target.to_value())?;
        assert_eq!(back, target, "target config of seed {seed}");

        let draft = random_draft_case(seed, DType::F32)?.drafter.config;
        let back = DraftConfig::from_value(file, &draft.to_value())?;
        assert_eq!(back, draft, "drafter config of seed {seed}");
        sliding +=
            [&target.dims, &draft.dims].iter().filter(|d| d.layer_kinds.iter().any(|k| *k != AttnKind::Full)).count();
    }
    assert!(sliding > 0, "no random config had a sliding layer");
    Ok(())
}

/// The spec's default `target_layer_ids`: `round(1 + i*(L-4)/(n-1))` (Qwen3-8B: 36 layers, 5
/// features -> [1, 9, 17, 25, 33]), halves to even as the upstream Python helper (`int(round(..))`,
/// values from it: 22, 30, 34 and 42 layers hit halves), and `[L/2]` for one feature.
#[rstest]
#[case::qwen3_8b(36, 5, vec![1, 9, 17, 25, 33])]
#[case::halves_22(22, 5, vec![1, 6, 10, 14, 19])]
#[case::halves_30(30, 5, vec![1, 8, 14, 20, 27])]
#[case::halves_34(34, 5, vec![1, 8, 16, 24, 31])]
#[case::halves_42(42, 5, vec![1, 10, 20, 30, 39])]
#[case::target_64(64, 5, vec![1, 16, 31, 46, 61])]
#[case::target_28(28, 3, vec![1, 13, 25])]
#[case::target_32(32, 4, vec![1, 10, 20, 29])]
#[case::drafter_fixture(8, 2, vec![1, 5])]
#[case::one_of_36(36, 1, vec![18])]
#[case::one_of_64(64, 1, vec![32])]
#[case::one_of_7(7, 1, vec![3])]
#[case::one_of_3(3, 1, vec![1])]
fn default_layer_ids(#[case] layers: usize, #[case] n: usize, #[case] want: Vec<usize>) {
    assert_eq!(default_target_layer_ids(layers, n), want);
}

/// A new drafter's feature layers: the spec's rule wherever it gives increasing layers below the
/// last (every published target); on targets of a few layers, where the rule repeats layers (3
/// layers: [1, 0, 0]; 6: [1, 2, 2, 2, 3]), layers spread evenly from the first to the one below
/// the last, as many as there are.
#[rstest]
#[case::qwen3_8b(36, 5, vec![1, 9, 17, 25, 33])]
#[case::target_64(64, 5, vec![1, 16, 31, 46, 61])]
#[case::eight_layers(8, 5, vec![1, 2, 3, 4, 5])]
#[case::six_layers(6, 5, vec![0, 1, 2, 3, 4])]
#[case::three_layers(3, 5, vec![0, 1])]
#[case::three_of_two(3, 2, vec![0, 1])]
#[case::one_of_3(3, 1, vec![1])]
#[case::two_layers(2, 5, vec![0])]
fn training_layer_ids(#[case] layers: usize, #[case] n: usize, #[case] want: Vec<usize>) {
    let ids = training_target_layer_ids(layers, n);
    assert_eq!(ids, want);
    assert_eq!(check_feature_layers(&ids, layers), Ok(()));
}

/// Feature layers chosen by a user, as serving engines read them: none, one past the last layer,
/// the last layer itself (engines serve its output after the final norm), one twice, or out of
/// increasing order (engines concatenate in layer order) are refused, naming the layer.
#[test]
fn bad_feature_layers_are_named() {
    assert_eq!(check_feature_layers(&[], 4), Err("no layer given".to_string()));
    let refused = |ids: &[usize], want: &str| {
        let err = check_feature_layers(ids, 4).unwrap_err();
        assert!(err.contains(want), "{ids:?}: {err}");
    };
    refused(&[1, 4], "layer 4 is out of range for the target's 4 layers");
    refused(&[0, 3], "layer 3 is the target's last");
    refused(&[1, 1], "layer 1 is given twice");
    refused(&[2, 0], "2 before 0");
    assert!(check_feature_layers(&[0], 1).unwrap_err().contains("no layer below its last"));
}
