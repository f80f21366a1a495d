"""Command line for the served recommender; every command prints JSON.

    python -m clients.cli --url localhost:8001 open --session u1 --items 1 2 3 [--actions 5 4 5] [--timestamps ...]
    python -m clients.cli append --session u1 --items 4 [--timestamps ...] [--top-k 5]
    python -m clients.cli recommend --session u1 [--top-k 5 --beam-width 50 --mode pfa]
    python -m clients.cli close --session u1
    python -m clients.cli health
    python -m clients.cli catalog add --file items.jsonl [--replace]     (one JSON object a line: {"id", "text" | "attributes" | "vector"})
    python -m clients.cli catalog add --id sku-9 --text "a new serum"
    python -m clients.cli catalog retire --ids sku-1 sku-2
    python -m clients.cli catalog list [--offset 0 --limit 100 --status live]
    python -m clients.cli catalog show --ids sku-9
    (catalog requests carry the server's admin key: GENREC_ADMIN_KEY, or the file --admin-key-file names,
    default runs/admin.key)

`--session` that is an integer (e.g. 42 or -5) is an integer id, anything else a string id (at most
128 bytes in UTF-8, no NUL); `--session-string 42` is the string id "42". Sessions live on the
server (its event log), so separate invocations continue one session; `close` ends the visit and
keeps the session.
Exit status: 0 ok, 1 refused request (the JSON names the gRPC status and the server's message),
2 the server holds no events for the session (open it with the user's history), 3 server or
models not ready.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from clients.client import RecommenderClient, RecommenderError, SessionLost
from genrec_contract.protocol import parse_session_id


def _add_session(p: argparse.ArgumentParser) -> None:
    ids = p.add_mutually_exclusive_group(required=True)
    ids.add_argument("--session", dest="session", type=parse_session_id,
                     help="session id: an integer id if it is an integer, else a string id")
    ids.add_argument("--session-string", dest="session", help="a string session id, also one that looks like an integer")


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--exclude-seen", action="store_true", default=None,
                   help="leave out items already in the session's history")
    p.add_argument("--beam-width", type=int, default=None)
    p.add_argument("--mode", default=None, help="full | pfa | pfa_per_beam | dynamic_topk")
    p.add_argument("--pfa-k", type=int, default=None)
    p.add_argument("--pfa-r", type=float, default=None)
    p.add_argument("--selection-step", type=int, default=None)


def _add_events(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--items", nargs="+" if required else "*", required=required, default=[], help="raw item ids, oldest first")
    p.add_argument("--actions", nargs="*", type=int, default=None, help="action id per event (default 0 = none)")
    p.add_argument("--timestamps", nargs="*", type=int, default=None, help="seconds per event (default: now)")


def _options(a) -> dict:
    return {
        k: getattr(a, k)
        for k in ("top_k", "exclude_seen", "beam_width", "mode", "pfa_k", "pfa_r", "selection_step")
        if getattr(a, k, None) is not None
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m clients.cli", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="localhost:8001", help="gRPC address of the server")
    ap.add_argument("--model", default="recommend")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, help_, events in (
        ("open", "start a session with the user's history", "required"),
        ("append", "add events to a session and get recommendations", "optional"),
        ("recommend", "recommendations for a session's current history", None),
    ):
        p = sub.add_parser(name, help=help_)
        _add_session(p)
        if events:
            _add_events(p, required=events == "required")
        _add_options(p)
    p = sub.add_parser("close", help="end the visit (the server keeps the session for the next one)")
    _add_session(p)
    sub.add_parser("health", help="server and model readiness, versions")
    p = sub.add_parser("catalog", help="add, retire, list or show items while the server serves (the admin key)")
    p.add_argument("operation", choices=("add", "retire", "list", "show"))
    p.add_argument("--file", help="add: a JSON-lines file, one item a line")
    p.add_argument("--id", help="add: one item's id (with --text and/or --attributes)")
    p.add_argument("--text")
    p.add_argument("--attributes", nargs="*")
    p.add_argument("--replace", action="store_true", help="add: change the content of items already added")
    p.add_argument("--ids", nargs="+", help="retire / show: item ids")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--status", choices=("live", "retired"))
    p.add_argument("--admin-key-file", default=None, help="the server's admin key file (default: GENREC_ADMIN_KEY, "
                                                          "else runs/admin.key)")
    return ap


def admin_key(path=None) -> str | None:
    """The server's admin key: the file `path` names, else GENREC_ADMIN_KEY, else runs/admin.key."""
    if path is None and os.environ.get("GENREC_ADMIN_KEY"):
        return os.environ["GENREC_ADMIN_KEY"].strip()
    try:
        return Path(path or "runs/admin.key").read_text().strip() or None
    except FileNotFoundError:
        return None


def catalog(client: RecommenderClient, a) -> dict:
    if a.operation == "add":
        if a.file:
            items = [json.loads(line) for line in Path(a.file).read_text().splitlines() if line.strip()]
        elif a.id:
            items = [{"id": a.id, **({"text": a.text} if a.text else {}), **({"attributes": a.attributes} if a.attributes else {})}]
        else:
            raise ValueError("catalog add needs --file or --id")
        return client.catalog_add(items, replace=a.replace)
    if a.operation in ("retire", "show"):
        if not a.ids:
            raise ValueError(f"catalog {a.operation} needs --ids")
        return client.catalog_retire(a.ids) if a.operation == "retire" else client.catalog_show(a.ids)
    return client.catalog_list(a.offset, a.limit, a.status)


def run(a) -> tuple[int, dict]:
    key = admin_key(a.admin_key_file) if a.command == "catalog" else None
    client = RecommenderClient(a.url, model=a.model, timeout_s=a.timeout, admin_key=key)
    try:
        if a.command == "health":
            h = client.health()
            return (0 if h.get("ready") else 3), h
        if a.command == "catalog":
            try:
                return 0, catalog(client, a)
            except RecommenderError as e:
                return 1, {"error": "request_refused", "status": e.status, "message": e.message}
            except (ValueError, OSError) as e:
                return 1, {"error": "bad_arguments", "message": str(e)}
        try:
            if a.command == "open":
                rec = client.open_session(a.session, a.items, a.actions, a.timestamps, **_options(a))
            elif a.command == "append":
                rec = client.append(a.session, a.items, a.actions, a.timestamps, **_options(a))
            elif a.command == "recommend":
                rec = client.recommend(a.session, **_options(a))
            else:
                closed = client.close_session(a.session)
                return 0, {"session": a.session, "closed": closed, **({} if closed else {"note": "the server holds no events for this session"})}
        except SessionLost as e:
            return 2, {"session": a.session, "error": "session_lost", "status": e.status, "message": e.message}
        except RecommenderError as e:
            return 1, {"session": a.session, "error": "request_refused", "status": e.status, "message": e.message}
        except ValueError as e:  # bad arguments caught before sending
            return 1, {"session": a.session, "error": "bad_arguments", "message": str(e)}
        return 0, {"session": a.session, **rec.to_dict()}
    finally:
        client.close()


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    code, out = run(a)
    print(json.dumps(out, indent=2, default=float))
    return code


if __name__ == "__main__":
    sys.exit(main())
