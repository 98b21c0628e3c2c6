"""The coordinator's batch ledger: chunks become steps, steps are leased,
done, re-issued, refilled after a cache miss and replayed; epochs turn over."""
from __future__ import annotations

import pytest

from mariana.services.ledger import (ChunkInfo, JobLedger, chunk_event, lease_cap, next_refills, parse_step,
                                     reissue_leases_of, step_id)


def chunk(cid: str = "f0o0", file: int = 0, offset: int = 0, lines: int = 10) -> ChunkInfo:
    return ChunkInfo(cid, file, offset, length=100, first_line=0, lines=lines)


def ledger_with(batches: dict[str, list[tuple[int, int]]], epochs: int = 2, staleness=None,
                source_done: bool = True) -> JobLedger:
    """A ledger whose chunks were sent and cached: chunk -> [(k, rows)]."""
    led = JobLedger("j1", epochs=epochs, staleness=staleness)
    for i, (cid, bs) in enumerate(batches.items()):
        led.chunk_sent(chunk(cid, file=0, offset=i * 100))
        assert led.chunk_cached(cid, bs, {})
    led.source_done = source_done
    return led


def finish_all(led: JobLedger, worker: str = "w0") -> list[str]:
    """Lease and report every ready step; returns them in lease order."""
    steps = []
    while (step := led.lease(worker, 60)) is not None:
        assert led.step_done(step, worker, led.batch_rows[parse_step(step)[1]], 0.5, {})
        steps.append(step)
    return steps


# ---- step ids ----------------------------------------------------------------------


def test_step_ids():
    assert step_id(2, "f0o0:3") == "e2/f0o0:3"
    assert parse_step("e2/f0o0:3") == (2, "f0o0:3")
    assert parse_step("e12/f1o4096:0") == (12, "f1o4096:0")
    assert parse_step("e1/a/b") == (1, "a/b")


@pytest.mark.parametrize("bad", ["", "f0o0:3", "e/f0o0:3", "x2/f0o0:3", "e2", "e2/", "e-1/a", "e1.5/a",
                                 "E2/a", "/e2/a", "e 2/a"])
def test_parse_step_rejects(bad):
    with pytest.raises(ValueError, match="not a step id"):
        parse_step(bad)


# ---- chunks ------------------------------------------------------------------------


def test_cached_chunks_make_ready_steps_in_order():
    led = JobLedger("j1", epochs=1)
    led.chunk_sent(chunk("f0o0"), seconds=0.5)
    led.chunk_sent(chunk("f0o100", offset=100))
    assert list(led.ready) == [] and led.chunks["f0o0"].state == "sent"
    assert led.chunk_cached("f0o0", [(0, 4), (1, 2)], {"rows_ok": 6, "rows_bad": 1, "parse_s": 0.25})
    assert led.chunk_cached("f0o100", [(0, 3)], {"rows_ok": 3})
    assert list(led.ready) == ["e1/f0o0:0", "e1/f0o0:1", "e1/f0o100:0"]
    assert led.batches == ["f0o0:0", "f0o0:1", "f0o100:0"]
    assert led.batch_rows == {"f0o0:0": 4, "f0o0:1": 2, "f0o100:0": 3}
    assert led.chunks["f0o0"].state == "cached" and led.chunks["f0o0"].batches == [(0, 4), (1, 2)]
    assert led.counters["rows_in_data"] == 9 and led.counters["bad_rows"] == 1
    assert led.stage_seconds["read"] == 0.5 and led.stage_seconds["parse"] == 0.25


def test_chunk_sent_twice_keeps_the_first():
    led = JobLedger("j1", epochs=1)
    led.chunk_sent(chunk("f0o0", lines=10), seconds=1.0)
    led.chunk_sent(chunk("f0o0", lines=99), seconds=1.0)
    assert led.chunks["f0o0"].lines == 10 and led.stage_seconds["read"] == 1.0


def test_duplicate_cached_adds_nothing():
    led = ledger_with({"f0o0": [(0, 4)]})
    assert not led.chunk_cached("f0o0", [(0, 4), (1, 4)], {"rows_ok": 8})
    assert list(led.ready) == ["e1/f0o0:0"] and led.batches == ["f0o0:0"]
    assert led.counters["duplicate_chunks"] == 1 and led.counters["rows_in_data"] == 0
    assert led.chunks["f0o0"].batches == [(0, 4)]


def test_cached_before_sent_is_accepted():
    led = JobLedger("j1", epochs=1)
    assert led.chunk_cached("f3o0", [(0, 5)], {})
    assert list(led.ready) == ["e1/f3o0:0"] and led.chunks["f3o0"].file == -1
    assert led.chunks_overdue(-1.0) == []  # no file to read it again from


def test_chunks_overdue_lists_sent_chunks():
    led = JobLedger("j1", epochs=1)
    led.chunk_sent(chunk("f0o0"))
    led.chunk_sent(chunk("f0o100", offset=100))
    led.chunk_cached("f0o100", [(0, 1)], {})
    assert [c.id for c in led.chunks_overdue(-1.0)] == ["f0o0"]
    assert led.chunks_overdue(3600.0) == []
    led.chunk_resent(led.chunks["f0o0"])
    assert led.chunks["f0o0"].resends == 1


# ---- leases ------------------------------------------------------------------------


def test_lease_and_done():
    led = ledger_with({"f0o0": [(0, 4), (1, 2)]})
    assert led.lease("w0", 60) == "e1/f0o0:0"
    assert led.lease("w1", 60) == "e1/f0o0:1"
    assert led.lease("w2", 60) is None
    assert set(led.leased) == {"e1/f0o0:0", "e1/f0o0:1"} and led.leased["e1/f0o0:1"].worker == "w1"
    assert led.step_done("e1/f0o0:0", "w0", 4, 2.0, {"pull": 0.5, "bogus": 9.0})
    assert "e1/f0o0:0" in led.done and "e1/f0o0:0" not in led.leased
    assert led.rows_done[1] == 4 and led.loss_sum[1] == 2.0 and led.worker_done["w0"] == 1
    assert led.stage_seconds["pull"] == 0.5 and "bogus" not in led.stage_seconds
    assert led.counters["cache_hits"] == 0  # epoch 1 reads the source


def test_duplicate_done_counts_once():
    led = ledger_with({"f0o0": [(0, 4)]})
    step = led.lease("w0", 60)
    assert led.step_done(step, "w0", 4, 2.0, {})
    assert not led.step_done(step, "w1", 4, 3.0, {})
    assert led.rows_done[1] == 4 and led.loss_sum[1] == 2.0
    assert led.worker_done == {"w0": 1} and led.counters["duplicate_done"] == 1


@pytest.mark.parametrize("times", [{"pull": "x"}, {"pull": [1]}, {"push": b"1"}, [0.5]])
def test_step_done_with_bad_stage_times_changes_nothing(times):
    led = ledger_with({"f0o0": [(0, 4)]})
    step = led.lease("w0", 60)
    with pytest.raises(ValueError, match="stats.times"):
        led.step_done(step, "w0", 4, 1.0, times)
    assert step in led.leased and not led.done and not led.rows_done and not led.stage_seconds["pull"]
    assert led.step_done(step, "w0", 4, 1.0, {"pull": 0.25, "other": "ignored"})
    assert led.stage_seconds["pull"] == 0.25 and "other" not in led.stage_seconds


def test_step_done_rejects_a_bad_step_id():
    led = ledger_with({"f0o0": [(0, 4)]})
    with pytest.raises(ValueError):
        led.step_done("f0o0:0", "w0", 4, 1.0, {})
    assert led.done == set()


def test_lapsed_leases_go_back_to_the_head():
    led = ledger_with({"f0o0": [(0, 4), (1, 4), (2, 4)]})
    assert led.lease("w0", -1.0) == "e1/f0o0:0"   # already lapsed
    assert led.lease("w1", 3600.0) == "e1/f0o0:1"
    assert led.expire_leases() == [("e1/f0o0:0", "w0")]
    assert list(led.ready) == ["e1/f0o0:0", "e1/f0o0:2"]
    assert set(led.leased) == {"e1/f0o0:1"}
    assert led.counters["batches_reissued"] == 1
    assert led.expire_leases() == [] and led.counters["batches_reissued"] == 1
    assert led.lease("w2", 60) == "e1/f0o0:0"


def test_released_steps_go_back_to_the_head_in_lease_order():
    led = ledger_with({"f0o0": [(0, 4), (1, 4), (2, 4), (3, 4)]})
    out = [led.lease("w0", 3600.0) for _ in range(3)]
    assert led.lease("w1", 3600.0) == "e1/f0o0:3"
    # a stopping worker hands back what it had not trained; another worker's and unknown steps stay
    assert led.release(out[1:] + ["e1/f0o0:3", "e1/f9o0:0"], "w0") == 2
    assert list(led.ready) == ["e1/f0o0:1", "e1/f0o0:2"]
    assert set(led.leased) == {"e1/f0o0:0", "e1/f0o0:3"}
    assert led.release(out[1:], "w0") == 0  # twice: nothing more
    assert led.counters["batches_reissued"] == 0  # handed back, not lapsed
    assert [led.lease("w1", 60) for _ in range(3)] == ["e1/f0o0:1", "e1/f0o0:2", None]


def test_a_restarted_workers_leases_are_issued_again_at_once():
    """A worker that restarted holds nothing it leased before: its steps go first in line at
    once (they used to wait out coordinator.lease_seconds), in lease order; others' stay."""
    led = ledger_with({"f0o0": [(0, 4), (1, 4), (2, 4), (3, 4)]})
    mine = [led.lease("worker-1", 3600.0) for _ in range(2)]
    assert led.lease("worker-0", 3600.0) == "e1/f0o0:2"
    assert reissue_leases_of(led, "worker-1") == 2
    assert list(led.ready) == mine + ["e1/f0o0:3"] and set(led.leased) == {"e1/f0o0:2"}
    assert led.counters["batches_reissued"] == 2
    assert reissue_leases_of(led, "worker-1") == 0 and led.counters["batches_reissued"] == 2


def test_late_done_of_a_reissued_step_is_skipped_by_lease():
    led = ledger_with({"f0o0": [(0, 4), (1, 4)]})
    led.lease("w0", -1.0)
    led.expire_leases()
    assert led.step_done("e1/f0o0:0", "w0", 4, 1.0, {})  # the slow worker finished after all
    assert led.lease("w1", 60) == "e1/f0o0:1"            # not the done one again
    assert led.lease("w1", 60) is None


# ---- epochs ------------------------------------------------------------------------


def test_epoch_complete_needs_source_done_and_every_step():
    led = ledger_with({"f0o0": [(0, 4), (1, 2)]}, source_done=False)
    finish_all(led)
    assert not led.epoch_complete()          # the loader may still send chunks
    led.source_done = True
    assert led.epoch_complete()


def test_epoch_not_complete_while_a_chunk_is_uncached_or_a_step_out():
    led = ledger_with({"f0o0": [(0, 4), (1, 2)]})
    led.chunk_sent(chunk("f0o100", offset=100))
    step = led.lease("w0", 60)
    assert not led.epoch_complete()
    led.step_done(step, "w0", 4, 0.0, {})
    finish_all(led)
    assert not led.epoch_complete()          # f0o100 is still being parsed
    led.chunk_cached("f0o100", [(0, 3)], {})
    assert not led.epoch_complete()          # its step is ready
    step = led.lease("w0", 60)
    assert not led.epoch_complete()          # ... then leased
    led.step_done(step, "w0", 3, 0.0, {})
    assert led.epoch_complete()


def test_next_epoch_queues_every_batch_again():
    led = ledger_with({"f0o0": [(0, 4), (1, 2)], "f0o100": [(0, 3)]}, epochs=2)
    finish_all(led)
    assert led.epoch_complete()
    led.next_epoch()
    assert led.epoch == 2 and len(led.epoch_seconds) == 1
    assert list(led.ready) == ["e2/f0o0:0", "e2/f0o0:1", "e2/f0o100:0"]
    assert not led.epoch_complete()
    assert led.expected_steps() == {"e1/f0o0:0", "e1/f0o0:1", "e1/f0o100:0",
                                    "e2/f0o0:0", "e2/f0o0:1", "e2/f0o100:0"}
    finish_all(led)
    assert led.epoch_complete() and led.rows_done == {1: 9, 2: 9}
    assert led.counters["cache_hits"] == 3
    led.next_epoch()                          # past the last epoch: nothing more
    assert led.epoch == 3 and list(led.ready) == []


def test_cache_miss_refills_the_step():
    led = ledger_with({"f0o0": [(0, 4), (1, 2)]}, epochs=2)
    finish_all(led)
    led.next_epoch()
    assert led.lease("w0", 60) == "e2/f0o0:0"
    assert led.missed("e2/f0o0:0") == "f0o0"   # ask the loader for f0o0 again
    assert "e2/f0o0:0" not in led.leased and led.chunks["f0o0"].state == "refill"
    assert led.refill == {"f0o0": ["e2/f0o0:0"]} and led.counters["cache_misses"] == 1
    assert not led.epoch_complete()
    assert led.chunks_overdue(-1.0) == []      # queued, not yet asked for: nothing is overdue
    assert [c.id for c in next_refills(led, 1)] == ["f0o0"] and led.chunks["f0o0"].state == "resent"
    assert next_refills(led, 1) == []
    assert [c.id for c in led.chunks_overdue(-1.0)] == ["f0o0"]

    # the other step is served from the cache meanwhile
    assert led.lease("w1", 60) == "e2/f0o0:1"
    assert led.step_done("e2/f0o0:1", "w1", 2, 0.0, {})
    assert led.counters["cache_hits"] == 1
    assert led.lease("w1", 60) is None

    # preprocess caches the chunk again: the waiting step is back, nothing new is added
    assert led.chunk_cached("f0o0", [(0, 4), (1, 2)], {"rows_ok": 6})
    assert list(led.ready) == ["e2/f0o0:0"] and led.refill == {}
    assert led.batches == ["f0o0:0", "f0o0:1"] and led.counters["rows_in_data"] == 0
    assert led.lease("w0", 60) == "e2/f0o0:0"
    assert led.step_done("e2/f0o0:0", "w0", 4, 0.0, {})
    assert led.counters["cache_hits"] == 1     # the refilled step read the source
    assert led.epoch_complete() and led.rows_done[2] == 6


def test_second_miss_of_a_refilling_chunk_does_not_resend():
    led = ledger_with({"f0o0": [(0, 4), (1, 2)]}, epochs=2)
    finish_all(led)
    led.next_epoch()
    a, b = led.lease("w0", 60), led.lease("w1", 60)
    assert led.missed(a) == "f0o0"
    assert led.missed(b) == ""
    assert led.refill == {"f0o0": [a, b]} and led.counters["cache_misses"] == 2
    led.chunk_cached("f0o0", [(0, 4), (1, 2)], {})
    assert set(led.ready) == {a, b}


def test_misses_of_a_chunk_after_it_was_cached_are_counted_per_epoch():
    """What fails a job whose cached batches keep vanishing (coord_jobs.pump_refills): counted
    afresh each epoch, where batches past cache.max_bytes expire by design."""
    led = ledger_with({"f0o0": [(0, 4)]}, epochs=3)
    finish_all(led)
    for epoch, times in ((2, 3), (3, 1)):
        led.next_epoch()
        for _ in range(times):
            step = led.lease("w0", 60)
            assert led.missed(step) == "f0o0"
            assert [c.id for c in next_refills(led, 1)] == ["f0o0"]
            assert led.chunk_cached("f0o0", [(0, 4)], {})
        assert led.chunks["f0o0"].misses == (epoch, times)
        finish_all(led)


def test_lost_chunk_marks_waiting_steps_lost():
    led = ledger_with({"f0o0": [(0, 4), (1, 2)]}, epochs=2)
    finish_all(led)
    led.next_epoch()
    step = led.lease("w0", 60)
    led.missed(step)
    finish_all(led)
    assert not led.epoch_complete()
    led.chunk_lost("f0o0")
    assert led.lost == {step} and led.refill == {} and led.chunks["f0o0"].state == "lost"
    assert led.counters["lines_lost"] == 0       # its rows were cached once
    assert led.epoch_complete()                  # a lost step does not hold the epoch up


def test_lost_chunk_never_cached_counts_its_lines():
    led = JobLedger("j1", epochs=1)
    led.chunk_sent(chunk("f0o0", lines=7))
    led.source_done = True
    assert not led.epoch_complete()
    led.chunk_lost("f0o0")
    led.chunk_lost("nope")                       # unknown: ignored
    assert led.counters["lines_lost"] == 7 and led.lost == set()
    assert led.epoch_complete()


def test_replay_moves_done_steps_back():
    led = ledger_with({"f0o0": [(0, 4), (1, 2)], "f0o100": [(0, 3)]}, epochs=2)
    finish_all(led)
    assert led.rows_done[1] == 9
    n = led.replay({"e1/f0o0:1", "e1/f0o100:0", "e1/never:0"})
    assert n == 2
    assert led.done == {"e1/f0o0:0"}
    assert set(led.ready) == {"e1/f0o0:1", "e1/f0o100:0"} and len(led.ready) == 2
    assert led.counters["batches_replayed"] == 2 and led.rows_done[1] == 4
    assert not led.epoch_complete()
    again = finish_all(led, "w1")
    assert sorted(again) == ["e1/f0o0:1", "e1/f0o100:0"]
    assert led.epoch_complete() and led.rows_done[1] == 9


def test_replay_goes_before_queued_steps():
    led = ledger_with({"f0o0": [(0, 4), (1, 2)]}, epochs=2)
    finish_all(led)
    led.next_epoch()
    led.replay({"e1/f0o0:0"})
    assert list(led.ready) == ["e1/f0o0:0", "e2/f0o0:0", "e2/f0o0:1"]


# ---- staleness ---------------------------------------------------------------------


def test_bsp_blocks_a_worker_one_step_ahead():
    led = ledger_with({"f0o0": [(0, 1), (1, 1), (2, 1), (3, 1)]}, staleness=0)
    active = {"w0", "w1"}
    assert led.may_lease("w0", active) and led.may_lease("w1", active)
    a = led.lease("w0", 60)
    assert not led.may_lease("w0", active)       # holds a step the others have not matched
    led.step_done(a, "w0", 1, 0.0, {})
    assert not led.may_lease("w0", active)       # one step ahead of w1
    assert led.may_lease("w1", active)
    b = led.lease("w1", 60)
    assert not led.may_lease("w0", active)       # w1 has not finished yet
    led.step_done(b, "w1", 1, 0.0, {})
    assert led.may_lease("w0", active) and led.may_lease("w1", active)


def test_bsp_ignores_workers_that_are_not_active():
    led = ledger_with({"f0o0": [(0, 1), (1, 1)]}, staleness=0)
    led.step_done(led.lease("w0", 60), "w0", 1, 0.0, {})
    assert not led.may_lease("w0", {"w0", "w1"})
    assert led.may_lease("w0", {"w0"})


def test_bounded_staleness_of_one():
    led = ledger_with({"f0o0": [(k, 1) for k in range(4)]}, staleness=1)
    active = {"w0", "w1"}
    led.step_done(led.lease("w0", 60), "w0", 1, 0.0, {})
    assert led.may_lease("w0", active)           # one ahead is allowed
    led.step_done(led.lease("w0", 60), "w0", 1, 0.0, {})
    assert not led.may_lease("w0", active)       # two ahead is not


def test_asynchronous_always_allows():
    led = ledger_with({"f0o0": [(k, 1) for k in range(4)]}, staleness=None)
    for _ in range(3):
        led.step_done(led.lease("w0", 60), "w0", 1, 0.0, {})
    led.lease("w0", 60)
    assert led.may_lease("w0", {"w0", "w1"})


def concurrent_leases(led: JobLedger, workers: list[str]) -> list[int]:
    """Lease as the coordinator does (every worker while may_lease allows), finish them all, repeat:
    the steps out at once in each round."""
    rounds = []
    while True:
        out = []
        for w in workers:
            if led.may_lease(w, set(workers)) and (step := led.lease(w, 60, len(workers))) is not None:
                out.append((step, w))
        if not out:
            return rounds
        rounds.append(len(out))
        for step, w in out:
            assert led.step_done(step, w, 1, 0.0, {})


def test_the_ramp_lets_workers_step_at_once_only_past_a_jobs_first_steps():
    led = ledger_with({"f0o0": [(k, 1) for k in range(100)]}, epochs=2)
    led.ramp = 4  # one step at a time for the first 4 steps, at most two until 16 are done
    rounds = concurrent_leases(led, ["w0", "w1", "w2"])
    assert rounds[:4] == [1, 1, 1, 1] and rounds[4:10] == [2] * 6 and set(rounds[10:-1]) == {3}, rounds
    assert sum(rounds) == 100 and led.counters["ramped_steps"] == 16  # leased under a limit
    led.next_epoch()  # the job's steps done, not the epoch's: epoch 2 starts at full width
    assert concurrent_leases(led, ["w0", "w1", "w2"])[0] == 3 and led.counters["ramped_steps"] == 16
    led.replay(set(led.done))  # a shard restored from its start: the ramp does not start again
    assert lease_cap(led, 3) > 3


def test_the_ramp_counts_steps_leased_not_polls_refused_by_bsp():
    led = ledger_with({"f0o0": [(k, 1) for k in range(40)]}, staleness=0)
    led.ramp = 4
    active = {"w0", "w1", "w2"}
    led.worker_done.update({"w0": 3, "w1": 2, "w2": 2})  # 7 done: at most 2 out; w0 one step ahead
    assert lease_cap(led, 3) == 2
    for _ in range(10):  # refused by BSP, under the ramp's limit: nothing counted
        assert not led.may_lease("w0", active)
    assert led.may_lease("w1", active) and led.lease("w1", 60, 3) is not None
    assert led.counters["ramped_steps"] == 1


def test_the_ramp_holds_no_lone_worker_and_no_lr_job():
    led = ledger_with({"f0o0": [(k, 1) for k in range(20)]})
    led.ramp = 4
    assert lease_cap(led, 1) > 1 and lease_cap(led, 2) == 1
    assert concurrent_leases(led, ["w0"]) == [1] * 20 and led.counters["ramped_steps"] == 0
    led = ledger_with({"f0o0": [(k, 1) for k in range(20)]})  # ramp 0: an LR job's "auto"
    assert concurrent_leases(led, ["w0", "w1", "w2"])[0] == 3 and led.counters["ramped_steps"] == 0


def test_progress():
    led = ledger_with({"f0o0": [(0, 4), (1, 2)]}, epochs=2)
    led.step_done(led.lease("w0", 60), "w0", 4, 2.0, {})
    p = led.progress()
    assert (p["epoch"], p["epochs"], p["rows"], p["loss"]) == (1, 2, 4, 0.5)
    assert (p["ready"], p["leased"], p["chunks"], p["batches"], p["source_done"]) == (1, 0, 1, 2, True)


def test_refills_go_out_a_few_at_a_time():
    led = ledger_with({f"f0o{i}": [(0, 1)] for i in range(5)}, epochs=2)
    finish_all(led)
    led.next_epoch()
    for _ in range(5):  # a restarted Redis: every read misses
        led.missed(led.lease("w0", 60))
    assert [c.id for c in next_refills(led, 2)] == ["f0o0", "f0o1"]
    assert next_refills(led, 2) == []           # two in flight already
    assert led.chunk_cached("f0o0", [(0, 1)], {})
    assert [c.id for c in next_refills(led, 2)] == ["f0o2"]


def test_a_lost_chunk_does_not_hold_up_later_epochs():
    led = ledger_with({"f0o0": [(0, 4)], "f0o9": [(0, 2)]}, epochs=3)
    finish_all(led)
    led.next_epoch()
    assert led.lease("w0", 60) == "e2/f0o0:0"
    led.missed("e2/f0o0:0")
    assert [c.id for c in next_refills(led, 2)] == ["f0o0"]
    led.chunk_lost("f0o0")                                  # the source changed: it cannot be read again
    assert led.lost == {"e2/f0o0:0"} and led.refill == {}
    assert led.lease("w0", 60) == "e2/f0o9:0" and led.step_done("e2/f0o9:0", "w0", 2, 0.0, {})
    assert led.epoch_complete()
    led.next_epoch()                                        # epoch 3 does not wait for it either
    assert list(led.ready) == ["e3/f0o9:0"] and "e3/f0o0:0" in led.lost


def test_a_miss_of_a_lost_chunk_is_lost_at_once():
    led = ledger_with({"f0o0": [(0, 4), (1, 4)]}, epochs=2)
    finish_all(led)
    led.next_epoch()
    a, b = led.lease("w0", 60), led.lease("w1", 60)
    led.missed(a)
    next_refills(led, 2)
    led.chunk_lost("f0o0")
    assert led.missed(b) == "" and b in led.lost and led.refill == {}


def test_a_chunk_first_cached_after_epoch_1_is_refused():
    led = ledger_with({"f0o0": [(0, 4)]}, epochs=2)
    led.chunk_sent(ChunkInfo("f0o9", 0, 9, 10, 5, 3))
    led.chunk_lost("f0o9")                                  # never cached: given up on
    finish_all(led)
    led.next_epoch()
    rows = led.counters["rows_in_data"]
    assert not led.chunk_cached("f0o9", [(0, 3)], {"rows_ok": 3})
    assert led.batches == ["f0o0:0"] and led.counters["rows_in_data"] == rows


def test_cached_stats_that_are_not_numbers_change_nothing():
    led = JobLedger("j", epochs=1)
    led.chunk_sent(ChunkInfo("f0o0", 0, 0, 10, 1, 4))
    with pytest.raises(ValueError):
        led.chunk_cached("f0o0", [(0, 4)], {"parse_s": "slow"})
    assert led.chunks["f0o0"].state == "sent" and led.batches == []
    assert led.chunk_cached("f0o0", [(0, 4)], {"rows_ok": 4})
    assert led.batches == ["f0o0:0"]


# ---- the journal ----------------------------------------------------------------------


def _journaled(led: JobLedger, events: list, kind: str, data: dict):
    """What the coordinator does: apply, and record what changed something."""
    changed = led.apply(kind, data)
    if changed is not False:
        events.append((kind, data))
    return changed


def test_replaying_the_journal_rebuilds_the_ledger_and_leases_what_is_not_done():
    live, events = JobLedger("j1", epochs=2), []
    _journaled(live, events, "start", {"t": 1000.0})
    for i, cid in enumerate(("f0o0", "f0o100")):
        _journaled(live, events, "sent", chunk_event(chunk(cid, offset=i * 100), 0.1))
        _journaled(live, events, "cached", {"chunk": cid, "batches": [[0, 4], [1, 3]], "stats": {"rows_ok": 7}})
    assert _journaled(live, events, "sent", chunk_event(chunk("f0o0"), 0.1)) is False  # a repeat
    _journaled(live, events, "source_done", {"chunks": 2})
    hist = [[0] * 127 + [3], [4] + [0] * 127]
    for _ in range(4):
        step = live.lease("w0", 60)
        _journaled(live, events, "done", {"step": step, "worker": "w0", "rows": 4, "loss_sum": 2.0,
                                          "times": {}, "hist": hist})
    assert live.epoch_complete()
    _journaled(live, events, "epoch", {"t": 1010.0})
    leased = live.lease("w0", 60)  # in flight when the coordinator died: not journaled
    assert len(events) == 1 + 4 + 1 + 4 + 1

    restored = JobLedger("j1", epochs=2)
    for kind, data in events:
        restored.apply(kind, data)
    assert (restored.epoch, restored.done, restored.batches, restored.source_done) == (
        live.epoch, live.done, live.batches, True)
    assert restored.rows_done == live.rows_done and restored.counters["rows_in_data"] == 14
    assert restored.epoch_summaries == [{"epoch": 1, "seconds": 10.0, "rows": 16, "loss": 0.5, "auc": 1.0}]
    again = []
    while (step := restored.lease("w1", 60)) is not None:
        again.append(step)
    assert leased in again and sorted(again) == sorted(restored.epoch_steps(2))


def test_a_published_record_survives_a_restart():
    """Once the version is written the journal holds its record: a restarted coordinator ends
    the job with it instead of exporting again (coord_jobs.JobRunner.run_job)."""
    led = JobLedger("j1", epochs=1)
    assert led.published is None
    record = {"model_dir": "/m", "model_version": "v000001", "auc": 0.7, "rows_applied": 16}
    assert led.apply("published", {"record": record}) is True
    restored = JobLedger("j1", epochs=1)
    restored.apply("published", {"record": record})
    assert restored.published == record and restored.published is not record
    with pytest.raises(ValueError, match="without its record"):
        JobLedger("j1", epochs=1).apply("published", {"record": "v000001"})


def test_bad_journal_events_change_nothing():
    led = ledger_with({"f0o0": [(0, 4)]})
    with pytest.raises(ValueError, match="unknown journal event"):
        led.apply("teleport", {})
    step = led.lease("w0", 60)
    with pytest.raises(ValueError, match="2 x 128"):
        led.apply("done", {"step": step, "worker": "w0", "rows": 4, "loss_sum": 1.0, "hist": [[1, 2], [3, 4]]})
    assert step not in led.done and led.rows_done[1] == 0


def test_progress_fraction_estimates_epoch_1_from_bytes_then_counts_rows():
    led = JobLedger("j1", epochs=2, data_bytes=400)  # four chunks of 100 bytes; one cached so far
    led.chunk_sent(chunk("f0o0"))
    led.chunk_cached("f0o0", [(0, 10)], {"rows_ok": 10})
    led.step_done(led.lease("w0", 60), "w0", 10, 1.0, {})
    assert led.fraction() == 0.125  # 10 rows of an estimated 40, epoch 1 of 2
    led.source_done = True
    assert led.fraction() == 0.5    # the source is read: 10 rows is all of epoch 1


def test_a_job_writing_its_version_cannot_be_cancelled_and_a_cancelled_one_writes_none():
    """The coordinator's handshake between a cancel (the event loop) and the thread that
    writes a job's version: whichever comes first wins, and only once."""
    from mariana.services.coord_state import JobRun
    from mariana.services.jobspec import JobSpec
    from mariana.trainer.config import JobConfig

    def run(state: str) -> JobRun:
        config = JobConfig()
        return JobRun("j1", {"mode": "async"}, JobSpec(config, config.data.resolve_schema()),
                      JobLedger("j1", epochs=1), state=state)

    writing = run("running")
    assert writing.begin_writing() is True
    assert writing.cancel() == "writing" and writing.state == "running"  # refused: it ends done
    cancelled = run("running")
    assert cancelled.cancel() == "cancelled" and cancelled.state == "cancelled" and cancelled.error
    assert cancelled.begin_writing() is False and not cancelled.writing  # nothing is written
    assert cancelled.cancel() == "ended"
    assert run("queued").cancel() == "cancelled"
    assert run("done").cancel() == "ended"


def test_a_jobs_warnings_are_kept_once_each_and_outlive_a_coordinator_restart():
    """A shard's warning (its tables too big for its memory) reaches the job's summary once,
    though a restarted shard says it again in every StartJob answer; None adds nothing; the
    saved job keeps them."""
    from mariana.services.coord_state import MAX_WARNINGS, JobRun
    from mariana.services.jobspec import JobSpec
    from mariana.trainer.config import JobConfig

    config = JobConfig()
    run = JobRun("j1", {"mode": "async"}, JobSpec(config, config.data.resolve_schema()), JobLedger("j1", epochs=1))
    assert run.summary()["warnings"] == []
    for who, text in [("ps-0", "too big"), ("ps-0", None), ("ps-0", "too big"), ("ps-1", "too big"), ("ps-1", 7)]:
        run.warn(text, who)
    assert run.summary()["warnings"] == ["ps-0: too big", "ps-1: too big"]
    assert JobRun.from_saved(run.to_saved()).warnings == ["ps-0: too big", "ps-1: too big"]
    for i in range(2 * MAX_WARNINGS):
        run.warn("too big", f"ps-{i}")
    assert len(run.warnings) == MAX_WARNINGS


def test_steps_replayed_after_the_last_epoch_go_out_and_complete_it_again():
    """A shard restored after the last epoch's end lacks steps; the coordinator replays them
    before the export: the job counts as active while they are out (`replaying`), and the last
    epoch is complete again once they are done."""
    led = ledger_with({"f0o0": [(0, 10), (1, 10)]}, epochs=1)
    finish_all(led)
    assert led.epoch_complete()
    led.next_epoch()
    assert led.epoch == 2 and not led.replaying() and led.epoch_complete()
    assert led.replay({"e1/f0o0:1"}) == 1
    assert led.replaying() and not led.epoch_complete() and led.rows_done[1] == 10
    assert finish_all(led) == ["e1/f0o0:1"]
    assert not led.replaying() and led.epoch_complete() and led.rows_done[1] == 20
    # its loss counted once: a shard restarted late doubled the record's train_loss (0.83 for 0.41)
    assert led.loss_sum[1] == 2 * 0.5


def test_a_step_replayed_mid_epoch_counts_its_loss_and_auc_once():
    led = ledger_with({"f0o0": [(0, 10), (1, 10)]}, epochs=1)
    hist = [[1] + [0] * 127, [0] * 127 + [2]]
    step = led.lease("w0", 60)
    assert led.step_done(step, "w0", 10, 4.0, {}, hist)
    assert led.replay({step}) == 1
    again = led.lease("w0", 60)
    assert again == step and led.step_done(step, "w0", 10, 3.0, {}, hist)
    assert led.loss_sum[1] == 4.0 and led.rows_done[1] == 10 and led.hist[1].sum() == 3


def test_a_cluster_jobs_peak_rss_is_of_its_own_run_not_the_coordinators_lifetime():
    """A cluster job's record said peak_rss_mb 1197.8 for an LR job that ran after a DNN job:
    the coordinator's lifetime peak (VmHWM). Now the largest RSS of one process while the job
    ran: the coordinator's current one and each service's last heartbeat (its resident_memory_bytes)."""
    from types import SimpleNamespace

    from mariana.services.coord_jobs import sample_rss
    from mariana.services.runtime.memwatch import rss_bytes

    import time

    from mariana.services.coord_state import ServiceInfo

    now = time.time()
    services = {"coordinator-0": ServiceInfo("coordinator", 0, last_seen=now, status={"resident_memory_bytes": 9e15}),
                "ps-0": ServiceInfo("ps", 0, last_seen=now, status={"resident_memory_bytes": 123456 << 20}),
                "ps-1": ServiceInfo("ps", 1, last_seen=now - 600, status={"resident_memory_bytes": 9e15}),  # gone
                "worker-0": ServiceInfo("worker", 0, last_seen=now, status={})}  # before its first heartbeat
    coord = SimpleNamespace(services=services, cfg=SimpleNamespace(coordinator=SimpleNamespace(heartbeat_seconds=5)))
    run = SimpleNamespace(peak_rss_mb=0.0)
    sample_rss(coord, run)
    assert run.peak_rss_mb == 123456.0
    services["ps-0"].status["resident_memory_bytes"] = 10 << 20  # a peak stays the peak
    sample_rss(coord, run)
    assert run.peak_rss_mb == 123456.0
    del services["ps-0"]
    run.peak_rss_mb = 0.0
    sample_rss(coord, run)
    assert 0 < run.peak_rss_mb <= rss_bytes() / (1 << 20) * 1.5  # the coordinator's own, measured now


def test_a_step_never_issued_is_refused_not_counted():
    """A Done for a made-up step ("e1/zzfake:0", 10**9 rows: any peer of the ZeroMQ port can
    send one) was counted: the record said 3,001,500,000 rows trained of a 500,000-row file."""
    led = ledger_with({"f0o0": [(0, 10)]}, epochs=2)
    for step in ("e1/zzfake:0", "e0/f0o0:0"):
        with pytest.raises(ValueError, match="is no step of job"):
            led.step_done(step, "w0", 10**9, 0.0, {})
    # a step of an epoch early stopping dropped (leased before it stopped) is let go, not refused
    led.stop_after(1)
    assert led.step_done("e2/f0o0:0", "w0", 10, 0.0, {}) is False and led.counters["dropped_epoch_steps"] == 1
    assert sum(led.rows_done.values()) == 0 and not led.done


def test_progress_counts_ready_steps_not_those_done_or_out():
    """After a coordinator restart a done job's progress said 476 ready of its 238 batches: the
    queue keeps steps done meanwhile (a lease skips them; a replayed journal leaves them all)."""
    led = ledger_with({"f0o0": [(0, 10), (1, 10), (2, 10)]}, epochs=1)
    steps = finish_all(led)
    led.next_epoch()  # the last epoch ended: the job is finished
    led.ready.extend(steps)  # as a journal replayed at a restart leaves them
    assert led.progress()["ready"] == 0 and len(led.ready) == 3


def test_a_running_jobs_progress_counts_ready_steps_not_those_done_or_out():
    """As above, while the job runs (it was counted only once the job had finished)."""
    led = ledger_with({"f0o0": [(0, 10), (1, 10), (2, 10)]}, epochs=2)
    steps = finish_all(led)
    led.ready.extend(steps)  # done, and queued again (a lapsed lease, a replayed journal)
    assert led.progress()["ready"] == 0 and len(led.ready) == 3


def test_a_history_points_rows_per_s_spans_the_ticks_without_rows_before_it(monkeypatch):
    """The history chart's rows/s: a tick with no new rows stores no point, but it moved the
    start of the next one's interval, whose rows were divided by that one tick's second: 3x
    the job's rate right after each stall (an exploratory round measured 4,081 rows/s where
    the rows came at 1,358). Each point's rate is its rows over the time since the point before."""
    from types import SimpleNamespace

    from mariana.services import coord_jobs

    clock = [1000.0]
    monkeypatch.setattr(coord_jobs.time, "time", lambda: clock[0])
    points = []
    coord = SimpleNamespace(store=SimpleNamespace(add_point=lambda job, p: points.append(p)))
    led = SimpleNamespace(rows_done={1: 0}, loss_sum={1: 0.0}, hist=None, epoch=1, epochs=1)
    run = SimpleNamespace(id="j1", ledger=led, started=1000.0, state="running", last_point=None)
    for t, rows in ((1001, 1000), (1002, 1000), (1003, 1000), (1004, 4000), (1005, 5000)):
        clock[0], led.rows_done[1], led.loss_sum[1] = float(t), rows, rows * 0.5
        coord_jobs.add_point(coord, run)
    assert [(p["t"], p["rows_total"], p["rows_per_s"]) for p in points] == [
        (1001, 1000, 1000.0), (1004, 4000, 1000.0), (1005, 5000, 1000.0)]  # no 3,000 after the stall
    assert all(p["loss"] == 0.5 for p in points)


def test_a_cluster_jobs_peak_rss_counts_the_export():
    """The periodic tick samples only while steps go out, and the coordinator holds the whole
    model after that, at the export: a record said 928 MB while the coordinator reached 3.6 GB.
    `sampled` samples while its work runs: here 256 MiB written in a thread, held 1 s, freed."""
    import asyncio
    import time
    from types import SimpleNamespace

    import numpy as np

    from mariana.services.coord_jobs import sampled
    from mariana.services.runtime.memwatch import rss_bytes

    coord = SimpleNamespace(services={}, cfg=SimpleNamespace(coordinator=SimpleNamespace(heartbeat_seconds=5)))
    run = SimpleNamespace(peak_rss_mb=0.0)
    before = rss_bytes() / (1 << 20)

    def export() -> str:
        held = np.ones(256 << 18, np.float32)  # 256 MiB, every page written
        time.sleep(1.0)
        return f"{held.size}"

    assert asyncio.run(sampled(coord, run, asyncio.to_thread(export))) == str(256 << 18)
    assert run.peak_rss_mb >= before + 200, (before, run.peak_rss_mb)
    assert rss_bytes() / (1 << 20) < run.peak_rss_mb - 200  # freed since: the peak is the export's


def test_an_ended_job_lets_go_of_its_best_epochs_tables(monkeypatch):
    """A validated job keeps the shards' export of its best epoch (the tables of a whole model)
    until it publishes; a cancelled or failed one never does, and the coordinator held every
    such model until it restarted (+77 MB over one `tune --mode cluster` of 19 pruned trials).
    A validation that ends after a cancel keeps nothing either."""
    import asyncio
    from types import SimpleNamespace

    from mariana.services import coord_jobs

    saved = []
    coord = SimpleNamespace(inputs=SimpleNamespace(forget=lambda job: None, enabled=False),
                            store=SimpleNamespace(save_job=lambda *a: saved.append(a), drop_events=lambda job: None))
    monkeypatch.setattr(coord_jobs, "add_point", lambda coord, run: None)
    run = SimpleNamespace(id="j1", state="cancelled", submitted=0.0, best_export=(1, 0.5, ["tables"]),
                          to_saved=lambda: {"final": {}})
    coord_jobs.JobJournal(coord).ended(run)
    assert run.best_export is None and saved

    async def export(run, i, type_):
        run.state = "cancelled"  # a cancel while the shards export
        return SimpleNamespace(arrays={"t": 1})

    async def no_images(coord, run):
        return None

    monkeypatch.setattr(coord_jobs, "job_validation", lambda request: SimpleNamespace(rows=0, source="", paths=[]))
    monkeypatch.setattr(coord_jobs, "image_table", no_images)
    monkeypatch.setattr(coord_jobs, "validate_exports", lambda *a: {"logloss": 0.4, "auc": 0.7})
    coord.shards = [None]
    coord.job_runner = SimpleNamespace(set_phase=lambda run, text: None, shard_call=export)
    coord.name = "coordinator-0"
    run = SimpleNamespace(id="j2", state="running", request={}, spec=None, best_export=None,
                          ledger=SimpleNamespace(epoch=1), phase=None)
    asyncio.run(coord_jobs.EpochValidation(coord).validate(run))
    assert run.best_export is None
