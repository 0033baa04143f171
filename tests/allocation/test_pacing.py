"""Bounded staleness, freshness, and paced runs with fast, slow, hung and raising workers."""

from __future__ import annotations

import threading
import time
import traceback

import pytest

from mutualrl.pacing import PacedRecord, VersionGate, is_fresh, run_paced, starvation_report


def test_is_fresh_bounds_age_but_not_records_from_the_future():
    assert is_fresh(5, 5, 0) and is_fresh(4, 5, 1) and not is_fresh(3, 5, 1)
    assert is_fresh(7, 5, 0)  # a faster producer's record is never stale


def test_gate_holds_a_fast_worker_and_releases_it_on_advance_or_removal():
    gate = VersionGate(["fast", "slow"], max_staleness=1)
    assert gate.wait_to_advance("fast", 0.1)
    gate.advance("fast")
    assert gate.wait_to_advance("fast", 0.1)  # 1 ahead: may start its next step
    gate.advance("fast")
    t0 = time.monotonic()
    assert not gate.wait_to_advance("fast", 0.2)  # 2 ahead: waits, and the wait times out
    assert 0.15 < time.monotonic() - t0 < 1.0
    threading.Timer(0.05, gate.advance, args=("slow",)).start()
    assert gate.wait_to_advance("fast", 1.0)
    gate.advance("fast")
    threading.Timer(0.05, gate.remove, args=("slow",)).start()  # a failed peer stops holding it
    assert gate.wait_to_advance("fast", 1.0)
    gate.close()
    assert not gate.wait_to_advance("fast", 1.0)
    with pytest.raises(KeyError, match="unknown worker 'x'"):
        gate.wait_to_advance("x", 0.1)


def test_lock_step_when_max_staleness_is_zero():
    gate = VersionGate(["a", "b"], max_staleness=0)
    gate.advance("a")
    assert not gate.wait_to_advance("a", 0.05) and gate.wait_to_advance("b", 0.05)


class Sleeper:
    """Emits one record per step; checks the staleness bound from inside its own steps."""

    def __init__(self, name: str, delay_s: float, gate: VersionGate, seen: list) -> None:
        self.name, self.delay_s, self.gate, self.seen = name, delay_s, gate, seen

    def step(self, k: int, incoming: list[PacedRecord]) -> list:
        live = self.gate.live()
        slowest = min((v for w, v in self.gate.versions().items() if w in live), default=k)
        self.seen.append((self.name, k, k - slowest, [(r.producer, r.version) for r in incoming]))
        time.sleep(self.delay_s)
        return [f"{self.name}@{k}"]


class Raises(Sleeper):
    def __init__(self, *a, at: int, **kw) -> None:
        super().__init__(*a, **kw)
        self.at = at

    def step(self, k, incoming):
        if k == self.at:
            raise ValueError(f"{self.name} failed at step {k}")
        return super().step(k, incoming)


class Hangs(Sleeper):
    def __init__(self, *a, release: threading.Event, at: int, **kw) -> None:
        super().__init__(*a, **kw)
        self.release, self.at = release, at

    def step(self, k, incoming):
        if k == self.at:
            self.release.wait()  # never set while the run lasts
        return super().step(k, incoming)


def _assert_accounted(report):
    assert report.balanced(), report
    assert report.deliveries >= sum(report.consumed.values())


def test_fast_and_slow_workers_stay_within_the_bound_and_lose_nothing():
    gate = VersionGate(["fast", "slow", "mid"], max_staleness=1)
    seen: list = []
    workers = {
        "fast": Sleeper("fast", 0.001, gate, seen),
        "slow": Sleeper("slow", 0.02, gate, seen),
        "mid": Sleeper("mid", 0.005, gate, seen),
    }
    report = run_paced(workers, 12, gate, step_timeout_s=2.0)
    assert report.steps_completed == {"fast": 12, "slow": 12, "mid": 12}
    assert not report.failures and not report.stopped
    assert max(ahead for _, _, ahead, _ in seen) <= 1  # never more than 1 version ahead
    assert report.produced == {"fast": 12, "slow": 12, "mid": 12}
    assert sum(report.dropped_stale.values()) == 0  # the gate keeps all experience fresh enough
    _assert_accounted(report)
    # the fast worker spent its spare time waiting for the slow one, not running ahead
    assert report.wait_s["fast"] > report.wait_s["slow"]


def test_stale_records_are_dropped_and_counted():
    # The gate lets workers drift by up to 3 versions, the consumers accept only age 0.
    gate = VersionGate(["fast", "slow"], max_staleness=3)
    seen: list = []
    report = run_paced(
        {"fast": Sleeper("fast", 0.0, gate, seen), "slow": Sleeper("slow", 0.02, gate, seen)},
        8,
        gate,
        step_timeout_s=2.0,
        max_age=0,
    )
    assert report.dropped_stale["fast"] > 0  # the slow one's records arrive too old for it
    _assert_accounted(report)
    for _, k, _, incoming in seen:
        assert all(is_fresh(version, k, 0) for _, version in incoming)


def test_consumption_drops_records_older_than_the_bound():
    from mutualrl.pacing.driver import _Run
    from mutualrl.pacing.gate import QueueChannel

    gate = VersionGate(["a", "b"], max_staleness=1)
    run = _Run(["a", "b"], 10, gate, QueueChannel(["a", "b"]), 1.0)
    for v in (0, 3, 4, 5):
        run.channel.publish(PacedRecord("a", v, v), ["b"])
    run.deliveries = 4
    fresh = run.consume("b", 5)
    assert [r.version for r in fresh] == [4, 5]
    assert run.consumed["b"] == 2 and run.dropped["b"] == 2


def test_a_raising_worker_stops_the_run_cleanly_with_its_traceback():
    gate = VersionGate(["a", "b", "bad"], max_staleness=1)
    seen: list = []
    workers = {
        "a": Sleeper("a", 0.002, gate, seen),
        "b": Sleeper("b", 0.005, gate, seen),
        "bad": Raises("bad", 0.002, gate, seen, at=3),
    }
    t0 = time.monotonic()
    report = run_paced(workers, 50, gate, step_timeout_s=1.0, on_failure="stop")
    assert time.monotonic() - t0 < 3.0
    assert report.stopped and [f.worker for f in report.failures] == ["bad"]
    f = report.failures[0]
    assert f.kind == "raised" and "bad failed at step 3" in f.message and "in step" in f.traceback
    assert report.steps_completed["bad"] == 3 and report.steps_completed["a"] < 50
    _assert_accounted(report)


def test_under_raise_a_raising_worker_s_own_exception_reaches_the_caller():
    """``on_failure = "raise"`` (a lock-step run's one member): the others wind down as under
    ``stop``, then the step's own exception is raised in the calling thread, as it was raised."""
    gate = VersionGate(["a", "bad"], max_staleness=0)
    seen: list = []
    bad = Raises("bad", 0.002, gate, seen, at=2)
    with pytest.raises(ValueError, match="bad failed at step 2") as caught:
        run_paced(
            {"a": Sleeper("a", 0.002, gate, seen), "bad": bad},
            50,
            gate,
            step_timeout_s=1.0,
            on_failure="raise",
        )
    assert any(frame.name == "step" for frame in traceback.extract_tb(caught.value.__traceback__))
    assert gate.version("bad") == 2 and gate.version("a") <= 3


def test_a_hung_worker_does_not_deadlock_the_others_under_continue():
    release = threading.Event()
    gate = VersionGate(["a", "b", "hung"], max_staleness=1)
    seen: list = []
    workers = {
        "a": Sleeper("a", 0.001, gate, seen),
        "b": Sleeper("b", 0.003, gate, seen),
        "hung": Hangs("hung", 0.001, gate, seen, release=release, at=2),
    }
    t0 = time.monotonic()
    report = run_paced(workers, 10, gate, step_timeout_s=0.5, on_failure="continue")
    elapsed = time.monotonic() - t0
    release.set()
    assert elapsed < 3.0
    assert report.steps_completed["a"] == report.steps_completed["b"] == 10
    assert report.steps_completed["hung"] == 2 and not report.stopped
    f = report.failures[0]
    assert (f.worker, f.kind) == ("hung", "timeout") and "self.release.wait()" in f.traceback
    # after the hang, a and b stop receiving hung's experience but lose none of their own
    assert report.produced["hung"] == 2
    _assert_accounted(report)


class Verifies:
    """Each step spends ``verify_s`` in a verifier that GuardedVerifier-style bookkeeping times
    per thread (a stand-in for ``tasks.base.GuardedVerifier.seconds_in_calls``)."""

    def __init__(self, verify_s: float, clock: dict) -> None:
        self.verify_s, self.clock = verify_s, clock

    def step(self, k: int, incoming: list[PacedRecord]) -> list:
        ident, t0 = threading.get_ident(), time.monotonic()
        self.clock[ident] = (self.clock.get(ident, (0.0, None))[0], t0)  # in progress
        time.sleep(self.verify_s)
        self.clock[ident] = (self.clock[ident][0] + time.monotonic() - t0, None)
        return [k]


def test_a_step_timeout_sets_aside_the_time_its_thread_spends_in_self_bounded_work():
    # a paced training run's verification: each call bounded by task.verifier_timeout_s, and
    # the policies take turns, so a healthy step can verify for longer than its calls' budget
    def aside(ident: int) -> float:
        spent, since = clock.get(ident, (0.0, None))
        return spent if since is None else spent + time.monotonic() - since

    clock: dict = {}
    gate = VersionGate(["v"], max_staleness=1)
    report = run_paced(
        {"v": Verifies(0.6, clock)},
        2,
        gate,
        step_timeout_s=0.3,
        on_failure="continue",
        set_aside=aside,
    )
    assert report.steps_completed["v"] == 2 and not report.failures
    clock.clear()
    gate = VersionGate(["v"], max_staleness=1)
    report = run_paced(
        {"v": Verifies(0.6, clock)}, 2, gate, step_timeout_s=0.3, on_failure="continue"
    )
    assert [(f.worker, f.kind) for f in report.failures] == [("v", "timeout")]


def test_starvation_report_compares_updates_and_time_with_the_plan():
    rep = starvation_report(
        busy_s={"a": 3.0, "b": 1.0},
        updates={"a": 5, "b": 5},
        planned_share={"a": 0.75, "b": 0.25},
        wait_s={"a": 0.0, "b": 2.0},
        wall_s=4.0,
    )
    assert rep["a"]["wall_share"] == 0.75 and rep["a"]["update_share"] == 0.5
    assert rep["a"]["update_ratio"] == pytest.approx(0.5 / 0.75)  # starved vs. its plan
    assert rep["b"]["update_ratio"] == pytest.approx(2.0)  # ran ahead of its plan
    assert rep["b"]["wait_fraction"] == 0.5


class Phased:
    """Produces one record per step; records what ``learn`` was handed."""

    def __init__(self, name: str, delay_s: float, seen: list) -> None:
        self.name, self.delay_s, self.seen = name, delay_s, seen

    def produce(self, k: int) -> list:
        time.sleep(self.delay_s)
        return [f"{self.name}@{k}"]

    def learn(self, k: int, incoming: list[PacedRecord]) -> None:
        self.seen.append((self.name, k, [(r.producer, r.version - 1) for r in incoming]))
        time.sleep(self.delay_s)


def test_phased_workers_use_a_peers_step_at_their_own_step_when_the_peer_is_ahead():
    gate = VersionGate(["fast", "slow"], max_staleness=2)
    seen: list = []
    report = run_paced(
        {"fast": Phased("fast", 0.001, seen), "slow": Phased("slow", 0.02, seen)},
        10,
        gate,
        step_timeout_s=2.0,
    )
    assert report.balanced() and not report.failures
    for _name, k, incoming in seen:
        assert all(step <= k for _, step in incoming)  # nothing from a step ahead of it
    slow = {k: [s for _, s in incoming] for name, k, incoming in seen if name == "slow"}
    assert all(slow[k] == [k] for k in range(10))  # the fast one's step k, at step k
    assert sum(report.dropped_stale.values()) == 0
