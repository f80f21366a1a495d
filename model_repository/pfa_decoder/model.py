"""pfa_decoder: constrained semantic-ID beam search over the history states (progressively focused
attention, from "PFA: Attention Can Be Progressively Focused in Long-Sequence Generative Recommendation").

Requests that arrive together (dynamic batching) and ask for the same decode options are
decoded in one batched beam search; histories of different lengths are padded and masked.
Decode options come from the request (BEAM_WIDTH, DECODE_MODE, PFA_K, PFA_R, SELECTION_STEP)
or the defaults in this model's config.
"""
import gc
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


def _params(args) -> dict:
    cfg = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}


def _use_own_package(args) -> Path:
    """Import the package published with this version (its own copy, first on the path)."""
    vdir = Path(args["model_repository"]) / args["model_version"]
    sys.path.insert(0, str(vdir))
    import backend_src

    pb_utils.Logger.log_info(f"{args['model_name']} v{args['model_version']}: backend_src {backend_src.require_copy_in(vdir)}")
    return vdir


class TritonPythonModel:
    def initialize(self, args):
        params = _params(args)
        vdir = _use_own_package(args)
        import torch

        from backend_src.model.recommender import GenerativeRecommender
        from genrec_contract import protocol as P
        from backend_src.serving import validation as V

        self.torch, self.P, self.V = torch, P, V
        torch.set_num_threads(int(params.get("torch_threads", 1)))
        self.model = GenerativeRecommender.load(vdir / "decoder.pt")  # the decoder and the codebook only
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
        from backend_src.decoding.cuda_graphs import DecodeGraphs

        # on a GPU the decode is replayed as CUDA graphs per (batch, history) bucket, the default
        # options captured here; on a CPU it runs eagerly, unpadded
        self.graphs = DecodeGraphs(self.model, max_history=self.limits.max_history)
        self.graphs.warmup(self.defaults)
        self.default_top_k = int(params.get("top_k", 10))
        gc.freeze()  # what loading made is never garbage: later collections skip it

    def _read(self, request):
        P, V = self.P, self.V
        inputs = {t.name(): t for t in request.inputs()}
        read = lambda spec: V.read_input(inputs, spec, self.sizes, self.max_elements)
        states = read(P.HISTORY_STATES)  # [1, n, D]
        # this model is reachable directly, not only through the ensemble: check before decoding
        V.check_decoder_inputs(states, self.limits.max_history)
        options = {spec.name: read(spec) for spec in P.DECODE_OPTION_INPUTS}
        _, opts = V.parse_options(options, self.defaults, 1, self.limits)
        return states[0], opts

    def _decode(self, states_list, opts):
        """One batched beam search for requests sharing `opts`."""
        torch = self.torch
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

    def execute(self, requests):
        P, V = self.P, self.V
        responses = [None] * len(requests)
        groups = {}
        for i, r in enumerate(requests):
            try:
                states, opts = self._read(r)
                groups.setdefault(V.option_key(opts), (opts, []))[1].append((i, states))
            except V.RequestError as e:
                responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(e.message, V.error_code(e.status, pb_utils.TritonError)))
            except Exception as e:  # noqa: BLE001 - a request that cannot be read fails alone
                responses[i] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"pfa_decoder: {type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL)
                )
        for opts, members in groups.values():
            try:
                items, log_probs, codes = self._decode([s for _, s in members], opts)
            except Exception as e:  # noqa: BLE001 - this group fails, others carry on
                err = pb_utils.TritonError(f"pfa_decoder: {type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL)
                for i, _ in members:
                    responses[i] = pb_utils.InferenceResponse(error=err)
                continue
            for b, (i, _) in enumerate(members):
                responses[i] = pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor(P.CANDIDATE_ITEMS.name, items[b : b + 1]),  # int64
                        pb_utils.Tensor(P.CANDIDATE_LOG_PROBS.name, log_probs[b : b + 1]),
                        pb_utils.Tensor(P.CANDIDATE_CODES.name, codes[b : b + 1]),
                    ]
                )
        return responses
