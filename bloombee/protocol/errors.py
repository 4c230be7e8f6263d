"""The error a peer's bad input raises once validated: the server answers it as INVALID, never as its own failure."""


class InvalidStep(ValueError):
    """A message or step does not fit the protocol or its session (kind, shape, dtype, positions); the message says
    what to fix."""
