//! Finding the CUDA driver and NCCL before anything touches them.
//!
//! cudarc loads both at run time, and a missing library panics deep inside cudarc the first
//! time a function is called (`Id::new()` included). So the engine checks
//! `is_culib_present()` first and reports what is missing and how to fix it. One pitfall has
//! its own message: cudarc looks for `libnccl.so` (and a few suffixes such as `.so.12`), while
//! NCCL installs `libnccl.so.2` and the NVIDIA wheel (`nvidia-nccl-cu12`) ships only that file,
//! so a symlink `libnccl.so -> libnccl.so.2` is needed.

use std::path::{Path, PathBuf};

/// The libraries the NCCL engine loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaLibrary {
    /// The CUDA driver API (`libcuda.so`), installed with the NVIDIA driver.
    Driver,
    /// NCCL (`libnccl.so`).
    Nccl,
}

/// A library the engine needs could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct LibraryMissing {
    /// The library that could not be loaded.
    pub library: CudaLibrary,
    /// What is missing and how to fix it.
    pub message: String,
}

/// Directories searched for a versioned NCCL that cudarc would not find by itself:
/// `LD_LIBRARY_PATH` and the usual system locations.
pub fn search_dirs(ld_library_path: Option<&str>) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = ld_library_path
        .unwrap_or("")
        .split(':')
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .collect();
    for d in [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/local/cuda/lib64",
        "/usr/local/lib",
        "/usr/lib64",
        "/usr/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    dirs
}

/// Versioned NCCL libraries (`libnccl.so.<n>`) in `dirs`, in search order.
pub fn versioned_nccl(dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else {
            continue;
        };
        let mut here: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_prefix("libnccl.so."))
                    .is_some_and(|v| {
                        !v.is_empty() && v.split('.').all(|x| x.parse::<u32>().is_ok())
                    })
            })
            .collect();
        here.sort();
        found.extend(here);
    }
    found
}

/// The message for a library that cudarc could not load; `versioned` lists versioned NCCL
/// files found on the system (see [`versioned_nccl`]).
pub fn missing_message(library: CudaLibrary, versioned: &[PathBuf]) -> String {
    match library {
        CudaLibrary::Driver => "CUDA (the NCCL engine, the cuda and tch backends) needs the CUDA \
             driver library (libcuda.so), which could not be loaded: this machine has no NVIDIA \
             driver, or it is not on the loader path (LD_LIBRARY_PATH)"
            .into(),
        CudaLibrary::Nccl => match versioned.first() {
            Some(path) => {
                let dir = path.parent().unwrap_or(Path::new("."));
                format!(
                    "NCCL was found as {} but cudarc loads it as libnccl.so, which does not \
                     exist (the NVIDIA NCCL wheel ships only the versioned file): create the \
                     link with `ln -s {} {}`, or in a directory of your own that you add to \
                     LD_LIBRARY_PATH",
                    path.display(),
                    path.display(),
                    dir.join("libnccl.so").display()
                )
            }
            None => "the NCCL engine needs NCCL (libnccl.so), which could not be loaded: \
                     install NCCL (e.g. Debian's libnccl2 and libnccl-dev, or `pip install \
                     nvidia-nccl-cu12` plus a libnccl.so -> libnccl.so.2 link) and put its \
                     directory on LD_LIBRARY_PATH"
                .into(),
        },
    }
}

/// The oldest NCCL the engine runs on: 2.18, the first with `ncclCommSplit` (one communicator
/// per mesh dimension) and non-blocking communicators that can be split.
pub const MIN_NCCL_VERSION: i32 = 21800;

/// `ncclGetVersion`'s code as `major.minor.patch` (codes below 2.9 have the older layout
/// `major * 1000 + minor * 100 + patch`).
pub fn version_string(code: i32) -> String {
    let (major, rest) = if code >= 10000 {
        (code / 10000, code % 10000)
    } else {
        (code / 1000, code % 1000)
    };
    format!("{major}.{}.{}", rest / 100, rest % 100)
}

/// Refuses an NCCL older than [`MIN_NCCL_VERSION`] with a message that names both versions,
/// where cudarc would panic at the first symbol the old library lacks.
pub fn check_nccl_version(code: i32) -> Result<(), LibraryMissing> {
    if code >= MIN_NCCL_VERSION {
        return Ok(());
    }
    Err(LibraryMissing {
        library: CudaLibrary::Nccl,
        message: format!(
            "NCCL {} is loaded, but the NCCL engine needs {} or newer (ncclCommSplit, \
             non-blocking communicators): install a newer NCCL (e.g. `pip install \
             \"nvidia-nccl-cu12>=2.18\"`, or Debian's libnccl2) and put it first on \
             LD_LIBRARY_PATH",
            version_string(code),
            version_string(MIN_NCCL_VERSION)
        ),
    })
}

/// Checks that the CUDA driver can be loaded, before any call that would panic (cudarc, and
/// Burn's CUDA backend on its device thread, panic when it cannot).
#[cfg(feature = "nccl")]
pub fn check_driver() -> Result<(), LibraryMissing> {
    // SAFETY: this only tries to open the shared library (dlopen) and closes it again.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    if !driver {
        return Err(LibraryMissing {
            library: CudaLibrary::Driver,
            message: missing_message(CudaLibrary::Driver, &[]),
        });
    }
    Ok(())
}

/// Checks that the CUDA driver and NCCL can be loaded, before any call that would panic.
#[cfg(feature = "nccl")]
pub fn check_libraries() -> Result<(), LibraryMissing> {
    check_driver()?;
    // SAFETY: this only tries to open the shared library (dlopen) and closes it again.
    let nccl = unsafe { cudarc::nccl::sys::is_culib_present() };
    if !nccl {
        let dirs = search_dirs(std::env::var("LD_LIBRARY_PATH").ok().as_deref());
        return Err(LibraryMissing {
            library: CudaLibrary::Nccl,
            message: missing_message(CudaLibrary::Nccl, &versioned_nccl(&dirs)),
        });
    }
    // ncclGetVersion exists in every NCCL; the symbols the engine needs past it may not.
    let code = cudarc::nccl::result::get_nccl_version().map_err(|e| LibraryMissing {
        library: CudaLibrary::Nccl,
        message: format!("NCCL loaded but ncclGetVersion failed: {e:?}"),
    })?;
    check_nccl_version(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lone_versioned_nccl_gets_the_symlink_advice() {
        let dir = std::env::temp_dir().join(format!("nccl-lib-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("libnccl.so.2"), b"").unwrap();
        std::fs::write(dir.join("libnccl.so.2.bak"), b"").unwrap();
        std::fs::write(dir.join("libnccl-net.so"), b"").unwrap();
        let dirs = search_dirs(Some(&format!("{}:", dir.display())));
        assert_eq!(dirs[0], dir);
        let found = versioned_nccl(&dirs[..1]);
        assert_eq!(found, vec![dir.join("libnccl.so.2")]);
        let msg = missing_message(CudaLibrary::Nccl, &found);
        let link = format!(
            "ln -s {} {}",
            dir.join("libnccl.so.2").display(),
            dir.join("libnccl.so").display()
        );
        assert!(msg.contains(&link), "{msg}");
        assert!(msg.starts_with("NCCL was found as"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn without_any_nccl_the_message_says_how_to_install_it() {
        let msg = missing_message(CudaLibrary::Nccl, &[]);
        assert!(msg.contains("libnccl.so"));
        assert!(msg.contains("LD_LIBRARY_PATH"));
        assert!(missing_message(CudaLibrary::Driver, &[]).contains("libcuda.so"));
    }

    #[test]
    fn nccl_older_than_2_18_is_refused_by_name() {
        assert_eq!(version_string(22705), "2.27.5");
        assert_eq!(version_string(2804), "2.8.4");
        assert!(check_nccl_version(21800).is_ok());
        assert!(check_nccl_version(22705).is_ok());
        let e = check_nccl_version(21703).unwrap_err();
        assert_eq!(e.library, CudaLibrary::Nccl);
        assert!(
            e.message
                .starts_with("NCCL 2.17.3 is loaded, but the NCCL engine needs 2.18.0"),
            "{}",
            e.message
        );
        assert!(
            check_nccl_version(2804)
                .unwrap_err()
                .message
                .contains("2.8.4")
        );
    }

    /// Runs on machines without CUDA (CI): the engine must refuse with the clear message
    /// rather than panic inside cudarc.
    #[cfg(feature = "nccl")]
    #[test]
    fn missing_libraries_are_reported_not_panicked() {
        let driver = unsafe { cudarc::driver::sys::is_culib_present() };
        let nccl = unsafe { cudarc::nccl::sys::is_culib_present() };
        match check_libraries() {
            Ok(()) => assert!(driver && nccl),
            Err(e) if !driver => {
                assert_eq!(e.library, CudaLibrary::Driver);
                assert!(e.to_string().contains("CUDA driver library (libcuda.so)"));
            }
            Err(e) => {
                assert!(!nccl);
                assert_eq!(e.library, CudaLibrary::Nccl);
                assert!(e.to_string().contains("libnccl.so"), "{e}");
            }
        }
    }
}
