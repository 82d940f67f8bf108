"""Where prompts are prefilled, chosen by the tokens/s each way makes as the loop runs.

With prefills beside the steps (``pxrt.decoder.overlap``, the default on CPU devices),
a unit of prompts that costs more than a step can go either way:

- **beside** the steps, on the prefill thread: the running streams keep their pace,
  less what the two programs and the loop's host work take from each other on the
  host's cores, and the prompts wait longer for their first token (the thread's hop,
  the rows' program slowed by the steps, the insert a turn later);
- **between** two steps (within the turn's bound, ``itl_bound_ms``): every running
  stream waits for it once, and its prompts start at once.

Which pays depends on the model, the slots and the host, and was not found from
prices measured one by one: on 2 CPU cores, alternated, every prefill between made
1.04-1.12x the demo decoder's tokens/s at 8 slots and 1.09x js-small's, 0.94x a 4x
wider model's at 8 and 0.82x the demo's at 16 (``docs/generation.md``). So the loop
measures it: it serves in epochs of at least ``EPOCH_S`` seconds and ``EPOCH_READS``
steps read, each under one rule, and now and then serves one epoch under the other
rule between two of the one in force (first every other epoch, ``WARM`` times, then
every ``PROBE``-th); the probe's tokens/s against the mean of its two neighbours' (a
drift of the load cancels) is a sample of the other rule's gain, and a moving average
of those samples (``GAIN_WEIGHT``) picks the rule once it is ``MARGIN`` from even and
``SIGNIFICANCE`` standard errors (the samples' moving variance). An
epoch the loop went idle in is dropped; the start of each (``settle_s``: twice a
unit's rows' time beside the steps, the units the rule before left in flight) is not
counted. Beside is the rule until the samples say otherwise; between, a unit goes
there only if it stretches the streams' gap to ``BETWEEN_STEPS`` steps at most. Pure
host code, no jax.
"""

from __future__ import annotations

import dataclasses
import math

#: An epoch lasts at least this long (s) and this many steps read.
EPOCH_S = 0.05
EPOCH_READS = 32
#: What an epoch does not count at its start: at least ``SETTLE_S`` seconds, and
#: ``SETTLE_ROWS`` times a unit's rows' wall time beside the steps (a moving average):
#: units the rule before left in flight, or the thread's pipeline filling again. With
#: 5 ms alone a wider model's rows (10-20 ms) crossed into the next epoch and the
#: probes read between as 1.11x where, pinned, it made 0.95x.
SETTLE_S = 0.005
SETTLE_ROWS = 2.0
#: Weight of a unit's rows' wall time in their moving average.
ROWS_WEIGHT = 0.1
#: Probes every other epoch until this many samples (the rule changes after them),
#: then one every ``PROBE`` epochs.
WARM = 6
PROBE = 8
#: Weight of a sample in the gain's moving average, and how far from even it must be
#: (in log tokens/s) to change the rule: ``MARGIN``, and ``SIGNIFICANCE`` times the
#: average's standard error (from the samples' moving variance). Epochs on 2 cores
#: spread ~10%: with the margin alone keras-llama at 8 slots took between once on a
#: 1.12x read where, pinned, it made 0.92x.
GAIN_WEIGHT = 0.25
MARGIN = 0.02
SIGNIFICANCE = 2.0
#: A unit between two steps stretches the streams' gap to this many times the step's
#: price at most (and to the turn's bound): up to the bound alone, the probes put
#: 20 ms prefills between a wider model's steps (js-wide at 8 slots: ITL p99 18.1
#: against JetStream's 12.1 ms).
BETWEEN_STEPS = 3


@dataclasses.dataclass
class Placement:
    """The rule in force (``between``), the epochs' record and the measured gain."""

    #: Whether units that fit the turn's bound go between two steps (else beside).
    between: bool = False
    #: log(tokens/s between / tokens/s beside), a moving average of the probes' samples,
    #: and their moving variance.
    gain: float = 0.0
    spread: float = 0.0
    samples: int = 0
    epochs: int = 0
    #: (the epoch being served; none: 0) when it counts from, its tokens and steps
    #: read, and whether it is a probe (of the rule not in force)
    counted_from: float = 0.0
    tokens: int = 0
    reads: int = 0
    probe: bool = False
    #: The tokens/s of the last epoch of the rule in force, and of the probe after it.
    before: float = 0.0
    probed: float = 0.0
    #: Epochs of the rule in force since the last probe.
    since: int = 0
    #: A unit's rows' wall time beside the steps (s, a moving average).
    rows_s: float = 0.0

    def rule(self) -> bool:
        """Whether the epoch being served puts units between two steps."""
        return self.between != self.probe

    def read(self, tokens: int, steps: int, now: float) -> None:
        """The loop read ``steps`` steps (0: a prefill's first tokens) giving ``tokens``
        tokens at ``now``; an epoch that is long enough ends here."""
        if not self.counted_from:
            self.counted_from = now + self.settle_s()
        if now >= self.counted_from:
            self.tokens += tokens
            self.reads += steps
        if now - self.counted_from >= EPOCH_S and self.reads >= EPOCH_READS:
            self._ended(self.tokens / (now - self.counted_from))
            self.counted_from = now + self.settle_s()
            self.tokens = self.reads = 0

    def rows_done(self, wall_s: float) -> None:
        """A unit's rows took ``wall_s`` beside the steps (handed to the thread to
        done)."""
        if wall_s > 0.0:
            self.rows_s = wall_s if not self.rows_s else self.rows_s + ROWS_WEIGHT * (
                wall_s - self.rows_s
            )

    def settle_s(self) -> float:
        """How long the start of an epoch is not counted."""
        return max(SETTLE_S, SETTLE_ROWS * self.rows_s)

    def idle(self) -> None:
        """The loop has no busy slot: the epoch is dropped, and the probe pending."""
        self.counted_from = 0.0
        self.tokens = self.reads = 0
        self.before = self.probed = 0.0
        self.probe = False

    def _ended(self, rate: float) -> None:
        self.epochs += 1
        if self.probe:
            self.probed, self.probe = rate, False
            return
        if self.probed and self.before:  # (a probe between two epochs of the rule)
            sample = math.log(self.probed / ((self.before + rate) / 2))
            self._sampled(sample if not self.between else -sample)
        self.before, self.probed = rate, 0.0
        self.since += 1
        if self.since >= (1 if self.samples < WARM else PROBE):
            self.since, self.probe = 0, True

    def _sampled(self, sample: float) -> None:
        """A probe's ``sample`` of log(between / beside)."""
        if not self.samples:
            self.gain = sample
        else:
            off = sample - self.gain
            self.gain += GAIN_WEIGHT * off
            self.spread = (1.0 - GAIN_WEIGHT) * (self.spread + GAIN_WEIGHT * off * off)
        self.samples += 1
        if self.samples < WARM:  # (a spread of a few samples can read as none)
            return
        if self.gain > self.threshold():
            self.between = True
        elif self.gain < -self.threshold():
            self.between = False

    def threshold(self) -> float:
        """How far from even the gain must be to change the rule."""
        error = math.sqrt(self.spread * GAIN_WEIGHT / (2.0 - GAIN_WEIGHT))
        return max(MARGIN, SIGNIFICANCE * error)

    def describe(self) -> dict:
        """The rule in force and what chose it, for ``pxrt inspect``."""
        return {
            "rule": "between" if self.between else "beside",
            "between_gain": round(math.exp(self.gain), 4),
            "needs": round(math.exp(self.threshold()), 4),
            "samples": self.samples,
            "epochs": self.epochs,
            "settle_ms": round(self.settle_s() * 1e3, 3),
        }
