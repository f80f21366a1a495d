"""Synthetic interaction data with learnable structure, for tests and quick experiments.

The generative story (all vectorized, deterministic by seed):
  - items fall into `num_clusters` clusters; popularity is Zipf within a cluster and mildly Zipf
    across clusters;
  - each user has 1-3 interest clusters whose weights drift linearly from one mix to another
    over the user's timeline;
  - a user's events come in focus segments: at each event the focus switches with probability
    `switch_prob`; a new focus is one of the user's interests (by the current weights), or with
    probability `explore_prob` some other cluster;
  - ratings rise with the affinity of the user to the event's cluster, plus item quality and noise;
  - timestamps grow in sessions: bursts minutes apart, separated by gaps of days;
  - item_text = "cluster-7 item-123 <a few cluster words>", so text embeddings see the clusters;
    item_attributes = [cluster id].
"""
from __future__ import annotations

import numpy as np

from .sequence_data import DAY, SequenceData

_SYLLABLES = ("ka", "lo", "mi", "ru", "te", "sa", "vo", "ne", "pi", "da", "gu", "zo", "be", "xi",
              "fa", "ho")


def generate_synthetic(num_users: int = 2000, num_items: int = 1000, num_clusters: int = 20,
                       seed: int = 0, *, mean_length: float = 30.0, min_length: int = 5,
                       max_length: int = 200, zipf_exponent: float = 1.1,
                       switch_prob: float = 0.05, explore_prob: float = 0.2,
                       session_prob: float = 0.2, words_per_cluster: int = 8,
                       start_time: int = 1_546_300_800) -> SequenceData:
    """Users 1..num_users and items 1..num_items (raw id = item index); actions are ratings 1..5."""
    if num_items < num_clusters:
        raise ValueError(f"need at least one item per cluster ({num_items} < {num_clusters})")
    if not 1 <= min_length <= max_length:
        raise ValueError(f"need 1 <= min_length <= max_length, got {min_length}, {max_length}")
    rng = np.random.default_rng(seed)
    U, I, C = num_users, num_items, num_clusters

    # items: balanced random clusters; Zipf weight by a random rank within the cluster
    item_cluster = rng.permutation(np.arange(I) % C)  # [I] cluster of item index i+1
    by_cluster = np.lexsort((rng.random(I), item_cluster))  # items grouped by cluster, random rank
    cluster_start = np.searchsorted(item_cluster[by_cluster], np.arange(C))
    rank = np.arange(I) - cluster_start[item_cluster[by_cluster]]
    weight = 1.0 / (rank + 1.0) ** zipf_exponent
    cum = np.cumsum(weight)
    cluster_total = np.add.reduceat(weight, cluster_start)
    before = np.concatenate(([0.0], np.cumsum(cluster_total)[:-1]))
    # within-cluster cdf shifted by the cluster id: cluster c occupies (c, c+1]
    item_cdf = (cum - before[item_cluster[by_cluster]]) / cluster_total[item_cluster[by_cluster]]
    item_cdf = item_cdf + item_cluster[by_cluster]
    cluster_pop = 1.0 / (rng.permutation(C) + 1.0) ** 0.8
    cluster_pop /= cluster_pop.sum()

    # users: 1-3 interests (popular clusters more likely, Gumbel top-k), weights drifting w0 -> w1
    n_interests = rng.integers(1, 4, size=U)
    gumbel = np.log(cluster_pop)[None, :] - np.log(-np.log(rng.random((U, C))))
    interests = np.argsort(-gumbel, axis=1)[:, :3]  # [U, 3]
    active = np.arange(3)[None, :] < n_interests[:, None]  # [U, 3]
    w0 = rng.gamma(1.0, size=(U, 3)) * active
    w1 = rng.gamma(1.0, size=(U, 3)) * active
    w0 /= w0.sum(1, keepdims=True)
    w1 /= w1.sum(1, keepdims=True)

    # sequence lengths: geometric, clipped to [min_length, max_length]
    p = 1.0 / max(mean_length - min_length + 1.0, 1.0)
    lengths = np.clip(min_length - 1 + rng.geometric(p, size=U), min_length, max_length)
    E = int(lengths.sum())
    user = np.repeat(np.arange(U), lengths)  # [E]
    first = np.cumsum(lengths) - lengths
    pos = np.arange(E) - np.repeat(first, lengths)
    frac = pos / np.maximum(np.repeat(lengths, lengths) - 1, 1)  # 0..1 over the timeline

    # focus segments
    switch = rng.random(E) < switch_prob
    switch[first] = True
    sw = np.flatnonzero(switch)
    w_now = (1 - frac[sw, None]) * w0[user[sw]] + frac[sw, None] * w1[user[sw]]  # [S, 3]
    pick = (rng.random(len(sw))[:, None] > np.cumsum(w_now, 1)).sum(1).clip(max=2)
    pick = np.where(active[user[sw], pick], pick, 0)
    focus = interests[user[sw], pick]
    explore = (rng.random(len(sw)) < explore_prob) & ~np.isin(sw, first)
    focus = np.where(explore, rng.choice(C, size=len(sw), p=cluster_pop), focus)
    event_cluster = focus[np.cumsum(switch) - 1]  # forward fill the focus

    # item within the cluster by Zipf weight
    draw = event_cluster + rng.random(E) * (1 - 1e-12)
    items = by_cluster[np.searchsorted(item_cdf, draw, side="right")] + 1

    # ratings: affinity to the event's cluster (its current interest weight, 0 outside them)
    w_event = (1 - frac[:, None]) * w0[user] + frac[:, None] * w1[user]  # [E, 3]
    affinity = (w_event * (interests[user] == event_cluster[:, None])).sum(1)
    quality = rng.normal(0.0, 0.5, size=I + 1)
    ratings = np.rint(2.6 + 2.0 * affinity + quality[items] + rng.normal(0.0, 0.7, size=E))
    ratings = ratings.clip(1, 5).astype(np.int64)

    # timestamps: bursts minutes apart within a session, days between sessions
    new_session = rng.random(E) < session_prob
    gaps = np.where(new_session, 3600 + rng.exponential(2.0 * DAY, size=E),
                    10 + rng.exponential(240.0, size=E)).astype(np.int64)
    gaps[first] = 0
    csum = np.cumsum(gaps)
    start = start_time + rng.integers(0, 365 * DAY, size=U)
    timestamps = start[user] + csum - np.repeat(csum[first], lengths)

    # text: cluster words are pseudo-words drawn from syllables
    n_syl = rng.integers(2, 4, size=(C, words_per_cluster))
    syl = rng.integers(0, len(_SYLLABLES), size=(C, words_per_cluster, 3))
    words = [["".join(_SYLLABLES[s] for s in syl[c, w, :n_syl[c, w]]) for w in range(words_per_cluster)]
             for c in range(C)]
    item_words = rng.integers(0, words_per_cluster, size=(I, 3))
    item_text = {i + 1: f"cluster-{item_cluster[i]} item-{i + 1} "
                        + " ".join(words[item_cluster[i]][w] for w in item_words[i])
                 for i in range(I)}

    offsets = np.zeros(U + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    item_ids = np.empty(I + 1, dtype=object)
    item_ids[0] = None
    item_ids[1:] = list(range(1, I + 1))
    return SequenceData(name="synthetic", user_ids=np.arange(1, U + 1, dtype=np.int64),
                        item_ids=item_ids, offsets=offsets, items=items.astype(np.int64),
                        actions=ratings, timestamps=timestamps.astype(np.int64),
                        item_text=item_text,
                        item_attributes={i + 1: [int(item_cluster[i])] for i in range(I)})


_SPEC_ALIASES = {"users": "num_users", "items": "num_items", "clusters": "num_clusters"}


def parse_synthetic_spec(spec: str) -> dict:
    """"synthetic:users=2000,items=1000,seed=0" -> keyword arguments of generate_synthetic."""
    _, _, rest = spec.partition(":")
    kwargs = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(f"bad synthetic option {part!r} in {spec!r}; expected key=value")
        key = _SPEC_ALIASES.get(key.strip(), key.strip())
        value = value.strip()
        try:
            kwargs[key] = int(value)
        except ValueError:
            kwargs[key] = float(value)
    import inspect

    allowed = set(inspect.signature(generate_synthetic).parameters)
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ValueError(f"unknown synthetic option(s) {unknown} in {spec!r}")
    return kwargs
