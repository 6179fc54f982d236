//! `cargo xtask gpu-bundle`: everything the H200 machine needs in one git-ignored folder,
//! `gpu-bundle/` at the repository root: the release `xtask` binary (it opens the CUDA libraries
//! at run time), the PyTorch baseline scripts of `xtask/bench/`, and `commit.txt`. Also the
//! helpers the GPU commands use to find what the bundle holds.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::args::Options;

const HELP: &str = "usage: cargo xtask gpu-bundle

Builds the release xtask, compiles every CUDA kernel with NVRTC when its library opens here
(LD_LIBRARY_PATH; CUDA_HOME for the headers; with CUDA_HOME/bin/ptxas it prints each kernel's
registers and spills, with CUDA_HOME/bin/cuobjdump it checks the attention forwards' SASS: q's
registers must be no p.v product's), and fills gpu-bundle/ (git-ignored) at the repository
root with the binary, xtask/bench/*.py and commit.txt (git rev-parse HEAD, `-dirty` when the tree
has changes), then prints its size and the command to run on the GPU machine.";

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
    compile_kernels()?;

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

/// Compiles every kernel module with NVRTC when its library opens here (`LD_LIBRARY_PATH`, and
/// `CUDA_HOME` for `cuda_bf16.h`), so a kernel that does not compile fails here rather than on the
/// GPU machine; says so when it cannot. Where `CUDA_HOME/bin/ptxas` exists too, assembles each
/// module for sm_90a and prints every kernel's registers, barriers, stack and spills, and ptxas's
/// notes ([`kernel_resources`]): a kernel past 128 registers runs one 256-thread CTA per SM,
/// spills cost local-memory traffic, and a serialised wgmma loses its overlap. Where
/// `CUDA_HOME/bin/cuobjdump` exists too, checks the attention forward's SASS
/// ([`forward_keeps_q_registers`]). Compile with the GPU machines' toolkit (13.0) to see what
/// their driver makes of the kernels.
fn compile_kernels() -> Result<(), String> {
    use dflash_optimized::device::gpu::{compile, nvrtc_present};
    if !nvrtc_present() {
        println!("kernels: not compiled here (no NVRTC library; set LD_LIBRARY_PATH and CUDA_HOME to check them)");
        return Ok(());
    }
    let cuda_home = std::env::var("CUDA_HOME").unwrap_or_else(|_| "/usr/local/cuda".to_string());
    let ptxas = Path::new(&cuda_home).join("bin/ptxas");
    for (module, source) in dflash_optimized::ops::sources::compiled_modules() {
        let started = std::time::Instant::now();
        let ptx = compile(&module, &source).map_err(|e| e.to_string())?;
        println!("kernels: {module} compiles with NVRTC ({:.1}s)", started.elapsed().as_secs_f64());
        if ptxas.is_file() {
            for line in kernel_resources(&ptxas, &module, &ptx.to_src())? {
                println!("  {line}");
            }
        }
    }
    if !ptxas.is_file() {
        println!("kernels: registers not reported ({} is missing)", ptxas.display());
    }
    Ok(())
}

/// What `ptxas -arch=sm_90a -v` says of `ptx`'s kernels ([`ptxas_summary`]), and for an
/// attention module the SASS check of its forwards ([`forward_sass_lines`]); the PTX and the
/// cubin written to temporary files and removed.
fn kernel_resources(ptxas: &Path, module: &str, ptx: &str) -> Result<Vec<String>, String> {
    let stem = std::env::temp_dir().join(format!("dflash-{module}-{}", std::process::id()));
    let (file, cubin) = (stem.with_extension("ptx"), stem.with_extension("cubin"));
    std::fs::write(&file, ptx).map_err(|e| format!("{}: {e}", file.display()))?;
    let out = Command::new(ptxas)
        .args(["-arch=sm_90a", "-v", "-o"])
        .arg(&cubin)
        .arg(&file)
        .output()
        .map_err(|e| format!("running {}: {e}", ptxas.display()));
    let _ = std::fs::remove_file(&file);
    let result = out.and_then(|out| {
        let log = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            return Err(format!("ptxas on module `{module}` failed:\n{log}"));
        }
        let mut lines = ptxas_summary(&log);
        if module.starts_with("attention") {
            lines.extend(forward_sass_lines(&ptxas.with_file_name("cuobjdump"), &cubin, module)?);
        }
        Ok(lines)
    });
    let _ = std::fs::remove_file(&cubin);
    result
}

/// The SASS check ([`forward_keeps_q_registers`]) of every forward kernel (`attention_forward*`)
/// of `cubin` (module `module`): a line per kernel, nothing without `cuobjdump`, or the error.
fn forward_sass_lines(cuobjdump: &Path, cubin: &Path, module: &str) -> Result<Vec<String>, String> {
    if !cuobjdump.is_file() {
        return Ok(Vec::new());
    }
    // cuobjdump runs nvdisasm, which the toolkit keeps next to it.
    let dirs = cuobjdump.parent().map(Path::to_path_buf).into_iter();
    let path = std::env::join_paths(dirs.chain(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())))
        .map_err(|e| e.to_string())?;
    let out = Command::new(cuobjdump)
        .arg("-sass")
        .arg(cubin)
        .env("PATH", path)
        .output()
        .map_err(|e| format!("running {}: {e}", cuobjdump.display()))?;
    if !out.status.success() {
        let log = String::from_utf8_lossy(&out.stderr);
        return Ok(vec![format!("SASS not checked ({})", log.trim())]);
    }
    let sass = String::from_utf8_lossy(&out.stdout);
    let mut lines = Vec::new();
    // cuobjdump heads each kernel's SASS with `Function : NAME`.
    for part in sass.split("Function : ").skip(1) {
        let name = part.split_whitespace().next().unwrap_or("");
        if !name.starts_with("attention_forward") {
            continue;
        }
        lines.push(match forward_keeps_q_registers(part) {
            Ok(true) => format!("{name}: the q.k products' q registers are no other product's"),
            Ok(false) => format!("{name}: no q.k product reads q from registers"),
            Err(e) => return Err(format!("module `{module}`, {name}: {e}")),
        });
    }
    Ok(lines)
}

/// Whether the forward keeps q: the A operand of its q.k products (the `HGMMA`s without a
/// transposed B; q in registers, made once before the KV loop) must not be the A operand of
/// its p.v products (`.tnspB`), whose p is made anew in every tile. ptxas 13.0 (the GPU
/// machines') gave q's registers to p in a fused variant at head dim 128, so every tile after
/// the first multiplied p in place of q (README, attention history). `Ok(false)` when no q.k
/// product reads registers (q in shared memory); the error names the registers both read.
fn forward_keeps_q_registers(sass: &str) -> Result<bool, String> {
    // An HGMMA line: `HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR12], RZ, !UPT ;`, its A
    // operand the second, a register's four from it when it is one.
    let (mut q, mut p) = (std::collections::BTreeSet::new(), std::collections::BTreeSet::new());
    for line in sass.lines() {
        let Some(at) = line.find("HGMMA") else { continue };
        let text = line[at..].split(';').next().unwrap_or("");
        let operands: Vec<&str> = text.split_once(' ').map_or("", |(_, o)| o).split(',').map(str::trim).collect();
        let Some(base) = operands.get(1).and_then(|a| a.strip_prefix('R')).and_then(|r| r.parse::<u32>().ok()) else {
            continue;
        };
        let into = if operands.iter().any(|o| o.ends_with(".tnspB")) { &mut p } else { &mut q };
        into.extend(base..base + 4);
    }
    let shared: Vec<String> = q.intersection(&p).map(|r| format!("R{r}")).collect();
    if !shared.is_empty() {
        return Err(format!(
            "the q.k products' q registers are also the p.v products' p ({}): q is lost after the first KV tile",
            shared.join(" ")
        ));
    }
    Ok(!q.is_empty())
}

/// `KERNEL: used R registers, ...; S bytes stack frame, ... spill loads` per kernel of a
/// `ptxas -v` log, and its warnings and notes on serialised wgmma as they are.
fn ptxas_summary(log: &str) -> Vec<String> {
    // Per kernel: "Compiling entry function 'NAME' ...", then "N bytes stack frame, N bytes spill
    // stores, N bytes spill loads", then "Used R registers, ...".
    let (mut lines, mut name, mut spill) = (Vec::new(), String::new(), String::new());
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            name = rest.split('\'').next().unwrap_or("").to_string();
            spill.clear();
        } else if line.contains("spill stores") {
            spill = line.trim().to_string();
        } else if let Some(rest) = line.split("Used ").nth(1) {
            lines.push(format!("{name}: used {}; {spill}", rest.trim()));
        } else if line.contains("warning") || line.contains("Performance Loss") {
            lines.push(line.trim().to_string());
        }
    }
    lines
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

#[cfg(test)]
mod tests {
    use super::{forward_keeps_q_registers, ptxas_summary};

    /// SASS lines of a forward's q.k and p.v products at head dim 128 (cut from `cuobjdump -sass`
    /// of ptxas 13.0's attention_forward: the first two of each group of eight).
    const KEPT: &str = "\
        /*5490*/                   HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR16], RZ, !UPT ;        /* 0x01e00010981879f0 */
        /*54e0*/                   HGMMA.64x128x16.F32.BF16 R24, R156, gdesc[UR16], R24 ;             /* 0x01e00010981879f0 */
        /*cea0*/                   HGMMA.64x128x16.F32.BF16 R88, R24, gdesc[UR12].tnspB, R88 ;        /* 0x41e0000c18587df0 */
        /*cef0*/                   HGMMA.64x128x16.F32.BF16 R88, R28, gdesc[UR12].tnspB, R88, gsb0 ;  /* 0x41e0000c1c587df0 */
";

    #[test]
    fn a_forward_whose_p_has_its_own_registers_keeps_q() {
        assert_eq!(forward_keeps_q_registers(KEPT), Ok(true));
    }

    /// The fused variant ptxas 13.0 broke: p packed into q's registers.
    #[test]
    fn a_forward_whose_p_takes_q_registers_is_refused() {
        let lost = KEPT.replace("R88, R24, gdesc", "R88, R152, gdesc");
        let err = forward_keeps_q_registers(&lost).unwrap_err();
        assert!(err.contains("(R152 R153 R154 R155)"), "{err}");
    }

    /// q in shared memory: the q.k products name descriptors only.
    #[test]
    fn a_forward_with_q_in_shared_memory_has_no_q_registers() {
        let sass = "        /*8360*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], RZ, !UPT ;\n\
                    /*cea0*/                   HGMMA.64x128x16.F32.BF16 R88, R24, gdesc[UR12].tnspB, R88 ;\n";
        assert_eq!(forward_keeps_q_registers(sass), Ok(false));
    }

    /// A `ptxas -v` log as ptxas 13.5 writes it (attention.cu at head dim 192, cut to two
    /// kernels): a line per kernel with its spills, and the note on serialised wgmma kept.
    #[test]
    fn the_ptxas_log_gives_each_kernels_registers_and_spills() {
        let log = "\
ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function 'attention_backward_dq'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'attention_backward_dq' for 'sm_90a'
ptxas info    : Function properties for attention_backward_dq
    336 bytes stack frame, 524 bytes spill stores, 444 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 336 bytes cumulative stack size
ptxas info    : Compile time = 778.717 ms
ptxas info    : Compiling entry function 'attention_forward' for 'sm_90a'
ptxas info    : Function properties for attention_forward
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 192 registers, used 1 barriers
ptxas info    : Compile time = 633.431 ms
";
        let lines = ptxas_summary(log);
        assert_eq!(lines.len(), 3, "{lines:#?}");
        assert!(lines[0].contains("C7512") && lines[0].contains("'attention_backward_dq'"), "{}", lines[0]);
        assert_eq!(
            lines[1],
            "attention_backward_dq: used 255 registers, used 1 barriers, 336 bytes cumulative stack size; \
             336 bytes stack frame, 524 bytes spill stores, 444 bytes spill loads"
        );
        assert_eq!(
            lines[2],
            "attention_forward: used 192 registers, used 1 barriers; 0 bytes stack frame, 0 bytes spill stores, \
             0 bytes spill loads"
        );
    }
}
