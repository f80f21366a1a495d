"""history_encoder: the HSTU backbone over each user session's history.

A user's state has three lifetimes, kept apart:
- a *visit* is one Triton sequence (START ... END): the sequence batcher sends its requests to
  this instance in order, and its slot is held only while the visit lasts;
- the *cache* is the session's HistoryCache (per-layer K/V and final states) in this instance's
  bounded LRU store, keyed by the session id; it outlives the visit, and a later request encodes
  only its appended events (causal HSTU, so appending equals re-encoding);
- the *log* holds every accepted event (the durable event log), written before the response.
  When a session is not in the cache (evicted, a new version, a restarted stub or server, or
  another instance or replica appended since), its history is rebuilt from the log with the
  version now serving, and RESTORED says so.

Exactly once: EVENTS_BEFORE is the number of events the client sent before this request. Only
events past the log's count are applied, so a retried request is answered from the state it
already made; a gap is refused with the count the server has. Without EVENTS_BEFORE the events
go after whatever the log holds, and START with events starts the history afresh.

A history that would exceed max_history keeps its most recent max_history events: they are
re-encoded and the number dropped is returned in TRUNCATED. Requests of different sessions in
one call are encoded in one batched forward/append and logged in one write. A refused request
changes nothing, END included.
"""
from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch

from backend_src.model.hstu import HistoryCache
from backend_src.model.recommender import GenerativeRecommender
from backend_src.serving import validation as V
from backend_src.serving.event_log import (
    WRITE_ASIDE_EVENTS, EventLogDamaged, LogConflict, open_event_log, served_log_url,
)
from backend_src.serving.session_store import DEFAULT_PREFAULT_BYTES, Session, SessionStore, prefault_heap
from backend_src.serving.stages.catalog_sync import CatalogSync
from backend_src.serving.stages.messages import END, INTERNAL, START, StageRequest, StageResponse, as_array
from backend_src.serving.stages.session_metrics import SessionMetrics
from genrec_contract import protocol as P

LOG_SWEEP_INTERVAL_S = 600.0


def event_log_url(params: Mapping, model_dir: Path) -> str:
    """GENREC_EVENT_LOG (the server's setting) > the config's event_log > a SQLite file beside
    the model repository (nothing to start): event_log.served_log_url, which the watchdog's probe reads too."""
    return served_log_url(params, Path(model_dir).resolve().parent)


class _Request:
    """One parsed request: nothing looked up in the log or the cache yet."""

    def __init__(self, index, key, start, end, offset, ids, actions, timestamps):
        self.index, self.key, self.start, self.end, self.offset = index, key, start, end, offset
        self.ids, self.actions, self.timestamps = ids, actions, timestamps  # the request's events (numpy)


class _Plan:
    """What one valid request does."""

    def __init__(self, req, logged):
        self.index, self.key, self.end = req.index, req.key, req.end
        self.logged = logged  # events in the log before this request
        self.offset = None  # the position of the request's first event (EVENTS_BEFORE, or the log's count)
        self.claimed = None  # (raw ids, actions, timestamps) of its events at positions the log already holds
        self.reset = False  # START without EVENTS_BEFORE: the history starts afresh
        self.session = None  # the cached session, when it is current
        self.restored = False  # the base history comes from the log
        self.new = None  # (raw ids, actions, timestamps) of the events this request applies
        self.base = None  # (items, actions, timestamps) tensors of the history before them
        self.items = self.actions = self.timestamps = None  # events to encode (new, or the whole kept history)
        self.reencode, self.truncated = False, 0
        self.cache = None
        self.count = logged  # events in the log after this request
        self.history = None  # (items, actions, timestamps) of the history rows once encoded

    @property
    def unchanged(self) -> bool:
        """A recommend on the cached history: nothing to encode, log or cache."""
        return self.session is not None and not self.reencode and self.items.shape[0] == 0


class EncoderStage:
    """The history encoder of the version in `version_dir` (its encoder.pt), configured by the model
    config's `params`; `make_metric` (stub.metric_maker) shows its numbers on Triton's /metrics."""

    def __init__(self, version_dir: Path, params: Mapping, make_metric: Callable | None = None):
        version_dir = Path(version_dir)
        self.model = GenerativeRecommender.load(version_dir / "encoder.pt")  # the backbone and the item ids only
        self.device = "cuda" if torch.cuda.is_available() else "cpu"  # sessions live where the model runs
        self.model.to(self.device)
        self.model.backbone.warm_up()
        self.catalog = CatalogSync(self.model, params, version_dir, P.ENCODER)  # items added since training
        cfg = self.model.cfg
        self.sizes = P.model_sizes(cfg)
        self.max_history = min(int(params.get("max_history", cfg.max_seq_len)), cfg.max_seq_len)
        self.limits = V.Limits(
            max_history=self.max_history,
            num_actions=cfg.num_actions,
            num_codes=cfg.num_codes,
            max_request_events=int(params.get("max_request_events", 100_000)),
            max_top_k=int(params.get("max_top_k", 256)),
            max_beam_width=int(params.get("max_beam_width", 1024)),
        )
        self.defaults = V.decode_defaults(params)
        self.default_top_k = int(params.get("top_k", 10))
        self.store = SessionStore(
            max_bytes=int(params.get("session_max_bytes", 2 << 30)),
            idle_timeout_s=float(params.get("cache_idle_s", 3600)),
        )
        if self.device == "cpu":  # the first sessions' pages mapped now, not on their requests
            prefault_heap(min(int(params.get("session_prefault_bytes", DEFAULT_PREFAULT_BYTES)), self.store.max_bytes))
        self.max_elements = max(self.limits.max_request_events, 1)
        ttl = float(params.get("log_ttl_s", 0))
        self.log = open_event_log(
            event_log_url(params, version_dir.parent),
            retain_events=max(int(params.get("log_retain_events", 4096)), self.max_history),
            ttl_s=ttl if ttl > 0 else None,
            durability=params.get("log_durability", "full"),
        )
        self.write_aside_events = WRITE_ASIDE_EVENTS
        self.metrics = SessionMetrics(make_metric, self.store.max_bytes)
        # long durable writes run on their own thread while this one encodes (see _encode_and_log)
        self._log_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="event-log-write")
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_log, daemon=True, name="event-log-retention")
        self._sweeper.start()

    def _sweep_log(self) -> None:
        while not self._stop.wait(LOG_SWEEP_INTERVAL_S):
            try:
                self.log.sweep()
            except Exception as e:  # noqa: BLE001 - retention retries at the next interval
                print(f"{P.ENCODER}: event log retention sweep failed: {e}", file=sys.stderr)

    # ---- one request -> parsed request (all checks that need neither log nor cache) ---------
    @staticmethod
    def _flag(request: StageRequest, name: str, bit: int) -> bool:
        t = request.inputs.get(name)
        if t is not None:
            return bool(np.asarray(as_array(t)).reshape(-1)[0])
        return bool(request.flags & bit)

    def _parse(self, index: int, request: StageRequest) -> _Request:
        cid = request.correlation_id
        if cid == 0 or cid == "":
            raise V.RequestError(f"{P.ENCODER} needs a sequence id (one per user session)")
        inputs = request.inputs
        start = self._flag(request, P.CONTROL_START, START)
        end = self._flag(request, P.CONTROL_END, END)
        read = lambda spec: V.read_input(inputs, spec, self.sizes, self.max_elements)  # noqa: E731
        raw = read(P.ITEM_IDS)
        actions = read(P.ACTIONS).reshape(-1).astype(np.int64)
        timestamps = read(P.TIMESTAMPS).reshape(-1).astype(np.int64)
        offset = read(P.EVENTS_BEFORE)
        if offset is not None:
            offset = int(V._one(offset, P.EVENTS_BEFORE.name))
            if offset < 0:
                raise V.RequestError(f"EVENTS_BEFORE must be >= 0, got {offset}")
        options = {spec.name: read(spec) for spec in P.OPTION_INPUTS}
        V.parse_options(options, self.defaults, self.default_top_k, self.limits)  # refuse bad options before any change
        ids = V.decode_strings(raw, P.ITEM_IDS.name)
        V.check_item_ids(ids, P.ITEM_IDS.name)
        # the request's own events: counts, action ids, time order within the request
        V.check_events(len(ids), actions, timestamps, self.limits, start=False, session_last_timestamp=None)
        return _Request(index, P.session_key(cid), start, end, offset, ids, actions, timestamps)

    # ---- parsed request + the log's count -> plan ---------------------------------------------
    def _plan(self, req: _Request, logged: int) -> _Plan:
        plan = _Plan(req, logged)
        n = len(req.ids)
        session = self.store.get(req.key)
        if session is not None and session.count != logged:  # another writer appended since: rebuild
            self.store.discard(req.key)
            session = None
        if req.start and req.offset is None and n > 0:
            plan.reset, skip = True, 0
        else:
            offset = logged if req.offset is None else req.offset
            if offset > logged:
                raise V.RequestError(
                    f"session {req.key[2:]!r}: EVENTS_BEFORE is {offset} but the server holds {logged} events of it; "
                    f"send the events from event {logged} on",
                    P.FAILED_PRECONDITION,
                )
            skip = min(logged - offset, n)  # events at positions the log holds: a retry's, or another writer's
            plan.offset = offset
            if skip:  # told apart by _compare_claimed
                plan.claimed = (req.ids[:skip], req.actions[:skip], req.timestamps[:skip])
            if logged == 0 and n == skip:
                raise V.RequestError(
                    f"session {req.key[2:]!r} has no events on this server: open it with the user's history", P.NOT_FOUND
                )
        plan.new = (req.ids[skip:], req.actions[skip:], req.timestamps[skip:])
        if not plan.reset:
            plan.session = session
            plan.restored = session is None and logged > 0
        return plan

    def _compare_claimed(self, plans, errors: dict) -> list:
        """Plans whose first events claim positions the log already holds: the events logged there are
        read (one log call for all) and compared with them. The same events (raw item id, action,
        timestamp): a retry, applied once. Different: another writer's events hold those positions, and
        the request is refused (ABORTED) saying what to re-send after the session's count. Returns the
        plans that go on; a request without such positions (the common case) reads nothing more."""
        claimed = [p for p in plans if p.claimed is not None]
        if not claimed:
            return plans
        try:
            held = self.log.event_ranges([(p.key, p.offset, p.offset + len(p.claimed[0])) for p in claimed])
        except Exception as e:  # noqa: BLE001 - no log, no change
            errors.update({p.index: self._log_unavailable(e) for p in claimed})
            return [p for p in plans if p.claimed is None]
        for p, logged in zip(claimed, held):
            try:
                self._check_claimed(p, logged)
            except V.RequestError as e:
                errors[p.index] = e
        return [p for p in plans if p.index not in errors]

    def _check_claimed(self, p: _Plan, held) -> None:
        name, n = p.key[2:], len(p.claimed[0])
        first, last = p.offset, p.offset + n - 1
        if held.count != p.logged:  # another request appended since the count was read: plan again
            raise V.RequestError(
                f"session {name!r}: another request appended to it at the same time (the server now holds "
                f"{held.count} events); retry with EVENTS_BEFORE",
                P.UNAVAILABLE,
            )
        if not held.items:  # nothing left to compare with: refused, neither dropped nor doubled
            raise V.RequestError(
                f"session {name!r}: events {first}..{last} are older than the {self.log.retain_events} the log keeps, "
                f"so this request's events there cannot be told from another writer's; the server holds {p.logged} "
                f"events: send only the events after them",
                P.FAILED_PRECONDITION,
            )
        lo = held.start - first  # positions older than the log keeps are taken as the same events
        ids, actions, timestamps = (x[lo:lo + len(held.items)] for x in p.claimed)
        mine = zip(ids, actions.tolist(), timestamps.tolist())
        differ = next((i for i, (a, b) in enumerate(zip(mine, zip(held.items, held.actions, held.timestamps))) if a != b), None)
        if differ is None:  # a retry
            self.metrics.count("replayed", n)
            return
        skip = lo + differ  # the request's events before this one are the very events held at their positions
        raise V.RequestError(
            f"session {name!r}: events {first + skip}..{last} are held and differ from this request's (another "
            f"writer's); the server holds {p.logged} events; " + P.resend_after(skip, p.logged),
            P.ABORTED,
        )

    def _set_base(self, plan: _Plan, tail) -> None:
        """The history before this request's events: the cached session's, or the log's tail (an
        item this version does not know is encoded as the unknown item: its position, action and
        time still count)."""
        if plan.session is not None:
            s = plan.session
            plan.base = (s.items, s.actions, s.timestamps)
            if not len(plan.new[0]):  # a recommend on the cached history: nothing to check or look up
                plan.items = plan.actions = plan.timestamps = s.items[:0]
                return
        elif plan.restored:
            items = self.model.item_indices(tail.items, strict=False)
            actions, timestamps = (np.asarray(x, dtype=np.int64) for x in (tail.actions, tail.timestamps))
            if timestamps.size:  # another writer's late events are logged as given (below): encoded at the time before them
                timestamps = np.maximum.accumulate(timestamps)
            plan.base = tuple(torch.from_numpy(x) for x in (items, actions, timestamps))
        else:  # a new session, or one that starts afresh
            empty = torch.zeros(0, dtype=torch.long)
            plan.base = (empty, empty, empty)
        ids, actions, timestamps = plan.new
        last = int(plan.base[2][-1]) if plan.base[2].numel() else None
        if last is not None and len(timestamps) and timestamps[0] < last:
            # a second writer's clock may be behind the session's last event: its events are logged as given
            # and encoded at that last time (their own order was checked in _parse), so the history's time
            # never goes back and the writer's events are not lost
            timestamps = np.maximum(timestamps, last)
        items = self.model.item_indices(ids, strict=False)  # no event is refused for its item
        new = tuple(torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64)) for x in (items, actions, timestamps))
        total = plan.base[0].shape[0] + new[0].shape[0]
        if plan.session is not None and total <= self.max_history:
            plan.items, plan.actions, plan.timestamps = new
            return
        # a new or restored history, or one that would grow too long: encode the most recent max_history
        drop = max(0, total - self.max_history)
        plan.items, plan.actions, plan.timestamps = (torch.cat([b, x])[drop:] for b, x in zip(plan.base, new))
        plan.reencode, plan.truncated = True, drop

    # ---- batched encoding -------------------------------------------------------------------
    def _pad(self, plans):
        """Events of the plans -> left-aligned [B, n] tensors + lengths [B]."""
        if len(plans) == 1:  # nothing to pad: views of the one plan's events
            p = plans[0]
            events = (t[None].to(self.device) for t in (p.items, p.actions, p.timestamps))
            return (*events, torch.tensor([p.items.shape[0]], device=self.device))
        pad = torch.nn.utils.rnn.pad_sequence
        lengths = torch.tensor([p.items.shape[0] for p in plans], dtype=torch.long)
        out = [pad([getattr(p, f) for p in plans], batch_first=True).to(self.device) for f in ("items", "actions", "timestamps")]
        return (*out, lengths.to(self.device))

    def _run(self, plans) -> None:
        encode = [p for p in plans if p.reencode]
        grow = [p for p in plans if not p.reencode]  # cached sessions with new events (a recommend never gets here)
        with torch.inference_mode():
            if encode:
                items, actions, ts, lengths = self._pad(encode)
                for p, c in zip(encode, self.model.encode(items, actions, ts, lengths).split()):
                    p.cache = c
            if len(grow) == 1:  # one session: its new rows go into its cache's spare rows
                p = grow[0]
                p.cache = self.model.append(p.session.cache, *self._pad(grow), in_place=True)
            elif grow:
                cache = HistoryCache.cat([p.session.cache for p in grow])
                items, actions, ts, lengths = self._pad(grow)
                for p, c in zip(grow, self.model.append(cache, items, actions, ts, lengths).split()):
                    p.cache = c
        for p in plans:
            if p.reencode:
                p.history = (p.items, p.actions, p.timestamps)
            else:
                p.history = tuple(torch.cat([b, x]) for b, x in zip(p.base, (p.items, p.actions, p.timestamps)))

    # ---- the log, before any answer ---------------------------------------------------------
    def _write_log(self, plans, errors: dict) -> None:
        """Log every plan's new events (one write for the appends); a plan whose write lost a
        race with another writer fails (the client retries), nothing else changes."""
        as_lists = lambda p: (list(p.new[0]), p.new[1], p.new[2])  # noqa: E731 - int64 arrays, converted at once
        appends = [p for p in plans if not p.reset and len(p.new[0])]
        results = self.log.append_many([(p.key, p.logged, *as_lists(p)) for p in appends])
        for p, r in zip(appends, results):
            if isinstance(r, LogConflict):
                errors[p.index] = V.RequestError(
                    f"session {p.key[2:]!r}: another request appended to it at the same time (the server now holds "
                    f"{r.count} events); retry with EVENTS_BEFORE",
                    P.UNAVAILABLE,
                )
            else:
                p.count = int(r)
        for p in plans:
            if p.reset:
                p.count = int(self.log.replace(p.key, *as_lists(p)))
        logged = sum(len(p.new[0]) for p in plans if p.index not in errors)
        if logged:
            self.metrics.count("logged", logged)

    def _encode_and_log(self, plans, errors: dict) -> None:
        """Encode the plans' events and write them to the log; no answer leaves before both are done.
        The two need nothing of each other, so a long write (an open's history: 512 events take 1-1.5 ms
        of SQLite and fsync, mostly with the GIL let go) runs on the log's thread while this one encodes.
        A short one (an append's few events) runs after the encode, on this thread: beside the encode it
        gained nothing, the hand-off and the contention for the GIL costing what it saved."""
        log_errors = {}
        aside = sum(len(p.new[0]) for p in plans) >= self.write_aside_events
        written = self._log_writer.submit(self._write_log, plans, log_errors) if aside else None
        try:
            self._run(plans)
        except Exception as e:  # noqa: BLE001 - the batch fails
            errors.update({p.index: e for p in plans})
            if aside:  # the log took the events (unacknowledged): the next request rebuilds the sessions from it,
                for p in plans:  # and a retry with EVENTS_BEFORE is answered from what was logged, applied once
                    self.store.discard(p.key)
        try:
            if written is not None:
                written.result()
            else:
                self._write_log([p for p in plans if p.index not in errors], log_errors)
            errors.update(log_errors)
        except Exception as e:  # noqa: BLE001 - nothing was acknowledged: the requests fail, the client retries
            errors.update({p.index: self._log_unavailable(e) for p in plans if p.index not in errors})

    def _commit(self, p) -> None:
        if p.unchanged:  # the cached session as it was: get() already marked it used
            return
        items, actions, ts = p.history
        self.store.put(p.key, Session(cache=p.cache, items=items, actions=actions, timestamps=ts, count=p.count))
        if p.restored:
            self.metrics.count("restored", 1)

    def _response(self, p) -> StageResponse:
        c = p.cache
        n = int(c.lengths[0])
        if self.device == "cpu":  # numpy views of the cache: numpy's slicing costs less than torch's
            states, keys, values, ts = (t.numpy() for t in (c.states, c.keys, c.values, c.timestamps))
        else:  # only the rows in use leave the device
            states, keys, values, ts = (c.states[:, :n].cpu().numpy(), c.keys[:, :, :n].cpu().numpy(),
                                        c.values[:, :, :n].cpu().numpy(), c.timestamps[:, :n].cpu().numpy())
        items = p.history[0].numpy()
        return StageResponse({
            P.HISTORY_STATES.name: np.ascontiguousarray(states[:, :n]),  # [1, n, D]
            P.HISTORY_KEYS.name: np.ascontiguousarray(keys[:, :, :n].transpose(1, 0, 2, 3, 4)),  # [1, L, n, H, dh]
            P.HISTORY_VALUES.name: np.ascontiguousarray(values[:, :, :n].transpose(1, 0, 2, 3, 4)),
            P.HISTORY_TIMESTAMPS.name: np.ascontiguousarray(ts[:, :n]),  # [1, n]
            P.HISTORY_ITEMS.name: np.ascontiguousarray(items[None]),  # [1, n]
            P.HISTORY_LENGTH.name: np.array([[n]], dtype=np.int64),
            P.TRUNCATED.name: np.array([[p.truncated]], dtype=np.int32),
            P.EVENT_COUNT.name: np.array([[p.count]], dtype=np.int64),
            P.RESTORED.name: np.array([[p.restored]], dtype=np.bool_),
            P.UNKNOWN_ITEMS.name: np.array([[np.count_nonzero(items == self.model.unknown_index)]], dtype=np.int64),
            P.MIN_CATALOG_VERSION.name: np.array([[self.catalog.version]], dtype=np.int64),
        })

    def _log_unavailable(self, exc):
        if isinstance(exc, EventLogDamaged):  # no retry can succeed: the message says how to repair it
            return V.RequestError(f"{P.ENCODER}: {exc}", INTERNAL)
        return V.RequestError(f"{P.ENCODER}: the event log is unavailable ({type(exc).__name__}: {exc}); retry", P.UNAVAILABLE)

    # ---- requests -> responses ----------------------------------------------------------------
    def _round(self, batch, responses) -> None:
        """Requests of distinct sessions: parse, read the log's counts, plan, rebuild misses from
        the log, encode, log, then cache and answer."""
        errors = {}
        reqs = []
        for i, r in batch:
            try:
                reqs.append(self._parse(i, r))
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                errors[i] = e
        plans = []
        try:
            counts = self.log.counts([q.key for q in reqs]) if reqs else []
        except Exception as e:  # noqa: BLE001 - no log, no change: every request of the round fails
            errors.update({q.index: self._log_unavailable(e) for q in reqs})
            counts, reqs = [], []
        for q, logged in zip(reqs, counts):
            try:
                plans.append(self._plan(q, int(logged)))
            except Exception as e:  # noqa: BLE001
                errors[q.index] = e
        plans = self._compare_claimed(plans, errors)
        try:
            restore = [p for p in plans if p.restored]
            tails = dict(zip((p.index for p in restore), self.log.tails([p.key for p in restore], self.max_history) if restore else []))
        except Exception as e:  # noqa: BLE001
            errors.update({p.index: self._log_unavailable(e) for p in restore})
            plans, tails = [p for p in plans if not p.restored], {}
        ready = []
        for p in plans:
            try:
                self._set_base(p, tails.get(p.index))
                ready.append(p)
            except Exception as e:  # noqa: BLE001
                errors[p.index] = e
        plans = ready
        for p in plans:  # a recommend on the cached history encodes, logs and caches nothing
            if p.unchanged:
                p.cache, p.history = p.session.cache, p.base
        changing = [p for p in plans if not p.unchanged]
        if changing:
            self._encode_and_log(changing, errors)
        for p in plans:
            if p.index in errors:
                continue
            try:
                self._commit(p)
            except Exception as e:  # noqa: BLE001 - logged but not cached: the next request rebuilds it from the log
                print(f"{P.ENCODER}: session {p.key!r} not cached: {e}", file=sys.stderr)
            responses[p.index] = self._response(p)
        for i, e in errors.items():
            responses[i] = StageResponse.failed(e, P.ENCODER)

    def handle(self, requests: list) -> list:
        """StageRequests -> StageResponses, one each, in order."""
        self.catalog.sync()  # between requests: this call's requests see one catalog version
        self.store.sweep()
        responses = [None] * len(requests)
        pending = list(enumerate(requests))
        while pending:  # rounds: a session appears at most once a round, in arrival order
            seen, now, later = set(), [], []
            for i, r in pending:
                key = P.session_key(r.correlation_id)  # one session whatever form its id took
                (later if key in seen else now).append((i, r))
                seen.add(key)
            self._round(now, responses)
            pending = later
        try:
            self.metrics.publish(self.store.stats())
        except Exception as e:  # noqa: BLE001 - the answers stand; the counts go out with the next request
            print(f"{P.ENCODER}: publishing metrics failed: {e}", file=sys.stderr)
        return responses

    def close(self) -> None:
        self._stop.set()
        self._log_writer.shutdown(wait=True)
        self.store.clear()
        self.log.close()
        self.catalog.close()
