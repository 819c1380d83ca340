//! The closure a process-wide C callback slot holds (the log sink, the progress sink): a leaked
//! `Box` whose address the library keeps as `user_data`. The C setters return only once no call
//! to the previous sink is in flight, so the previous closure is freed as soon as it is replaced.

use std::sync::Mutex;

use crate::error::Result;

pub(crate) struct Installed {
    // Address of the installed closure; 0 for none.
    current: Mutex<usize>,
}

impl Installed {
    pub(crate) const fn new() -> Self {
        Installed {
            current: Mutex::new(0),
        }
    }

    /// Runs `set`, the C setter handing the library `new` (0: no closure), then frees with
    /// `free` whichever closure the library no longer holds: the previous one once `set`
    /// succeeded, else `new`, which the library never kept.
    pub(crate) fn replace(
        &self,
        new: usize,
        set: impl FnOnce() -> Result<()>,
        free: unsafe fn(usize),
    ) -> Result<()> {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        let r = set();
        let unused = if r.is_ok() {
            std::mem::replace(&mut *current, new)
        } else {
            new
        };
        if unused != 0 {
            // SAFETY: no longer the library's sink, and no call to it is in flight.
            unsafe { free(unused) };
        }
        r
    }
}
