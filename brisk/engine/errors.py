"""Engine errors the server must handle without importing torch (the socket opens first)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an error, or shutdown); open requests are ended with it."""
