"""Between Triton's Python backend and a stage: Triton's requests as plain ones, the stage's answers as
Triton's responses, a stage's metrics as Triton's. The backend's module (``triton_python_backend_utils``,
importable only inside a stub) is handed in by ``model.py``, the one file that imports it."""
from __future__ import annotations

from backend_src.serving.stages.messages import StageRequest
from backend_src.serving.validation import error_code
from genrec_contract.protocol import tagged_message


def plain_requests(requests) -> list:
    """Triton's requests -> StageRequests; the inputs stay Triton's tensors, read once their shape is checked."""
    return [StageRequest({t.name(): t for t in r.inputs()}, r.correlation_id(), r.flags()) for r in requests]


def triton_responses(responses, pb_utils) -> list:
    """The stage's StageResponses -> Triton's responses (a refusal keeps its status: INVALID_ARG, NOT_FOUND,
    UNAVAILABLE, INTERNAL; one Triton has no code for is tagged in the message, see protocol.tagged_message)."""
    Tensor, Response, Error = pb_utils.Tensor, pb_utils.InferenceResponse, pb_utils.TritonError
    return [
        Response(output_tensors=[Tensor(k, v) for k, v in r.outputs.items()]) if r.error is None
        else Response(error=Error(tagged_message(r.status, r.error), error_code(r.status, Error)))
        for r in responses
    ]


def metric_maker(pb_utils, args: dict):
    """make(name, kind, doc) -> a Triton metric labelled with the model and its version; `kind` is
    "counter" or "gauge". Each metric's family is kept with it (a family must outlive its metrics)."""
    labels = {"model": args["model_name"], "version": args["model_version"]}
    kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE}
    families = []

    def make(name: str, kind: str, doc: str):
        families.append(pb_utils.MetricFamily(name=name, description=doc, kind=kinds[kind]))
        return families[-1].Metric(labels=labels)

    return make
