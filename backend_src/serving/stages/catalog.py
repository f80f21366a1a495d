"""catalog: adds, retires, lists and shows items while the other models serve (model/catalog.py places
them; serving/catalog_store keeps the changes, numbered, beside the event log; every stage of every
replica follows the store, stages/catalog_sync.py).

One request is one operation (CATALOG_OPERATION) with its arguments as JSON (CATALOG_REQUEST):

    add     {"items": [{"id": "sku-1", "text": "...", "attributes": [...], "vector": [...]}, ...], "replace": false}
    retire  {"ids": ["sku-1", ...]}
    list    {"offset": 0, "limit": 100, "status": "live" | "retired" | null}
    show    {"ids": ["sku-1", ...]}

An add or a retire of up to 10,000 items is one change, whole or not at all: every item is checked
and embedded before the store takes the change in one transaction, so a request refused or cut off
(a killed stub) changes nothing, and sending it again after a lost answer changes nothing more.
Content: `text` (what the item says: embedded by the text encoder the version's semantic IDs were fit
with), `attributes` (ids or words, appended to the text: an item with attributes only is embedded as
the text of its attributes), or `vector` (its embedding in the space the IDs were fit in, the only
content a version whose IDs were not fit on text takes). The answer names the catalog version made
and, per added item, its semantic ID. Where the server has an admin key, every operation needs it
(ADMIN_KEY), checked against its digest (the models never hold the key).
"""
from __future__ import annotations

import hmac
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Mapping

import numpy as np
import torch.nn.functional as F

from backend_src.model.catalog import TEXT_ENCODER_SOURCE
from backend_src.model.recommender import GenerativeRecommender
from backend_src.model.text_encoder import embed_in_subprocess
from backend_src.serving import validation as V
from backend_src.serving.access import ADMIN_KEY_DIGEST_ENV, key_digest
from backend_src.serving.catalog_store import DEFAULT_MAX_ITEMS, CatalogConflict, CatalogEntry
from backend_src.serving.stages.catalog_sync import CatalogSync
from backend_src.serving.stages.messages import StageRequest, StageResponse
from genrec_contract import protocol as P

MAX_TEXT_BYTES = 64 << 10  # an item's text; the encoder reads its first 128 tokens
MAX_ATTRIBUTES = 256
MAX_LIST = 10_000


class CatalogStage:
    def __init__(self, version_dir: Path, params: Mapping):
        self.version_dir = Path(version_dir)
        self.model = GenerativeRecommender.load(self.version_dir / "catalog.pt")  # the codebook and the item ids
        # the catalog as every stage has it: what they could not place is refused here first
        self.sync = CatalogSync(self.model, params, version_dir, P.CATALOG)
        self.store = self.sync.store
        self.admin_digest = os.environ.get(ADMIN_KEY_DIGEST_ENV)

    # ---- one request ---------------------------------------------------------------------------
    def _parse(self, request: StageRequest) -> tuple[str, dict]:
        read = lambda spec: V.read_input(request.inputs, spec, {}, 1)  # noqa: E731 - each input one string
        op = V.decode_strings(read(P.CATALOG_OPERATION), P.CATALOG_OPERATION.name)[0]
        if op not in P.CATALOG_OPERATIONS:
            raise V.RequestError(f"{P.CATALOG_OPERATION.name} must be one of {', '.join(P.CATALOG_OPERATIONS)}, got {P.preview(op)}")
        if self.admin_digest:
            key = read(P.ADMIN_KEY)
            given = V.decode_strings(key, P.ADMIN_KEY.name)[0] if key is not None else ""
            if not hmac.compare_digest(key_digest(given.strip()), self.admin_digest):
                raise V.RequestError(f"catalog {op}: {'a wrong' if given else 'no'} admin key (ADMIN_KEY): the server "
                                     "takes catalog requests with its admin key only", P.PERMISSION_DENIED)
        text = V.decode_strings(read(P.CATALOG_REQUEST), P.CATALOG_REQUEST.name)[0]
        try:
            body = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as e:
            raise V.RequestError(f"{P.CATALOG_REQUEST.name} is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise V.RequestError(f"{P.CATALOG_REQUEST.name} must be a JSON object, got {type(body).__name__}")
        return op, body

    def handle(self, requests: list) -> list:
        responses = []
        for request in requests:
            try:
                op, body = self._parse(request)
                self.sync.sync()
                result = getattr(self, op)(body)
                responses.append(StageResponse({
                    P.CATALOG_RESULT.name: np.array([[json.dumps(result).encode()]], dtype=object),
                    P.CATALOG_VERSION.name: np.array([[self.sync.version]], dtype=np.int64),
                }))
            except CatalogConflict as e:
                responses.append(StageResponse(error=f"catalog add: {e}; send it with \"replace\": true to change it",
                                               status=P.ALREADY_EXISTS))
            except ValueError as e:  # the store's checks of ids and content
                responses.append(StageResponse.failed(e if isinstance(e, V.RequestError) else V.RequestError(str(e)),
                                                      P.CATALOG))
            except Exception as e:  # noqa: BLE001 - the store unreachable, or the stage failed: nothing committed
                status = P.UNAVAILABLE if isinstance(e, ConnectionError) else None
                responses.append(StageResponse(error=f"catalog: {type(e).__name__}: {P.preview(str(e), 240)}", status=status)
                                 if status else StageResponse.internal(e, P.CATALOG))
        return responses

    # ---- operations ----------------------------------------------------------------------------
    def _ids(self, body: dict, key: str = "ids") -> list:
        ids = body.get(key)
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
            raise V.RequestError(f"catalog: \"{key}\" must be a non-empty list of item ids (strings)")
        if len(ids) > DEFAULT_MAX_ITEMS:
            raise V.RequestError(f"catalog: {len(ids)} items in one request; at most {DEFAULT_MAX_ITEMS}")
        V.check_item_ids(ids, key)
        return ids

    def _known(self, item_id: str) -> bool:
        return item_id in self.sync.catalog.trained_index or item_id in self.sync.catalog.row_of

    def add(self, body: dict) -> dict:
        items = body.get("items")
        if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
            raise V.RequestError('catalog add: "items" must be a non-empty list of objects {"id": ..., "text" | '
                                 '"attributes" | "vector": ...}')
        ids = self._ids({"ids": [i.get("id") for i in items]})
        replace = bool(body.get("replace", False))
        catalog = self.sync.catalog
        live_trained = [i for i in ids if i in catalog.trained_index and bool(catalog.live[catalog.trained_index[i]])]
        if live_trained:
            raise V.RequestError(f"catalog add: {', '.join(map(P.preview, live_trained[:5]))} "
                                 f"{'is a trained item' if len(live_trained) == 1 else 'are trained items'} of the serving "
                                 "version (retire one first to change it)", P.ALREADY_EXISTS)
        fresh = sum(not self._known(i) for i in ids)
        free = catalog.capacity - len(catalog.ids)
        if fresh > free:
            raise V.RequestError(f"catalog add: {fresh} new items; {free} of the {catalog.capacity} rows reserved for "
                                 "added items are free (catalog_capacity)", P.RESOURCE_EXHAUSTED)
        contents = [self._content(item) for item in items]
        # a trained item listed again keeps its own ID and vector: its content is not embedded
        embeddings = self._embed([None if i in catalog.trained_index else c for i, c in zip(ids, contents)])
        new = [j for j, i in enumerate(ids) if not self._known(i)]
        crowded = [ids[new[j]] for j in catalog.unplaceable(embeddings[new])]  # what no stage could place: refused now
        if crowded:
            raise V.RequestError(f"catalog add: {len(crowded)} items ({', '.join(map(P.preview, crowded[:5]))}) find no free "
                                 "semantic ID near their content: the nearest prefixes are full", P.RESOURCE_EXHAUSTED)
        entries = [CatalogEntry(i, c, e) for i, c, e in zip(ids, contents, embeddings)]
        version = self.store.commit(entries, [], replace=replace)
        self.sync.sync(at_least=version)
        rows = [catalog.row_of.get(i, catalog.trained_index.get(i)) for i in ids]
        return {"version": version, "items": [
            {"id": i, "semantic_id": catalog.codes[r].tolist() if r is not None else None} for i, r in zip(ids, rows)]}

    def retire(self, body: dict) -> dict:
        ids = self._ids(body)
        unknown = [i for i in ids if not self._known(i)]
        if unknown:
            raise V.RequestError(f"catalog retire: unknown item ids {', '.join(map(P.preview, unknown[:5]))}"
                                 + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""), P.NOT_FOUND)
        version = self.store.commit([], ids)
        self.sync.sync(at_least=version)
        return {"version": version, "retired": len(ids)}

    def list(self, body: dict) -> dict:
        offset, limit = body.get("offset", 0), body.get("limit", 100)
        if not (isinstance(offset, int) and isinstance(limit, int) and offset >= 0 and 0 < limit <= MAX_LIST):
            raise V.RequestError(f"catalog list: offset >= 0 and 1 <= limit <= {MAX_LIST} (integers)")
        return {**self.store.stats(), "items": self.store.list(offset, limit, body.get("status"))}

    def show(self, body: dict) -> dict:
        ids = self._ids(body)
        found = self.store.get(ids)
        catalog = self.sync.catalog
        out = []
        for i in ids:
            row = catalog.row_of.get(i, catalog.trained_index.get(i))
            entry = dict(found.get(i) or {"item_id": i, "status": "trained" if i in catalog.trained_index else "unknown"})
            if i in catalog.unplaced:  # committed, but no stage could place it (another replica's add took its place)
                entry["placed"] = False
            if row is not None:
                entry["semantic_id"] = catalog.codes[row].tolist()
                entry["live"] = bool(catalog.live[row])
            out.append(entry)
        return {"version": self.sync.version, "items": out}

    # ---- content -> the embeddings the version's quantizer reads ------------------------------------
    def _content(self, item: dict) -> dict:
        extra = set(item) - {"id", "text", "attributes", "vector"}
        name = P.preview(item["id"])
        if extra:
            raise V.RequestError(f"catalog add: item {name} has unknown fields {sorted(extra)}")
        content = {k: item[k] for k in ("text", "attributes", "vector") if item.get(k) not in (None, "", [])}
        if not content:
            raise V.RequestError(f"catalog add: item {name} has no content: give its text, attributes or vector")
        text = content.get("text")
        if text is not None and (not isinstance(text, str) or len(text.encode()) > MAX_TEXT_BYTES):
            raise V.RequestError(f"catalog add: item {name}'s text must be a string of at most {MAX_TEXT_BYTES} bytes")
        attrs = content.get("attributes")
        if attrs is not None and (not isinstance(attrs, list) or len(attrs) > MAX_ATTRIBUTES
                                  or not all(isinstance(a, (str, int)) and not isinstance(a, bool) for a in attrs)):
            raise V.RequestError(f"catalog add: item {name}'s attributes must be a list of at most {MAX_ATTRIBUTES} ids")
        return content

    def _embed(self, contents: list) -> np.ndarray:
        """[n, E] content embeddings in the space the version's IDs were fit in (a zero row for None)."""
        cfg, codebook = self.model.cfg, self.model.codebook
        if not codebook.has_quantizer:
            raise V.RequestError("catalog add: this model version kept no quantizer (its semantic IDs were not fit by "
                                 "residual k-means, or it was trained before the catalog existed): retrain it to add items",
                                 P.FAILED_PRECONDITION)
        dim = codebook.get_buffer("center_0").shape[1]
        by_text = cfg.semantic_id_source == TEXT_ENCODER_SOURCE
        out = np.empty((len(contents), dim), np.float32)
        texts = []
        for j, c in enumerate(contents):
            if c is None:
                out[j] = 0.0
            elif "vector" in c:
                v = np.asarray(c["vector"], dtype=np.float64)
                if v.shape != (dim,) or not np.isfinite(v).all() or not np.abs(v).sum():
                    raise V.RequestError(f"catalog add: item {j}'s vector must be {dim} finite numbers, not all 0 (this "
                                         f"version's semantic IDs were fit on {cfg.semantic_id_source} embeddings of {dim})")
                out[j] = v / np.linalg.norm(v)  # the unit rows the codes were fit on
            elif by_text:
                texts.append((j, " ".join([c.get("text", "")] + [str(a) for a in c.get("attributes", [])]).strip()))
            else:
                raise V.RequestError(f"catalog add: item {j} has no vector; this version's semantic IDs were fit on "
                                     f"{cfg.semantic_id_source or 'unrecorded'} embeddings, not on item text, so an "
                                     f"item needs its vector in that space ({dim} numbers)")
        if texts:  # by the environment's interpreter: the stub's cannot import the encoder's packages
            python = shutil.which("python3") or shutil.which("python") or sys.executable
            emb = embed_in_subprocess([t for _, t in texts], python, self.version_dir)
            out[[j for j, _ in texts]] = F.normalize(emb, dim=-1).numpy()
        return out

    def close(self) -> None:
        self.sync.close()
