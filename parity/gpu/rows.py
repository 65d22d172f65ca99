"""Rows that survive: each measurement of a step (an implementation at one T and mode,
a batch, a launch) is one guarded call whose failure is recorded on its row only, and
the kit completes the rows a child never wrote (it crashed, or was killed at its cap).

Every row has `status`:
  ok           measured
  error        the call raised (`error` says what)
  not_warmed   fla would have autotuned inside the timing (parity/gpu/fla.py)
  not_reached  the step's cap came first
  absent       the implementation is not there (fla-core not installed)
"""

import time

STATUSES = ("ok", "error", "not_warmed", "not_reached", "absent")


def _status(e) -> str:
    from .fla import NotWarmed

    return "not_warmed" if isinstance(e, NotWarmed) else "error"


def failure(e) -> dict:
    """{status, error} of an exception."""
    return {"status": _status(e), "error": f"{type(e).__name__}: {str(e)[:300]}"}


def guarded(emit, kind, row, deadline, measure) -> dict:
    """Emit `row` updated with measure() ({field: value}) and status ok, or with the
    failure (or not_reached past `deadline`); the fields added."""
    if time.monotonic() > deadline:
        extra = {"status": "not_reached", "error": "not reached before the step's cap"}
    else:
        try:
            extra = dict(measure(), status="ok", error=None)
        except Exception as e:
            extra = failure(e)
    emit(kind, **row, **extra)
    return extra


def complete(expected, outcome, keys, kind="row") -> list:
    """`outcome`'s rows, plus a row for each of `expected` ([{field: value}]) it lacks
    (matched on `keys`), with the child's end as its status: not_reached when the child
    was killed at its cap, else error."""
    rows = list(outcome["rows"])
    have = {tuple(r.get(k) for k in keys) for r in rows if r.get("kind") == kind}
    status = "not_reached" if outcome["status"] == "timed_out" else "error"
    why = outcome.get("error") or "the child ended without measuring it"
    for row in expected:
        if tuple(row.get(k) for k in keys) not in have:
            rows.append(dict(row, kind=kind, status=status, error=f"child ended: {why}"[:400]))
    return rows
