from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PlacementMap(_message.Message):
    __slots__ = ("version", "num_moe_layers", "num_slots", "slot_to_logical", "num_expert_groups")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_TO_LOGICAL_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    version: int
    num_moe_layers: int
    num_slots: int
    slot_to_logical: _containers.RepeatedScalarFieldContainer[int]
    num_expert_groups: int
    def __init__(self, version: _Optional[int] = ..., num_moe_layers: _Optional[int] = ..., num_slots: _Optional[int] = ..., slot_to_logical: _Optional[_Iterable[int]] = ..., num_expert_groups: _Optional[int] = ...) -> None: ...

class ApplyPlacementRequest(_message.Message):
    __slots__ = ("group", "placement")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    group: str
    placement: PlacementMap
    def __init__(self, group: _Optional[str] = ..., placement: _Optional[_Union[PlacementMap, _Mapping]] = ...) -> None: ...

class PlacementApplied(_message.Message):
    __slots__ = ("version", "slots_moved", "bytes_sent", "bytes_received", "seconds_paused")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PAUSED_FIELD_NUMBER: _ClassVar[int]
    version: int
    slots_moved: int
    bytes_sent: int
    bytes_received: int
    seconds_paused: float
    def __init__(self, version: _Optional[int] = ..., slots_moved: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., seconds_paused: _Optional[float] = ...) -> None: ...

class GetPlacementRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: str
    def __init__(self, group: _Optional[str] = ...) -> None: ...

class GroupRebalance(_message.Message):
    __slots__ = ("group", "applied", "reason", "version", "slots_moved", "bytes_moved", "seconds_paused", "predicted_balancedness_before", "predicted_balancedness_after")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PAUSED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_BALANCEDNESS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_BALANCEDNESS_AFTER_FIELD_NUMBER: _ClassVar[int]
    group: str
    applied: bool
    reason: str
    version: int
    slots_moved: int
    bytes_moved: int
    seconds_paused: float
    predicted_balancedness_before: float
    predicted_balancedness_after: float
    def __init__(self, group: _Optional[str] = ..., applied: _Optional[bool] = ..., reason: _Optional[str] = ..., version: _Optional[int] = ..., slots_moved: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., seconds_paused: _Optional[float] = ..., predicted_balancedness_before: _Optional[float] = ..., predicted_balancedness_after: _Optional[float] = ...) -> None: ...

class RebalanceReply(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupRebalance]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupRebalance, _Mapping]]] = ...) -> None: ...

class GroupStatusRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: str
    def __init__(self, group: _Optional[str] = ...) -> None: ...

class GroupState(_message.Message):
    __slots__ = ("group", "ranks", "version", "balancedness", "rebalances", "num_moe_layers", "rows_total", "rows_step", "placement_step")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    REBALANCES_FIELD_NUMBER: _ClassVar[int]
    NUM_MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ROWS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROWS_STEP_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_STEP_FIELD_NUMBER: _ClassVar[int]
    group: str
    ranks: int
    version: int
    balancedness: float
    rebalances: int
    num_moe_layers: int
    rows_total: _containers.RepeatedScalarFieldContainer[int]
    rows_step: int
    placement_step: int
    def __init__(self, group: _Optional[str] = ..., ranks: _Optional[int] = ..., version: _Optional[int] = ..., balancedness: _Optional[float] = ..., rebalances: _Optional[int] = ..., num_moe_layers: _Optional[int] = ..., rows_total: _Optional[_Iterable[int]] = ..., rows_step: _Optional[int] = ..., placement_step: _Optional[int] = ...) -> None: ...

class GroupStatusReply(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupState]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupState, _Mapping]]] = ...) -> None: ...
