"""pfa_decoder's Triton model: a thin adapter over backend_src.serving.stages.decoder, the constrained
semantic-ID beam search with progressively focused attention.

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
        from backend_src.serving.stages.decoder import DecoderStage

        self.stub = stub
        start = startup.start(args, pb_utils.Logger.log_info)
        self.stage = DecoderStage(start.version_dir, start.params)
        startup.loaded()

    def execute(self, requests):
        return self.stub.triton_responses(self.stage.handle(self.stub.plain_requests(requests)), pb_utils)

    def finalize(self):
        self.stage.close()
