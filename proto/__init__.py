"""looprl wire protocol: typed records, codec (msgpack + zstd framing), stream files."""

from proto.codec import Codec, DecodedFrame
from proto.errors import ProtocolError
from proto.records import (
    ALL_RECORDS,
    Ack,
    ErrorMsg,
    Goodbye,
    Heartbeat,
    Hello,
    Nack,
    Rollout,
    RolloutBatch,
    TensorMeta,
    WeightAnnounce,
    WeightChunk,
    Welcome,
    WorkItem,
    WorkReturn,
)
from proto.version import PROTOCOL_VERSION, check_compatible

__all__ = [
    "ALL_RECORDS",
    "PROTOCOL_VERSION",
    "Ack",
    "Codec",
    "DecodedFrame",
    "ErrorMsg",
    "Goodbye",
    "Heartbeat",
    "Hello",
    "Nack",
    "ProtocolError",
    "Rollout",
    "RolloutBatch",
    "TensorMeta",
    "WeightAnnounce",
    "WeightChunk",
    "Welcome",
    "WorkItem",
    "WorkReturn",
    "check_compatible",
]
