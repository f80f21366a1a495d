"""The event log's command line: look at, delete or expire users' logs."""
from __future__ import annotations

import argparse
import json

from backend_src.serving.event_log import open_event_log
from genrec_contract import protocol as P

_UINT64 = 1 << 64


def stored_keys(session_id) -> list:
    """Every key the session may be stored under: its key (protocol.session_key) and, for a negative
    integer id, the key of the unsigned form Triton hands the model (-5 as 2**64 - 5)."""
    key = P.session_key(session_id)
    sid = P.canonical_session_id(session_id)
    return [key, f"i:{sid + _UINT64}"] if isinstance(sid, int) and sid < 0 else [key]


def main(argv=None) -> int:
    """python -m backend_src.serving.event_log {show,delete,sweep} --log URL [--session ID | --session-string ID]

    delete erases a session's whole log (a data deletion request); servers drop their cached
    copy of it at the session's next request (its count no longer matches the log's)."""
    ap = argparse.ArgumentParser(prog="python -m backend_src.serving.event_log", description=main.__doc__.split("\n")[0])
    ap.add_argument("action", choices=["show", "delete", "sweep"])
    ap.add_argument("--log", required=True, help="the server's event log: a SQLite path or redis://host:port/db")
    ids = ap.add_mutually_exclusive_group()
    ids.add_argument("--session", help="session id: an integer id if it is an integer (e.g. -5), else a string id")
    ids.add_argument("--session-string", help="a string session id, also one that looks like an integer (\"42\")")
    ap.add_argument("--ttl-s", type=float, default=None, help="sweep: drop users with no event for this long")
    ap.add_argument("--events", type=int, default=20, help="show: the most recent events shown")
    a = ap.parse_args(argv)
    text = a.session if a.session is not None else a.session_string
    if a.action != "sweep" and not text:
        ap.error(f"{a.action} needs --session or --session-string")
    if text:
        sid = P.parse_session_id(text, string=a.session_string is not None)
        problem = P.session_id_problem(sid)
        if problem:
            ap.error(problem)
    with open_event_log(a.log, ttl_s=a.ttl_s) as log:
        if a.action == "show":
            tails = [log.tail(k, a.events) for k in stored_keys(sid)]
            t = next((t for t in tails if t.count), tails[0])
            print(json.dumps({"session": P.canonical_session_id(sid), "key": P.session_key(sid), "events": t.count,
                              "recent": list(zip(t.items, t.actions, t.timestamps))}))
        elif a.action == "delete":
            deleted = [log.delete(k) for k in stored_keys(sid)]  # every form, each whatever the others held
            print(json.dumps({"session": P.canonical_session_id(sid), "key": P.session_key(sid), "deleted": any(deleted)}))
        else:
            print(json.dumps({"swept_users": log.sweep()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
