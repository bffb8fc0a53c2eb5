"""Scheduler driven by a fake model on the host: continuous batching, chunked prefill and
preemption never change what a request generates, and every page and slot comes back.

The fake runner keeps a per-slot "recurrent state" (the tokens fed to that slot) and per-page
"KV" (the tokens written there). A sampled token is a hash of the slot state, and the runner
checks that the KV pages read back the request's tokens, so a chunk that skips or repeats
tokens, a slot not reset on a fresh start, or a wrong block table changes the outputs or fails.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.core.allocator import NULL_PAGE, PageAllocator, block_table_row
from serving.core.cache_manager import CacheManager
from serving.core.sampling import SamplingParams
from serving.core.scheduler import PrefillChunk, Request, RequestStatus, Scheduler, SchedulerOutput
from serving.core.state_pool import NULL_SLOT, StatePool

VOCAB = 50
EOS = 7


def next_token(token_ids: list[int]) -> int:
    h = 17
    for t in token_ids:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h % VOCAB


def expected_output(prompt: list[int], params: SamplingParams, eos=()) -> tuple[list[int], str]:
    tokens, out = list(prompt), []
    while True:
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in params.stop_token_ids or (not params.ignore_eos and t in eos):
            return out, "stop"
        if len(out) >= params.max_tokens:
            return out, "length"


class FakeRunner:
    """Executes a SchedulerOutput against fake slot states and fake KV pages."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.slot_state: dict[int, list[int]] = {}
        self.kv: dict[int, list[int | None]] = {}

    def _compute(
        self, out: SchedulerOutput, request: Request, start: int, length: int, fresh: bool
    ) -> int | None:
        alloc, tpp = self.sched.cache.allocator, self.sched.cache.allocator.tokens_per_page
        # A runner reads only the placement: the pool's slot and the allocator's pages.
        placed = out.placement[request.request_id]
        slot = placed.slot
        assert slot == self.sched.cache.state_pool.slot(request.request_id) and slot != NULL_SLOT
        assert list(placed.pages) == alloc.pages(request.request_id)
        assert (placed.start, placed.length) == (start, length)
        if fresh:
            self.slot_state[slot] = []
        state = self.slot_state[slot]
        assert len(state) == start == request.num_computed_tokens
        tokens = request.all_token_ids[start : start + length]
        state.extend(tokens)
        row = block_table_row(placed.pages, alloc.pages_for(start + length))
        for pos, tok in zip(range(start, start + length), tokens, strict=True):
            page = int(row[pos // tpp])
            assert page != NULL_PAGE
            self.kv.setdefault(page, [None] * tpp)[pos % tpp] = tok
        if start + length < request.num_tokens:
            return None
        read = [self.kv[int(row[p // tpp])][p % tpp] for p in range(start + length)]
        assert read == request.all_token_ids, "KV pages do not hold the request's tokens"
        return next_token(state)

    def step(self, out: SchedulerOutput) -> list[int | None]:
        sampled = [
            self._compute(out, c.request, c.start, c.length, c.is_first) for c in out.prefill
        ]
        sampled += [self._compute(out, r, r.num_tokens - 1, 1, False) for r in out.decode]
        return sampled


def check_invariants(sched: Scheduler, out: SchedulerOutput) -> None:
    sched.cache.allocator.check_invariants()
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert all(1 <= c.length <= sched.chunk_size for c in out.prefill)
    assert len(sched.running) <= sched.max_num_seqs
    ids = [r.request_id for r in out.rows]
    assert len(ids) == len(set(ids))
    assert all(r.status is RequestStatus.RUNNING for r in sched.running)
    assert sched.cache.state_pool.num_free == sched.cache.state_pool.num_slots - 1 - len(
        sched.running
    )
    holders = {r.request_id for r in sched.running}
    assert (
        sum(len(sched.cache.allocator.pages(rid)) for rid in holders)
        == sched.cache.allocator.num_used
    )


def make(
    num_pages=64, page_size=4, num_slots=9, *, budget=32, chunk=8, seqs=8, eos=(), mml=512, fuse=1
):
    return Scheduler(
        CacheManager(PageAllocator(num_pages, page_size), StatePool(num_slots)),
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        chunk_size=chunk,
        max_model_len=mml,
        eos_token_ids=eos,
        num_decode_steps=fuse,
    )


def run(sched: Scheduler, arrivals: dict[int, list[Request]], max_steps=5000, on_step=None):
    """Add requests at their step, run to completion; return the step outputs."""
    runner, outs, step = FakeRunner(sched), [], 0
    while sched.has_unfinished() or any(s >= step for s in arrivals):
        for r in arrivals.get(step, []):
            sched.add(r)
        out = sched.schedule()
        check_invariants(sched, out)
        sched.update(out, runner.step(out))
        sched.cache.allocator.check_invariants()
        if on_step:
            on_step(out)
        outs.append(out)
        step += 1
        assert step < max_steps, "scheduler did not finish"
    assert sched.cache.allocator.num_free == sched.cache.allocator.capacity
    assert sched.cache.state_pool.num_free == sched.cache.state_pool.num_slots - 1
    assert not sched.running and not sched.waiting
    return outs


def requests(specs, eos_ids=()):
    """specs: (prompt_len, max_tokens, seed) -> fresh Requests with distinct ids."""
    out = []
    for i, (n, m, seed) in enumerate(specs):
        prompt = [(seed * 31 + 7 * j) % VOCAB for j in range(n)]
        out.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=m, ignore_eos=not eos_ids)))
    return out


SPECS = [(5, 9, 1), (23, 4, 2), (1, 12, 3), (40, 6, 4), (8, 1, 5), (17, 15, 6), (3, 3, 7)]


def outputs(reqs):
    return {r.request_id: (r.output_token_ids, r.finish_reason) for r in reqs}


def test_batched_equals_alone_and_matches_model():
    alone = {}
    for r in requests(SPECS):
        run(make(), {0: [r]})
        alone[r.request_id] = (r.output_token_ids, r.finish_reason)
        assert alone[r.request_id] == expected_output(r.prompt_token_ids, r.params)
    for chunk, budget in [(1, 4), (3, 10), (8, 32), (64, 64), (5, 7)]:
        reqs = requests(SPECS)
        run(make(budget=budget, chunk=chunk), {0: reqs[:3], 2: reqs[3:5], 5: reqs[5:]})
        assert outputs(reqs) == alone, (chunk, budget)


def test_chunked_prefill_interleaves_with_decodes():
    short, long = requests([(2, 20, 1), (50, 3, 2)])
    seen = []

    def on_step(out):
        chunks = [c for c in out.prefill if c.request is long]
        if chunks:
            seen.append((chunks[0].start, chunks[0].length, [r.request_id for r in out.decode]))

    run(make(budget=8, chunk=6), {0: [short], 2: [long]}, on_step=on_step)
    starts = [s for s, _, _ in seen]
    assert starts == sorted(starts) and len(seen) >= 50 // 6
    assert all(length <= 6 for _, length, _ in seen)
    assert sum(length for _, length, _ in seen) == 50
    # The short request's decode runs in the same steps as the long prompt's chunks.
    assert all(decodes == ["r0"] for _, _, decodes in seen)
    assert [length for _, length, _ in seen][:2] == [6, 6]  # budget 8 - 1 decode leaves 7 > 6
    assert long.output_token_ids == expected_output(long.prompt_token_ids, long.params)[0]


def test_budget_limits_chunk_below_chunk_size():
    (r,) = requests([(20, 2, 3)])
    outs = run(make(budget=5, chunk=8), {0: [r]})
    assert [c.length for o in outs for c in o.prefill] == [5, 5, 5, 5]


def test_forced_preemption_tiny_pool_same_outputs_and_all_freed():
    specs = [(9, 14, 1), (6, 10, 2), (12, 8, 3), (4, 16, 4), (7, 7, 5)]
    big = requests(specs)
    run(make(num_pages=128), {0: big})
    small = requests(specs)
    preempted = []
    # 8 usable pages of 4 tokens: each request alone fits (<= 6 pages), together they cannot.
    outs = run(
        make(num_pages=9, page_size=4, budget=16, chunk=4),
        {0: small},
        on_step=lambda o: preempted.extend(o.preempted),
    )
    assert preempted, "the tiny pool never forced a preemption"
    assert sum(r.num_preemptions for r in small) == len(preempted)
    assert outputs(small) == outputs(big)
    # A preempted request is re-prefilled from 0 (prompt + outputs so far) into a fresh slot.
    restarts = [c for o in outs for c in o.prefill if c.is_first and c.request.num_preemptions]
    assert restarts


def test_preempted_request_recomputes_outputs_so_far():
    sched = make(num_pages=5, page_size=2, budget=8, chunk=8, seqs=2)
    a, b = requests([(3, 5, 1), (3, 5, 2)])
    run(sched, {0: [a, b]})
    assert a.num_preemptions + b.num_preemptions > 0
    for r in (a, b):
        want = expected_output(r.prompt_token_ids, r.params)
        assert (r.output_token_ids, r.finish_reason) == want


def test_max_num_seqs_and_slots_limit_running():
    reqs = requests([(3, 4, i) for i in range(6)])
    sched = make(num_slots=3, seqs=8)
    running = []
    run(sched, {0: reqs}, on_step=lambda o: running.append(sched.num_running))
    assert max(running) == 2
    sched = make(seqs=3)
    run(sched, {0: requests([(3, 4, i) for i in range(6)])})


def test_stop_token_eos_ignore_eos_and_max_tokens():
    prompt = [1, 2, 3]
    free_run, _ = expected_output(prompt, SamplingParams(max_tokens=30))
    stop = free_run[4]
    k = free_run.index(stop)
    params = {
        "len": SamplingParams(max_tokens=3, ignore_eos=True),
        "stop": SamplingParams(max_tokens=30, stop_token_ids=(stop,), ignore_eos=True),
        "eos": SamplingParams(max_tokens=30),
        "ign": SamplingParams(max_tokens=30, ignore_eos=True),
    }
    sched = make(eos=(stop,))
    reqs = [Request(name, list(prompt), p) for name, p in params.items()]
    run(sched, {0: reqs})
    got = {r.request_id: (r.output_token_ids, r.finish_reason) for r in reqs}
    assert got["len"] == (free_run[:3], "length")
    assert got["stop"] == (free_run[: k + 1], "stop")
    assert got["eos"] == (free_run[: k + 1], "stop")
    assert got["ign"] == (free_run, "length")
    assert sched.num_waiting == sched.num_running == 0


def test_abort_waiting_running_and_mid_step():
    sched = make(num_slots=2)
    a, b, c = requests([(4, 10, 1), (4, 10, 2), (4, 10, 3)])
    for r in (a, b, c):
        sched.add(r)
    runner = FakeRunner(sched)
    out = sched.schedule()
    assert [ch.request for ch in out.prefill] == [a] and sched.num_waiting == 2
    sched.update(out, runner.step(out))
    assert sched.abort("r1") is b and b.finish_reason == "abort" and b.is_finished
    assert sched.num_waiting == 1
    out = sched.schedule()
    assert out.decode == [a] and len(a.output_token_ids) == 1
    assert sched.abort("r0") is a  # aborted while its step is in flight
    assert sched.cache.allocator.num_free == sched.cache.allocator.capacity
    assert sched.update(out, [5]) == [] and len(a.output_token_ids) == 1
    assert a.finish_reason == "abort" and sched.abort("r0") is None and sched.abort("zz") is None
    run(sched, {})
    assert c.finish_reason == "length" and len(c.output_token_ids) == 10


def test_update_accepts_dict_and_skips_non_sampling_rows():
    sched = make(budget=4, chunk=4)
    (r,) = requests([(6, 2, 1)])
    sched.add(r)
    out = sched.schedule()
    assert out.prefill == [PrefillChunk(r, 0, 4)] and not out.prefill[0].samples
    assert sched.update(out, {}) == [] and r.num_computed_tokens == 4
    out = sched.schedule()
    assert out.prefill[0].samples and out.prefill[0].token_ids == r.prompt_token_ids[4:]
    with pytest.raises(ValueError, match="2 sampled entries for 1 rows"):
        sched.update(out, [1, 2])
    assert sched.update(out, {"r0": 11}) == [] and r.output_token_ids == [11]
    out = sched.schedule()
    assert out.decode == [r]
    assert sched.update(out, {"r0": 12}) == [r] and r.finish_reason == "length"


def test_stop_truncates_and_frees_a_running_or_just_finished_request():
    """A stop string found on the host ends the request through the scheduler: the outputs
    are cut at the stop, pages and slot come back; a request that finished in the same step
    (here by length) only takes the new reason and length."""
    sched = make(budget=8, chunk=8)
    a, b = requests([(4, 10, 1), (4, 3, 2)])
    for r in (a, b):
        sched.add(r)
    sched.update(sched.schedule(), {"r0": 5, "r1": 6})
    sched.update(sched.schedule(), {"r0": 7, "r1": 8})
    out = sched.schedule()
    assert sched.update(out, {"r0": 9, "r1": 10}) == [b] and b.finish_reason == "length"
    sched.stop(a, 2)
    assert a.output_token_ids == [5, 7] and a.finish_reason == "stop" and a.is_finished
    sched.stop(b, 1)
    assert b.output_token_ids == [6] and b.finish_reason == "stop"
    assert not sched.has_unfinished()
    assert sched.cache.allocator.num_free == sched.cache.allocator.capacity
    assert sched.cache.state_pool.num_free == sched.cache.state_pool.num_slots - 1


def test_validation_errors():
    sched = make(num_pages=5, page_size=4, mml=100)  # 4 usable pages = 16 tokens
    p = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="prompt is empty"):
        sched.add(Request("e", [], p))
    with pytest.raises(ValueError, match=r"prompt length 98 \+ max_tokens 4.*max_model_len 100"):
        sched.add(Request("m", [1] * 98, p))
    with pytest.raises(ValueError, match="needs 5 pages.*holds only 4"):
        sched.add(Request("c", [1] * 14, p))
    sched.add(Request("ok", [1] * 13, p))  # 13 + 4 - 1 = 16 tokens: exactly the pool
    with pytest.raises(ValueError, match="already in use"):
        sched.add(Request("ok", [1], p))
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        make(chunk=0)
    run(sched, {})


# Random requests: (prompt length, max_tokens, a seed for their tokens, unused).
WORKLOADS = st.lists(
    st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 99), st.integers(0, 10)),
    min_size=1,
    max_size=8,
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    specs=WORKLOADS,
    page_size=st.integers(1, 4),
    extra_pages=st.integers(0, 12),
    num_slots=st.integers(2, 6),
    seqs=st.integers(1, 6),
    budget=st.integers(1, 24),
    chunk=st.integers(1, 16),
    use_eos=st.booleans(),
)
def test_random_workloads(specs, page_size, extra_pages, num_slots, seqs, budget, chunk, use_eos):
    eos = (EOS,) if use_eos else ()
    reqs = requests([(n, m, seed) for n, m, seed, _ in specs], eos_ids=eos)
    alloc_probe = PageAllocator(2, page_size)
    need = max(alloc_probe.pages_for(n + m - 1) for n, m, _, _ in specs)
    sched = make(
        need + 1 + extra_pages, page_size, num_slots, budget=budget, chunk=chunk, seqs=seqs, eos=eos
    )
    arrivals: dict[int, list[Request]] = {}
    for r, (_, _, _, at) in zip(reqs, specs, strict=True):
        arrivals.setdefault(at, []).append(r)
    run(sched, arrivals, max_steps=3000)
    for r in reqs:
        assert (r.output_token_ids, r.finish_reason) == expected_output(
            r.prompt_token_ids, r.params, eos
        )


@pytest.mark.parametrize("eos", [(), (EOS,)])
def test_fused_decode_steps_have_pages_and_keep_outputs(eos):
    """Decode-only steps fuse up to 4 steps (never past max_tokens); each fused position has a
    page; tokens after a stop are dropped; outputs equal one step at a time."""
    reqs = requests(SPECS, eos_ids=eos)
    sched = make(num_pages=24, budget=16, fuse=4, eos=eos)
    for r in reqs:
        sched.add(r)
    fused, tpp = [], sched.cache.allocator.tokens_per_page
    while sched.has_unfinished():
        out = sched.schedule()
        check_invariants(sched, out)
        if out.prefill:
            assert out.decode_steps == [1] * len(out.decode)
        sampled = {
            c.request.request_id: next_token(c.request.all_token_ids)
            for c in out.prefill
            if c.samples
        }
        for r, n in zip(out.decode, out.decode_steps, strict=True):
            assert 1 <= n <= min(4, r.params.max_tokens - len(r.output_token_ids))
            pages = out.placement[r.request_id].pages
            assert list(pages) == sched.cache.allocator.pages(r.request_id)
            row = block_table_row(pages, 64)
            seq, tokens = list(r.all_token_ids), []
            for j in range(n):
                assert row[(r.num_tokens - 1 + j) // tpp] != NULL_PAGE
                tokens.append(next_token(seq))
                seq.append(tokens[-1])
            sampled[r.request_id] = tokens
            fused.append(n)
        sched.update(out, sampled)
    assert max(fused) == 4
    for r in reqs:
        want = expected_output(r.prompt_token_ids, r.params, eos)
        assert (r.output_token_ids, r.finish_reason) == want
    assert sched.cache.allocator.num_free == sched.cache.allocator.capacity


# ---- async scheduling: the next step is scheduled before the in-flight step's tokens come -----


class Flight(NamedTuple):
    out: SchedulerOutput
    sampled: dict[str, list[int]]  # on the "device" until the host collects them


class AsyncFakeRunner(FakeRunner):
    """Runs a plain decode step when it is dispatched (a device runs steps in dispatch order)
    and hands its tokens to the host only when collected. A row with pending tokens reads its
    input token from the in-flight step, as the engine's runner does on the device; KV pages
    must read back what its slot consumed."""

    def dispatch(self, out: SchedulerOutput, prev: Flight | None) -> Flight:
        sampled = {}
        for r, n in zip(out.decode, out.decode_steps, strict=True):
            assert len(r.output_token_ids) + r.num_pending + n <= r.params.max_tokens
            token = prev.sampled[r.request_id][-1] if r.num_pending else r.all_token_ids[-1]
            tokens = []
            for j in range(n):
                token = self._feed(out, r, r.num_computed_tokens + j, token)
                tokens.append(token)
            sampled[r.request_id] = tokens
        return Flight(out, sampled)

    def step(self, out: SchedulerOutput) -> list:
        """A synchronous step (decode rows as in `dispatch`: a decode scheduled next to
        prefill chunks holds the pages of the fused steps it asked for)."""
        sampled = [
            self._compute(out, c.request, c.start, c.length, c.is_first) for c in out.prefill
        ]
        decoded = self.dispatch(out, None).sampled
        return sampled + [decoded[r.request_id] for r in out.decode]

    def _feed(self, out: SchedulerOutput, request: Request, pos: int, token: int) -> int:
        placed, tpp = out.placement[request.request_id], self.sched.cache.allocator.tokens_per_page
        assert placed.slot == self.sched.cache.state_pool.slot(request.request_id)
        state = self.slot_state[placed.slot]
        assert len(state) == pos
        state.append(token)
        pages = placed.pages  # an IndexError: no page for the position
        self.kv.setdefault(pages[pos // tpp], [None] * tpp)[pos % tpp] = token
        assert [self.kv[pages[p // tpp]][p % tpp] for p in range(pos + 1)] == state
        return next_token(state)


def run_async(sched, arrivals, max_steps=5000, dispatch_first=lambda out: True) -> int:
    """The engine's async protocol (`LLM._step_async`): with a plain decode step in flight,
    schedule the next one when the scheduler allows and dispatch it before applying the
    earlier tokens (unless `dispatch_first(out)` says no, as the engine does for a step that
    could compile differently without some rows: then apply them, drop the rows that ended
    and dispatch the rest); otherwise apply them first and run synchronously (leaving a
    plain decode step in flight). Returns (steps dispatched ahead, steps that waited)."""
    runner, flight, ahead, waited, step = AsyncFakeRunner(sched), None, 0, 0, 0
    while sched.has_unfinished() or flight or any(s >= step for s in arrivals):
        for r in arrivals.get(step, []):
            sched.add(r)
        step += 1
        assert step < max_steps, "scheduler did not finish"
        if flight is not None and sched.can_schedule_ahead():
            out = sched.schedule()
            check_invariants(sched, out)
            if dispatch_first(out):
                nxt = runner.dispatch(out, flight)
                sched.advance(out)
                sched.update(flight.out, flight.sampled)
                flight, ahead = nxt, ahead + 1
                continue
            sched.update(flight.out, flight.sampled)
            sched.drop_finished(out)
            flight = runner.dispatch(out, None) if out.decode else None
            if out.decode:
                sched.advance(out)
            waited += 1
            continue
        if flight is not None:
            sched.update(flight.out, flight.sampled)
            flight = None
        if not sched.has_unfinished():
            continue
        out = sched.schedule()
        check_invariants(sched, out)
        if out.is_plain_decode:
            flight = runner.dispatch(out, None)
            sched.advance(out)
        else:
            sched.update(out, runner.step(out))
    assert sched.cache.allocator.num_free == sched.cache.allocator.capacity
    assert sched.cache.state_pool.num_free == sched.cache.state_pool.num_slots - 1
    return ahead, waited


def every_nth_waits(n: int):
    """A `dispatch_first` that says no on every n-th call (never for n = 0)."""
    calls = itertools.count(1)
    return lambda out: n == 0 or next(calls) % n != 0


@pytest.mark.parametrize("fuse", [1, 3])
@pytest.mark.parametrize("wait_every", [0, 2])
def test_async_schedule_keeps_outputs(fuse, wait_every):
    """Stops (EOS, max_tokens) apply one step late and the extra tokens are dropped; requests
    arriving mid-run, preemption in a small pool and fused steps keep their outputs. With
    `wait_every` 2, every other step scheduled ahead waits for the tokens in flight and
    drops the rows they ended."""
    for pages in (64, 14):
        reqs = requests(SPECS, eos_ids=(EOS,))
        sched = make(num_pages=pages, budget=16, eos=(EOS,), fuse=fuse)
        first = every_nth_waits(wait_every)
        ahead, waited = run_async(sched, {0: reqs[:4], 3: reqs[4:]}, dispatch_first=first)
        assert ahead > 0 and (waited > 0) == (wait_every > 0)
        assert (pages == 14) == any(r.num_preemptions for r in reqs)
        for r in reqs:
            want = expected_output(r.prompt_token_ids, r.params, (EOS,))
            assert (r.output_token_ids, r.finish_reason) == want


def test_advance_takes_only_plain_decode_steps():
    sched = make()
    (r,) = requests([(4, 5, 1)])
    sched.add(r)
    out = sched.schedule()
    with pytest.raises(ValueError, match="only a plain decode step"):
        sched.advance(out)
    sched.update(out, FakeRunner(sched).step(out))
    out = sched.schedule()
    sched.advance(out)
    assert (r.num_pending, r.num_computed_tokens, r.num_uncomputed) == (1, 5, 1)
    assert sched.can_schedule_ahead()
    sched.add(Request("late", [1, 2], SamplingParams(max_tokens=2)))
    assert not sched.can_schedule_ahead()  # a waiting request: a finish could admit it


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=WORKLOADS,
    page_size=st.integers(1, 4),
    extra_pages=st.integers(0, 12),
    num_slots=st.integers(2, 6),
    budget=st.integers(1, 24),
    fuse=st.integers(1, 4),
    use_eos=st.booleans(),
    wait_every=st.integers(0, 3),
)
def test_async_random_workloads(
    specs, page_size, extra_pages, num_slots, budget, fuse, use_eos, wait_every
):
    eos = (EOS,) if use_eos else ()
    reqs = requests([(n, m, seed) for n, m, seed, _ in specs], eos_ids=eos)
    need = max(PageAllocator(2, page_size).pages_for(n + m - 1) for n, m, _, _ in specs)
    sched = make(need + 1 + extra_pages, page_size, num_slots, budget=budget, eos=eos, fuse=fuse)
    arrivals: dict[int, list[Request]] = {}
    for r, (_, _, _, at) in zip(reqs, specs, strict=True):
        arrivals.setdefault(at, []).append(r)
    run_async(sched, arrivals, 3000, every_nth_waits(wait_every))
    for r in reqs:
        want = expected_output(r.prompt_token_ids, r.params, eos)
        assert (r.output_token_ids, r.finish_reason) == want


def test_failed_probes_back_off_exponentially_and_success_resets():
    """A request whose drafts all fail stops drafting once its acceptance EMA drops below the
    floor, then probes after 4, 8, 16, 32, 32 ... verifies (interval 4, back-off capped at
    MAX_PROBE_BACKOFF = 8 intervals); a probe that is accepted restores drafting and the
    base interval."""
    from serving.core.policy import MAX_PROBE_BACKOFF, DraftPolicy

    k, interval = 3, 4
    sched = Scheduler(
        CacheManager(PageAllocator(512, 4), StatePool(3)),
        max_num_seqs=2,
        max_num_batched_tokens=64,
        chunk_size=64,
        max_model_len=2048,
        num_decode_steps=k + 1,  # the verify window
        draft_policy=DraftPolicy(min_acceptance=0.25, probe_interval=interval),
    )
    request = Request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=1000))
    sched.add(request)
    out = sched.schedule()
    sched.update(out, {"r": 7})  # the prefill's token
    drafted_at, step = [], 0

    def run(steps, accept):
        nonlocal step
        for _ in range(steps):
            out = sched.schedule()
            n = out.max_drafts[0]
            if n:
                drafted_at.append(step)
            tokens = [7] * (1 + (n if accept else 0))
            sched.update(out, {"r": tokens}, {"r": n})
            step += 1

    run(200, accept=False)
    # 4 failed windows take the EMA from 1.0 under 0.25 (0.7 ** 4 = 0.24).
    gaps = [b - a for a, b in zip(drafted_at[3:], drafted_at[4:], strict=False)]
    cap = interval * MAX_PROBE_BACKOFF
    assert drafted_at[:4] == [0, 1, 2, 3]
    assert gaps[:5] == [interval, 2 * interval, 4 * interval, cap, cap], drafted_at
    first_probe = len(drafted_at)
    run(cap + 1, accept=True)  # the next probe succeeds: drafting resumes at once
    after = drafted_at[first_probe:]
    assert after[1:] == list(range(after[0] + 1, step)), drafted_at
    fail_from, count = step, len(drafted_at)
    run(16, accept=False)  # failing again: the same back-off from the base interval
    f = fail_from
    assert drafted_at[count:] == [f, f + 1, f + 2, f + 3, f + 7, f + 15], drafted_at[count:]
