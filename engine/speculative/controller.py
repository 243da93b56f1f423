"""When to speculate, and how far: decided from what the engine measures, not from constants of a machine.

Per request, the number of drafts follows its acceptance: the k-th draft is proposed only while the request's
measured chance of a draft being accepted, raised to the k-th power (the chance that all k are), stays above
MIN_CHANCE_OF_USE. Per batch size, speculation is on while steps with drafts give more output tokens a second a
decoding request than steps without, by MIN_GAIN at least: both are measured, in turn at first, at each power of two
of decoding requests, on pure decode steps (a prompt chunk in the step would cloud the comparison), and the mode that
loses is still tried now and then, so that a change (longer contexts, other text) can turn the decision back: after
EXPLORE_EVERY steps, then after twice as many each time it loses again (up to MAX_EXPLORE_EVERY), and again after
EXPLORE_EVERY once the decision turns. A try costs: with a draft model it first runs every token decoded since its
last drafts through the draft (at 32 sequences here a try took 30 ms against 5 ms for a plain step, and trying every
32 steps cost whole runs 10-20%), so losing drafts are tried no more often than keeps that under EXPLORE_BUDGET of
the time.

That catching up is a cost of switching to drafts, not of speculating (drafting steps in a row run one or two
tokens a request through the draft before proposing), so with a draft model a step with drafts after one without is
not measured, and a try of drafts runs two steps. Measured on it, the built-in model's draft lost at four requests
(14 ms a step against 2 ms for four tokens without), while steps with drafts in a row gave 2,175 tokens/s against
1,577-1,910 without.

Rates are per decoding request because the sizes a power of two covers do not cost alike: as a batch of 32 drained
to 17 at the end of a run, steps without drafts (the only ones run then) gave ever fewer tokens a second, their
running rate fell below what drafts had measured at 32, and drafts were switched on at the next full batch, to lose
again (the built-in model's draft: 10-12 steps with drafts a run at 32 sequences, 4-6% of a run's time). A step's
tokens a second a request rise as its batch shrinks, so a draining batch keeps drafts off rather than on.
"""

import math
from dataclasses import dataclass, field

# A draft less likely than this to be used costs more than it is worth. Verifying a token adds little to a step at
# small batches (0.15 ms to a 1.4 ms step at one request here): at 1/4, prompt lookup's acceptance length at one
# request on "copy" was 3.42 against 4.01 with 4 drafts always (1.78x against 2.07x), at 1/10 3.83 (1.95x against
# 2.10x). Large batches, where a token costs more, are the on/off decision's to judge.
MIN_CHANCE_OF_USE = 0.1
ACCEPTANCE_WEIGHT = 0.3  # of a verification in a request's running acceptance
RATE_WEIGHT = 0.1  # of a step in a batch size's running rate, once a mode has had 1 / RATE_WEIGHT steps
MIN_STEPS_EACH = 4  # steps of each mode at a batch size before either is preferred
EXPLORE_EVERY = 32  # steps of a batch size before the losing mode runs once, to stay measured
MAX_EXPLORE_EVERY = 1024  # the interval doubles while the same mode keeps winning
# With a draft model, tries of drafts slower than plain steps are spaced so that their catching up costs at most
# this share of the time: at four requests a catch-up step took 11-16 ms against 1.9 ms for a plain step, and tries
# every 32-64 steps cost whole runs 6-9% (the built-in model's draft). Not short of the margin: at one request slow
# first steps (new shapes) put drafts just under it, and spaced tries kept them off for whole runs (1.02-1.10x).
EXPLORE_BUDGET = 0.02
# Drafts must beat plain steps by this much: at 32 sequences here, steps with drafts measured from 4% slower to 7%
# faster while whole runs came out at 0.98-1.03x (costs outside pure decode steps, and noise): a smaller gain is none.
MIN_GAIN = 0.05


@dataclass
class _Rate:
    """Running output tokens a second a decoding request of one mode: the mean of its first steps (a first step can
    be slow: new shapes), then a moving average that follows changes."""

    value: float = 0.0
    num_steps: int = 0

    def add(self, rate: float) -> None:
        self.num_steps += 1
        self.value += max(1 / self.num_steps, RATE_WEIGHT) * (rate - self.value)


@dataclass
class _ModeRates:
    """Pure decode steps' output tokens a second a decoding request at one batch size, with drafts and without."""

    with_drafts: _Rate = field(default_factory=_Rate)
    without_drafts: _Rate = field(default_factory=_Rate)
    winner: bool | None = None  # whether drafts won the last decision
    explore_every: int = EXPLORE_EVERY
    steps_since_explored: int = 0
    trying: int = 0  # steps left of a try of the losing mode after this one
    catch_up_s: float = 0.0  # the last step that caught drafting up (a draft model's KV after steps without)

    def speculates(self, drafts_try_steps: int) -> bool:
        """Whether the next step speculates; a try of drafts runs `drafts_try_steps` steps."""
        with_drafts, without_drafts = self.with_drafts, self.without_drafts
        if min(with_drafts.num_steps, without_drafts.num_steps) < MIN_STEPS_EACH:  # both measured first, in turn
            return with_drafts.num_steps <= without_drafts.num_steps
        better = with_drafts.value >= (1 + MIN_GAIN) * without_drafts.value
        if better != self.winner:  # the decision turned (or is the first): the loser is tried soon again
            self.winner, self.steps_since_explored, self.trying = better, 0, 0
            self.explore_every = self._spaced(EXPLORE_EVERY)
        if self.trying:
            self.trying -= 1
            return not better
        self.steps_since_explored += 1
        if self.steps_since_explored < self.explore_every:
            return better
        self.explore_every = self._spaced(2 * self.explore_every)
        self.steps_since_explored = 0
        self.trying = 0 if better else drafts_try_steps - 1
        return not better

    def _spaced(self, explore_every: int) -> int:
        """`explore_every`, or more while drafts lose outright (slower than plain steps: short of the margin, a try
        may well turn the decision) and catching them up would take more than EXPLORE_BUDGET of the time (a plain
        step takes 1 / its rate: one token a request)."""
        losing = self.with_drafts.value < self.without_drafts.value
        if not self.winner and losing and self.catch_up_s and self.without_drafts.value:
            explore_every = max(explore_every, math.ceil(self.catch_up_s * self.without_drafts.value / EXPLORE_BUDGET))
        return min(explore_every, MAX_EXPLORE_EVERY)


class SpeculationController:
    """`adaptive` False: always speculate, with `max_drafts` drafts (what is measured is then only recorded).
    `drafts_catch_up`: a step with drafts after one without first catches the proposer up (a draft model's KV)."""

    def __init__(self, max_drafts: int, adaptive: bool = True, drafts_catch_up: bool = False) -> None:
        self.max_drafts = max_drafts
        self.adaptive = adaptive
        self.drafts_catch_up = drafts_catch_up
        self._acceptance: dict[str, float] = {}  # request id -> chance that a draft is accepted
        self._rates: dict[int, _ModeRates] = {}  # batch size bucket -> rates
        self._drafted_last_step = False

    def speculates(self, num_decoding: int) -> bool:
        """Whether a step with this many decoding requests gets drafts."""
        if not self.adaptive:
            return True
        rates = self._rates.setdefault(_bucket(num_decoding), _ModeRates())
        return rates.speculates(drafts_try_steps=2 if self.drafts_catch_up else 1)

    def num_drafts(self, request_id: str) -> int:
        """How many drafts the request gets: at least one, so its acceptance stays measured."""
        if not self.adaptive:
            return self.max_drafts
        chance = self._acceptance.get(request_id, 1.0)
        num_drafts, all_accepted = 1, chance
        while num_drafts < self.max_drafts and all_accepted * chance >= MIN_CHANCE_OF_USE:
            num_drafts += 1
            all_accepted *= chance
        return num_drafts

    def verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A step verified `num_drafts` of the request's drafts and accepted the first `num_accepted`: each accepted
        draft passed a test, and the first rejected one failed it (drafts after it were never tested)."""
        num_tested = min(num_drafts, num_accepted + 1)
        previous = self._acceptance.get(request_id, 1.0)
        self._acceptance[request_id] = previous + ACCEPTANCE_WEIGHT * (num_accepted / num_tested - previous)

    def stepped(
        self, num_decoding: int, with_drafts: bool, num_tokens: int, elapsed_s: float, pure_decode: bool = True
    ) -> None:
        """A step of `num_decoding` requests gave `num_tokens` tokens in `elapsed_s`. Measured if it was a pure decode
        step (a prompt chunk in it would cloud the comparison) that did not catch drafting up."""
        catching_up = self.drafts_catch_up and with_drafts and not self._drafted_last_step
        self._drafted_last_step = with_drafts
        if not pure_decode:
            return
        rates = self._rates.setdefault(_bucket(num_decoding), _ModeRates())
        if catching_up:
            rates.catch_up_s = elapsed_s
            return
        rate = num_tokens / max(elapsed_s, 1e-9) / num_decoding
        (rates.with_drafts if with_drafts else rates.without_drafts).add(rate)

    def forget(self, request_id: str) -> None:
        self._acceptance.pop(request_id, None)


def _bucket(num_decoding: int) -> int:
    """The power of two at or above the batch size: sizes that cost about the same share a decision."""
    return 1 << max(0, num_decoding - 1).bit_length()
