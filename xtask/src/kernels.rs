//! `cargo xtask kernels`: every CUDA kernel compiled here, without a GPU, as the GPU machine
//! compiles it: NVRTC (its library on `LD_LIBRARY_PATH`, the headers under `CUDA_HOME`), then
//! ptxas's registers and spills and a SASS check of the attention forwards (`CUDA_HOME/bin`).
//! `gpu-bundle` runs the same check where it can; this command fails where it cannot.

use std::path::Path;
use std::process::Command;

use crate::args::Options;

const HELP: &str = "usage: cargo xtask kernels

Compiles every CUDA kernel module with NVRTC (its library found through LD_LIBRARY_PATH, the
headers under CUDA_HOME), assembles each for sm_90a with CUDA_HOME/bin/ptxas and prints every
kernel's registers, barriers and spills, and reads the attention forwards' SASS with
CUDA_HOME/bin/cuobjdump: the q registers of their q.k products must be no p.v product's p (ptxas
13.0 gave them to p once; README, attention history). Fails when a kernel does not compile, the
check fails, or any of the three tools is missing. No GPU needed: the tools come from PyPI, pinned
to the GPU machines' 13.0 in .ci/run, which runs this command.";

pub fn run(args: Vec<String>) -> Result<(), String> {
    if Options::parse(args, &[])?.is_none() {
        println!("{HELP}");
        return Ok(());
    }
    check(true)
}

/// Compiles every kernel module with NVRTC, so a kernel that does not compile fails here rather
/// than on the GPU machine. With `CUDA_HOME/bin/ptxas`, assembles each module for sm_90a and prints
/// every kernel's registers, barriers, stack and spills, and ptxas's notes ([`kernel_resources`]):
/// a kernel past 128 registers runs one 256-thread CTA per SM, spills cost local-memory traffic,
/// and a serialised wgmma loses its overlap. With `CUDA_HOME/bin/cuobjdump` too, checks the
/// attention forwards' SASS ([`forward_keeps_q_registers`]). `strict`: a missing NVRTC, ptxas or
/// cuobjdump is an error; otherwise it is said and skipped.
pub fn check(strict: bool) -> Result<(), String> {
    use dflash_optimized::device::gpu::{compile, nvrtc_present};
    let missing = |what: String| -> Result<(), String> {
        match strict {
            true => Err(format!("kernels: {what}")),
            false => {
                println!("kernels: {what}");
                Ok(())
            }
        }
    };
    if !nvrtc_present() {
        return missing("not compiled here (no NVRTC library; set LD_LIBRARY_PATH and CUDA_HOME to check them)".into());
    }
    let cuda_home = std::env::var("CUDA_HOME").unwrap_or_else(|_| "/usr/local/cuda".to_string());
    let ptxas = Path::new(&cuda_home).join("bin/ptxas");
    let cuobjdump = ptxas.with_file_name("cuobjdump");
    if !ptxas.is_file() {
        missing(format!("registers not reported ({} is missing)", ptxas.display()))?;
    } else if !cuobjdump.is_file() {
        missing(format!("SASS not checked ({} is missing)", cuobjdump.display()))?;
    }
    for (module, source) in dflash_optimized::ops::sources::compiled_modules() {
        let started = std::time::Instant::now();
        let ptx = compile(&module, &source).map_err(|e| e.to_string())?;
        println!("kernels: {module} compiles with NVRTC ({:.1}s)", started.elapsed().as_secs_f64());
        if ptxas.is_file() {
            for line in kernel_resources(&ptxas, &module, &ptx.to_src(), strict)? {
                println!("  {line}");
            }
        }
    }
    Ok(())
}

/// What `ptxas -arch=sm_90a -v` says of `ptx`'s kernels ([`ptxas_summary`]), and for an
/// attention module the SASS check of its forwards ([`forward_sass_lines`], `strict` as there);
/// the PTX and the cubin written to temporary files and removed.
fn kernel_resources(ptxas: &Path, module: &str, ptx: &str, strict: bool) -> Result<Vec<String>, String> {
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
            lines.extend(forward_sass_lines(&ptxas.with_file_name("cuobjdump"), &cubin, module, strict)?);
        }
        Ok(lines)
    });
    let _ = std::fs::remove_file(&cubin);
    result
}

/// The SASS check ([`forward_keeps_q_registers`]) of every forward kernel (`attention_forward*`)
/// of `cubin` (module `module`): a line per kernel, nothing without `cuobjdump`, or the error.
/// `strict`: a disassembly that fails or holds no forward kernel is an error, not a line.
fn forward_sass_lines(cuobjdump: &Path, cubin: &Path, module: &str, strict: bool) -> Result<Vec<String>, String> {
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
        let what = format!("SASS not checked ({})", String::from_utf8_lossy(&out.stderr).trim());
        return if strict { Err(format!("module `{module}`: {what}")) } else { Ok(vec![what]) };
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
    if strict && lines.is_empty() {
        return Err(format!("module `{module}`: no attention_forward kernel in cuobjdump's SASS, nothing checked"));
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
