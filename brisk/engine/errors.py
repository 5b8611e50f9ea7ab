"""Engine errors the server must handle without importing torch (the socket opens first)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (an error, or shutdown); open requests are ended with it."""


class RequestFailedError(RuntimeError):
    """One request ended by a failure of its own (its sampling, detokenizing, grammar or tool-call reader
    raised): the engine goes on serving the others. `reason`: internal_error, grammar_rejected or
    grammar_unsatisfiable."""

    def __init__(self, request_id: str, reason: str, message: str, param: str | None = None):
        super().__init__(message)
        self.request_id, self.reason, self.message, self.param = request_id, reason, message, param
