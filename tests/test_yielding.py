"""Background torch work that gives way to requests (``engine/serving/yielding.py``): it pauses before its next op while a
request computes, lets go of the model lock meanwhile, and splits large products on the CPU without changing them."""

import threading

import pytest
import torch

from cachegen_core.engine.serving import yielding
from cachegen_core.engine.serving.yielding import Stopped, Yielding


def counting(monkeypatch) -> tuple[Yielding, list[int]]:
    """A ``Yielding`` with no request ever computing, its checks counted (one per op, one between product blocks)."""
    checks: list[int] = []
    idle = threading.Event()
    idle.set()
    y = Yielding(idle)
    monkeypatch.setattr(y, "check", lambda: checks.append(1))
    return y, checks


def test_products_split_in_blocks_of_rows_equal_the_whole_forward_and_backward(monkeypatch):
    monkeypatch.setattr(yielding, "BLOCK_S", 1e-9)  # every product below is split, a row a block
    monkeypatch.setattr(yielding, "_RATES", {})
    y, checks = counting(monkeypatch)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(50, 30, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(30, 20, dtype=torch.float64, generator=g)
    bias = torch.randn(20, dtype=torch.float64, generator=g)
    x, w = torch.randn(4, 50, 30, dtype=torch.float64, generator=g), torch.randn(4, 30, 20, dtype=torch.float64, generator=g)
    lin = torch.nn.Linear(30, 20).double()

    def work():
        outs = [a @ b, torch.addmm(bias, a, b), torch.addmm(torch.ones(50, 20, dtype=torch.float64), a, b), lin(a), torch.bmm(x, w)]
        return outs, torch.autograd.grad((lin(a) ** 2).sum() + (a @ b).sum(), a)[0]

    want, want_grad = work()
    with y.active():
        got, got_grad = work()
    assert len(checks) > y.ops  # a check before every op, and more between the blocks of the split products
    for u, v in zip(want + [want_grad], got + [got_grad]):
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12)


def test_blocks_are_sized_by_the_rate_measured_for_the_dtype(monkeypatch):
    """A product of a dtype this CPU computes slowly (16-bit floats without native support: 100x float32's time) is
    split into blocks of about ``BLOCK_S``, each timed; a fast rate measured makes the next blocks larger."""
    monkeypatch.setattr(yielding, "_RATES", {torch.float32: 1e6})  # as if float32 products ran at 1 MFLOP/s here
    y, checks = counting(monkeypatch)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 64, generator=g), torch.randn(64, 64, generator=g)
    with y.active():
        got = a @ b
    torch.testing.assert_close(got, a @ b)
    blocks = len(checks) - y.ops + 1
    assert 2 <= blocks < 512 / 6  # split (first block: 6 rows at 1 MFLOP/s), later blocks larger once timed
    assert yielding._RATES[torch.float32] > 1e7  # what the blocks measured replaced the pretended rate
    checks.clear()
    ops = y.ops
    with y.active():
        a[:8] @ b  # 65 kflop: well under two blocks at the measured rate, not split
    assert len(checks) == y.ops - ops == 2  # a check per op (the slice, the product), none between blocks


def test_a_paused_thread_lets_go_of_the_lock_and_goes_on_once_requests_are_done():
    idle, lock = threading.Event(), threading.Lock()
    idle.set()
    y = Yielding(idle, quiet_s=0.0)
    step, ran, results = threading.Event(), [], []

    def background():
        with y.active(), y.holding(lock):
            ran.append(torch.ones(3).sum().item())
            step.wait(60)
            ran.append(torch.ones(3).sum().item())  # paused here while the "request" runs
        results.append("done")

    t = threading.Thread(target=background)
    t.start()
    while not ran:
        t.join(0.01)
    idle.clear()  # a request starts
    step.set()
    assert y.paused.wait(60)
    assert lock.acquire(timeout=60)  # let go while paused: the request takes the model
    assert len(ran) == 1 and y.pauses == 1
    lock.release()
    idle.set()  # the request is done
    t.join(60)
    assert ran == [3.0, 3.0] and results == ["done"] and not y.paused.is_set()


def test_stop_ends_a_paused_thread():
    idle, stop = threading.Event(), threading.Event()
    y = Yielding(idle, stop, quiet_s=0.0)
    errors = []

    def background():
        try:
            with y.active():
                torch.ones(2) + 1
        except Stopped as e:
            errors.append(e)

    t = threading.Thread(target=background)
    t.start()
    assert y.paused.wait(60)  # no request ever ends
    stop.set()
    t.join(60)
    assert not t.is_alive() and len(errors) == 1
    with pytest.raises(Stopped), y.active():
        torch.ones(1) * 2


def test_a_job_queue_runs_its_jobs_in_order_on_a_thread_that_ends_with_the_work():
    from cachegen_core.engine.serving.background import JobQueue

    idle = threading.Event()
    idle.set()
    done, threads = [], []

    def run(job: int) -> None:
        threads.append(threading.current_thread().name)
        done.append(job + int(torch.ones(1).item()))  # torch under the queue's Yielding

    q = JobQueue(run, Yielding(idle, quiet_s=0.0), name="test-jobs")
    q.submit([1, 2, 3])
    assert q.join(60) and done == [2, 3, 4] and set(threads) == {"test-jobs"}
    assert q._thread is None  # no thread while there is no work
    idle.clear()  # a request computes: the next job waits at its first op
    q.submit([4])
    assert q.yielding.paused.wait(60) and done == [2, 3, 4] and not q.join(0.05)
    q.stop(60)  # stopped while paused: the job ends at that op, and no other job is taken
    assert q.join(60) and done == [2, 3, 4]
    q.submit([5])
    assert q._thread is None and q.join(0) and done == [2, 3, 4]


def test_a_job_queue_without_a_background_thread_runs_its_jobs_when_drained():
    from cachegen_core.engine.serving.background import JobQueue

    done: list[int] = []
    q = JobQueue(done.append, Yielding(threading.Event()), name="test-jobs", background=False)
    q.submit([1, 2])
    assert done == [] and q.join(0)
    q.drain()
    assert done == [1, 2] and q._thread is None
