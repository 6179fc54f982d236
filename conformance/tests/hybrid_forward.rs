//! The hybrid target's forward on the CPU twins (`HybridForward<Host<_>>`: the layout, the driver,
//! the backend's matmuls, norms, SwiGLU and attention, the GatedDeltaNet twins) against the
//! reference (`HybridModel::row_features`, the delta rule in its recurrent form), spec section 10:
//! random tiny hybrids (both layer kinds, GQA in both, partial RoPE, tied and untied) and the
//! transformers fixture `target-qwen3_5`, on packed rows of several documents with restarting
//! positions, a document longer than a chunk of 64, padding, and launches of T no multiple of 64;
//! in f64 and f32; the random hybrids the H200 runs (the kernels' head dims) in f64. And a target
//! too large for its backend is refused before allocating.

use candle_core::DType;
use dflash_conformance::fixtures_dir;
use dflash_conformance::hybrid_cases::{hybrid_check, random_hybrid_cases, HybridCase, GPU_HYBRID_SEED};
use dflash_conformance::target_cases::packed_row;
use dflash_conformance::tolerance::{Tolerance, HYBRID_BF16};
use dflash_optimized::backend::host::{Host, HostAlloc};
use dflash_optimized::backend::{Backend, Pitched};
use dflash_optimized::model::hybrid_forward::HybridForward;
use dflash_optimized::ops::attention::ranges::KeyRanges;
use dflash_optimized::ops::attention::AttnShape;
use dflash_optimized::ops::elementwise::twin::ElementwiseTwin;
use dflash_optimized::ops::gdn::GdnOps;
use dflash_optimized::ops::matmul::Mat;
use dflash_reference::data::Row;
use dflash_reference::hybrid::{HybridConfig, HybridModel};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;

/// f64 storage: the twins against the f64 reference through the whole stack.
const HYBRID_F64: Tolerance = Tolerance {
    rel: 1e-10,
    reason: "the same math in f64 in another order (the chunked delta rule vs the recurrent one, fused loops and \
             the tile-wise online softmax vs candle ops): ~1e-16 per op over a few layers of sums of <= 150 terms",
};

/// f32 storage: the twins' f32 arithmetic against the f64 reference on the same f32-exact weights.
const HYBRID_F32: Tolerance = Tolerance {
    rel: 1e-5,
    reason: "the twins' f32 rounding (~6e-8 per op, and of 1 + w at load) over dot products of H <= 40, the \
             chunk sums and UT substitution of <= 64 terms and softmax over <= 150 keys, through <= 5 layers; \
             the f64 reference adds nothing",
};

/// A random tiny hybrid config: 5 layers with both kinds among the first 4, GDN heads `H_k`
/// sharing `H_v` (d_k != d_v), gated attention with GQA and partial RoPE, tied or untied.
fn random_config(seed: u64) -> HybridConfig {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let key_heads = rng.random_range(1..=2);
    let kv_heads = rng.random_range(1..=2);
    let head_dim = 8 * rng.random_range(1..=2);
    let rotary = [0.25, 0.5][rng.random_range(0..2)];
    let mut kinds: Vec<&str> = (0..5).map(|_| ["linear_attention", "full_attention"][rng.random_range(0..2)]).collect();
    kinds[rng.random_range(0..2)] = "linear_attention";
    kinds[rng.random_range(2..4)] = "full_attention";
    let value = json!({
        "model_type": "qwen3_5_text",
        "hidden_size": 8 * rng.random_range(2..=5), "intermediate_size": rng.random_range(20..=48),
        "num_hidden_layers": 5, "vocab_size": rng.random_range(40..=90), "layer_types": kinds,
        "linear_conv_kernel_dim": rng.random_range(2..=4), "linear_key_head_dim": rng.random_range(3..=8),
        "linear_value_head_dim": rng.random_range(3..=8), "linear_num_key_heads": key_heads,
        "linear_num_value_heads": key_heads * rng.random_range(1..=3),
        "head_dim": head_dim, "num_attention_heads": kv_heads * rng.random_range(2..=3),
        "num_key_value_heads": kv_heads,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": rotary},
        "rms_norm_eps": 1e-6, "tie_word_embeddings": rng.random_bool(0.5),
    });
    HybridConfig::from_value(std::path::Path::new("random/config.json"), &value).expect("random config")
}

/// `model` with its weights rounded to f32 and held in f64 (what `Host<f32>` stores exactly).
fn f32_exact(model: &HybridModel) -> HybridModel {
    HybridModel::from_fn(model.config.clone(), |name, _| {
        Ok(model.weight(name)?.to_dtype(DType::F32)?.to_dtype(DType::F64)?)
    })
    .expect("f32-exact model")
}

/// One launch: a row of documents of 37, 1 and 70 tokens (the last across a chunk of 64) and 5 of
/// padding, then a row of one document of 29: T = 142.
fn launch_rows(vocab: usize, seed: u64) -> Vec<Row> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    vec![packed_row(&[37, 1, 70], 5, vocab, &mut rng), packed_row(&[29], 0, vocab, &mut rng)]
}

/// `case` (f64 weights) on `Host<f64>` and, f32-exact, on `Host<f32>`, against the reference
/// (`hybrid_check`: the features, and each document of the first row alone against its slice of
/// the packed launch).
fn check(case: HybridCase) {
    let f32_case = HybridCase {
        name: case.name.clone(),
        model: f32_exact(&case.model),
        layer_ids: case.layer_ids.clone(),
        rows: case.rows.clone(),
    };
    for (check, tol) in [
        (hybrid_check(&case, || Ok(Host::<f64>::default()), HYBRID_F64, None), HYBRID_F64),
        (hybrid_check(&f32_case, || Ok(Host::<f32>::default()), HYBRID_F32, None), HYBRID_F32),
    ] {
        let check = check.expect("hybrid forward");
        println!("{}: {:?}", check.name, check.errors);
        assert!(check.pass(), "{}: {:?} above {:.0e} ({})", check.name, check.errors, tol.rel, tol.reason);
    }
}

/// Random tiny hybrids (seeded): features of tapped layers of both kinds, out of order, the last
/// tapped layer before the last layer (layers after it never run).
#[test]
fn random_hybrids_match_the_reference() {
    for seed in 0..4 {
        let config = random_config(seed);
        let vocab = config.vocab_size;
        let model = HybridModel::random(config, 100 + seed, 0.2, DType::F64).expect("random model");
        let rows = launch_rows(vocab, seed);
        check(HybridCase { name: format!("random hybrid {seed}"), model, layer_ids: vec![3, 0, 1], rows });
    }
}

/// The transformers fixture (5 layers: GDN, full, GDN, GDN, full; heads of 32 with RoPE on 8,
/// GDN d_k 8 / d_v 16, 2 key heads for 4 value heads), every layer tapped.
#[test]
fn the_qwen3_5_fixture_matches_the_reference() {
    let model = HybridModel::load(&fixtures_dir().join("target-qwen3_5"), DType::F64).expect("fixture");
    let rows = launch_rows(model.config.vocab_size, 9);
    check(HybridCase { name: "target-qwen3_5".into(), model, layer_ids: vec![4, 0, 1, 2, 3], rows });
}

/// The random hybrids `xtask gpu-conformance` runs on the H200 (the kernels' head dims), here
/// on the CPU twins in f64 against the reference in f64.
#[test]
fn the_gpu_hybrid_cases_match_the_reference_on_the_twins() {
    for case in random_hybrid_cases(5, DType::F64).expect("cases") {
        let check = hybrid_check(&case, || Ok(Host::<f64>::default()), HYBRID_F64, None).expect("forward");
        println!("{}: {:?}", check.name, check.errors);
        assert!(check.pass(), "{}: {:?} above {:.0e}", check.name, check.errors, HYBRID_F64.rel);
    }
}

/// The random hybrids `xtask gpu-conformance` runs, on the bf16 twins (the GPU's storage, f32
/// arithmetic) against the reference in f32: the GPU's bound holds for bf16 storage itself, and is
/// not loose: bf16 storage alone costs more than half of it.
#[test]
fn the_bf16_twins_carry_the_gpu_hybrid_bound() {
    for case in random_hybrid_cases(GPU_HYBRID_SEED, DType::F32).expect("cases") {
        let check = hybrid_check(&case, || Ok(Host::<half::bf16>::default()), HYBRID_BF16, None).expect("forward");
        println!("bf16 twins, {}: {:?}", check.name, check.errors);
        assert!(
            check.pass(),
            "{}: {:?} above {:.0e} ({})",
            check.name,
            check.errors,
            HYBRID_BF16.rel,
            HYBRID_BF16.reason
        );
        assert!(check.errors[0].1 > HYBRID_BF16.rel / 2.0, "{}: {:?}: the bound is loose", check.name, check.errors);
    }
}

/// `Host<f32>` with `available` bytes free; allocating more panics (a refusal must come first).
struct Tight {
    host: Host<f32>,
    available: u64,
}

impl Backend for Tight {
    type Elem = f32;
    type Ops = ElementwiseTwin<f32>;
    type Alloc = HostAlloc;
    type Ranges = KeyRanges;
    const KIND: &'static str = "CPU twins (a small device)";

    fn name(&self) -> &str {
        "a small device"
    }
    fn available_bytes(&self) -> dflash_optimized::Result<u64> {
        Ok(self.available)
    }
    fn alloc(&self, name: &str, bytes: usize) -> dflash_optimized::Result<HostAlloc> {
        assert!(
            bytes as u64 <= self.available,
            "{name}: {bytes} bytes allocated beyond the {} available",
            self.available
        );
        self.host.alloc(name, bytes)
    }
    fn upload(&self, dst: u64, src: &[u8]) -> dflash_optimized::Result<()> {
        self.host.upload(dst, src)
    }
    fn download(&self, src: u64, dst: &mut [u8]) -> dflash_optimized::Result<()> {
        self.host.download(src, dst)
    }
    fn zero(&self, ptr: u64, bytes: usize) -> dflash_optimized::Result<()> {
        self.host.zero(ptr, bytes)
    }
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> dflash_optimized::Result<()> {
        self.host.copy(dst, src, bytes)
    }
    fn copy_strided(&self, dst: Pitched, src: Pitched, width: usize, rows: usize) -> dflash_optimized::Result<()> {
        self.host.copy_strided(dst, src, width, rows)
    }
    fn copy_from_peer(&self, dst: u64, src: u64, bytes: usize) -> dflash_optimized::Result<()> {
        self.host.copy_from_peer(dst, src, bytes)
    }
    fn synchronize(&self) -> dflash_optimized::Result<()> {
        self.host.synchronize()
    }
    fn ops(&self) -> &ElementwiseTwin<f32> {
        self.host.ops()
    }
    fn gdn_ops(&self) -> &dyn GdnOps {
        self.host.gdn_ops()
    }
    fn matmul(&self, a: Mat, b: Mat, c: u64, beta: f32) -> dflash_optimized::Result<()> {
        self.host.matmul(a, b, c, beta)
    }
    fn upload_ranges(&self, ranges: &KeyRanges) -> dflash_optimized::Result<KeyRanges> {
        self.host.upload_ranges(ranges)
    }
    fn attention_forward(
        &self,
        ranges: &KeyRanges,
        shape: AttnShape,
        qkv: (u64, u64, u64),
        out_lse: (u64, u64),
    ) -> dflash_optimized::Result<()> {
        self.host.attention_forward(ranges, shape, qkv, out_lse)
    }
    fn attention_backward(
        &self,
        ranges: &KeyRanges,
        shape: AttnShape,
        qkv: (u64, u64, u64),
        out_lse_dout: (u64, u64, u64),
        dsum: u64,
        grads: (u64, u64, u64),
    ) -> dflash_optimized::Result<()> {
        self.host.attention_backward(ranges, shape, qkv, out_lse_dout, dsum, grads)
    }
}

/// A hybrid whose embedding and LM head (vocab 40000) dwarf a device of 4 MB is refused before
/// anything is allocated, the error naming the device, the total and the largest items; on a
/// device with the layout's bytes it is laid out and allocated once.
#[test]
fn a_hybrid_too_large_for_its_backend_is_refused_naming_its_largest_items() {
    let mut config = random_config(7);
    config.vocab_size = 40_000;
    config.tie_word_embeddings = false;
    let small = Tight { host: Host::default(), available: 4_000_000 };
    let err = HybridForward::new(small, &config, &[2], 256).err().expect("must be refused").to_string();
    println!("{err}");
    for needle in [
        "the hybrid target needs",
        "a small device (hybrid target, 256 tokens per launch) has 0.004 GB available",
        "largest items: target embedding table (shared)",
        "target LM head (the drafter's, shared)",
    ] {
        assert!(err.contains(needle), "`{needle}` missing from: {err}");
    }
    let layout = dflash_optimized::memory::hybrid::HybridLayout::new(&config, &[2], 256, (4, 4)).expect("layout");
    let enough = Tight { host: Host::default(), available: layout.total_bytes().expect("total") };
    let forward = HybridForward::new(enough, &config, &[2], 256).expect("fits exactly");
    assert_eq!(forward.layout.bytes, layout.bytes);
}
