"""Data layer: loaders on the real files, format errors, synthetic structure, splits and batches."""
import gzip
import json
import time

import numpy as np
import pytest
import torch

from backend_src.data import (
    DataFormatError,
    SequenceData,
    eval_batches,
    generate_synthetic,
    item_popularity,
    load_csv,
    load_dataset,
    pad_histories,
    train_batches,
)
from backend_src.data.loaders import (
    load_amazon_json,
    load_amazon_reviews,
    load_amazon_sequential,
    load_ml100k,
    load_movielens,
)


def assert_chronological(d: SequenceData):
    """Offsets are consistent and timestamps never decrease within a user."""
    assert d.offsets[0] == 0 and d.offsets[-1] == len(d.items) == len(d.actions) == len(d.timestamps)
    assert (np.diff(d.offsets) > 0).all()
    first = np.zeros(len(d.items), dtype=bool)
    first[d.offsets[:-1]] = True
    assert (np.diff(d.timestamps)[~first[1:]] >= 0).all()
    assert d.items.min() >= 1 and d.items.max() == d.num_items
    assert d.item_ids[0] is None and len(d.item_ids) == d.num_items + 1


# ------------------------------------------------------------------------------- real files


def test_ml100k_full(data_dir):
    d = load_dataset("ml-100k", root=data_dir)
    assert (d.num_users, d.num_items, d.num_events) == (943, 1682, 100000)
    assert_chronological(d)
    assert set(np.unique(d.actions)) == {1, 2, 3, 4, 5}
    assert d.item_text[d.item_index(1)].startswith("Toy Story (1995) | Animation")
    assert d.item_index("1") == d.item_index(1)
    with pytest.raises(KeyError, match="not in data set"):
        d.item_index(999999)
    # users in order of first appearance in u.data (196 is on line 1)
    assert d.user_ids[0] == 196
    # the same file by path
    d2 = load_dataset(str(data_dir / "ml-100k" / "u.data"), max_users=10)
    assert d2.num_users == 10 and (d2.user_ids == d.user_ids[:10]).all()


def test_ml1m(data_dir):
    d = load_dataset("ml-1m", root=data_dir)
    assert (d.user_ids == np.arange(1, 3000)).all()
    assert d.num_events == 487650 and d.num_items == 3615
    assert d.lengths.max() == 1850
    assert_chronological(d)
    assert "Comedy" in d.item_text[d.item_index(1)]
    small = load_dataset("ml-1m", root=data_dir, max_users=50)
    assert (small.user_ids == np.arange(1, 51)).all()
    assert small.num_events == d.offsets[50]
    # same events for user 1 in both (item indices differ: vocabularies differ)
    raw = lambda data, u: [data.item_ids[i] for i in data.user_events(u)[0]]  # noqa: E731
    assert raw(small, 0) == raw(d, 0)


def test_amazon_beauty_full(data_dir):
    t = time.perf_counter()
    d = load_dataset("amazon-beauty", root=data_dir)
    elapsed = time.perf_counter() - t
    assert elapsed < 5.0, f"amazon-beauty took {elapsed:.2f}s"
    assert (d.num_users, d.num_items, d.num_events) == (22363, 12101, 198502)
    assert_chronological(d)
    assert (d.actions == 0).all()
    assert (d.timestamps % 86400 == 0).all()
    # the data set's own ids: item index == raw id, order == sequential_data.txt
    assert list(d.item_ids[1:6]) == [1, 2, 3, 4, 5]
    lines = (data_dir / "amazon-beauty" / "sequential_data.txt").read_text().split("\n")
    for u in (0, 1, 777, 22362):
        ids = [int(x) for x in lines[u].split()]
        assert d.user_ids[u] == ids[0]
        assert [d.item_ids[i] for i in d.user_events(u)[0]] == ids[1:]
    # user 1: days 0, 0, 107, 835 from interactions.tsv.gz
    assert list(d.user_events(0)[2][:4] // 86400) == [0, 0, 107, 835]
    assert d.item_attributes[d.item_index(4)] and all(isinstance(a, int) for a in d.item_attributes[1])


def test_amazon_scientific(data_dir):
    d = load_dataset("amazon-scientific", root=data_dir)
    assert (d.num_users, d.num_items, d.num_events) == (8317, 4344, 58492)
    assert_chronological(d)
    inter = json.loads((data_dir / "amazon-scientific" / "Scientific.inter.json").read_text())
    items, _, ts = d.user_events(0)
    assert [d.item_ids[i] for i in items] == inter[str(d.user_ids[0])]
    assert (ts == np.arange(len(ts)) * 86400).all()
    assert d.item_text[d.item_index(0)].startswith("SUPCO SPP6")
    assert load_dataset(str(data_dir / "amazon-scientific"), max_users=5).num_users == 5


def test_synthetic_spec():
    d = load_dataset("synthetic:users=50,items=100,clusters=5,seed=3")
    assert (d.num_users, d.num_items) == (50, 100)
    e = generate_synthetic(50, 100, 5, seed=3)
    assert np.array_equal(d.items, e.items)
    with pytest.raises(ValueError, match="unknown synthetic option"):
        load_dataset("synthetic:colour=3")
    with pytest.raises(FileNotFoundError):
        load_dataset("no-such-data-set")


# ------------------------------------------------------------------------------- small files


def write(path, text, gz=False):
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def test_stable_chronological_sort_and_filters(tmp_path):
    csv = write(tmp_path / "events.csv", "user,item,timestamp,action\n"
                "u2,a,5,1\nu1,b,30,2\nu1,c,10,3\nu1,d,10,4\nu2,b,1,1\nu1,a,20,5\nu3,a,1,0\n")
    d = load_csv(csv, min_events=1)
    assert list(d.user_ids) == ["u2", "u1", "u3"]  # order of first appearance
    raw = lambda u: [d.item_ids[i] for i in d.user_events(u)[0]]  # noqa: E731
    assert raw(0) == ["b", "a"]
    assert raw(1) == ["c", "d", "a", "b"]  # the 10/10 tie keeps file order
    assert list(d.user_events(1)[1]) == [3, 4, 5, 2]
    assert list(d.item_ids[1:]) == ["a", "b", "c", "d"]
    # default min_events=3 drops u2 and u3; items only from kept users
    d3 = load_csv(csv)
    assert list(d3.user_ids) == ["u1"] and d3.num_items == 4
    assert load_csv(csv, min_events=1, max_users=2).num_users == 2
    # reversed column order found by header names; integer ids stay integers
    csv2 = write(tmp_path / "e2.csv", "timestamp,item,user\n3,7,1\n1,8,1\n2,9,1\n")
    d2 = load_csv(csv2)
    assert [d2.item_ids[i] for i in d2.items] == [8, 9, 7] and d2.user_ids[0] == 1


def test_movielens_gz_and_titles(tmp_path):
    write(tmp_path / "ratings.dat.gz", "1::10::5::100\n1::11::3::50\n1::10::4::70\n2::11::1::5\n", gz=True)
    (tmp_path / "movies.dat").write_bytes("10::Caf\xe9 (1999)::Comedy|Drama\n11::B (2000)::Horror\n"
                                          .encode("latin-1"))
    d = load_dataset(str(tmp_path), min_events=1)
    assert [d.item_ids[i] for i in d.user_events(0)[0]] == [11, 10, 10]
    assert list(d.user_events(0)[1]) == [3, 4, 5]
    assert d.item_text[d.item_index(10)] == "Caf\xe9 (1999) | Comedy, Drama"


BAD_ROWS = [
    ("ratings.dat", "1::2::3::4\n1::2::3\n", ":2: expected 4 fields"),
    ("ratings.dat", "1::2::3::4\n\n1::x::3::4\n", ":3: MovieID 'x' is not an integer"),
    ("ratings.dat", "1::2::3::4\n1::2::3::4.5\n", ":2: Timestamp '4.5' is not an integer"),
    ("ratings.dat", "1::2::3::4\n1::2::3::4\n1::2::9::4\n", ":3: Rating 9 is out of range 1..5"),
    ("u.data", "1\t2\t3\t4\n1\t2\t0\t4\n", ":2: rating 0 is out of range"),
    ("u.data", "1\t2\t3\t4\n1 2 3 4\n", ":2: expected 4 tab-separated fields"),
    ("e.csv", "user,item,timestamp\n1,2,3\n1,2,yesterday\n", ":3: timestamp 'yesterday' is not an integer"),
    ("e.csv", "user,item,timestamp,action\n1,2,3,1\n1,2,3,7\n", ":3: action 7 is out of range 0..6"),
    ("e.csv", "user,item,timestamp\n1,2,3,4\n", ":2: expected 3 comma-separated fields"),
]


@pytest.mark.parametrize("name,text,message", BAD_ROWS)
def test_bad_rows_name_file_and_line(tmp_path, name, text, message):
    path = write(tmp_path / name, text)
    loader = {"ratings.dat": load_movielens, "u.data": load_ml100k, "e.csv": load_csv}[name]
    with pytest.raises(DataFormatError) as err:
        loader(path, min_events=1)
    assert str(path) + message in str(err.value)
    assert isinstance(err.value, ValueError)


def test_bad_json_and_amazon_rows(tmp_path):
    inter = write(tmp_path / "X.inter.json", '{\n "0": [0, 1],\n "1": [1, 5]\n}\n')
    write(tmp_path / "X.item.json", json.dumps({"0": {"title": "a"}, "1": {"title": "b"}}))
    with pytest.raises(DataFormatError, match=r"X\.inter\.json:3: user '1' has item '5'"):
        load_amazon_json(inter, min_events=1)
    broken = write(tmp_path / "Y.inter.json", '{\n "0": [0, 1],\n')
    with pytest.raises(DataFormatError, match=r"Y\.inter\.json:3: invalid JSON"):
        load_amazon_json(broken)

    folder = tmp_path / "beauty"
    folder.mkdir()
    write(folder / "sequential_data.txt", "1 1 2 3\n2 2 x 3\n")
    with pytest.raises(DataFormatError, match=r"sequential_data\.txt:2: id 'x' is not an integer"):
        load_amazon_sequential(folder)
    write(folder / "sequential_data.txt", "1 1 2 3\n2 2 1 3\n")
    header = "user_idx\treviewerID\titem_idx\tasin\tpos\tdays_since_user_first\tsame_sequence_user_ambiguous\n"
    rows = ["1\tA\t1\ta\t0\t0\t0", "1\tA\t2\tb\t1\t3\t0", "1\tA\t3\tc\t2\t3\t0",
            "2\tB\t2\tb\t0\t0\t0", "2\tB\t1\ta\t1\t1\t0", "2\tB\t3\tc\t2\t9\t0"]
    write(folder / "interactions.tsv.gz", header + "\n".join(rows) + "\n", gz=True)
    d = load_amazon_sequential(folder)
    assert list(d.timestamps // 86400) == [0, 3, 3, 0, 1, 9]
    rows[4] = "2\tB\t3\ta\t1\t1\t0"  # item disagrees with the sequence (line 6 with the header)
    write(folder / "interactions.tsv.gz", header + "\n".join(rows) + "\n", gz=True)
    with pytest.raises(DataFormatError, match=r"interactions\.tsv\.gz:6: item_idx 3 disagrees"):
        load_amazon_sequential(folder)
    (folder / "interactions.tsv.gz").unlink()  # no tsv: the position is the day
    assert list(load_amazon_sequential(folder).timestamps // 86400) == [0, 1, 2, 0, 1, 2]


def _reviews(rows, user="reviewerID", item="asin", time="unixReviewTime"):
    return "".join(json.dumps({user: u, item: i, time: t, "overall": 5.0, "reviewText": "fine"}) + "\n" for u, i, t in rows)


def test_amazon_review_releases(tmp_path):
    """Amazon's own files as a user downloads them: the 2018 5-core reviews with JSON metadata, the 2014
    metadata written as Python literals, the 2023 release in milliseconds; found in a folder by content."""
    folder = tmp_path / "sports"
    folder.mkdir()
    rows = [("A", "i2", 200), ("A", "i1", 100), ("B", "i1", 300), ("A", "i3", 200), ("A", "i2", 200), ("B", "i3", 50)]
    write(folder / "Sports_5.json.gz", _reviews(rows), gz=True)
    meta = [{"asin": "i1", "title": "Ball", "brand": "Acme", "category": ["Sports", "Balls"], "description": ["Round."]},
            {"asin": "i2", "title": "Net"}, {"asin": "zz", "title": "not reviewed"}]
    write(folder / "meta_Sports.json", "".join(json.dumps(m) + "\n" for m in meta))
    d = load_dataset(str(folder), min_events=1)
    assert d.name == "sports" and d.num_users == 2 and len(d.items) == 5  # A's repeated review is one event
    raw = [d.item_ids[i] for i in d.items]
    assert raw == ["i1", "i2", "i3", "i3", "i1"] and list(d.timestamps) == [100, 200, 200, 50, 300]  # ties: file order
    text = {d.item_ids[i]: t for i, t in d.item_text.items()}
    assert text == {"i1": "Ball | Acme | Sports, Balls | Round.", "i2": "Net"}

    # the 2014 metadata is not JSON but Python literals, its categories a list of lists
    (folder / "meta_Sports.json").unlink()
    write(folder / "meta_Sports.json.gz", "{'asin': 'i3', 'title': 'Bat', 'categories': [['Sports', 'Bats']]}\n", gz=True)
    d = load_amazon_reviews(folder / "Sports_5.json.gz", min_events=1)
    assert {d.item_ids[i]: t for i, t in d.item_text.items()} == {"i3": "Bat | Sports, Bats"}

    # 2023: user_id, parent_asin, timestamps in milliseconds
    new = write(tmp_path / "Toys.jsonl", _reviews([("u", "p1", 5000), ("u", "p2", 1000)], "user_id", "parent_asin", "timestamp"))
    d = load_dataset(str(new), min_events=1)
    assert d.name == "Toys" and [d.item_ids[i] for i in d.items] == ["p2", "p1"] and list(d.timestamps) == [1, 5]

    bad = write(tmp_path / "Bad_5.json", _reviews([("A", "i1", 1)]) + '{"reviewerID": "A", "asin": "i2"}\n')
    with pytest.raises(DataFormatError, match=r"Bad_5\.json:2: review without 'unixReviewTime'"):
        load_amazon_reviews(bad)
    write(folder / "Golf_5.json", _reviews([("A", "i1", 1)]))
    with pytest.raises(DataFormatError, match="several review files"):
        load_dataset(str(folder))


# ------------------------------------------------------------------------------- synthetic


def test_synthetic_structure():
    d = generate_synthetic(num_users=1000, num_items=500, num_clusters=10, seed=0)
    assert (d.num_users, d.num_items) == (1000, 500)
    assert_chronological(d)
    lengths = d.lengths
    assert lengths.min() >= 5 and lengths.max() <= 200 and lengths.std() > 5
    # strictly increasing times with sessions: many gaps under an hour, some over a day
    first = np.zeros(d.num_events, bool)
    first[d.offsets[:-1]] = True
    gaps = np.diff(d.timestamps)[~first[1:]]
    assert (gaps > 0).all() and (gaps < 3600).mean() > 0.5 and (gaps > 86400).mean() > 0.02
    # popularity skew: top 10% of items hold > 30% of the events
    counts = np.sort(np.bincount(d.items, minlength=d.num_items + 1)[1:])[::-1]
    assert counts[: d.num_items // 10].sum() > 0.3 * counts.sum()
    # cluster structure: consecutive events mostly share a cluster, but users do switch
    cluster = np.array([d.item_attributes[i][0] for i in range(1, d.num_items + 1)])
    ec = cluster[d.items - 1]
    same = (ec[1:] == ec[:-1])[~first[1:]]
    assert 0.6 < same.mean() < 0.995
    assert "cluster-%d" % cluster[0] in d.item_text[1]
    # ratings correlate with affinity: a user's most frequent cluster gets higher ratings
    user = np.repeat(np.arange(d.num_users), lengths)
    top = np.array([np.bincount(ec[s:e]).argmax() for s, e in zip(d.offsets[:-1], d.offsets[1:])])
    fav = ec == top[user]
    assert d.actions[fav].mean() > d.actions[~fav].mean() + 0.3
    assert d.actions.min() >= 1 and d.actions.max() <= 5


def test_synthetic_deterministic():
    a = generate_synthetic(200, 100, 5, seed=7)
    b = generate_synthetic(200, 100, 5, seed=7)
    c = generate_synthetic(200, 100, 5, seed=8)
    for f in ("offsets", "items", "actions", "timestamps"):
        assert np.array_equal(getattr(a, f), getattr(b, f))
    assert a.item_text == b.item_text
    assert not (len(a.items) == len(c.items) and np.array_equal(a.items, c.items))


# ------------------------------------------------------------------------------- splits, batches


@pytest.fixture(scope="module")
def syn():
    return generate_synthetic(num_users=300, num_items=200, num_clusters=8, seed=1)


def test_eval_batches_leave_one_out(syn):
    max_len = 16
    for split, back in (("test", 1), ("valid", 2)):
        seen = []
        for batch in eval_batches(syn, split, batch_size=64, max_len=max_len):
            assert batch.targets is None and batch.items.dtype == torch.long
            for b, u in enumerate(batch.users):
                items, actions, ts = syn.user_events(u)
                hist = items[: len(items) - back]
                n = min(len(hist), max_len)
                assert batch.lengths[b] == n
                assert batch.target_items[b] == items[len(items) - back]
                assert batch.items[b, :n].tolist() == hist[-n:].tolist()
                assert batch.timestamps[b, :n].tolist() == ts[: len(items) - back][-n:].tolist()
                assert (batch.items[b, n:] == 0).all() and (batch.actions[b, n:] == 0).all()
            seen.extend(batch.users.tolist())
        assert seen == list(range(syn.num_users))
    sub = next(eval_batches(syn, "test", batch_size=8, max_len=4, users=[5, 3], pad_to_max=True))
    assert sub.users.tolist() == [5, 3] and sub.items.shape == (2, 4)


@pytest.mark.parametrize("end_offset", [2, 1])  # 1: a refit trains on the validation targets too
def test_train_batches_shift_and_padding(syn, end_offset):
    max_len = 12
    rows = 0
    for batch in train_batches(syn, batch_size=50, max_len=max_len, rng=0, end_offset=end_offset):
        B, N = batch.items.shape
        assert N == int(batch.lengths.max()) <= max_len
        for b, u in enumerate(batch.users):
            items, _, _ = syn.user_events(u)
            train = items[: len(items) - end_offset]
            n = min(len(train) - 1, max_len)
            assert batch.lengths[b] == n
            window = train[-(n + 1):]
            assert batch.items[b, :n].tolist() == window[:-1].tolist()
            assert batch.targets[b, :n].tolist() == window[1:].tolist()  # shifted by one
            assert (batch.items[b, n:] == 0).all() and (batch.targets[b, n:] == 0).all()
        rows += B
    assert rows == int((syn.lengths - end_offset >= 2).sum())
    # shuffling is seeded; no shuffle = user order
    a = [b.users.tolist() for b in train_batches(syn, 64, 8, rng=3)]
    assert a == [b.users.tolist() for b in train_batches(syn, 64, 8, rng=3)]
    ordered = np.concatenate([b.users for b in train_batches(syn, 64, 8, shuffle=False)])
    assert (np.diff(ordered) > 0).all()
    assert next(train_batches(syn, 4, 8, rng=0, pad_to_max=True)).items.shape == (4, 8)


def test_stochastic_length(syn):
    max_len = 64
    n_train = syn.lengths - 2
    full = {int(u): min(n - 1, max_len) for u, n in enumerate(n_train) if n >= 2}

    def lengths(alpha, seed):
        out = {}
        for batch in train_batches(syn, 128, max_len, rng=seed, stochastic_length_alpha=alpha):
            out.update(zip(batch.users.tolist(), batch.lengths.tolist()))
        return out

    assert lengths(2.0, 0) == full  # alpha = 2: off
    alpha = 1.0
    short = int(max_len ** (alpha / 2))  # 8 events -> 7 positions
    long_users = [u for u in full if n_train[u] > short]
    keep_p = np.array([min(1.0, max_len ** alpha / n_train[u] ** 2) for u in long_users])
    kept = np.zeros(len(long_users))
    for seed in range(5):
        got = lengths(alpha, seed)
        assert all(got[u] == full[u] for u in full if n_train[u] <= short)  # short ones untouched
        lens = np.array([got[u] for u in long_users])
        assert set(lens[lens != np.array([full[u] for u in long_users])]) <= {short - 1}
        kept += lens == np.array([full[u] for u in long_users])
    # kept-whole frequency matches max_len^alpha / n^2 (ones shorter than `short` coincide)
    expected = keep_p.sum() * 5
    assert abs(kept.sum() - expected) < 4 * np.sqrt(expected) + 5
    # the subsample preserves order: its timestamps never decrease and the items are a subsequence
    batch = next(train_batches(syn, 256, max_len, rng=1, stochastic_length_alpha=0.5))
    for b in range(len(batch)):
        n = int(batch.lengths[b])
        ts = batch.timestamps[b, :n]
        assert (ts[1:] >= ts[:-1]).all()
        items = syn.user_events(batch.users[b])[0].tolist()
        seq = batch.items[b, :n].tolist() + [int(batch.targets[b, n - 1])]
        it = iter(items)
        assert all(x in it for x in seq)


def test_pad_histories():
    h = [(np.array([1, 2, 3, 4]), np.array([1, 1, 2, 2]), np.array([10, 20, 30, 40])),
         (np.array([7]), np.array([3]), np.array([5])),
         (np.array([], dtype=np.int64), np.array([], dtype=np.int64), np.array([], dtype=np.int64))]
    batch = pad_histories(h, max_len=3)
    assert batch.items.tolist() == [[2, 3, 4], [7, 0, 0], [0, 0, 0]]
    assert batch.actions.tolist() == [[1, 2, 2], [3, 0, 0], [0, 0, 0]]
    assert batch.timestamps.tolist() == [[20, 30, 40], [5, 0, 0], [0, 0, 0]]
    assert batch.lengths.tolist() == [3, 1, 0]
    assert pad_histories(h[1:2], max_len=5, pad_to_max=True).items.shape == (1, 5)


def test_item_popularity(syn):
    pop = item_popularity(syn)
    expected = np.zeros(syn.num_items + 1, dtype=np.int64)
    for u in range(syn.num_users):
        items = syn.user_events(u)[0]
        np.add.at(expected, items[: len(items) - 2], 1)
    assert np.array_equal(pop, expected) and pop[0] == 0
    assert item_popularity(syn, end_offset=0).sum() == syn.num_events
