"""Change streams: a map write inside ``db.tx()`` emits queue rows in the same commit (SPEC T6-T8).

``emit(change)`` runs inside ``commit()``, before the log append, while the
commit holds the locks of the source map's shards and of every shard of every
destination queue (T7).  It must not call armdb itself.  Its rows are logged as
absolute rows; replay applies them without calling it again, and an aborted
transaction emits nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .layout import validate_name
from .queue import QueueSpec

__all__ = ["Change", "SchemaRegistry"]


@dataclass(frozen=True)
class Change:
    """One write to a stream source: ``key`` as it was put, ``old`` and ``new`` values
    (``None`` when absent; a delete has ``new=None``)."""

    key: Any
    old: Any
    new: Any


Emit = Callable[[Change], Any]


@dataclass(frozen=True)
class _Stream:
    source: str
    queue: QueueSpec
    emit: Emit


class SchemaRegistry:
    """Declares change streams and classifies queue collections; pass it to ``Db.open(schema=...)``."""

    def __init__(self) -> None:
        self._streams: dict[str, list[_Stream]] = {}
        self._queues: dict[str, QueueSpec] = {}

    def change_stream(self, source: str, queue: QueueSpec, emit: Emit) -> SchemaRegistry:
        """Record that writes to map ``source`` emit rows into ``queue`` (T6).

        Raises
        ------
        ConfigError
            ``source`` is not a valid map name, ``queue`` is not a ``QueueSpec``, or
            ``emit`` is not callable.
        """
        validate_name(source)
        if not isinstance(queue, QueueSpec):
            raise ConfigError("change_stream takes the QueueSpec returned by armdb.queue(...)")
        if not callable(emit):
            raise ConfigError("emit must be callable: emit(change) -> payload | list | None")
        if source in (queue.name, queue.payload_name):
            raise ConfigError(f"a queue's own collection {source!r} cannot be a stream source")
        self._streams.setdefault(source, []).append(_Stream(source, queue, emit))
        self.register_queue(queue)
        return self

    def register_queue(self, spec: QueueSpec) -> SchemaRegistry:
        """Classify a queue's physical collections (``name`` and, for var, ``name.payload``)."""
        if not isinstance(spec, QueueSpec):
            raise ConfigError("register_queue takes the QueueSpec returned by armdb.queue(...)")
        self._queues[spec.name] = spec
        return self

    def is_source(self, name: str) -> bool:
        return name in self._streams

    def streams_for(self, name: str) -> list[_Stream]:
        return self._streams.get(name, [])

    def collections(self) -> dict[str, str]:
        """Every collection this registry knows, by name: its role."""
        out: dict[str, str] = {}
        for spec in self._queues.values():
            out[spec.name] = "queue.header"
            if spec.var:
                out[spec.payload_name] = "queue.payload"
        for source in self._streams:
            out.setdefault(source, "stream.source")
        return out
