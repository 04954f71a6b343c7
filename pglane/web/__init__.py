"""pglane web: the operator's page (``pglane web``, in the optional extra ``pglane[web]``).

Lanes with their next safe action, slots and consumers; jobs by lane, status and key; one job with
its attempts, result and next safe action; the last hour of each lane in charts; and, only when
started with ``--allow-actions`` and a token, retry, cancel, recover, resuming a paused lane and
ending stuck sessions behind a confirmation. ``app`` the routes, ``security`` the token, CSRF and
headers, ``queries`` its own statements, ``charts`` the charts' coordinates, ``server`` the command.
Importing this package needs the extra's libraries (Starlette, Jinja2, uvicorn); pglane itself does not.
"""

from .app import create_app

__all__ = ["create_app"]
