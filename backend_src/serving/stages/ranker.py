"""mfalcon_ranker: target-aware ranking of the decoder's candidates (M-FALCON, from "Actions Speak
Louder than Words: Trillion-Parameter Sequential Transducers for Generative Recommendations").

The candidates attend to the history K/V handed over by history_encoder (never recomputed)
and to themselves only, in microbatches. Requests batched together are ranked in one call
(histories padded to the longest). The ranker runs on the fastest runtime this version holds
(backend_src.serving.ranker_runtime): a TensorRT plan on a GPU host; on a CPU ``ranker.onnx`` in
ONNX Runtime or torch, whichever was faster for the history's length when the version loaded.
The top TOP_K by ranking score come back with their raw item ids, retrieval log-probabilities
and semantic IDs; with EXCLUDE_SEEN, candidates already in the
session's history are left out and the fused order takes the checkpoint's weight for that policy.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, NamedTuple

import numpy as np
import torch

from backend_src.model.recommender import RANK_ORDERS, GenerativeRecommender, served_order
from backend_src.serving import validation as V
from backend_src.serving.stages.catalog_sync import CatalogSync
from backend_src.serving.ranker_runtime import RankerRuntime
from backend_src.serving.stages.messages import StageRequest, StageResponse
from genrec_contract import protocol as P

RUNTIME_BACKENDS = {"auto": "auto", "torch": "torch", "onnx": "onnxruntime", "tensorrt": "tensorrt"}


class Ranking(NamedTuple):
    """One request's inputs (its batch dimension dropped)."""

    user_state: np.ndarray  # [D] the history's last final state
    keys: np.ndarray  # [L, n, H, dh]
    values: np.ndarray  # [L, n, H, dh]
    timestamps: np.ndarray  # [n]
    history_items: np.ndarray  # [n]
    candidates: np.ndarray  # [W]
    log_probs: np.ndarray  # [W]
    codes: np.ndarray  # [W, C]
    top_k: int
    exclude_seen: bool
    catalog_version: int  # the encoder's: this stage applies at least it


class RankerStage:
    """The ranker of the version in `version_dir` (its ranker.pt and exported runtimes), configured by
    the model config's `params`."""

    def __init__(self, version_dir: Path, params: Mapping):
        version_dir = Path(version_dir)
        self.served_order = served_order
        self.model = GenerativeRecommender.load(version_dir / "ranker.pt")  # the backbone, the ranking head and the item ids
        cfg = self.model.cfg
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model.to(self.device)
        self.sizes = P.model_sizes(cfg)
        self.max_history = min(int(params.get("max_history", cfg.max_seq_len)), cfg.max_seq_len)
        self.max_top_k = int(params.get("max_top_k", 256))
        self.max_beams = int(params.get("max_beam_width", 1024))
        self.default_top_k = int(params.get("top_k", 10))
        self.microbatch = int(params["ranker_microbatch"])
        self.rank_by = params.get("rank_by", "fused")  # the order everything else defaults to
        if self.rank_by not in RANK_ORDERS:
            raise ValueError(f"rank_by must be one of {RANK_ORDERS}, got {self.rank_by!r}")
        self.max_elements = max((self.max_history + 1) * cfg.d_model * cfg.num_layers, self.max_beams * cfg.num_codes)
        backend = RUNTIME_BACKENDS[params.get("ranker_backend", "auto")]
        # the routing is timed on one call of the default beam's candidates
        one_call = min(self.microbatch, V.decode_defaults(params).beam_width)
        self.runtime = RankerRuntime.from_version_dir(version_dir, self.model, backend=backend, candidates=one_call)
        one = torch.ones(1, 1, dtype=torch.long)
        self.model.covisit_scores(one, one)  # the CPU's compiled lookup builds here, not in a request
        self.catalog = CatalogSync(self.model, params, version_dir, P.RANKER)  # items added since training
        self.raw_ids = self._raw_ids()

    def _raw_ids(self) -> np.ndarray:
        """The raw id of each row of the item table as the answer carries it (b"" for no item)."""
        return np.array([b"" if x is None else str(x).encode() for x in self.model.row_ids()], dtype=object)

    def _read(self, request: StageRequest) -> Ranking:
        read = lambda spec: V.read_input(request.inputs, spec, self.sizes, self.max_elements)  # noqa: E731
        states = read(P.HISTORY_STATES)  # [1, n, D]
        keys = read(P.HISTORY_KEYS)  # [1, L, n, H, dh]
        values = read(P.HISTORY_VALUES)
        ts = read(P.HISTORY_TIMESTAMPS)  # [1, n]
        history_items = read(P.HISTORY_ITEMS)  # [1, n]
        cands = read(P.CANDIDATE_ITEMS)  # [1, W]
        log_probs = read(P.CANDIDATE_LOG_PROBS)
        codes = read(P.CANDIDATE_CODES)  # [1, W, C]
        top_k = V.parse_top_k({P.TOP_K.name: read(P.TOP_K)}, self.default_top_k, self.max_top_k)
        exclude_seen = V.flag(read(P.EXCLUDE_SEEN), P.EXCLUDE_SEEN.name)
        catalog_version = V.catalog_version(read(P.MIN_CATALOG_VERSION))
        # this model is reachable directly, not only through the ensemble: check before ranking
        V.check_ranker_inputs(
            states, keys, values, ts, history_items, cands, log_probs, codes,
            item_rows=self.model.item_rows, codebook_sizes=self.model.cfg.codebook_sizes,
            max_history=self.max_history, max_candidates=self.max_beams,
        )
        return Ranking(states[0, -1], keys[0], values[0], ts[0], history_items[0], cands[0], log_probs[0], codes[0], top_k, exclude_seen,
                       catalog_version)

    def _scores(self, reqs, cands):
        """Ranking logits [B, M] of the batch's padded candidate lists cands [B, M] (histories
        padded to the longest)."""
        if len(reqs) == 1:  # one request: its arrays as they are, no padding copies
            r = reqs[0]
            keys, values = torch.from_numpy(r.keys)[:, None], torch.from_numpy(r.values)[:, None]  # [L, 1, n, H, dh]
            ts = torch.from_numpy(r.timestamps)[None]
        else:
            pad = torch.nn.utils.rnn.pad_sequence
            # per request [L, n, H, dh] -> padded [B, n, L, H, dh] -> [L, B, n, H, dh]
            keys = pad([torch.from_numpy(r.keys).transpose(0, 1) for r in reqs], batch_first=True).permute(2, 0, 1, 3, 4).contiguous()
            values = pad([torch.from_numpy(r.values).transpose(0, 1) for r in reqs], batch_first=True).permute(2, 0, 1, 3, 4).contiguous()
            ts = pad([torch.from_numpy(r.timestamps) for r in reqs], batch_first=True)  # [B, n]
        lengths = torch.tensor([r.timestamps.shape[0] for r in reqs], dtype=torch.long)
        with torch.inference_mode():
            return torch.as_tensor(self.runtime.score(keys, values, ts, lengths, cands, self.microbatch)).float().cpu()

    @staticmethod
    def _batch(tensors, padding_value=0):
        """Per-request tensors [M, ...] -> [B, M, ...], padded to the longest; one request's as it is."""
        if len(tensors) == 1:
            return tensors[0][None]
        return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=padding_value)

    def _order(self, reqs):
        """The served order (served_order, as offline) of the batch: items, scores, log-probs
        [B, k] and codes [B, k, C], k = min(largest TOP_K, longest list). A request's answer is
        its first min(TOP_K, its candidates) slots: a shorter list's padding is empty and sorts last."""
        pad = self._batch
        cands = pad([torch.from_numpy(r.candidates).clamp(min=0) for r in reqs])  # [B, M]; 0 = none
        cands = cands.masked_fill(~self.model.item_live[cands], 0)  # a row that is no item (now) is an empty slot
        log_probs = pad([torch.from_numpy(r.log_probs).float() for r in reqs], float("-inf"))
        codes = pad([torch.from_numpy(r.codes) for r in reqs], -1)  # [B, M, C]
        # each request takes the fusion weights chosen on validation under its seen-item policy:
        # numbers when the batch shares one policy, else [B, 1] columns
        flags = [r.exclude_seen for r in reqs]
        per_request = [self.model.cfg.fusion_weights(f) for f in flags]  # (w, v, u) each
        fused = self.rank_by == "fused"
        use_covisit = fused and any(u for _, _, u in per_request)
        history = content = None
        if any(flags) or use_covisit or (fused and self.model.has_added_items):
            history = pad([torch.from_numpy(r.history_items) for r in reqs])  # [B, n], 0 = padding
        if fused:  # the catalog's added items nearest in content join the candidates
            cands, log_probs, codes, content = self.model.with_added_candidates(history, cands, log_probs, codes)
        scores = self._scores(reqs, cands)
        if len(set(flags)) == 1:
            exclude, (weight, dense_weight, covisit_weight) = flags[0], per_request[0]
        else:
            exclude = torch.tensor(flags)  # [B]
            weight, dense_weight, covisit_weight = (torch.tensor(column)[:, None] for column in zip(*per_request))
        dense = covisit = None
        if fused and any(v for _, v, _ in per_request):
            user_states = torch.from_numpy(np.stack([r.user_state for r in reqs])).to(self.device)
            with torch.inference_mode():
                dense = self.model.dense_log_probs(user_states, cands.to(self.device)).cpu()
        if use_covisit:
            covisit = self.model.covisit_scores(history, cands).cpu()
        items, scores, log_probs, top = self.served_order(
            scores, log_probs, cands, history, fusion_weight=weight, dense_log_probs=dense, dense_weight=dense_weight,
            covisit_scores=covisit, covisit_weight=covisit_weight, content_scores=content,
            content_weight=self.model.cfg.catalog_content_weight, rank_by=self.rank_by, exclude_seen=exclude,
            top_k=max(r.top_k for r in reqs),
        )
        codes = torch.gather(codes, 1, top[:, :, None].expand(-1, -1, codes.shape[-1]))
        return items, scores, log_probs, codes.masked_fill((items == 0)[:, :, None], -1)

    def _answer(self, r: Ranking, b: int, items, scores, log_probs, codes) -> StageResponse:
        """Row `b` of the batch's order: its first min(TOP_K, its candidates) slots."""
        kk = min(r.top_k, r.candidates.shape[0])
        return StageResponse({
            P.RECOMMENDED_IDS.name: self.raw_ids[items[b, :kk]][None],  # item 0 (empty) -> b""
            P.RANK_SCORES.name: scores[b : b + 1, :kk].astype(np.float32),
            P.RETRIEVAL_LOG_PROBS.name: log_probs[b : b + 1, :kk].astype(np.float32),
            P.SEMANTIC_IDS.name: codes[b : b + 1, :kk].astype(np.int32),
            P.CATALOG_VERSION.name: np.array([[self.catalog.version]], dtype=np.int64),
        })

    def handle(self, requests: list) -> list:
        """StageRequests -> StageResponses, one each, in order; the readable ones ranked in one call."""
        responses = [None] * len(requests)
        batch = []
        for i, r in enumerate(requests):
            try:
                batch.append((i, self._read(r)))
            except Exception as e:  # noqa: BLE001 - a request that cannot be read fails alone
                responses[i] = StageResponse.failed(e, P.RANKER)
        if not batch:
            return responses
        if self.catalog.sync(max(r.catalog_version for _, r in batch)):  # the whole call at one catalog version
            self.raw_ids = self._raw_ids()
        try:
            items, scores, log_probs, codes = self._order([r for _, r in batch])  # [B, k] best first
        except Exception as e:  # noqa: BLE001
            failed = StageResponse.internal(e, P.RANKER)
            for i, _ in batch:
                responses[i] = failed
            return responses
        items, scores, log_probs, codes = items.numpy(), scores.numpy(), log_probs.numpy(), codes.numpy()
        for b, (i, r) in enumerate(batch):
            responses[i] = self._answer(r, b, items, scores, log_probs, codes)
        return responses

    def close(self) -> None:
        self.catalog.close()
