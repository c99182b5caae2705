"""Training progress for the job's output: rank 0 sends its step metrics to a small actor, and a
thread in the driver turns the latest into a progress bar line now and then.

Owns: how often the job's output hears about training (one line every train.log_every_s at most,
and at most MAX_LINES lines whatever the number of steps). Does not own the per-step record
(metrics.jsonl and the Ray gauges, actors.trainer._Progress) nor the workers' own log lines.
Why an actor rather than Ray Train's reported metrics: Ray Train hands the driver a report only
when a worker calls ray.train.report, which also carries each checkpoint; reporting every step
would make Ray Train keep a result per step, and its callbacks run in its controller, not here.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("eagle3")

MAX_LINES = 100
"""Progress lines of one training run in the job's output at most (the last one included)."""


class ProgressActor:
    """The latest metrics rank 0 reported (a step, its loss, accuracy, tokens/s). Rank 0 calls
    `update` without waiting for it; the driver polls `latest`."""

    def __init__(self):
        self.metrics: dict = {}

    def update(self, metrics: dict) -> None:
        if metrics.get("step", 0) >= self.metrics.get("step", 0):
            self.metrics = metrics

    def latest(self) -> dict:
        return self.metrics


class ProgressLines:
    """When to print and what: a line once the step has moved by num_steps / MAX_LINES since the last
    line AND interval_s has passed (so at most MAX_LINES lines, and at most one every interval_s),
    plus the last step's; each line a tqdm bar (its format_meter) with loss, accuracy and tokens/s.
    Plain state, testable without Ray."""

    def __init__(self, num_steps: int, interval_s: float, *, start_step: int = 0, clock=time.monotonic):
        """start_step: the step a resumed run starts after (no line until a later one)."""
        self.num_steps, self.interval_s, self.clock = num_steps, interval_s, clock
        self.stride = max(1, -(-num_steps // (MAX_LINES - 1)))  # ceil: MAX_LINES - 1 strides, then the last line
        self.t0 = self.first_step = None  # set by the first metrics seen: the rate leaves the set-up out
        self.last_step, self.last_t = start_step, None
        self.lines = 0

    def line(self, m: dict) -> str | None:
        """The line to print for these metrics, or None (too soon, or no new step)."""
        step = m.get("step", 0)
        now = self.clock()
        if self.t0 is None:
            self.t0, self.first_step = now, step
        last = step >= self.num_steps
        if step <= self.last_step and not (last and self.last_step < self.num_steps):
            return None
        if not last and (step - self.last_step < self.stride
                         or (self.last_t is not None and now - self.last_t < self.interval_s)):
            return None
        self.last_step, self.last_t = step, now
        self.lines += 1
        from tqdm import tqdm

        post = [f"loss={m['loss']:.4f}"] if "loss" in m else []
        if "full_acc_0" in m:
            post.append(f"acc0={m['full_acc_0']:.3f}")
        if "tokens_per_s" in m:
            post.append(f"tok/s={m['tokens_per_s']:,.0f}")
        return tqdm.format_meter(step, self.num_steps, now - self.t0, prefix="train", unit="step",
                                 initial=self.first_step, postfix=", ".join(post), ncols=100)


class DriverProgress:
    """A driver thread that polls a ProgressActor every poll_s and logs ProgressLines' lines;
    `close()` logs the last metrics seen (the final step's) and stops it."""

    def __init__(self, actor, num_steps: int, interval_s: float, *, poll_s: float = 2.0):
        self.actor, self.poll_s = actor, poll_s
        self.lines = ProgressLines(num_steps, interval_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="train-progress", daemon=True)
        self._thread.start()

    def _emit(self) -> None:
        import ray

        try:
            m = ray.get(self.actor.latest.remote(), timeout=30)
        except (ray.exceptions.RayError, TimeoutError) as e:  # the job goes on; its progress line waits
            logger.warning("train progress: could not read rank 0's metrics (%s); next try in %.0fs", e, self.poll_s)
            return
        if m and (text := self.lines.line(m)) is not None:
            logger.info("%s", text)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._emit()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._emit()
