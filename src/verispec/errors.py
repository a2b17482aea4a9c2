"""One exception type for every mistake a user can make, so the CLI can print it without a traceback."""


class VerispecError(Exception):
    """A user-facing error: bad input, a missing file, an unsupported combination."""
