"""Exceptions raised by the RoundPipe binding."""

import enum


class Status(enum.IntEnum):
    """The C library's ``rp_status`` codes."""

    OK = 0
    INVALID_ARGUMENT = -1
    OUT_OF_MEMORY = -2
    IO = -3
    CUDA = -4
    CALLBACK = -5
    STATE = -6
    INTERNAL = -7


_STATUS_NAMES = {
    Status.OK: "ok",
    Status.INVALID_ARGUMENT: "invalid argument",
    Status.OUT_OF_MEMORY: "out of memory",
    Status.IO: "i/o error",
    Status.CUDA: "cuda error",
    Status.CALLBACK: "callback failed",
    Status.STATE: "invalid state",
    Status.INTERNAL: "internal error",
}


class RoundPipeError(RuntimeError):
    """A RoundPipe call failed.

    ``status`` is the C status code (a :class:`Status` when known) and ``message`` the
    library's explanation (``rp_last_error_message()``) or the binding's own.
    """

    def __init__(self, status, message):
        try:
            status = Status(status)
        except ValueError:
            status = int(status)
        self.status = status
        self.message = message
        super().__init__(status, message)

    @property
    def status_name(self):
        return _STATUS_NAMES.get(self.status, "unknown status %d" % int(self.status))

    def __str__(self):
        if self.message:
            return "%s: %s" % (self.status_name, self.message)
        return self.status_name


class RoundPipeUnsupportedError(RoundPipeError, NotImplementedError):
    """What was asked for is not supported by this RoundPipe build (yet). The message lists
    what is supported."""

    def __init__(self, message):
        super().__init__(Status.INVALID_ARGUMENT, message)


class LibraryNotFoundError(RoundPipeError, OSError):
    """``libroundpipe.so`` could not be found or loaded; the message lists every path tried."""

    def __init__(self, message):
        super().__init__(Status.IO, message)
