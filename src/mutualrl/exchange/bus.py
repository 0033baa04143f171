"""The in-process experience bus: publish records, subscribe with filters, bounded queues.

In process nothing is serialized: subscribers receive the very (frozen) Struct objects that were
published. An attached ``ExperienceLog`` gets every published record as an envelope, so a run is
replayable. Delivery is at-least-once upstream and exactly-once here: a record re-published with
the same (producer, seq) is delivered once and counted as a duplicate.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Collection
from typing import Any, Literal

import msgspec

from mutualrl.exchange.codec import Delivery, RecordCodec
from mutualrl.exchange.errors import BusClosedError, SubscriberOverflowError
from mutualrl.exchange.kinds import EXPERIENCE_TYPES
from mutualrl.exchange.log import ExperienceLog
from mutualrl.registry import Registry

Overflow = Literal["block", "drop_oldest"]


class Subscription:
    """A subscriber's bounded queue of deliveries matching its filters.

    ``overflow="drop_oldest"`` evicts the oldest queued item when full (counted in ``dropped``);
    ``"block"`` makes the publisher wait up to ``timeout`` seconds for room, then raise
    ``SubscriberOverflowError``. Either way nothing is lost silently.
    """

    def __init__(
        self,
        *,
        name: str,
        kinds: Collection[str] | None,
        producers: Collection[str] | None,
        prompt_ids: Collection[str] | None,
        maxsize: int,
        overflow: Overflow,
        timeout: float,
        on_close: Callable[[Subscription], None] | None = None,
    ) -> None:
        if maxsize < 1:
            raise ValueError(f"subscription {name!r}: maxsize must be >= 1, got {maxsize}")
        if overflow not in ("block", "drop_oldest"):
            raise ValueError(
                f"subscription {name!r}: overflow must be 'block' or 'drop_oldest', "
                f"got {overflow!r}"
            )
        self.name = name
        self.kinds = frozenset(kinds) if kinds is not None else None
        self.producers = frozenset(producers) if producers is not None else None
        self.prompt_ids = frozenset(prompt_ids) if prompt_ids is not None else None
        self.maxsize = maxsize
        self.overflow = overflow
        self.timeout = timeout
        self.delivered = 0
        self.dropped = 0
        self.closed = False
        self._queue: deque[Delivery] = deque()
        self._cond = threading.Condition()
        self._on_close = on_close

    def matches(self, kind: str, producer: str, record: msgspec.Struct) -> bool:
        """Whether a record passes every filter (records without ``prompt_id`` fail that one)."""
        return (
            (self.kinds is None or kind in self.kinds)
            and (self.producers is None or producer in self.producers)
            and (self.prompt_ids is None or getattr(record, "prompt_id", None) in self.prompt_ids)
        )

    def offer(self, delivery: Delivery) -> None:
        """Enqueue ``delivery`` under the overflow policy (called by the bus)."""
        with self._cond:
            if self.closed:
                return
            if len(self._queue) >= self.maxsize:
                if self.overflow == "drop_oldest":
                    self._queue.popleft()
                    self.dropped += 1
                elif not self._cond.wait_for(
                    lambda: len(self._queue) < self.maxsize or self.closed, timeout=self.timeout
                ):
                    self.dropped += 1
                    raise SubscriberOverflowError(
                        f"subscriber {self.name!r}: queue stayed full ({self.maxsize} items) for "
                        f"{self.timeout}s with overflow='block' ({delivery.kind} seq "
                        f"{delivery.seq} from {delivery.producer!r} not delivered); drain it "
                        "more often, raise maxsize or use overflow='drop_oldest'"
                    )
                elif self.closed:
                    return
            self._queue.append(delivery)
            self.delivered += 1
            self._cond.notify_all()  # wake a consumer waiting in get()

    def drain_deliveries(self, max_items: int | None = None) -> list[Delivery]:
        """Take queued deliveries (records with their envelope metadata), without blocking."""
        with self._cond:
            n = len(self._queue) if max_items is None else min(max_items, len(self._queue))
            out = [self._queue.popleft() for _ in range(n)]
            self._cond.notify_all()  # wake publishers blocked on a full queue
        return out

    def drain(self, max_items: int | None = None) -> list[Any]:
        """Take queued records (the published Struct objects), without blocking."""
        return [d.record for d in self.drain_deliveries(max_items)]

    def get(self, timeout: float | None = None) -> Delivery | None:
        """Wait up to ``timeout`` seconds for one delivery; ``None`` if none came."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._queue or self.closed, timeout=timeout):
                return None
            if not self._queue:
                return None
            item = self._queue.popleft()
            self._cond.notify_all()
            return item

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)

    def queued(self) -> list[Delivery]:
        """The deliveries waiting, oldest first, left in the queue (a checkpoint keeps them)."""
        with self._cond:
            return list(self._queue)

    def restore(self, deliveries: list[Delivery]) -> None:
        """Queue ``deliveries`` again, ahead of anything that arrived since, as a checkpoint left
        them: they were delivered and counted before, so neither filter nor counter sees them."""
        with self._cond:
            self._queue.extendleft(reversed(deliveries))
            self._cond.notify_all()

    def close(self) -> None:
        """Stop receiving (queued items stay drainable); unblocks a waiting publisher."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()
        if self._on_close is not None:
            self._on_close(self)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                "queued": len(self._queue),
                "delivered": self.delivered,
                "dropped": self.dropped,
                "maxsize": self.maxsize,
                "overflow": self.overflow,
                "closed": self.closed,
            }


class _SeenSeqs:
    """The seqs of one producer seen so far: everything below ``floor`` plus a sparse set above.

    Memory stays bounded when seqs arrive (mostly) in order, which the bus's own numbering does.
    """

    __slots__ = ("floor", "above")

    def __init__(self) -> None:
        self.floor = 0
        self.above: set[int] = set()

    def __contains__(self, seq: int) -> bool:
        return seq < self.floor or seq in self.above

    def add(self, seq: int) -> None:
        self.above.add(seq)
        while self.floor in self.above:
            self.above.remove(self.floor)
            self.floor += 1


class ExperienceBus:
    """Routes published records to matching subscriptions and, if attached, to a log.

    Thread-safe: policies publish from their own threads. ``seq`` is assigned per producer.
    """

    def __init__(
        self,
        *,
        log: ExperienceLog | None = None,
        registry: Registry[type[msgspec.Struct]] = EXPERIENCE_TYPES,
    ) -> None:
        self._lock = threading.Lock()
        self._codec = RecordCodec(registry)
        self._log = log
        self._next_seq: dict[str, int] = {}
        self._seen: dict[str, _SeenSeqs] = {}
        self._subs: dict[str, Subscription] = {}
        self._retired: dict[str, Subscription] = {}  # closed ones keep reporting their counts
        self._published: Counter[str] = Counter()
        self._duplicates = 0
        self._closed = False

    def attach_log(self, log: ExperienceLog) -> None:
        """Append every record published from now on to ``log``."""
        with self._lock:
            self._log = log

    def publish(
        self, record: msgspec.Struct, *, producer: str, version: int, seq: int | None = None
    ) -> int | None:
        """Publish ``record`` from ``producer`` at policy ``version``.

        ``seq`` is assigned (next for this producer) unless given -- give it when forwarding a
        record that already has one, so a re-delivery is recognised. Returns the seq, or
        ``None`` for a duplicate (counted, not delivered again). Raises ``UnknownKindError`` for
        an unregistered record type and ``SubscriberOverflowError`` from a blocked subscriber.
        """
        with self._lock:
            if self._closed:
                raise BusClosedError(
                    f"publish({type(record).__name__}) from {producer!r} after "
                    "ExperienceBus.close()"
                )
            kind = self._codec.kind_of(record)
            if seq is None:
                seq = self._next_seq.get(producer, 0)
            seen = self._seen.setdefault(producer, _SeenSeqs())
            if seq in seen:
                self._duplicates += 1
                return None
            # Encode (and so validate) before anything is counted: a refused record leaves no trace.
            envelope = (
                None
                if self._log is None
                else self._codec.envelope(
                    record, kind=kind, producer=producer, version=version, seq=seq
                )
            )
            seen.add(seq)
            self._next_seq[producer] = max(self._next_seq.get(producer, 0), seq + 1)
            self._published[kind] += 1
            if self._log is not None and envelope is not None:  # an envelope iff a log
                self._log.append(envelope)
            targets = [s for s in self._subs.values() if s.matches(kind, producer, record)]
        # Outside the bus lock: a blocking subscriber must not stall unrelated publishers.
        delivery = Delivery(
            kind=kind, producer=producer, producer_version=version, seq=seq, record=record
        )
        for sub in targets:
            sub.offer(delivery)
        return seq

    def subscribe(
        self,
        *,
        kinds: Collection[str] | None = None,
        producers: Collection[str] | None = None,
        prompt_ids: Collection[str] | None = None,
        maxsize: int = 4096,
        overflow: Overflow = "block",
        timeout: float = 30.0,
        name: str | None = None,
    ) -> Subscription:
        """A new subscription; ``None`` filters match everything. Kinds are checked."""
        for kind in kinds or ():
            self._codec.registry.get(kind)  # unknown kind -> RegistryError listing known ones
        with self._lock:
            name = name or f"sub{len(self._subs) + len(self._retired)}"
            if name in self._subs or name in self._retired:
                raise ValueError(f"subscribe: name {name!r} is already used on this bus")
            sub = Subscription(
                name=name,
                kinds=kinds,
                producers=producers,
                prompt_ids=prompt_ids,
                maxsize=maxsize,
                overflow=overflow,
                timeout=timeout,
                on_close=self._retire,
            )
            self._subs[name] = sub
            return sub

    def _retire(self, sub: Subscription) -> None:
        with self._lock:
            if self._subs.get(sub.name) is sub:
                self._retired[sub.name] = self._subs.pop(sub.name)

    def close(self) -> None:
        """Refuse further publishes and flush/close the attached log (idempotent)."""
        with self._lock:
            self._closed = True
            log = self._log
        if log is not None:
            log.close()

    def __enter__(self) -> ExperienceBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def flush(self) -> None:
        """Write the attached log's buffered records to disk now (a checkpoint needs them there)."""
        with self._lock:
            log = self._log
        if log is not None:
            log.flush()

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue this bus: the next seq and the seqs seen per
        producer, the counters, each subscriber's counters and the deliveries still queued for it
        (records published after a step's drain, such as a strategy's own, wait there for the
        next step). The records are kept as they are (a checkpoint stores them through this
        package's record codec), so a resumed run needs every kind among them registered, as the
        run that wrote it had."""
        with self._lock:
            out: dict[str, Any] = {
                "next_seq": dict(self._next_seq),
                "seen": {p: [s.floor, sorted(s.above)] for p, s in self._seen.items()},
                "published": dict(self._published),
                "duplicates": self._duplicates,
                "log": self._log.state_dict() if self._log is not None else None,
            }
            subs = {**self._retired, **self._subs}
        out["subscribers"] = {
            n: {"delivered": s.delivered, "dropped": s.dropped, "queued": len(s)}
            for n, s in subs.items()
        }
        out["queued"] = {n: q for n, q in ((n, s.queued()) for n, s in subs.items()) if q}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``: numbering goes on where it stopped (no seq is reused)."""
        with self._lock:
            self._next_seq = {p: int(n) for p, n in state["next_seq"].items()}
            self._seen = {}
            for producer, (floor, above) in state["seen"].items():
                seen = self._seen[producer] = _SeenSeqs()
                seen.floor, seen.above = int(floor), set(above)
            self._published = Counter(state["published"])
            self._duplicates = int(state["duplicates"])
            if self._log is not None and state.get("log") is not None:
                self._log.load_state_dict(state["log"])
            subs = {**self._retired, **self._subs}
        for name, counts in state["subscribers"].items():
            if name in subs:
                subs[name].delivered, subs[name].dropped = counts["delivered"], counts["dropped"]
        missing = sorted(set(state.get("queued", {})) - set(subs))
        if missing:
            raise ValueError(
                f"bus state: deliveries are queued for subscriptions {missing}, which "
                f"this bus does not have (it has {sorted(subs)}); subscribe them "
                "before loading the state"
            )
        for name, deliveries in state.get("queued", {}).items():
            subs[name].restore(deliveries)

    def stats(self) -> dict[str, Any]:
        """Counters: published (and by kind), duplicates, delivered, dropped, log bytes, and
        per-subscriber queue/delivered/dropped."""
        with self._lock:
            subs = {**self._retired, **self._subs}
            published = dict(self._published)
            out: dict[str, Any] = {
                "published": sum(published.values()),
                "published_by_kind": published,
                "duplicates": self._duplicates,
            }
            log = self._log
        per_sub = {name: s.stats() for name, s in subs.items()}
        out["delivered"] = sum(s["delivered"] for s in per_sub.values())
        out["dropped"] = sum(s["dropped"] for s in per_sub.values())
        out["subscribers"] = per_sub
        log_stats = log.stats() if log is not None else {}
        for key in ("frames_written", "records_written", "bytes_written", "raw_bytes_written"):
            out[key] = log_stats.get(key, 0)
        return out
