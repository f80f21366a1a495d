"""Triton's own cost: a no-op stand-in for each stage of `recommend`, with the real tensor contract.

perf.floor publishes this file as every Python model of a repository whose configs are the real
ones (export/triton_configs.py: same names, batching, sequence batching and ensemble), so a
request takes the same path through Triton (gRPC, the ensemble, the sequence batcher, three
stubs and their shared memory) and carries tensors of the real sizes, but no model work:
- history_encoder counts each session's events and returns zero states / K / V for that many
  rows (HISTORY_STATES [1, n, D], HISTORY_KEYS/VALUES [1, L, n, H, DH], ...);
- pfa_decoder reads the states and returns BEAM_WIDTH zero candidates;
- mfalcon_ranker reads the states, K/V and candidates and returns TOP_K empty recommendations;
- catalog (not in the ensemble) answers an empty JSON object.
"""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.stage = cfg["name"]
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        self.max_history = int(params.get("max_history", 0))
        self.beam_width = int(params.get("beam_width", 0))
        self.top_k = int(params.get("top_k", 0))
        dims = {t["name"]: [int(d) for d in t["dims"]] for t in cfg["input"] + cfg["output"]}
        # the sizes are in the real contract's dims: K/V [L, -1, H, DH], states [-1, D], codes [-1, C]
        self.kv = dims.get("HISTORY_KEYS")
        self.d = dims.get("HISTORY_STATES", [0, 0])[-1]
        self.c = dims.get("CANDIDATE_CODES", dims.get("SEMANTIC_IDS", [0, 0]))[-1]
        self.counts = {}  # the encoder's per-session event count

    def _input(self, request, name):
        t = pb_utils.get_input_tensor_by_name(request, name)
        return None if t is None else t.as_numpy()

    def _option(self, request, name, default):
        x = self._input(request, name)
        return default if x is None else int(x.reshape(-1)[0])

    def _encoder(self, request):
        key = request.correlation_id()
        n = len(self._input(request, "ITEM_IDS").reshape(-1))
        count = self.counts.get(key, 0) + n
        self.counts[key] = count
        rows = min(count, self.max_history)
        L, _, H, dh = self.kv
        out = {
            "HISTORY_STATES": np.zeros((1, rows, self.d), np.float32),
            "HISTORY_KEYS": np.zeros((1, L, rows, H, dh), np.float32),
            "HISTORY_VALUES": np.zeros((1, L, rows, H, dh), np.float32),
            "HISTORY_TIMESTAMPS": np.zeros((1, rows), np.int64),
            "HISTORY_ITEMS": np.zeros((1, rows), np.int64),
            "HISTORY_LENGTH": np.array([[rows]], np.int64),
            "TRUNCATED": np.zeros((1, 1), np.int32),
            "EVENT_COUNT": np.array([[count]], np.int64),
            "RESTORED": np.zeros((1, 1), np.bool_),
            "UNKNOWN_ITEMS": np.zeros((1, 1), np.int64),
            "MIN_CATALOG_VERSION": np.zeros((1, 1), np.int64),
        }
        return out

    def _decoder(self, request):
        self._input(request, "HISTORY_STATES")
        w = self._option(request, "BEAM_WIDTH", self.beam_width)
        return {
            "CANDIDATE_ITEMS": np.zeros((1, w), np.int64),
            "CANDIDATE_LOG_PROBS": np.zeros((1, w), np.float32),
            "CANDIDATE_CODES": np.zeros((1, w, self.c), np.int32),
        }

    def _ranker(self, request):
        for name in ("HISTORY_STATES", "HISTORY_KEYS", "HISTORY_VALUES", "HISTORY_TIMESTAMPS", "HISTORY_ITEMS", "CANDIDATE_ITEMS",
                     "CANDIDATE_LOG_PROBS", "CANDIDATE_CODES"):
            self._input(request, name)
        k = self._option(request, "TOP_K", self.top_k)
        return {
            "RECOMMENDED_IDS": np.full((1, k), b"", dtype=object),
            "RANK_SCORES": np.zeros((1, k), np.float32),
            "RETRIEVAL_LOG_PROBS": np.zeros((1, k), np.float32),
            "SEMANTIC_IDS": np.zeros((1, k, self.c), np.int32),
            "CATALOG_VERSION": np.zeros((1, 1), np.int64),
        }

    def _catalog(self, request):
        return {"CATALOG_RESULT": np.array([[b"{}"]], dtype=object), "CATALOG_VERSION": np.zeros((1, 1), np.int64)}

    def execute(self, requests):
        stage = {"history_encoder": self._encoder, "pfa_decoder": self._decoder, "mfalcon_ranker": self._ranker,
                 "catalog": self._catalog}[self.stage]
        responses = []
        for r in requests:
            outs = stage(r)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outs.items()]))
        return responses
