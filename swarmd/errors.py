"""The one exception tree of swarmd.

    SwarmError
    ├── ConfigError                 bad config file, env var or flag
    ├── IdentityError               unreadable or unsafe identity key
    ├── ModelError
    │   ├── ModelNotFoundError      unknown model id / path            -> 404
    │   └── ModelLoadError          weights or tokenizer unusable
    ├── RequestError                the client's fault                 -> 400
    │   ├── InvalidRequestError     a bad parameter (names `param`)
    │   ├── UnsupportedError        a valid OpenAI feature we do not serve
    │   ├── ContextLengthError      prompt (+ max_tokens) over the context
    │   └── PayloadTooLargeError    body over the size limit           -> 413
    ├── AuthError                   missing or wrong bearer token      -> 401
    ├── ClientDisconnectedError     the client went away mid-reply (nobody to answer)
    ├── UnavailableError            cannot serve now (has Retry-After) -> 503
    │   ├── OverloadedError         every session slot busy past the queue timeout
    │   ├── StepTimeoutError        one model step ran past step_timeout_s
    │   └── NoRouteError            layers missing from the swarm
    └── InternalError               a bug or a worker failure          -> 500

Library errors are translated into this tree where they are caught (`raise ... from exc`);
the HTTP API maps the tree to statuses in one table (`swarmd/api/errors.py`).
"""

from __future__ import annotations


class SwarmError(Exception):
    """Base of every error swarmd raises on purpose."""


class ConfigError(SwarmError):
    """A config file, environment variable or flag has a bad value."""


class IdentityError(SwarmError):
    """The node's identity key is missing, unreadable or unsafe."""


class ModelError(SwarmError):
    """A model cannot be found or loaded."""


class ModelNotFoundError(ModelError):
    def __init__(self, model: str, known: list[str] | None = None) -> None:
        self.model = model
        hint = f" (this node serves: {', '.join(known)})" if known else ""
        super().__init__(f"The model '{model}' does not exist{hint}")


class ModelLoadError(ModelError):
    """Weights, config or tokenizer of a model are unusable."""


class RequestError(SwarmError):
    """The request is wrong; the client can fix it."""

    status = 400
    error_type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)


class InvalidRequestError(RequestError):
    code = "invalid_value"


class UnsupportedError(RequestError):
    code = "unsupported_parameter"


class ContextLengthError(RequestError):
    code = "context_length_exceeded"


class PayloadTooLargeError(RequestError):
    status = 413
    code = "payload_too_large"


class AuthError(SwarmError):
    """Missing or wrong API token."""


class ClientDisconnectedError(SwarmError):
    """The client closed the connection before the reply was complete."""


class UnavailableError(SwarmError):
    """The node cannot serve this request now; the client may retry later."""

    def __init__(self, message: str, retry_after_s: int = 5) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(message)


class OverloadedError(UnavailableError):
    """Every session slot stayed busy for longer than the queue timeout."""


class StepTimeoutError(UnavailableError):
    """One model step ran longer than `step_timeout_s`."""


class NoRouteError(UnavailableError):
    """No set of peers covers every layer of the model."""

    def __init__(self, model: str, missing: list[tuple[int, int]], retry_after_s: int = 10) -> None:
        self.model = model
        self.missing = missing
        ranges = ", ".join(f"[{a}:{b})" for a, b in missing)
        super().__init__(
            f"No route for model '{model}': layers {ranges} are not served", retry_after_s
        )


class InternalError(SwarmError):
    """Something broke inside the node (a bug or a failed worker)."""
