"""The decoder's scheduler on its own: pure host code, tested without jax or a device.
Prices go in as the load would measure them (seconds per program); what comes out is
each choice the loop makes from them: the turn's bound, the prefill cell for the prompts
waiting, the prefill budget of a turn, the step for the busy slots and how many steps
one program runs."""

from __future__ import annotations

import collections
import math
import subprocess
import sys
import threading
import types

import pytest

from pxrt.decoder.relayout import SETTLE_SAMPLES, STABLE_SAMPLES, Relayout
from pxrt.decoder.scheduler import BLOCK_S, Scheduler


class Decoder(Relayout, Scheduler):
    """The attributes the scheduler reads of a decoder, set by hand: 8 slots on one
    device, prefill cells of 1 and 4 prompts at lengths 16 and 64, steps over 4 and 8
    slots and windows of 64 and 128 positions of a 256-position cache."""

    def __init__(self, **over) -> None:
        self.devices = [None]
        self.slots = 8
        self.prefill_lengths = (16, 64)
        self.prefill_batches = (1, 4)
        self._cells = {(b, n): None for b in self.prefill_batches for n in self.prefill_lengths}
        self.step_slots = (4, 8)
        self._steps = {4: None, 8: None}
        self.step_lengths = (64, 128)
        self.max_length = 256
        self.multi_step = 4
        self.speculative_tokens = 0
        self.overlap_prefill = False
        self._placement = None
        self.counters = collections.Counter()
        self.deferred = 0  # (programs still compiling after the load)
        self._chunking, self._prefilling, self._prefilled = [], [], []
        self._in_prefill: set = set()
        self._waiting = collections.deque()
        self._table = types.SimpleNamespace(free=list(range(8)), owners=[None] * 8, busy=0)
        self.__dict__.update(over)
        self._wire_tiers(())
        self._wire_relayout(None, False)  # (no change of layout: see the tests below)


COSTS = {
    "prefill[1,16]": 1.0e-3, "prefill[4,16]": 2.0e-3,
    "prefill[1,64]": 3.0e-3, "prefill[4,64]": 8.0e-3,
    "step[8]": 2.0e-3, "step[4]": 1.2e-3,
    "step[8,64]": 0.8e-3, "step[8,128]": 2.5e-3, "step[4,64]": 0.5e-3, "step[4,128]": 0.9e-3,
    "dispatch": 0.0,
}  # fmt: skip


def priced(**over) -> Decoder:
    dec = Decoder(**over)
    dec._price_programs(COSTS, None)
    return dec


def busy(dec: Decoder, n: int, position: int = 10, left: int = 100) -> None:
    """``n`` busy slots, each at ``position`` with ``left`` tokens to go."""
    gens = [
        types.SimpleNamespace(prompt=[0] * position, tokens=[], max_tokens=left, dispatched=0)
        for _ in range(n)
    ]
    dec._table.owners = gens + [None] * (dec.slots - n)
    dec._table.free = list(range(n, dec.slots))
    dec._table.busy = n


def test_the_scheduler_imports_no_jax():
    code = (
        "import sys, pxrt.decoder.scheduler, pxrt.decoder.placement\n"
        "assert 'jax' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_prices_and_the_turns_bound_come_from_the_measured_times():
    dec = priced()
    assert dec._priced == 1
    # the bound: a whole step and the longest single-prompt prefill
    assert dec.itl_bound_s == pytest.approx(2.0e-3 + 3.0e-3)
    assert dec._step_prices[(8, 0)] == 2.0e-3 and dec._step_prices[(4, 64)] == 0.5e-3
    assert dec._step_cost == {4: 1.2e-3, 8: 2.0e-3}
    # a step over fewer slots measured dearer than the whole one is priced as the whole
    dec._price_programs(COSTS | {"step[4]": 9e-3}, 7.5)
    assert dec._step_cost[4] == 2.0e-3 and dec.itl_bound_s == pytest.approx(7.5e-3)
    # a prefill cell not measured (a multi-host group): unpriced, one unit a turn
    unpriced = Decoder()
    unpriced._price_programs({"step[8]": 1e-3}, None)
    assert unpriced._priced == 0 and unpriced.itl_bound_s == math.inf
    assert unpriced._price(3, 16, 0.0, first=True) == (4, 3, 0.0)


def test_a_unit_goes_in_the_cell_that_admits_the_most_prompts_per_second():
    dec = priced()
    # 3 prompts at 64: the 4-cell takes 3 in 8 ms (375/s), the 1-cell 1 in 3 ms (333/s)
    assert dec._price(3, 64, math.inf, first=True) == (4, 3, 8.0e-3)
    # 1 prompt: the 4-cell's padding is paid for nothing
    assert dec._price(1, 64, math.inf, first=True) == (1, 1, 3.0e-3)
    # within the budget left: only the 1-cell fits
    assert dec._price(3, 64, 5.0e-3, first=True) == (1, 1, 3.0e-3)
    # none fits: the turn's first unit still goes (the cheapest), a later one waits
    assert dec._price(3, 64, 1.0e-3, first=True) == (1, 1, 3.0e-3)
    assert dec._price(3, 64, 1.0e-3, first=False) == (0, 0, 0.0)


def test_a_turns_prefill_budget_leaves_room_for_the_coming_step():
    dec = priced()
    assert dec._prefill_budget() == math.inf  # no stream waits on this turn
    busy(dec, 3)  # the step over 4 slots comes next
    assert dec._prefill_budget() == pytest.approx(dec.itl_bound_s - 1.2e-3)
    busy(dec, 6)
    assert dec._prefill_budget() == pytest.approx(dec.itl_bound_s - 2.0e-3)
    beside = priced(overlap_prefill=True)  # what costs up to a step goes between two
    busy(beside, 6)
    assert beside._prefill_budget() == pytest.approx(2.0e-3)


def test_the_step_is_the_cheapest_measured_that_holds_the_busy_slots():
    dec = priced()
    busy(dec, 3, position=20)  # 3 slots, positions under 64 (with the margin)
    assert dec._window() == 64
    assert dec._cheapest_step(4) == (4, 64)
    busy(dec, 6, position=20)
    assert dec._cheapest_step(8) == (8, 64)
    busy(dec, 6, position=100)  # under 128: but the window of 128 is measured dearer
    assert dec._window() == 128 and dec._cheapest_step(8) == (8, 0)
    busy(dec, 3, position=200)  # past every window: the whole cache
    assert dec._window() == 0 and dec._cheapest_step(4) == (4, 0)
    unmeasured = Decoder()
    unmeasured._price_programs({k: v for k, v in COSTS.items() if "," not in k[5:]}, None)
    busy(unmeasured, 3, position=20)  # windows not timed: the fewest rows, the smallest window
    assert unmeasured._cheapest_step(4) == (4, 64)


def test_a_block_runs_as_many_steps_as_fit_and_nothing_waits_on():
    dec = priced()
    busy(dec, 8, left=100)
    # at 0.8 ms a step, 2 fit in BLOCK_S (2 ms); at 0.5 ms, all 4
    assert dec._block_size(8, 64) == min(4, int(BLOCK_S / 0.8e-3)) == 2
    assert dec._block_size(4, 64) == 4
    # a step dearer than BLOCK_S runs alone
    assert dec._block_size(8, 128) == 1
    # a prompt waiting with no slot free: no further than the first max_tokens reached
    dec._waiting.append(object())
    busy(dec, 8, left=3)
    assert dec._block_size(4, 64) == 3
    busy(dec, 7, left=3)  # ... and with a slot free, one step: it is admitted next turn
    assert dec._block_size(4, 64) == 1
    dec._waiting.clear()
    dec._chunking.append(object())  # a chunk between the steps
    assert dec._block_size(4, 64) == 1


def test_where_a_launch_outweighs_the_step_blocks_fit_in_block_s_less_one_launch():
    # an accelerator's prices: the step 0.6 ms, of which 0.5 ms the launch
    dec = Decoder(multi_step=32)
    dec._price_programs(COSTS | {"step[8]": 0.6e-3, "launch": 0.5e-3}, None)
    busy(dec, 8)
    # (BLOCK_S - 0.5 ms) / 0.1 ms a step; by the whole step's price, 3
    assert dec._block_size(8, 0) == int((BLOCK_S - 0.5e-3) / 0.1e-3 + 1e-9) == 15
    assert dec.scheduler_choices()["step_launch_ms"] == pytest.approx(0.5)
    busy(dec, 7)
    dec._waiting.append(object())  # a prompt the prefill budget held back: one step
    assert dec._block_size(8, 0) == 1


def test_length_tiers_take_the_shortest_free_tier_that_holds_a_prompt():
    dec = Decoder()
    dec._wire_tiers(((4, 64), (2, 128), (2, 256)))
    assert dec._slot_length == (64,) * 4 + (128,) * 2 + (256,) * 2

    def gen(prompt: int, max_tokens: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(prompt=[0] * prompt, max_tokens=max_tokens)

    def length(slot: int) -> int:
        return dec._slot_length[slot]

    assert length(dec._tier_slot(gen(10, 20), {})) == 64
    assert length(dec._tier_slot(gen(10, 54), {})) == 64  # (prompt + max_tokens = 64)
    assert length(dec._tier_slot(gen(60, 20), {})) == 128
    assert length(dec._tier_slot(gen(60, 190), {})) == 256
    assert dec._tier_slot(gen(60, 300), {}) == -1  # (no tier holds it)
    dec._table.free = [4, 5, 6, 7]  # the short tier busy: a longer tier's slot
    assert length(dec._tier_slot(gen(10, 20), {})) == 128
    # slots this turn's admission chose already are not chosen again
    assert dec._tier_slot(gen(10, 20), {"a": 4, "b": 5}) in (6, 7)
    assert dec._tier_slot(gen(10, 20), {"a": 4, "b": 5, "c": 6, "d": 7}) == -1
    # on two devices each device's slots are its rows of each tier in turn
    two = Decoder(devices=[None, None])
    two._wire_tiers(((4, 64), (2, 128), (2, 256)))
    assert two._slot_length == (64, 64, 128, 256) * 2


def test_a_prompt_runs_at_the_next_length_in_use_until_its_own_cells_come():
    """The cells at lengths between the artifact's compile after the others: until
    they are in use, a prompt of such a bucket runs at the next longer length in use;
    with no cell in use, or no length in use that holds it, in chunks (0)."""
    dec = Decoder(prefill_lengths=(16, 32, 48, 64))
    assert dec._cell_length(48) == 64 and dec._cell_length(32) == 64
    assert dec._cell_length(16) == 16 and dec._cell_length(0) == 0
    dec._cells[(1, 48)] = dec._cells[(4, 48)] = None
    assert dec._cell_length(48) == 48 and dec._cell_length(32) == 48
    dec._cells = {(1, 16): None}
    assert dec._cell_length(32) == 0 and dec._cell_length(16) == 16
    dec._cells = {}
    assert dec._cell_length(16) == 0


def test_length_tiers_are_suggested_from_the_busy_slots_lengths(monkeypatch):
    from pxrt.decoder import scheduler
    from pxrt.decoder.scheduler import NEED_SAMPLE_TURNS, NEED_SAMPLES

    dec = Decoder(slots=32, max_length=512)
    # (none before NEED_GENERATIONS prompts per slot were admitted, however many samples)
    turns_needed = NEED_SAMPLES + 1
    dec._table.owners = [types.SimpleNamespace(prompt=[0] * 8, max_tokens=92)] * 32
    for _ in range(turns_needed * NEED_SAMPLE_TURNS):
        dec._sample_needs()
    dec._need_gens = scheduler.NEED_GENERATIONS * 32 - 1
    assert dec.suggested_length_tiers() is None
    dec._need_gens += 1
    assert dec.suggested_length_tiers() == "31x128+1x512"
    monkeypatch.setattr(scheduler, "NEED_GENERATIONS", 0)
    dec._wire_tiers(())

    def turns(needs: list[int | None], samples: int) -> None:
        dec._table.owners = [
            None if n is None else types.SimpleNamespace(prompt=[0] * 8, max_tokens=n - 8)
            for n in needs
        ]
        for _ in range(samples * NEED_SAMPLE_TURNS):
            dec._sample_needs()

    def fresh() -> None:
        dec._wire_tiers(())

    turns([100] * 29 + [150, 200, 300], NEED_SAMPLES - 1)
    assert dec.suggested_length_tiers() is None  # (too few samples yet)
    turns([100] * 29 + [150, 200, 300], 200 - NEED_SAMPLES + 1)
    # A slot in 32 needs more than 256 and three more than 128: as independent
    # requests at those shares, up to 4 and 7 of 32 slots at once in 99 % of the
    # turns (a binomial); so 4 + 1 spare of 512, 7 - 5 of 256, the rest of 128.
    assert dec.suggested_length_tiers() == "25x128+2x256+5x512"
    # A quarter of the slots busy (a loop whose admission bounds it), at the same
    # shares as all of them: the same tiers (counted, 1 + 1 slots of 512).
    fresh()
    turns([100] * 24 + [150] * 4 + [300] * 4, 100)
    full = dec.suggested_length_tiers()
    fresh()
    turns([None] * 24 + [100] * 6 + [150, 300], 100)
    assert dec.suggested_length_tiers() == full == "18x128+4x256+10x512"
    # Bursts count as sampled where the share would not cover them: 6 long slots in
    # over 1 % of the samples (each alone a share of 6/32 in 1 of 100 samples: 1
    # slot's worth), with 4 devices (multiples of 4).
    fresh()
    dec.devices = [None] * 4
    turns([100] * 32, 98)
    turns([400] * 6 + [100] * 26, 2)
    assert dec.suggested_length_tiers() == "24x128+8x512"
    dec.devices = [None]
    fresh()
    turns([100] * 32, 100)  # (none long: one spare long slot)
    assert dec.suggested_length_tiers() == "31x128+1x512"
    turns([500] * 32, 3 * NEED_SAMPLES)  # every slot long: no tiers
    assert dec.suggested_length_tiers() is None
    assert "suggested_length_tiers" not in priced().scheduler_choices()
    # (pxrt inspect: the shares the suggestion is sized by, of the slots counted)
    shown = priced()
    assert "need_shares" not in shown.scheduler_choices()
    shown._need_slots = 40
    shown._need_counts = [collections.Counter({5: 2}), collections.Counter({1: 1})]
    assert shown.scheduler_choices()["need_shares"] == {"64": 0.25, "128": 0.025}


def test_the_binomial_quantile_against_its_definition():
    from math import comb

    from pxrt.decoder.scheduler import binomial_quantile

    def by_definition(n: int, p: float, q: float) -> int:
        cdf = 0.0
        for k in range(n + 1):
            cdf += comb(n, k) * p**k * (1 - p) ** (n - k)
            if cdf >= q:
                return k
        return n

    for n in (1, 8, 16, 32, 64, 256):
        for p in (0.0, 1e-4, 0.03, 0.25, 0.5, 0.9, 1.0):
            assert binomial_quantile(n, p, 0.99) == by_definition(n, p, 0.99), (n, p)
    # many slots: no underflow (0.8 ** 4096 is 0.0 in floats)
    assert 819 < binomial_quantile(4096, 0.2, 0.99) < 880


def test_auto_tiers_are_asked_for_once_the_suggestion_holds(monkeypatch):
    """``length_tiers="auto"``: the suggested tiers are compiled once the same
    suggestion held ``STABLE_SAMPLES`` samples in a row; a change starts the count
    again; once asked, never again."""
    from pxrt.decoder import scheduler
    from pxrt.decoder.scheduler import NEED_SAMPLE_TURNS, NEED_SAMPLES

    monkeypatch.setattr(scheduler, "NEED_GENERATIONS", 0)

    asked: list = []
    dec = Decoder(slots=32, max_length=512, name="lm", _cond=threading.Condition())
    dec._wire_relayout(lambda d, tiers: asked.append(tiers) or tiers, True)

    def samples(needs: list[int], n: int) -> None:
        dec._table.owners = [types.SimpleNamespace(prompt=[0] * 8, max_tokens=m - 8) for m in needs]
        for _ in range(n * NEED_SAMPLE_TURNS):
            dec._sample_needs()

    samples([100] * 31 + [300], NEED_SAMPLES + STABLE_SAMPLES - 1)
    assert not asked and dec.suggested_length_tiers() == "27x128+5x512"
    samples([100] * 24 + [300] * 8, 1)  # (another suggestion: counted again)
    assert not asked and dec.suggested_length_tiers() == "23x128+9x512"
    samples([100] * 24 + [300] * 8, STABLE_SAMPLES)
    assert asked == ["23x128+9x512"] and dec.relayout_status == "compiling"
    samples([100] * 24 + [300] * 8, 2 * STABLE_SAMPLES)
    assert len(asked) == 1
    # Switched (the counts start again): fewer long slots wait for SETTLE_SAMPLES
    # samples of the traffic since; more are asked for as soon as they hold.
    dec._wire_tiers(((26, 128), (6, 512)))
    dec.relayout_status = "switched"
    samples([100] * 32, NEED_SAMPLES + 2 * STABLE_SAMPLES)
    assert dec.suggested_length_tiers(whole=True) == "31x128+1x512" and len(asked) == 1
    samples([100] * 32, SETTLE_SAMPLES)
    assert asked[1:] == ["31x128+1x512"]
    dec._wire_tiers(((31, 128), (1, 512)))
    dec.relayout_status = "switched"
    samples([100] * 28 + [300] * 4, NEED_SAMPLES + STABLE_SAMPLES)
    assert asked[2:] == ["22x128+10x512"]
    # Up to a sixteenth of the slots more or fewer in each tier than the tiers have
    # (two of 32): kept (the suggestion's noise), however long it holds; three, not.
    for tiers in [((28, 128), (4, 512)), ((29, 128), (3, 512)), ((25, 128), (7, 512))]:
        dec._wire_tiers(tiers)
        dec.relayout_status = "switched"
        samples([100] * 31 + [300], NEED_SAMPLES + STABLE_SAMPLES + SETTLE_SAMPLES)
        assert dec.suggested_length_tiers() == "27x128+5x512" and asked[3:] == []
    dec._wire_tiers(((30, 128), (2, 512)))
    dec.relayout_status = "switched"
    samples([100] * 31 + [300], NEED_SAMPLES + STABLE_SAMPLES)
    assert asked[3:] == ["27x128+5x512"]
    # After the second switch the band is twice as wide (four slots): three more long
    # slots, kept however long the suggestion holds; five, asked for.
    dec.counters["relayouts"] = 2
    dec._wire_tiers(((30, 128), (2, 512)))
    dec.relayout_status = "switched"
    samples([100] * 31 + [300], NEED_SAMPLES + STABLE_SAMPLES + SETTLE_SAMPLES)
    assert asked[4:] == []
    dec._wire_tiers(((32, 128),))
    dec.relayout_status = "switched"
    samples([100] * 31 + [300], NEED_SAMPLES + STABLE_SAMPLES)
    assert asked[4:] == ["27x128+5x512"]


def test_auto_tiers_wait_for_the_programs_compiled_after_the_load(monkeypatch):
    """``length_tiers="auto"`` asks for tiers only once the programs compiled after the
    load are in (as ``set_length_tiers`` waits for them): arriving after a switch they
    would be the one cache's."""
    from pxrt.decoder import scheduler
    from pxrt.decoder.scheduler import NEED_SAMPLE_TURNS, NEED_SAMPLES

    monkeypatch.setattr(scheduler, "NEED_GENERATIONS", 0)
    asked: list = []
    dec = Decoder(slots=32, max_length=512, name="lm", _cond=threading.Condition())
    dec._wire_relayout(lambda d, tiers: asked.append(tiers) or tiers, True)
    dec.deferred = 16
    dec._table.owners = [types.SimpleNamespace(prompt=[0] * 8, max_tokens=92)] * 32
    for _ in range((NEED_SAMPLES + 2 * STABLE_SAMPLES) * NEED_SAMPLE_TURNS):
        dec._sample_needs()
    assert not asked
    dec.deferred = 0
    for _ in range(NEED_SAMPLE_TURNS):
        dec._sample_needs()
    assert asked == ["31x128+1x512"]


def test_every_slot_long_is_asked_for_at_once_even_a_devices_step_away(monkeypatch):
    """Tiers of a slot per device apart from the suggestion are kept (its noise),
    but not one tier of ``max_length``: on 4 devices 4x16+4x64 becomes 8x64."""
    from pxrt.decoder import scheduler
    from pxrt.decoder.scheduler import NEED_SAMPLE_TURNS, NEED_SAMPLES

    monkeypatch.setattr(scheduler, "NEED_GENERATIONS", 0)

    asked: list = []
    dec = Decoder(max_length=64, devices=[None] * 4, name="lm", _cond=threading.Condition())
    dec._wire_relayout(lambda d, tiers: asked.append(tiers) or tiers, True)
    dec._wire_tiers(((4, 16), (4, 64)))
    dec.relayout_status = "switched"
    dec._table.owners = [types.SimpleNamespace(prompt=[0] * 8, max_tokens=40) for _ in range(8)]
    for _ in range((NEED_SAMPLES + STABLE_SAMPLES) * NEED_SAMPLE_TURNS):
        dec._sample_needs()
    assert asked == ["8x64"]


def test_a_relayout_waits_until_every_busy_slot_fits_a_tier_row():
    """At the switch each busy slot goes to the shortest free row that holds its prompt
    and ``max_tokens``, the longest first; while one fits no row (more long streams
    than long rows) nothing moves and admission waits."""
    launched: list = []
    dec = Decoder(devices=[None, None], _forwarded=None)
    dec._tiered = (((4, 64), (2, 128), (2, 256)), types.SimpleNamespace(relayout="R"), {})
    dec._launch = lambda index, program, state, src: launched.append(src.tolist()) or ("S", None)
    dec._use_tiers = lambda *got: setattr(dec, "_tiered", None)
    dec._state = None
    gen = lambda need: types.SimpleNamespace(prompt=[0] * 8, max_tokens=need - 8, slot=-1)  # noqa: E731
    owners = [gen(200), gen(30), None, gen(100), gen(250), None, gen(60), gen(150)]
    dec._table.owners = list(owners)
    dec._waiting.append(gen(10))
    assert dec._admit() == []  # (held while the tiers wait for their turn)
    dec._try_relayout()  # three need over 128 positions, two rows hold them
    assert not launched and dec._tiered is not None and dec._table.owners == owners
    dec._table.owners[4] = owners[4] = None  # (the 250-position stream ended)
    dec._try_relayout()
    # two devices: each one's slots are its rows of 64, 128, 256 positions in turn:
    # slots 0, 1, 4, 5 of 64, slots 2, 6 of 128, slots 3, 7 of 256
    assert launched == [[6, 1, 3, 0, 8, 8, 8, 7]]  # (new slot i <- old slot src[i])
    assert [owners.index(g) if g else 8 for g in dec._table.owners] == launched[0]
    assert all(g.slot == i for i, g in enumerate(dec._table.owners) if g)
    assert dec._table.free == [6, 5, 4]
    assert dec._state == "S" and dec._tiered is None


def test_the_tiers_timed_while_serving_are_priced_as_on_a_quiet_host():
    """The tiered programs are timed on the compiling thread while the decoder serves:
    their times are scaled by how much slower the prefill cells (the same work in both
    layouts) ran there than at load, and the prefills keep the load's prices."""
    dec = Decoder()
    dec.costs = {"prefill[1,16]": 1e-3, "prefill[4,16]": 2e-3, "dispatch": 1e-4, "step[8]": 6e-3}
    timed = {"prefill[1,16]": 2e-3, "prefill[4,16]": 4e-3, "dispatch": 3e-4, "step[8]": 4e-3}
    got = dec._tier_costs(timed | {"launch": 1e-3})
    assert dec.relayout_scale == 0.5
    assert got == {
        "prefill[1,16]": 1e-3, "prefill[4,16]": 2e-3, "dispatch": 1e-4,
        "step[8]": 2e-3, "launch": 0.5e-3,
    }  # fmt: skip
    dec._tier_costs({"prefill[1,16]": 0.5e-3, "step[8]": 4e-3})  # (never scaled up)
    assert dec.relayout_scale == 1.0


# ------------------------------------------------------------- the prefill placement


def served(place, between_gain: float, epochs: int, drift: float = 0.0) -> None:
    """``place`` (a ``Placement``) fed the reads of a loop serving ``epochs`` epochs, a
    step read every 2 ms, the rule between making ``between_gain`` times beside's
    tokens/s; ``drift``: the load's share of change per second (the traffic's)."""
    now = start = 100.0
    while place.epochs < epochs:
        rate = 10_000.0 * (1.0 + drift * (now - start))
        now += 2e-3
        place.read(rate * 2e-3 * (between_gain if place.rule() else 1.0), 1, now)


def test_the_prefill_placement_takes_the_rule_that_made_more_tokens():
    """Epochs under the rule in force with probes of the other between them: the rule
    that made more tokens/s is taken once it is ``MARGIN`` ahead; an even one stays
    beside, whatever the load's drift (each probe against its two neighbours)."""
    from pxrt.decoder.placement import MARGIN, PROBE, WARM, Placement

    for gain, between in [(1.2, True), (0.8, False), (1.0, False), (1.0 + MARGIN / 2, False)]:
        place = Placement()
        served(place, gain, 60)
        assert place.between == between, gain
        assert place.describe()["rule"] == ("between" if between else "beside")
        assert place.describe()["between_gain"] == pytest.approx(gain, rel=0.01)
    # (warm: a probe every other epoch, the rule kept until WARM samples; then a
    # probe every PROBE-th epoch)
    place = Placement()
    served(place, 1.2, 2 * WARM - 1)
    assert place.samples == WARM - 1 and not place.between
    place = Placement()
    served(place, 1.0, 2 * WARM + 1)
    assert place.samples == WARM
    served(place, 1.0, 2 * WARM + 1 + 3 * (PROBE + 1))
    assert place.samples == WARM + 3
    # A load rising (or falling) by half a second: a probe against the epoch before it
    # alone would read it as a gain (or a loss); against both neighbours it is even.
    for drift in (0.5, -0.5):
        place = Placement()
        served(place, 1.0, 60, drift=drift)
        assert not place.between and abs(place.gain) < MARGIN, drift
    # Between pays once the load changes: the rule follows.
    place = Placement()
    served(place, 0.8, 40)
    assert not place.between
    served(place, 1.25, 40 + 8 * (PROBE + 1))
    assert place.between


def test_an_idle_loop_drops_the_epoch_and_the_probe_pending():
    from pxrt.decoder.placement import EPOCH_READS, Placement

    place = Placement()
    served(place, 1.2, 1)  # (the first epoch of the rule in force: a probe next)
    assert place.probe and place.rule() and place.before > 0
    place.read(10.0, 1, 101.0)
    place.idle()
    assert not place.probe and not place.before and not place.rule()
    epochs = place.epochs
    for i in range(EPOCH_READS - 1):  # (a new epoch from the next read: not yet long)
        place.read(10.0, 1, 200.0 + i)
    assert place.epochs == epochs and place.samples == 0


def test_the_placement_changes_its_rule_on_a_significant_gain_only(monkeypatch):
    """Probes' samples as noisy as this host's epochs (a tenth apart): an even pair of
    rules changes the rule a few times in 300 samples (dozens with the margin alone);
    a 15% gain either way holds its rule after 30."""
    import random

    from pxrt.decoder import placement as pl

    def served(mean: float, significance: float, seed: int) -> tuple[int, float]:
        monkeypatch.setattr(pl, "SIGNIFICANCE", significance)
        rng, place, changes, held = random.Random(seed), pl.Placement(), 0, 0
        for i in range(300):
            before = place.between
            place._sampled(rng.gauss(mean, 0.12))
            changes += place.between != before
            held += place.between and i >= 30
        return changes, held / 270

    significance = pl.SIGNIFICANCE
    for seed in range(5):
        changes, _ = served(0.0, significance, seed)
        margin_only, _ = served(0.0, 0.0, seed)
        assert changes <= 10 and 3 * changes <= margin_only, seed
        assert served(math.log(1.15), significance, seed)[1] >= 0.9, seed
        assert served(math.log(0.87), significance, seed)[1] <= 0.1, seed
