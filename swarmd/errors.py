"""The one exception tree of swarmd.

    SwarmError
    ├── ConfigError                 bad config file, env var or flag
    ├── IdentityError               unreadable or unsafe identity key
    ├── ModelError
    │   ├── ModelNotFoundError      unknown model id / path            -> 404
    │   ├── ModelLoadError          weights or tokenizer unusable
    │   │   ├── ManifestError       a manifest that is invalid, or not the content id asked for
    │   │   └── ShardHashError      a file whose SHA-256 is not the manifest's (both named)
    │   └── FetchError              no holder could supply a file of the model
    ├── RequestError                the client's fault                 -> 400
    │   ├── InvalidRequestError     a bad parameter (names `param`)
    │   ├── UnsupportedError        a valid OpenAI feature we do not serve
    │   ├── ContextLengthError      prompt (+ max_tokens) over the context
    │   │   └── KVRoomError         more than the route's KV budget     -> 413
    │   └── PayloadTooLargeError    body over the size limit           -> 413
    ├── AuthError                   missing or wrong bearer token      -> 401
    ├── ClientDisconnectedError     the client went away mid-reply (nobody to answer)
    ├── UnavailableError            cannot serve now (has Retry-After) -> 503
    │   ├── OverloadedError         every session slot busy past the queue timeout
    │   ├── StepTimeoutError        one model step ran past step_timeout_s
    │   ├── NoRouteError            layers missing from the swarm
    │   ├── CommonFilesError        a coordinated model's files not taken from its holders
    │   └── RouteFailedError        stages kept failing past the failover limit
    ├── RecordError                 a DHT record refused (dropped, never served)
    │   ├── RecordTooLargeError     value over the size limit, refused unread
    │   ├── MalformedRecordError    not msgpack, wrong fields, types or ranges
    │   ├── BadSignatureError       not signed by the key of its peer id
    │   ├── ExpiredRecordError      expires_at already past
    │   └── WrongOwnerError         another peer's (or model's) record
    ├── PeerError                   a peer or the link to it failed (names `peer_id`)
    │   ├── DialError               cannot connect, or open a stream on a protocol
    │   │   └── DialTimeoutError    connect_timeout_s / open_stream_timeout_s passed
    │   ├── StreamClosedError       closed or reset by the peer, or cut mid-frame
    │   ├── FrameError              bytes that are not a valid frame (stream is reset)
    │   │   ├── FrameTooLargeError  declared length over the frame limit, refused unread
    │   │   ├── FrameBufferError    more bytes buffered than the cap
    │   │   └── MalformedFrameError not a msgpack map within the limits
    │   │       └── FrameBudgetError more items or deeper nesting than a frame may hold
    │   ├── SendTimeoutError        the peer stopped reading (send_timeout_s)
    │   ├── RecvTimeoutError        no whole frame within the read timeout
    │   ├── RpcTimeoutError         a remote call ran past its timeout (peer, method)
    │   ├── RemoteError             the peer's handler failed (peer, method, type, message)
    │   ├── StageRefusedError       a stage will not open a session it cannot serve
    │   │   └── RequestRefusedError because of what the request asked (status, param)
    │   └── StageFailedError        a stage of a route failed (peer, kind: lost|bad|declined|busy)
    │       └── UnconfirmedReportError  a report naming a peer that answered our check
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
    def __init__(self, model: str, known: list[str] | None = None, hint: str = "") -> None:
        self.model = model
        serves = f" (this node serves: {', '.join(known)})" if known else ""
        super().__init__(f"The model '{model}' does not exist{serves}{hint}")


class ModelLoadError(ModelError):
    """Weights, config or tokenizer of a model are unusable."""


class ManifestError(ModelLoadError):
    """A manifest that cannot be read, breaks a rule, or has another content id."""


class ShardHashError(ModelLoadError):
    def __init__(self, path: str, expected: str, actual: str) -> None:
        self.path = path
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"{path} does not match its manifest: expected SHA-256 {expected}, got {actual}"
        )


class FetchError(ModelError):
    """No holder in the swarm could supply a file (or the manifest) of a model."""


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


class KVRoomError(ContextLengthError):
    """A conversation larger than every route's KV budget: it would never be admitted."""

    status = 413


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


class QueueFullError(UnavailableError):
    """`max_queued_requests` requests wait already: this one is not queued."""

    code = "queue_full"

    def __init__(self, waiting: int) -> None:
        super().__init__(
            f"{waiting} requests are already waiting for this node; try again shortly",
            retry_after_s=2,
        )


class StepTimeoutError(UnavailableError):
    """One model step ran longer than `step_timeout_s`."""


class CommonFilesError(UnavailableError):
    """The common files (manifest, tokenizer, templates) of a model this node holds no
    layers of could not be taken from its holders, or did not load."""


class NoRouteError(UnavailableError):
    """No set of peers covers every layer of the model."""

    def __init__(
        self,
        model: str,
        missing: list[tuple[int, int]],
        retry_after_s: int = 10,
        avoided: int = 0,
    ) -> None:
        """`avoided`: holders of the missing layers this node may not use now (banned,
        sitting out after a loss and not answering, or left out of this request), which
        the message names: they are served, only not for this node."""
        self.model = model
        self.missing = missing
        ranges = ", ".join(f"[{a}:{b})" for a, b in missing)
        why = f"No route for model '{model}': layers {ranges} are not served"
        if avoided:
            why += (
                f" by a peer this node may use now ({avoided} holder(s) banned here, lost"
                " and not answering, or left out of this request; see `swarmd peers`)"
            )
        super().__init__(why, retry_after_s)


class RouteBusyError(UnavailableError):
    """Every holder of some layers stayed without room for a request until its queue
    deadline (they hold the layers, but no session slot or KV room was free)."""

    def __init__(self, model: str, missing: list[tuple[int, int]], need: int, waited_s: float):
        self.model = model
        self.missing = missing
        ranges = ", ".join(f"[{a}:{b})" for a, b in missing)
        which = f"Every holder of layers {ranges}" if ranges else "A stage"
        super().__init__(
            f"{which} of model '{model}' stayed busy for {waited_s:.0f} s "
            f"(no session slot or KV room for {need:,} tokens)",
            retry_after_s=10,
        )


class RouteFailedError(UnavailableError):
    """A distributed route failed more often than the failover limit allows."""


class InternalError(SwarmError):
    """Something broke inside the node (a bug or a failed worker)."""

    code = "internal_error"  # as a 500 from an exception of no known kind


class RecordError(SwarmError):
    """A DHT record failed validation; `reason` names the check for counters."""

    reason = "invalid"


class RecordTooLargeError(RecordError):
    reason = "too_large"


class MalformedRecordError(RecordError):
    reason = "malformed"


class BadSignatureError(RecordError):
    reason = "bad_signature"


class ExpiredRecordError(RecordError):
    reason = "expired"


class WrongOwnerError(RecordError):
    """A valid record, but not of the peer (or model) it was expected to be."""

    reason = "wrong_owner"


class PeerError(SwarmError):
    """A peer, or the link to it, failed; `peer_id` names the peer when known."""

    def __init__(self, message: str, peer_id: str | None = None) -> None:
        self.peer_id = peer_id
        super().__init__(message)


class DialError(PeerError):
    """Cannot connect to a peer, or open a stream to it on a protocol."""

    code = "dial_failed"


class DialTimeoutError(DialError):
    """Connecting, or opening a stream, ran past its timeout."""


class StreamClosedError(PeerError):
    """The stream ended: closed or reset by the peer, or cut in the middle of a frame."""

    def __init__(self, message: str, peer_id: str | None = None, truncated: bool = False) -> None:
        self.truncated = truncated
        super().__init__(message, peer_id)


class FrameError(PeerError):
    """Bytes that are not a valid frame; the stream they came on is reset."""


class FrameTooLargeError(FrameError):
    """A frame longer than the limit (refused from its header, before its body is read)."""


class FrameBufferError(FrameError):
    """More bytes were handed to a frame decoder than it may hold."""


class MalformedFrameError(FrameError):
    """A frame body that is not a msgpack map within the size limits."""


class SendTimeoutError(PeerError):
    """A frame could not be written within the send timeout (the peer stopped reading)."""


class RecvTimeoutError(PeerError):
    """No whole frame arrived within the read timeout."""


class RpcTimeoutError(PeerError):
    """A remote call got no reply within its timeout."""

    def __init__(self, peer_id: str, method: str, timeout_s: float) -> None:
        self.method = method
        self.timeout_s = timeout_s
        super().__init__(
            f"Remote call '{method}' to peer {peer_id[-8:]} got no reply in {timeout_s:g} s",
            peer_id,
        )


class RemoteError(PeerError):
    """The peer's handler failed; `remote_type` and `remote_message` are what it said."""

    def __init__(self, peer_id: str, method: str, remote_type: str, remote_message: str) -> None:
        self.method = method
        self.remote_type = remote_type
        self.remote_message = remote_message
        super().__init__(
            f"Remote call '{method}' failed on peer {peer_id[-8:]}: "
            f"{remote_type}: {remote_message}",
            peer_id,
        )


class StageRefusedError(PeerError):
    """This node will not serve a stage session (wrong model or layers, no free slot)."""


class StageFailedError(PeerError):
    """A stage of a distributed route failed; `peer_id` names the culprit when known.

    kind: "lost" (connection gone or silent), "bad" (sent garbage: banned), "declined"
    (would not open the session here: left out of this request only), "busy" (no room
    for it now: another holder takes it, or the request waits for room).
    """

    def __init__(self, message: str, peer_id: str | None, kind: str) -> None:
        super().__init__(message, peer_id)
        self.kind = kind


class FrameBudgetError(MalformedFrameError):
    """A frame body with more msgpack items, or deeper nesting, than a frame may hold."""


class RequestRefusedError(StageRefusedError):
    """A stage will not serve what the request asked (a sampling value out of bounds, a
    session longer than it holds): the request fails with `status` (400 or 413) naming
    `param`; nobody is banned and nothing fails over."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class UnconfirmedReportError(StageFailedError):
    """A stage's report named another peer, and that peer answered this node's own check:
    it is avoided for this request only. When the check `disproved` the report (a peer
    said lost answers a ping; a peer not on the route sent nothing), the `reporter` (the
    peer that handed it over) is charged with a false report."""

    def __init__(
        self, message: str, peer_id: str | None, kind: str, reporter: str, disproved: bool
    ) -> None:
        super().__init__(message, peer_id, kind)
        self.reporter = reporter
        self.disproved = disproved
