//! A folder's lock: an exclusive `flock` of `DIR/.lock` that names its holder, taken by a run
//! (its `--out`) or a feature-cache writer (its cache) and held until the process ends, so that
//! no two processes ever write one folder at once.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::{Error, Result};

/// The lock's file in a locked folder.
pub const LOCK_FILE: &str = ".lock";

/// This machine's name (Linux), which a lock's holder and a temporary name carry: on a
/// filesystem shared by several machines, a process id means something only on its own.
pub(crate) fn host_name() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let name = name.trim();
    (!name.is_empty()).then(|| name.to_string())
}

/// Whether `e` says the filesystem has no locks (ENOSYS, ENOLCK, EOPNOTSUPP on Linux).
fn unsupported(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::Unsupported || matches!(e.raw_os_error(), Some(38 | 37 | 95))
}

/// Takes `dir`'s lock for the rest of this process (a second call for the same folder holds it
/// already). When another live process holds it, an error for `option` names that holder.
pub fn lock_folder(dir: &Path, option: &str) -> Result<()> {
    static HELD: Mutex<Vec<(PathBuf, std::fs::File)>> = Mutex::new(Vec::new());
    let path = dir.join(LOCK_FILE);
    let key = std::fs::canonicalize(dir).map_err(|e| Error::io(dir, e))?;
    let mut held = HELD.lock().unwrap_or_else(|e| e.into_inner());
    if held.iter().any(|(p, _)| *p == key) {
        return Ok(());
    }
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| Error::io(&path, e))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            let holder = match holder.trim() {
                "" => "a live process holds its lock".to_string(),
                named => named.to_string(),
            };
            return Err(Error::option(
                option,
                format!("{} is in use by another run ({holder}): wait for it to end or stop it", dir.display()),
            ));
        }
        // A filesystem without `flock` (Lustre's `noflock`, NFS without its lock daemon): the
        // folder is used unlocked, and said so.
        Err(std::fs::TryLockError::Error(e)) if unsupported(&e) => {
            eprintln!("warning: {}: {e}: locking is not supported here, so nothing stops a second run from writing {} at once", path.display(), dir.display());
            // Said once: a second call for the folder finds it held.
            held.push((key, file));
            return Ok(());
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(Error::io(&path, e)),
    }
    let holder = format!("process {} on {}", std::process::id(), host_name().unwrap_or_default());
    file.set_len(0).and_then(|()| file.write_all(holder.as_bytes())).map_err(|e| Error::io(&path, e))?;
    held.push((key, file));
    Ok(())
}
