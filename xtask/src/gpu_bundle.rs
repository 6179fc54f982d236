//! `cargo xtask gpu-bundle`: everything the H200 machine needs in one git-ignored folder,
//! `gpu-bundle/` at the repository root: the release `xtask` binary (it opens the CUDA libraries
//! at run time), the PyTorch baseline scripts of `xtask/bench/`, and `commit.txt`. Also the
//! helpers the GPU commands use to find what the bundle holds.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::args::Options;

const HELP: &str = "usage: cargo xtask gpu-bundle

Builds the release xtask, runs `cargo xtask kernels`'s checks where their tools are here (NVRTC
through LD_LIBRARY_PATH, CUDA_HOME/bin/ptxas and cuobjdump; a missing one is said and skipped),
and fills gpu-bundle/ (git-ignored) at the repository root with the binary, xtask/bench/*.py and
commit.txt (git rev-parse HEAD, `-dirty` when the tree has changes), then prints its size and the
command to run on the GPU machine.";

/// Name of the folder, at the repository root.
const BUNDLE: &str = "gpu-bundle";
/// The file next to the bundled binary that names the commit it was built from.
const COMMIT_FILE: &str = "commit.txt";

/// The repository root (this crate's parent folder, fixed at build time).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

/// The folder of the running binary (the bundle folder on the GPU machine).
fn binary_dir() -> Option<PathBuf> {
    std::env::current_exe().ok()?.parent().map(Path::to_path_buf)
}

/// `name` next to the running binary when it is there (in a bundle), else `fallback` under the
/// repository root (running through `cargo xtask`).
pub fn bundled_file(name: &str, fallback: &str) -> PathBuf {
    binary_dir().map(|dir| dir.join(name)).filter(|path| path.is_file()).unwrap_or_else(|| repo_root().join(fallback))
}

/// The commit results are attributed to: `explicit` (`--commit`), else `commit.txt` next to the
/// binary, else the checkout's `git rev-parse HEAD` (+ `-dirty`) when run inside it.
pub fn commit(explicit: Option<String>) -> Result<String, String> {
    if let Some(commit) = explicit {
        return Ok(commit);
    }
    if let Some(file) = binary_dir().map(|dir| dir.join(COMMIT_FILE)).filter(|f| f.is_file()) {
        let text = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        return match text.trim() {
            "" => Err(format!("{}: empty; pass --commit", file.display())),
            commit => Ok(commit.to_string()),
        };
    }
    git_commit(&repo_root())
        .map_err(|e| format!("no --commit, no {COMMIT_FILE} next to the binary, and no git checkout: {e}"))
}

/// `git rev-parse HEAD` of `root`, with `-dirty` when `git status --porcelain` lists anything
/// (untracked files included: a new kernel file changes the binary).
fn git_commit(root: &Path) -> Result<String, String> {
    let head = git(root, &["rev-parse", "HEAD"])?;
    let dirty = !git(root, &["status", "--porcelain"])?.is_empty();
    Ok(if dirty { format!("{head}-dirty") } else { head })
}

/// Runs `git args` in `root`; its trimmed stdout, or an error naming the command.
fn git(root: &Path, args: &[&str]) -> Result<String, String> {
    let shown = format!("git {}", args.join(" "));
    let out = Command::new("git").args(args).current_dir(root).output().map_err(|e| format!("{shown}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{shown}: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

pub fn run(args: Vec<String>) -> Result<(), String> {
    if Options::parse(args, &[])?.is_none() {
        println!("{HELP}");
        return Ok(());
    }
    let root = repo_root();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    println!("building: {cargo} build --release -p xtask");
    let status = Command::new(&cargo)
        .args(["build", "--release", "-p", "xtask"])
        .current_dir(&root)
        .status()
        .map_err(|e| format!("running `{cargo} build --release -p xtask`: {e}"))?;
    if !status.success() {
        return Err(format!("`{cargo} build --release -p xtask` failed ({status})"));
    }
    let target = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => root.join(dir),
        None => root.join("target"),
    };
    let binary = target.join("release").join("xtask");
    if !binary.is_file() {
        return Err(format!("{}: the release binary is missing after the build", binary.display()));
    }
    let commit = git_commit(&root)?;
    ensure_excluded(&root)?;
    crate::kernels::check(false)?;

    let bundle = root.join(BUNDLE);
    if bundle.exists() {
        std::fs::remove_dir_all(&bundle).map_err(|e| format!("{}: {e}", bundle.display()))?;
    }
    std::fs::create_dir_all(&bundle).map_err(|e| format!("{}: {e}", bundle.display()))?;
    let copy = |from: &Path, name: &str| -> Result<u64, String> {
        std::fs::copy(from, bundle.join(name)).map_err(|e| format!("copying {} to {BUNDLE}/: {e}", from.display()))
    };
    let mut files = vec![("xtask".to_string(), copy(&binary, "xtask")?)];
    let bench = root.join("xtask").join("bench");
    let mut scripts: Vec<PathBuf> = std::fs::read_dir(&bench)
        .map_err(|e| format!("{}: {e}", bench.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "py"))
        .collect();
    scripts.sort();
    for script in scripts {
        let name = script.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        files.push((name.clone(), copy(&script, &name)?));
    }
    let commit_file = bundle.join(COMMIT_FILE);
    dflash_reference::io::write_atomically(&commit_file, |f| {
        use std::io::Write;
        writeln!(f, "{commit}")
    })
    .map_err(|e| e.to_string())?;
    files.push((COMMIT_FILE.to_string(), commit.len() as u64 + 1));

    let total: u64 = files.iter().map(|(_, size)| size).sum();
    println!("\n{BUNDLE}/ at {} (commit {commit}):", bundle.display());
    for (name, size) in &files {
        println!("  {name:<24} {:>9.2} MiB", *size as f64 / (1 << 20) as f64);
    }
    println!("  {:<24} {:>9.2} MiB", "total", total as f64 / (1 << 20) as f64);
    if total > 64 << 20 {
        println!("warning: over 64 MiB, more than a device run can carry");
    }
    println!("\nOn the GPU machine, from the repository root (carry: [\"{BUNDLE}\"]):");
    println!(
        "  export LD_LIBRARY_PATH=/usr/local/cuda/lib64; {BUNDLE}/xtask gpu-conformance --out $OUT/attestation.json \
         && {BUNDLE}/xtask bench attention --out $OUT/attention-h200.json \
         && {BUNDLE}/xtask bench step --out $OUT/step-h200.json"
    );
    println!(
        "Then commit $OUT/attestation.json as fixtures/gpu/attestation.json, and $OUT/attention-h200.json and \
         $OUT/step-h200.json into results/."
    );
    Ok(())
}

/// Adds `/gpu-bundle/` to the repository's `.git/info/exclude` when it is not there (the bundle
/// must never be committed, even from a checkout whose `.gitignore` lacks it).
fn ensure_excluded(root: &Path) -> Result<(), String> {
    let line = format!("/{BUNDLE}/");
    let exclude = root.join(git(root, &["rev-parse", "--git-path", "info/exclude"])?);
    let text = match std::fs::read_to_string(&exclude) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(format!("{}: {e}", exclude.display())),
    };
    if text.lines().any(|l| l.trim() == line) {
        return Ok(());
    }
    if let Some(dir) = exclude.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let separator = if text.is_empty() || text.ends_with('\n') { "" } else { "\n" };
    dflash_reference::io::write_atomically(&exclude, |f| {
        use std::io::Write;
        writeln!(f, "{text}{separator}{line}")
    })
    .map_err(|e| e.to_string())
}
