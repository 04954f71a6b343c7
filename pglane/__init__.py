"""pglane: a PostgreSQL-native job queue for scarce, expensive work.

A lane is a scarce capability with a fixed number of consumer slots cluster-wide (one by default),
held by session advisory locks. Claims and completions are stored SQL functions; recovery is
authorized by evidence from the database, never by a timer. See README.md and DESIGN.md.
"""

from .client import (
    attempts,
    cancel,
    connect,
    create_lane,
    enqueue,
    job_status,
    jobs,
    lane_status,
    prune,
    recover,
    result,
    retry,
)
from .errors import (
    ConfigurationError,
    DatabaseUnavailable,
    IdempotencyConflict,
    InsufficientPrivilege,
    InvalidIdempotencyKey,
    InvalidInput,
    InvalidLane,
    InvalidPayload,
    InvalidTransition,
    LaneFull,
    NoSlotHeld,
    NotTheClaimer,
    PayloadTooLarge,
    PermissionDenied,
    PglaneError,
    SchemaError,
    SlotLost,
    UnknownJob,
    UnknownLane,
)
from .job import Job
from .schema import downgrade, upgrade
from .worker import Worker, WorkerOptions

__all__ = [
    "ConfigurationError",
    "DatabaseUnavailable",
    "IdempotencyConflict",
    "InsufficientPrivilege",
    "InvalidIdempotencyKey",
    "InvalidInput",
    "InvalidLane",
    "InvalidPayload",
    "InvalidTransition",
    "Job",
    "LaneFull",
    "NoSlotHeld",
    "NotTheClaimer",
    "PayloadTooLarge",
    "PermissionDenied",
    "PglaneError",
    "SchemaError",
    "SlotLost",
    "UnknownJob",
    "UnknownLane",
    "Worker",
    "WorkerOptions",
    "attempts",
    "cancel",
    "connect",
    "create_lane",
    "downgrade",
    "enqueue",
    "job_status",
    "jobs",
    "lane_status",
    "prune",
    "recover",
    "result",
    "retry",
    "upgrade",
]
