OFFSETS: dict[str, int]
SIZES: dict[str, int]
STATES: dict[str, int]
FLAGS: dict[str, int]
OUTCOMES: dict[str, int]

def push(due: int, seq: int, now: int, payload_id: int, payload: bytes) -> bytes: ...
def lease(image: bytes, now: int, deadline: int, max_attempts: int) -> tuple[bytes, int]: ...
def nack(
    image: bytes, now: int, retry_at: int, dead: bool, poisoned: bool, max_attempts: int
) -> tuple[bytes, int]: ...
