"""The server's one idle queue (chunkcache/blend/idle.py) on one rank: the order of kinds, a bound per kind, a key
queued once, a job run a step per turn (so a request waits for one step at most), and the one failure rule. Two
ranks: tests/test_rank_agreements.py (`idle_choice`)."""

import pytest

from chunkcache.blend.idle import KINDS, IdleWork, run_through, timed
from chunkcache.ranks import Ranks


def work(**bounds) -> IdleWork:
    return IdleWork(Ranks(), {kind: bounds.get(kind, 4) for kind in KINDS})


def steps(log: list, name: str, n: int):
    """A job of `n` steps, each noted in `log`; returns its name."""
    for i in range(n):
        log.append(f"{name}{i}")
        if i < n - 1:
            yield
    return name


def test_kinds_run_in_order_oldest_first_and_a_key_waits_once():
    ran, idle = [], work()
    idle.put("audit", lambda: ran.append("audit"))
    assert idle.put("encode", lambda: ran.append("e1"), key="p") and not idle.put("encode", lambda: 1 / 0, key="p")
    idle.put("encode", lambda: ran.append("e2"), key="q")
    idle.put("deviation", lambda: ran.append("deviation"))
    assert idle.state() == {"deviation": 1, "encode": 2, "audit": 1}
    while idle.run_one():
        pass
    assert ran == ["deviation", "e1", "e2", "audit"] and idle.waiting() == 0


def test_a_kind_keeps_its_bound_the_oldest_dropped():
    ran, idle = [], work(encode=2)
    for name in "abc":
        idle.put("encode", lambda name=name: ran.append(name))
    assert idle.waiting("encode") == 2
    while idle.run_one():
        pass
    assert ran == ["b", "c"]
    assert not work(audit=0).put("audit", lambda: None)  # a kind kept at 0 takes nothing


def test_a_job_runs_a_step_per_turn_and_stays_first_until_done():
    """Between two steps the scheduler serves whatever arrived: a request waits for one step at most."""
    log, idle = [], work()
    idle.put("encode", lambda: steps(log, "long", 3))
    idle.put("encode", lambda: steps(log, "next", 1))
    assert idle.run_one() == ("encode", False) and log == ["long0"]
    idle.put("deviation", lambda: steps(log, "dev", 1))  # queued mid-job: the started job finishes first
    assert idle.run_one() == ("encode", False) and idle.run_one() == ("encode", True)
    assert log == ["long0", "long1", "long2"]
    assert idle.run_one() == ("deviation", True) and idle.run_one() == ("encode", True) and idle.run_one() is None
    assert log[-2:] == ["dev0", "next0"]


def test_a_failing_job_is_logged_and_dropped_never_raised(caplog):
    log, idle = [], work()

    def breaks():
        yield
        raise RuntimeError("forward failed")

    idle.put("encode", breaks)
    idle.put("encode", lambda: steps(log, "after", 1))
    assert idle.run_one() == ("encode", False)
    assert idle.run_one() is None and "an idle encode job failed" in caplog.text
    assert idle.run_one() == ("encode", True) and log == ["after0"]


def test_steps_run_through_or_timed_return_the_jobs_value():
    assert run_through(steps([], "x", 3)) == "x"
    timing = timed(steps([], "y", 2))
    next(timing)
    with pytest.raises(StopIteration) as done:
        next(timing)
    value, seconds = done.value.value
    assert value == "y" and seconds >= 0
