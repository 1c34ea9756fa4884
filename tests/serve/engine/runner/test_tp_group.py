"""Rank 0's side of tensor parallelism (``serve_cli.engine.runner.tp_group.TPWorkers``) against
scripted worker processes that speak ``tp_protocol`` over real pipes: every worker gets every step,
a step completes only when each worker says so, and a failure (a worker's report, a worker gone
without a word, rank 0's own forward, a worker that never answers) names the rank at fault, stops
the workers and leaves the group refusing every later step.

The workers are forked processes running a script, not models: the collectives are covered by
tests/serve/test_serve_tp.py; here it is the protocol and its failure bookkeeping."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
from collections.abc import Iterator

import pytest

from serve_cli.engine.runner import tp_group
from serve_cli.engine.runner.tp_group import TPWorkers
from serve_cli.engine.runner.tp_protocol import BindKV, Failed, Ready, Started, StepDone, Stop

STEPS = [{"step": i, "tokens": list(range(i + 3))} for i in range(3)]  # any picklable step


def scripted_worker(conn, rank: int, script: list[str], expected: list[object]) -> None:
    """Answers each message rank 0 sends by the next word of ``script`` ("ok", "fail", "die",
    "wrong", "hang"), then "ok" to the rest; exits 0 on ``Stop`` only if it received exactly
    ``expected`` (``BindKV`` and the steps, in order)."""
    received: list[object] = []
    actions = iter(script)
    while True:
        msg = pickle.loads(conn.recv_bytes())  # send() and send_bytes(pickle) read alike
        if isinstance(msg, Stop):
            os._exit(0 if received == expected else 1)
        received.append(msg)
        action = next(actions, "ok")
        if action == "fail":
            conn.send(Failed(rank, "ValueError: boom"))
            os._exit(2)
        if action == "die":
            os._exit(3)
        if action == "hang":
            continue
        if action == "wrong":
            conn.send(Started(rank))
        else:
            conn.send(Ready(rank) if isinstance(msg, BindKV) else StepDone())


@pytest.fixture
def group() -> Iterator:
    """``make(*scripts)`` -> a ``TPWorkers`` over one scripted worker per script (ranks 1..n),
    its KV bound with 8 blocks when no script objects to that; every group is closed at the end."""
    made: list[TPWorkers] = []

    def make(*scripts: list[str], bind: bool = True) -> TPWorkers:
        ctx = mp.get_context("fork")  # the script needs nothing imported anew
        workers = TPWorkers.__new__(TPWorkers)  # the pipes and processes, without the model
        workers.conns, workers.procs, workers.error, workers._group_up = [], [], None, False
        for rank, script in enumerate(scripts, start=1):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=scripted_worker,
                args=(theirs, rank, script, [BindKV(8), *STEPS]),
                daemon=True,
            )
            proc.start()
            theirs.close()
            workers.conns.append(ours)
            workers.procs.append(proc)
        made.append(workers)
        if bind:
            workers.bind_kv_caches(8)
        return workers

    yield make
    for workers in made:
        workers.close(timeout=0)


def test_every_worker_gets_every_step_and_the_step_waits_for_all(group) -> None:
    workers = group(["ok"], ["ok"])
    procs = list(workers.procs)
    assert [workers.run_step(step, lambda s=step: s["step"] * 10) for step in STEPS] == [0, 10, 20]
    workers.close()
    assert [p.exitcode for p in procs] == [0, 0]  # each saw BindKV(8) and the three steps
    workers.close()  # idempotent
    with pytest.raises(RuntimeError, match="group is down .*closed.*restart the engine"):
        workers.run_step(STEPS[0], lambda: None)


def test_a_worker_report_names_its_rank_and_downs_the_group(group) -> None:
    workers = group(["ok", "ok"], ["ok", "fail"])  # rank 2 fails the first step
    procs = list(workers.procs)
    with pytest.raises(RuntimeError, match=r"step failed: rank 2\b.*restart the engine"):
        workers.run_step(STEPS[0], lambda: None)
    assert workers.procs == [] and not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match=r"group is down \(rank 2\b"):
        workers.run_step(STEPS[1], lambda: None)


def test_a_worker_gone_without_a_word_is_named_with_its_exit_code(group) -> None:
    workers = group(["ok", "die"], ["ok"])
    with pytest.raises(RuntimeError, match="rank 1 exit.* code 3"):
        workers.run_step(STEPS[0], lambda: None)


def test_rank_zero_failing_its_own_forward(group) -> None:
    """The workers finish the step (their StepDone is not a report), so rank 0 is named."""
    workers = group(["ok"])
    with pytest.raises(RuntimeError, match="step failed: rank 0: ZeroDivisionError") as e:
        workers.run_step(STEPS[0], lambda: 1 / 0)
    assert isinstance(e.value.__cause__, ZeroDivisionError)


def test_a_wrong_answer_at_binding_names_what_was_expected(group) -> None:
    workers = group(["wrong"], bind=False)
    with pytest.raises(RuntimeError, match="rank 1 sent Started, expected Ready"):
        workers.bind_kv_caches(8)
    assert workers.procs == []  # a failed bind stops the workers too


def test_a_worker_that_never_answers(group, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound is what rank 0 waits for an answer that will never come: the worker is stuck,
    so how short it is cannot make this test flaky."""
    monkeypatch.setattr(tp_group, "STEP_TIMEOUT_S", 0.5)
    workers = group(["ok", "hang"])
    procs = list(workers.procs)
    with pytest.raises(RuntimeError, match="rank 1 did not finish the step within 0.5 s"):
        workers.run_step(STEPS[0], lambda: None)
    assert not any(p.is_alive() for p in procs)  # terminated, not left stuck
