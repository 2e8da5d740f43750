"""How many threads the engine's steps use when the cores are shared (CPU_THREAD_POLICY=adaptive).

A step on CPU is hundreds of parallel regions, each ending at a barrier that waits for the
team's slowest thread. When another process takes one of the cores, the thread that shares it
is descheduled for whole time slices, and every barrier waits them out: at one stream on two
cores, a decode step went from ~12 ms to hundreds. With one thread fewer there is no barrier to
wait at, and the step costs what that many threads cost.

Waiting alone does not say which count is faster: the stack's own gateway and scheduler, on the
same two cores, make the worker's threads wait a fifth of their time while two threads still
decode twice as fast as one. So waiting only starts a trial, and the steps' measured cost
decides (cost: the wall time of decode-only steps, compared between steps of the same number of
rows, since a prefill chunk's tokens cost a fraction of a decode's and a step's rows change its
cost):

    steady at n, a window (`window_s`) with decode steps whose threads waited >= `high` of
    their time
        -> trial at n - 1 for `trial_s`
    steady below the most, `retry_s` after the last change, the last window with decode steps
        -> trial at n + 1 for `trial_s`
    a trial whose decode steps cost, row count for row count, below the steady ones / `margin`
        -> keep its count (steady there); a trial down whose steps cost more than `sure` of
           the steady ones first goes back for a confirmation (`trial_s`, up to `trial_max_s`)
           and keeps its count only if its steps also cost below that window's / `margin`
    a trial with no step of a row count both saw yet -> on, up to `trial_max_s`
    else -> back, and the next trial in that direction waits twice as long (up to `retry_max_s`)

A trial is only ever judged against the window right before it, and on at least `min_steps`
steps of a row count on each side: steps from longer ago ran on another load, and a single one
is no evidence. At 32 streams on idle cores a trial judged on one 1-row decode step (the
warm-up's last, slowed by the gateway tokenizing the 32 arriving prompts) kept one thread of
two, and could not go back while the prefill steps, which it cannot compare, lasted: 93-99
tokens/s for those runs, 142-150 with these rules (156 with a fixed count).

A trial down compared with the window before it alone mistakes a load that ends for one thread
being faster: at the served stack's switch from one stream to 32, the window before the trial
held 1-row decodes slowed by the gateway tokenizing 32 arriving prompts, the trial's did not, and
one thread of two was kept for the prefill that followed (a c32 round at 90.6 tokens/s against
114-121 beside it). A collapse (a busy process on the threads' core: steps 3-30x as long) is
kept at once; a trial that is cheaper by less is compared again with a window back at the count
it left, which a load that has ended no longer slows.

Windows are measured in time, not steps, so that steps slowed down by the contention itself
(hundreds of ms each) are judged as soon as quick ones.

Below the most threads, a window whose allowed CPUs sat idle for at least `idle_up` of a CPU
while the threads hardly waited (below `high` / 2) goes back up at once, no trial needed: the
competitor that made fewer threads faster is gone. Trials back up are judged on decode steps,
and a load of long prefill steps has none: one thread of two kept after a real collapse (a peer
server shutting down beside the worker) stayed through the prefill of the 32 prompts that
followed, a quarter of that c32 round (94.5 tokens/s against 122-126 in the rounds beside it).
With a busy process on the other core the CPUs are not idle, and under a CPU quota the threads
wait (throttled), so neither goes up.

A trial's count applies to decode-only steps, the steps it is judged on; any other step during a
trial runs at the larger of the two counts (`threads_for`). A trial down started by the burst of
work a new load brings (the gateway tokenizing 32 prompts, the scheduler admitting them) used to
run the prefill steps that followed, seconds each and never comparable, at one thread of two: a
2,048-token step at half speed before the trial could end, in every c32 round of the served
benchmark.

Pure: it is given the wall time of the steps since its last call, each decode-only step's rows
and wall time, and the waiting and the allowed CPUs' idle time measured across them, and answers
the thread count to use from then on (and, before a step, the count for its kind); cpu_share.py measures,
thread_pacer.py applies. Invariant: min_threads <= threads <= max_threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GovernorConfig:
    max_threads: int
    min_threads: int = 1
    high: float = 0.2                   # the waiting share that starts a trial at one thread fewer
    margin: float = 1.2                 # how much cheaper a trial's steps must be to keep its count
    sure: float = 0.5                   # a trial down this much cheaper is kept without a confirmation
    window_s: float = 0.5               # wall time of steps per judgement at a steady count
    trial_s: float = 0.3                # wall time of steps a trial lasts (one call at least)
    trial_max_s: float = 1.0            # ... while it has no decode step to compare, at most
    min_steps: int = 2                  # decode steps of one row count each side needs to be compared
    idle_up: float = 0.5                # CPUs idle (of the allowed ones, on average) that bring a thread back
    retry_s: float = 5.0                # first wait before a trial in a direction that failed
    retry_max_s: float = 60.0


@dataclass
class _Window:
    wall_s: float = 0.0
    waited_s: float = 0.0
    idle_s: float = 0.0                 # the allowed CPUs' idle seconds, summed over them
    decodes: dict[int, list[float]] = field(default_factory=dict)   # rows -> [wall seconds, steps]

    def share(self, threads: int) -> float:
        return self.waited_s / (self.wall_s * threads) if self.wall_s > 0 else 0.0

    def add_decodes(self, steps: list[tuple[int, float]]) -> None:
        for rows, wall_s in steps:
            total = self.decodes.setdefault(rows, [0.0, 0])
            total[0] += wall_s
            total[1] += 1


def relative_cost(trial: dict[int, list[float]], steady: dict[int, list[float]],
                  min_steps: int = 1) -> float | None:
    """The trial's decode steps' mean time over the steady ones', averaged over the row counts
    both saw at least `min_steps` times, weighted by the trial's steps; None when they share
    no such row count."""
    weighted = steps = 0.0
    for rows, (wall_s, count) in trial.items():
        if rows in steady and steady[rows][1] >= min_steps and count >= min_steps:
            weighted += count * (wall_s / count) / (steady[rows][0] / steady[rows][1])
            steps += count
    return weighted / steps if steps else None


class ThreadGovernor:
    """The thread count for the next step, from what the last steps cost and waited (module
    docstring)."""

    def __init__(self, config: GovernorConfig, now_s: float) -> None:
        if not 1 <= config.min_threads <= config.max_threads:
            raise ValueError(f"threads bounds {config.min_threads}..{config.max_threads} are not 1 <= min <= max")
        self.config = config
        self.threads = config.max_threads
        self.last_share = 0.0               # the last steady window's waiting share
        self.last_idle = 0.0                # the last steady window's idle CPUs (on average)
        self.last_relative: float | None = None   # the last judged trial's steps over the steady ones'
        self.last_kept = False              # whether the last trial that ended kept its count
        self._window = _Window()
        self._steady: dict[int, list[float]] = {}   # the last steady window's decode steps
        self._trial_from: int | None = None  # the steady count a trial returns to
        self._trial_direction = 0
        # A trial down not yet kept: its count and steps, while back at the steady count.
        self._confirming: tuple[int, dict[int, list[float]]] | None = None
        self._wait_s = {-1: 0.0, +1: config.retry_s}   # per direction, before its next trial
        self._changed_at_s = now_s

    @property
    def in_trial(self) -> bool:
        return self._trial_from is not None or self._confirming is not None

    @property
    def confirming(self) -> bool:
        """Back at the count a trial down left, to compare that trial's steps once more."""
        return self._confirming is not None

    def threads_for(self, decode_only: bool) -> int:
        """The count for the next step: `threads`, except that a step with prefill rows during a
        trial runs at the larger of the trial's count and the one it left (module docstring)."""
        if self._trial_from is None or decode_only:
            return self.threads
        return max(self.threads, self._trial_from)

    def observe(self, wall_s: float, decodes: list[tuple[int, float]], waited_s: float, now_s: float,
                idle_s: float = 0.0) -> int:
        """The steps since the last call: their wall time, each decode-only step's (rows, wall
        time), the process's waiting over them and the allowed CPUs' idle time (summed over
        them). Returns the count to use from the next step on."""
        window = self._window
        window.wall_s += max(wall_s, 0.0)
        window.waited_s += max(waited_s, 0.0)
        window.idle_s += max(idle_s, 0.0)
        window.add_decodes(decodes)
        if self.in_trial:
            if window.wall_s >= self.config.trial_s:
                # A confirmation: the trial's steps against this window's; a trial: this window's
                # against the steady ones.
                trial, steady = ((self._confirming[1], window.decodes) if self.confirming
                                 else (window.decodes, self._steady))
                relative = relative_cost(trial, steady, self.config.min_steps)
                if relative is not None or window.wall_s >= self.config.trial_max_s:
                    (self._end_confirmation if self.confirming else self._end_trial)(relative, now_s)
            return self.threads
        if window.wall_s >= self.config.window_s:
            self.last_share = window.share(self.threads)
            self.last_idle = window.idle_s / window.wall_s
            self._steady = window.decodes       # only the last window's steps judge a trial
            self._window = _Window()
            if (self.threads < self.config.max_threads and self.last_idle >= self.config.idle_up
                    and self.last_share < self.config.high / 2 and self._ready(+1, now_s)):
                return self._rise(now_s)
            waited = self.last_share >= self.config.high
            if waited and self.threads > self.config.min_threads and self._judges() and self._ready(-1, now_s):
                return self._start_trial(-1, now_s)
        if self.threads < self.config.max_threads and self._judges() and self._ready(+1, now_s):
            return self._start_trial(+1, now_s)
        return self.threads

    def _rise(self, now_s: float) -> int:
        """One thread more at once: the CPUs sat idle while the threads did not wait."""
        self.last_kept = True
        self._steady = {}                   # steps at the lower count judge no trial at this one
        self._wait_s = {-1: 0.0, +1: self.config.retry_s}
        self._set(self.threads + 1, now_s)
        return self.threads

    def _judges(self) -> bool:
        """Whether the last window's decode steps can judge a trial: `min_steps` of one row
        count at least (one step is no evidence: the warm-up's last, slowed by a burst of
        arrivals, once made one thread look faster)."""
        return any(count >= self.config.min_steps for _, count in self._steady.values())

    def _ready(self, direction: int, now_s: float) -> bool:
        return now_s - self._changed_at_s >= self._wait_s[direction]

    def _start_trial(self, direction: int, now_s: float) -> int:
        self._trial_from = self.threads
        self._trial_direction = direction
        self._set(self.threads + direction, now_s)
        return self.threads

    def _end_trial(self, relative: float | None, now_s: float) -> None:
        returned_to, direction = self._trial_from, self._trial_direction
        self._trial_from = None
        self.last_relative = relative
        cheaper = relative is not None and relative * self.config.margin < 1.0
        if cheaper and direction < 0 and relative > self.config.sure:
            self._confirming = (self.threads, self._window.decodes)
            self._set(returned_to, now_s)
        elif cheaper:
            self._keep(self._window.decodes, now_s)
        else:
            self._back_off(direction, returned_to, now_s)

    def _end_confirmation(self, relative: float | None, now_s: float) -> None:
        """`relative`: the trial's steps against this window's, back at the count it left."""
        trial_threads, trial_decodes = self._confirming
        self._confirming = None
        self.last_relative = relative
        if relative is not None and relative * self.config.margin < 1.0:
            self.threads = trial_threads
            self._keep(trial_decodes, now_s)
        else:
            self._steady = self._window.decodes
            self._back_off(-1, self.threads, now_s)

    def _keep(self, decodes: dict[int, list[float]], now_s: float) -> None:
        self.last_kept = True
        self._steady = decodes
        self._wait_s = {-1: 0.0, +1: self.config.retry_s}   # kept: a later change may go either way
        self._changed_at_s = now_s
        self._window = _Window()

    def _back_off(self, direction: int, threads: int, now_s: float) -> None:
        self.last_kept = False
        self._wait_s[direction] = min(max(self._wait_s[direction], self.config.retry_s / 2) * 2,
                                      self.config.retry_max_s)
        self._set(threads, now_s)

    def _set(self, threads: int, now_s: float) -> None:
        self.threads = threads
        self._changed_at_s = now_s
        self._window = _Window()
