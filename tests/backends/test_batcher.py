"""MicroBatcher: coalescing, token budget, length buckets, deadlines, cancellation, backpressure, lifecycle."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Sequence

import pytest

from guard.backends.batcher import BatcherConfig, BatcherState, BatchInfo, MicroBatcher
from guard.errors import BackendTimeout, Overloaded

pytestmark = pytest.mark.anyio


class Model:
    """A real (if trivial) batch function: squares each item's value; ``gate`` holds items named 'hold'."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, int]]] = []
        self.threads: set[int] = set()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def __call__(self, items: Sequence[tuple[str, int]]) -> list[int]:
        self.threads.add(threading.get_ident())
        self.batches.append(list(items))
        if any(name == "hold" for name, _ in items):
            self.entered.set()
            if not self.gate.wait(10):
                raise RuntimeError("test gate never opened")
        if any(name == "bad" for name, _ in items):
            raise ValueError("bad item in batch")
        return [value * value for _, value in items]

    def seen(self) -> list[str]:
        return [name for batch in self.batches for name, _ in batch]


def tokens(item: tuple[str, int]) -> int:
    return item[1]


async def hold_inference_thread(batcher: MicroBatcher[tuple[str, int], int], model: Model) -> asyncio.Task[int]:
    """Start a batch that blocks the inference thread until ``model.gate`` is set."""
    task = asyncio.ensure_future(batcher.submit(("hold", 1)))
    await asyncio.to_thread(model.entered.wait, 5)
    return task


async def fill_queue(batcher: MicroBatcher[tuple[str, int], int], model: Model
                     ) -> tuple[asyncio.Task[int], list[asyncio.Task[int]]]:
    """Hold the inference thread, then queue two requests of 2 tokens (``q0``, ``q1``): a queue of 2 is full."""
    held = await hold_inference_thread(batcher, model)
    queued = [asyncio.ensure_future(batcher.submit((f"q{i}", 2))) for i in range(2)]
    await asyncio.sleep(0)
    return held, queued


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_batch": 0}, "max_batch"),
        ({"max_batch": 2.5}, "max_batch"),
        ({"max_batch": True}, "max_batch"),
        ({"max_batch_tokens": 0}, "max_batch_tokens"),
        ({"max_wait_ms": -1}, "max_wait_ms"),
        ({"max_wait_ms": math.inf}, "max_wait_ms"),
        ({"max_queue": 0}, "max_queue"),
        ({"max_length_ratio": 0.5}, "max_length_ratio"),
        ({"max_length_ratio": math.nan}, "max_length_ratio"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"BatcherConfig.{field} must be"):
        BatcherConfig(**kwargs)  # type: ignore[arg-type]


def test_config_defaults_and_repr() -> None:
    config = BatcherConfig(max_batch=1, max_length_ratio=math.inf)
    assert config.max_batch == 1 and config.max_wait_ms > 0
    assert "max_batch=1" in repr(config)
    assert config == BatcherConfig(max_batch=1, max_length_ratio=math.inf)


async def test_concurrent_requests_share_forward_passes_and_get_their_own_results() -> None:
    model = Model()
    async with MicroBatcher(model, tokens=tokens, config=BatcherConfig(max_wait_ms=50)) as batcher:
        results = await asyncio.gather(*(batcher.submit((f"r{i}", i + 1)) for i in range(24)))
    assert results == [(i + 1) ** 2 for i in range(24)]
    assert batcher.stats.batches < 24
    assert sorted(model.seen()) == sorted(f"r{i}" for i in range(24))
    assert batcher.stats.completed == 24 and batcher.stats.batched_requests == 24


async def test_runs_on_one_inference_thread_not_the_event_loop() -> None:
    model = Model()
    async with MicroBatcher(model, tokens=tokens, config=BatcherConfig(max_batch=2, max_wait_ms=0)) as batcher:
        await asyncio.gather(*(batcher.submit((f"r{i}", 1)) for i in range(10)))
    assert len(model.threads) == 1
    assert threading.get_ident() not in model.threads


async def test_max_batch_and_padded_token_budget_are_respected() -> None:
    model = Model()
    config = BatcherConfig(max_batch=4, max_batch_tokens=250, max_wait_ms=20)
    async with MicroBatcher(model, tokens=tokens, config=config) as batcher:
        held = await hold_inference_thread(batcher, model)
        waiting = [asyncio.ensure_future(batcher.submit((f"r{i}", 100))) for i in range(7)]
        await asyncio.sleep(0.01)
        model.gate.set()
        await asyncio.gather(held, *waiting)
    sizes = [len(batch) for batch in model.batches[1:]]
    assert sizes == [2, 2, 2, 1]  # 3 × 100 padded tokens would exceed 250
    small = BatcherConfig(max_batch=3, max_wait_ms=20)
    model = Model()
    async with MicroBatcher(model, tokens=tokens, config=small) as batcher:
        await asyncio.gather(*(batcher.submit((f"r{i}", 1)) for i in range(7)))
    assert max(len(batch) for batch in model.batches) <= 3


async def test_very_different_lengths_do_not_share_a_batch() -> None:
    model = Model()
    config = BatcherConfig(max_batch=32, max_batch_tokens=100_000, max_wait_ms=20, max_length_ratio=2.0)
    async with MicroBatcher(model, tokens=tokens, config=config) as batcher:
        held = await hold_inference_thread(batcher, model)
        lengths = [10, 1000, 12, 900, 15, 1100, 11, 950]
        waiting = [asyncio.ensure_future(batcher.submit((f"r{i}", n))) for i, n in enumerate(lengths)]
        await asyncio.sleep(0.01)
        model.gate.set()
        results = await asyncio.gather(*waiting)
        await held
    assert results == [n * n for n in lengths]
    later = model.batches[1:]
    assert len(later) == 2
    for batch in later:
        values = [value for _, value in batch]
        assert max(values) <= 2 * min(values)
    # the oldest waiting request (length 10) anchors the first batch after the held one
    assert ("r0", 10) in later[0]


async def test_deadline_passed_while_queued_drops_before_compute() -> None:
    model = Model()
    async with MicroBatcher(model, tokens=tokens, config=BatcherConfig(max_wait_ms=0)) as batcher:
        held = await hold_inference_thread(batcher, model)
        with pytest.raises(BackendTimeout, match="within 50 ms"):
            await batcher.submit(("late", 3), timeout=0.05)
        model.gate.set()
        await held
        assert await batcher.submit(("after", 2), timeout=5) == 4
    assert "late" not in model.seen()
    assert batcher.stats.expired == 1


async def test_cancelled_caller_is_dropped_before_compute() -> None:
    model = Model()
    async with MicroBatcher(model, tokens=tokens, config=BatcherConfig(max_wait_ms=0)) as batcher:
        held = await hold_inference_thread(batcher, model)
        gone = asyncio.ensure_future(batcher.submit(("gone", 3)))
        await asyncio.sleep(0.01)
        gone.cancel()
        stays = asyncio.ensure_future(batcher.submit(("stays", 4)))
        await asyncio.sleep(0.01)
        model.gate.set()
        assert await stays == 16
        await held
    assert gone.cancelled()
    assert "gone" not in model.seen()
    assert batcher.stats.cancelled == 1


async def test_full_queue_raises_overloaded_at_once() -> None:
    model = Model()
    async with MicroBatcher(model, tokens=tokens, config=BatcherConfig(max_queue=2, max_wait_ms=0)) as batcher:
        held, queued = await fill_queue(batcher, model)
        with pytest.raises(Overloaded) as info:
            await asyncio.wait_for(batcher.submit(("extra", 2)), 0.5)
        assert info.value.retry_after >= 1 and info.value.limit == 2
        assert "full (2 waiting)" in str(info.value)
        model.gate.set()
        assert await asyncio.gather(*queued) == [4, 4]
        await held
    assert batcher.stats.rejected == 1


async def test_requests_that_left_a_full_queue_give_back_their_places() -> None:
    """Two requests expire and one is cancelled while a long batch holds the inference thread: a full queue of
    finished requests does not refuse a live one (it answered 429 until the batch ended)."""
    model = Model()
    async with MicroBatcher(model, tokens=tokens, config=BatcherConfig(max_queue=3, max_wait_ms=0)) as batcher:
        held = await hold_inference_thread(batcher, model)
        expired = [asyncio.ensure_future(batcher.submit((f"late{i}", 2), timeout=0.02)) for i in range(2)]
        gone = asyncio.ensure_future(batcher.submit(("gone", 2)))
        await asyncio.sleep(0.05)
        gone.cancel()
        await asyncio.sleep(0)
        for late in expired:
            with pytest.raises(BackendTimeout):
                await late
        assert batcher.queue_depth == 0  # left at once, though the collector waits on the held batch
        live = asyncio.ensure_future(batcher.submit(("live", 3)))
        await asyncio.sleep(0)
        model.gate.set()
        assert await live == 9
        await held
    assert batcher.stats.rejected == 0 and batcher.stats.expired == 2 and batcher.stats.cancelled == 1
    assert "late0" not in model.seen() and "gone" not in model.seen()


async def test_requests_whose_callers_left_leave_the_queue_depth_at_once() -> None:
    """The autoscaler reads ``queue_depth``: a request whose client left or whose deadline passed while a long batch
    computes leaves it at once (not when the next batch forms), is never run, and is counted once."""
    model = Model()
    async with MicroBatcher(model, tokens=tokens, config=BatcherConfig(max_wait_ms=0)) as batcher:
        held = await hold_inference_thread(batcher, model)
        gone = [asyncio.ensure_future(batcher.submit((f"gone{i}", 2))) for i in range(5)]
        late = asyncio.ensure_future(batcher.submit(("late", 2), timeout=0.02))
        stays = asyncio.ensure_future(batcher.submit(("stays", 2)))
        await asyncio.sleep(0)
        assert batcher.queue_depth == 7
        for task in gone:
            task.cancel()
        with pytest.raises(BackendTimeout):
            await late
        await asyncio.sleep(0)
        assert batcher.queue_depth == 1
        model.gate.set()
        assert await stays == 4
        await held
    assert batcher.stats.cancelled == 5 and batcher.stats.expired == 1
    assert not any(name.startswith(("gone", "late")) for name in model.seen())


async def test_a_request_cancelled_as_its_batch_forms_is_counted_once() -> None:
    """A request cancelled in the turn its batch is taken: the collector drops it, and its done callback, a turn
    later, finds it gone and counts nothing."""
    model = Model()
    async with MicroBatcher(model, tokens=tokens, config=BatcherConfig(max_wait_ms=0)) as batcher:
        held = await hold_inference_thread(batcher, model)
        queued = [asyncio.ensure_future(batcher.submit((f"q{i}", 2))) for i in range(3)]
        await asyncio.sleep(0)
        batcher._queue[1].future.cancel()
        batch = batcher._take_batch()  # the collector's turn, before the done callback's
        assert [pending.item[0] for pending in batch] == ["q0", "q2"]
        for pending in batch:
            pending.future.set_result(0)
        await asyncio.sleep(0)
        assert batcher.queue_depth == 0 and batcher.stats.cancelled == 1
        assert await queued[0] == 0 and queued[1].cancelled()
        model.gate.set()
        await held
    assert batcher.stats.cancelled == 1


async def test_a_request_cancelled_this_turn_gives_its_place_to_the_next() -> None:
    """A future's done callbacks run a loop turn later; the place must be free at once."""
    model = Model()
    async with MicroBatcher(model, tokens=tokens, config=BatcherConfig(max_queue=2, max_wait_ms=0)) as batcher:
        held, queued = await fill_queue(batcher, model)
        batcher._queue[0].future.cancel()  # what a client leaving does to its request's future
        live = asyncio.ensure_future(batcher.submit(("live", 3)))
        await asyncio.sleep(0)
        model.gate.set()
        assert await live == 9 and await queued[1] == 4
        await held
    assert batcher.stats.rejected == 0

async def test_aclose_finishes_queued_work_and_refuses_new_work() -> None:
    model = Model()
    batcher = MicroBatcher(model, tokens=tokens, config=BatcherConfig(max_batch=2, max_wait_ms=1000))
    assert batcher.state is BatcherState.UNOPENED
    with pytest.raises(RuntimeError, match="has not been started"):
        await batcher.submit(("x", 1))
    await batcher.start()
    with pytest.raises(RuntimeError, match="Cannot start a MicroBatcher that is running"):
        await batcher.start()
    held = await hold_inference_thread(batcher, model)
    queued = [asyncio.ensure_future(batcher.submit((f"q{i}", 1))) for i in range(5)]
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(batcher.aclose())
    await asyncio.sleep(0.01)
    assert batcher.state is BatcherState.CLOSING
    with pytest.raises(RuntimeError, match="Cannot submit to a MicroBatcher that is closing"):
        await batcher.submit(("new", 1))
    model.gate.set()
    await closing
    assert await asyncio.gather(*queued) == [1] * 5
    await held
    assert batcher.state is BatcherState.CLOSED
    await batcher.aclose()  # idempotent
    with pytest.raises(RuntimeError, match="that is closed"):
        await batcher.submit(("new", 1))


async def test_a_failing_request_does_not_fail_its_batch_neighbours() -> None:
    model = Model()
    async with MicroBatcher(model, tokens=tokens, config=BatcherConfig(max_wait_ms=50)) as batcher:
        outcomes = await asyncio.gather(
            batcher.submit(("a", 2)), batcher.submit(("bad", 2)), batcher.submit(("b", 3)), return_exceptions=True
        )
        assert outcomes[0] == 4 and outcomes[2] == 9
        assert isinstance(outcomes[1], ValueError)
        assert await batcher.submit(("c", 5)) == 25  # still serving
    assert batcher.stats.failed == 1 and batcher.stats.batches == 5  # 1 failed batch + 3 reruns + 1


async def test_a_base_exception_from_the_model_fails_its_request_and_the_batcher_serves_on() -> None:
    """A ``BaseException`` that is not an ``Exception`` ended the collector: every later request waited out its
    timeout (or forever) while the batcher still said running."""

    class Poison(BaseException):
        pass

    def model(items: Sequence[tuple[str, int]]) -> list[int]:
        if any(name == "poison" for name, _ in items):
            raise Poison("from a library")
        return [value * value for _, value in items]

    async with MicroBatcher(model, tokens=tokens, config=BatcherConfig(max_wait_ms=1)) as batcher:
        with pytest.raises(RuntimeError, match="run_batch raised Poison: from a library"):
            await batcher.submit(("poison", 2))
        assert await batcher.submit(("c", 5), timeout=5) == 25
        assert batcher.state is BatcherState.RUNNING


async def test_on_batch_reports_sizes_and_survives_a_broken_hook() -> None:
    infos: list[BatchInfo] = []

    def hook(info: BatchInfo) -> None:
        infos.append(info)
        raise RuntimeError("broken metrics")

    config = BatcherConfig(max_wait_ms=50)
    async with MicroBatcher(Model(), tokens=tokens, config=config, on_batch=hook) as batcher:
        assert await asyncio.gather(batcher.submit(("a", 3)), batcher.submit(("b", 5))) == [9, 25]
    assert infos[0].size == 2 and infos[0].tokens == 8 and infos[0].padded_tokens == 10 and infos[0].ok


async def test_a_lone_request_in_sparse_traffic_is_not_held_for_max_wait() -> None:
    infos: list[BatchInfo] = []
    config = BatcherConfig(max_batch=2, max_wait_ms=1000)
    async with MicroBatcher(Model(), tokens=tokens, config=config, on_batch=infos.append) as batcher:
        assert await batcher.submit(("first", 2)) == 4
        await asyncio.sleep(1.1)  # longer than max_wait: the next request is sparse traffic
        assert await batcher.submit(("second", 3)) == 9
        assert await asyncio.gather(batcher.submit(("a", 1)), batcher.submit(("b", 1))) == [1, 1]  # fills a batch
    assert [info.size for info in infos] == [1, 1, 2]
    # held requests would have waited the full second; these went straight to compute
    assert all(info.max_queue_wait_s < 1.0 for info in infos)


async def test_bad_token_count_and_timeout_are_refused() -> None:
    async with MicroBatcher(Model(), tokens=tokens) as batcher:
        with pytest.raises(ValueError, match="tokens\\(item\\) must be an integer >= 1, got 0"):
            await batcher.submit(("zero", 0))
        with pytest.raises(ValueError, match="timeout must be"):
            await batcher.submit(("a", 1), timeout=0)
