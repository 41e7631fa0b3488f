"""ferry's exception classes.

Every error raised by ferry derives from :class:`ferry.Error`; its ``code`` attribute is
the C++ status code name ("InvalidArgument", "NotFound", ...). Where a Python builtin
exception fits, the class also derives from it, so ``except ValueError`` / ``except
IndexError`` / ``except KeyError`` work as they do with torch.
"""
import builtins


class Error(Exception):
    """Base class of every ferry error. ``code`` names the C++ status code. ``report``:
    for a failed ``Producer.sync`` / ``Consumer.sync``, the sync's report as far as it
    went (the dict a successful sync returns: "ok" False, "error", "failures", "events",
    bytes, phases, "live_version", "groups_live", ...); None otherwise."""

    code = "Unknown"
    report = None


class RecordingError(Error, RuntimeError):
    """A value-dependent operation (arithmetic, comparison, ``item()``, ``numpy()``,
    ``bool()``, a copy from real data, ...) on a recording tensor, which has no bytes;
    or a recording op with no active ``ferry.record()``. The message names the op and
    the tensor."""

    code = "FailedPrecondition"


class InvalidArgumentError(Error, ValueError):
    code = "InvalidArgument"


class MismatchError(InvalidArgumentError):
    """A tensor handed to ``Plan.replay`` disagrees with the plan (names the tensor)."""


class ShapeMismatchError(MismatchError):
    pass


class DTypeMismatchError(MismatchError, TypeError):
    pass


class OutOfRangeError(Error, builtins.IndexError):
    """An index or dim outside a tensor (torch raises IndexError there too)."""

    code = "OutOfRange"


class NotFoundError(Error, KeyError):
    code = "NotFound"

    def __str__(self):  # KeyError would quote the message
        return Exception.__str__(self)


class AlreadyExistsError(Error, ValueError):
    code = "AlreadyExists"


class FailedPreconditionError(Error, RuntimeError):
    code = "FailedPrecondition"


class CorruptError(Error, ValueError):
    """Bytes from outside (a serialized plan, a file, the network) failed validation."""

    code = "Corrupt"


class IOError(Error, OSError):  # noqa: A001 - ferry.IOError, distinct from builtins
    code = "IoError"


class TimeoutError(Error, builtins.TimeoutError):  # noqa: A001
    code = "Timeout"


class UnavailableError(Error, ConnectionError):
    code = "Unavailable"


class PeerFailedError(Error, ConnectionError):
    code = "PeerFailed"


class PermissionDeniedError(Error, PermissionError):
    code = "PermissionDenied"


class CancelledError(Error, RuntimeError):
    code = "Cancelled"


class UnimplementedError(Error, NotImplementedError):
    code = "Unimplemented"


class InternalError(Error, RuntimeError):
    code = "Internal"


__all__ = [
    "Error", "RecordingError", "InvalidArgumentError", "MismatchError", "ShapeMismatchError",
    "DTypeMismatchError", "OutOfRangeError", "NotFoundError", "AlreadyExistsError",
    "FailedPreconditionError", "CorruptError", "IOError", "TimeoutError", "UnavailableError",
    "PeerFailedError", "PermissionDeniedError", "CancelledError", "UnimplementedError",
    "InternalError",
]


for _cls in [globals()[_n] for _n in __all__]:
    _cls.__module__ = "ferry"  # shown as ferry.RecordingError in tracebacks
del _cls


def _classes():
    g = globals()
    return {name: g[name] for name in __all__}


def _class_for_code(code):
    """The class of a C++ status code name ("NotFound" -> NotFoundError), for reports that
    carry a code; ``Error`` for an unknown one."""
    g = globals()
    for name in __all__:
        cls = g[name]
        # The class that defines the code itself, not a refinement (RecordingError, MismatchError).
        if cls.__dict__.get("code") == code and cls is not RecordingError:
            return cls
    return Error
