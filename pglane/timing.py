"""Timing rules: the four timeouts that must agree (docs/design.md, "The four timeouts").

- the lane's ``job_timeout``: the handler's budget; past it the attempt is ``timed_out``;
- the lane's ``lease_timeout``: past it a still-connected holder is *stuck* (reported, never re-run);
- the worker's hard timeout (``pglane worker --timeout``): where it stops waiting for a handler that
  ignores cancellation, records the attempt ``timed_out`` and recycles its process;
- the process manager's stop grace period: how long a deploy waits after SIGTERM.

Rules: R1 job < lease (also a CHECK in the database); R2 job <= worker < lease; R3 stop grace >=
worker; S1, on a strict lane (takeover after_lease), lease >= worker + liveness. Breaking R2 lets a
lease run out while the worker still waits; breaking R3 lets a deploy cut a paid call off.
"""

from __future__ import annotations

from dataclasses import dataclass

# Seed numbers (seconds) for a lane created without options.
DEFAULT_JOB_TIMEOUT = 600.0


def default_lease_timeout(job_timeout: float) -> float:
    """The lease given to a lane when only its job timeout is chosen: 10 % (at least 1 s) longer."""
    return job_timeout + max(1.0, job_timeout * 0.1)


def default_worker_timeout(job_timeout: float, lease_timeout: float) -> float:
    """job_timeout plus a margin of up to 20 s that stays inside the lease (R2 holds by construction)."""
    return job_timeout + min(20.0, (lease_timeout - job_timeout) / 2)


@dataclass(frozen=True)
class Timeouts:
    job: float
    lease: float
    worker: float
    stop_grace: float | None = None
    liveness: float | None = None  # given for a strict lane only: the workers' liveness deadline

    def violations(self) -> list[str]:
        """Every broken rule, each named and explained; empty when the four numbers agree."""
        broken = []
        if not self.job < self.lease:
            broken.append(
                f"R1 job_timeout < lease_timeout: job_timeout {self.job:g}s is not below "
                f"lease_timeout {self.lease:g}s, so a running job could be handed to a second worker"
            )
        if not self.job <= self.worker:
            broken.append(
                f"R2 job_timeout <= worker timeout: worker timeout {self.worker:g}s is below "
                f"job_timeout {self.job:g}s, so handlers would be cut off before their budget"
            )
        if not self.worker < self.lease:
            broken.append(
                f"R2 worker timeout < lease_timeout: worker timeout {self.worker:g}s is not below "
                f"lease_timeout {self.lease:g}s, so a hung handler would outlive its lease"
            )
        if self.stop_grace is not None and not self.stop_grace >= self.worker:
            broken.append(
                f"R3 stop grace >= worker timeout: stop grace {self.stop_grace:g}s is below the "
                f"worker timeout {self.worker:g}s, so a deploy could cut a paid call off"
            )
        if self.liveness is not None and not self.lease >= self.worker + self.liveness:
            broken.append(
                f"S1 strict lane: lease_timeout >= worker timeout + liveness: lease {self.lease:g}s is below "
                f"{self.worker:g}s + {self.liveness:g}s, so a takeover could wait less than a cut-off worker "
                f"needs to notice it is cut off and stop; raise --lease-timeout"
            )
        return broken


def parse_duration(text: str) -> float:
    """Seconds from '90', '90s', '15m', '1h30m', '7d' (pglane.durations, the one parser); ValueError
    that says what is accepted."""
    from .durations import parse

    return parse(text, allow_zero=True)
