//! Progress of long operations (loading and saving weights) reported to a Rust closure.

use std::ffi::CStr;
use std::os::raw::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use roundpipe_sys as sys;

use crate::error::{check, Result};
use crate::installed::Installed;

type ProgressFn = dyn Fn(&str, i64, i64) + Send + Sync;

static CURRENT: Installed = Installed::new();

unsafe extern "C" fn progress_trampoline(
    what: *const c_char,
    done: i64,
    total: i64,
    user_data: *mut c_void,
) {
    if user_data.is_null() {
        return;
    }
    // SAFETY: user_data is the Box<Box<ProgressFn>> installed by `install`, alive while it is
    // the library's sink (installed.rs); `what` is borrowed for the call.
    let f = &*(user_data as *const Box<ProgressFn>);
    let what = if what.is_null() {
        std::borrow::Cow::Borrowed("")
    } else {
        CStr::from_ptr(what).to_string_lossy()
    };
    // A panic must not cross into C; a progress display is not worth failing a load for.
    let _ = catch_unwind(AssertUnwindSafe(|| f(&what, done, total)));
}

fn install(user_data: *mut c_void) -> Result<()> {
    crate::ensure_abi()?;
    let fn_: sys::rp_progress_fn = if user_data.is_null() {
        None
    } else {
        Some(progress_trampoline)
    };
    CURRENT.replace(
        user_data as usize,
        // SAFETY: the trampoline matches rp_progress_fn; user_data lives until replaced.
        || check(unsafe { sys::rp_set_progress_callback(fn_, user_data) }),
        free_closure,
    )
}

unsafe fn free_closure(address: usize) {
    drop(Box::from_raw(address as *mut Box<ProgressFn>));
}

/// Report the progress of long operations to `f(what, done, total)`: creating a model from a
/// Hugging Face directory and loading or saving weights (`what` is `"load <path>"` or
/// `"save <path>"`; `done` and `total` count bytes, and every operation that succeeds ends with
/// one call where `done == total`). Process-wide; `f` runs on the thread that made the call
/// being reported and must not call back into RoundPipe. A panic in `f` is caught and ignored.
pub fn set_progress_callback<F>(f: F) -> Result<()>
where
    F: Fn(&str, i64, i64) + Send + Sync + 'static,
{
    let boxed: Box<Box<ProgressFn>> = Box::new(Box::new(f));
    install(Box::into_raw(boxed) as *mut c_void)
}

/// Stop reporting progress (the default).
pub fn reset_progress_callback() -> Result<()> {
    install(std::ptr::null_mut())
}
