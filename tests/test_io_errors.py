"""jrl.io_errors: the OSError inside a library's error, named by its errno, in one line."""

import errno

from jrl.io_errors import describe_os_error, find_os_error


class Group(Exception):
    """An exception group's shape (ExceptionGroup needs Python 3.11)."""

    def __init__(self, exceptions):
        super().__init__("tasks")
        self.exceptions = exceptions


def test_the_disk_error_is_found_through_causes_contexts_and_groups():
    disk = OSError(errno.ENOSPC, "No space left on device", "/data/x")
    try:
        try:
            raise disk
        except OSError:
            raise ValueError("wrapper")   # context
    except ValueError as wrapped:
        group = Group([RuntimeError("other"), wrapped])
    assert find_os_error(group) is disk
    assert describe_os_error(group) == "No space left on device (ENOSPC): /data/x"


def test_an_error_without_an_os_error_is_its_first_line():
    assert find_os_error(ValueError("x")) is None
    assert describe_os_error(ValueError("first\nsecond")) == "ValueError: first"
    assert describe_os_error(PermissionError(errno.EACCES, "Permission denied")) == \
        "Permission denied (EACCES)"
