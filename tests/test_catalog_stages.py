"""The living catalog through the served stages in one process, without Triton: the catalog model adds and
retires items (one durable change each, numbered), the encoder knows an added item's id, the decoder
generates it and the ranker returns it at the version it names; a retired item is never returned again;
bad requests change nothing; a stage loaded later catches up from the store."""
import json

import numpy as np
import pytest
import torch

from backend_src.config import DecodeOptions
from backend_src.model.catalog import ItemCatalog
from backend_src.model.recommender import GenerativeRecommender, content_vectors
from backend_src.serving.access import ADMIN_KEY_DIGEST_ENV, key_digest
from backend_src.serving.stages.catalog import CatalogStage
from backend_src.serving.stages.decoder import DecoderStage
from backend_src.serving.stages.encoder import EncoderStage
from backend_src.serving.stages.messages import START, StageRequest
from backend_src.serving.stages.ranker import RankerStage
from export import publish as pub
from export.triton_configs import ServingOptions
from genrec_contract import protocol as P
from serving_helpers import build_tiny_checkpoint
from test_stages import item_id, one, params, ranker_request

NUM_ITEMS = 40
CONTENT = content_vectors(NUM_ITEMS)  # the content the tiny model's semantic IDs were fit on


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("catalog-stages")
    build_tiny_checkpoint(tmp / "model.pt", [None] + [item_id(i) for i in range(1, NUM_ITEMS + 1)], 16, seed=5)
    repo = tmp / "model_repository"
    pub.publish(tmp / "model.pt", repo, ServingOptions(ranker_backend="torch", catalog_capacity=6), export_ranker=False)
    return repo


@pytest.fixture()
def stages(repo, tmp_path, monkeypatch):
    monkeypatch.delenv("GENREC_EVENT_LOG", raising=False)
    monkeypatch.delenv(ADMIN_KEY_DIGEST_ENV, raising=False)
    log = tmp_path / "events.sqlite3"
    # the encoder looks at the store before every call; the decoder and the ranker only when a request
    # names a version they have not applied
    made = {name: cls(repo / name / "1", params(repo, name, event_log=log, catalog_poll_s=0 if name == P.ENCODER else 3600))
            for name, cls in ((P.CATALOG, CatalogStage), (P.ENCODER, EncoderStage), (P.DECODER, DecoderStage),
                              (P.RANKER, RankerStage))}
    yield made
    for stage in made.values():
        stage.close()


def catalog(stage, op, key=None, **body):
    inputs = {P.CATALOG_OPERATION.name: np.array([[op.encode()]], dtype=object),
              P.CATALOG_REQUEST.name: np.array([[json.dumps(body).encode()]], dtype=object)}
    if key is not None:
        inputs[P.ADMIN_KEY.name] = np.array([[key.encode()]], dtype=object)
    r = one(stage, StageRequest(inputs))
    if r.error is not None:
        return r
    return json.loads(r.outputs[P.CATALOG_RESULT.name][0, 0])


def near(i, seed):
    v = CONTENT[i - 1].numpy() + 0.01 * np.random.default_rng(seed).standard_normal(CONTENT.shape[1])
    return v.tolist()


def recommend(stages, sid, items, **options):
    n = len(items)
    request = StageRequest({P.ITEM_IDS.name: np.array([[x.encode() for x in items]], dtype=object),
                            P.ACTIONS.name: np.ones((1, n), np.int64),
                            P.TIMESTAMPS.name: (1000 + 60 * np.arange(n, dtype=np.int64))[None]}, sid, START)
    encoded = one(stages[P.ENCODER], request)
    assert encoded.error is None, encoded.error
    decoded = one(stages[P.DECODER], StageRequest({
        P.HISTORY_STATES.name: encoded.outputs[P.HISTORY_STATES.name],
        P.MIN_CATALOG_VERSION.name: encoded.outputs[P.MIN_CATALOG_VERSION.name],
        P.BEAM_WIDTH.name: np.array([[64]], np.int32), P.DECODE_MODE.name: np.array([[b"full"]], dtype=object)}))
    assert decoded.error is None, decoded.error
    ranked = one(stages[P.RANKER], ranker_request(encoded, decoded, **options))
    assert ranked.error is None, ranked.error
    ids = [x.decode() for x in ranked.outputs[P.RECOMMENDED_IDS.name][0] if x]
    return encoded, decoded, ids, int(ranked.outputs[P.CATALOG_VERSION.name][0, 0])


def test_added_items_are_served_and_retired_ones_never_again(stages, repo, tmp_path):
    added = catalog(stages[P.CATALOG], "add", items=[{"id": "new-1", "vector": near(3, 1)},
                                                     {"id": "new-2", "vector": near(9, 2), "text": "a new thing"}])
    assert added["version"] == 1 and [len(i["semantic_id"]) for i in added["items"]] == [4, 4]
    # the encoder knows the new id (its catalog vector), not the one nobody added
    encoded, decoded, ids, version = recommend(stages, 7, [item_id(1), "new-1", "never-added"], TOP_K=42)
    assert int(encoded.outputs[P.UNKNOWN_ITEMS.name][0, 0]) == 1 and int(encoded.outputs[P.MIN_CATALOG_VERSION.name][0, 0]) == 1
    rows = set(decoded.outputs[P.CANDIDATE_ITEMS.name][0].tolist())
    assert {NUM_ITEMS + 2, NUM_ITEMS + 3} <= rows  # the decoder generates both added items
    assert version == 1 and {"new-1", "new-2"} <= set(ids) and len(ids) == NUM_ITEMS + 2
    # served = offline: the whole model with the same catalog changes applied gives the same list
    model = GenerativeRecommender.load(repo.parent / "model.pt")
    model.cfg.catalog_content_weight = 1.0
    ItemCatalog(model, capacity=6).apply(stages[P.CATALOG].store.changes(0))
    stages[P.RANKER].model.cfg.catalog_content_weight = 1.0
    _, _, ids, _ = recommend(stages, 17, [item_id(1), "new-1", "never-added"], TOP_K=12)
    rows = torch.from_numpy(model.item_indices([item_id(1), "new-1", "never-added"], strict=False))[None]
    cache = model.encode(rows, torch.ones_like(rows), 1000 + 60 * torch.arange(3)[None], torch.tensor([3]))
    rec = model.recommend(cache, DecodeOptions(mode="full", beam_width=64), top_k=12, history_items=rows)
    assert ids == [model.row_ids()[i] for i in rec.items[0].tolist()]
    # the same content again: no change; other content: refused unless replaced
    assert catalog(stages[P.CATALOG], "add", items=[{"id": "new-1", "vector": near(3, 1)}])["version"] == 1
    refused = catalog(stages[P.CATALOG], "add", items=[{"id": "new-1", "vector": near(20, 3)}])
    assert refused.status == P.ALREADY_EXISTS and "replace" in refused.error
    assert catalog(stages[P.CATALOG], "add", replace=True, items=[{"id": "new-1", "vector": near(20, 3)}])["version"] == 2
    # retired: a trained item and an added one, never returned again
    assert catalog(stages[P.CATALOG], "retire", ids=["new-2", item_id(4)])["version"] == 3
    _, _, ids, version = recommend(stages, 8, [item_id(1), item_id(2)], TOP_K=42)
    assert version == 3 and not {"new-2", item_id(4)} & set(ids) and "new-1" in ids
    shown = catalog(stages[P.CATALOG], "show", ids=["new-2", item_id(4), "new-1", "nope"])
    assert [(i.get("status"), i.get("live")) for i in shown["items"]] == [
        ("retired", False), ("retired", False), ("live", True), ("unknown", None)]
    listed = catalog(stages[P.CATALOG], "list")
    assert (listed["version"], listed["live"], listed["retired"]) == (3, 1, 2)
    # a stage loaded now (a restart, another replica) catches up before it serves
    late = RankerStage(repo / P.RANKER / "1", params(repo, P.RANKER, event_log=tmp_path / "events.sqlite3"))
    assert late.catalog.version == 3 and late.model.item_indices(["new-1"]).tolist() == [NUM_ITEMS + 2]
    late.close()


@pytest.mark.parametrize("op, body, status, message", [
    ("add", {"items": [{"id": item_id(5), "vector": [1.0] * 8}]}, P.ALREADY_EXISTS, "is a trained item"),
    ("add", {"items": [{"id": "x"}]}, P.INVALID_ARGUMENT, "has no content"),
    ("add", {"items": [{"id": "x", "vector": [1.0] * 3}]}, P.INVALID_ARGUMENT, "must be 8 finite numbers"),
    ("add", {"items": [{"id": "x", "text": "a shirt"}]}, P.INVALID_ARGUMENT, "needs its vector in that space"),
    ("add", {"items": [{"id": "x", "text": "y" * (1 << 20)}]}, P.INVALID_ARGUMENT, "at most 65536 bytes"),
    ("add", {"items": [{"id": f"x{j}", "vector": near(1 + j, j)} for j in range(7)]}, P.RESOURCE_EXHAUSTED,
     "7 new items; 6 of the 6 rows"),
    ("add", {"items": [{"id": "x", "vector": near(1, 0)}, {"id": "x", "vector": near(2, 0)}]}, P.INVALID_ARGUMENT, "x"),
    ("retire", {"ids": ["nope", item_id(1)]}, P.NOT_FOUND, "unknown item ids 'nope'"),
    ("list", {"limit": 0}, P.INVALID_ARGUMENT, "limit"),
    ("drop", {}, P.INVALID_ARGUMENT, "must be one of add, retire, list, show"),
])
def test_bad_catalog_requests_change_nothing(stages, op, body, status, message):
    refused = catalog(stages[P.CATALOG], op, **body)
    assert refused.status == status and message in refused.error, refused.error
    assert stages[P.CATALOG].store.version() == 0


def test_catalog_requests_need_the_servers_admin_key(repo, tmp_path, monkeypatch):
    monkeypatch.setenv(ADMIN_KEY_DIGEST_ENV, key_digest("k" * 20))
    stage = CatalogStage(repo / P.CATALOG / "1", params(repo, P.CATALOG, event_log=tmp_path / "e.sqlite3"))
    for key in (None, "wrong-key-wrong-key"):
        refused = catalog(stage, "add", key=key, items=[{"id": "x", "vector": near(1, 0)}])
        assert refused.status == P.PERMISSION_DENIED and "admin key" in refused.error
    assert catalog(stage, "add", key="k" * 20, items=[{"id": "x", "vector": near(1, 0)}])["version"] == 1
    stage.close()


def test_the_catalog_version_of_a_request_is_applied_before_it_is_served(stages):
    """The decoder and the ranker poll the store rarely here; a request naming a newer version makes
    them apply it at once."""
    catalog(stages[P.CATALOG], "add", items=[{"id": "new-9", "vector": near(11, 9)}])
    assert stages[P.DECODER].catalog.version == 0 and stages[P.RANKER].catalog.version == 0
    _, decoded, ids, version = recommend(stages, 9, [item_id(1)], TOP_K=41)
    assert stages[P.DECODER].catalog.version == 1 and version == 1 and "new-9" in ids
