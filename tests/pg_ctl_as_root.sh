#!/bin/sh
# pytest-postgresql runs this as its pg_ctl when the tests run as root (see tests/conftest.py):
# PostgreSQL refuses euid 0, so pg_ctl (and the postgres it starts) run in a user namespace as nobody.
exec "$PGLANE_PYTHON" -m pglane.userns "$PGLANE_REAL_PG_CTL" "$@"
