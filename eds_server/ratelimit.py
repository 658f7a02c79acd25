"""Token buckets: budgets of "N per window" that a client spends and that refill continuously."""

from __future__ import annotations

import logging
import time


class Bucket:
    """`capacity` tokens, refilled at `capacity` per `window` seconds."""

    __slots__ = ("capacity", "rate", "stamp", "tokens")

    def __init__(self, capacity: int, window: float) -> None:
        self.capacity = float(capacity)
        self.rate = capacity / window
        self.tokens = float(capacity)
        self.stamp = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, n: int = 1) -> bool:
        self._refill()
        if self.tokens >= n:
            self.tokens -= n
            return True
        self.tokens = 0.0
        return False

    def peek(self) -> bool:
        """Whether one token is there, without taking it."""
        self._refill()
        return self.tokens >= 1

    @property
    def share(self) -> float:
        """The part of its capacity left, 0 to 1."""
        self._refill()
        return self.tokens / self.capacity

    @property
    def full(self) -> bool:
        self._refill()
        return self.tokens >= self.capacity

    @property
    def seconds_to_next(self) -> float:
        self._refill()
        return max(0.0, (1 - self.tokens) / self.rate)


class PerKey:
    """One bucket per key (e.g. a client IP), at most `most` keys: when full, keys whose bucket
    has refilled are forgotten (nobody's debt is), then the oldest."""

    def __init__(self, capacity: int, window: float, most: int = 10_000) -> None:
        self.capacity, self.window, self.most = capacity, window, most
        self.buckets: dict[str, Bucket] = {}

    def get(self, key: str) -> Bucket:
        bucket = self.buckets.get(key)
        if bucket is None:
            if len(self.buckets) >= self.most:
                for k in [k for k, b in self.buckets.items() if b.full]:
                    del self.buckets[k]
                while len(self.buckets) >= self.most:
                    del self.buckets[next(iter(self.buckets))]
            bucket = self.buckets[key] = Bucket(self.capacity, self.window)
        return bucket


class LogBudget:
    """At most `most` lines per `window` seconds from one place that can repeat (a peer sending junk,
    a refused credential retried): the first ones are said, the rest counted and their number said
    with the next line that gets through."""

    def __init__(self, logger: logging.Logger, most: int = 5, window: float = 60.0) -> None:
        self.logger = logger
        self.bucket = Bucket(most, window)
        self.suppressed = 0

    def log(self, level: int, msg: str, *args: object) -> bool:
        """Log it if the budget allows (True), else count it."""
        if not self.bucket.take():
            self.suppressed += 1
            return False
        if self.suppressed:
            msg += f" ({self.suppressed} more like it not logged)"
            self.suppressed = 0
        self.logger.log(level, msg, *args)
        return True
