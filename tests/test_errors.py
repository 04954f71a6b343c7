"""The error tree owns its SQLSTATEs: every code the SQL raises has exactly one class, which declares it.
No database is involved here (tests/test_enqueue.py and tests/test_claim.py see translate() at work)."""

from __future__ import annotations

import re

import pglane
from pglane import errors
from tests.conftest import ROOT


def raised_codes() -> set[str]:
    """Every pglane SQLSTATE that the functions in sql/ or a migration raise."""
    sources = [*ROOT.joinpath("sql").glob("*.sql"), *ROOT.joinpath("alembic", "versions").glob("*.py")]
    return {code for path in sources for code in re.findall(r"ERRCODE = '(PGL\d\d)'", path.read_text())}


def test_every_code_the_sql_raises_has_its_own_error_class() -> None:
    assert raised_codes() <= set(errors.SQLSTATES)
    for code, cls in errors.SQLSTATES.items():
        assert cls.sqlstate == code and issubclass(cls, pglane.PglaneError)


def test_a_class_that_declares_no_code_has_none_rather_than_its_parents() -> None:
    assert errors.InvalidInput.sqlstate == "PGL10"
    assert errors.InvalidLane.sqlstate is None  # refused by a CHECK, not by a code of its own
    assert errors.SlotLost.sqlstate is None and issubclass(errors.SlotLost, errors.NoSlotHeld)


def test_a_migrating_role_without_createrole_meets_a_schema_error() -> None:
    assert errors.SQLSTATES["PGL11"] is errors.InsufficientPrivilege
    assert issubclass(errors.InsufficientPrivilege, errors.SchemaError)
