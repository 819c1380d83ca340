//! Errors: the library's status code and its message, in one `Error`.

use std::ffi::CStr;
use std::fmt;

use roundpipe_sys as sys;

/// What kind of failure a call reported (the C `rp_status`, without `RP_OK`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Status {
    /// Bad pointer, value, shape, dtype, device or spec (`RP_ERR_INVALID_ARGUMENT`).
    InvalidArgument,
    /// A host or device allocation failed (`RP_ERR_OUT_OF_MEMORY`).
    OutOfMemory,
    /// A file could not be read, written or parsed (`RP_ERR_IO`).
    Io,
    /// A CUDA call failed (`RP_ERR_CUDA`).
    Cuda,
    /// A callback reported failure or panicked (`RP_ERR_CALLBACK`).
    Callback,
    /// The call is not allowed in the model's current state (`RP_ERR_STATE`).
    State,
    /// A bug in RoundPipe (`RP_ERR_INTERNAL`).
    Internal,
    /// A code this binding does not know (a newer library).
    Other(i32),
}

impl Status {
    /// The status for a C code; `None` for `RP_OK`.
    pub fn from_code(code: i32) -> Option<Status> {
        Some(match code {
            sys::RP_OK => return None,
            sys::RP_ERR_INVALID_ARGUMENT => Status::InvalidArgument,
            sys::RP_ERR_OUT_OF_MEMORY => Status::OutOfMemory,
            sys::RP_ERR_IO => Status::Io,
            sys::RP_ERR_CUDA => Status::Cuda,
            sys::RP_ERR_CALLBACK => Status::Callback,
            sys::RP_ERR_STATE => Status::State,
            sys::RP_ERR_INTERNAL => Status::Internal,
            other => Status::Other(other),
        })
    }

    /// The C code (`RP_ERR_*`, negative).
    pub fn code(self) -> i32 {
        match self {
            Status::InvalidArgument => sys::RP_ERR_INVALID_ARGUMENT,
            Status::OutOfMemory => sys::RP_ERR_OUT_OF_MEMORY,
            Status::Io => sys::RP_ERR_IO,
            Status::Cuda => sys::RP_ERR_CUDA,
            Status::Callback => sys::RP_ERR_CALLBACK,
            Status::State => sys::RP_ERR_STATE,
            Status::Internal => sys::RP_ERR_INTERNAL,
            Status::Other(c) => c,
        }
    }

    /// The library's short English name of the status ("invalid argument", ...).
    pub fn name(self) -> String {
        // SAFETY: any value is accepted; the result is static storage or NULL.
        unsafe { c_string(sys::rp_status_string(self.code())) }
    }
}

/// A failed call: its status and the library's message (`rp_last_error_message`), or the
/// binding's own message when the binding refused the call before reaching the library.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    status: Status,
    message: String,
}

impl Error {
    /// An error made by this binding (not reported by the library).
    pub fn new(status: Status, message: impl Into<String>) -> Error {
        Error {
            status,
            message: message.into(),
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Error {
        Error::new(Status::InvalidArgument, message)
    }

    /// The kind of failure.
    pub fn status(&self) -> Status {
        self.status
    }

    /// The C status code (negative `RP_ERR_*`).
    pub fn code(&self) -> i32 {
        self.status.code()
    }

    /// What went wrong, in the library's words.
    pub fn message(&self) -> &str {
        &self.message
    }

    pub(crate) fn with_detail(mut self, detail: &str) -> Error {
        if !detail.is_empty() {
            if self.message.is_empty() {
                self.message = detail.to_string();
            } else {
                self.message = format!("{}: {}", self.message, detail);
            }
        }
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.status.name(),
            self.code(),
            self.message
        )
    }
}

impl std::error::Error for Error {}

/// `Result` with RoundPipe's `Error`.
pub type Result<T> = std::result::Result<T, Error>;

/// A copy of a NUL-terminated C string ("" for NULL).
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string valid for the call.
pub(crate) unsafe fn c_string(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

/// `Ok(())` for `RP_OK`, else the error with the calling thread's last error message.
pub(crate) fn check(code: sys::rp_status) -> Result<()> {
    match Status::from_code(code) {
        None => Ok(()),
        Some(status) => {
            // SAFETY: the message is library-owned and valid until the next call on this thread;
            // it is copied at once.
            let message = unsafe { c_string(sys::rp_last_error_message()) };
            Err(Error { status, message })
        }
    }
}
