//! The GPU attestation gate (DESIGN.md, "Conformance strategy"): CI cannot run CUDA, so a GPU
//! conformance run on the H200 attests the kernel sources it tested; this test fails when the
//! current sources (`optimized/src/ops/*/*.cu` with the constants' prelude) no longer match `fixtures/gpu/attestation.json`, or
//! when that run did not pass. No kernel change lands without a passing GPU run.
//!
//! With no kernel sources at all there is nothing to attest, and the test passes.

use std::path::Path;

use dflash_optimized::ops::sources::{kernel_hash, KERNEL_SOURCES};
use serde_json::Value;

const HOW: &str = "run `cargo xtask gpu-bundle`, then on the H200 the gpu-conformance command it prints, and \
                   commit the attestation it writes as fixtures/gpu/attestation.json";

#[test]
fn kernel_sources_match_a_passing_gpu_attestation() {
    if KERNEL_SOURCES.is_empty() {
        // No CUDA kernels yet: no attestation is needed.
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the conformance crate is in the workspace");
    let file = root.join("fixtures/gpu/attestation.json");
    let text = std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e}\nthe CUDA kernels have no GPU attestation: {HOW}", file.display()));
    let attestation: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: invalid JSON: {e}", file.display()));
    let attested = attestation["kernel_hash"].as_str().unwrap_or("<missing>");
    let current = kernel_hash();
    assert_eq!(
        attested,
        current,
        "{}: the kernel sources changed since the GPU conformance run (attested {attested}, now {current}): {HOW}",
        file.display()
    );
    assert_eq!(
        attestation["verdict"].as_str(),
        Some("pass"),
        "{}: the GPU conformance run did not pass; fix the kernels, then {HOW}",
        file.display()
    );
    assert_ne!(
        attestation["partial"],
        Value::Bool(true),
        "{}: a partial run (`gpu-conformance --only`) attests only some groups: {HOW}",
        file.display()
    );
    let cases = attestation["cases"].as_array().map_or(&[][..], Vec::as_slice);
    assert!(!cases.is_empty(), "{}: the attestation lists no cases: {HOW}", file.display());
    for case in cases {
        assert_eq!(case["pass"], Value::Bool(true), "{}: case {} did not pass: {HOW}", file.display(), case["name"]);
    }
    // The run covered every elementwise kernel and the matmul against the CPU twins, the target's
    // forward of both architectures, decoding (a trained pair among the cases), and the GPU step
    // under every policy.
    let names: Vec<&str> = cases.iter().filter_map(|c| c["name"].as_str()).collect();
    for prefix in [
        "op rms_norm_forward",
        "op rms_norm_backward",
        "op head_norm_rope_forward",
        "op head_norm_rope_backward",
        "op rope_forward",
        "op swiglu",
        "op ce_grad_rows",
        "op argmax_rows",
        "op adamw_update x2",
        "op adamw_update (stored gradients)",
        "op fill_normal, gather/scatter, sum_squares, accumulate",
        "op matmul",
        "op linear of 1 rows",
        "op linear of 16 rows",
        "target qwen3",
        "target llama",
        "decode qwen3",
        "decode llama",
        "decode GPU built-in target, its trained drafter",
    ] {
        assert!(names.iter().any(|n| n.starts_with(prefix)), "{}: no `{prefix}` case: {HOW}", file.display());
    }
    for policy in ["none", "selective", "per-layer"] {
        let step = format!(" {policy} [");
        assert!(
            names.iter().any(|n| n.starts_with("step seed") && n.contains(&step)),
            "{}: no GPU step case under the {policy} policy: {HOW}",
            file.display()
        );
    }
}
