"""CPU model of the push all-reduce protocol (:mod:`comm.push_allreduce`), for CI.

Each rank is a state machine running launches phase after phase, in the steps of the
kernel (push to every peer's half ``p & 1`` -> raise flags -> wait for all flags of phase p
-> read the world slots -> advance). A scheduler interleaves the ranks' atomic steps at
random (with optional slow readers). The checker asserts, for every read, that the value is
exactly what the writer pushed for that phase (no stale read, no overwrite before read), and
that every run finishes (no deadlock). Deliberately broken variants -- a single buffer half,
or an exact-match (``==``) wait, which deadlocks when a fast peer's next flag lands first --
must be caught, so the model is known to be able to fail.
"""

from __future__ import annotations

import random


class Rank:
    def __init__(self, r: int, world: int, phases: int, halves: int):
        self.r, self.world, self.phases, self.halves = r, world, phases, halves
        self.phase = 0
        self.step = "push"
        self.q = 0  # next peer to push to / next slot to read
        self.done = False
        self.sum = 0

    def value(self, p: int) -> int:
        return 1000 * p + self.r + 1  # what rank r contributes at phase p


class Model:
    def __init__(self, world: int, phases: int, halves: int = 2, seed: int = 0, slow: dict | None = None,
                 exact_wait: bool = False):
        self.world, self.phases, self.halves = world, phases, halves
        self.exact_wait = exact_wait
        self.rng = random.Random(seed)
        # recv[q][h][s] = (phase, value) last pushed by s into q's half h
        self.recv = [[[None] * world for _ in range(halves)] for _ in range(world)]
        # flags[q][s] = phase + 1 last raised by s at q
        self.flags = [[0] * world for _ in range(world)]
        self.ranks = [Rank(r, world, phases, halves) for r in range(world)]
        self.slow = slow or {}  # rank -> probability of not being scheduled when chosen
        self.errors: list[str] = []

    def runnable(self, rk: Rank) -> bool:
        if rk.done:
            return False
        if rk.step == "wait":
            if self.exact_wait:
                return all(self.flags[rk.r][s] == rk.phase + 1 for s in range(self.world))
            return all(self.flags[rk.r][s] >= rk.phase + 1 for s in range(self.world))
        return True

    def step(self, rk: Rank) -> None:
        p, h = rk.phase, rk.phase % self.halves
        if rk.step == "push":
            self.recv[rk.q][h][rk.r] = (p, rk.value(p))
            rk.q += 1
            if rk.q == self.world:
                rk.q, rk.step = 0, "flag"
        elif rk.step == "flag":
            self.flags[rk.q][rk.r] = p + 1
            rk.q += 1
            if rk.q == self.world:
                rk.q, rk.step = 0, "wait"
        elif rk.step == "wait":
            rk.step, rk.sum = "read", 0
        elif rk.step == "read":
            got = self.recv[rk.r][h][rk.q]
            want = (p, self.ranks[rk.q].value(p))
            if got != want:
                self.errors.append(f"rank {rk.r} phase {p} read slot {rk.q}: got {got}, expected {want}")
            rk.sum += got[1] if got else 0
            rk.q += 1
            if rk.q == self.world:
                rk.q, rk.step = 0, "push"
                rk.phase += 1
                rk.done = rk.phase == self.phases

    def run(self, max_steps: int = 10**6) -> bool:
        """True if all ranks finished; False on deadlock. Errors are in self.errors."""
        for _ in range(max_steps):
            live = [rk for rk in self.ranks if self.runnable(rk)]
            if not live:
                return all(rk.done for rk in self.ranks)
            rk = self.rng.choice(live)
            if self.rng.random() < self.slow.get(rk.r, 0.0) and len(live) > 1:
                continue
            self.step(rk)
        return False
