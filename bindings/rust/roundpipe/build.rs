//! Put the folder of libroundpipe.so (found by roundpipe-sys's build script and passed on as
//! `DEP_ROUNDPIPE_LIB_DIR`) in the rpath of this crate's tests and examples. Needed only when
//! roundpipe-sys could not build its link stub (no C compiler; see roundpipe-sys/build.rs), which
//! otherwise makes every binary, this crate's and its dependents', name the library by its
//! absolute path. An rpath emitted here reaches this package's own targets only, never the
//! binaries of a crate that depends on `roundpipe`.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_ROUNDPIPE_LIB_DIR");
    if let Ok(dir) = std::env::var("DEP_ROUNDPIPE_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir);
    }
}
