"""Generation: decoder artifacts, continuous batching over device-resident slots, and
sampling, against one-request-at-a-time decoding in plain JAX with the same functions."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pxrt
from pxrt import _slots_py, decoder, demo, generate

# How batches split over the devices, and the Cython modules end to end: `make test`
# also runs this module on one device with the pure-Python twins (PXRT_NO_EXTENSIONS=1).
pytestmark = [pytest.mark.devices, pytest.mark.twins]


MAX_LENGTH = 64
SIZES = {"dim": 32, "heads": 2, "layers": 2}
LENGTHS = (8, 32)
BATCHES = (1, 4)
SLOTS = 8  # (on 4 devices, 2 rows each: steps over 4 slots and over 8)
LONG = 2048
CHUNKS = (8, 32)  # extend's (the demo's default: the shortest and longest prefill length)


@pytest.fixture(scope="module")
def lm_path(tmp_path_factory):
    return demo.export_lm(
        str(tmp_path_factory.mktemp("lm") / "lm"),
        slots=SLOTS,
        max_length=MAX_LENGTH,
        prefill_lengths=LENGTHS,
        prefill_batches=BATCHES,
        bounds={"length": LONG},  # long_lm loads it with a longer cache
        **SIZES,
    )


@pytest.fixture(scope="module")
def lm(lm_path):
    # (its steps also run over the cache's first 16 and 32 positions when every busy
    # slot is within them: every test of it checks those against plain JAX too)
    dec = pxrt.load(lm_path, step_lengths=(16, 32))
    assert dec.wait_programs(120)  # (those compiled after the load: the tests use them)
    # (the steps chosen by rule, not by their measured prices: the fewest rows and the
    # smallest window, which the tests below count; test_steps_are_priced prices them)
    dec._step_prices = dec._forward_prices = {}
    yield dec
    dec.close()


@pytest.fixture(scope="module")
def long_lm(lm_path):
    """The same artifact with a long cache: generations that run for thousands of steps
    unless cancelled."""
    dec = pxrt.load(
        lm_path,
        max_length=LONG,
        prefix_cache_tokens=0,
        step_slots=(),
        prefill_batches=(1,),  # (its prompts come one at a time: fewer programs)
        chunk_lengths=(32,),
        chunk_batches=(1,),
        sampling_controls=False,
    )
    assert dec.wait_programs(120)
    yield dec
    dec.close()


@pytest.fixture(scope="module")
def fused_lm(lm_path):
    """The same artifact with each prefill dispatched between two steps, on the loop's
    thread (the default on accelerators; ``lm`` prefills beside the steps, the CPU
    default), and one step per program (``lm`` runs blocks of up to 4). Fewer
    programs: only the prefill path and the steps differ."""
    dec = pxrt.load(
        lm_path,
        overlap_prefill=False,
        multi_step=1,
        prefix_cache_tokens=0,
        step_slots=(),
        defer=False,
    )
    yield dec
    dec.close()


@pytest.fixture(scope="module")
def params():
    return demo.make_lm_params(**SIZES)


@pytest.fixture(scope="module")
def reference(params):
    """Plain JAX, one request at a time (``demo.lm_reference``), memoized."""
    memo: dict = {}

    def run(prompt, max_tokens):
        key = (tuple(int(t) for t in prompt), max_tokens)
        if key not in memo:
            memo[key] = demo.lm_reference(prompt, max_tokens, params, MAX_LENGTH)
        return memo[key]

    return run


def prompts(n, seed=0, high=32):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, high + 1, n)
    return [rng.integers(0, 256, int(k)).astype(np.int32) for k in lengths]


# --------------------------------------------------------------------------- the contract


def test_one_request_equals_plain_jax(lm, reference):
    for prompt in prompts(4, seed=1):
        out = lm.generate(prompt, max_tokens=12)
        assert out.tokens == reference(prompt, 12)
        assert out.finish_reason == ("stop" if out.tokens[-1] == demo.LM_EOS else "length")
        assert out.prompt_tokens == len(prompt)
    # text, where the artifact carries a tokenizer (bytes here), as the front ends encode it
    text = "Hi, pxrt"
    out = lm.generate(text, max_tokens=12)
    assert out.tokens == reference(list(text.encode()), 12) and out.prompt_tokens == 8


def test_continuous_batching_equals_one_at_a_time(lm, reference):
    """Staggered arrivals, more prompts than slots (slots reused), prompts across every
    prefill length, generations ending at different steps: each stream's tokens equal
    plain JAX greedy decoding of that prompt alone."""
    cases = [(p, 3 + (i * 7) % 20) for i, p in enumerate(prompts(14, seed=2))]
    results: dict = {}

    def client(i, prompt, max_tokens):
        time.sleep(0.002 * (i % 5))
        results[i] = list(lm.stream(prompt, max_tokens=max_tokens))

    threads = [threading.Thread(target=client, args=(i, p, m)) for i, (p, m) in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {len(p) for p, _ in cases} & set(range(1, 9)) and max(len(p) for p, _ in cases) > 16
    for i, (prompt, max_tokens) in enumerate(cases):
        assert results[i] == reference(prompt, max_tokens), i
    assert lm.busy_slots == 0 and lm.waiting == 0
    assert lm.compiles_after_load == 0


def test_prefills_beside_the_steps_or_between_them_give_the_same_tokens(lm, fused_lm, reference):
    """Both prefill paths, staggered arrivals over more prompts than slots: greedy
    streams equal plain JAX, seeded sampled ones equal each other's, and logprobs
    (the controls' insert and step after a prefill beside the steps) agree."""
    assert lm.overlap_prefill and not fused_lm.overlap_prefill
    cases = [(p, 2 + (i * 5) % 17) for i, p in enumerate(prompts(12, seed=41))]

    def run_on(dec):
        results: dict = {}

        def client(i, prompt, max_tokens):
            time.sleep(0.002 * (i % 4))
            sampled = {"temperature": 0.8, "top_k": 5, "seed": i} if i % 3 == 2 else {}
            want = {"logprobs": 2} if i % 4 == 1 else {}
            if i % 4 == 3:  # (the controls: their insert, then the full step)
                want = {"repetition_penalty": 1.8, "presence_penalty": 0.5, "min_tokens": 2}
            done = dec.submit(prompt, max_tokens=max_tokens, **want, **sampled).result(60)
            results[i] = (done.tokens, done.logprobs)

        threads = [threading.Thread(target=client, args=(i, *c)) for i, c in enumerate(cases)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    with _beside(lm):
        beside = run_on(lm)
    between = run_on(fused_lm)
    for i, (prompt, max_tokens) in enumerate(cases):
        assert beside[i][0] == between[i][0], i
        if i % 3 != 2 and i % 4 != 3:
            assert beside[i][0] == reference(prompt, max_tokens), i
        if i % 4 == 1:
            assert [t for t, _ in beside[i][1][0][1]] == [t for t, _ in between[i][1][0][1]]
            np.testing.assert_allclose(
                [p for p, _ in beside[i][1]], [p for p, _ in between[i][1]], rtol=1e-5, atol=1e-5
            )
    assert lm.counters["prefills"] > 0 and lm.compiles_after_load == 0


def test_blocks_of_steps_give_the_single_steps_tokens(lm, fused_lm, reference):
    """``lm`` runs up to 4 steps in one program while nothing waits (over fewer slots
    and a window of the cache too): greedy tokens are plain JAX's, a stop token or
    ``max_tokens`` inside a block ends the generation there, and seeded sampling gives
    the tokens of single steps (``fused_lm``)."""
    assert lm.multi_step == 4 and fused_lm.multi_step == 1
    before = dict(lm.counters)
    cases = list(zip(prompts(5, seed=51), (3, 6, 9, 13, 30)))
    # (steps priced well under the 2 ms a block may take, the launch at nothing: a
    # loaded machine's measured prices at load can be over it, and then blocks are
    # single steps)
    cost, launch = dict(lm._step_cost), lm._launch_s
    lm._step_cost, lm._launch_s = dict.fromkeys(cost, 1e-4), 0.0
    try:
        with lm._cond:
            gens = [lm.submit(p, max_tokens=m) for p, m in cases]
        got = [g.result(timeout=60).tokens for g in gens]
        c = {k: lm.counters[k] - before[k] for k in ("steps", "step_programs")}
        prompt = prompts(1, seed=52)[0]
        want = reference(prompt, 20)
        stop = want[5]
        cut = want[: want.index(stop) + 1]
        stopped = lm.generate(prompt, max_tokens=20, stop_ids=[stop]).tokens
        sampled = dict(temperature=0.9, top_k=20, seed=8)
        blocks = lm.generate(prompt, max_tokens=20, **sampled).tokens
    finally:
        lm._step_cost, lm._launch_s = cost, launch
    assert got == [reference(p, m) for p, m in cases]
    assert c["steps"] >= 2 * c["step_programs"], c  # (blocks ran)
    assert stopped == cut
    assert fused_lm.generate(prompt, max_tokens=20, stop_ids=[stop]).tokens == cut
    assert blocks == fused_lm.generate(prompt, max_tokens=20, **sampled).tokens
    assert fused_lm.counters["steps"] == fused_lm.counters["step_programs"]


def test_a_blocks_launch_is_the_steps_price_less_what_a_further_step_adds(monkeypatch):
    """The launch the scheduler sizes blocks by is the step's price less the device
    time a further step adds (the block's and one step's least times): the price less
    the launch is that step time, whatever noise the price met. Before, the launch
    came from the least single step alone, and a price measured on a noisier run
    made every step look dearer (blocks of 3 on the TPU where 4 fit)."""
    from pxrt.decoder import load as decoder_load

    clock = [0.0]
    monkeypatch.setattr(decoder_load.time, "perf_counter", lambda: clock[0])

    class Step:  # ``cost(n)`` seconds for a block of n, on a fake clock
        steps = 4

        def __init__(self, cost):
            self.cost = cost

        def __call__(self, params, state, n=1):
            clock[0] += self.cost(n)
            return state, np.zeros(1), None

    got = object.__new__(decoder_load._Obtained)
    got.step = Step(lambda n: 1e-3 + 0.2e-3 * n)  # a launch of 1 ms, 0.2 ms a step
    # (the price a median of noisier runs: 1.5 ms against the least 1.2)
    launch = got._launch(None, [None], 1.0, 1.5e-3)
    assert launch == pytest.approx(1.3e-3) and 1.5e-3 - launch == pytest.approx(0.2e-3)
    # noise that made the block look cheaper than one step: no step time, all launch
    got.step = Step(lambda n: 1.2e-3 if n == 1 else 1.0e-3)
    assert got._launch(None, [None], 1.0, 1.5e-3) == pytest.approx(1.5e-3)


def test_the_default_prefill_lengths_pad_a_prompt_by_a_quarter_at_most(tmp_path):
    """Loaded without ``prefill_lengths``, a decoder compiles the artifact's and, between
    two from 32 up, every multiple of a quarter of the shorter (a multiple of every
    length given): a prompt of 33-48 tokens is prefilled at 48, not 64. Tokens equal
    plain JAX's at every new length; lengths given, or traced concrete, are kept."""
    from pxrt.decoder.load import finer_lengths

    assert finer_lengths([16, 32, 64, 128, 256]) == [
        16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256
    ]  # fmt: skip
    assert finer_lengths([8, 16]) == [8, 16] and finer_lengths([8, 64]) == [8, 64]
    assert finer_lengths([32, 64, 128]) == [32, 64, 96, 128]  # (a model's multiple of 32)
    sizes = {"dim": 16, "heads": 2, "layers": 1}
    path = demo.export_lm(
        str(tmp_path / "lm"), slots=2, max_length=128, prefill_lengths=(8, 32, 64),
        prefill_batches=(1,), **sizes,
    )  # fmt: skip
    options = dict(prefix_cache_tokens=0, step_slots=(), sampling_controls=False)
    dec = pxrt.load(path, **options)  # (deferred: the cells at 48 come last)
    try:
        assert dec.prefill_lengths == (8, 32, 48, 64)
        params = demo.make_lm_params(**sizes)
        cases = [np.arange(n, dtype=np.int32) % 200 + 3 for n in (33, 40, 48, 49)]
        wants = [demo.lm_reference(p, 6, params, 128) for p in cases]
        for _ in range(2):  # (as they come: in chunks, at 64, at 48; then all in use)
            for prompt, want in zip(cases, wants):
                assert dec.generate(prompt, max_tokens=6).tokens == want, len(prompt)
            assert dec.wait_programs(120) and dec.deferred == 0
        assert (1, 48) in dec._cells
    finally:
        dec.close()
    dec = pxrt.load(path, prefill_lengths=(8, 32, 64), defer=False, **options)
    try:
        assert dec.prefill_lengths == (8, 32, 64)
    finally:
        dec.close()
    # Only the lengths the load added come last: lengths given (the artifact's or not)
    # are a way in at once (a decoder without extend has no other).
    from pxrt.decoder import export, load

    art, devices = export.read(path), jax.local_devices()
    plan = lambda **over: load._plan(  # noqa: E731
        art, len(devices), False, **(dict(
            slots=None, max_length=None, prefill_batches=None, chunk_lengths=None,
            chunk_batches=None, prefix_cache_tokens=None, prefix_block=16, step_slots=None,
            step_lengths=None, speculative_tokens=0, max_waiting=8, sampling_controls=True,
            chunk_tokens=None, itl_bound_ms=None, devices=devices,
        ) | over)
    )  # fmt: skip
    assert plan(prefill_lengths=None).between == {48}
    assert plan(prefill_lengths=(16, 48)).between == frozenset()
    jobs = [("state", 0, 0), ("step", 0, 0), ("rows", 1, 16), ("insert", 1, 16)]
    jobs += [("rows", 1, 48), ("insert", 1, 48), ("rows", 4, 48)]
    assert load._split(jobs, True, frozenset())[0] == jobs[:-1]
    assert load._split(jobs, True, {48}) == (jobs[:4], jobs[4:])


def test_a_prompt_is_prefilled_ahead_of_a_free_slot(lm, reference):
    """With every slot taken and prefills beside the steps (the CPU's default), the
    next prompts' rows are computed on the prefill thread before a slot frees and go
    into the first that do: every stream's tokens are plain JAX's; one cancelled
    meanwhile takes no slot."""
    assert lm.overlap_prefill
    before = lm.counters["prefills_ahead"]
    running = prompts(lm.slots, seed=63, high=8)
    lengths = [MAX_LENGTH - len(p) - 1 - i for i, p in enumerate(running)]  # (long)
    extra, dropped = prompts(2, seed=64, high=8)
    with lm._cond:  # (one turn admits them all: the extra two ahead of free slots)
        gens = [lm.submit(p, max_tokens=m) for p, m in zip(running, lengths)]
        kept, gone = lm.submit(extra, max_tokens=6), lm.submit(dropped, max_tokens=6)
    gone.cancel()
    got = [g.result(timeout=60).tokens for g in gens]
    assert kept.result(timeout=60).tokens == reference(extra, 6)
    assert gone.result(timeout=60).finish_reason == "cancelled"
    assert got == [reference(p, m) for p, m in zip(running, lengths)]
    assert lm.counters["prefills_ahead"] > before
    deadline = time.monotonic() + 30  # (the last slot goes back as its stream ends)
    while lm.busy_slots and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(lm._table.free) == list(range(lm.slots))  # (none lost to the cancel)


def test_no_prompt_is_prefilled_ahead_before_a_prefill_cell_is_in(lm, reference):
    """A deferred load is ready with its extend cells only: with every slot taken then,
    the prompts that wait are not prefilled ahead (no cell to do it) but go in chunks as
    slots free, and every stream's tokens are plain JAX's. (`pxrt demo lm`'s callers
    took every slot before its prefill cells came in, and the loop failed every
    generation in flight.)"""
    cells, batches = lm._cells, lm.prefill_batches
    lm._cells, lm.prefill_batches = {}, ()  # (as before the later programs come in)
    try:
        asks = prompts(lm.slots + 4, seed=65, high=8)
        chunks, ahead = lm.counters["chunks"], lm.counters["prefills_ahead"]
        with lm._cond:  # (one turn admits them all: four more than the slots)
            gens = [lm.submit(p, max_tokens=6) for p in asks]
        assert [g.result(timeout=60).tokens for g in gens] == [reference(p, 6) for p in asks]
        assert lm.counters["prefills_ahead"] == ahead and lm.counters["chunks"] > chunks
    finally:
        lm._cells, lm.prefill_batches = cells, batches


def test_prompts_prefilled_ahead_together_go_in_as_slots_free(lm, reference):
    """Several prompts prefilled ahead of free slots in one unit (its cell makes more
    prompts per second) go in as the running streams end, each into the slot that
    freed, and not once as many slots are free as the unit has rows; one cancelled
    meanwhile takes none. Every stream's tokens are plain JAX's."""
    price = lm._price
    lm._price = lambda n, length, left, *, first: (max(lm.prefill_batches), min(n, 4), 0.0)
    try:
        before = dict(lm.counters)
        running = prompts(lm.slots, seed=65, high=8)
        lengths = [6 + 4 * i for i in range(lm.slots)]  # (one ends every 4 steps)
        extra = prompts(4, seed=66, high=8)
        with lm._cond:  # (one turn admits them all: the extra four ahead of free slots)
            gens = [lm.submit(p, max_tokens=m) for p, m in zip(running, lengths)]
            ahead = [lm.submit(p, max_tokens=5) for p in extra]
        ahead[1].cancel()
        for g, p, m in zip(gens, running, lengths):
            assert g.result(timeout=60).tokens == reference(p, m)
        for i, (g, p) in enumerate(zip(ahead, extra)):
            if i != 1:
                assert g.result(timeout=60).tokens == reference(p, 5)
    finally:
        lm._price = price
    assert ahead[1].result(timeout=60).finish_reason == "cancelled"
    assert lm.counters["prefills_ahead"] - before["prefills_ahead"] >= 3
    assert lm.counters["prefills"] - before["prefills"] == 3  # (4 + 4 + the four ahead)
    # The first went in as the first stream ended, before the third had.
    assert ahead[0].t_first < gens[2].t_last
    deadline = time.monotonic() + 30
    while lm.busy_slots and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(lm._table.free) == list(range(lm.slots))  # (none lost to the cancel)


def test_controls_apply_to_a_prompt_prefilled_beside_running_streams(lm, fused_lm):
    """A prompt with sampling controls admitted while plain streams run (their steps
    the plain one): once inserted, its steps are the full one, with its controls, as
    between two steps."""
    controls = {"repetition_penalty": 1.8, "presence_penalty": 0.5, "min_tokens": 3}
    running, prompt = prompts(2, seed=47)
    got = []
    for dec in (lm, fused_lm):
        plain = dec.submit(running, max_tokens=40)
        next(iter(plain))  # (a plain stream busy: the steps are the plain one)
        with _beside(lm):
            got.append(dec.generate(prompt, max_tokens=12, **controls).tokens)
        plain.result(timeout=60)
    assert got[0] == got[1]
    assert got[0] != lm.generate(prompt, max_tokens=12).tokens  # (the controls matter)


@contextlib.contextmanager
def _beside(dec):
    """``dec``'s steps priced at nothing, so that every prefill while a slot is busy
    goes to the prefill thread (a prompt that costs no more than the coming step goes
    between two steps: the demo's all do), whatever the measured placement says."""
    costs, placement = dict(dec._step_cost), dec._placement
    dec._step_cost = dict.fromkeys(costs, 0.0)
    dec._placement = None
    try:
        yield
    finally:
        dec._step_cost, dec._placement = costs, placement


def test_a_prompt_goes_beside_the_steps_when_it_costs_more_than_the_coming_step(lm):
    """The choice per prefill: with no slot busy, at once (nobody waits between
    tokens); with one busy, at once if it costs no more than the coming step, else on
    the prefill thread, ``IN_FLIGHT`` at a time."""
    from pxrt.decoder.scheduler import IN_FLIGHT

    def admitted(n, busy, in_flight=0):
        with lm._cond:  # (the loop waits: admission as it would run now)
            gens = [lm.submit(p, max_tokens=2) for p in prompts(n, seed=48, high=8)]
            lm._table.busy += busy  # (as if a slot were busy)
            lm._prefilling = [None] * in_flight  # (as if units were on the thread)
            try:
                units = lm._admit()
            finally:
                lm._table.busy -= busy
                lm._prefilling = []
                # (put back: the loop admits them once let go)
                lm._waiting.extendleft(reversed([g for u in units for g in u[0]]))
        for gen in gens:
            gen.result(timeout=60)
        return [u[3] for u in units]

    assert not any(admitted(3, busy=0))
    cost, placement = dict(lm._step_cost), lm._placement
    lm._placement = None  # (what the traffic measured: the next test)
    try:
        lm._step_cost = dict.fromkeys(cost, 1.0)  # (every prefill cheaper than a step)
        assert not any(admitted(3, busy=1))
        lm._step_cost = dict.fromkeys(cost, 0.0)  # (none is)
        beside = admitted(9, busy=1)
        assert beside and all(beside) and len(beside) <= IN_FLIGHT
        assert admitted(9, busy=1, in_flight=IN_FLIGHT - 1) == [True]
        assert admitted(3, busy=1, in_flight=IN_FLIGHT) == []
    finally:
        lm._step_cost, lm._placement = cost, placement


def test_a_prompt_goes_between_two_steps_while_that_made_more_tokens(lm, fused_lm, lm_path):
    """With prefills beside the steps by default, where a prompt that costs more than
    the coming step goes is the measured rule's (``pxrt.decoder.placement``): beside,
    or between two steps while it stretches the gap to ``BETWEEN_STEPS`` steps at most,
    within the turn's bound. ``overlap_prefill=True`` keeps them beside; without the
    thread there is nothing to choose."""
    from pxrt.decoder import export, load
    from pxrt.decoder.placement import BETWEEN_STEPS, Placement

    assert isinstance(lm._placement, Placement) and fused_lm._placement is None
    art, devices = export.read(lm_path), jax.local_devices()
    plan = lambda **over: load._plan(  # noqa: E731
        art, len(devices), False, **(dict(
            slots=None, max_length=None, prefill_lengths=None, prefill_batches=None,
            chunk_lengths=None, chunk_batches=None, prefix_cache_tokens=None,
            prefix_block=16, step_slots=None, step_lengths=None, speculative_tokens=0,
            max_waiting=8, sampling_controls=True, chunk_tokens=None, itl_bound_ms=None,
            devices=devices,
        ) | over)
    )  # fmt: skip
    assert plan().placement and not plan(overlap_prefill=True).placement

    def admitted(rule):
        with lm._cond:  # (the loop waits: admission as it would run now)
            gens = [lm.submit(p, max_tokens=2) for p in prompts(3, seed=49, high=8)]
            lm._table.busy += 1  # (as if a slot were busy)
            try:
                lm._placement = Placement(between=rule)
                units = lm._admit()
            finally:
                lm._table.busy -= 1
                lm._waiting.extendleft(reversed([g for u in units for g in u[0]]))
        for gen in gens:
            gen.result(timeout=60)
        return [u[3] for u in units]

    cost, prefill, placement, bound = (
        dict(lm._step_cost), dict(lm._prefill_cost), lm._placement, lm.itl_bound_s
    )
    try:
        # Every prefill 1 s, every step just over 1 / (BETWEEN_STEPS - 1) of it (a
        # prefill between two steps stretches the gap to just under BETWEEN_STEPS
        # steps), a bound far above.
        lm._prefill_cost = dict.fromkeys(prefill, 1.0)
        lm._step_cost = dict.fromkeys(cost, 1.01 / (BETWEEN_STEPS - 1))
        lm.itl_bound_s = 100.0
        beside, between = admitted(False), admitted(True)
        assert beside and all(beside) and between and not any(between)
        lm._step_cost = dict.fromkeys(cost, 0.99 / (BETWEEN_STEPS - 1))  # (over the steps)
        beside = admitted(True)
        assert beside and all(beside)
        lm._step_cost = dict.fromkeys(cost, 1.01 / (BETWEEN_STEPS - 1))
        lm.itl_bound_s = 1.5  # (over the turn's bound)
        beside = admitted(True)
        assert beside and all(beside)
    finally:
        lm._step_cost, lm._prefill_cost, lm._placement = cost, prefill, placement
        lm.itl_bound_s = bound


def _slow_rows(dec, started, release):
    """Every prefill cell's rows program of ``dec`` holding its result until
    ``release`` is set (``started`` set once one ran); undo with the returned call."""
    real = {key: cell.compiled.rows for key, cell in dec._cells.items()}

    def held(rows):
        def run(*args):
            out = rows(*args)
            started.set()
            release.wait(30)
            return out

        return run

    for key, cell in dec._cells.items():
        cell.compiled.rows = held(real[key])

    def undo():
        for key, cell in dec._cells.items():
            cell.compiled.rows = real[key]

    return undo


def test_a_generation_cancelled_while_prefilled_beside_gives_its_slot_back_once(lm, reference):
    """A generation cancelled while its prompt is on the prefill thread keeps its
    reserved slot until the rows come back (nothing else can be inserted there while
    they are in flight), then gives it back exactly once; the prompts with it and after
    it are exact."""
    started, release = threading.Event(), threading.Event()
    busy = lm.submit(prompts(1, seed=49, high=4)[0], max_tokens=50)
    next(iter(busy))  # (a slot busy: the prompts go beside the steps)
    undo = _slow_rows(lm, started, release)
    try:
        with _beside(lm):
            first = lm.submit(prompts(1, seed=42)[0], max_tokens=6)
            assert started.wait(30)
            assert lm._in_prefill and first.slot < 0  # (on the thread: reserved, not busy)
            first.cancel()
            others = prompts(9, seed=43)
            gens = [lm.submit(p, max_tokens=5) for p in others]
            time.sleep(0.05)
            release.set()
            for gen, prompt in zip(gens, others):
                assert gen.result(timeout=60).tokens == reference(prompt, 5)
    finally:
        release.set()
        undo()
    busy.result(timeout=60)
    assert first.finish_reason == "cancelled" and first.tokens == []
    deadline = time.monotonic() + 10
    while (lm.busy_slots or lm._prefilling) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(lm._table.free) == list(range(lm.slots)), lm._table.free
    assert not lm._in_prefill and not lm._prefilling


def test_a_failed_prefill_beside_the_steps_fails_only_its_prompts(lm, reference):
    """A prefill that fails on the prefill thread fails the generations it carried,
    with the cause; the streams running meanwhile and the next prompts are exact."""

    def slow(step):  # (a tenth of a second a step: still busy when the victim comes)
        return lambda *args: time.sleep(0.1) or step(*args)

    steps, windows = dict(lm._steps), dict(lm._windows)
    lm._steps.update({k: slow(v) for k, v in steps.items()})
    lm._windows.update({k: slow(v) for k, v in windows.items()})
    running = lm.submit(prompts(1, seed=44)[0], max_tokens=30)
    next(iter(running))  # (busy before the failing prefill, for seconds)
    real = {key: cell.compiled.rows for key, cell in lm._cells.items()}
    failed = threading.Event()

    def failing(rows):
        def run(*args):
            if not failed.is_set():
                failed.set()
                raise RuntimeError("injected prefill failure")
            return rows(*args)

        return run

    for key, cell in lm._cells.items():
        cell.compiled.rows = failing(real[key])
    try:
        with _beside(lm):  # (until it has failed: the loop admits it on its own time)
            victim = lm.submit(prompts(1, seed=45)[0], max_tokens=4)
            with pytest.raises(RuntimeError, match="prefill failed: .*injected prefill failure"):
                victim.result(timeout=30)
        lm._steps.update(steps)
        lm._windows.update(windows)
        after = prompts(3, seed=46)
        assert [lm.generate(p, max_tokens=4).tokens for p in after] == [
            reference(p, 4) for p in after
        ]
    finally:
        lm._steps.update(steps)
        lm._windows.update(windows)
        for key, cell in lm._cells.items():
            cell.compiled.rows = real[key]
    assert running.result(timeout=60).tokens == reference(prompts(1, seed=44)[0], 30)
    assert victim.finish_reason == "error"


def test_async_streams_under_each_loop(lm, reference, run):
    cases = [(p, 5 + i) for i, p in enumerate(prompts(6, seed=3))]

    async def main():
        async def one(i, prompt, max_tokens):
            await asyncio.sleep(0.001 * i)
            return [t async for t in lm.agenerate(prompt, max_tokens=max_tokens)]

        return await asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(cases)))

    got = run(main)
    assert got == [reference(p, m) for p, m in cases]


def test_listeners_take_each_steps_tokens(lm, reference, run, caplog):
    """``listen``: the callback runs on the loop after steps that gave tokens and once
    at the end; ``take`` gives each token once, in order: the engine's tokens. A listener
    that raises is logged and the others go on."""
    cases = [(p, 6 + i) for i, p in enumerate(prompts(4, seed=5))]

    async def main():
        got = [[] for _ in cases]
        ended = [asyncio.Event() for _ in cases]
        calls = [0] * len(cases)

        def listener(i):
            def on(gen):
                done = gen.finish_reason is not None
                calls[i] += 1
                got[i].extend(gen.take())
                if done:
                    ended[i].set()
                if i == 0:
                    raise RuntimeError("a broken listener")

            return on

        gens = [lm.submit(p, max_tokens=m) for p, m in cases]
        await asyncio.sleep(0.05)  # some tokens before listening: delivered at once
        for i, gen in enumerate(gens):
            gen.listen(listener(i))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in ended)), 30)
        return got, calls, gens

    got, calls, gens = run(main)
    assert got == [reference(p, m) for p, m in cases]
    assert all(g.delivered == len(g.tokens) for g in gens)
    assert all(c <= len(t) + 1 for c, t in zip(calls, got))  # per step, not per poll
    assert "a broken listener" in caplog.text


def test_stop_ids_end_a_generation_with_the_stop_token(lm, reference):
    prompt = prompts(1, seed=4)[0]
    full = reference(prompt, 20)
    stop = full[5]
    first = full.index(stop)
    out = lm.generate(prompt, max_tokens=20, stop_ids=[stop])
    assert out.tokens == full[: first + 1] and out.finish_reason == "stop"


def test_generation_stops_at_the_end_of_the_cache(lm, reference):
    prompt = prompts(1, seed=5, high=32)[0][:30]
    out = lm.generate(prompt, max_tokens=1000)
    assert len(out.tokens) <= MAX_LENGTH - len(prompt)
    assert out.tokens == reference(prompt, 1000)


# --------------------------------------------------------------------------- sampling


def test_seeded_sampling_is_the_same_whatever_shares_the_batch(lm):
    prompt = prompts(1, seed=6)[0]
    options = dict(max_tokens=16, temperature=8.0, top_k=50, top_p=0.95, seed=1234)
    alone = lm.generate(prompt, **options).tokens
    crowd = [
        lm.submit(p, max_tokens=16, temperature=8.0, seed=i)
        for i, p in enumerate(prompts(7, seed=7))
    ]
    together = lm.submit(prompt, **options)
    assert together.result().tokens == alone
    for g in crowd:
        g.result()
    other = lm.generate(prompt, **(options | {"seed": 99})).tokens
    assert other != alone  # the seed matters (high temperature)


@pytest.mark.once
def test_sampling_limits_on_device():
    logits = jnp.asarray(np.log([[0.5, 0.3, 0.1, 0.05, 0.05]] * 64), jnp.float32)
    n = logits.shape[0]
    seeds = jnp.arange(n, dtype=jnp.uint32)
    pos = jnp.zeros(n, jnp.int32)

    def draw(temperature, top_k, top_p):
        return np.asarray(
            generate.sample(
                logits,
                jnp.full(n, temperature, jnp.float32),
                jnp.full(n, top_k, jnp.int32),
                jnp.full(n, top_p, jnp.float32),
                seeds,
                pos,
            )
        )

    assert set(draw(0.0, 0, 1.0)) == {0}  # greedy
    assert set(draw(1.0, 1, 1.0)) == {0}  # top-k 1 is greedy
    assert set(draw(1.0, 2, 1.0)) == {0, 1}  # only the two likeliest
    assert set(draw(1.0, 0, 0.75)) == {0, 1}  # 0.5 + 0.3 reach 0.75
    assert set(draw(1.0, 0, 0.4)) == {0}
    assert len(set(draw(1.0, 0, 1.0))) >= 4  # everything is possible
    # Per-row parameters: greedy and sampled rows in one call.
    mixed = generate.sample(
        logits,
        jnp.where(jnp.arange(n) % 2 == 0, 0.0, 1.0).astype(jnp.float32),
        jnp.zeros(n, jnp.int32),
        jnp.ones(n, jnp.float32),
        seeds,
        pos,
    )
    assert set(np.asarray(mixed)[::2]) == {0}


def test_the_top_k_top_p_cut_is_a_sorted_rows_whether_or_not_it_sorts():
    """The cut (looked for among each row's CUT_CANDIDATES largest logits, the rows
    sorted only when one's lies beyond) equals numpy's over whole sorted rows: peaked
    rows (found among the candidates), flat ones with top-p (beyond them: sorted), top-k
    above the candidates, and nothing cut."""
    from pxrt import sampling

    rng = np.random.default_rng(3)
    vocab = 1000
    peaked = rng.standard_normal((6, vocab)) * 8
    flat = rng.standard_normal((6, vocab)) * 0.1

    def want(row, k, p):
        desc = np.sort(row)[::-1]
        k = k if 0 < k < vocab else vocab
        probs = np.exp(desc[:k] - desc[0])
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        kept = max(int(((before < p) | (p >= 1.0)).sum()), 1)
        return -np.inf if k == vocab and p >= 1.0 else desc[kept - 1]

    cases = [(0, 1.0), (5, 1.0), (0, 0.9), (40, 0.5), (300, 1.0), (vocab, 0.95)]
    for rows in (peaked, flat):
        for mix in (cases, [(0, 1.0)] * 6, [(3, 1.0), (0, 0.3)] * 3):
            k = np.array([c[0] if 0 < c[0] < vocab else vocab for c in mix], np.int32)
            p = np.array([c[1] for c in mix], np.float32)
            got = np.asarray(sampling._cut(jnp.asarray(rows, jnp.float32), jnp.asarray(k),
                                           jnp.asarray(p)))  # fmt: skip
            expect = [want(r.astype(np.float32), int(a), float(b)) for r, a, b in zip(rows, k, p)]
            np.testing.assert_allclose(got, expect, rtol=1e-6)


@pytest.mark.once
def test_greedy_is_argmax_ties_nan_and_all():
    """``sampling.greedy`` (two plain reductions, not argmax's (value, index) reduce)
    picks ``jnp.argmax``'s index: random rows, ties (the first), -inf and NaN (the
    first NaN), one or many rows, float32 and bfloat16, under jit."""
    from pxrt import sampling

    rng = np.random.default_rng(11)
    rows = rng.standard_normal((9, 300)).astype(np.float32)
    rows[1, [5, 17, 250]] = 9.0  # a tie: the first
    rows[2, :] = -np.inf
    rows[3, [40, 90]] = np.nan  # the first NaN, as argmax
    rows[4, :] = 1.0
    rows[5, 299] = 1e30
    rows[6] = np.round(rows[6])  # many ties
    fast = jax.jit(sampling.greedy)
    for x in (rows, rows[:1], rows[3:4], rows[:, :7]):
        for dtype in (jnp.float32, jnp.bfloat16):
            a = jnp.asarray(x, dtype)
            want = np.asarray(jnp.argmax(a, axis=-1))
            got = np.asarray(fast(a))
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- logprobs, controls


def _log_softmax(logits):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32)))


@pytest.mark.once  # (device programs: the twins change nothing they run)
def test_logprobs_equal_a_log_softmax_in_plain_jax(lm, params):
    """Each token's log-probability and its 5 likeliest alternatives equal a
    log-softmax of the model's logits in plain JAX (<= 1e-4): prompts prefilled whole,
    chunked (longer than any prefill) and copied from the prefix cache, batched with
    requests that want none (which are unchanged)."""
    rng = np.random.default_rng(60)
    shared = rng.integers(0, 256, 40).astype(np.int32)
    cases = [rng.integers(0, 256, n).astype(np.int32) for n in (5, 30, 45)]
    cases += [np.concatenate([shared, [7, 8]]), np.concatenate([shared, [9]])]
    lm.generate(cases[3], max_tokens=1)  # its start cached: the last two hit
    plain = [lm.submit(p, max_tokens=9) for p in prompts(3, seed=61)]
    gens = [lm.submit(p, max_tokens=9, logprobs=5) for p in cases]
    for prompt, gen in zip(cases, gens):
        out = gen.result(timeout=60)
        want, logits = demo.lm_reference_steps(prompt, 9, params, MAX_LENGTH)
        assert out.tokens == want
        assert len(out.logprobs) == len(out.tokens)
        for token, (chosen, top), row in zip(out.tokens, out.logprobs, logits):
            ref = _log_softmax(row)
            assert abs(chosen - ref[token]) <= 1e-4
            assert len(top) == 5
            ids, values = [t for t, _ in top], np.array([v for _, v in top])
            np.testing.assert_allclose(values, np.sort(ref)[::-1][:5], atol=1e-4)
            np.testing.assert_allclose(ref[ids], values, atol=1e-4)
            assert ids[0] == token  # greedy: the likeliest
    for prompt, gen in zip(prompts(3, seed=61), plain):
        assert gen.result().tokens == demo.lm_reference(prompt, 9, params, MAX_LENGTH)
        assert gen.result().logprobs is None
    assert lm.compiles_after_load == 0


@pytest.mark.once  # (device programs: the twins change nothing they run)
def test_prompt_logprobs_equal_a_log_softmax_in_plain_jax(lm, params, reference):
    """A prompt's logprobs (each token's after the ones before it, with the likeliest
    alternatives; none for the first): plain JAX's causal logits over the whole prompt,
    for prompts within one chunk and over several, beside requests without them; the
    generated tokens do not change. A decoder without extend refuses them by name."""
    rng = np.random.default_rng(33)
    prompts_ = [rng.integers(0, 256, n).astype(np.int32) for n in (3, 20, 50)]
    gens = [lm.submit(p, max_tokens=4, prompt_logprobs=3) for p in prompts_]
    plain = [lm.submit(p, max_tokens=4) for p in prompts_]
    heads = SIZES["heads"]
    kv = jnp.zeros((1, SIZES["layers"], MAX_LENGTH, heads, SIZES["dim"] // heads), jnp.float32)
    rows = {"k": kv, "v": kv}
    for prompt, gen, other in zip(prompts_, gens, plain):
        got = gen.result(timeout=60)
        assert got.tokens == other.result().tokens == reference(prompt, 4)
        _, logits = demo.lm_extend(params, rows, jnp.asarray(prompt)[None], jnp.zeros(1, jnp.int32))
        logp = _log_softmax(np.asarray(logits[0]))
        assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == len(prompt)
        for i, (lp, top) in enumerate(got.prompt_logprobs[1:]):
            row = logp[i]
            assert lp == pytest.approx(row[prompt[i + 1]], abs=1e-4)
            best = np.argsort(row)[::-1][:3]
            assert [t for t, _ in top] == list(best)
            np.testing.assert_allclose([v for _, v in top], row[best], atol=1e-4)
        assert other.result().prompt_logprobs is None


def test_prompt_logprobs_need_extend(lm, monkeypatch):
    monkeypatch.setattr(lm, "chunk_lengths", ())  # (an artifact exported without extend)
    with pytest.raises(ValueError, match="prompt_logprobs: decoder 'lm' has no extend program"):
        lm.submit([1, 2], max_tokens=2, prompt_logprobs=1)


def _controlled(prompt, bias=None, presence=0.0, frequency=0.0, repetition=1.0, min_tokens=0,
                stops=(demo.LM_EOS,)):  # fmt: skip
    """The controls, as a plain numpy pick over plain JAX's logits (greedy)."""
    prompted = np.zeros(demo.LM_VOCAB, bool)
    prompted[np.asarray(prompt)] = True

    def choose(logits, tokens):
        out = logits.copy()
        for t, b in (bias or {}).items():
            out[int(t)] += np.float32(b)
        counts = np.bincount(np.asarray(tokens, np.int64), minlength=demo.LM_VOCAB)
        counts = counts.astype(np.float32)
        seen = prompted | (counts > 0)
        rep = np.float32(repetition)
        out = np.where(seen, np.where(out > 0, out / rep, out * rep), out)
        out = out - np.float32(frequency) * counts - np.float32(presence) * (counts > 0)
        if len(tokens) < min_tokens:
            out[list(stops)] = -np.inf
        return int(np.argmax(out))

    return choose


@pytest.mark.once  # (device programs: the twins change nothing they run)
def _windowed_forwards(lm, monkeypatch):
    """The windows the step with the controls ran its forward over, from now on."""
    ran = []
    forwards = lm._full_step.forwards
    assert sorted(forwards) == [0, *lm.step_lengths]
    for w in lm.step_lengths:
        counted = functools.partial(lambda f, w, *a: ran.append(w) or f(*a), forwards[w], w)
        monkeypatch.setitem(forwards, w, counted)
    return ran


def test_controls_equal_the_same_controls_in_numpy(lm, params, reference, monkeypatch):
    """logit_bias, the penalties and min_tokens on the device pick the tokens plain
    numpy picks from plain JAX's logits, whole and chunked prompts, batched with
    requests without controls (unchanged, also in slots controlled ones had); the
    step's forward over the cache's first positions while every busy slot is there."""
    windowed = _windowed_forwards(lm, monkeypatch)
    rng = np.random.default_rng(62)
    base = [rng.integers(0, 256, n).astype(np.int32) for n in (6, 20, 44)]
    first = reference(base[0], 1)[0]
    cases = [
        (base[0], {"logit_bias": {first: -100.0, "3": 5.0}}),
        (base[1], {"repetition_penalty": 1.8}),
        (base[2], {"presence_penalty": 1.5, "frequency_penalty": 0.7}),
        (base[0], {"min_tokens": 5, "stop_ids": [first]}),
        (base[1], {"repetition_penalty": 0.6, "frequency_penalty": -1.0, "logprobs": 0}),
    ]
    names = {"logit_bias": "bias", "repetition_penalty": "repetition",
             "presence_penalty": "presence", "frequency_penalty": "frequency",
             "min_tokens": "min_tokens"}  # fmt: skip
    for _ in range(2):  # (again: the slots now hold the controls of the first round)
        plain = [lm.submit(p, max_tokens=10) for p in base]
        gens = [lm.submit(p, max_tokens=10, **o) for p, o in cases]
        for (prompt, options), gen in zip(cases, gens):
            stops = (demo.LM_EOS, *options.get("stop_ids", ()))
            kwargs = {names[k]: v for k, v in options.items() if k in names}
            choose = _controlled(prompt, stops=stops, **kwargs)
            want, _ = demo.lm_reference_steps(prompt, 10, params, MAX_LENGTH, stops, choose)
            assert gen.result(timeout=60).tokens == want, options
        for prompt, gen in zip(base, plain):
            assert gen.result().tokens == reference(prompt, 10)
    # min_tokens held the stop back: without it, the stop token ends it at once.
    assert lm.generate(base[0], max_tokens=10, stop_ids=[first]).tokens == [first]
    # Alone, a short prompt's slot stays within the first positions: its forwards run
    # over them (beside the longer prompts above that depends on the turns' timing).
    choose = _controlled(base[0], stops=(demo.LM_EOS,), presence=1.5)
    want, _ = demo.lm_reference_steps(base[0], 10, params, MAX_LENGTH, (demo.LM_EOS,), choose)
    assert lm.generate(base[0], max_tokens=10, presence_penalty=1.5).tokens == want
    assert windowed and set(windowed) <= set(lm.step_lengths), windowed
    assert lm.compiles_after_load == 0


def _grammar_pick(lm, structured):
    """The structured output's constraint as a plain numpy pick (greedy) over plain
    JAX's logits: llguidance's mask for the tokens so far, from a matcher of its own."""
    from pxrt.decoder.grammar import grammars_of

    grammars = grammars_of(lm)
    matcher, _ = grammars.matcher(structured)

    def choose(logits, tokens):
        if tokens:
            assert matcher.consume_token(tokens[-1])
        bits = np.unpackbits(grammars.masks([(matcher, 0)], 1)[0].view(np.uint8), bitorder="little")
        return int(np.argmax(np.where(bits[: demo.LM_VOCAB] > 0, logits, -np.inf)))

    return choose


def _until_complete(lm, structured, tokens):
    """``tokens`` up to the one that completes the grammar (where pxrt ends it)."""
    from pxrt.decoder.grammar import grammars_of

    matcher, _ = grammars_of(lm).matcher(structured)
    for i, t in enumerate(tokens):
        assert matcher.consume_token(t)
        if matcher.is_stopped():
            return tokens[: i + 1]
    return tokens


@pytest.mark.once  # (device programs: the twins change nothing they run)
def test_structured_outputs_equal_plain_jax_masked_by_the_grammar(
    lm, params, reference, monkeypatch
):
    """A JSON schema, JSON mode, a regex, a choice and a Lark grammar: greedy tokens are
    plain JAX's argmax over the tokens llguidance allows, whole and chunked prompts,
    batched with free requests (unchanged, also in slots constrained ones had); the
    text matches; sampled (temperature 1) ones match too; the generation ends where the
    grammar does."""
    import re

    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                       "tag": {"enum": ["a", "bc"]}, "ok": {"type": "boolean"}},
        "required": ["id", "tag", "ok"], "additionalProperties": False,
    }  # fmt: skip
    rng = np.random.default_rng(71)
    base = [rng.integers(0, 256, n).astype(np.int32) for n in (5, 20, 44)]
    cases = [
        (base[0], {"json": schema}),
        (base[1], {"regex": r"[0-9]{2,4}-[a-f]{1,3}"}),
        (base[2], {"choice": ["yes", "no", "maybe"]}),
        (base[0], {"json_object": True}),
        (base[1], {"grammar": 'start: "(" num ("," num)? ")"\nnum: /[0-9]{1,2}/'}),
    ]
    windowed = _windowed_forwards(lm, monkeypatch)
    for _ in range(2):  # (again: the slots now hold the first round's masks)
        plain = [lm.submit(p, max_tokens=10) for p in base]
        sos = [pxrt.StructuredOutput(**c) for _, c in cases]
        gens = [lm.submit(p, max_tokens=40, structured=so) for (p, _), so in zip(cases, sos)]
        hot = [lm.submit(p, max_tokens=40, structured=so, temperature=1.0, seed=5)
               for (p, _), so in zip(cases, sos)]  # fmt: skip
        for (prompt, c), so, gen, sampled in zip(cases, sos, gens, hot):
            want, _ = demo.lm_reference_steps(
                prompt, 40, params, MAX_LENGTH, (demo.LM_EOS,), _grammar_pick(lm, so)
            )
            got = gen.result(timeout=60)
            assert got.tokens == _until_complete(lm, so, want), c
            for result in (got, sampled.result(timeout=60)):
                if "json_object" in c and result.finish_reason == "length":
                    continue  # (any object: random weights may write keys for ever)
                assert result.finish_reason == "stop", (c, result)
                text = lm.tokenizer.decode(result.tokens)
                if "json" in c or "json_object" in c:
                    assert isinstance(json.loads(text), dict)
                elif "regex" in c:
                    assert re.fullmatch(c["regex"], text), text
                elif "choice" in c:
                    assert text in c["choice"]
        for prompt, gen in zip(base, plain):
            assert gen.result().tokens == reference(prompt, 10)
    # Alone, a shorter prompt's slot is within the first positions for its first masked
    # steps: their forwards run over them (beside the others that depends on timing).
    prompt, c = cases[1]
    so = pxrt.StructuredOutput(**c)
    want, _ = demo.lm_reference_steps(
        prompt, 40, params, MAX_LENGTH, (demo.LM_EOS,), _grammar_pick(lm, so)
    )
    got = lm.generate(prompt, max_tokens=40, structured=so)
    assert got.tokens == _until_complete(lm, so, want), c
    assert lm.counters["masked_steps"] > 0
    assert lm._full_step.forward is not None  # (the masked steps ran as forward and pick)
    assert windowed and set(windowed) <= set(lm.step_lengths), windowed
    assert lm.compiles_after_load == 0


# --------------------------------------------------------------------------- the device side


def _pointer(array):
    return array.addressable_shards[0].data.unsafe_buffer_pointer()


def test_the_cache_is_donated_through_every_step_and_insert(lm):
    """The cache is updated in place: the same device buffer before and after a whole
    generation (inserts and steps), the old handles deleted, and XLA aliases the cache
    argument to the output in the step and every prefill program."""
    before = lm.state["cache"]["k"]
    pointer = _pointer(before)
    lm.generate(prompts(1, seed=8)[0], max_tokens=10)
    after = lm.state["cache"]["k"]
    assert before.is_deleted()
    assert _pointer(after) == pointer
    cache_bytes = lm.cache_bytes
    for program in lm.describe()["programs"]:
        mem = program["memory"]
        if program["program"] == "prefill_rows":  # (beside the steps: it takes no state)
            continue
        if mem:  # XLA:CPU reports aliasing through its memory analysis
            assert mem["alias_bytes"] >= cache_bytes // len(lm.devices), program


def test_no_compiles_while_generating(lm):
    before = pxrt.compile_count()
    gens = [
        lm.submit(p, max_tokens=6, temperature=0.5, top_k=3, seed=i)
        for i, p in enumerate(prompts(9, seed=9))
    ]
    for g in gens:
        g.result()
    assert pxrt.compile_count() == before
    assert lm.compiles_after_load == 0


def test_describe_lists_every_program_and_the_cache(lm):
    info = lm.describe()
    for kind, lengths in (("prefill_insert", LENGTHS), ("extend_insert", CHUNKS)):
        cells = {(p["batch"], p["length"]) for p in info["programs"] if p["program"] == kind}
        assert cells == {(b, n) for b in BATCHES for n in lengths}, kind
    assert info["prefix_cache"]["blocks"] * 16 == SLOTS * MAX_LENGTH // 2
    assert info["slots"] == lm.slots and lm.slots % len(jax.devices()) == 0
    per_slot = 2 * SIZES["layers"] * MAX_LENGTH * SIZES["dim"] * 4
    assert info["cache_bytes"] == lm.slots * per_slot
    json.dumps(info)


# --------------------------------------------------------------------------- long prompts


def test_prompts_longer_than_any_prefill_are_chunked(lm, reference):
    """Prompts up to the cache's length (63 tokens; prefill goes to 32) mixed with short
    ones, more than the slots: every stream equals plain JAX, prefilled whole."""
    rng = np.random.default_rng(40)
    long = [rng.integers(0, 256, n).astype(np.int32) for n in (33, 40, 63, 50, 62)]
    cases = [(p, 6) for p in long] + [(p, 9) for p in prompts(4, seed=41)]
    cases = [cases[i] for i in rng.permutation(len(cases))]
    before = dict(lm.counters)
    gens = [lm.submit(p, max_tokens=m, prefix_cache=False) for p, m in cases]
    assert [g.result(timeout=60).tokens for g in gens] == [reference(p, m) for p, m in cases]
    assert lm.counters["chunks"] - before["chunks"] >= len(long)
    assert lm.busy_slots == 0 and len(lm._table.free) == lm.slots
    assert lm.compiles_after_load == 0


def test_running_streams_step_between_the_chunks_of_a_long_prompt(long_lm):
    """A 2,000-token prompt is 63 chunks; each turn of the loop runs one chunk and one
    decode step, so a stream already running gets a token per chunk meanwhile."""
    running = long_lm.submit(prompts(1, seed=42)[0], max_tokens=LONG)
    it = iter(running)
    next(it)
    long = np.random.default_rng(43).integers(0, 256, 2000).astype(np.int32)
    chunks = long_lm.counters["chunks"]
    before = len(running.tokens)
    first = next(iter(long_lm.submit(long, max_tokens=1, prefix_cache=False)))
    during = len(running.tokens) - before
    assert long_lm.counters["chunks"] - chunks == 63 and 0 <= first < demo.LM_VOCAB
    assert during >= 60, during
    running.cancel()
    _wait_for(lambda: long_lm.busy_slots == 0)


def test_cancelling_a_prompt_being_chunked_frees_its_slot(long_lm, lm, reference):
    long = np.random.default_rng(44).integers(0, 256, 1500).astype(np.int32)
    gen = long_lm.submit(long, max_tokens=5, prefix_cache=False)
    _wait_for(lambda: long_lm._chunking)
    gen.cancel()
    _wait_for(lambda: len(long_lm._table.free) == long_lm.slots and not long_lm._chunking)
    assert gen.finish_reason == "cancelled" and not gen.tokens
    other = np.random.default_rng(45).integers(0, 256, 40).astype(np.int32)
    assert lm.generate(other, max_tokens=8).tokens == reference(other, 8)


@pytest.mark.once  # (an export path: neither the twins nor the device count matter)
def test_a_concrete_shape_decoder_chunks_and_caches_prompts_too(tmp_path):
    """``shapes="concrete"`` traces extend per (rows, chunk) as well: prompts longer than
    its one prefill length go in chunks of 8, a repeated one from the prefix cache."""
    sizes = {"dim": 16, "heads": 2, "layers": 1}
    params = demo.make_lm_params(**sizes)
    n_dev = len(jax.devices())
    path = decoder.export_decoder(
        demo.lm_prefill, demo.lm_decode, params, tmp_path / "lm", cache=demo.lm_cache_spec(
            sizes["layers"], sizes["heads"], sizes["dim"]), extend=demo.lm_extend,
        chunk_lengths=(8,), chunk_batches=(1,), max_length=48, slots=n_dev,
        prefill_lengths=(8,), prefill_batches=(1,), shapes="concrete", num_devices=n_dev,
    )  # fmt: skip
    programs = json.loads((tmp_path / "lm" / "manifest.json").read_text())["programs"]
    assert programs[-1] == {"program": "extend", "cell": [1, 8], "file": "extend.1x8.jaxexport"}
    rng = np.random.default_rng(60)
    cases = [rng.integers(0, 256, n).astype(np.int32) for n in (5, 30, 20)]
    with pxrt.load(path, prefix_block=8, prefix_cache_tokens=48, sampling_controls=False) as dec:
        assert dec.wait_programs(120)
        for prompt in cases + cases[1:2]:
            want = demo.lm_reference(prompt, 6, params, 48)
            assert dec.generate(prompt, max_tokens=6).tokens == want
        assert dec.counters["prefix_hit_tokens"] == 24  # (the repeat: 3 blocks of 8)
    with pytest.raises(ValueError, match=r"chunk_lengths \[8\]; \[16\] were not traced"):
        pxrt.load(path, chunk_lengths=(16,))


# --------------------------------------------------------------------------- scheduling


def test_a_decoder_serves_before_its_later_programs_and_takes_them_as_they_come(
    lm_path, reference, monkeypatch
):
    """Ready with the state, the step and the smallest cells; the rest (steps over
    fewer slots or positions, larger cells, the controls', prefix cache's and
    speculation's programs) compile after, on a thread of their own, and the loop
    takes them between turns. Meanwhile a request for logprobs waits for them."""
    from pxrt.decoder import load as decoder_load

    gate = threading.Event()
    real = decoder_load._obtain_all

    def held(*args, **kwargs):
        if kwargs.get("stop") is not None:  # (the later programs: held until the gate)
            gate.wait(120)
        return real(*args, **kwargs)

    monkeypatch.setattr(decoder_load, "_obtain_all", held)
    with pxrt.load(lm_path, step_lengths=(32,)) as dec:
        cases = prompts(3, seed=80)
        assert dec.deferred > 0 and dec.step_slots == (SLOTS,) and dec.prefill_batches == ()
        assert dec.prefix is None and dec.step_lengths == ()
        wants = dec.submit(cases[0], max_tokens=6, logprobs=2)
        assert dec.generate(cases[1], max_tokens=8).tokens == reference(cases[1], 8)
        assert wants.tokens == [] and not wants.done  # (held: no controls' programs yet)
        gate.set()
        assert dec.wait_programs(120) and dec.deferred == 0 and dec.deferred_error is None
        assert wants.result(timeout=60).tokens == reference(cases[0], 6)
        assert len(wants.logprobs) == 6
        assert len(dec.step_slots) >= 2 and dec.prefill_batches == BATCHES
        assert dec.step_lengths == (32,) and dec.prefix is not None
        assert all(f"prefill[{b},{n}]" in dec.costs for b in BATCHES for n in LENGTHS)
        assert 0 <= dec._launch_s <= dec.costs[f"step[{SLOTS}]"]  # (the block's price)
        together = [dec.submit(p, max_tokens=7) for p in cases]
        assert [g.result(timeout=60).tokens for g in together] == [reference(p, 7) for p in cases]
        assert dec.compiles_after_load == 0
        kinds = [p["program"] for p in dec.describe()["programs"]]
        assert kinds.count("prefill_insert") == len(BATCHES) * len(LENGTHS)


def test_cells_timed_while_others_compiled_are_timed_again_once_all_are_in(tmp_path, monkeypatch):
    """The later programs come in two parts: the cells at the artifact's lengths, then
    those at the lengths the load adds between them. The first part is timed while the
    second compiles on the same cores (1.5-2x its quiet time, keras-hub's Llama at 8
    slots on 2 cores): once the last part is in, the first is timed again and priced
    at those times."""
    from pxrt.decoder.runner import Runner

    path = demo.export_lm(
        str(tmp_path / "lm"), slots=4, max_length=128, prefill_lengths=(16, 32, 64),
        prefill_batches=(1,),
    )  # fmt: skip
    timed: list[dict] = []
    real = Runner._time_cells

    def spy(self, cells):
        out = real(self, cells)
        timed.append(dict(out))
        return out

    monkeypatch.setattr(Runner, "_time_cells", spy)
    with pxrt.load(path) as dec:
        assert dec.wait_programs(120)
        first, last, again = timed
        assert set(first) == set(again) == {f"prefill[1,{n}]" for n in (16, 32, 64)}
        assert sorted(last) == ["prefill[1,48]"]
        assert all(dec.costs[key] == again[key] for key in again)


def test_the_scheduler_prices_prefill_cells_with_the_measured_costs(lm):
    """Each turn's prefills go at the cell with the most prompts per measured second
    that fits the turn's budget: a padded cell pays for its padding where rows cost
    (CPU-like), and is taken where they do not (accelerator-like); with no room left, a
    turn's first prefill still goes, at the cheapest cell, and no other."""
    measured = dict(lm.costs)
    assert all(f"prefill[{b},{n}]" in measured for b in BATCHES for n in LENGTHS), measured
    assert lm.describe()["scheduler"]["priced"] and lm.itl_bound_s > 0
    steps = {f"step[{n}]": 1e-3 for n in lm.step_slots}

    def priced(per_row, fixed):  # a cell's seconds: fixed + per_row * rows * length
        costs = {f"prefill[{b},{n}]": fixed + per_row * b * n for b in BATCHES for n in LENGTHS}
        lm._price_programs(costs | steps, itl_bound_ms=None)

    try:
        priced(per_row=1e-5, fixed=1e-4)  # rows cost: 2 waiting go one at a time
        assert lm._price(2, 32, math.inf, first=True) == (1, 1, pytest.approx(4.2e-4))
        assert lm._price(4, 32, math.inf, first=True)[:2] == (4, 4)
        priced(per_row=1e-7, fixed=1e-3)  # rows nearly free: 2 go together, padded
        assert lm._price(2, 32, math.inf, first=True)[:2] == (4, 2)
        # With little of the turn left: the cheapest for its first prefill, else none.
        assert lm._price(4, 32, 1e-6, first=True)[:2] == (1, 1)
        assert lm._price(4, 32, 1e-6, first=False) == (0, 0, 0.0)
        # The default bound: a full step and the longest one-prompt prefill.
        assert lm.itl_bound_s == pytest.approx(1e-3 + 1e-3 + 1e-7 * 32)
    finally:
        lm._price_programs(measured, itl_bound_ms=None)
        lm._step_prices = {}  # (the steps by rule, as the lm fixture has them)


# --------------------------------------------------------------------------- busy slots


def test_steps_run_over_the_first_positions_while_the_busy_slots_are_there(lm, reference):
    """Short prompts generating past 16, then 32 positions: the steps run over a window
    of the cache (16, then 32 positions) while every busy slot is inside it, then over
    all of it; the tokens are plain JAX's all the same, sampled ones included."""
    lm._step_prices = {}  # (by rule: the smallest window that holds the busy slots)
    before = dict(lm.counters)
    cases = [(p[:6], m) for p, m in zip(prompts(6, seed=70), (8, 12, 20, 30, 40, 50))]
    with lm._cond:
        gens = [lm.submit(p, max_tokens=m) for p, m in cases]
    assert [g.result(timeout=60).tokens for g in gens] == [reference(p, m) for p, m in cases]
    c = {k: lm.counters[k] - before[k] for k in ("steps", "window_steps")}
    assert 0 < c["window_steps"] < c["steps"], c
    sampled = dict(temperature=0.9, top_k=20, seed=5)
    alone = lm.generate(cases[4][0], max_tokens=40, **sampled).tokens  # (windows, then not)
    with lm._cond:
        together = [lm.submit(p, max_tokens=40, **sampled) for p, _ in cases[3:6]]
    assert together[1].result(timeout=60).tokens == alone


def test_the_loop_runs_the_cheapest_step_that_holds_the_busy_slots(lm):
    """Priced, the loop runs the cheapest measured step of those that hold the busy
    slots (over fewer slots or positions, or the whole one: a part can cost more than
    the whole); its tokens are the busy slots' whatever it is."""
    rows = lm._rows_per_device
    parts = sorted(lm._steps)
    try:
        lm._step_prices = {(r, w): 1.0 for r in lm._steps for w in (0, *lm.step_lengths)}
        lm._step_prices[(rows, 0)] = 0.5  # the whole step cheapest: taken for any busy slots
        assert lm._cheapest_step(parts[0]) == (rows, 0)
        lm._step_prices[(parts[0], lm.step_lengths[0])] = 0.1  # a window cheaper still
        # (no busy slot: every window holds them)
        assert lm._cheapest_step(parts[0]) == (parts[0], lm.step_lengths[0])
        assert lm._cheapest_step(rows) == (rows, 0)  # (the cheap window is over fewer rows)
        del lm._step_prices[(parts[0], 0)]  # one not measured: by rule, the least of each
        assert lm._cheapest_step(parts[0]) == (parts[0], lm.step_lengths[0])
    finally:
        lm._step_prices = {}
    prompt = prompts(1, seed=90)[0]
    assert lm.generate(prompt, max_tokens=5).tokens == lm.generate(prompt, max_tokens=5).tokens


def test_steps_run_over_the_busy_slots_only(lm, reference):
    """With few slots busy a step runs over fewer (compiled for a quarter, a half and
    all); generations that outlive those in the low slots are moved down. The tokens
    are plain JAX's all the same."""
    assert lm.step_slots[-1] == SLOTS and len(lm.step_slots) >= 2, lm.step_slots
    lm._step_prices = {}  # (by rule: the fewest rows that hold the busy slots)
    before = dict(lm.counters)
    # The first four end early; the last four then sit above them and move down.
    # (All queued before the loop looks, so they take the slots in order however
    # loaded the machine: the loop waits for the decoder's lock when idle.)
    cases = list(zip(prompts(8, seed=50), (2, 3, 4, 5, 20, 22, 24, 26)))
    with lm._cond:
        gens = [lm.submit(p, max_tokens=m) for p, m in cases]
    assert [g.result(timeout=60).tokens for g in gens] == [reference(p, m) for p, m in cases]
    c = {k: lm.counters[k] - before[k] for k in ("steps", "stepped_slots", "moves")}
    assert c["stepped_slots"] < c["steps"] * SLOTS and c["moves"] >= 1, c
    again = [lm.submit(p, max_tokens=m) for p, m in cases[::-1]]
    assert [g.result(timeout=60).tokens for g in again] == [reference(p, m) for p, m in cases[::-1]]
    assert lm.busy_slots == 0 and sorted(lm._table.free) == list(range(SLOTS))
    assert lm.compiles_after_load == 0


# --------------------------------------------------------------------------- speculative decoding


def test_speculative_decoding_gives_the_greedy_tokens(lm_path, lm, reference):
    """Prompt-lookup drafts verified by extend: greedy tokens equal plain JAX for
    repetitive prompts (drafts accepted) and random ones batched together; a sampled
    request among them turns speculation off while it runs, and its tokens are those of
    the same seed without speculation."""
    rng = np.random.default_rng(70)
    loops = [np.tile(rng.integers(0, 256, n).astype(np.int32), 4) for n in (3, 5, 7)]
    cases = loops + prompts(3, seed=71)
    only = {"prefill_batches": (4,), "chunk_lengths": (8,), "chunk_batches": (1,)}
    with pxrt.load(
        lm_path, speculative_tokens=4, prefix_cache_tokens=0, step_slots=(),
        sampling_controls=False, **only,
    ) as dec:  # fmt: skip
        assert dec.wait_programs(120)
        gens = [dec.submit(p, max_tokens=24) for p in cases]
        for prompt, gen in zip(cases, gens):
            assert gen.result(timeout=60).tokens == reference(prompt, 24)
        accepted = dec.counters["accepted_tokens"]
        assert dec.counters["verifies"] > 0 and accepted > 0
        sampled = dec.submit(cases[3], max_tokens=12, temperature=2.0, seed=5)
        greedy = dec.submit(loops[0], max_tokens=24)
        assert greedy.result(timeout=60).tokens == reference(loops[0], 24)
        alone = lm.generate(cases[3], max_tokens=12, temperature=2.0, seed=5)
        assert sampled.result(timeout=60).tokens == alone.tokens
        assert dec.compiles_after_load == 0
        with pytest.raises(ValueError, match="loaded with sampling_controls=False"):
            dec.submit(loops[0], logprobs=1)
        assert not any(p.get("sampling_controls") for p in dec.describe()["programs"])
    with pytest.raises(ValueError, match="speculative_tokens must be an int from 0 to 62"):
        pxrt.load(lm_path, speculative_tokens=63)


# --------------------------------------------------------------------------- prefix cache


def test_a_shared_prefix_is_computed_once_and_the_tokens_do_not_change(lm, reference):
    """A system prompt of 40 tokens before each question: the first request prefills it,
    the others copy its two cached blocks (16 tokens each) and prefill the rest. Tokens
    equal plain JAX, with and without the cache, and across evictions (the pool's 16
    blocks, fewer than the prompts' blocks together)."""
    rng = np.random.default_rng(46)
    system = rng.integers(0, 256, 40).astype(np.int32)
    asks = [
        np.concatenate([system, rng.integers(0, 256, n).astype(np.int32)])
        for n in (3, 9, 20, 1, 15)
    ]
    others = [rng.integers(0, 256, n).astype(np.int32) for n in (50, 17, 33, 60, 61, 62, 63)]
    index = lm.prefix.index
    hits = lambda: index.counters["hit_tokens"]  # noqa: E731
    before = hits()
    first = lm.generate(asks[0], max_tokens=7)
    assert first.tokens == reference(asks[0], 7) and hits() == before
    gens = [lm.submit(p, max_tokens=7) for p in asks[1:]]
    assert [g.result(timeout=60).tokens for g in gens] == [reference(p, 7) for p in asks[1:]]
    assert hits() - before == 32 * len(asks[1:])
    # Off per request: nothing reused.
    now = hits()
    assert lm.generate(asks[2], max_tokens=7, prefix_cache=False).tokens == reference(asks[2], 7)
    assert hits() == now
    # Other prompts evict blocks; whatever is left or gone, the tokens stay right.
    evicted = index.counters["evicted_blocks"]
    for p in others + asks + others[::-1] + asks:
        assert lm.generate(p, max_tokens=5).tokens == reference(p, 5)
    assert index.counters["evicted_blocks"] > evicted and len(index) == index.blocks
    assert lm.compiles_after_load == 0


@pytest.mark.parametrize("overlap", [True, False], ids=["beside", "fused"])
def test_prompts_prefilled_whole_save_their_blocks_as_they_go_in(lm_path, reference, overlap):
    """Four prompts of 20-32 tokens prefilled whole in one unit (the 4 x 32 cell, its
    rows beside the steps or the prefill and insert in one program) save their first
    block into the prefix pool in their insert, no save program after it: a later
    prompt that shares each one's first 16 tokens copies that block, and every token
    equals plain JAX (a block saved from another row or position would not)."""
    dec = pxrt.load(
        lm_path,
        overlap_prefill=overlap,
        prefill_batches=(4,),  # (one unit of four, whatever the cells' measured prices)
        step_slots=(),
        step_lengths=(),
        sampling_controls=False,
    )
    try:
        assert dec.wait_programs(120)
        rng = np.random.default_rng(55)
        firsts = [rng.integers(0, 256, n).astype(np.int32) for n in (20, 32, 25, 30)]
        saves = dec.prefix.save
        dec.prefix.save = lambda *a: pytest.fail("a save program ran for a whole prefill")
        with dec._cond:  # (one turn admits them all: one unit of four)
            gens = [dec.submit(p, max_tokens=4) for p in firsts]
        assert [g.result(timeout=60).tokens for g in gens] == [reference(p, 4) for p in firsts]
        assert dec.counters["prefills"] == 1 and dec.prefix.index.counters["saved_blocks"] == 4
        dec.prefix.save = saves
        hit = dec.prefix.index.counters["hit_tokens"]
        for p in firsts[::-1]:
            later = np.concatenate([p[:16], rng.integers(0, 256, 9).astype(np.int32)])
            assert dec.generate(later, max_tokens=6).tokens == reference(later, 6)
        assert dec.prefix.index.counters["hit_tokens"] - hit == 4 * 16
    finally:
        dec.close()


def test_prompts_sharing_a_start_wait_for_the_one_being_chunked(lm, reference):
    """Four prompts that share a 48-token start arrive together: the first is chunked
    and the others wait for it to cache the start (not prefill it four times)."""
    rng = np.random.default_rng(47)
    start = rng.integers(0, 256, 48).astype(np.int32)
    asks = [
        np.concatenate([start, rng.integers(0, 256, n).astype(np.int32)]) for n in (9, 2, 14, 5)
    ]
    hits = lm.counters["prefix_hit_tokens"]
    gens = [lm.submit(p, max_tokens=6) for p in asks]
    assert [g.result(timeout=60).tokens for g in gens] == [reference(p, 6) for p in asks]
    assert lm.counters["prefix_hit_tokens"] - hits == 3 * 48


@pytest.mark.once
def test_prefix_index_chains_blocks_and_evicts_least_recently_used():
    from pxrt.prefix import PrefixIndex

    index = PrefixIndex(blocks=3, block=4)
    a = np.arange(13, dtype=np.int32)  # 3 cacheable blocks (the last token never is)
    assert len(index.keys(a)) == 3 and len(index.keys(a[:12])) == 2
    b = a.copy()
    b[0] = 99  # the same later blocks after another start: different keys
    assert not set(index.keys(a)) & set(index.keys(b))
    assert index.match(index.keys(a)) == []
    saved = index.add(index.keys(a), 0)
    assert [i for i, _ in saved] == [0, 1, 2]
    assert index.match(index.keys(a)) == [e for _, e in saved]
    assert index.match(index.keys(a[:9])) == [e for _, e in saved[:2]]
    # A new prompt's blocks evict the least recently used: the continuations first.
    c = np.full(9, 7, np.int32)
    index.add(index.keys(c), 0)
    assert index.match(index.keys(a)) == [saved[0][1]]
    assert index.counters["evicted_blocks"] == 2
    # Saved blocks are used in the same order: a new chain's start outlives its end.
    index.clear()
    index.add(index.keys(a), 0)
    index.add(index.keys(c), 0)  # 2 blocks: a's last two go
    assert len(index.match(index.keys(a))) == 1
    # The pool never evicts the prompt's own blocks to save more of them.
    assert len(index.add(index.keys(np.arange(200, 300, dtype=np.int32)), 0)) == 3


# --------------------------------------------------------------------------- cancellation


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_cancel_frees_the_slot(long_lm, lm, reference):
    gen = long_lm.submit(prompts(1, seed=10)[0], max_tokens=LONG)
    it = iter(gen)
    next(it)
    next(it)
    assert long_lm.busy_slots == 1 and not gen.done
    gen.cancel()
    _wait_for(lambda: long_lm.busy_slots == 0)
    assert gen.finish_reason == "cancelled" and len(gen.tokens) < LONG // 4
    # A freed slot serves the next request correctly (stale cache entries are masked).
    other = prompts(1, seed=11)[0]
    assert lm.generate(other, max_tokens=8).tokens == reference(other, 8)


def _tokens_after(dec, action):
    before = dec.counters["tokens"]
    action()
    _wait_for(lambda: dec.busy_slots == 0)
    return dec.counters["tokens"] - before


def test_leaving_an_async_stream_early_frees_the_slot(long_lm, run):
    async def main():
        stream = long_lm.agenerate(prompts(1, seed=12)[0], max_tokens=LONG)
        got = []
        async for token in stream:
            got.append(token)
            if len(got) == 3:
                break
        await stream.aclose()
        return got

    assert _tokens_after(long_lm, lambda: run(main)) < LONG // 4


def test_cancelling_the_task_frees_the_slot(long_lm, run):
    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in long_lm.agenerate(prompts(1, seed=13)[0], max_tokens=LONG):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    assert _tokens_after(long_lm, lambda: run(main)) < LONG // 4


def test_waiting_prompts_are_admitted_by_priority_then_by_age(long_lm):
    """With every slot busy, a freed slot goes to the highest level waiting, whatever
    came first; once prompts have waited ``wait_s``, to the oldest."""

    def admitted_first(wait_s):
        long_lm.set_priorities(2, default_level=2, wait_s=wait_s)
        running = [long_lm.submit([i + 1], max_tokens=LONG) for i in range(SLOTS)]
        _wait_for(lambda: long_lm.busy_slots == SLOTS)
        low = long_lm.submit([3, 4], max_tokens=LONG)  # (the default level: 2)
        high = long_lm.submit([5, 6], max_tokens=LONG, priority=1)
        running[0].cancel()
        _wait_for(lambda: low.tokens or high.tokens)
        first = "high" if high.tokens else "low"
        assert not (low.tokens and high.tokens)  # (one slot was freed)
        for gen in [*running, low, high]:
            gen.cancel()
        _wait_for(lambda: long_lm.busy_slots == 0 and long_lm.waiting == 0)
        return first

    try:
        assert admitted_first(wait_s=60.0) == "high"
        assert admitted_first(wait_s=1e-9) == "low"  # (both aged: the oldest first)
        with pytest.raises(ValueError, match="priority must be an int from 0 to 2, got 3"):
            long_lm.submit([1], priority=3)
    finally:
        long_lm.set_priorities(1)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "prompt, options, message",
    [
        ([], {}, "prompt: is empty"),
        (list(range(MAX_LENGTH)), {}, "leave no room in a cache of 64 positions"),
        ([1], {"prefix_cache": "no"}, "prefix_cache must be true or false"),
        ([1, 2, demo.LM_VOCAB], {}, f"token id {demo.LM_VOCAB} is outside the vocabulary"),
        ([1, -1], {}, "token id -1 is outside"),
        ([[1, 2]], {}, "1-D sequence"),
        ([1.5], {}, "integer token ids"),
        ([1], {"max_tokens": 0}, "max_tokens must be an int >= 1"),
        ([1], {"temperature": -1.0}, "temperature"),
        ([1], {"temperature": float("nan")}, "temperature"),
        ([1], {"top_p": 0.0}, "top_p"),
        ([1], {"top_k": -2}, "top_k"),
        ([1], {"seed": 2**32}, "seed"),
        ([1], {"stop_ids": [demo.LM_VOCAB]}, "stop_ids"),
        ([1], {"logprobs": 21}, "logprobs must be an int from 0 to 20, got 21"),
        ([1], {"presence_penalty": 2.5}, "presence_penalty must be a number from -2 to 2"),
        ([1], {"frequency_penalty": "1"}, "frequency_penalty must be a number"),
        ([1], {"repetition_penalty": 0.0}, "repetition_penalty must be a number above 0"),
        ([1], {"logit_bias": {1: 101}}, r"logit_bias\[1\] must be a number from -100 to 100"),
        ([1], {"logit_bias": {demo.LM_VOCAB: 1}}, "logit_bias: a token id must be an int"),
        ([1], {"logit_bias": [1]}, "logit_bias must map token ids to numbers"),
        ([1], {"logit_bias": dict.fromkeys(range(301), 1)}, "301 entries; at most 300"),
        ([1], {"min_tokens": 11, "max_tokens": 10}, "min_tokens must be at most max_tokens"),
        ([1], {"priority": 2}, "priority must be an int from 0 to 1, got 2"),
        ([1], {"priority": 2**64}, "priority must be an int from 0 to 1"),
        ([1], {"priority": 1.0}, "priority must be an int"),
        ([1], {"max_token": 3}, "unknown sampling option 'max_token'; known: max_tokens"),
        ([1], {"params": pxrt.SamplingParams(), "seed": 3}, "in params or as keyword arguments"),
        ([1], {"params": {"max_tokens": 3}}, "params must be a pxrt.SamplingParams, got dict"),
        # what params cannot know without the model, checked at submit
        ([1], {"params": pxrt.SamplingParams(stop_ids=(demo.LM_VOCAB,))}, "stop_ids must be"),
        ([1], {"params": pxrt.SamplingParams(priority=5)}, "priority must be an int from 0 to 1"),
    ],
)
def test_bad_requests_fail_alone(lm, reference, prompt, options, message):
    good = prompts(1, seed=14)[0]
    running = lm.submit(good, pxrt.SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match=message):
        lm.submit(prompt, **options)
    assert running.result().tokens == reference(good, 10)


def test_text_needs_a_tokenizer(lm, monkeypatch):
    monkeypatch.setattr(lm, "tokenizer", None)  # (an artifact exported without one)
    with pytest.raises(ValueError, match="prompt: text needs a tokenizer and decoder 'lm' has"):
        lm.submit("Hi", max_tokens=2)


@pytest.mark.once
def test_queue_full_and_closed(lm_path):
    dec = pxrt.load(lm_path, max_waiting=2, prefix_cache_tokens=0)
    try:
        assert dec.prefix is None and dec.describe()["prefix_cache"] is None
        running = dec.submit([1, 2, 3], max_tokens=5)
        running.result()
        dec._admit = lambda: None  # no prompt gets a slot from now on
        queued = [dec.submit([4], max_tokens=5) for _ in range(2)]
        with pytest.raises(generate.QueueFull, match="max_waiting=2") as err:
            dec.submit([5], max_tokens=5)
        assert err.value.retry_after_s > 0
    finally:
        dec.close()
    for g in queued:
        with pytest.raises(generate.DecoderClosed):
            g.result()
    with pytest.raises(generate.DecoderClosed):
        dec.submit([1])


# --------------------------------------------------------------------------- host routing


def test_slot_routing_twins_agree():
    """The Cython routing and its pure-Python twin give the same tokens, stops, frees
    and wake-ups on the same sequence of steps."""
    mods = [_slots_py]
    if pxrt.using_extensions():
        from pxrt import _slots

        mods.append(_slots)
    traces = []
    for mod in mods:
        table = mod.SlotTable(4)
        gens = [mod.Generation(3 + i, frozenset({7})) for i in range(5)]
        trace = []
        for g in gens[:4]:
            table.assign(g)
        rng = np.random.default_rng(0)
        for step in range(8):
            owners = table.dispatch()
            if step == 2:
                table.release(gens[1])  # cancelled mid-flight: its token is still routed
                table.assign(gens[4])
            woken, finished = [], []
            table.route(
                rng.integers(0, 9, 4).astype(np.int32), owners, float(step), woken, finished
            )
            for g in woken:
                g.woken = False
            trace.append(
                (
                    [gens.index(g) for g in woken],
                    [gens.index(g) for g in finished],
                    table.busy,
                    sorted(table.free),
                )
            )
        trace.append([(g.tokens, g.finish_reason, g.slot) for g in gens])
        first = mod.Generation(1, frozenset())
        table2 = mod.SlotTable(2)
        table2.assign(first)
        woken, finished = [], []
        table2.first(np.array([5], np.int32), [first], 1.0, woken, finished)
        trace.append((first.tokens, first.finish_reason, first.t_first, table2.busy))
        # A block of 3 steps: a generation whose last token it computes gives its slot
        # back at dispatch; a stop inside the block ends the other there.
        table3 = mod.SlotTable(2)
        short, stops = mod.Generation(3, frozenset()), mod.Generation(9, frozenset({7}))
        table3.assign(short)
        table3.assign(stops)
        owners = table3.dispatch(3)
        freed = sorted(table3.free)
        woken, finished = [], []
        # (column-major, as a TPU returns a block's tokens: each step's row is strided)
        block = np.asfortranarray(np.array([[1, 2], [3, 7], [4, 8]], np.int32))
        for row in block:
            table3.route(row, owners, 2.0, woken, finished)
        trace.append((freed, short.tokens, stops.tokens, [g.finish_reason for g in finished]))
        with pytest.raises(ValueError, match="steps must be >= 1"):
            table3.dispatch(0)
        traces.append(trace)
    assert all(t == traces[0] for t in traces)
    assert traces[0][-2] == ([5], "length", 1.0, 0)
    assert traces[0][-1] == ([0], [1, 3, 4], [2, 7], ["stop", "length"])


# --------------------------------------------------------------------------- artifacts


@pytest.mark.once
def test_decoder_manifest_and_refusals(lm_path, tmp_path):
    with open(f"{lm_path}/manifest.json") as f:
        m = json.load(f)
    assert m["kind"] == "decoder" and m["format_version"] == 4
    assert m["decoder"]["vocab"] == demo.LM_VOCAB and m["decoder"]["stop_ids"] == [demo.LM_EOS]
    with pytest.raises(pxrt.ArtifactError, match="decoder artifact"):
        pxrt.read_artifact(lm_path)
    # An edited manifest is refused (the programs are bound to it).
    import shutil

    edited = tmp_path / "edited"
    shutil.copytree(lm_path, edited)
    m["decoder"]["vocab"] = 300
    (edited / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(pxrt.ArtifactError, match="edited"):
        pxrt.load(str(edited))


@pytest.mark.once
def test_export_checks_the_functions(tmp_path, params):
    cache = demo.lm_cache_spec(SIZES["layers"], SIZES["heads"], SIZES["dim"])
    common = dict(cache=cache, max_length=32, prefill_lengths=(8,), prefill_batches=(1,))

    def bad_prefill(p, tokens, lengths):
        rows, logits = demo.lm_prefill(p, tokens, lengths)
        return {"k": rows["k"]}, logits

    with pytest.raises(ValueError, match="prefill returns its rows"):
        decoder.export_decoder(bad_prefill, demo.lm_decode, params, tmp_path / "a", **common)

    def no_pair(p, cache, tokens, positions):
        return demo.lm_decode(p, cache, tokens, positions)[1]

    with pytest.raises(ValueError, match="decode must return a pair"):
        decoder.export_decoder(demo.lm_prefill, no_pair, params, tmp_path / "b", **common)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decoder.export_decoder(
            demo.lm_prefill, demo.lm_decode, params, tmp_path / "c", eos_id=10_000, **common
        )
    with pytest.raises(ValueError, match="needs room"):
        decoder.export_decoder(
            demo.lm_prefill, demo.lm_decode, params, tmp_path / "d", **(common | {"max_length": 8})
        )
    with pytest.raises(ValueError, match="may name one dimension"):
        decoder.export_decoder(
            demo.lm_prefill,
            demo.lm_decode,
            params,
            tmp_path / "e",
            **(common | {"cache": {"k": pxrt.TensorSpec(("seq",), "float32")}}),
        )


# --------------------------------------------------------------------------- the server


def test_server_generates_with_limits_deadlines_and_metrics(lm_path, reference, run):
    from prometheus_client import generate_latest

    from serving import Server
    from serving.errors import DeadlineExceeded, Overloaded, ServerClosed, UnknownModel

    good = prompts(3, seed=20)

    async def main():
        dec = pxrt.load(lm_path, max_waiting=len(good))
        async with Server() as server:
            server.add_decoder("lm", dec)

            async def collect(p):
                return [t async for t in server.generate("lm", p, max_tokens=9)]

            got = await asyncio.gather(*(collect(p) for p in good))
            assert got == [reference(p, 9) for p in good]
            with pytest.raises(ValueError, match="prompt: is empty"):
                [t async for t in server.generate("lm", [], max_tokens=3)]
            with pytest.raises(UnknownModel, match="no model named 'nope'"):
                [t async for t in server.generate("nope", [1])]
            # A deadline ends a generation that outlives it, after the tokens before it.
            tokens = []
            with pytest.raises(DeadlineExceeded, match="did not end within"):
                async for t in server.generate("lm", [1, 2], max_tokens=10_000, timeout_s=0.0):
                    tokens.append(t)
            _wait_for(lambda: dec.busy_slots == 0 and dec.waiting == 0)
            # Overload: prompts that find no slot wait, up to max_waiting.
            dec._admit = lambda: None
            waiting = [dec.submit([3], max_tokens=2) for _ in good]
            with pytest.raises(Overloaded) as err:
                [t async for t in server.generate("lm", [4], max_tokens=2)]
            assert err.value.retry_after_s > 0
            snap = server.metrics_snapshot()["lm"]
            assert snap["generations"]["length"] + snap["generations"]["stop"] >= 3
            assert snap["ttft_us"]["count"] >= 3 and snap["step_us"]["count"] > 0
            assert snap["compiles_after_load"] == 0 and snap["waiting"] == len(good)
            text = generate_latest(server.metrics.registry).decode()
            for family in (
                "pxrt_time_to_first_token_us_bucket",
                "pxrt_decode_step_duration_us_bucket",
                "pxrt_generated_tokens_total",
                'pxrt_slots_busy{model="lm",version="1"}',
                f'pxrt_prompts_waiting{{model="lm",version="1"}} {len(good)}.0',
            ):
                assert family in text, family
        # Closing the server ends what was still waiting.
        for g in waiting:
            with pytest.raises(generate.DecoderClosed):
                g.result()
        with pytest.raises(ServerClosed):
            [t async for t in server.generate("lm", [1])]

    run(main)


def _patch_steps(dec, wrap):
    """Every decode step program of ``dec`` (one per step size) wrapped by ``wrap``."""
    dec._steps = {rows: wrap(program) for rows, program in dec._steps.items()}
    dec._windows = {key: wrap(program) for key, program in dec._windows.items()}


def test_a_failed_step_fails_its_generations_and_the_next_ones_succeed(lm_path, reference):
    dec = pxrt.load(lm_path)
    try:
        broken = threading.Event()

        def failing(real):
            def step(params, state, *block):  # (a block's: how many steps)
                if not broken.is_set():
                    broken.set()
                    raise RuntimeError("injected device failure")
                return real(params, state, *block)

            return step

        _patch_steps(dec, failing)
        victim = dec.submit(prompts(1, seed=30)[0], max_tokens=10)
        with pytest.raises(RuntimeError, match="generation failed: .*injected device failure"):
            victim.result(timeout=30)
        assert victim.finish_reason == "error" and dec.busy_slots == 0
        after = prompts(2, seed=31)
        got = [dec.submit(p, max_tokens=7) for p in after]
        assert [g.result(timeout=30).tokens for g in got] == [reference(p, 7) for p in after]
        assert dec.outcomes["error"] == 1
    finally:
        dec.close()


@pytest.mark.once
def test_a_decoder_dropped_without_close_is_collected(lm_path):
    import gc
    import weakref

    dec = pxrt.load(lm_path)
    dec.generate([1, 2, 3], max_tokens=3)
    thread, ref = dec._thread, weakref.ref(dec)
    del dec
    gc.collect()
    _wait_for(lambda: ref() is None and not thread.is_alive())


def test_sync_and_async_readers_mix(lm, reference, run):
    """A generation submitted in a coroutine and waited for on a thread, and blocking
    calls made while an event loop runs (as in a notebook), finish."""
    p = prompts(1, seed=40)[0]

    async def main():
        gen = lm.submit(p, max_tokens=6)
        done = await asyncio.to_thread(gen.result, 30)
        blocking = lm.generate(p, max_tokens=6)  # on the loop's thread, loop running
        gen2 = await asyncio.to_thread(lm.submit, p, max_tokens=6)
        streamed = [t async for t in gen2]
        return done.tokens, blocking.tokens, streamed

    want = reference(p, 6)
    assert run(main) == (want, want, want)


def test_close_ends_generations_whose_last_token_is_in_flight(lm_path):
    dec = pxrt.load(lm_path)
    gens = [dec.submit(p, max_tokens=1 + i % 3) for i, p in enumerate(prompts(12, seed=41))]
    dec.close()
    for g in gens:
        try:
            g.result(timeout=30)
        except generate.DecoderClosed:
            pass
        assert g.done


def test_a_failed_read_fails_generations_only_in_flight(lm_path, reference):
    """A device error that surfaces when a step's tokens are read fails the generations
    of that step, including one whose slot was given back at dispatch (its last token)."""
    dec = pxrt.load(lm_path)
    try:
        broken = threading.Event()

        class Unreadable:
            def copy_to_host_async(self):
                pass

            def __array__(self, *args, **kwargs):
                raise RuntimeError("injected read failure")

        def unreadable(real):
            def step(params, state, *block):  # (a block's: how many steps)
                state, tokens, scores = real(params, state, *block)
                if not broken.is_set():
                    broken.set()
                    return state, Unreadable(), scores
                return state, tokens, scores

            return step

        _patch_steps(dec, unreadable)
        victim = dec.submit(prompts(1, seed=42)[0], max_tokens=2)  # given back at dispatch
        with pytest.raises(RuntimeError, match="injected read failure"):
            victim.result(timeout=30)
        p = prompts(1, seed=43)[0]
        assert dec.generate(p, max_tokens=5).tokens == reference(p, 5)
        assert sum(dec.outcomes.values()) == 2 and dec.outcomes["error"] == 1
    finally:
        dec.close()


def test_a_dropped_decoder_finishes_what_it_started(lm_path, reference):
    p = prompts(1, seed=44)[0]
    gen = pxrt.load(lm_path).submit(p, max_tokens=8)
    assert gen.result(timeout=30).tokens == reference(p, 8)


def test_tokens_are_counted_when_readers_lag(lm, run):
    before = lm.counters["tokens"]

    async def main():
        gens = [lm.submit(p, max_tokens=12) for p in prompts(6, seed=45)]
        await asyncio.sleep(0.3)  # nobody reads meanwhile: wake-ups pile up
        return sum([len([t async for t in g]) for g in gens])

    read = run(main)
    assert lm.counters["tokens"] - before == read > 0


def test_a_server_loads_replaces_and_unloads_a_decoder(lm_path, reference, run):
    from serving import Server
    from serving.errors import UnknownModel

    p = prompts(1, seed=50)[0]

    async def main():
        async with Server() as server:
            first = await server.load_model("lm", lm_path)
            assert isinstance(first, pxrt.Decoder) and server.is_decoder("lm")
            running = server.start_generation("lm", p, max_tokens=20)
            second = await server.load_model("lm", lm_path, version="2")
            # the first finished what it had started, then closed
            assert (await running.wait()).tokens == reference(p, 20)
            assert server.decoder("lm") is second and first._closed
            assert [t async for t in server.generate("lm", p, max_tokens=5)] == reference(p, 5)
            await server.unload_model("lm")
            assert second._closed and not server.is_decoder("lm")
            with pytest.raises(UnknownModel):
                server.start_generation("lm", p)

    run(main)


@pytest.mark.once
def test_a_warm_load_runs_the_stored_programs(lm_path, reference, tmp_path):
    """The step and the prefill cells are stored when compiled; a second load runs the
    stored executables and compiles nothing; a corrupted one is compiled afresh."""
    from pxrt import _xla

    cache = tmp_path / "cache"
    load = dict(
        compilation_cache=str(cache), prefix_cache_tokens=0, step_slots=(), sampling_controls=False,
        prefill_batches=(1,), chunk_lengths=(32,), chunk_batches=(1,),  # (fewer programs)
        defer=False,  # (every program before the load returns: none compiling beside)
    )  # fmt: skip
    with pxrt.load(lm_path, **load) as cold:
        assert set(cold.program_sources) <= {"compiled", "cache"}
        programs = sum(cold.program_sources.values())
        want = [cold.generate(p, max_tokens=8).tokens for p in prompts(3, seed=4)]
    files = sorted((cache / "executables").glob("*.bin"))
    assert len(files) == cold.program_sources.get("compiled", 0) > 0
    compiles = _xla.compile_counter.total
    with pxrt.load(lm_path, **load) as warm:
        assert warm.program_sources.get("stored") == len(files)
        assert [warm.generate(p, max_tokens=8).tokens for p in prompts(3, seed=4)] == want
    assert _xla.compile_counter.total == compiles + programs - len(files) == compiles
    data = bytearray(files[0].read_bytes())
    data[-50] ^= 0xFF
    files[0].write_bytes(bytes(data))
    with pxrt.load(lm_path, **load) as healed:
        assert healed.program_sources.get("compiled") == 1
        assert [healed.generate(p, max_tokens=8).tokens for p in prompts(3, seed=4)] == want
    assert want[0] == reference(prompts(3, seed=4)[0], 8)


@pytest.mark.once
def test_a_decoder_load_that_would_not_fit_is_refused_before_allocating(lm_path, monkeypatch):
    """An absurd slot count is refused at once, naming slots and the bytes, with nothing
    compiled or placed (it used to allocate until the kernel killed the process)."""
    from pxrt import _xla, compiling, decoder_load

    placed = []
    monkeypatch.setattr(decoder_load.DecoderPrograms, "place", lambda *a: placed.append(a))
    monkeypatch.setattr(compiling, "available_host_bytes", lambda: 1 << 30)
    compiles = _xla.compile_counter.total
    t0 = time.perf_counter()
    message = (
        r"'lm' with slots=100000 and max_length=64 needs about .* GiB of host memory, .* for "
        r"each of \d+ CPU devices \(the cache state .* GiB, 3\d{4} bytes a slot; the prefix "
        r"cache .*\), and 1.00 GiB is available: load it with fewer slots"
    )
    with pytest.raises(ValueError, match=message):
        pxrt.load(lm_path, slots=100000)
    assert time.perf_counter() - t0 < 30  # (nothing compiled: it was 40 s to a kill)
    assert _xla.compile_counter.total == compiles and not placed
    # What fits before compiling and not with the programs' work space: refused once
    # compiled, before the params or the cache are placed.
    free = iter([1 << 40, 64 << 10])
    monkeypatch.setattr(compiling, "available_host_bytes", lambda: next(free))
    with pytest.raises(ValueError, match=r"slots=8 .*; the programs' work space .* is avail"):
        pxrt.load(
            lm_path, prefix_cache_tokens=0, step_slots=(), sampling_controls=False,
            prefill_batches=(1,), chunk_lengths=(32,), chunk_batches=(1,),
        )  # fmt: skip
    assert not placed


# --------------------------------------------------------------------------- length tiers


@pytest.mark.once  # (its routing is the slot table's, which the twins' test holds)
def test_length_tiers_give_the_same_tokens_and_step_each_tier_in_place(lm_path, lm, reference):
    """``length_tiers``: the cache as one array per tier, every tier stepped in one
    program at its own length. Prompts go to the shortest tier with a free slot that
    holds prompt plus ``max_tokens`` (a prompt whose prefill cell is longer than its
    tier has its rows cut to it; one longer than any prefill is chunked into its
    tier's slot); greedy streams equal plain JAX, seeded sampled ones and logprobs
    equal the one-cache decoder's, every cache is updated in place, and a request too
    long for the short tiers waits for a long one."""
    dec = pxrt.load(lm_path, length_tiers="4x16+4x32+4x64")
    try:
        assert dec.wait_programs(120)
        assert dec.slots == 12 and dec.max_length == MAX_LENGTH
        assert sorted(set(dec._slot_length)) == [16, 32, 64]
        assert dec.step_slots == (12,) and not dec.step_lengths
        chosen: list[int] = []
        pick = dec._tier_slot
        dec._tier_slot = lambda gen, taken: chosen.append(pick(gen, taken)) or chosen[-1]
        before = [leaf for tier in dec.state["cache"] for leaf in jax.tree.leaves(tier)]
        # (lengths 1..32 and max_tokens 3..36: every tier; a 9-32 token prompt is
        # prefilled at 32 positions and may go to the 16-position tier; 33-56 tokens:
        # chunked, into the 64-position tier)
        cases = [(p, 3 + (i * 11) % 34) for i, p in enumerate(prompts(16, seed=51))]
        rng = np.random.default_rng(53)
        cases += [(rng.integers(0, 256, n).astype(np.int32), 7) for n in (33, 45, 56)]
        chunks = dec.counters["chunks"]
        results: dict = {}

        def client(i, prompt, max_tokens):
            time.sleep(0.002 * (i % 5))
            results[i] = list(dec.stream(prompt, max_tokens=max_tokens))

        threads = [threading.Thread(target=client, args=(i, *c)) for i, c in enumerate(cases)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, (prompt, max_tokens) in enumerate(cases):
            assert results[i] == reference(prompt, max_tokens), i
        lengths = [dec._slot_length[s] for s in chosen if s >= 0]
        assert set(lengths) == {16, 32, 64}
        assert any(8 < len(p) and len(p) + m <= 16 for p, m in cases)  # (a cut prefill)
        assert dec.counters["chunks"] - chunks >= 3
        assert all(b.is_deleted() for b in before)  # (donated: updated in place)
        cache_bytes = dec.cache_bytes
        assert cache_bytes == 4 * (16 + 32 + 64) * lm.cache_bytes // (SLOTS * MAX_LENGTH)
        for program in dec.describe()["programs"]:
            mem = program["memory"]
            if mem and program["program"] != "prefill_rows":
                assert mem["alias_bytes"] >= cache_bytes // len(dec.devices), program
        sampled = dict(max_tokens=12, temperature=0.9, top_k=20, seed=8, logprobs=2)
        for p in prompts(2, seed=52):
            a, b = dec.generate(p, **sampled), lm.generate(p, **sampled)
            assert a.tokens == b.tokens
            np.testing.assert_allclose(
                [t[0] for t in a.logprobs], [t[0] for t in b.logprobs], rtol=1e-5, atol=1e-5
            )
        # Every slot taken: the next prompts are prefilled ahead of free slots, and
        # each goes into the first slot to free of a tier that holds it (the long one
        # waits for a 64-position slot while shorter ones free: in a 16-position slot
        # its tokens would not be plain JAX's).
        dec._tier_slot = pick
        ahead = dec.counters["prefills_ahead"]
        wants = (4, 6, 8, 10, 16, 18, 20, 22, 32, 36, 40, 44)  # (4 per tier, prompts <= 4)
        running = list(zip(prompts(12, seed=54, high=4), wants))
        extra = [(p, m) for p, m in zip(prompts(2, seed=55, high=8), (40, 4))]
        with dec._cond:  # (one turn admits the first twelve; the two extra go ahead)
            gens = [dec.submit(p, max_tokens=m) for p, m in running + extra]
        for g, (p, m) in zip(gens, running + extra):
            assert g.result(timeout=60).tokens == reference(p, m)
        assert dec.counters["prefills_ahead"] > ahead
        deadline = time.monotonic() + 30
        while dec.busy_slots and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(dec._table.free) == list(range(dec.slots))
        assert dec.compiles_after_load == 0 and dec.busy_slots == 0
    finally:
        dec.close()


def test_prompts_are_chunked_into_a_short_tier(lm_path, reference):
    """With prefills of 8 tokens only, prompts of 9-40 tokens go in chunks (extend) into
    the shortest tier that holds them and their ``max_tokens``: each chunk reads its
    slot's rows out of that tier and writes them back cut to the tier's length, the
    rest of the cache untouched. The prefix cache saves blocks from any tier and copies
    them into any other (cut to its length). The tokens equal plain JAX."""
    dec = pxrt.load(
        lm_path, length_tiers="4x16+4x32+4x64", prefill_lengths=(8,), sampling_controls=False
    )
    try:
        assert dec.wait_programs(120)
        # (the pool holds half the tiers' positions by default, in blocks of 16)
        assert dec.prefix.index.blocks == 4 * (16 + 32 + 64) // 2 // 16
        chosen: list[int] = []
        pick = dec._tier_slot
        dec._tier_slot = lambda gen, taken: chosen.append(pick(gen, taken)) or chosen[-1]
        rng = np.random.default_rng(54)
        sizes = [(9, 5), (12, 4), (14, 2), (20, 9), (27, 5), (40, 9), (5, 9)]
        cases = [(rng.integers(0, 256, n).astype(np.int32), m) for n, m in sizes]
        gens = [dec.submit(p, max_tokens=m) for p, m in cases]
        assert [g.result(timeout=60).tokens for g in gens] == [reference(p, m) for p, m in cases]
        assert {dec._slot_length[s] for s in chosen if s >= 0} == {16, 32, 64}
        assert dec.counters["chunks"] >= 6
        # A 20-token start cached from a 32-position slot (the first block), then copied
        # into slots of every tier that holds what follows.
        index = dec.prefix.index
        start = cases[3][0]
        hit = index.counters["hit_tokens"]
        chosen.clear()
        for extra, m in [(1, 9), (24, 9), (2, 40)]:  # (the 32-, 64- and 64-position tiers)
            p = np.concatenate([start, rng.integers(0, 256, extra).astype(np.int32)])
            assert dec.generate(p, max_tokens=m).tokens == reference(p, m)
        assert index.counters["hit_tokens"] - hit == 16 * 3
        assert {dec._slot_length[s] for s in chosen if s >= 0} == {32, 64}
        assert dec.busy_slots == 0 and len(dec._table.free) == dec.slots
    finally:
        dec.close()


def _switch_mid_stream(dec, tiers, cases, busy, reference):
    """``dec`` changed into ``tiers`` while ``cases`` stream: the compiled tiers held
    until the loop's step sees ``busy`` slots busy (or, on a loaded machine where the
    short streams end before the last prompt is in, every prompt in its slot), then
    handed over; every stream's tokens checked against plain JAX. Returns the busy
    slots at the switch."""
    arrived: list = []
    dec._tiers_arrived = lambda *got: arrived.append(got)  # (held: delivered below)
    dec._ask_tiers(tiers)
    assert dec.relayout_status == "compiling"
    with pytest.raises(ValueError, match="compiling already"):
        dec.set_length_tiers(tiers)
    deadline = time.monotonic() + 120
    while not arrived and time.monotonic() < deadline:
        time.sleep(0.05)
    assert arrived and arrived[0][2] is None, arrived
    del dec._tiers_arrived
    at_switch: list[int] = []

    def deliver():  # (from the loop's own step, once every stream is in its slot)
        sample()
        admitted = submitted and not dec._waiting and not dec._prefilling and dec.busy_slots
        if arrived and (dec.busy_slots == busy or admitted):
            dec._tiers_arrived(*arrived.pop())

    sample, use = dec._sample_needs, dec._use_tiers
    dec._sample_needs = deliver
    dec._use_tiers = lambda *a: at_switch.append(dec.busy_slots) or use(*a)
    submitted: list = []
    try:
        gens = [dec.submit(p, max_tokens=m) for p, m in cases]
        submitted.append(True)
        assert [g.result(timeout=60).tokens for g in gens] == [reference(p, m) for p, m in cases]
    finally:
        del dec._sample_needs, dec._use_tiers
    assert dec.relayout_status == "switched"
    return at_switch[0]


def test_a_running_decoder_changes_into_length_tiers(lm_path, lm, reference):
    """``set_length_tiers`` while streams run: the tiered programs compile on a thread;
    the loop then holds admission until every busy slot fits a tier row (five need
    more than 16 positions against four 64-position rows: one ends first), moves each
    busy slot's rows and per-slot state into its new slot (across devices, on 4) and
    renumbers the slots. Every stream across the switch, and every one after it
    (chunked, a cached start saved before the switch), equals plain JAX; a seeded
    sampled stream with logprobs equals the one-cache decoder's. Then tiers change
    into other tiers the same way."""
    dec = pxrt.load(lm_path, slots=8)
    try:
        assert dec.wait_programs(120) and not dec.tiers
        rng = np.random.default_rng(56)
        start = rng.integers(0, 256, 20).astype(np.int32)  # (its first block is cached)
        assert dec.generate(start, max_tokens=4).tokens == reference(start, 4)
        sizes = [(20, 30), (30, 30), (3, 40), (10, 30), (25, 25), (5, 8), (9, 6)]
        cases = [(rng.integers(0, 256, n).astype(np.int32), m) for n, m in sizes]
        assert _switch_mid_stream(dec, "4x16+4x64", cases, 7, reference) >= 1  # (mid-stream)
        assert dec.counters["relayouts"] == 1
        assert dec.tiers == ((4, 16), (4, 64)) and len(dec.state["cache"]) == 2
        assert sorted(dec._slot_length) == [16] * 4 + [64] * 4
        # After: a chunked prompt, a cached start from before the switch, sampling.
        hit = dec.prefix.index.counters["hit_tokens"]
        after = [(rng.integers(0, 256, 40).astype(np.int32), 9)]
        after += [(np.concatenate([start, rng.integers(0, 256, 3).astype(np.int32)]), 9)]
        after += [(p, 5) for p in prompts(6, seed=57, high=10)]
        gens = [dec.submit(p, max_tokens=m) for p, m in after]
        assert [g.result(timeout=60).tokens for g in gens] == [reference(p, m) for p, m in after]
        assert dec.prefix.index.counters["hit_tokens"] - hit == 16
        sampled = dict(max_tokens=24, temperature=0.9, top_k=20, seed=8, logprobs=2)
        p = prompts(1, seed=58)[0]
        a, b = dec.generate(p, **sampled), lm.generate(p, **sampled)
        assert a.tokens == b.tokens
        np.testing.assert_allclose(
            [t[0] for t in a.logprobs], [t[0] for t in b.logprobs], rtol=1e-5, atol=1e-5
        )
        assert dec.describe()["scheduler"]["relayout"] == "switched"
        with pytest.raises(ValueError, match="has '4x16\\+4x64' already"):
            dec.set_length_tiers("4x16+4x64")
        # Tiers into tiers: the 16-position rows' streams grow into 64-position ones.
        cases = [(rng.integers(0, 256, n).astype(np.int32), m) for n, m in sizes[2:]]
        assert _switch_mid_stream(dec, "8x64", cases, 5, reference) >= 1
        assert dec.tiers == ((8, 64),) and dec.counters["relayouts"] == 2
        gens = [dec.submit(p, max_tokens=m) for p, m in after]
        assert [g.result(timeout=60).tokens for g in gens] == [reference(p, m) for p, m in after]
        assert dec.compiles_after_load == 0 and dec.busy_slots == 0
    finally:
        dec.close()


@pytest.mark.once
def test_auto_length_tiers_follow_the_traffic(lm_path, reference, monkeypatch):
    """``length_tiers="auto"``: one cache first; once the same tiers are suggested
    for ``STABLE_SAMPLES`` samples of the slots' needs, they are compiled and switched
    to; when long prompts then wait while short slots are free, the suggestion moves
    and the tiers change again. The tokens stay plain JAX's throughout."""
    monkeypatch.setattr(decoder.scheduler, "NEED_SAMPLES", 8)
    monkeypatch.setattr(decoder.scheduler, "NEED_GENERATIONS", 2)
    monkeypatch.setattr(decoder.relayout, "STABLE_SAMPLES", 4)
    with pytest.raises(ValueError, match="speculative_tokens"):
        pxrt.load(lm_path, length_tiers="auto", speculative_tokens=2)
    dec = pxrt.load(lm_path, length_tiers="auto", slots=8)
    n_dev = len(dec.devices)

    def serve_until(cases, done):
        deadline = time.monotonic() + 180
        while not done() and time.monotonic() < deadline:
            gens = [dec.submit(p, max_tokens=m) for p, m in cases]
            for g, (p, m) in zip(gens, cases):
                assert g.result(timeout=60).tokens == reference(p, m)
        assert done(), (dec.relayout_status, dec.tiers)

    try:
        assert dec.wait_programs(120) and dec.auto_tiers and not dec.tiers
        short = [(p, 8) for p in prompts(64, seed=59, high=6)]  # (every need under 16)
        serve_until(short, lambda: dec.relayout_status == "switched")
        # (one 64-position slot per device at least; the rest a quarter of max_length)
        assert dec.tiers == ((8 - n_dev, 16), (n_dev, 64))
        rng = np.random.default_rng(60)
        long = [(rng.integers(0, 256, 30).astype(np.int32), 20) for _ in range(16)]
        serve_until(long, lambda: dec.counters["relayouts"] == 2)
        assert dec.tiers == ((8, 64),)
        assert dec.compiles_after_load == 0
    finally:
        dec.close()


def test_length_tiers_are_learned_by_default_from_16_slots_on_cpu(lm_path):
    """Unset, ``length_tiers`` is ``"auto"`` on CPU devices at ``AUTO_TIERS`` slots or
    more (not with speculation); ``"off"`` keeps one cache; ``"auto"`` says so at any
    size. Checked on the load's plan: nothing compiles."""
    from pxrt.decoder import export, load

    art = export.read(lm_path)
    devices = jax.local_devices()
    options = dict(
        slots=None, max_length=None, prefill_lengths=None, prefill_batches=None,
        chunk_lengths=None, chunk_batches=None, prefix_cache_tokens=None, prefix_block=16,
        step_slots=None, step_lengths=None, speculative_tokens=0, max_waiting=1024,
        sampling_controls=True, chunk_tokens=None, itl_bound_ms=None, devices=devices,
    )  # fmt: skip

    def plan(**over):
        return load._plan(art, len(devices), False, **(options | over))

    assert load.AUTO_TIERS == 16
    assert plan(slots=16).auto_tiers and not plan(slots=16).tiers
    assert not plan(slots=8).auto_tiers and plan(slots=8, length_tiers="auto").auto_tiers
    assert not plan(slots=16, length_tiers="off").auto_tiers
    assert not plan(slots=16, length_tiers="").auto_tiers
    assert not plan(slots=16, speculative_tokens=2).auto_tiers
    assert plan(slots=16, length_tiers="8x16+8x64").tiers == ((8, 16), (8, 64))


def test_length_tiers_are_checked(lm_path):
    with pytest.raises(ValueError, match="slots x positions per tier"):
        pxrt.load(lm_path, length_tiers="4 by 16")
    with pytest.raises(ValueError, match="slots: 8, but length_tiers"):
        pxrt.load(lm_path, slots=8, length_tiers="4x16+8x64")
    with pytest.raises(ValueError, match="max_length: 32, but the longest of length_tiers"):
        pxrt.load(lm_path, max_length=32, length_tiers="4x16+4x64")
    with pytest.raises(ValueError, match="positive multiple of the"):
        pxrt.load(lm_path, length_tiers="0x16+4x64")
    with pytest.raises(ValueError, match="one tier per length"):
        pxrt.load(lm_path, length_tiers=[(4, 16), (4, 16)])
    with pytest.raises(ValueError, match="speculative_tokens"):
        pxrt.load(lm_path, length_tiers="4x16+4x64", speculative_tokens=2)
