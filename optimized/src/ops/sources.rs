//! The CUDA kernel sources (`optimized/src/ops/*/*.cu`), embedded in the binary for NVRTC with the
//! shared constants' prelude, and their hash: the GPU conformance run attests a hash, and a CI test
//! fails when the sources or the constants no longer match it (DESIGN.md, "Conformance strategy").

use sha2::{Digest, Sha256};

use super::constants::prelude;

/// `elementwise.cu`, as written.
pub const ELEMENTWISE_CU: &str = include_str!("elementwise/elementwise.cu");
/// `attention.cu`, as written (compiled per head dim).
pub const ATTENTION_CU: &str = include_str!("attention/attention.cu");
/// `gdn.cu`, as written.
pub const GDN_CU: &str = include_str!("gdn/gdn.cu");

/// `(path under optimized/src/ops, source)` of every kernel file, sorted by path. A unit test
/// checks that this list matches the folders, so a new kernel file cannot be left out.
pub const KERNEL_SOURCES: &[(&str, &str)] =
    &[("attention/attention.cu", ATTENTION_CU), ("elementwise/elementwise.cu", ELEMENTWISE_CU), ("gdn/gdn.cu", GDN_CU)];

/// Head dims the attention kernels are built for (multiples of 64 up to 256).
pub const ATTENTION_HEAD_DIMS: [usize; 4] = [64, 128, 192, 256];

/// The per-head-dim `#define`s of `attention.cu`: `HEAD_DIM`, the key-major stage size and the
/// forward's KV tile and threads.
pub fn attention_defines(head_dim: usize) -> String {
    use super::{
        attention::cuda::dkdv_stage_bytes,
        constants::{forward_threads, forward_tile_k},
    };
    format!(
        "#define HEAD_DIM {head_dim}\n#define DKDV_STAGE_BYTES {}\n#define FORWARD_TILE_K {}\n#define FORWARD_THREADS {}\n",
        dkdv_stage_bytes(head_dim),
        forward_tile_k(head_dim),
        forward_threads(head_dim)
    )
}

/// What NVRTC compiles for `elementwise.cu`: the constants' prelude, then the source (made once
/// per process).
pub fn elementwise_source() -> &'static str {
    static SOURCE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SOURCE.get_or_init(|| format!("{}{ELEMENTWISE_CU}", prelude()))
}

/// What NVRTC compiles for `gdn.cu`: the constants' prelude, then the source (made once per
/// process).
pub fn gdn_source() -> &'static str {
    static SOURCE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SOURCE.get_or_init(|| format!("{}{GDN_CU}", prelude()))
}

/// What NVRTC compiles for `attention.cu` at `head_dim`: the prelude, the head dim's defines, the
/// source.
pub fn attention_source(head_dim: usize) -> String {
    format!("{}{}{ATTENTION_CU}", prelude(), attention_defines(head_dim))
}

/// Every module the GPU compiles, as `(module name, source with its defines)`: `elementwise`, `gdn`
/// and `attention_d{D}` for each head dim of [`ATTENTION_HEAD_DIMS`].
pub fn compiled_modules() -> Vec<(String, String)> {
    let mut modules = vec![
        ("elementwise".to_string(), elementwise_source().to_string()),
        ("gdn".to_string(), gdn_source().to_string()),
    ];
    modules.extend(ATTENTION_HEAD_DIMS.map(|d| (format!("attention_d{d}"), attention_source(d))));
    modules
}

/// Everything the kernels are compiled with besides their sources: the prelude and the attention
/// kernels' per-head-dim defines.
fn defines() -> String {
    prelude() + &ATTENTION_HEAD_DIMS.map(attention_defines).concat()
}

/// SHA-256 (lower-case hex) of the defines followed by the kernel sources in path order.
pub fn kernel_hash() -> String {
    let mut hasher = Sha256::new();
    hasher.update(defines().as_bytes());
    for (_, source) in KERNEL_SOURCES {
        hasher.update(source.as_bytes());
    }
    hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_sources_list_every_cu_file_of_the_ops_folders() {
        let ops = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/ops");
        let mut on_disk: Vec<(String, String)> = Vec::new();
        for op in std::fs::read_dir(&ops).unwrap_or_else(|e| panic!("{}: {e}", ops.display())) {
            let dir = op.unwrap().path();
            if !dir.is_dir() {
                continue;
            }
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.extension().is_some_and(|ext| ext == "cu") {
                    let name = path.strip_prefix(&ops).unwrap().to_string_lossy().into_owned();
                    on_disk.push((name, std::fs::read_to_string(&path).unwrap()));
                }
            }
        }
        on_disk.sort();
        let listed: Vec<(String, String)> =
            KERNEL_SOURCES.iter().map(|&(n, s)| (n.to_string(), s.to_string())).collect();
        let names = |v: &[(String, String)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(&listed), names(&on_disk), "KERNEL_SOURCES must list every ops/*/*.cu, sorted");
        assert!(listed == on_disk, "KERNEL_SOURCES differ from the files on disk");
    }

    #[test]
    fn hash_covers_the_defines_and_every_source() {
        let all: String = defines() + &KERNEL_SOURCES.iter().map(|&(_, s)| s).collect::<String>();
        let expected: String = Sha256::digest(all.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(kernel_hash(), expected);
        assert_eq!(kernel_hash().len(), 64);
    }
}
