"""The one error type users see. It imports nothing, so the command line can catch it without loading torch."""


class LabkitError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits with status 2."""
