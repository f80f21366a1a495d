"""The living catalog measured: cold start as *Unifying Generative and Dense Retrieval for Sequential
Recommendation* (LIGER) measures it, unknown items in traffic, and what the catalog costs.

Cold start. The recipe is trained without 10% of the items (`export.train --hold-out-items 0.1`: their
events removed from every training sequence) and published to a real tritonserver; every user's test
case (the full data's leave-one-out split, seen items excluded) then goes through the served path
before and after the held-out items are added through the catalog API with their text. Users whose
target is a held-out item are "cold", the rest "warm". Rows, per split:
  frozen        the held-out model, catalog unchanged (a held-out item cannot be generated: cold is 0)
  catalog       the same server after the catalog add
  content_only  the held-out item nearest in content (the text encoder's cosine) to the mean of the
                user's last 3 items' (not seen)
  trained_with  the recipe trained with every item (--ceiling), served the same way

Unknown items in traffic: the warm users' histories with 5% of their events renamed to ids no model saw,
served by the frozen model: requests refused, events logged (read back from the event log), and the warm
users' quality beside the same replay without renaming.

Cost: catalog add latency (one item with text; 10,000 items with vectors: the text encoder's time is
the one-item number's share), the time from an add's answer to the item being returned, and the served
p50 of recommend with no added items and with `--many` added, the two servers side by side in one run.

    python -m perf.bench_catalog --data amazon-scientific --checkpoint runs/scientific-cold/model.pt \\
        --ceiling runs/scientific-full/model.pt --cluster  # -> perf/results/catalog.json
    python -m perf.bench_catalog --data ml-1m --checkpoint runs/ml1m-cold/model.pt --ceiling runs/ml1m-full/model.pt \\
        --many 0 --add-to                                  # ML-1M's rows into the same file
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from backend_src.config import DecodeOptions
from backend_src.data import eval_batches, load_dataset
from backend_src.data.loaders import hold_out_items
from backend_src.metrics import ranking_metrics
from backend_src.model.catalog import ItemCatalog
from backend_src.model.recommender import GenerativeRecommender
from backend_src.serving.catalog_store import CatalogChange, CatalogEntry
from backend_src.results import REPO_ROOT, command_line, write_result
from backend_src.serving.event_log import open_event_log, served_log_url
from clients.client import RecommenderClient
from export.triton_configs import ServingOptions
from genrec_contract import protocol as P
from perf.served_eval import local_server

TOP_K = 10
RENAMED_SHARE = 0.05


def test_cases(data, max_len: int):
    """Every user's test case on the full data: (raw-id histories, actions, timestamps, targets [B], users)."""
    b = next(eval_batches(data, "test", batch_size=1 << 30, max_len=max_len))
    histories = [[str(x) for x in data.item_ids[b.items[i, :n].numpy()]] for i, n in enumerate(b.lengths.tolist())]
    actions = [b.actions[i, :n].tolist() for i, n in enumerate(b.lengths.tolist())]
    stamps = [b.timestamps[i, :n].tolist() for i, n in enumerate(b.lengths.tolist())]
    return histories, actions, stamps, b.target_items, b.users


def serve_lists(url: str, histories, actions, stamps, index: dict, concurrency: int = 4) -> tuple:
    """Each history as one session through the ensemble (defaults: the recipe's decode, seen items
    excluded) -> [B, TOP_K] full-data item indices, the latencies (ms), the answers' catalog versions."""
    tag = uuid.uuid4().hex[:8]
    B = len(histories)
    ranked = torch.zeros(B, TOP_K, dtype=torch.long)
    latencies, versions = np.zeros(B), np.zeros(B, np.int64)
    clients = [RecommenderClient(url) for _ in range(concurrency)]

    def one(b):
        rec = clients[b % concurrency].recommend_history(f"bench-{tag}-{b}", histories[b], actions[b], stamps[b],
                                                         top_k=TOP_K, exclude_seen=True)
        ranked[b, : len(rec.item_ids)] = torch.tensor([index.get(x, 0) for x in rec.item_ids], dtype=torch.long)
        latencies[b], versions[b] = rec.latency_ms, rec.catalog_version

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(B)))
    finally:
        for c in clients:
            c.close()
    return ranked, latencies, versions


def split_rows(dataset, method, ranked, targets, cold) -> list:
    rows = []
    for split, mask in (("cold", cold), ("warm", ~cold)):
        m = ranking_metrics(ranked[mask], targets[mask], (5, 10))
        rows.append({"dataset": dataset, "split": split, "method": method, "recall10": m["recall@10"],
                     "ndcg10": m["ndcg@10"], "recall5": m["recall@5"], "ndcg5": m["ndcg@5"], "users": int(mask.sum())})
    return rows


def content_only(data, held, histories_idx, lengths) -> torch.Tensor:
    """[B, TOP_K] held-out items nearest in content to the mean of each user's last 3 items (not seen)."""
    from backend_src.model.text_encoder import sentence_embeddings

    texts = [(data.item_text or {}).get(i, "") or "" for i in range(1, data.num_items + 1)]
    emb = F.pad(F.normalize(sentence_embeddings(texts), dim=-1), (0, 0, 1, 0))  # row = item index (0: none)
    last = [h[max(0, n - 3):n] for h, n in zip(histories_idx, lengths)]
    profile = F.normalize(torch.stack([emb[torch.as_tensor(x)].mean(0) for x in last]), dim=-1)
    held_t = torch.as_tensor(held)
    scores = profile @ emb[held_t].T  # [B, H]
    for b, h in enumerate(histories_idx):
        scores[b, torch.isin(held_t, torch.as_tensor(h[:lengths[b]]))] = float("-inf")
    return held_t[scores.topk(TOP_K, dim=1).indices]


def rename_events(histories, share: float, seed: int = 0):
    """The histories with `share` of their events (never a user's last) renamed to ids no model saw."""
    rng = np.random.default_rng(seed)
    out, renamed = [], 0
    for b, h in enumerate(histories):
        h = list(h)
        for j in np.flatnonzero(rng.random(len(h) - 1) < share):
            h[j] = f"never-seen-{b}-{j}"
            renamed += 1
        out.append(h)
    return out, renamed


def add_items(url: str, items: list, admin_key=None, batch: int = 10_000) -> tuple:
    """catalog_add in batches -> (the last version, seconds per batch)."""
    seconds, version = [], 0
    with RecommenderClient(url, admin_key=admin_key, timeout_s=600.0) as c:
        for s in range(0, len(items), batch):
            t0 = time.perf_counter()
            version = c.catalog_add(items[s : s + batch])["version"]
            seconds.append(time.perf_counter() - t0)
    return version, seconds


def until_version(urls: list, version: int, history, stamps, timeout_s: float = 60.0) -> list:
    """Seconds from now until each server in `urls` answers at catalog `version` or later (from then on
    every item of that version is in every table of its stages: it can be generated and returned)."""
    t0, out = time.perf_counter(), []
    for url in urls:
        with RecommenderClient(url, timeout_s=timeout_s) as c:
            while time.perf_counter() - t0 < timeout_s:
                rec = c.recommend_history(f"visible-{uuid.uuid4().hex[:8]}", history, None, stamps, top_k=TOP_K)
                if rec.catalog_version >= version:
                    break
        out.append(time.perf_counter() - t0)
    return out


def cluster_visibility(checkpoint, items: list, histories, stamps, work, adds: int = 10) -> dict:
    """Two replicas behind nginx with Redis (serving.cluster): the seconds from each one-item add's answer
    (through replica 0) until both replicas answer at its version; then a replica down during an add serves
    it once restarted."""
    from backend_src.serving.cluster import LocalCluster
    from export.publish import publish

    tmp = Path(tempfile.mkdtemp(prefix="genrec-catalog-cluster-", dir=work))
    repo = tmp / "model_repository"
    publish(checkpoint, repo, ServingOptions(), export_ranker=False)
    seconds = []
    with LocalCluster(repo, replicas=2, workdir=tmp / "run") as cluster:
        urls = cluster.replica_urls
        for j in range(adds):
            version, _ = add_items(urls[0], items[j : j + 1], cluster.admin_key)
            seconds.append(max(until_version(urls, version, histories[j], stamps[j])))
        cluster.kill_replica(1)
        version, _ = add_items(urls[0], items[adds : adds + 1], cluster.admin_key)
        cluster.restart_replica(1)
        with RecommenderClient(urls[1]) as c:
            rec = c.recommend_history(f"restarted-{uuid.uuid4().hex[:8]}", histories[0], None, stamps[0], top_k=TOP_K)
    shutil.rmtree(tmp, ignore_errors=True)
    return {"add_visible_s_p50": float(np.median(seconds)), "add_visible_s_max": float(np.max(seconds)),
            "add_visible_adds": adds, "replica_down_during_add_serves_it": rec.catalog_version >= version}


def offline_lists(model, data, split: str, index: dict, users: np.ndarray) -> tuple:
    """`users`' cases of `split` through GenerativeRecommender.recommend as the server runs it (the
    recipe's decode, seen items excluded, raw ids mapped by the model's vocabulary and catalog) ->
    ([B, TOP_K] full-data item indices, targets [B])."""
    rows_of = np.vectorize(lambda i: 0 if i == 0 else int(model.item_indices([str(data.item_ids[i])], strict=False)[0]))
    row_ids = model.row_ids()
    ranked, targets = [], []
    with torch.no_grad():
        for b in eval_batches(data, split, batch_size=256, max_len=model.cfg.max_seq_len, users=users):
            rows = torch.from_numpy(rows_of(b.items.numpy()).astype(np.int64))
            cache = model.encode(rows, b.actions, b.timestamps, b.lengths)
            rec = model.recommend(cache, DecodeOptions(), top_k=TOP_K, exclude_seen=True, history_items=rows)
            ranked.append(torch.tensor([[index.get(str(row_ids[r]), 0) if r else 0 for r in row] for row in rec.items.tolist()]))
            targets.append(b.target_items)
    return torch.cat(ranked), torch.cat(targets)


def add_offline(model, data, held) -> ItemCatalog:
    """The held-out items added to `model` in this process as the catalog model adds them (their text)."""
    from backend_src.model.text_encoder import sentence_embeddings

    texts = [(data.item_text or {}).get(int(i), "") for i in held]
    emb = F.normalize(sentence_embeddings(texts), dim=-1).numpy()  # as the catalog model embeds them
    catalog = ItemCatalog(model, capacity=len(held))
    entries = tuple(CatalogEntry(str(data.item_ids[i]), {"text": t}, e) for i, t, e in zip(held, texts, emb))
    catalog.apply([CatalogChange(1, entries, (), 0.0)])
    return catalog


def tune(checkpoint, data, held, index, warm_sample: int = 2000, seed: int = 0) -> dict:
    """catalog_candidates and catalog_content_weight on the validation split (every user whose validation
    target is a held-out item, and `warm_sample` others): the best recall@10 over all users, the cold and
    the warm ones weighted by their share of the data's users (the served order is one for both)."""
    valid = data.items[data.offsets[1:] - 2]
    cold_users = np.flatnonzero(np.isin(valid, held))
    share = len(cold_users) / data.num_users
    rng = np.random.default_rng(seed)
    users = np.sort(np.concatenate([cold_users, rng.choice(np.setdiff1d(np.arange(data.num_users), cold_users),
                                                            warm_sample, replace=False)]))
    base = GenerativeRecommender.load(checkpoint)
    ranked, targets = offline_lists(base, data, "valid", index, users)
    cold = torch.as_tensor(np.isin(targets.numpy(), held))
    floor = ranking_metrics(ranked[~cold], targets[~cold], (10,))["recall@10"]
    trials = []
    for count in (10, 30):
        for weight in (0.0, 5.0, 10.0, 20.0, 40.0):
            model = GenerativeRecommender.load(checkpoint)
            model.cfg.catalog_candidates, model.cfg.catalog_content_weight = count, weight
            add_offline(model, data, held)
            ranked, _ = offline_lists(model, data, "valid", index, users)
            m = {split: ranking_metrics(ranked[mask], targets[mask], (10,))["recall@10"]
                 for split, mask in (("cold", cold), ("warm", ~cold))}
            m["all"] = share * m["cold"] + (1 - share) * m["warm"]
            trials.append({"catalog_candidates": count, "catalog_content_weight": weight, **m})
            print(trials[-1], flush=True)
    best = max(trials, key=lambda t: (round(t["all"], 4), -t["catalog_candidates"]))  # a tie: the fewer candidates
    return {"valid_users": len(users), "valid_cold_users": int(cold.sum()), "cold_share": share,
            "warm_recall10_no_change": floor, "trials": trials,
            "chosen": {k: best[k] for k in ("catalog_candidates", "catalog_content_weight")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--checkpoint", required=True, help="the recipe trained with --hold-out-items")
    ap.add_argument("--ceiling", help="the recipe trained with every item")
    ap.add_argument("--hold-out", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0, help="the training's seed (it chose the held-out items)")
    ap.add_argument("--users", type=int, default=None, help="the first N users (default all)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--many", type=int, default=100_000, help="added items for the latency comparison (0: skip)")
    ap.add_argument("--latency-requests", type=int, default=300)
    ap.add_argument("--cluster", action="store_true", help="also the add-to-visible time on two replicas behind nginx "
                                                            "(needs redis-server and nginx)")
    ap.add_argument("--results", default=None, help="default perf/results/catalog.json")
    ap.add_argument("--add-to", action="store_true", help="put this data set's rows into the results file beside the "
                                                          "other data sets' (its other numbers under runs)")
    ap.add_argument("--latency-only", action="store_true", help="only the served p50 with no and with --many added "
                                                                 "items, into the results file beside what is there")
    ap.add_argument("--tune", action="store_true", help="only choose catalog_candidates and catalog_content_weight on the "
                                                         "validation split, in this process")
    a = ap.parse_args(argv)

    data = load_dataset(a.data)
    _, held = hold_out_items(data, a.hold_out, a.seed)
    index = {str(x): i for i, x in enumerate(data.item_ids) if i > 0}
    if a.tune:
        tuned = tune(a.checkpoint, data, held, index, seed=a.seed)
        print(tuned["chosen"])
        write_result(Path(REPO_ROOT) / (a.results or f"perf/results/catalog_tuning_{Path(a.data).name}.json"), tuned["trials"],
                     checkpoint=a.checkpoint, **{k: v for k, v in tuned.items() if k != "trials"})
        return 0
    model = GenerativeRecommender.load(a.checkpoint)
    histories, actions, stamps, targets, users = test_cases(data, model.cfg.max_seq_len)
    if a.latency_only:  # only the cost of many added items, into the results file as it is
        path = Path(REPO_ROOT) / (a.results or "perf/results/catalog.json")
        blob = json.loads(path.read_text())
        out = latency_with_many(a.checkpoint, ServingOptions(catalog_poll_s=0.5), Path(REPO_ROOT) / "runs", histories,
                                actions, stamps, a.many, a.latency_requests, model.codebook.content)
        print(out)
        rows = blob.pop("rows")
        write_result(path, rows, **{k: v for k, v in blob.items() if k not in ("date", "machine", "commit")}, **out,
                     latency_command=command_line())
        return 0
    if a.users:
        histories, actions, stamps, targets, users = (histories[: a.users], actions[: a.users], stamps[: a.users],
                                                      targets[: a.users], users[: a.users])
    cold = torch.as_tensor(np.isin(targets.numpy(), held))
    lengths = [len(h) for h in histories]
    hist_idx = [[index[x] for x in h] for h in histories]
    rows, out = [], {}
    options = ServingOptions(catalog_poll_s=0.5)
    work = Path(REPO_ROOT) / "runs"
    with local_server(a.checkpoint, options, workdir=work) as server:
        url = server.grpc_url
        print(f"{len(histories)} users ({int(cold.sum())} cold), {len(held)} held-out items")
        ranked, lat, _ = serve_lists(url, histories, actions, stamps, index, a.concurrency)
        rows += split_rows(data.name, "frozen", ranked, targets, cold)
        out["recommend_p50_ms_frozen"] = float(np.percentile(lat, 50))
        # unknown items in traffic: the frozen model's warm users, 5% of their events renamed
        warm = (~cold).nonzero().squeeze(1).tolist()
        renamed, n_renamed = rename_events([histories[b] for b in warm], RENAMED_SHARE, a.seed)
        tag = uuid.uuid4().hex[:8]
        refused, answered = 0, []
        ranked_r = torch.zeros(len(warm), TOP_K, dtype=torch.long)
        with RecommenderClient(url) as c:
            for j, b in enumerate(warm):
                try:
                    rec = c.recommend_history(f"renamed-{tag}-{j}", renamed[j], actions[b], stamps[b], top_k=TOP_K, exclude_seen=True)
                except Exception:  # noqa: BLE001 - counted: the goal is none
                    refused += 1
                    continue
                ranked_r[j, : len(rec.item_ids)] = torch.tensor([index.get(x, 0) for x in rec.item_ids], dtype=torch.long)
                answered.append(j)
        # every event in the log, as sent (raw ids): read back
        with open_event_log(served_log_url({}, server.model_repository)) as log:
            tails = log.tails([P.session_key(f"renamed-{tag}-{j}") for j in answered], model.cfg.max_seq_len)
        sent = sum(map(len, renamed))
        logged = sum(len(renamed[j]) for t, j in zip(tails, answered) if list(t.items) == renamed[j])
        renamed_m = ranking_metrics(ranked_r, targets[warm], (5, 10))
        plain_m = ranking_metrics(ranked[warm], targets[warm], (5, 10))
        out.update(unknown_item_requests_refused=refused, unknown_item_events_renamed=n_renamed,
                   unknown_item_events_logged_share=logged / max(sent, 1),
                   unknown_items_warm_recall10=renamed_m["recall@10"], unknown_items_warm_ndcg10=renamed_m["ndcg@10"],
                   no_renaming_warm_recall10=plain_m["recall@10"], no_renaming_warm_ndcg10=plain_m["ndcg@10"])
        # the catalog adds the held-out items with their text
        items = [{"id": str(data.item_ids[i]), "text": (data.item_text or {}).get(int(i), "")} for i in held]
        version, seconds = add_items(url, items[:1])
        out["add_one_s"] = seconds[0]
        out["add_visible_one_server_s"] = until_version([url], version, histories[0], stamps[0])[0]
        version, seconds = add_items(url, items[1:])
        out["add_held_out_s"] = sum(seconds)
        out["add_held_out_items"] = len(items)
        time.sleep(2 * options.catalog_poll_s)
        ranked, lat, versions = serve_lists(url, histories, actions, stamps, index, a.concurrency)
        assert (versions == version).all(), "every answer at the catalog version of the last add"
        rows += split_rows(data.name, "catalog", ranked, targets, cold)
        out["recommend_p50_ms_catalog"] = float(np.percentile(lat, 50))
    rows += split_rows(data.name, "content_only", content_only(data, held, hist_idx, lengths), targets, cold)
    if a.ceiling:
        with local_server(a.ceiling, options, workdir=work) as server:
            ranked, _, _ = serve_lists(server.grpc_url, histories, actions, stamps, index, a.concurrency)
        rows += split_rows(data.name, "trained_with", ranked, targets, cold)
    for r in rows:
        print(f"{r['dataset']:>18} {r['split']:>4} {r['method']:>13} R@10={r['recall10']:.4f} N@10={r['ndcg10']:.4f} "
              f"users={r['users']}")
    path = Path(REPO_ROOT) / (a.results or "perf/results/catalog.json")
    base = json.loads(path.read_text()) if a.add_to and path.exists() else None
    save = lambda: save_results(path, base, data.name, rows, dict(  # noqa: E731 - after each part: a late failure keeps the rest
        checkpoint=a.checkpoint, ceiling=a.ceiling, hold_out=a.hold_out, seed=a.seed, held_out_items=len(held), **out))
    save()
    if a.cluster:
        out.update(cluster_visibility(a.checkpoint, items, histories, stamps, work))
        save()
    if a.many:
        out.update(latency_with_many(a.checkpoint, options, work, histories, actions, stamps, a.many, a.latency_requests,
                                     model.codebook.content))
        save()
    print(out)
    return 0


def save_results(path: Path, base: dict | None, dataset: str, rows: list, run: dict) -> None:
    """The run's rows and numbers; with `base` (--add-to: the file as it was), its rows beside the other data
    sets' there and its numbers under runs[dataset]."""
    if base is None:
        write_result(path, rows, **run)
        return
    blob = dict(base)
    kept = [r for r in blob.pop("rows") if r["dataset"] != dataset]
    runs = {**blob.pop("runs", {}), dataset: {"command": command_line(), **run}}
    write_result(path, kept + rows, command=blob.pop("command"),
                 **{k: v for k, v in blob.items() if k not in ("date", "machine", "commit")}, runs=runs)


def latency_with_many(checkpoint, options, work, histories, actions, stamps, many: int, requests: int, content) -> dict:
    """recommend's served p50 on two servers of the same version side by side, one with `many` items added,
    requests alternating. The items come as vectors (their placing is timed here, not the text encoder): a
    trained item's content embedding moved a little, so they spread over the semantic IDs as items do."""
    rng = np.random.default_rng(0)
    with local_server(checkpoint, options, workdir=work) as plain, local_server(checkpoint, options, workdir=work) as grown:
        base = content[rng.integers(1, content.shape[0], many)].numpy()
        vectors = base + 0.05 * rng.standard_normal(base.shape).astype(np.float32) / np.sqrt(base.shape[1])
        items = [{"id": f"added-{j}", "vector": vectors[j].tolist()} for j in range(many)]
        t0 = time.perf_counter()
        _, seconds = add_items(grown.grpc_url, items)
        out = {"add_10k_s_p50": float(np.median(seconds)), "added_items": many, "add_many_s": time.perf_counter() - t0}
        with RecommenderClient(grown.grpc_url, timeout_s=600.0) as c:  # every stage has applied them (their cost
            version = c.catalog_list(limit=1)["version"]                  # is paid once, between requests)
        out["apply_many_s"] = until_version([grown.grpc_url], version, histories[0], stamps[0], timeout_s=600.0)[0]
        lat = {0: [], many: []}
        tag = uuid.uuid4().hex[:8]
        with RecommenderClient(plain.grpc_url) as a, RecommenderClient(grown.grpc_url) as b:
            for j in range(requests):
                u = j % len(histories)
                for n, c in ((0, a), (many, b)) if j % 2 else ((many, b), (0, a)):
                    rec = c.recommend_history(f"lat-{tag}-{n}-{j}", histories[u], actions[u], stamps[u], top_k=TOP_K,
                                              exclude_seen=True)
                    lat[n].append(rec.latency_ms)
    out.update(recommend_p50_ms_no_adds=float(np.percentile(lat[0], 50)),
               recommend_p50_ms_100k_adds=float(np.percentile(lat[many], 50)))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
