"""The event log's command line: look at, delete or expire users' logs."""
from __future__ import annotations

import argparse
import json

from backend_src.serving.event_log import open_event_log


def main(argv=None) -> int:
    """python -m backend_src.serving.event_log {show,delete,sweep} --log URL [--session ID] [--ttl-s S]

    delete erases a session's whole log (a data deletion request); servers drop their cached
    copy of it at the session's next request (its count no longer matches the log's)."""
    from genrec_contract.protocol import session_key

    ap = argparse.ArgumentParser(prog="python -m backend_src.serving.event_log", description=main.__doc__.split("\n")[0])
    ap.add_argument("action", choices=["show", "delete", "sweep"])
    ap.add_argument("--log", required=True, help="the server's event log: a SQLite path or redis://host:port/db")
    ap.add_argument("--session", help="session id (digits: an integer id)")
    ap.add_argument("--ttl-s", type=float, default=None, help="sweep: drop users with no event for this long")
    ap.add_argument("--events", type=int, default=20, help="show: the most recent events shown")
    a = ap.parse_args(argv)
    if a.action != "sweep" and not a.session:
        ap.error(f"{a.action} needs --session")
    key = session_key(int(a.session) if a.session and a.session.lstrip("-").isdigit() else a.session)
    with open_event_log(a.log, ttl_s=a.ttl_s) as log:
        if a.action == "show":
            t = log.tail(key, a.events)
            print(json.dumps({"session": a.session, "events": t.count, "recent": list(zip(t.items, t.actions, t.timestamps))}))
        elif a.action == "delete":
            print(json.dumps({"session": a.session, "deleted": log.delete(key)}))
        else:
            print(json.dumps({"swept_users": log.sweep()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
