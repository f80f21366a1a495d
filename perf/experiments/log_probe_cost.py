"""What the watchdog's probe of the event log costs the served path: one-event appends to a SQLite log on
disk (the encoder's durable write, fsync included), timed back to back with a 5 ms pause, without and with a
probe (serving/log_probe.py: one write and one read of its reserved key every 2 s) in another process, as the
watchdog runs it. Conditions alternate in rounds, so drift of the host shows as a difference between rounds.
Run from the repository root:
    python -m perf.experiments.log_probe_cost            # -> perf/results/log_probe_cost.json
    python -m perf.experiments.log_probe_cost --quick --out -
"""
import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

from perf.common import host_load, log, save_result


def _probe(path: str, stop) -> None:
    from backend_src.serving.log_probe import LogProbe

    LogProbe(lambda: path, 2.0).start()
    stop.wait()


def appends(path: str, probe: bool, seconds: float) -> dict:
    from backend_src.serving.event_log import open_event_log

    stop = mp.Event()
    prober = mp.Process(target=_probe, args=(path, stop)) if probe else None
    if prober is not None:
        prober.start()
        time.sleep(1.0)
    lat = []
    with open_event_log(path) as event_log:
        n = event_log.count("s:bench")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            n = event_log.append("s:bench", n, ["1"], [0], [1])
            lat.append((time.perf_counter() - t) * 1e3)
            time.sleep(0.005)
    stop.set()
    if prober is not None:
        prober.join()
    lat.sort()
    return {"probe": probe, "appends": len(lat), "p50_ms": round(statistics.median(lat), 3),
            "p99_ms": round(lat[int(0.99 * len(lat))], 3), "max_ms": round(lat[-1], 3)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="per condition and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="perf/results/log_probe_cost.json", help="'-' prints only")
    a = ap.parse_args(argv)
    seconds, rounds = (2.0, 1) if a.quick else (a.seconds, a.rounds)
    load_start = host_load()
    rows = []
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:  # on disk: /tmp may be memory
        path = str(Path(d) / "events.sqlite3")
        for r in range(rounds):
            for probe in (False, True):
                row = {"round": r, **appends(path, probe, seconds)}
                log(str(row))
                rows.append(row)
    if a.out != "-":
        save_result(Path(a.out), rows, "perf.experiments.log_probe_cost", sys.argv[1:] if argv is None else argv,
                    load_start, probe_interval_s=2.0, pause_between_appends_s=0.005)


if __name__ == "__main__":
    main()
