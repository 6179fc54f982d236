//! The conformance suite's harnesses: named tolerances, relative errors, fixture paths, random
//! tiny setups, the attention and target cases, the counting allocator, and the GPU checks that
//! `xtask gpu-conformance` runs on the H200. The tests themselves live in `tests/`.

pub mod attention_cases;
pub mod decode_cases;
pub mod gdn_cases;
pub mod gpu_attention;
pub mod gpu_step;
pub mod heap;
pub mod hybrid_cases;
pub mod op_cases;
pub mod setups;
pub mod target_cases;
pub mod tolerance;
pub mod twin_tensors;

use std::path::PathBuf;

/// The repository's `fixtures/` folder: where this crate was built, else `fixtures/` of the
/// working directory (a bundled binary run from a checkout elsewhere, as on the GPU machine).
pub fn fixtures_dir() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures");
    match built.is_dir() {
        true => built,
        false => PathBuf::from("fixtures"),
    }
}
