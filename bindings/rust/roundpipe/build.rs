//! Put the folder of libroundpipe.so (found by roundpipe-sys's build script and passed on as
//! `DEP_ROUNDPIPE_LIB_DIR`) in the rpath of this crate's tests and examples, so that they run
//! without LD_LIBRARY_PATH. Programs of your own that depend on `roundpipe` need the same line
//! in their build script, or the library on the loader's path.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_ROUNDPIPE_LIB_DIR");
    if let Ok(dir) = std::env::var("DEP_ROUNDPIPE_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir);
    }
}
