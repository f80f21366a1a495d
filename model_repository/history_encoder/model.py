"""history_encoder's Triton model: a thin adapter over backend_src.serving.stages.encoder, the HSTU
backbone over each user session's history (its visit, cache and durable log are described there).

The version directory holds this file beside its own copy of the package; that copy is put first on
the path before anything of the package is imported, so the version serves the code published with it.
"""
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        sys.path.insert(0, str(Path(args["model_repository"]) / args["model_version"]))  # this version's own package first
        from backend_src.serving.stages import startup, stub
        from backend_src.serving.stages.encoder import EncoderStage

        self.stub = stub
        start = startup.start(args, pb_utils.Logger.log_info)
        self.stage = EncoderStage(start.version_dir, start.params, stub.metric_maker(pb_utils, args))
        startup.loaded(rare_full_collections=True)  # the session cache: many long-lived objects, no cycles

    def execute(self, requests):
        return self.stub.triton_responses(self.stage.handle(self.stub.plain_requests(requests)), pb_utils)

    def finalize(self):
        self.stage.close()
