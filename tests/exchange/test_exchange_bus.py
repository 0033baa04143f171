"""ExperienceBus and Subscription: routing, de-duplication, bounded queues, threads, the log."""

from __future__ import annotations

import threading

import pytest

from mutualrl.exchange import (
    BusClosedError,
    ExperienceBus,
    ExperienceLog,
    GroupStats,
    Rollout,
    SubscriberOverflowError,
    Watermark,
    prompt_id,
    read_log,
)
from mutualrl.registry import RegistryError


def rollout(prompt: str = "p", producer: str = "a", version: int = 0) -> Rollout:
    return Rollout.create(
        prompt=prompt,
        completion="c",
        producer=producer,
        tokenizer_id="t",
        token_ids=[1, 2, 3],
        logprobs=[-0.1, -0.2, -0.3],
        reward=0.5,
        verifier_id="v",
        policy_version=version,
        finish_reason="length",
    )


def test_publish_assigns_seq_per_producer_and_hands_the_same_object() -> None:
    bus = ExperienceBus()
    sub = bus.subscribe()
    r = rollout()
    assert bus.publish(r, producer="a", version=0) == 0
    assert bus.publish(rollout(), producer="a", version=0) == 1
    assert bus.publish(rollout(), producer="b", version=0) == 0
    items = sub.drain_deliveries()
    assert [(d.producer, d.seq) for d in items] == [("a", 0), ("a", 1), ("b", 0)]
    assert items[0].record is r  # in process nothing is serialized


def test_filters_by_kind_producer_and_prompt() -> None:
    bus = ExperienceBus()
    only_rollouts = bus.subscribe(kinds={"rollout"})
    only_b = bus.subscribe(producers={"b"})
    only_q = bus.subscribe(prompt_ids={prompt_id("q")})
    bus.publish(rollout("p"), producer="a", version=0)
    bus.publish(rollout("q"), producer="b", version=0)
    bus.publish(Watermark(producer="b", version=1), producer="b", version=1)
    assert [type(r).__name__ for r in only_rollouts.drain()] == ["Rollout", "Rollout"]
    assert len(only_b.drain()) == 2
    assert [r.prompt for r in only_q.drain()] == ["q"]  # Watermark has no prompt_id: no match


def test_unknown_kind_in_a_filter_fails_early() -> None:
    with pytest.raises(RegistryError, match="unknown experience type 'rollouts'"):
        ExperienceBus().subscribe(kinds={"rollouts"})


def test_duplicates_are_delivered_once_and_counted() -> None:
    bus = ExperienceBus()
    sub = bus.subscribe()
    r = rollout()
    assert bus.publish(r, producer="a", version=0, seq=5) == 5
    assert bus.publish(r, producer="a", version=0, seq=5) is None
    assert bus.publish(r, producer="a", version=0, seq=3) == 3  # late but new
    assert bus.publish(r, producer="a", version=0) == 6  # numbering continues after the max
    assert [d.seq for d in sub.drain_deliveries()] == [5, 3, 6]
    stats = bus.stats()
    assert stats["duplicates"] == 1 and stats["published"] == 3


def test_drop_oldest_counts_every_drop() -> None:
    bus = ExperienceBus()
    sub = bus.subscribe(maxsize=2, overflow="drop_oldest", name="slow")
    for v in range(5):
        bus.publish(Watermark(producer="a", version=v), producer="a", version=v)
    assert [w.version for w in sub.drain()] == [3, 4]
    s = bus.stats()
    assert s["dropped"] == 3 and s["subscribers"]["slow"]["dropped"] == 3
    assert s["delivered"] == 5


def test_block_times_out_with_a_clear_error() -> None:
    bus = ExperienceBus()
    bus.subscribe(maxsize=1, overflow="block", timeout=0.05, name="stuck")
    bus.publish(Watermark(producer="a", version=0), producer="a", version=0)
    with pytest.raises(SubscriberOverflowError, match="subscriber 'stuck': queue stayed full"):
        bus.publish(Watermark(producer="a", version=1), producer="a", version=1)
    assert bus.stats()["subscribers"]["stuck"]["dropped"] == 1


def test_block_waits_for_a_consumer_thread() -> None:
    bus = ExperienceBus()
    sub = bus.subscribe(maxsize=2, overflow="block", timeout=5.0)
    got: list[int] = []

    def consume() -> None:
        while len(got) < 50:
            d = sub.get(timeout=5.0)
            assert d is not None
            got.append(d.record.version)

    t = threading.Thread(target=consume)
    t.start()
    for v in range(50):
        bus.publish(Watermark(producer="a", version=v), producer="a", version=v)
    t.join(timeout=10)
    assert got == list(range(50)) and bus.stats()["dropped"] == 0


def test_concurrent_publishers_get_unique_seqs() -> None:
    bus = ExperienceBus()
    sub = bus.subscribe(maxsize=10_000)

    def produce(name: str) -> None:
        for v in range(200):
            bus.publish(Watermark(producer=name, version=v), producer=name, version=v)

    threads = [threading.Thread(target=produce, args=(f"p{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    items = sub.drain_deliveries()
    assert len(items) == 800 == len({(d.producer, d.seq) for d in items})
    for name in ("p0", "p3"):  # per producer, order is publish order
        assert [d.seq for d in items if d.producer == name] == list(range(200))


def test_closed_subscription_keeps_reporting_and_stops_receiving() -> None:
    bus = ExperienceBus()
    sub = bus.subscribe(name="gone")
    bus.publish(Watermark(producer="a", version=0), producer="a", version=0)
    sub.close()
    bus.publish(Watermark(producer="a", version=1), producer="a", version=1)
    assert len(sub.drain()) == 1
    assert bus.stats()["subscribers"]["gone"]["closed"] is True


def test_attached_log_gets_every_record_and_replays(tmp_path) -> None:
    bus = ExperienceBus(log=ExperienceLog(tmp_path, batch_records=4))
    stats = GroupStats.from_rewards(
        prompt_id=prompt_id("p"), producer="b", policy_version=1, rewards=[0.0, 1.0]
    )
    for v in range(6):
        bus.publish(rollout(version=v), producer="a", version=v)
    bus.publish(stats, producer="b", version=1)
    bus.publish(stats, producer="b", version=1, seq=0)  # duplicate: not logged twice
    assert bus.stats()["frames_written"] == 1  # 4 records flushed, 3 still buffered
    bus.close()
    s = bus.stats()
    assert s["frames_written"] == 2 and s["records_written"] == 7 and s["bytes_written"] > 0
    replayed = list(read_log(tmp_path))
    assert [(d.kind, d.producer, d.seq) for d in replayed] == (
        [("rollout", "a", i) for i in range(6)] + [("group_stats", "b", 0)]
    )
    assert replayed[6].record == stats
    with pytest.raises(BusClosedError, match="after ExperienceBus.close"):
        bus.publish(stats, producer="b", version=2)


def test_attach_log_later(tmp_path) -> None:
    bus = ExperienceBus()
    bus.publish(Watermark(producer="a", version=0), producer="a", version=0)
    bus.attach_log(ExperienceLog(tmp_path))
    bus.publish(Watermark(producer="a", version=1), producer="a", version=1)
    bus.close()
    assert [d.seq for d in read_log(tmp_path)] == [1]


def test_a_record_readers_would_refuse_is_refused_at_publish(tmp_path) -> None:
    from mutualrl.exchange import RecordDecodeError

    bus = ExperienceBus(log=ExperienceLog(tmp_path))
    with pytest.raises(
        RecordDecodeError,
        match=r"'watermark' record seq 0 from 'a' would not be "
        r"readable: .*\$\.version",
    ):
        bus.publish(Watermark(producer="a", version=-1), producer="a", version=0)
    assert bus.publish(Watermark(producer="a", version=1), producer="a", version=1) == 0
    assert bus.stats()["published"] == 1


def test_queued_deliveries_survive_the_state_and_come_back_first() -> None:
    from mutualrl.run import state_codec

    bus = ExperienceBus()
    sub = bus.subscribe(name="strategy")
    for i in range(3):
        bus.publish(rollout(prompt=f"p{i}"), producer="a", version=i)
    sub.drain_deliveries(1)  # the first was read before the checkpoint
    # as a checkpoint keeps it: the records through the exchange's own codec
    state = state_codec.decode(state_codec.encode(bus.state_dict(), "run"), "run")
    assert state["queued"]["strategy"] == sub.queued()
    assert [d.seq for d in state["queued"]["strategy"]] == [1, 2]
    assert len(sub) == 2  # taking the state leaves them queued

    resumed = ExperienceBus()
    again = resumed.subscribe(name="strategy")
    other = resumed.subscribe(name="other")
    resumed.load_state_dict(state)
    assert len(other) == 0
    assert again.delivered == 3 and again.dropped == 0  # counted once, when first delivered
    resumed.publish(rollout(prompt="p3"), producer="a", version=3)
    got = again.drain_deliveries()
    assert [d.seq for d in got] == [1, 2, 3]  # the restored ones first, then the new one
    assert [d.record.prompt for d in got] == ["p1", "p2", "p3"]


def test_queued_deliveries_for_a_subscription_the_bus_lacks_are_refused() -> None:
    bus = ExperienceBus()
    bus.subscribe(name="paced:a")
    bus.publish(rollout(), producer="a", version=0)
    fresh = ExperienceBus()
    fresh.subscribe(name="strategy")
    with pytest.raises(
        ValueError,
        match=r"queued for subscriptions \['paced:a'\].*"
        r"it has \['strategy'\]",
    ):
        fresh.load_state_dict(bus.state_dict())
