//! The CUDA kernel sources (`optimized/kernels/*.cu`), embedded in the binary for NVRTC, and their
//! hash: the GPU conformance run attests a hash, and a CI test fails when the sources no longer
//! match it (DESIGN.md, "Conformance strategy").

use sha2::{Digest, Sha256};

/// `(file name, source)` of every `optimized/kernels/*.cu`, sorted by file name. A unit test
/// checks that this list matches the folder, so a new kernel file cannot be left out.
pub const KERNEL_SOURCES: &[(&str, &str)] =
    &[("attention.cu", include_str!("../kernels/attention.cu")), ("step.cu", include_str!("../kernels/step.cu"))];

/// SHA-256 (lower-case hex) of the kernel sources concatenated in file-name order: the same as
/// `cat optimized/kernels/*.cu | sha256sum` in the C locale.
pub fn kernel_hash() -> String {
    let mut sources: Vec<_> = KERNEL_SOURCES.to_vec();
    sources.sort_by_key(|&(name, _)| name);
    let mut hasher = Sha256::new();
    for (_, source) in sources {
        hasher.update(source.as_bytes());
    }
    hasher.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_sources_list_every_cu_file_of_the_folder() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let mut on_disk: Vec<(String, String)> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "cu"))
            .map(|path| {
                let name = path.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read_to_string(&path).unwrap())
            })
            .collect();
        on_disk.sort();
        let listed: Vec<(String, String)> =
            KERNEL_SOURCES.iter().map(|&(n, s)| (n.to_string(), s.to_string())).collect();
        let names = |v: &[(String, String)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names(&listed), names(&on_disk), "KERNEL_SOURCES must list every optimized/kernels/*.cu, sorted");
        assert!(listed == on_disk, "KERNEL_SOURCES differ from the files on disk");
    }

    #[test]
    fn hash_is_sha256_of_the_concatenation() {
        let all: String = KERNEL_SOURCES.iter().map(|&(_, s)| s).collect();
        let expected: String = Sha256::digest(all.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(kernel_hash(), expected);
        assert_eq!(kernel_hash().len(), 64);
    }
}
