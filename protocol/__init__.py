"""The messages between HTTP servers and the engine: the one source of truth for the socket."""

from protocol.codec import MAX_FRAME_BYTES, Message, ProtocolError, decode_message
from protocol.limits import context_length_problem
from protocol.messages import (
    MAX_TOP_LOGPROBS,
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
    StructuredOutput,
    StructuredOutputKind,
    TokenLogprobs,
    TokenOutputs,
)

__all__ = [
    "MAX_FRAME_BYTES",
    "MAX_TOP_LOGPROBS",
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
    "StructuredOutput",
    "StructuredOutputKind",
    "TokenLogprobs",
    "TokenOutputs",
    "context_length_problem",
    "decode_message",
]
