//! Files: atomic writes, and safetensors weight sets whose errors name the file and tensor.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// Writes `file` through `fill` into a temporary name in the same folder, then renames it, so
/// a failure never leaves a half-written `file`.
pub fn write_atomically(file: &Path, fill: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>) -> Result<()> {
    let tmp = temporary_name(file);
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        fill(&mut f)?;
        f.flush()?;
        f.sync_all()
    })();
    finish_atomic_write(file, &tmp, result)
}

/// Writes `weights` as f32 into `dir/model.safetensors` (atomically), creating `dir`.
pub fn save_weights_f32(dir: &Path, weights: &HashMap<String, Tensor>) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let tensors =
        weights.iter().map(|(n, t)| Ok((n.clone(), t.to_dtype(DType::F32)?))).collect::<Result<HashMap<_, _>>>()?;
    save_safetensors(&dir.join("model.safetensors"), &tensors)
}

/// The header metadata of every safetensors file written, as PyTorch's writers set it:
/// transformers before 4.48.2 fails to load a file without `"format": "pt"` (it reads
/// `metadata.get("format")` from a header whose metadata is absent).
pub const SAFETENSORS_METADATA: [(&str, &str); 1] = [("format", "pt")];

/// Saves named tensors as one safetensors file with [`SAFETENSORS_METADATA`], atomically and
/// synced, with the permissions a newly created file gets (the writer underneath creates a private
/// temporary file: a server running as another user could not read the drafter).
pub fn save_safetensors(file: &Path, tensors: &HashMap<String, Tensor>) -> Result<()> {
    let tmp = temporary_name(file);
    let result = (|| {
        let permissions = std::fs::File::create(&tmp)?.metadata()?.permissions();
        let metadata = SAFETENSORS_METADATA.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        safetensors::serialize_to_file(tensors, Some(metadata), &tmp)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        std::fs::set_permissions(&tmp, permissions)?;
        std::fs::File::open(&tmp)?.sync_all()
    })();
    finish_atomic_write(file, &tmp, result)
}

fn temporary_name(file: &Path) -> PathBuf {
    let name = file.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    file.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

fn finish_atomic_write(file: &Path, tmp: &Path, result: std::io::Result<()>) -> Result<()> {
    match result.and_then(|()| std::fs::rename(tmp, file)) {
        Ok(()) => Ok(()),
        Err(e) => {
            let _ = std::fs::remove_file(tmp);
            Err(Error::io(file, e))
        }
    }
}

/// Tensors of one model in one or several safetensors files, memory-mapped: a tensor is read
/// (and converted) only when asked for, so a checkpoint larger than the host's memory loads one
/// tensor at a time; each is remembered with the file it is in. The files must not change while
/// the set is open.
pub struct WeightSet {
    /// The file named in errors about a tensor that is missing.
    origin: PathBuf,
    files: Vec<(PathBuf, MmapedSafetensors)>,
    /// Each tensor's file (an index into `files`).
    index: HashMap<String, usize>,
}

/// The safetensors files of the checkpoint in `dir` and the file that names them: the shards of
/// `model.safetensors.index.json`, or `model.safetensors` alone.
fn checkpoint_files(dir: &Path) -> Result<(PathBuf, Vec<PathBuf>)> {
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        return Ok((dir.join("model.safetensors"), vec![dir.join("model.safetensors")]));
    }
    let value = crate::json_fields::read_json(&index)?;
    let map = value.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| Error::Field {
        file: index.clone(),
        field: "weight_map".into(),
        message: "missing or not an object".into(),
    })?;
    let mut shards: Vec<PathBuf> = Vec::new();
    for (name, shard) in map {
        let shard = shard.as_str().ok_or_else(|| Error::Field {
            file: index.clone(),
            field: format!("weight_map.{name}"),
            message: "expected a file name".into(),
        })?;
        let path = dir.join(shard);
        if !shards.contains(&path) {
            shards.push(path);
        }
    }
    Ok((index, shards))
}

/// Checks the checkpoint in `dir` from its safetensors headers alone: every `expected` weight
/// `(checkpoint name, shape)` is there with its shape and a float dtype (bf16, f16, f32 or f64).
/// Returns the checkpoint's other tensors, sorted, unless `refuse(name)` says why one of them is refused (checked first, so a checkpoint
/// of another layout names its first foreign tensor).
pub fn check_checkpoint(
    dir: &Path,
    expected: &[(String, Vec<usize>)],
    refuse: impl Fn(&str) -> Option<String>,
) -> Result<Vec<String>> {
    let shapes = WeightSet::load_dir(dir)?.shapes();
    let error =
        |tensor: &str, message: String| Error::Tensor { file: dir.to_path_buf(), tensor: tensor.into(), message };
    let mut unused: Vec<String> = shapes.keys().filter(|n| !expected.iter().any(|(e, _)| e == *n)).cloned().collect();
    unused.sort();
    if let Some((name, why)) = unused.iter().find_map(|n| refuse(n).map(|why| (n, why))) {
        return Err(error(name, why));
    }
    for (name, shape) in expected {
        match shapes.get(name) {
            None => return Err(error(name, "missing from the checkpoint (the config needs it)".into())),
            Some((found, _)) if found != shape => {
                return Err(error(name, format!("shape {found:?} in the checkpoint, the config needs {shape:?}")))
            }
            Some((_, dtype)) if !["BF16", "F16", "F32", "F64"].contains(&dtype.as_str()) => {
                return Err(error(name, format!("dtype {dtype} in the checkpoint (expected BF16, F16, F32 or F64)")))
            }
            Some(_) => {}
        }
    }
    Ok(unused)
}

impl WeightSet {
    /// Loads `model.safetensors` from `dir`, or the shards listed in `model.safetensors.index.json`.
    pub fn load_dir(dir: &Path) -> Result<Self> {
        let (origin, files) = checkpoint_files(dir)?;
        Self::load_files(&origin, &files)
    }

    /// Opens the given safetensors files (their headers read, their tensors mapped); `origin`
    /// names the set in errors about missing tensors.
    pub fn load_files(origin: &Path, files: &[PathBuf]) -> Result<Self> {
        let (mut mapped, mut index) = (Vec::new(), HashMap::new());
        for file in files {
            if !file.exists() {
                return Err(Error::io(file, std::io::Error::new(std::io::ErrorKind::NotFound, "no such file")));
            }
            // SAFETY: the map is only read, and the set's contract is that the checkpoint's files
            // do not change while it is open (as every reader of a mapped checkpoint assumes).
            let m = unsafe { MmapedSafetensors::new(file) }.map_err(|e| Error::Tensor {
                file: file.clone(),
                tensor: "<file>".into(),
                message: format!("not a readable safetensors file: {e}"),
            })?;
            index.extend(m.tensors().into_iter().map(|(name, _)| (name, mapped.len())));
            mapped.push((file.clone(), m));
        }
        Ok(WeightSet { origin: origin.to_path_buf(), files: mapped, index })
    }

    /// Every tensor's shape and dtype (as safetensors names it: `BF16`, `F32`, ...), from the
    /// headers (no tensor is read).
    pub fn shapes(&self) -> HashMap<String, (Vec<usize>, String)> {
        let views = self.files.iter().flat_map(|(_, m)| m.tensors());
        views.map(|(name, view)| (name, (view.shape().to_vec(), format!("{:?}", view.dtype())))).collect()
    }

    /// The tensor `name`, checked to have `shape` and a float dtype, converted to `dtype`.
    pub fn get(&self, name: &str, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let (file, mapped) = self.index.get(name).map(|&i| &self.files[i]).ok_or_else(|| Error::Tensor {
            file: self.origin.clone(),
            tensor: name.into(),
            message: "missing".into(),
        })?;
        let err = |message: String| Error::Tensor { file: file.clone(), tensor: name.into(), message };
        let t = mapped.load(name, &Device::Cpu).map_err(|e| err(format!("not readable: {e}")))?;
        if !matches!(t.dtype(), DType::BF16 | DType::F16 | DType::F32 | DType::F64) {
            return Err(err(format!("unsupported dtype {:?} (expected bf16, f16, f32 or f64)", t.dtype())));
        }
        if t.dims() != shape {
            return Err(err(format!("shape {:?}, expected {shape:?}", t.dims())));
        }
        Ok(t.to_dtype(dtype)?)
    }
}
