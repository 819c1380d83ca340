//! Find libroundpipe.so and link against it so that every binary using it, in this workspace or
//! in a crate that depends on `roundpipe` / `roundpipe-sys`, starts with no environment variable.
//!
//! Search order:
//! 1. `ROUNDPIPE_LIB_DIR`, a folder holding libroundpipe.so;
//! 2. `pkg-config --variable=libdir roundpipe` (an installed RoundPipe, e.g. `cmake --install`);
//! 3. the build tree of this repository, `<repo>/build` (`../../build` from bindings/rust).
//!
//! Why a link stub and not an rpath. Cargo lets no dependency put an rpath into a dependent's
//! binary: `cargo:rustc-link-arg` applies to this package's own tests and examples only, and
//! `DEP_ROUNDPIPE_LIB_DIR` reaches only the build scripts of packages that depend on this one
//! directly (not a program that depends on `roundpipe`). What does reach every final link is
//! the library this script names. So it names a stub that it writes to OUT_DIR: a shared object
//! defining each `rp_*` function of src/lib.rs as an empty function, whose SONAME is the
//! absolute path of the library found, `<dir>/libroundpipe.so.<ABI>`. The linker writes a
//! library's SONAME into the binary as its DT_NEEDED entry, and the dynamic loader opens a
//! DT_NEEDED entry that holds a slash as that very path, searching nothing. Every binary thus
//! loads the library this script found (whose own run path then finds libtorch); the stub itself
//! is never loaded, like an import library on Windows. Without a C compiler (`$CC`, else `cc`),
//! the script links the library itself and only this package's targets get an rpath.

use std::env;
use std::fs;
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
    if dir.is_empty() {
        return None;
    }
    if !Path::new(&dir).join(LIB_FILE).exists() {
        println!(
            "cargo:warning=pkg-config names {} as RoundPipe's libdir, but it holds no {}; \
             ignoring it",
            dir, LIB_FILE
        );
        return None;
    }
    Some(PathBuf::from(dir))
}

fn from_build_tree() -> PathBuf {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    // bindings/rust/roundpipe-sys -> repository root
    manifest.join("..").join("..").join("..").join("build")
}

/// The `rp_*` functions src/lib.rs declares (one `pub fn rp_...(` per declaration), and its
/// RP_ABI_VERSION.
fn declared_functions(lib_rs: &Path) -> (Vec<String>, Option<String>) {
    let text = fs::read_to_string(lib_rs).expect("roundpipe-sys/src/lib.rs");
    let mut names = Vec::new();
    let mut abi = None;
    for line in text.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("pub fn rp_") {
            if let Some(end) = rest.find('(') {
                names.push(format!("rp_{}", &rest[..end]));
            }
        } else if let Some(rest) = line.strip_prefix("pub const RP_ABI_VERSION: i32 =") {
            abi = Some(rest.trim().trim_end_matches(';').trim().to_string());
        }
    }
    (names, abi)
}

/// Write and compile the link stub (see the top of this file) into `out_dir`; false when no C
/// compiler could build it.
fn build_stub(out_dir: &Path, soname: &Path, functions: &[String]) -> bool {
    let mut source =
        String::from("/* Link stub written by roundpipe-sys/build.rs; never loaded. */\n");
    for name in functions {
        source.push_str(&format!("void {}(void) {{}}\n", name));
    }
    let c_file = out_dir.join("roundpipe_stub.c");
    fs::write(&c_file, source).expect("write the link stub's source");
    let cc = env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .arg("-shared")
        .arg("-fPIC")
        .arg("-o")
        .arg(out_dir.join(LIB_FILE))
        .arg(&c_file)
        .arg(format!("-Wl,-soname,{}", soname.display()))
        .status();
    matches!(status, Ok(s) if s.success())
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/lib.rs");
    println!("cargo:rerun-if-env-changed=ROUNDPIPE_LIB_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG");
    println!("cargo:rerun-if-env-changed=CC");

    let (dir, how) = if let Some(d) = from_env() {
        (d, "ROUNDPIPE_LIB_DIR")
    } else if let Some(d) = from_pkg_config() {
        (d, "pkg-config")
    } else {
        (from_build_tree(), "the repository build tree")
    };
    // The stub's SONAME must be absolute; a path given relative is taken from here.
    let dir = dir.canonicalize().unwrap_or(dir);
    println!("cargo:rerun-if-changed={}", dir.join(LIB_FILE).display());
    println!("cargo:lib_dir={}", dir.display());

    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    let (functions, abi) = declared_functions(&manifest.join("src").join("lib.rs"));
    // The name the library's SONAME gives it, when the folder has it (an installed or built
    // library); else the file itself (the Python wheel ships one file, libroundpipe.so).
    let soname = abi
        .map(|v| dir.join(format!("{}.{}", LIB_FILE, v)))
        .filter(|p| p.exists())
        .unwrap_or_else(|| dir.join(LIB_FILE));

    if !dir.join(LIB_FILE).exists() {
        println!(
            "cargo:warning={} not found in {} (from {}); build the C library first \
             (cmake --build build) or set ROUNDPIPE_LIB_DIR",
            LIB_FILE,
            dir.display(),
            how
        );
    } else if build_stub(&out_dir, &soname, &functions) {
        println!("cargo:rustc-link-search=native={}", out_dir.display());
        println!("cargo:rustc-link-lib=dylib=roundpipe");
        return;
    } else {
        println!(
            "cargo:warning=could not compile RoundPipe's link stub (no C compiler?): binaries \
             of crates that depend on roundpipe will need {} on the loader's path",
            dir.display()
        );
    }
    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-link-lib=dylib=roundpipe");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
}
