"""One exception type for user-facing errors.

The CLI prints ``FisherSelectError`` as a single line (no traceback) and exits 2.
Messages say what is wrong, where, and what to do.
"""


class FisherSelectError(Exception):
    """A problem with the user's input or environment, reported as one clear line."""
