//! Routing the library's log messages to Rust.

use std::ffi::CStr;
use std::os::raw::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use roundpipe_sys as sys;

use crate::error::{check, Result};
use crate::installed::Installed;

/// Log levels, in increasing severity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    Debug,
    Info,
    Warn,
    Error,
}

impl LogLevel {
    fn code(self) -> i32 {
        match self {
            LogLevel::Debug => sys::RP_LOG_DEBUG,
            LogLevel::Info => sys::RP_LOG_INFO,
            LogLevel::Warn => sys::RP_LOG_WARN,
            LogLevel::Error => sys::RP_LOG_ERROR,
        }
    }

    fn from_code(code: i32) -> LogLevel {
        match code {
            sys::RP_LOG_DEBUG => LogLevel::Debug,
            sys::RP_LOG_INFO => LogLevel::Info,
            sys::RP_LOG_WARN => LogLevel::Warn,
            _ => LogLevel::Error,
        }
    }
}

type LogFn = dyn Fn(LogLevel, &str) + Send + Sync;

unsafe extern "C" fn log_trampoline(level: i32, message: *const c_char, user_data: *mut c_void) {
    if user_data.is_null() {
        return;
    }
    // SAFETY: user_data is the Box<Box<LogFn>> installed by set_log_callback, alive while it is
    // the library's sink (installed.rs); message is borrowed for the call.
    let f = &*(user_data as *const Box<LogFn>);
    let msg = if message.is_null() {
        std::borrow::Cow::Borrowed("")
    } else {
        CStr::from_ptr(message).to_string_lossy()
    };
    // A panic must not cross into C; a log line is not worth more than dropping it.
    let _ = catch_unwind(AssertUnwindSafe(|| f(LogLevel::from_code(level), &msg)));
}

// The installed closure (installed.rs): freed when replaced.
static CURRENT: Installed = Installed::new();

/// Send library log messages at or above `min_level` to `f`, called from any RoundPipe thread,
/// one call at a time. `f` must not call back into RoundPipe. Replacing the callback frees the
/// previous closure (the library returns once no call to it is in flight).
pub fn set_log_callback<F>(f: F, min_level: LogLevel) -> Result<()>
where
    F: Fn(LogLevel, &str) + Send + Sync + 'static,
{
    crate::ensure_abi()?;
    let boxed: Box<Box<LogFn>> = Box::new(Box::new(f));
    let user_data = Box::into_raw(boxed) as *mut c_void;
    CURRENT.replace(
        user_data as usize,
        // SAFETY: the trampoline matches rp_log_fn; user_data lives until replaced.
        || {
            check(unsafe {
                sys::rp_set_log_callback(Some(log_trampoline), min_level.code(), user_data)
            })
        },
        free_closure,
    )
}

/// Restore the default log sink (warnings and errors to stderr), freeing the closure.
pub fn reset_log_callback() -> Result<()> {
    crate::ensure_abi()?;
    CURRENT.replace(
        0,
        || check(unsafe { sys::rp_set_log_callback(None, sys::RP_LOG_WARN, std::ptr::null_mut()) }),
        free_closure,
    )
}

unsafe fn free_closure(address: usize) {
    drop(Box::from_raw(address as *mut Box<LogFn>));
}
