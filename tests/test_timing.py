"""The worker's default hard timeout: the job timeout plus a margin of up to 20 s, inside the lease
(docs/design.md, "The four timeouts"; rule R2 holds by construction)."""

from __future__ import annotations

import pytest

from pglane import timing


@pytest.mark.parametrize(("job", "lease", "worker"), [
    (600, 660, 620),  # the seed numbers: 20 s of margin
    (3600, 7200, 3620),  # a long lease: the margin stays 20 s
    (1, 2, 1.5),  # a short lease: half of what is left of it
])
def test_the_default_worker_timeout_is_the_job_timeout_plus_up_to_20_s_inside_the_lease(
    job: float, lease: float, worker: float
) -> None:
    assert timing.default_worker_timeout(job, lease) == worker
    assert not timing.Timeouts(job=job, lease=lease, worker=worker).violations()
