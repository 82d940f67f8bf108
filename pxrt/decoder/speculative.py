"""Speculative decoding by prompt lookup: each generation's drafts (``PromptLookup``),
whether drafting pays this turn (moving averages of the tokens a verify gains and of
the verify's and the step's times), and a verify's tokens routed column by column. Pure
host code, no jax: a part of ``pxrt.decoder.engine.Decoder`` (a mixin, like
``pxrt.decoder.scheduler``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .params import MIN_TEMPERATURE

if TYPE_CHECKING:
    from .core import Core
else:
    Core = object

# Speculative decoding's measure of whether it pays: a moving average's weight, and how
# many turns run plain steps between two verifies while it does not.
_EMA, _PROBE = 0.1, 32


class PromptLookup:
    """Speculative decoding's drafts for one generation, by prompt lookup: the tokens
    that followed the last earlier occurrence of its text's last 3 tokens (else 2), its
    text being the prompt and the tokens generated so far. Each n-gram is indexed once,
    as the text grows, so a draft costs a dictionary lookup."""

    __slots__ = ("text", "after", "prompt", "hit")

    def __init__(self, prompt: np.ndarray) -> None:
        self.hit = False  # its last draft found something
        self.text: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}  # n-gram -> where the next token is
        self.prompt = len(prompt)
        self._extend(prompt.tolist())

    def _extend(self, tokens: list[int]) -> None:
        text, after = self.text, self.after
        for token in tokens:
            end = len(text)  # the n-grams ending at the last token are followed by this
            if end >= 2:
                after[(text[-2], text[-1])] = end
                if end >= 3:
                    after[(text[-3], text[-2], text[-1])] = end
            text.append(token)

    def draft(self, generated: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to try after ``generated`` (the generation's tokens)."""
        self._extend(generated[len(self.text) - self.prompt :])
        text = self.text
        at = self.after.get(tuple(text[-3:])) if len(text) >= 3 else None
        if at is None and len(text) >= 2:
            at = self.after.get((text[-2], text[-1]))
        return [] if at is None else text[at : at + k]


class Speculation(Core):
    """The drafts of a turn, or None (a plain step), and a verify's tokens routed."""

    def _drafts(self) -> np.ndarray | None:
        """Speculative decoding: each busy slot's drafts (prompt lookup: what followed
        the last earlier occurrence of its last 3, else 2, tokens), ``[slots, k]``,
        -1 past a slot's; or None: a plain step instead (a busy slot samples, has
        controls or logprobs, or lacks room in the cache for k more; or no slot has a
        draft). The programs in flight are read first: drafts continue the tokens."""
        k = self.speculative_tokens
        spec = self._spec
        if spec["verify_s"] and spec["step_s"]:
            if (1 + spec["gain"]) * spec["step_s"] < spec["verify_s"]:
                spec["skip"] += 1
                if spec["skip"] < _PROBE:
                    return None
            spec["skip"] = 0
        owners = self._table.owners
        for gen in owners:
            if gen is not None and (
                gen.temperature >= MIN_TEMPERATURE
                or gen.controls is not None
                or gen.logprobs is not None
            ):
                return None
        if not any(g is not None and g.lookup is not None and g.lookup.hit for g in owners):
            # No slot found a draft last time: the step in flight is not waited for
            # unless one might (a slot new to the lookup).
            if all(g is None or g.lookup is not None for g in owners):
                for gen in owners:
                    if gen is not None:
                        gen.lookup.hit = bool(gen.lookup.draft(gen.tokens, k))
                if not any(g is not None and g.lookup.hit for g in owners):
                    return None
        pending = self._pending
        while pending:
            self._read(pending[0])
            pending.popleft()
        drafts = np.full((self.slots, k), -1, np.int32)
        found = False
        for slot, gen in enumerate(owners):
            if gen is None:
                continue
            if len(gen.prompt) + len(gen.tokens) + k > self.max_length:
                return None
            lookup = gen.lookup
            if lookup is None:
                lookup = gen.lookup = PromptLookup(gen.prompt)
            draft = lookup.draft(gen.tokens, k)
            lookup.hit = bool(draft)
            if draft:
                drafts[slot, : len(draft)] = draft
                found = True
        return drafts if found else None

    def _route_verified(
        self, tokens: np.ndarray, accepted: np.ndarray, owners: list, now: float,
        woken: list, finished: list,
    ) -> int:  # fmt: skip
        """A verify program's tokens: a slot's first ``accepted + 1``, column by column
        (stop conditions apply to each)."""
        accepted = np.asarray(accepted)
        routed = 0
        for j in range(tokens.shape[1]):
            column = [
                g if g is not None and accepted[i] >= j else None for i, g in enumerate(owners)
            ]
            if not any(g is not None for g in column):
                break
            routed += self._table.route(
                np.ascontiguousarray(tokens[:, j]), column, now, woken, finished
            )
        busy = 0
        gained = 0
        for i, gen in enumerate(owners):
            if gen is not None:
                gen.dispatched += int(accepted[i])  # (dispatch counted one)
                gained += int(accepted[i])
                busy += 1
        self.counters["accepted_tokens"] += gained
        spec = self._spec
        spec["gain"] += _EMA * (gained / max(busy, 1) - spec["gain"])
        return routed
