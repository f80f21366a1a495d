"""Roll a new version out to a running local cluster, replica by replica, or roll it back.

    python -m export.rollout publish --checkpoint ckpt.pt [--dir runs/cluster]
    python -m export.rollout rollback [--dir runs/cluster]

The cluster (``python -m backend_src.serving.cluster start``) serves one model repository from
every replica. The new version is written into that repository once (``export.publish``), then
loaded on one replica after another, so the others keep serving while one swaps. The
repository, the replicas and the admin key come from the state the cluster's ``start`` left in
``--dir``; a new version keeps the serving options of the version serving now.
"""
from __future__ import annotations

import argparse
import sys

from backend_src.serving.access import read_admin_key
from backend_src.serving.cluster import DEFAULT_DIR, read_state
from export import publish as pub


def cluster_target(workdir) -> tuple:
    """(repository, the replicas' gRPC addresses, admin key) of the cluster running from `workdir`."""
    state = read_state(workdir)
    if state is None:
        raise FileNotFoundError(f"no cluster running from {workdir} (no state file)")
    return state["repository"], [r["grpc"] for r in state["replicas"]], read_admin_key(state["admin_key_file"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m export.rollout", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["publish", "rollback"])
    ap.add_argument("--checkpoint", help="publish: the checkpoint of the new version")
    ap.add_argument("--dir", default=str(DEFAULT_DIR), help="the cluster's folder (its state and admin key)")
    ap.add_argument("--no-ranker-export", action="store_true", help="publish: serve the ranker in torch (no ONNX/TensorRT export)")
    a = ap.parse_args(argv)
    if a.action == "publish" and not a.checkpoint:
        ap.error("publish needs --checkpoint")
    try:
        repository, servers, key = cluster_target(a.dir)
    except FileNotFoundError as e:
        print(str(e), file=sys.stderr)
        return 3
    if a.action == "publish":
        done = pub.publish(a.checkpoint, repository, pub.current_options(repository), server=servers, admin_key=key,
                           export_ranker=not a.no_ranker_export)
        print("published " + ", ".join(f"{m} v{v}" for m, v in done.items()) + f" on {len(servers)} replicas")
    else:
        plan = pub.rollback(repository, server=servers, admin_key=key)
        print("rolled back " + ", ".join(f"{m} v{old} -> v{new}" for m, (old, new) in plan.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
