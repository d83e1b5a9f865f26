"""One line for an I/O fault, cause first: the OSError found inside whatever a library raised
(Orbax wraps the disk's error in its own and in asyncio's), named by its errno."""

from __future__ import annotations

import errno
import os
import re

# TensorStore (Orbax's array writer) reports a failed system call as a ValueError whose text
# carries the errno: "... No space left on device [os_error_code='28'] ...".
_TENSORSTORE_ERRNO = re.compile(r"\[os_error_code='(\d+)'\]")


def find_os_error(error: BaseException) -> OSError | None:
    """The first OSError in `error`, its causes and contexts, or the exceptions of an exception
    group (depth first), or one made from a TensorStore error's os_error_code; None if there is
    none."""
    seen, stack = set(), [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        code = _TENSORSTORE_ERRNO.search(str(current)) if isinstance(current, ValueError) \
            else None
        if code:
            number = int(code.group(1))
            return OSError(number, os.strerror(number))
        stack.extend(reversed(getattr(current, "exceptions", ()) or ()))
        stack.extend((current.__context__, current.__cause__))
    return error if isinstance(error, OSError) else None


def describe_os_error(error: BaseException) -> str:
    """"No space left on device (ENOSPC)" for the OSError inside `error`; the error's own
    one-line text when it holds none."""
    found = find_os_error(error)
    if found is None or found.errno is None:
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    name = errno.errorcode.get(found.errno, str(found.errno))
    where = f": {found.filename}" if found.filename else ""
    return f"{found.strerror or str(found)} ({name}){where}"


class WriteFailed(OSError):
    """Writing a run's files failed; str() is one line, the cause first."""
