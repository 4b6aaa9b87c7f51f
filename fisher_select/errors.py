"""One exception type for user-facing errors.

The CLI prints ``FisherSelectError`` as a single line (no traceback) and exits 2 (the input), or 1 for
``ResourceError`` (the machine: no room on disk).
Messages say what is wrong, where, and what to do.
"""


class FisherSelectError(Exception):
    """A problem with the user's input or environment, reported as one clear line."""


class ResourceError(FisherSelectError):
    """The machine, not the input, cannot do it (no room on disk): exit 1, like an OSError."""


class DegenerateResultWarning(UserWarning):
    """A result that is valid but useless as it stands (S = 0: every bound is 0); the CLI's report says it instead."""
