"""Interaction data: loaders for the supported file formats, each returning a `SequenceData`.

Every loader returns chronological per-user event sequences in a jagged (CSR) layout. Events of a
user are stably sorted by timestamp, so events with equal timestamps keep their file order.

Supported formats (auto-detected by `load_dataset`):
  - MovieLens 1M `ratings.dat` (`UserID::MovieID::Rating::Timestamp`, plain or .gz) + `movies.dat`
  - MovieLens 100K `u.data` (tab separated `user item rating timestamp`) + `u.item`
  - Amazon 5-core sequential split (`sequential_data.txt`, `interactions.tsv.gz`,
    `item2attributes_s3rec_ids.json`), as used by S3-Rec / P5 / TIGER
  - Amazon 2018 JSON maps (`*.inter.json` user -> ordered items, `*.item.json` item -> text fields)
  - Amazon's own review releases, one JSON object a line (2014 and 2018: `reviews_<Category>_5.json.gz`,
    `<Category>_5.json.gz`; 2023: `<Category>.jsonl.gz`), with the category's `meta_*` file beside it
  - generic CSV `user,item,timestamp[,action]` with a header line

Parsing is whole-file: the text is split once and converted with numpy; a slow line-by-line scan
runs only to name the offending line when the fast path finds a malformed row.
"""
from __future__ import annotations

import ast
import gzip
import json
import os
import re
from pathlib import Path

import numpy as np

from .sequence_data import DAY, SequenceData
from .synthetic import generate_synthetic, parse_synthetic_spec

# repo_root/../shared/data unless GENREC_DATA_DIR says otherwise
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"

NAMED_DATASETS = ("amazon-beauty", "ml-1m", "ml-100k", "amazon-scientific")


def data_dir() -> Path:
    """Folder holding the named data sets."""
    return Path(os.environ.get("GENREC_DATA_DIR", DEFAULT_DATA_DIR))


class DataFormatError(ValueError):
    """A malformed input row; the message names the file, the 1-based line and the problem."""


# --------------------------------------------------------------------------------------------
# assembling a SequenceData from flat event columns


def build_sequence_data(name: str, users, items, actions, timestamps, *, item_text=None,
                        item_attributes=None, min_events: int = 3,
                        max_users: int | None = None) -> SequenceData:
    """Group flat events (in file order) into per-user chronological sequences.

    users/items: raw ids (int or str arrays). Users are ordered by first appearance in the input;
    items are indexed 1..I in sorted raw-id order over the events that are kept.
    item_text / item_attributes: dicts keyed by raw item id (entries for dropped items are ignored).
    min_events: drop users with fewer events; max_users: then keep the first N users.
    """
    users = np.asarray(users)
    items = np.asarray(items)
    actions = np.asarray(actions, dtype=np.int64)
    timestamps = np.asarray(timestamps, dtype=np.int64)

    uniq_users, first_seen, user_inv = np.unique(users, return_index=True, return_inverse=True)
    by_first = np.argsort(first_seen, kind="stable")
    user_row = np.empty(len(uniq_users), dtype=np.int64)
    user_row[by_first] = np.arange(len(uniq_users))
    row = user_row[user_inv]  # [E] user row in file order of first appearance
    user_ids = uniq_users[by_first]

    keep = np.bincount(row, minlength=len(user_ids)) >= min_events
    if max_users is not None:
        keep &= np.cumsum(keep) <= max_users
    new_row = np.cumsum(keep) - 1
    mask = keep[row]
    row, items, actions, timestamps = new_row[row[mask]], items[mask], actions[mask], timestamps[mask]
    user_ids = user_ids[keep]

    # stable: by user, then by time, ties keep file order
    order = np.argsort(timestamps, kind="stable")
    order = order[np.argsort(row[order], kind="stable")]
    row, items, actions, timestamps = row[order], items[order], actions[order], timestamps[order]

    uniq_items, item_inv = np.unique(items, return_inverse=True)
    item_ids = np.empty(len(uniq_items) + 1, dtype=object)
    item_ids[0] = None
    item_ids[1:] = uniq_items.tolist()  # python ints / strs
    offsets = np.zeros(len(user_ids) + 1, dtype=np.int64)
    np.cumsum(np.bincount(row, minlength=len(user_ids)), out=offsets[1:])

    def by_index(raw_map):
        if raw_map is None:
            return None
        return {i: raw_map[raw] for i, raw in enumerate(item_ids.tolist()) if i > 0 and raw in raw_map}

    return SequenceData(name=name, user_ids=user_ids, item_ids=item_ids, offsets=offsets,
                        items=item_inv.astype(np.int64).reshape(-1) + 1, actions=actions,
                        timestamps=timestamps, item_text=by_index(item_text),
                        item_attributes=by_index(item_attributes))


def hold_out_items(data: SequenceData, share: float, seed: int = 0) -> tuple[SequenceData, np.ndarray]:
    """`data` without a random `share` of its items: their events are removed from every sequence,
    as if they had never been in the catalog (the cold-start protocol of *Unifying Generative and
    Dense Retrieval for Sequential Recommendation*). Returns (that data, the held-out items' indices
    in `data`). Users left with fewer than 3 events are dropped."""
    rng = np.random.default_rng(seed)
    held = np.sort(rng.choice(np.arange(1, data.num_items + 1), int(round(share * data.num_items)), replace=False))
    keep = ~np.isin(data.items, held)
    user = np.repeat(np.arange(data.num_users), np.diff(data.offsets))[keep]
    raw = lambda m: None if m is None else {data.item_ids[i]: v for i, v in m.items()}  # noqa: E731
    filtered = build_sequence_data(data.name, data.user_ids[user], data.item_ids[data.items[keep]], data.actions[keep],
                                   data.timestamps[keep], item_text=raw(data.item_text),
                                   item_attributes=raw(data.item_attributes))
    return filtered, held


# --------------------------------------------------------------------------------------------
# fast delimited-text parsing with line-accurate errors


def _read_text(path: Path, encoding: str = "utf-8") -> str:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataFormatError(f"{path}:{line}: not valid {encoding} text") from None
    return text.replace("\r\n", "\n")


class _Table:
    """Rows of a delimited text file split into string columns, remembering source line numbers."""

    def __init__(self, path: Path, text: str, sep: str | None, ncols: int, header: bool = False,
                 layout: str = ""):
        self.path, self.sep, self.ncols = path, sep, ncols
        layout = layout or f"{ncols} fields"
        lines = text.split("\n")
        first_line = 1
        if header:
            self.header = lines[0] if lines else ""
            lines, first_line = lines[1:], 2
        # skip blank lines but remember where every row came from
        blank = [not ln.strip() for ln in lines]
        if any(blank):
            self.line_numbers = np.flatnonzero(~np.asarray(blank)) + first_line
            lines = [ln for ln, b in zip(lines, blank) if not b]
        else:
            self.line_numbers = np.arange(len(lines)) + first_line
        self.num_rows = len(lines)
        if not lines:
            self.columns = [[] for _ in range(ncols)]
            return
        if sep is None:  # whitespace separated
            counts = [len(ln.split()) for ln in lines]
            bad = [i for i, c in enumerate(counts) if c != ncols]
            if bad:
                self.fail(bad[0], f"expected {layout}, got {counts[bad[0]]}: {lines[bad[0]]!r}")
            tokens = " ".join(lines).split()
        else:
            counts = [ln.count(sep) for ln in lines]
            bad = [i for i, c in enumerate(counts) if c != ncols - 1]
            if bad:
                self.fail(bad[0], f"expected {layout}, got {counts[bad[0]] + 1}: {lines[bad[0]]!r}")
            tokens = sep.join(lines).split(sep)
        self.columns = [tokens[j::ncols] for j in range(ncols)]

    def fail(self, row: int, what: str):
        raise DataFormatError(f"{self.path}:{int(self.line_numbers[row])}: {what}")

    def ints(self, col: int, name: str) -> np.ndarray:
        values = self.columns[col]
        try:
            return np.array(values, dtype=np.int64) if values else np.zeros(0, dtype=np.int64)
        except (ValueError, OverflowError):
            for r, v in enumerate(values):
                try:
                    int(v)
                except ValueError:
                    self.fail(r, f"{name} {v.strip()!r} is not an integer")
            raise

    def ids(self, col: int, name: str) -> np.ndarray:
        """Integer ids where every value is an integer, else the stripped strings."""
        values = [v.strip() for v in self.columns[col]]
        for r, v in enumerate(values):
            if not v:
                self.fail(r, f"{name} is empty")
        try:
            return np.array(values, dtype=np.int64)
        except (ValueError, OverflowError):
            return np.array(values, dtype=object)

    def check_range(self, values: np.ndarray, lo: int, hi: int, name: str):
        bad = np.flatnonzero((values < lo) | (values > hi))
        if len(bad):
            self.fail(bad[0], f"{name} {values[bad[0]]} is out of range {lo}..{hi}")


# --------------------------------------------------------------------------------------------
# MovieLens


def load_movielens(ratings_path, movies_path=None, *, min_events: int = 3,
                   max_users: int | None = None, name: str | None = None) -> SequenceData:
    """MovieLens 1M-style `UserID::MovieID::Rating::Timestamp` (plain or .gz); actions = ratings.

    movies_path: `MovieID::Title::Genres` (latin-1); defaults to movies.dat next to the ratings.
    """
    ratings_path = Path(ratings_path)
    users, items, ratings, ts = _rating_columns(ratings_path, "::", "4 fields UserID::MovieID::Rating::Timestamp",
                                                ("UserID", "MovieID", "Rating", "Timestamp"))
    movies_path = _beside(ratings_path, movies_path, "movies.dat")
    item_text = _movielens_titles(movies_path) if movies_path else None
    return build_sequence_data(name or ratings_path.parent.name, users, items, ratings, ts,
                               item_text=item_text, min_events=min_events, max_users=max_users)


def _rating_columns(path: Path, sep: str, layout: str, names: tuple) -> tuple:
    """user, item, rating (1..5), timestamp integer columns of a MovieLens-style ratings file."""
    table = _Table(path, _read_text(path, "latin-1"), sep, 4, layout=layout)
    users, items, ratings, ts = (table.ints(i, name) for i, name in enumerate(names))
    table.check_range(ratings, 1, 5, names[2])
    return users, items, ratings, ts


def _beside(path: Path, given, default_name: str) -> Path | None:
    """The companion file given, else `default_name` next to `path` if it exists."""
    if given is not None:
        return Path(given)
    candidate = path.parent / default_name
    return candidate if candidate.exists() else None


def _movielens_titles(path: Path) -> dict:
    table = _Table(path, _read_text(path, "latin-1"), "::", 3, layout="3 fields MovieID::Title::Genres")
    ids = table.ints(0, "MovieID")
    return {int(i): f"{title} | {genres.replace('|', ', ')}"
            for i, title, genres in zip(ids, table.columns[1], table.columns[2])}


ML100K_GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
                 "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
                 "Romance", "Sci-Fi", "Thriller", "War", "Western")


def load_ml100k(data_path, item_path=None, *, min_events: int = 3, max_users: int | None = None,
                name: str | None = None) -> SequenceData:
    """MovieLens 100K `u.data` (tab separated user item rating timestamp); `u.item` gives titles."""
    data_path = Path(data_path)
    users, items, ratings, ts = _rating_columns(data_path, "\t", "4 tab-separated fields user item rating timestamp",
                                                ("user", "item", "rating", "timestamp"))
    item_path = _beside(data_path, item_path, "u.item")
    item_text = _ml100k_titles(item_path) if item_path else None
    return build_sequence_data(name or data_path.parent.name, users, items, ratings, ts,
                               item_text=item_text, min_events=min_events, max_users=max_users)


def _ml100k_titles(path: Path) -> dict:
    # movie id | title | release date | video release date | IMDb URL | 19 genre flags
    ncols = 5 + len(ML100K_GENRES)
    table = _Table(path, _read_text(path, "latin-1"), "|", ncols, layout=f"{ncols} '|'-separated fields")
    ids = table.ints(0, "movie id")
    flags = np.stack([table.ints(5 + g, "genre flag") for g in range(len(ML100K_GENRES))], axis=1)
    names = np.array(ML100K_GENRES, dtype=object)
    return {int(i): f"{title} | {', '.join(names[f.astype(bool)])}"
            for i, title, f in zip(ids, table.columns[1], flags)}


# --------------------------------------------------------------------------------------------
# Amazon


def load_amazon_sequential(folder, *, min_events: int = 3, max_users: int | None = None,
                           name: str | None = None) -> SequenceData:
    """Amazon 5-core sequential split (S3-Rec / P5 / TIGER): the data set's own user and item ids.

    sequential_data.txt: `user item item ...` in time order. interactions.tsv(.gz), when present,
    gives `days_since_user_first` per (user_idx, pos): timestamps = days * 86400; otherwise the
    position is used as the day. item2attributes_s3rec_ids.json gives item attributes. No ratings
    in this split: actions = 0.
    """
    folder = Path(folder)
    seq_path = folder / "sequential_data.txt"
    text = _read_text(seq_path)
    lines = text.split("\n")
    tokens = [ln.split() for ln in lines]
    rows = [(i, t) for i, t in enumerate(tokens) if t]
    for i, t in rows:
        if len(t) < 2:
            raise DataFormatError(f"{seq_path}:{i + 1}: expected `user item [item ...]`, got {lines[i]!r}")
    lengths = np.array([len(t) - 1 for _, t in rows], dtype=np.int64)
    line_of_user = np.array([i + 1 for i, _ in rows], dtype=np.int64)
    flat = [x for _, t in rows for x in t]
    try:
        values = np.array(flat, dtype=np.int64)
    except ValueError:
        for i, t in rows:
            for x in t:
                try:
                    int(x)
                except ValueError:
                    raise DataFormatError(f"{seq_path}:{i + 1}: id {x!r} is not an integer") from None
        raise
    starts = np.cumsum(lengths + 1) - (lengths + 1)  # position of each line's user id in `values`
    user_of_line = values[starts]
    is_item = np.ones(len(values), dtype=bool)
    is_item[starts] = False
    items = values[is_item]
    users = np.repeat(user_of_line, lengths)
    pos = np.arange(len(items)) - np.repeat(np.cumsum(lengths) - lengths, lengths)

    days = pos.copy()
    tsv = next((p for p in (folder / "interactions.tsv.gz", folder / "interactions.tsv") if p.exists()), None)
    if tsv is not None:
        days = _amazon_days(tsv, users, items, pos, seq_path, line_of_user, lengths)

    attributes = None
    attr_path = folder / "item2attributes_s3rec_ids.json"
    if attr_path.exists():
        attr_raw = _read_json(attr_path)
        attributes = {}
        for k, v in attr_raw.items():
            try:
                attributes[int(k)] = [int(a) for a in v]
            except (TypeError, ValueError):
                raise DataFormatError(f"{attr_path}:{_json_key_line(attr_path, k)}: item {k!r} "
                                      f"needs an integer id and a list of integer attributes") from None
    return build_sequence_data(name or folder.name, users, items, np.zeros(len(items), np.int64),
                               days * DAY, item_attributes=attributes, min_events=min_events,
                               max_users=max_users)


def _amazon_days(tsv: Path, users, items, pos, seq_path, line_of_user, lengths) -> np.ndarray:
    """days_since_user_first of every sequence event, matched by (user_idx, pos)."""
    text = _read_text(tsv)
    header = text.split("\n", 1)[0].split("\t")
    need = ("user_idx", "item_idx", "pos", "days_since_user_first")
    missing = [c for c in need if c not in header]
    if missing:
        raise DataFormatError(f"{tsv}:1: header lacks column(s) {missing}: {header}")
    table = _Table(tsv, text, "\t", len(header), header=True,
                   layout=f"{len(header)} tab-separated fields")
    t_user, t_item, t_pos, t_days = (table.ints(header.index(c), c) for c in need)
    # one key per (user, position); look every sequence event up among the tsv keys
    stride = int(max(pos.max(initial=0), t_pos.max(initial=0))) + 1
    t_key = t_user * stride + t_pos
    key = users * stride + pos
    order = np.argsort(t_key, kind="stable")
    found = np.searchsorted(t_key[order], key)
    found = np.minimum(found, len(order) - 1)
    hit = order[found] if len(order) else np.zeros(len(key), np.int64)
    ok = (t_key[hit] == key) if len(order) else np.zeros(len(key), bool)
    if not ok.all():
        e = int(np.flatnonzero(~ok)[0])
        u = np.searchsorted(np.cumsum(lengths), e, side="right")
        raise DataFormatError(f"{seq_path}:{line_of_user[u]}: no row for user_idx {users[e]} pos "
                              f"{pos[e]} in {tsv.name}")
    wrong = np.flatnonzero(t_item[hit] != items)
    if len(wrong):
        r = int(hit[wrong[0]])
        table.fail(r, f"item_idx {t_item[r]} disagrees with {seq_path.name} (item "
                      f"{items[wrong[0]]} at user_idx {t_user[r]} pos {t_pos[r]})")
    return t_days[hit]


def _read_json(path: Path):
    text = _read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataFormatError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None


def _json_key_line(path: Path, key) -> int:
    """Line of the first `"key":` in a JSON file (for error messages)."""
    text = _read_text(path)
    at = text.find(f'"{key}"')
    return text.count("\n", 0, max(at, 0)) + 1


def load_amazon_json(inter_path, item_path=None, *, min_events: int = 3,
                     max_users: int | None = None, name: str | None = None) -> SequenceData:
    """Amazon 2018 JSON maps: `*.inter.json` user -> ordered item list, `*.item.json` item -> fields.

    Ordered without time: timestamps = position * 86400. item_text from title/brand/categories/
    description. Actions = 0.
    """
    inter_path = Path(inter_path)
    inter = _read_json(inter_path)
    if not isinstance(inter, dict):
        raise DataFormatError(f"{inter_path}:1: expected an object user -> list of items")
    if item_path is None:
        guess = inter_path.with_name(inter_path.name.replace(".inter.json", ".item.json"))
        item_path = guess if guess.exists() else None
    item_map = _read_json(Path(item_path)) if item_path else None

    users, items, pos = [], [], []
    for u, seq in inter.items():
        if not isinstance(seq, list):
            raise DataFormatError(f"{inter_path}:{_json_key_line(inter_path, u)}: user {u!r}: "
                                  f"expected a list of items, got {type(seq).__name__}")
        users.extend([u] * len(seq))
        items.extend(str(i) for i in seq)
        pos.extend(range(len(seq)))
    if item_map is not None:
        unknown = [(u, i) for u, i in zip(users, items) if i not in item_map]
        if unknown:
            u, i = unknown[0]
            raise DataFormatError(f"{inter_path}:{_json_key_line(inter_path, u)}: user {u!r} has item "
                                  f"{i!r} that is not in {Path(item_path).name}")
    users_arr = _maybe_int_ids(users)
    items_arr = _maybe_int_ids(items)
    item_text = None
    if item_map is not None:
        fields = ("title", "brand", "categories", "description")
        item_text = {}
        for k, v in item_map.items():
            if not isinstance(v, dict):
                raise DataFormatError(f"{item_path}:{_json_key_line(Path(item_path), k)}: item {k!r}: "
                                      f"expected an object of text fields")
            text = " | ".join(str(v[f]).strip() for f in fields if v.get(f) and str(v[f]).strip())
            item_text[_as_id(k, items_arr.dtype)] = text
    stem = inter_path.name.replace(".inter.json", "")
    return build_sequence_data(name or inter_path.parent.name or stem, users_arr, items_arr,
                               np.zeros(len(items), np.int64), np.asarray(pos, np.int64) * DAY,
                               item_text=item_text, min_events=min_events, max_users=max_users)


def _maybe_int_ids(values: list) -> np.ndarray:
    try:
        return np.array(values, dtype=np.int64)
    except (ValueError, OverflowError):
        return np.array(values, dtype=object)


def _as_id(key: str, dtype):
    if dtype == np.int64:
        try:
            return int(key)
        except ValueError:
            return key
    return key


# --------------------------------------------------------------------------------------------
# Amazon's own review releases

# per release: the user, item and time keys of a review, and the time's units per second
_REVIEW_KEYS = (("reviewerID", "asin", "unixReviewTime", 1),  # 2014, 2018
                ("user_id", "parent_asin", "timestamp", 1000))  # 2023: items grouped by parent, time in ms
_JSON_LINES = (".json", ".json.gz", ".jsonl", ".jsonl.gz")


def _json_line(line: str):
    """One line's object: JSON, or the Python literal the 2014 metadata files are written as."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return ast.literal_eval(line)


def _review_keys(path: Path) -> tuple | None:
    """The release's keys when the file's first line is a review, else None."""
    if not path.name.endswith(_JSON_LINES) or path.name.startswith("meta_") or path.name.endswith((".inter.json", ".item.json")):
        return None
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            first = _json_line(f.readline())
    except (OSError, UnicodeDecodeError, ValueError, SyntaxError, EOFError):
        return None
    if isinstance(first, dict):
        return next((keys for keys in _REVIEW_KEYS if all(k in first for k in keys[:3])), None)
    return None


def _review_files(folder: Path) -> list:
    return [p for p in sorted(folder.iterdir()) if p.is_file() and _review_keys(p)]


def _category(path: Path) -> str:
    """`reviews_Sports_5.json.gz`, `Sports_5.json.gz`, `Sports.jsonl.gz`, `meta_Sports.json.gz` -> `Sports`."""
    stem = path.name
    for suffix in (".gz", ".jsonl", ".json"):
        stem = stem.removesuffix(suffix)
    return stem.removeprefix("reviews_").removeprefix("meta_").removesuffix("_5")


def _meta_beside(path: Path) -> Path | None:
    """The category's metadata file in the same folder: the one named for it, else the only one."""
    metas = [p for p in sorted(path.parent.glob("meta_*")) if p.name.endswith(_JSON_LINES)]
    named = [p for p in metas if _category(p) == _category(path)]
    if len(named) == 1:
        return named[0]
    return metas[0] if len(metas) == 1 else None


def _flat_text(value) -> str:
    """A metadata field as text: lists (of lists) joined by commas."""
    if isinstance(value, (list, tuple)):
        return ", ".join(t for t in (_flat_text(v) for v in value) if t)
    return str(value).strip() if value is not None else ""


def _item_texts(meta_path: Path, item_key: str, wanted: set) -> dict:
    """item -> "title | brand | categories | description" for the items in `wanted` (other lines are
    skipped unparsed: a category's metadata lists many more items than its 5-core reviews)."""
    key = re.compile(r"""['"]%s['"]\s*:\s*['"]([^'"]+)['"]""" % re.escape(item_key))
    texts = {}
    for n, line in enumerate(_read_text(meta_path).split("\n"), 1):
        found = key.search(line)
        if not found or found.group(1) not in wanted:
            continue
        try:
            meta = _json_line(line)
        except (ValueError, SyntaxError):
            raise DataFormatError(f"{meta_path}:{n}: neither JSON nor a Python literal") from None
        fields = (meta.get("title"), meta.get("brand") or meta.get("store"),
                  meta.get("categories") or meta.get("category"), meta.get("description"))
        texts[found.group(1)] = " | ".join(t for t in map(_flat_text, fields) if t)
    return texts


def load_amazon_reviews(path, meta_path=None, *, min_events: int = 3, max_users: int | None = None,
                        name: str | None = None) -> SequenceData:
    """Amazon's own review files, one review a line, as its releases publish them: 2014 and 2018
    (`reviewerID`, `asin`, `unixReviewTime` in seconds) and 2023 (`user_id`, `parent_asin`, `timestamp`
    in milliseconds). A review is one event (actions = 0; its rating is not used); the same user,
    item and time twice is one event (the 2018 files repeat some reviews). item_text from the
    category's metadata (`meta_*`, beside the file unless meta_path names it): title, brand (2023:
    store), categories, description. No k-core filter beyond min_events: the 5-core files are already
    filtered."""
    path = Path(path)
    keys = _review_keys(path)
    if keys is None:
        raise DataFormatError(f"{path}:1: not an Amazon review file (a JSON object with reviewerID, asin and "
                              f"unixReviewTime, or user_id, parent_asin and timestamp)")
    user_key, item_key, time_key, per_second = keys
    users, items, times, seen = [], [], [], set()
    for n, line in enumerate(_read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            review = json.loads(line)
            event = (str(review[user_key]), str(review[item_key]), int(review[time_key]) // per_second)
        except json.JSONDecodeError as e:
            raise DataFormatError(f"{path}:{n}: invalid JSON: {e.msg}") from None
        except KeyError as e:
            raise DataFormatError(f"{path}:{n}: review without {e.args[0]!r}") from None
        except (TypeError, ValueError):
            raise DataFormatError(f"{path}:{n}: {time_key} {review[time_key]!r} is not an integer") from None
        if event not in seen:
            seen.add(event)
            users.append(event[0])
            items.append(event[1])
            times.append(event[2])
    meta_path = Path(meta_path) if meta_path else _meta_beside(path)
    item_text = _item_texts(meta_path, item_key, set(items)) if meta_path else None
    return build_sequence_data(name or _category(path), np.array(users, dtype=object), np.array(items, dtype=object),
                               np.zeros(len(items), np.int64), np.asarray(times, np.int64), item_text=item_text,
                               min_events=min_events, max_users=max_users)


# --------------------------------------------------------------------------------------------
# generic CSV

_CSV_COLUMNS = {
    "user": ("user", "user_id", "userid", "user_idx"),
    "item": ("item", "item_id", "itemid", "item_idx", "movie_id", "movieid"),
    "timestamp": ("timestamp", "time", "ts", "unix_time"),
    "action": ("action", "rating", "event", "action_id"),
}
MAX_CSV_ACTION = 6  # action 7 is reserved for ranking-target tokens


def load_csv(path, *, min_events: int = 3, max_users: int | None = None,
             name: str | None = None) -> SequenceData:
    """Generic CSV `user,item,timestamp[,action]` with a header line.

    Columns are found by header name (user/item/timestamp/action and common synonyms), else by
    position. Timestamps and actions must be integers (actions 0..6; 7 is reserved); user and item
    ids are integers where all of them are, else strings.
    """
    path = Path(path)
    text = _read_text(path)
    header_line = text.split("\n", 1)[0]
    header = [h.strip().lower() for h in header_line.split(",")]
    if len(header) not in (3, 4):
        raise DataFormatError(f"{path}:1: expected a header user,item,timestamp[,action], "
                              f"got {header_line!r}")
    cols = {}
    for role, names in _CSV_COLUMNS.items():
        hit = [j for j, h in enumerate(header) if h in names]
        if hit:
            cols[role] = hit[0]
    if len(cols) != len(header) or len(set(cols.values())) != len(cols):
        cols = dict(zip(("user", "item", "timestamp", "action"), range(len(header))))
    table = _Table(path, text, ",", len(header), header=True,
                   layout=f"{len(header)} comma-separated fields ({header_line.strip()})")
    users = table.ids(cols["user"], "user")
    items = table.ids(cols["item"], "item")
    ts = table.ints(cols["timestamp"], "timestamp")
    if "action" in cols:
        actions = table.ints(cols["action"], "action")
        table.check_range(actions, 0, MAX_CSV_ACTION, "action")
    else:
        actions = np.zeros(len(ts), np.int64)
    return build_sequence_data(name or path.stem, users, items, actions, ts,
                               min_events=min_events, max_users=max_users)


# --------------------------------------------------------------------------------------------
# dispatch


def detect_format(path) -> str:
    """One of movielens, ml100k, amazon_sequential, amazon_json, amazon_reviews, csv (for a file or a folder)."""
    path = Path(path)
    if path.is_dir():
        if (path / "sequential_data.txt").exists():
            return "amazon_sequential"
        if list(path.glob("*.inter.json")):
            return "amazon_json"
        if _movielens_ratings_file(path) is not None:
            return "movielens"
        if (path / "u.data").exists():
            return "ml100k"
        if len(list(path.glob("*.csv"))) == 1:
            return "csv"
        reviews = _review_files(path)
        if len(reviews) == 1:
            return "amazon_reviews"
        if reviews:
            raise DataFormatError(f"{path}: several review files ({', '.join(p.name for p in reviews)}): "
                                  f"pass the one to load")
        raise DataFormatError(f"{path}: no known data set layout in this folder")
    n = path.name
    if n == "sequential_data.txt":
        return "amazon_sequential"
    if n.endswith(".inter.json"):
        return "amazon_json"
    if _review_keys(path):
        return "amazon_reviews"
    if n.endswith((".csv", ".csv.gz")):
        return "csv"
    if n in ("u.data",) or n.endswith(".data"):
        return "ml100k"
    if n.endswith((".dat", ".dat.gz")):
        return "movielens"
    raise DataFormatError(f"{path}: cannot tell the format from the file name")


def _movielens_ratings_file(folder: Path) -> Path | None:
    for pattern in ("ratings.dat", "ratings.dat.gz", "ratings*.dat", "ratings*.dat.gz"):
        hits = sorted(folder.glob(pattern))
        if hits:
            return hits[0]
    return None


def load_path(path, *, min_events: int = 3, max_users: int | None = None) -> SequenceData:
    """Load a file or folder in any supported format (auto-detected)."""
    path = Path(path)
    fmt = detect_format(path)
    kw = dict(min_events=min_events, max_users=max_users)
    if fmt == "amazon_sequential":
        return load_amazon_sequential(path if path.is_dir() else path.parent, **kw)
    if fmt == "amazon_json":
        inter = next(iter(sorted(path.glob("*.inter.json")))) if path.is_dir() else path
        return load_amazon_json(inter, name=path.name if path.is_dir() else None, **kw)
    if fmt == "amazon_reviews":
        return load_amazon_reviews(_review_files(path)[0] if path.is_dir() else path,
                                   name=path.name if path.is_dir() else None, **kw)
    if fmt == "movielens":
        f = _movielens_ratings_file(path) if path.is_dir() else path
        return load_movielens(f, name=path.name if path.is_dir() else None, **kw)
    if fmt == "ml100k":
        return load_ml100k(path / "u.data" if path.is_dir() else path, **kw)
    f = next(iter(path.glob("*.csv"))) if path.is_dir() else path
    return load_csv(f, **kw)


def load_dataset(spec: str, *, min_events: int = 3, max_users: int | None = None,
                 root=None) -> SequenceData:
    """Load a data set by name or path.

    spec: "synthetic" or "synthetic:users=2000,items=1000,clusters=20,seed=0"; a named folder
    under the data dir ("amazon-beauty", "ml-1m", "ml-100k", "amazon-scientific"); or any file or
    folder path in a supported format.
    """
    spec = str(spec)
    if spec == "synthetic" or spec.startswith("synthetic:"):
        data = generate_synthetic(**parse_synthetic_spec(spec))
        if min_events > 0 or max_users is not None:
            keep = np.flatnonzero(data.lengths >= min_events)
            if max_users is not None:
                keep = keep[:max_users]
            if len(keep) != data.num_users:
                data = data.select_users(keep)
        return data
    root = Path(root) if root is not None else data_dir()
    named = root / spec
    if spec in NAMED_DATASETS or (not Path(spec).exists() and named.exists()):
        if not named.exists():
            raise FileNotFoundError(f"data set {spec!r} not found under {root}")
        return load_path(named, min_events=min_events, max_users=max_users)
    if not Path(spec).exists():
        raise FileNotFoundError(f"{spec!r} is neither a known data set name "
                                f"({', '.join(('synthetic',) + NAMED_DATASETS)}) nor an existing path")
    return load_path(Path(spec), min_events=min_events, max_users=max_users)
