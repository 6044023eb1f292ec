"""Tree fan-out: one thing (an image, a file of the weights) from its origin to N nodes, each
node that has it serving the next ones, so the number of holders doubles each round and the
origin sends it about once, not N times.

The planner is pure: it knows node names and what each transfer came to, never how a
transfer is made. ``FanOut`` holds the state of one item's fan-out; ``next_round`` gives the
(source, target) pairs to run now (every holder that may serve, one waiting target each), and
``record`` takes each pair's ``Outcome``:

- ``OK``: the target holds the item now (verified by the transfer) and serves from the next
  round on;
- ``TARGET``: the target failed (its disk, its check); it is out, the others go on;
- ``SOURCE``: the source failed (unreachable, or its copy turned out bad): it serves no more,
  and its target waits for another source in the next round.

When no source is left for the targets still waiting, they fail with the reason. ``run`` drives
the rounds over a ``transfer(source, target) -> Outcome`` (the image ship, a model sync);
``rounds`` is the plan when every transfer succeeds (what a dry run shows). ``pick_source`` is
the one rule for choosing among holders, shared with the per-file scheduler of model.sync.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

Pair = tuple[str, str]
"""(source, target)."""


class Outcome(enum.Enum):
    OK = "ok"
    TARGET = "target"
    SOURCE = "source"


def pick_source(holders: Sequence[str], origin: str, load: dict[str, int] | None = None) -> str:
    """The holder that serves next: a node other than the origin before the origin (the
    origin's link is the one every fan-out starts on, and what it sends once need not leave it
    again), then the least loaded, then in holding order."""
    load = load or {}
    order = {h: i for i, h in enumerate(holders)}
    return min(holders, key=lambda h: (h == origin, load.get(h, 0), order[h]))


@dataclass
class FanOut:
    """One item's fan-out from ``origin`` to ``targets`` (in the order they are served)."""

    origin: str
    targets: list[str]
    holders: list[str] = field(default_factory=list)
    """Nodes that hold the item and may serve it, in the order they came to hold it."""
    waiting: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    """target -> why it did not get the item."""
    lost: dict[str, str] = field(default_factory=dict)
    """source -> why it serves no more."""
    running: set[Pair] = field(default_factory=set)
    received: list[str] = field(default_factory=list)
    """Targets that got the item (a lost source among them: it holds the item, serves no more)."""
    stranded: list[str] = field(default_factory=list)
    """Targets that failed because no source was left (no transfer of theirs said so)."""

    def __post_init__(self) -> None:
        if not self.holders:
            self.holders = [self.origin]
        if not self.waiting:
            self.waiting = [t for t in self.targets if t not in self.holders]

    def next_round(self) -> list[Pair]:
        """The pairs to start now: each free holder serves one waiting target (a holder busy
        with a running pair, or a target already in one, waits)."""
        busy_src = {s for s, _ in self.running}
        busy_dst = {t for _, t in self.running}
        free = [h for h in self.holders if h not in busy_src]
        todo = [t for t in self.waiting if t not in busy_dst]
        pairs: list[Pair] = []
        for target in todo:
            if not free:
                break
            src = pick_source(free, self.origin)
            free.remove(src)
            pairs.append((src, target))
        self.running.update(pairs)
        self._give_up()
        return pairs

    def record(self, pair: Pair, outcome: Outcome, why: str = "") -> None:
        """What the transfer ``pair`` came to."""
        src, target = pair
        self.running.discard(pair)
        if outcome is Outcome.OK:
            self.waiting.remove(target)
            self.holders.append(target)
            self.received.append(target)
        elif outcome is Outcome.TARGET:
            self.waiting.remove(target)
            self.failed[target] = why or f"{target} failed"
        else:
            if src in self.holders:
                self.holders.remove(src)
            self.lost[src] = why or f"{src} failed while sending"
        self._give_up()

    def _give_up(self) -> None:
        """With no holder left and nothing running, every waiting target has failed."""
        if self.holders or self.running:
            return
        why = "; ".join(f"{s}: {w}" for s, w in self.lost.items()) or "no source"
        for target in self.waiting:
            self.failed[target] = f"no node left to send from ({why})"
            self.stranded.append(target)
        self.waiting = []

    @property
    def finished(self) -> bool:
        return not self.waiting and not self.running

    @property
    def done(self) -> list[str]:
        """The targets that got the item, in target order."""
        return [t for t in self.targets if t in self.received]


def rounds(origin: str, targets: Iterable[str]) -> list[list[Pair]]:
    """The rounds when every transfer succeeds: 1, 2, 4, ... pairs."""
    fan = FanOut(origin, list(targets))
    out = []
    while not fan.finished:
        pairs = fan.next_round()
        for p in pairs:
            fan.record(p, Outcome.OK)
        out.append(pairs)
    return out


def run(fan: FanOut, transfer: Callable[[str, str], tuple[Outcome, str]],
        each: Callable[[Callable[[Pair], tuple[Outcome, str]], list[Pair]], list]) -> FanOut:
    """Run the rounds: each round's pairs through ``each`` (at once), every outcome recorded,
    until no target waits. ``transfer(source, target)`` returns (outcome, why)."""
    while not fan.finished:
        pairs = fan.next_round()
        if not pairs:  # nothing can start and nothing runs: every waiting target failed
            break
        for pair, (outcome, why) in zip(pairs, each(lambda p: transfer(*p), pairs),
                                        strict=True):
            fan.record(pair, outcome, why)
    return fan
