from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT8: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "scales")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    scales: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., scales: _Optional[bytes] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("request_id", "activations", "position", "path_length", "token_mask", "reply_dtype", "frozen")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    PATH_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASK_FIELD_NUMBER: _ClassVar[int]
    REPLY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    FROZEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    activations: Tensor
    position: int
    path_length: int
    token_mask: Tensor
    reply_dtype: DType
    frozen: Tensor
    def __init__(self, request_id: _Optional[str] = ..., activations: _Optional[_Union[Tensor, _Mapping]] = ..., position: _Optional[int] = ..., path_length: _Optional[int] = ..., token_mask: _Optional[_Union[Tensor, _Mapping]] = ..., reply_dtype: _Optional[_Union[DType, str]] = ..., frozen: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("request_id", "activations", "compute_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    activations: Tensor
    compute_ms: float
    def __init__(self, request_id: _Optional[str] = ..., activations: _Optional[_Union[Tensor, _Mapping]] = ..., compute_ms: _Optional[float] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("in_flight", "max_in_flight", "ewma_latency_ms", "served")
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    EWMA_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    in_flight: int
    max_in_flight: int
    ewma_latency_ms: float
    served: int
    def __init__(self, in_flight: _Optional[int] = ..., max_in_flight: _Optional[int] = ..., ewma_latency_ms: _Optional[float] = ..., served: _Optional[int] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("family_id", "model_id", "block_index", "variant", "weights_sha256", "device", "compute_dtype", "software_version", "protocol_version", "boot_id", "load", "depth", "tokens", "dim", "max_batch", "shuffle_robust", "links", "trace_key", "stream_limits")
    FAMILY_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    VARIANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_ROBUST_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    TRACE_KEY_FIELD_NUMBER: _ClassVar[int]
    STREAM_LIMITS_FIELD_NUMBER: _ClassVar[int]
    family_id: str
    model_id: str
    block_index: int
    variant: str
    weights_sha256: str
    device: str
    compute_dtype: DType
    software_version: str
    protocol_version: int
    boot_id: str
    load: Load
    depth: int
    tokens: int
    dim: int
    max_batch: int
    shuffle_robust: bool
    links: _containers.RepeatedCompositeFieldContainer[LinkStat]
    trace_key: bytes
    stream_limits: StreamLimits
    def __init__(self, family_id: _Optional[str] = ..., model_id: _Optional[str] = ..., block_index: _Optional[int] = ..., variant: _Optional[str] = ..., weights_sha256: _Optional[str] = ..., device: _Optional[str] = ..., compute_dtype: _Optional[_Union[DType, str]] = ..., software_version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., boot_id: _Optional[str] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., depth: _Optional[int] = ..., tokens: _Optional[int] = ..., dim: _Optional[int] = ..., max_batch: _Optional[int] = ..., shuffle_robust: _Optional[bool] = ..., links: _Optional[_Iterable[_Union[LinkStat, _Mapping]]] = ..., trace_key: _Optional[bytes] = ..., stream_limits: _Optional[_Union[StreamLimits, _Mapping]] = ...) -> None: ...

class StreamLimits(_message.Message):
    __slots__ = ("max_streams", "max_seq_len", "max_cache_bytes", "idle_timeout_s")
    MAX_STREAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    max_streams: int
    max_seq_len: int
    max_cache_bytes: int
    idle_timeout_s: float
    def __init__(self, max_streams: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., max_cache_bytes: _Optional[int] = ..., idle_timeout_s: _Optional[float] = ...) -> None: ...

class LinkStat(_message.Message):
    __slots__ = ("peer", "ewma_send_ms", "ewma_mbps", "samples", "rtt_ms")
    PEER_FIELD_NUMBER: _ClassVar[int]
    EWMA_SEND_MS_FIELD_NUMBER: _ClassVar[int]
    EWMA_MBPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    peer: str
    ewma_send_ms: float
    ewma_mbps: float
    samples: int
    rtt_ms: float
    def __init__(self, peer: _Optional[str] = ..., ewma_send_ms: _Optional[float] = ..., ewma_mbps: _Optional[float] = ..., samples: _Optional[int] = ..., rtt_ms: _Optional[float] = ...) -> None: ...

class RelayStep(_message.Message):
    __slots__ = ("address", "position", "block", "trace_key")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    TRACE_KEY_FIELD_NUMBER: _ClassVar[int]
    address: str
    position: int
    block: int
    trace_key: bytes
    def __init__(self, address: _Optional[str] = ..., position: _Optional[int] = ..., block: _Optional[int] = ..., trace_key: _Optional[bytes] = ...) -> None: ...

class RelayRequest(_message.Message):
    __slots__ = ("forward", "chain", "index", "plan_mac", "issued_ms", "hop_timeout_s", "deadline_s", "collect")
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PLAN_MAC_FIELD_NUMBER: _ClassVar[int]
    ISSUED_MS_FIELD_NUMBER: _ClassVar[int]
    HOP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    COLLECT_FIELD_NUMBER: _ClassVar[int]
    forward: ForwardRequest
    chain: _containers.RepeatedCompositeFieldContainer[RelayStep]
    index: int
    plan_mac: str
    issued_ms: int
    hop_timeout_s: float
    deadline_s: float
    collect: bool
    def __init__(self, forward: _Optional[_Union[ForwardRequest, _Mapping]] = ..., chain: _Optional[_Iterable[_Union[RelayStep, _Mapping]]] = ..., index: _Optional[int] = ..., plan_mac: _Optional[str] = ..., issued_ms: _Optional[int] = ..., hop_timeout_s: _Optional[float] = ..., deadline_s: _Optional[float] = ..., collect: _Optional[bool] = ...) -> None: ...

class HopTrace(_message.Message):
    __slots__ = ("node", "block", "position", "compute_ms", "send_ms", "sent_bytes", "input_sha256", "output_sha256", "rtt_ms", "signature", "rest_sha256", "given_deadline_s", "given_hop_timeout_s")
    NODE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    SEND_MS_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    INPUT_SHA256_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHA256_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    REST_SHA256_FIELD_NUMBER: _ClassVar[int]
    GIVEN_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    GIVEN_HOP_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    node: str
    block: int
    position: int
    compute_ms: float
    send_ms: float
    sent_bytes: int
    input_sha256: str
    output_sha256: str
    rtt_ms: float
    signature: bytes
    rest_sha256: str
    given_deadline_s: float
    given_hop_timeout_s: float
    def __init__(self, node: _Optional[str] = ..., block: _Optional[int] = ..., position: _Optional[int] = ..., compute_ms: _Optional[float] = ..., send_ms: _Optional[float] = ..., sent_bytes: _Optional[int] = ..., input_sha256: _Optional[str] = ..., output_sha256: _Optional[str] = ..., rtt_ms: _Optional[float] = ..., signature: _Optional[bytes] = ..., rest_sha256: _Optional[str] = ..., given_deadline_s: _Optional[float] = ..., given_hop_timeout_s: _Optional[float] = ...) -> None: ...

class RelayEvent(_message.Message):
    __slots__ = ("request_id", "ack", "trace", "activations", "handback_reason", "refused")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    HANDBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ack: bool
    trace: _containers.RepeatedCompositeFieldContainer[HopTrace]
    activations: Tensor
    handback_reason: str
    refused: str
    def __init__(self, request_id: _Optional[str] = ..., ack: _Optional[bool] = ..., trace: _Optional[_Iterable[_Union[HopTrace, _Mapping]]] = ..., activations: _Optional[_Union[Tensor, _Mapping]] = ..., handback_reason: _Optional[str] = ..., refused: _Optional[str] = ...) -> None: ...

class CollectRequest(_message.Message):
    __slots__ = ("request_id", "output_sha256")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHA256_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    output_sha256: str
    def __init__(self, request_id: _Optional[str] = ..., output_sha256: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("stream_id", "start", "activations", "reply_dtype", "request_id", "fill", "release", "kv_only")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    REPLY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FILL_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    KV_ONLY_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    start: int
    activations: Tensor
    reply_dtype: DType
    request_id: str
    fill: Tensor
    release: bool
    kv_only: bool
    def __init__(self, stream_id: _Optional[str] = ..., start: _Optional[int] = ..., activations: _Optional[_Union[Tensor, _Mapping]] = ..., reply_dtype: _Optional[_Union[DType, str]] = ..., request_id: _Optional[str] = ..., fill: _Optional[_Union[Tensor, _Mapping]] = ..., release: _Optional[bool] = ..., kv_only: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("stream_id", "activations", "compute_ms", "length", "batched", "refused", "error")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    BATCHED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    activations: Tensor
    compute_ms: float
    length: int
    batched: int
    refused: str
    error: str
    def __init__(self, stream_id: _Optional[str] = ..., activations: _Optional[_Union[Tensor, _Mapping]] = ..., compute_ms: _Optional[float] = ..., length: _Optional[int] = ..., batched: _Optional[int] = ..., refused: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class DecodeBatch(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[DecodeRequest]
    def __init__(self, steps: _Optional[_Iterable[_Union[DecodeRequest, _Mapping]]] = ...) -> None: ...

class DecodeBatchReply(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[DecodeResponse]
    def __init__(self, replies: _Optional[_Iterable[_Union[DecodeResponse, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("stream_ids",)
    STREAM_IDS_FIELD_NUMBER: _ClassVar[int]
    stream_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stream_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...
