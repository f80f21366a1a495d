"""mfalcon_ranker: target-aware ranking of the decoder's candidates (seed 001's M-FALCON).

The candidates attend to the history K/V handed over by history_encoder (never recomputed)
and to themselves only, in microbatches. Requests batched together are ranked in one call
(histories padded to the longest). The ranker runs on the fastest runtime this version holds
(backend_src.serving.ranker_runtime): a TensorRT plan on a GPU host, ``ranker.onnx`` in ONNX
Runtime, else torch. The top TOP_K by ranking score come back with their raw item ids,
retrieval log-probabilities and semantic IDs; with EXCLUDE_SEEN, candidates already in the
session's history are left out and the fused order takes the checkpoint's weight for that policy.
"""
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

RUNTIME_BACKENDS = {"auto": "auto", "torch": "torch", "onnx": "onnxruntime", "tensorrt": "tensorrt"}


def _params(args) -> dict:
    cfg = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}


class TritonPythonModel:
    def initialize(self, args):
        params = _params(args)
        root = params.get("code_root") or str(Path(__file__).resolve().parents[3])
        if root not in sys.path:
            sys.path.insert(0, root)
        import torch

        from backend_src.model.recommender import RANK_ORDERS, GenerativeRecommender, served_order
        from backend_src.serving import protocol as P
        from backend_src.serving import validation as V

        self.torch, self.P, self.V, self.served_order = torch, P, V, served_order
        torch.set_num_threads(int(params.get("torch_threads", 1)))
        vdir = Path(args["model_repository"]) / args["model_version"]
        self.model = GenerativeRecommender.load(vdir / "model.pt")
        cfg = self.model.cfg
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model.to(self.device)
        self.sizes = P.model_sizes(cfg)
        self.max_history = min(int(params.get("max_history", cfg.max_seq_len)), cfg.max_seq_len)
        self.max_top_k = int(params.get("max_top_k", 256))
        self.max_beams = int(params.get("max_beam_width", 1024))
        self.default_top_k = int(params.get("top_k", 10))
        self.microbatch = int(params.get("ranker_microbatch", 64))
        self.rank_by = params.get("rank_by", "fused")  # the order everything else defaults to
        if self.rank_by not in RANK_ORDERS:
            raise ValueError(f"rank_by must be one of {RANK_ORDERS}, got {self.rank_by!r}")
        self.max_elements = max((self.max_history + 1) * cfg.d_model * cfg.num_layers, self.max_beams * cfg.num_codes)
        self.raw_ids = np.array([b"" if x is None else str(x).encode() for x in self.model.item_ids], dtype=object)
        from backend_src.serving.ranker_runtime import RankerRuntime

        backend = RUNTIME_BACKENDS[params.get("ranker_backend", "auto")]
        self.runtime = RankerRuntime.from_version_dir(vdir, self.model, backend=backend)
        pb_utils.Logger.log_info(f"mfalcon_ranker v{args['model_version']}: ranking with {self.runtime}")

    def _read(self, request):
        P, V = self.P, self.V
        read = lambda spec: V.read_input(request, spec, self.sizes, self.max_elements, pb_utils.get_input_tensor_by_name)
        keys = read(P.HISTORY_KEYS)  # [1, L, n, H, dh]
        values = read(P.HISTORY_VALUES)
        ts = read(P.HISTORY_TIMESTAMPS)  # [1, n]
        history_items = read(P.HISTORY_ITEMS)  # [1, n]
        cands = read(P.CANDIDATE_ITEMS)  # [1, W]
        log_probs = read(P.CANDIDATE_LOG_PROBS)
        codes = read(P.CANDIDATE_CODES)  # [1, W, C]
        top_k = read(P.TOP_K)
        top_k = self.default_top_k if top_k is None else int(top_k.reshape(-1)[0])
        if not 1 <= top_k <= self.max_top_k:
            raise V.RequestError(f"TOP_K must be in [1, {self.max_top_k}], got {top_k}")
        exclude_seen = V.flag(read(P.EXCLUDE_SEEN), P.EXCLUDE_SEEN.name)
        # this model is reachable directly, not only through the ensemble: check before ranking
        V.check_ranker_inputs(
            keys, values, ts, history_items, cands, log_probs, codes,
            num_items=self.model.cfg.num_items, codebook_sizes=self.model.cfg.codebook_sizes,
            max_history=self.max_history, max_candidates=self.max_beams,
        )
        keys, values, ts, history_items, cands, log_probs, codes = (
            x[0] for x in (keys, values, ts, history_items, cands, log_probs, codes)
        )
        return keys, values, ts, cands, log_probs, codes, top_k, history_items, exclude_seen

    def _scores(self, reqs, cands):
        """Ranking logits [B, M] of the batch's padded candidate lists cands [B, M] (histories
        padded to the longest)."""
        torch = self.torch
        pad = torch.nn.utils.rnn.pad_sequence
        lengths = torch.tensor([r[2].shape[0] for r in reqs], dtype=torch.long)
        # per request [L, n, H, dh] -> padded [B, n, L, H, dh] -> [L, B, n, H, dh]
        keys = pad([torch.from_numpy(r[0]).transpose(0, 1) for r in reqs], batch_first=True).permute(2, 0, 1, 3, 4).contiguous()
        values = pad([torch.from_numpy(r[1]).transpose(0, 1) for r in reqs], batch_first=True).permute(2, 0, 1, 3, 4).contiguous()
        ts = pad([torch.from_numpy(r[2]) for r in reqs], batch_first=True)  # [B, n]
        with torch.inference_mode():
            return torch.as_tensor(self.runtime.score(keys, values, ts, lengths, cands, self.microbatch)).float().cpu()

    def _order(self, reqs):
        """The served order (served_order, as offline) of the batch: items, scores, log-probs
        [B, k] and codes [B, k, C], k = min(largest TOP_K, longest list). A request's answer is
        its first min(TOP_K, its candidates) slots: a shorter list's padding is empty and sorts last."""
        torch = self.torch
        pad = torch.nn.utils.rnn.pad_sequence
        cands = pad([torch.from_numpy(r[3]).clamp(min=0) for r in reqs], batch_first=True)  # [B, M]; 0 = none
        scores = self._scores(reqs, cands)
        log_probs = pad([torch.from_numpy(r[4]).float() for r in reqs], batch_first=True, padding_value=float("-inf"))
        codes = pad([torch.from_numpy(r[5]) for r in reqs], batch_first=True, padding_value=-1)  # [B, M, C]
        exclude = torch.tensor([r[8] for r in reqs])  # [B] EXCLUDE_SEEN of each request
        history = None
        if bool(exclude.any()):
            history = pad([torch.from_numpy(r[7]) for r in reqs], batch_first=True)  # [B, n], 0 = padding
        # each request takes the fusion weight chosen on validation under its seen-item policy
        cfg = self.model.cfg
        weight = torch.where(exclude, cfg.fusion_weight(True), cfg.fusion_weight(False))[:, None]
        items, scores, log_probs, top = self.served_order(
            scores, log_probs, cands, history, fusion_weight=weight, rank_by=self.rank_by,
            exclude_seen=exclude, top_k=max(r[6] for r in reqs),
        )
        codes = torch.gather(codes, 1, top[:, :, None].expand(-1, -1, codes.shape[-1]))
        return items, scores, log_probs, codes.masked_fill((items == 0)[:, :, None], -1)

    def execute(self, requests):
        P, V = self.P, self.V
        responses = [None] * len(requests)
        batch = []
        for i, r in enumerate(requests):
            try:
                batch.append((i, self._read(r)))
            except V.RequestError as e:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(e.message, V.error_code(e.status, pb_utils.TritonError)))
            except Exception as e:  # noqa: BLE001 - a request that cannot be read fails alone
                responses[i] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"mfalcon_ranker: {type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL)
                )
        if not batch:
            return responses
        try:
            items, scores, log_probs, codes = self._order([r for _, r in batch])  # [B, k] best first
        except Exception as e:  # noqa: BLE001
            err = pb_utils.TritonError(f"mfalcon_ranker: {type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL)
            for i, _ in batch:
                responses[i] = pb_utils.InferenceResponse(error=err)
            return responses
        items, scores, log_probs, codes = items.numpy(), scores.numpy(), log_probs.numpy(), codes.numpy()
        for b, (i, (_, _, _, cands, _, _, top_k, _, _)) in enumerate(batch):
            kk = min(top_k, cands.shape[0])
            ids = self.raw_ids[items[b, :kk]]  # item 0 (an empty slot) -> b""
            s = scores[b, :kk].astype(np.float32)
            lp = log_probs[b, :kk].astype(np.float32)
            c = codes[b, :kk].astype(np.int32)
            responses[i] = pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor(P.RECOMMENDED_IDS.name, ids[None]),
                    pb_utils.Tensor(P.RANK_SCORES.name, s[None]),
                    pb_utils.Tensor(P.RETRIEVAL_LOG_PROBS.name, lp[None]),
                    pb_utils.Tensor(P.SEMANTIC_IDS.name, c[None]),
                ]
            )
        return responses
