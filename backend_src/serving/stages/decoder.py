"""pfa_decoder: constrained semantic-ID beam search over the history states (progressively focused
attention, from "PFA: Attention Can Be Progressively Focused in Long-Sequence Generative Recommendation").

Requests that arrive together (dynamic batching) and ask for the same decode options are
decoded in one batched beam search; histories of different lengths are padded and masked.
Decode options come from the request (BEAM_WIDTH, DECODE_MODE, PFA_K, PFA_R, SELECTION_STEP)
or the defaults in this model's config.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from backend_src.decoding.cuda_graphs import DecodeGraphs
from backend_src.model.recommender import GenerativeRecommender
from backend_src.serving import validation as V
from backend_src.serving.stages.catalog_sync import CatalogSync
from backend_src.serving.stages.messages import StageRequest, StageResponse
from genrec_contract import protocol as P


class DecoderStage:
    """The decoder of the version in `version_dir` (its decoder.pt), configured by the model config's `params`."""

    def __init__(self, version_dir: Path, params: Mapping):
        self.model = GenerativeRecommender.load(Path(version_dir) / "decoder.pt")  # the decoder, the codebook, the item ids
        cfg = self.model.cfg
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model.to(self.device)
        self.sizes = P.model_sizes(cfg)
        self.limits = V.Limits(
            max_history=min(int(params.get("max_history", cfg.max_seq_len)), cfg.max_seq_len),
            num_actions=cfg.num_actions,
            num_codes=cfg.num_codes,
            max_top_k=int(params.get("max_top_k", 256)),
            max_beam_width=int(params.get("max_beam_width", 1024)),
        )
        self.max_elements = (self.limits.max_history + 1) * cfg.d_model
        self.defaults = V.decode_defaults(params)
        # on a GPU the decode is replayed as CUDA graphs per (batch, history) bucket, the default
        # options captured here; on a CPU it runs eagerly, unpadded
        self.graphs = DecodeGraphs(self.model, max_history=self.limits.max_history)
        self.graphs.warmup(self.defaults)
        with torch.inference_mode():  # one decode now: the CPU's compiled kernels build here, not in a request
            self.graphs.retrieve(torch.zeros(1, 1, cfg.d_model), torch.ones(1, dtype=torch.long), self.defaults)
        self.default_top_k = int(params.get("top_k", 10))
        self.catalog = CatalogSync(self.model, params, version_dir, P.DECODER)  # items added since training
        self.graphs.reset()  # the tables the warm-up's graphs hold may have changed

    def _read(self, request: StageRequest):
        """One request's states [n, D] and its decode options."""
        read = lambda spec: V.read_input(request.inputs, spec, self.sizes, self.max_elements)  # noqa: E731
        states = read(P.HISTORY_STATES)  # [1, n, D]
        # this model is reachable directly, not only through the ensemble: check before decoding
        V.check_decoder_inputs(states, self.limits.max_history)
        options = {spec.name: read(spec) for spec in P.DECODE_OPTION_INPUTS}
        _, opts = V.parse_options(options, self.defaults, 1, self.limits)
        return states[0], opts, V.catalog_version(read(P.MIN_CATALOG_VERSION))

    def _decode(self, states_list, opts):
        """One batched beam search for requests sharing `opts`."""
        lengths = torch.tensor([s.shape[0] for s in states_list], dtype=torch.long)
        if len(states_list) == 1:  # one request: its states as they are, no padding copy
            states = torch.from_numpy(states_list[0])[None]  # [1, n, D]
        else:
            states = torch.nn.utils.rnn.pad_sequence([torch.from_numpy(s) for s in states_list], batch_first=True)  # [B, n, D]
        with torch.inference_mode():
            beams = self.graphs.retrieve(states, lengths, opts)
        items, log_probs, codes = beams.item_ids, beams.log_probs, beams.codes  # int64, float32, int64 on a CPU
        if self.device != "cpu":
            items, log_probs, codes = items.cpu(), log_probs.float().cpu(), codes.cpu()
        return items.numpy(), log_probs.numpy(), codes.numpy().astype(np.int32)

    def handle(self, requests: list) -> list:
        """StageRequests -> StageResponses, one each, in order; requests with equal options decoded together."""
        responses = [None] * len(requests)
        groups = {}  # DecodeOptions (frozen: its own key) -> [(index, states)]
        at_least = 0
        for i, r in enumerate(requests):
            try:
                states, opts, version = self._read(r)
                groups.setdefault(opts, []).append((i, states))
                at_least = max(at_least, version)
            except Exception as e:  # noqa: BLE001 - a request that cannot be read fails alone
                responses[i] = StageResponse.failed(e, P.DECODER)
        if self.catalog.sync(at_least):  # the whole call at one catalog version
            self.graphs.reset()
        for opts, members in groups.items():
            try:
                items, log_probs, codes = self._decode([s for _, s in members], opts)
            except Exception as e:  # noqa: BLE001 - this group fails, others carry on
                failed = StageResponse.internal(e, P.DECODER)
                for i, _ in members:
                    responses[i] = failed
                continue
            for b, (i, _) in enumerate(members):
                responses[i] = StageResponse({
                    P.CANDIDATE_ITEMS.name: items[b : b + 1],  # int64
                    P.CANDIDATE_LOG_PROBS.name: log_probs[b : b + 1],
                    P.CANDIDATE_CODES.name: codes[b : b + 1],
                })
        return responses

    def close(self) -> None:
        self.catalog.close()
