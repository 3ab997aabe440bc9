from typing import Any

from armdb._core.qindex import KeyIndex

ACKED: int
ABSENT: int
RELEASED: int
FOREIGN: int

def wall_ms() -> int: ...

class QueueShard:
    live: KeyIndex
    dead: KeyIndex
    fixed: Any
    lock: Any
    pushes: int
    acks: int
    nacks: int
    dead_lettered: int
    expired_leases: int
    def __init__(self, fixed: Any, payload_size: int, hooked: bool) -> None: ...
    def push(self, due: int, seq: int, now: int, payload_id: int, payload: bytes) -> int: ...
    def set_lease_types(self, lease_cls: type, token_cls: type, handle: int, dtype: Any) -> None: ...
    def claim(
        self, now: int, deadline: int, n: int, max_attempts: int, shard_no: int, out: list[Any], dl: Any = None
    ) -> int: ...
    def claim_one(
        self, due: int, seq: int, slot: int, now: int, deadline: int, max_attempts: int, shard_no: int,
        dl: Any = None,
    ) -> Any: ...
    def ack_token(self, token: Any) -> int: ...
    def ack(self, due: int, seq: int, epoch: int) -> int: ...
    def settle_slot(self, due: int, seq: int, epoch: int) -> tuple[int, int]: ...
    def ack_slot(self, due: int, seq: int, slot: int, version: int) -> None: ...
