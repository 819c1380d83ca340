//! Find libroundpipe.so and link against it.
//!
//! Search order:
//! 1. `ROUNDPIPE_LIB_DIR`, a folder holding libroundpipe.so;
//! 2. `pkg-config --variable=libdir roundpipe` (an installed RoundPipe);
//! 3. the build tree of this repository, `<repo>/build` (`../../build` from bindings/rust).
//!
//! The folder found is put in the rpath of this crate's tests and passed on to dependents as
//! `DEP_ROUNDPIPE_LIB_DIR` (the `links = "roundpipe"` metadata), so that `roundpipe`'s tests and
//! examples get the same rpath.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const LIB_FILE: &str = "libroundpipe.so";

fn from_env() -> Option<PathBuf> {
    env::var_os("ROUNDPIPE_LIB_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

fn from_pkg_config() -> Option<PathBuf> {
    let out = Command::new(env::var("PKG_CONFIG").unwrap_or_else(|_| "pkg-config".into()))
        .args(["--variable=libdir", "roundpipe"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let dir = String::from_utf8(out.stdout).ok()?.trim().to_string();
    if dir.is_empty() || !Path::new(&dir).join(LIB_FILE).exists() {
        return None;
    }
    Some(PathBuf::from(dir))
}

fn from_build_tree() -> PathBuf {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    // bindings/rust/roundpipe-sys -> repository root
    let repo = manifest.join("..").join("..").join("..");
    let dir = repo.join("build");
    dir.canonicalize().unwrap_or(dir)
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=ROUNDPIPE_LIB_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG");

    let (dir, how) = if let Some(d) = from_env() {
        (d, "ROUNDPIPE_LIB_DIR")
    } else if let Some(d) = from_pkg_config() {
        (d, "pkg-config")
    } else {
        (from_build_tree(), "the repository build tree")
    };
    if !dir.join(LIB_FILE).exists() {
        println!(
            "cargo:warning={} not found in {} (from {}); build the C library first \
             (cmake --build build) or set ROUNDPIPE_LIB_DIR",
            LIB_FILE,
            dir.display(),
            how
        );
    }
    let dir = dir.display().to_string();
    println!("cargo:rustc-link-search=native={}", dir);
    println!("cargo:rustc-link-lib=dylib=roundpipe");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir);
    println!("cargo:lib_dir={}", dir);
}
