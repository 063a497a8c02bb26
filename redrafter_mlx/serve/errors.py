"""The server's refusals: ``ProtocolError`` (an HTTP status and an OpenAI-style error body
naming the bad parameter)."""

from __future__ import annotations

from redrafter_mlx.engine.base.errors import RedrafterError


class ProtocolError(RedrafterError):
    """A request the server refuses; ``status`` and ``body()`` are the HTTP answer."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (
            message,
            param,
            status,
            type,
            code,
        )

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None):
    """``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
