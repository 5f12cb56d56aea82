//! scripts/cuda-build.sh's packing, without building anything: the kit's layout, its
//! checksums and the size limit, on stand-in binaries.

use std::path::Path;
use std::process::Command;

use crate::llama_hf::temp_dir;

fn script() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/cuda-build.sh")
}

/// `bytes` of incompressible data (xz cannot shrink them below the limit).
fn noise(bytes: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..bytes)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn pack(dir: &Path, limit_mib: u32) -> std::process::Output {
    Command::new("bash")
        .arg(script())
        .arg("--pack")
        .arg(dir.join("bin"))
        .env("KIT_DIR", dir.join("kit"))
        .env("KIT_LIMIT_MIB", limit_mib.to_string())
        .env("LIBDEVICE", dir.join("libdevice.10.bc"))
        .output()
        .expect("running bash")
}

#[test]
fn the_kit_holds_the_compressed_binaries_libdevice_and_the_check_within_its_limit() {
    let root = temp_dir("gpu-kit");
    let dir = &root;
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    for (i, name) in ["train_llama", "nccl_check"].into_iter().enumerate() {
        std::fs::write(dir.join("bin").join(name), noise(700 << 10, i as u64)).unwrap();
    }
    std::fs::write(dir.join("libdevice.10.bc"), noise(1000, 9)).unwrap();

    let ok = pack(dir, 60);
    let log =
        String::from_utf8_lossy(&ok.stderr).to_string() + &String::from_utf8_lossy(&ok.stdout);
    assert!(ok.status.success(), "{log}");
    let kit = dir.join("kit");
    for file in [
        "train_llama.xz",
        "nccl_check.xz",
        "nvvm/libdevice/libdevice.10.bc",
        "gpu-check.sh",
        "SHA256SUMS",
    ] {
        assert!(
            kit.join(file).is_file(),
            "{file} missing from the kit: {log}"
        );
    }
    let sums = Command::new("sha256sum")
        .args(["-c", "SHA256SUMS"])
        .current_dir(&kit)
        .output()
        .unwrap();
    assert!(
        sums.status.success(),
        "{}",
        String::from_utf8_lossy(&sums.stdout)
    );
    // The binaries come back whole.
    let unpacked = Command::new("xz")
        .args(["-dc"])
        .arg(kit.join("nccl_check.xz"))
        .output()
        .unwrap();
    assert_eq!(unpacked.stdout, noise(700 << 10, 1));

    // Over the limit: an error that says so, and a failing status.
    let over = pack(dir, 1);
    let err = String::from_utf8_lossy(&over.stderr);
    assert!(!over.status.success());
    assert!(err.contains("over the 1 MiB limit"), "{err}");

    // Missing binaries: named, with the way to build them.
    std::fs::remove_file(dir.join("bin/nccl_check")).unwrap();
    let missing = pack(dir, 60);
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(!missing.status.success());
    assert!(
        err.contains("nccl_check") && err.contains("build it first"),
        "{err}"
    );
    std::fs::remove_dir_all(&root).unwrap();
}
