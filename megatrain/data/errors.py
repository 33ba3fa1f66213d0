"""The error every data problem is reported as."""


class DataError(ValueError):
    """Unusable training data; the message names the file (and row) and the problem."""
