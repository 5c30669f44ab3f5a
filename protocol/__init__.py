"""The messages between HTTP servers and the engine: the one source of truth for the socket."""

from protocol.codec import MAX_FRAME_BYTES, Message, ProtocolError, decode_message
from protocol.messages import (
    PROTOCOL_VERSION,
    AbortRequest,
    EngineStats,
    ErrorCode,
    ErrorReply,
    FinishReason,
    GenerateRequest,
    HandshakeReply,
    HandshakeRequest,
    RequestOutput,
    SamplingParams,
    StatsRequest,
    TokenOutputs,
)

__all__ = [
    "MAX_FRAME_BYTES",
    "PROTOCOL_VERSION",
    "AbortRequest",
    "EngineStats",
    "ErrorCode",
    "ErrorReply",
    "FinishReason",
    "GenerateRequest",
    "HandshakeReply",
    "HandshakeRequest",
    "Message",
    "ProtocolError",
    "RequestOutput",
    "SamplingParams",
    "StatsRequest",
    "TokenOutputs",
    "decode_message",
]
