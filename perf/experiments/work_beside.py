"""Does work on the other core slow this one down? An open of 512 events writes them to the durable log on the
encoder's second thread while its first encodes them, counting on the two cores to run both at once. Here one
process times the encode of 512 events (the benchmark model, one torch thread):
  - alone;
  - beside the log write of an open (512 events into a SQLite log, synchronous=FULL), on a second thread;
  - beside about 1.5 ms of pure Python on a second thread (it holds the GIL throughout);
  - beside about a millisecond of hashing on a second thread (no GIL held: hashlib lets it go);
  - beside the same hashing in another process (no GIL shared at all).
and the write, the Python and the hashing alone. Conditions alternate repetition by repetition, so drift of the
host cancels. Run from the repository root (needs the benchmark model, `make bench-served` trains it):
    python -m perf.experiments.work_beside            # -> perf/results/work_beside.json
    python -m perf.experiments.work_beside --quick --out -
"""
import hashlib
import multiprocessing as mp
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from perf.common import host_load, log, save_result
from perf.experiments import bench_model_parser

HASHED = b"x" * 400_000  # about 0.3 ms of sha256 on this host
HASHES = 3
PYTHON_STEPS = 30_000  # about 1.5 ms of the interpreter on this host


def hash_work() -> None:
    for _ in range(HASHES):
        hashlib.sha256(HASHED).digest()


def python_work() -> None:
    sum(i * i for i in range(PYTHON_STEPS))


def hash_server(conn) -> None:
    while conn.recv():
        hash_work()
        conn.send(True)


def main(argv=None):
    ap = bench_model_parser(__doc__, "work_beside.json")
    ap.add_argument("--history", type=int, default=512)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)

    from perf.served import long_history, same_runtime_as_the_server

    same_runtime_as_the_server(argv, module="perf.experiments.work_beside")
    import torch

    from backend_src.data import load_dataset
    from backend_src.model.recommender import GenerativeRecommender
    from backend_src.serving.event_log import open_event_log

    torch.set_num_threads(1)
    reps = 10 if args.quick else args.reps
    load_start = host_load()
    model = GenerativeRecommender.load(args.checkpoint).eval()
    model.backbone.warm_up()
    items, actions, timestamps = long_history(load_dataset(args.data, max_users=args.max_users), args.history)
    actions, timestamps = np.asarray(actions, np.int64), np.asarray(timestamps, np.int64)  # as the encoder writes them
    n = len(items)
    events = [torch.as_tensor(x, dtype=torch.long)[None] for x in (model.item_indices(items), actions, timestamps)]

    def encode():
        with torch.inference_mode():
            model.encode(*events, torch.tensor([n]))

    with tempfile.TemporaryDirectory(prefix="genrec-beside-") as tmp:
        event_log = open_event_log(str(Path(tmp) / "events.sqlite3"), retain_events=max(n, 4096))
        users = iter(range(1 << 30))

        def write():
            event_log.append(f"u:{next(users)}", 0, items, actions, timestamps)

        thread = ThreadPoolExecutor(max_workers=1)
        parent, child = mp.Pipe()
        helper = mp.Process(target=hash_server, args=(child,), daemon=True)
        helper.start()

        def beside(start, wait, work=encode):
            t0 = time.perf_counter()
            pending = start()
            work()
            took = time.perf_counter() - t0
            wait(pending)
            return took

        def start_helper():
            parent.send(True)

        conditions = {
            "encode alone": lambda: beside(lambda: None, lambda _: None),
            "encode beside the log write (thread)": lambda: beside(lambda: thread.submit(write), lambda f: f.result()),
            "encode beside Python (thread)": lambda: beside(lambda: thread.submit(python_work), lambda f: f.result()),
            "encode beside hashing (thread)": lambda: beside(lambda: thread.submit(hash_work), lambda f: f.result()),
            "encode beside hashing (process)": lambda: beside(start_helper, lambda _: parent.recv()),
            "log write alone": lambda: beside(lambda: None, lambda _: None, work=write),
            "Python alone": lambda: beside(lambda: None, lambda _: None, work=python_work),
            "hashing alone": lambda: beside(lambda: None, lambda _: None, work=hash_work),
        }
        times = {name: [] for name in conditions}
        for i in range(reps + 10):
            for name, run in conditions.items():
                took = run()
                if i >= 10:  # the first rounds warm up
                    times[name].append(took)
        parent.send(False)
        helper.join(5)
        thread.shutdown()
        event_log.close()
    base = statistics.median(times["encode alone"])
    rows = []
    for name, t in times.items():
        p50 = statistics.median(t)
        rows.append(dict(condition=name, history=n, reps=reps, p50_ms=p50 * 1e3, ratio_to_encode_alone=p50 / base))
        log(f"{name:50s} {p50 * 1e3:6.2f} ms p50 ({p50 / base:.2f}x the encode alone)")
    if args.out != "-":
        save_result(Path(args.out), rows, "perf.experiments.work_beside", argv, load_start,
                    checkpoint=str(args.checkpoint), data=args.data, torch_threads=1)


if __name__ == "__main__":
    main()
