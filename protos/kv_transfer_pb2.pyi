from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class KvPullRequest(_message.Message):
    __slots__ = ("transfer_id", "checksum")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    checksum: bool
    def __init__(self, transfer_id: _Optional[str] = ..., checksum: _Optional[bool] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("total_bytes", "offset", "data", "checksum")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    offset: int
    data: bytes
    checksum: int
    def __init__(self, total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class KvLeaseRequest(_message.Message):
    __slots__ = ("transfer_id", "seconds")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    seconds: float
    def __init__(self, transfer_id: _Optional[str] = ..., seconds: _Optional[float] = ...) -> None: ...

class KvLeaseReply(_message.Message):
    __slots__ = ("ok",)
    OK_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    def __init__(self, ok: _Optional[bool] = ...) -> None: ...
