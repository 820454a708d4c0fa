from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_PUSH: _ClassVar[Mode]
    MODE_PULL: _ClassVar[Mode]

class KvLayoutOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_LAYOUT_ORDER_UNSPECIFIED: _ClassVar[KvLayoutOrder]
    KV_LAYOUT_ORDER_HND: _ClassVar[KvLayoutOrder]
    KV_LAYOUT_ORDER_NHD: _ClassVar[KvLayoutOrder]

class KvPacking(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_PACKING_UNSPECIFIED: _ClassVar[KvPacking]
    KV_PACKING_PACKED: _ClassVar[KvPacking]
    KV_PACKING_SPLIT: _ClassVar[KvPacking]
    KV_PACKING_SEPARATE: _ClassVar[KvPacking]

class CacheKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CACHE_KIND_UNSPECIFIED: _ClassVar[CacheKind]
    CACHE_KIND_FULL_ATTENTION: _ClassVar[CacheKind]
    CACHE_KIND_SLIDING_WINDOW: _ClassVar[CacheKind]
    CACHE_KIND_MLA: _ClassVar[CacheKind]
    CACHE_KIND_MAMBA: _ClassVar[CacheKind]

class InProcessMemory(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IN_PROCESS_MEMORY_UNSPECIFIED: _ClassVar[InProcessMemory]
    IN_PROCESS_MEMORY_HOST: _ClassVar[InProcessMemory]
    IN_PROCESS_MEMORY_DEVICE: _ClassVar[InProcessMemory]

class FailureKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_KIND_UNSPECIFIED: _ClassVar[FailureKind]
    FAILURE_KIND_HANDSHAKE: _ClassVar[FailureKind]
    FAILURE_KIND_INCOMPATIBLE: _ClassVar[FailureKind]
    FAILURE_KIND_REGISTRATION: _ClassVar[FailureKind]
    FAILURE_KIND_SETUP: _ClassVar[FailureKind]
    FAILURE_KIND_TRANSFER: _ClassVar[FailureKind]
    FAILURE_KIND_NOTIFICATION: _ClassVar[FailureKind]
    FAILURE_KIND_EXPIRED: _ClassVar[FailureKind]
    FAILURE_KIND_PEER_GONE: _ClassVar[FailureKind]
    FAILURE_KIND_PEER: _ClassVar[FailureKind]
    FAILURE_KIND_CANCELLED: _ClassVar[FailureKind]
    FAILURE_KIND_CLOSED: _ClassVar[FailureKind]

class FinishStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_STATUS_UNSPECIFIED: _ClassVar[FinishStatus]
    FINISH_STATUS_STOPPED: _ClassVar[FinishStatus]
    FINISH_STATUS_LENGTH_CAPPED: _ClassVar[FinishStatus]
    FINISH_STATUS_ABORTED: _ClassVar[FinishStatus]
    FINISH_STATUS_ERROR: _ClassVar[FinishStatus]
    FINISH_STATUS_PREEMPTED: _ClassVar[FinishStatus]
MODE_UNSPECIFIED: Mode
MODE_PUSH: Mode
MODE_PULL: Mode
KV_LAYOUT_ORDER_UNSPECIFIED: KvLayoutOrder
KV_LAYOUT_ORDER_HND: KvLayoutOrder
KV_LAYOUT_ORDER_NHD: KvLayoutOrder
KV_PACKING_UNSPECIFIED: KvPacking
KV_PACKING_PACKED: KvPacking
KV_PACKING_SPLIT: KvPacking
KV_PACKING_SEPARATE: KvPacking
CACHE_KIND_UNSPECIFIED: CacheKind
CACHE_KIND_FULL_ATTENTION: CacheKind
CACHE_KIND_SLIDING_WINDOW: CacheKind
CACHE_KIND_MLA: CacheKind
CACHE_KIND_MAMBA: CacheKind
IN_PROCESS_MEMORY_UNSPECIFIED: InProcessMemory
IN_PROCESS_MEMORY_HOST: InProcessMemory
IN_PROCESS_MEMORY_DEVICE: InProcessMemory
FAILURE_KIND_UNSPECIFIED: FailureKind
FAILURE_KIND_HANDSHAKE: FailureKind
FAILURE_KIND_INCOMPATIBLE: FailureKind
FAILURE_KIND_REGISTRATION: FailureKind
FAILURE_KIND_SETUP: FailureKind
FAILURE_KIND_TRANSFER: FailureKind
FAILURE_KIND_NOTIFICATION: FailureKind
FAILURE_KIND_EXPIRED: FailureKind
FAILURE_KIND_PEER_GONE: FailureKind
FAILURE_KIND_PEER: FailureKind
FAILURE_KIND_CANCELLED: FailureKind
FAILURE_KIND_CLOSED: FailureKind
FINISH_STATUS_UNSPECIFIED: FinishStatus
FINISH_STATUS_STOPPED: FinishStatus
FINISH_STATUS_LENGTH_CAPPED: FinishStatus
FINISH_STATUS_ABORTED: FinishStatus
FINISH_STATUS_ERROR: FinishStatus
FINISH_STATUS_PREEMPTED: FinishStatus

class Region(_message.Message):
    __slots__ = ("kind", "window", "base", "block_len", "num_blocks", "device_id", "conv_bytes", "ssm_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    CONV_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSM_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: CacheKind
    window: int
    base: int
    block_len: int
    num_blocks: int
    device_id: int
    conv_bytes: _containers.RepeatedScalarFieldContainer[int]
    ssm_bytes: int
    def __init__(self, kind: _Optional[_Union[CacheKind, str]] = ..., window: _Optional[int] = ..., base: _Optional[int] = ..., block_len: _Optional[int] = ..., num_blocks: _Optional[int] = ..., device_id: _Optional[int] = ..., conv_bytes: _Optional[_Iterable[int]] = ..., ssm_bytes: _Optional[int] = ...) -> None: ...

class CacheGroup(_message.Message):
    __slots__ = ("kind", "window", "regions")
    KIND_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    kind: CacheKind
    window: int
    regions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[CacheKind, str]] = ..., window: _Optional[int] = ..., regions: _Optional[_Iterable[int]] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("tp_rank", "tp_size", "pp_rank", "pp_size", "total_kv_heads", "head_size", "elem_bytes", "order", "packing", "logical_block_size", "kernel_block_size", "region_offset", "regions", "groups")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ELEM_BYTES_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    PACKING_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    REGION_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    total_kv_heads: int
    head_size: int
    elem_bytes: int
    order: KvLayoutOrder
    packing: KvPacking
    logical_block_size: int
    kernel_block_size: int
    region_offset: int
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    groups: _containers.RepeatedCompositeFieldContainer[CacheGroup]
    def __init__(self, tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ..., total_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., elem_bytes: _Optional[int] = ..., order: _Optional[_Union[KvLayoutOrder, str]] = ..., packing: _Optional[_Union[KvPacking, str]] = ..., logical_block_size: _Optional[int] = ..., kernel_block_size: _Optional[int] = ..., region_offset: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[CacheGroup, _Mapping]]] = ...) -> None: ...

class SharedMemory(_message.Message):
    __slots__ = ("path", "base", "size", "cuda_ipc_handle", "device", "device_uuid", "in_process")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    IN_PROCESS_FIELD_NUMBER: _ClassVar[int]
    path: str
    base: int
    size: int
    cuda_ipc_handle: bytes
    device: int
    device_uuid: str
    in_process: InProcessMemory
    def __init__(self, path: _Optional[str] = ..., base: _Optional[int] = ..., size: _Optional[int] = ..., cuda_ipc_handle: _Optional[bytes] = ..., device: _Optional[int] = ..., device_uuid: _Optional[str] = ..., in_process: _Optional[_Union[InProcessMemory, str]] = ...) -> None: ...

class Span(_message.Message):
    __slots__ = ("start", "block_ids")
    START_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    start: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, start: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RemoteRef(_message.Message):
    __slots__ = ("engine_id", "addr", "request_id", "tp_size", "pp_size", "blocks", "tokens", "expiry_unix_nanos", "generation")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPIRY_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    addr: str
    request_id: str
    tp_size: int
    pp_size: int
    blocks: _containers.RepeatedCompositeFieldContainer[Span]
    tokens: int
    expiry_unix_nanos: int
    generation: int
    def __init__(self, engine_id: _Optional[str] = ..., addr: _Optional[str] = ..., request_id: _Optional[str] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[Span, _Mapping]]] = ..., tokens: _Optional[int] = ..., expiry_unix_nanos: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class RecvRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "local", "remote", "aborted", "deadline_unix_nanos", "tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    local: _containers.RepeatedCompositeFieldContainer[Span]
    remote: RemoteRef
    aborted: bool
    deadline_unix_nanos: int
    tokens: int
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., local: _Optional[_Iterable[_Union[Span, _Mapping]]] = ..., remote: _Optional[_Union[RemoteRef, _Mapping]] = ..., aborted: _Optional[bool] = ..., deadline_unix_nanos: _Optional[int] = ..., tokens: _Optional[int] = ...) -> None: ...

class SendRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "deadline_unix_nanos", "blocks", "tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    deadline_unix_nanos: int
    blocks: _containers.RepeatedCompositeFieldContainer[Span]
    tokens: int
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., deadline_unix_nanos: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[Span, _Mapping]]] = ..., tokens: _Optional[int] = ...) -> None: ...

class StepMeta(_message.Message):
    __slots__ = ("step", "scheduler_clock_unix_nanos", "recv", "send", "prefill", "not_processed", "not_processed_transfer_ids", "preempted", "await_end")
    class NotProcessedTransferIdsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_CLOCK_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    RECV_FIELD_NUMBER: _ClassVar[int]
    SEND_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    NOT_PROCESSED_FIELD_NUMBER: _ClassVar[int]
    NOT_PROCESSED_TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    AWAIT_FIELD_NUMBER: _ClassVar[int]
    AWAIT_END_FIELD_NUMBER: _ClassVar[int]
    step: int
    scheduler_clock_unix_nanos: int
    recv: _containers.RepeatedCompositeFieldContainer[RecvRequest]
    send: _containers.RepeatedCompositeFieldContainer[SendRequest]
    prefill: _containers.RepeatedCompositeFieldContainer[SendRequest]
    not_processed: _containers.RepeatedScalarFieldContainer[str]
    not_processed_transfer_ids: _containers.ScalarMap[str, str]
    preempted: _containers.RepeatedScalarFieldContainer[str]
    await_end: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., scheduler_clock_unix_nanos: _Optional[int] = ..., recv: _Optional[_Iterable[_Union[RecvRequest, _Mapping]]] = ..., send: _Optional[_Iterable[_Union[SendRequest, _Mapping]]] = ..., prefill: _Optional[_Iterable[_Union[SendRequest, _Mapping]]] = ..., not_processed: _Optional[_Iterable[str]] = ..., not_processed_transfer_ids: _Optional[_Mapping[str, str]] = ..., preempted: _Optional[_Iterable[str]] = ..., await_end: _Optional[_Iterable[str]] = ..., **kwargs) -> None: ...

class Outcome(_message.Message):
    __slots__ = ("request_id", "result", "reason", "failure_kind")
    class Result(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RESULT_UNSPECIFIED: _ClassVar[Outcome.Result]
        RESULT_DONE: _ClassVar[Outcome.Result]
        RESULT_FAILED: _ClassVar[Outcome.Result]
        RESULT_EXPIRED: _ClassVar[Outcome.Result]
        RESULT_ABORTED: _ClassVar[Outcome.Result]
    RESULT_UNSPECIFIED: Outcome.Result
    RESULT_DONE: Outcome.Result
    RESULT_FAILED: Outcome.Result
    RESULT_EXPIRED: Outcome.Result
    RESULT_ABORTED: Outcome.Result
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FAILURE_KIND_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    result: Outcome.Result
    reason: str
    failure_kind: FailureKind
    def __init__(self, request_id: _Optional[str] = ..., result: _Optional[_Union[Outcome.Result, str]] = ..., reason: _Optional[str] = ..., failure_kind: _Optional[_Union[FailureKind, str]] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("sending", "recving", "invalid_block_ids", "stats")
    SENDING_FIELD_NUMBER: _ClassVar[int]
    RECVING_FIELD_NUMBER: _ClassVar[int]
    INVALID_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    sending: _containers.RepeatedCompositeFieldContainer[Outcome]
    recving: _containers.RepeatedCompositeFieldContainer[Outcome]
    invalid_block_ids: _containers.RepeatedScalarFieldContainer[int]
    stats: TransferStats
    def __init__(self, sending: _Optional[_Iterable[_Union[Outcome, _Mapping]]] = ..., recving: _Optional[_Iterable[_Union[Outcome, _Mapping]]] = ..., invalid_block_ids: _Optional[_Iterable[int]] = ..., stats: _Optional[_Union[TransferStats, _Mapping]] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("transfers", "failed_transfers", "bytes", "descriptors", "transfer_seconds", "expired")
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    FAILED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    transfers: int
    failed_transfers: int
    bytes: int
    descriptors: int
    transfer_seconds: float
    expired: int
    def __init__(self, transfers: _Optional[int] = ..., failed_transfers: _Optional[int] = ..., bytes: _Optional[int] = ..., descriptors: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., expired: _Optional[int] = ...) -> None: ...

class WorkerHello(_message.Message):
    __slots__ = ("engine_id", "mode", "layout", "memory", "compat_hash", "layerwise", "max_message_bytes", "first_layer")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYERWISE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    mode: Mode
    layout: KvLayout
    memory: _containers.RepeatedCompositeFieldContainer[SharedMemory]
    compat_hash: str
    layerwise: bool
    max_message_bytes: int
    first_layer: int
    def __init__(self, engine_id: _Optional[str] = ..., mode: _Optional[_Union[Mode, str]] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., memory: _Optional[_Iterable[_Union[SharedMemory, _Mapping]]] = ..., compat_hash: _Optional[str] = ..., layerwise: _Optional[bool] = ..., max_message_bytes: _Optional[int] = ..., first_layer: _Optional[int] = ...) -> None: ...

class LayerSaved(_message.Message):
    __slots__ = ("step", "layer")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    step: int
    layer: int
    def __init__(self, step: _Optional[int] = ..., layer: _Optional[int] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("hello", "step", "layer_saved", "bye", "step_ref")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYER_SAVED_FIELD_NUMBER: _ClassVar[int]
    BYE_FIELD_NUMBER: _ClassVar[int]
    STEP_REF_FIELD_NUMBER: _ClassVar[int]
    hello: WorkerHello
    step: StepMeta
    layer_saved: LayerSaved
    bye: Bye
    step_ref: StepRef
    def __init__(self, hello: _Optional[_Union[WorkerHello, _Mapping]] = ..., step: _Optional[_Union[StepMeta, _Mapping]] = ..., layer_saved: _Optional[_Union[LayerSaved, _Mapping]] = ..., bye: _Optional[_Union[Bye, _Mapping]] = ..., step_ref: _Optional[_Union[StepRef, _Mapping]] = ...) -> None: ...

class StepRef(_message.Message):
    __slots__ = ("step", "recv_request_ids", "send_request_ids")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RECV_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SEND_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    recv_request_ids: _containers.RepeatedScalarFieldContainer[str]
    send_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., recv_request_ids: _Optional[_Iterable[str]] = ..., send_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Bye(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Ready(_message.Message):
    __slots__ = ("agent_name", "max_message_bytes")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    max_message_bytes: int
    def __init__(self, agent_name: _Optional[str] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("step", "message", "dropped", "recv_request_ids", "send_request_ids")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    RECV_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    SEND_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    message: str
    dropped: bool
    recv_request_ids: _containers.RepeatedScalarFieldContainer[str]
    send_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., message: _Optional[str] = ..., dropped: _Optional[bool] = ..., recv_request_ids: _Optional[_Iterable[str]] = ..., send_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("ready", "finished", "step_error")
    READY_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    STEP_ERROR_FIELD_NUMBER: _ClassVar[int]
    ready: Ready
    finished: Finished
    step_error: StepError
    def __init__(self, ready: _Optional[_Union[Ready, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., step_error: _Optional[_Union[StepError, _Mapping]] = ...) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("engine_id", "compat_hash", "layout", "agent")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    compat_hash: str
    layout: KvLayout
    agent: bytes
    def __init__(self, engine_id: _Optional[str] = ..., compat_hash: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., agent: _Optional[bytes] = ...) -> None: ...

class RankList(_message.Message):
    __slots__ = ("ranks", "leaving")
    RANKS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    leaving: _containers.RepeatedCompositeFieldContainer[RankInfo]
    def __init__(self, ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ..., leaving: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("engine_id", "accept_zstd")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_ZSTD_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    accept_zstd: bool
    def __init__(self, engine_id: _Optional[str] = ..., accept_zstd: _Optional[bool] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("engine_id", "generation", "server_unix_nanos", "zstd", "payload", "rank_port_base")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SERVER_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    ZSTD_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    RANK_PORT_BASE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    generation: int
    server_unix_nanos: int
    zstd: bool
    payload: bytes
    rank_port_base: int
    def __init__(self, engine_id: _Optional[str] = ..., generation: _Optional[int] = ..., server_unix_nanos: _Optional[int] = ..., zstd: _Optional[bool] = ..., payload: _Optional[bytes] = ..., rank_port_base: _Optional[int] = ...) -> None: ...

class TransferParams(_message.Message):
    __slots__ = ("transfer_id", "do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_addr", "remote_request_id", "remote_block_ids", "remote_tp_size", "remote_pp_size", "remote_num_tokens", "remote_blocks_expiry_unix_nanos", "mode", "remote_generation")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DO_REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    DO_REMOTE_DECODE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ADDR_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_EXPIRY_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    do_remote_prefill: bool
    do_remote_decode: bool
    remote_engine_id: str
    remote_addr: str
    remote_request_id: str
    remote_block_ids: _containers.RepeatedCompositeFieldContainer[Span]
    remote_tp_size: int
    remote_pp_size: int
    remote_num_tokens: int
    remote_blocks_expiry_unix_nanos: int
    mode: Mode
    remote_generation: int
    def __init__(self, transfer_id: _Optional[str] = ..., do_remote_prefill: _Optional[bool] = ..., do_remote_decode: _Optional[bool] = ..., remote_engine_id: _Optional[str] = ..., remote_addr: _Optional[str] = ..., remote_request_id: _Optional[str] = ..., remote_block_ids: _Optional[_Iterable[_Union[Span, _Mapping]]] = ..., remote_tp_size: _Optional[int] = ..., remote_pp_size: _Optional[int] = ..., remote_num_tokens: _Optional[int] = ..., remote_blocks_expiry_unix_nanos: _Optional[int] = ..., mode: _Optional[_Union[Mode, str]] = ..., remote_generation: _Optional[int] = ...) -> None: ...

class EngineRequest(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    params: TransferParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., params: _Optional[_Union[TransferParams, _Mapping]] = ...) -> None: ...

class BlockList(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SchedulerConfig(_message.Message):
    __slots__ = ("engine_id", "mode", "tp_size", "pp_size", "logical_block_size", "groups", "spec_blocks", "lease_millis", "decoder_blocks_ttl_millis", "registration_timeout_millis", "recompute_threshold", "bidirectional", "host_buffer", "layerwise", "prefill_backoff")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MILLIS_FIELD_NUMBER: _ClassVar[int]
    DECODER_BLOCKS_TTL_MILLIS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_TIMEOUT_MILLIS_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    BIDIRECTIONAL_FIELD_NUMBER: _ClassVar[int]
    HOST_BUFFER_FIELD_NUMBER: _ClassVar[int]
    LAYERWISE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BACKOFF_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    mode: Mode
    tp_size: int
    pp_size: int
    logical_block_size: int
    groups: _containers.RepeatedCompositeFieldContainer[CacheGroup]
    spec_blocks: int
    lease_millis: int
    decoder_blocks_ttl_millis: int
    registration_timeout_millis: int
    recompute_threshold: int
    bidirectional: bool
    host_buffer: bool
    layerwise: bool
    prefill_backoff: int
    def __init__(self, engine_id: _Optional[str] = ..., mode: _Optional[_Union[Mode, str]] = ..., tp_size: _Optional[int] = ..., pp_size: _Optional[int] = ..., logical_block_size: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[CacheGroup, _Mapping]]] = ..., spec_blocks: _Optional[int] = ..., lease_millis: _Optional[int] = ..., decoder_blocks_ttl_millis: _Optional[int] = ..., registration_timeout_millis: _Optional[int] = ..., recompute_threshold: _Optional[int] = ..., bidirectional: _Optional[bool] = ..., host_buffer: _Optional[bool] = ..., layerwise: _Optional[bool] = ..., prefill_backoff: _Optional[int] = ...) -> None: ...

class OpenSchedulerRequest(_message.Message):
    __slots__ = ("config",)
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    config: SchedulerConfig
    def __init__(self, config: _Optional[_Union[SchedulerConfig, _Mapping]] = ...) -> None: ...

class OpenSchedulerResponse(_message.Message):
    __slots__ = ("addr", "takes_preempted", "takes_new_request")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    TAKES_PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    TAKES_NEW_REQUEST_FIELD_NUMBER: _ClassVar[int]
    addr: str
    takes_preempted: bool
    takes_new_request: bool
    def __init__(self, addr: _Optional[str] = ..., takes_preempted: _Optional[bool] = ..., takes_new_request: _Optional[bool] = ...) -> None: ...

class MatchedTokensRequest(_message.Message):
    __slots__ = ("engine_id", "request", "computed")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request: EngineRequest
    computed: int
    def __init__(self, engine_id: _Optional[str] = ..., request: _Optional[_Union[EngineRequest, _Mapping]] = ..., computed: _Optional[int] = ...) -> None: ...

class MatchedTokensResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ASYNC_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    def __init__(self, tokens: _Optional[int] = ..., **kwargs) -> None: ...

class AfterAllocRequest(_message.Message):
    __slots__ = ("engine_id", "request", "blocks", "computed", "external")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request: EngineRequest
    blocks: _containers.RepeatedCompositeFieldContainer[BlockList]
    computed: int
    external: int
    def __init__(self, engine_id: _Optional[str] = ..., request: _Optional[_Union[EngineRequest, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[BlockList, _Mapping]]] = ..., computed: _Optional[int] = ..., external: _Optional[int] = ...) -> None: ...

class AfterAllocResponse(_message.Message):
    __slots__ = ("params",)
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    params: TransferParams
    def __init__(self, params: _Optional[_Union[TransferParams, _Mapping]] = ...) -> None: ...

class ScheduledRequest(_message.Message):
    __slots__ = ("engine_id", "request", "new_blocks", "computed", "scheduled")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request: EngineRequest
    new_blocks: _containers.RepeatedCompositeFieldContainer[BlockList]
    computed: int
    scheduled: int
    def __init__(self, engine_id: _Optional[str] = ..., request: _Optional[_Union[EngineRequest, _Mapping]] = ..., new_blocks: _Optional[_Iterable[_Union[BlockList, _Mapping]]] = ..., computed: _Optional[int] = ..., scheduled: _Optional[int] = ...) -> None: ...

class ScheduledResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RequestFinishedRequest(_message.Message):
    __slots__ = ("engine_id", "request", "status", "blocks", "computed")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request: EngineRequest
    status: FinishStatus
    blocks: _containers.RepeatedCompositeFieldContainer[BlockList]
    computed: int
    def __init__(self, engine_id: _Optional[str] = ..., request: _Optional[_Union[EngineRequest, _Mapping]] = ..., status: _Optional[_Union[FinishStatus, str]] = ..., blocks: _Optional[_Iterable[_Union[BlockList, _Mapping]]] = ..., computed: _Optional[int] = ...) -> None: ...

class RequestFinishedResponse(_message.Message):
    __slots__ = ("delay", "params", "request_params")
    DELAY_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_PARAMS_FIELD_NUMBER: _ClassVar[int]
    delay: bool
    params: TransferParams
    request_params: TransferParams
    def __init__(self, delay: _Optional[bool] = ..., params: _Optional[_Union[TransferParams, _Mapping]] = ..., request_params: _Optional[_Union[TransferParams, _Mapping]] = ...) -> None: ...

class BuildMetaRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class BuildMetaResponse(_message.Message):
    __slots__ = ("meta",)
    META_FIELD_NUMBER: _ClassVar[int]
    meta: StepMeta
    def __init__(self, meta: _Optional[_Union[StepMeta, _Mapping]] = ...) -> None: ...

class UpdateRequest(_message.Message):
    __slots__ = ("engine_id", "finished")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    finished: Finished
    def __init__(self, engine_id: _Optional[str] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...

class UpdateResponse(_message.Message):
    __slots__ = ("pending",)
    PENDING_FIELD_NUMBER: _ClassVar[int]
    pending: bool
    def __init__(self, pending: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("engine_id", "request", "blocks", "computed", "scheduled")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request: EngineRequest
    blocks: _containers.RepeatedCompositeFieldContainer[BlockList]
    computed: int
    scheduled: int
    def __init__(self, engine_id: _Optional[str] = ..., request: _Optional[_Union[EngineRequest, _Mapping]] = ..., blocks: _Optional[_Iterable[_Union[BlockList, _Mapping]]] = ..., computed: _Optional[int] = ..., scheduled: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerOp(_message.Message):
    __slots__ = ("after_alloc", "scheduled", "request_finished", "update", "prefill", "new_request")
    AFTER_ALLOC_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FINISHED_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUEST_FIELD_NUMBER: _ClassVar[int]
    after_alloc: AfterAllocRequest
    scheduled: ScheduledRequest
    request_finished: RequestFinishedRequest
    update: UpdateRequest
    prefill: PrefillRequest
    new_request: NewRequestRequest
    def __init__(self, after_alloc: _Optional[_Union[AfterAllocRequest, _Mapping]] = ..., scheduled: _Optional[_Union[ScheduledRequest, _Mapping]] = ..., request_finished: _Optional[_Union[RequestFinishedRequest, _Mapping]] = ..., update: _Optional[_Union[UpdateRequest, _Mapping]] = ..., prefill: _Optional[_Union[PrefillRequest, _Mapping]] = ..., new_request: _Optional[_Union[NewRequestRequest, _Mapping]] = ...) -> None: ...

class NewRequestRequest(_message.Message):
    __slots__ = ("engine_id", "request")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request: EngineRequest
    def __init__(self, engine_id: _Optional[str] = ..., request: _Optional[_Union[EngineRequest, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("engine_id", "ops", "build_meta", "columns", "publish_step", "errors_only")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    BUILD_META_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_STEP_FIELD_NUMBER: _ClassVar[int]
    ERRORS_ONLY_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    ops: _containers.RepeatedCompositeFieldContainer[SchedulerOp]
    build_meta: bool
    columns: StepColumns
    publish_step: int
    errors_only: bool
    def __init__(self, engine_id: _Optional[str] = ..., ops: _Optional[_Iterable[_Union[SchedulerOp, _Mapping]]] = ..., build_meta: _Optional[bool] = ..., columns: _Optional[_Union[StepColumns, _Mapping]] = ..., publish_step: _Optional[int] = ..., errors_only: _Optional[bool] = ...) -> None: ...

class RequestColumns(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "flags", "transfer_id", "remote_engine_id", "remote_addr", "remote_request_id", "remote_tp_size", "remote_pp_size", "remote_num_tokens", "mode", "remote_block_lens", "remote_block_starts", "remote_block_ids", "block_lens", "block_ids", "computed", "count", "status", "remote_generation", "remote_blocks_expiry_unix_nanos")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ADDR_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_LENS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_STARTS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_LENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_EXPIRY_UNIX_NANOS_FIELD_NUMBER: _ClassVar[int]
    request_id: _containers.RepeatedScalarFieldContainer[str]
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    flags: _containers.RepeatedScalarFieldContainer[int]
    transfer_id: _containers.RepeatedScalarFieldContainer[str]
    remote_engine_id: _containers.RepeatedScalarFieldContainer[str]
    remote_addr: _containers.RepeatedScalarFieldContainer[str]
    remote_request_id: _containers.RepeatedScalarFieldContainer[str]
    remote_tp_size: _containers.RepeatedScalarFieldContainer[int]
    remote_pp_size: _containers.RepeatedScalarFieldContainer[int]
    remote_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    mode: _containers.RepeatedScalarFieldContainer[Mode]
    remote_block_lens: _containers.RepeatedScalarFieldContainer[int]
    remote_block_starts: _containers.RepeatedScalarFieldContainer[int]
    remote_block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_lens: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    computed: _containers.RepeatedScalarFieldContainer[int]
    count: _containers.RepeatedScalarFieldContainer[int]
    status: _containers.RepeatedScalarFieldContainer[FinishStatus]
    remote_generation: _containers.RepeatedScalarFieldContainer[int]
    remote_blocks_expiry_unix_nanos: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[_Iterable[str]] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., flags: _Optional[_Iterable[int]] = ..., transfer_id: _Optional[_Iterable[str]] = ..., remote_engine_id: _Optional[_Iterable[str]] = ..., remote_addr: _Optional[_Iterable[str]] = ..., remote_request_id: _Optional[_Iterable[str]] = ..., remote_tp_size: _Optional[_Iterable[int]] = ..., remote_pp_size: _Optional[_Iterable[int]] = ..., remote_num_tokens: _Optional[_Iterable[int]] = ..., mode: _Optional[_Iterable[_Union[Mode, str]]] = ..., remote_block_lens: _Optional[_Iterable[int]] = ..., remote_block_starts: _Optional[_Iterable[int]] = ..., remote_block_ids: _Optional[_Iterable[int]] = ..., block_lens: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., computed: _Optional[_Iterable[int]] = ..., count: _Optional[_Iterable[int]] = ..., status: _Optional[_Iterable[_Union[FinishStatus, str]]] = ..., remote_generation: _Optional[_Iterable[int]] = ..., remote_blocks_expiry_unix_nanos: _Optional[_Iterable[int]] = ...) -> None: ...

class StepColumns(_message.Message):
    __slots__ = ("request_finished", "after_alloc", "prefill")
    REQUEST_FINISHED_FIELD_NUMBER: _ClassVar[int]
    AFTER_ALLOC_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_finished: RequestColumns
    after_alloc: RequestColumns
    prefill: RequestColumns
    def __init__(self, request_finished: _Optional[_Union[RequestColumns, _Mapping]] = ..., after_alloc: _Optional[_Union[RequestColumns, _Mapping]] = ..., prefill: _Optional[_Union[RequestColumns, _Mapping]] = ...) -> None: ...

class OpResult(_message.Message):
    __slots__ = ("index", "code", "error", "delay", "params")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DELAY_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    index: int
    code: int
    error: str
    delay: bool
    params: TransferParams
    def __init__(self, index: _Optional[int] = ..., code: _Optional[int] = ..., error: _Optional[str] = ..., delay: _Optional[bool] = ..., params: _Optional[_Union[TransferParams, _Mapping]] = ...) -> None: ...

class SchedulerCounters(_message.Message):
    __slots__ = ("bad_params", "unknown_updates", "watchdog_expired", "recomputed")
    BAD_PARAMS_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_UPDATES_FIELD_NUMBER: _ClassVar[int]
    WATCHDOG_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    bad_params: int
    unknown_updates: int
    watchdog_expired: int
    recomputed: int
    def __init__(self, bad_params: _Optional[int] = ..., unknown_updates: _Optional[int] = ..., watchdog_expired: _Optional[int] = ..., recomputed: _Optional[int] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("meta", "results", "pending", "counters", "publish_step", "generation")
    META_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    meta: StepMeta
    results: _containers.RepeatedCompositeFieldContainer[OpResult]
    pending: bool
    counters: SchedulerCounters
    publish_step: int
    generation: int
    def __init__(self, meta: _Optional[_Union[StepMeta, _Mapping]] = ..., results: _Optional[_Iterable[_Union[OpResult, _Mapping]]] = ..., pending: _Optional[bool] = ..., counters: _Optional[_Union[SchedulerCounters, _Mapping]] = ..., publish_step: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class StepsRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: StepRequest
    def __init__(self, step: _Optional[_Union[StepRequest, _Mapping]] = ...) -> None: ...

class StepsResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: StepResponse
    def __init__(self, step: _Optional[_Union[StepResponse, _Mapping]] = ...) -> None: ...

class CloseSchedulerRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class CloseSchedulerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
