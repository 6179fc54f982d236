//! Shared helpers of the conformance suite: named tolerances, relative errors, fixture paths
//! and random tiny setups. The tests themselves live in `tests/`.

pub mod gpu_step;
pub mod heap;
pub mod setups;
pub mod tolerance;

use std::path::PathBuf;

/// The repository's `fixtures/` folder.
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}
