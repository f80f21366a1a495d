"""Stub health: find the Python models whose stub no longer answers, and reload them.

A Python model whose stub process died stays "ready" but fails every request ("Stub process ...
is not healthy") until it is reloaded; the server of this release does not restart it. One way
to kill it is a request whose shape's element count overflows (e.g. INT64 [1, 2**62] with an
empty payload): the stub dies while unpacking the request, before model code can look at the
shape, so only a reload brings the model back. The watchdog (``serving/watchdog.py``) sees the
stub process go and calls ``reload_model``; the inference probe here is the slower way, for a
stub that is there but does not answer.
"""
from __future__ import annotations

import json
import time

from backend_src.serving.access import admin_headers


def probe_inputs(model: str, client_module):
    """A request each model refuses by its own validation (INVALID_ARG): an answer proves the
    stub is alive, and nothing changes (no session is started). (inputs, infer kwargs), or
    (None, None) for a stage whose probe needs its metadata (``metadata_probe``)."""
    import numpy as np

    from genrec_contract import protocol as P

    def tensor(spec, arr):
        t = client_module.InferInput(spec.name, list(arr.shape), spec.dtype)
        t.set_data_from_numpy(arr)
        return t

    if model == P.ENCODER:  # START with an empty history
        return [
            tensor(P.ITEM_IDS, np.zeros((1, 0), dtype=object)),
            tensor(P.ACTIONS, np.zeros((1, 0), np.int64)),
            tensor(P.TIMESTAMPS, np.zeros((1, 0), np.int64)),
        ], {"sequence_id": "stub-health-probe", "sequence_start": True, "sequence_end": True}
    if model in (P.DECODER, P.RANKER):
        return None, None  # needs the model's dims: built by the caller from its metadata
    if model == P.CATALOG:  # an operation that does not exist: refused before anything is read or changed
        return [tensor(P.CATALOG_OPERATION, np.array([[b"health-probe"]], dtype=object)),
                tensor(P.CATALOG_REQUEST, np.array([[b"{}"]], dtype=object))], {}
    raise KeyError(model)


def metadata_probe(client, model: str, client_module):
    """Probe inputs for a stateless stage from its metadata: empty history / no candidates,
    TOP_K = 0 where the model has it (refused by the model itself)."""
    import numpy as np

    from genrec_contract import protocol as P

    meta = client.get_model_metadata(model)
    inputs = []
    for t in meta.inputs:
        spec = P.CONTRACTS[model].input(t.name)
        if spec.optional and t.name != P.TOP_K.name:
            continue
        shape = [1] + [0 if d < 0 else d for d in list(t.shape)[1:]]
        arr = np.zeros(shape, dtype=spec.numpy_dtype)
        if t.name == P.TOP_K.name:
            arr = np.zeros((1, 1), np.int32)
        x = client_module.InferInput(t.name, shape, t.datatype)
        x.set_data_from_numpy(arr)
        inputs.append(x)
    return inputs


def unhealthy_models(grpc_url: str, models=None) -> list:
    """The Python models whose stub no longer answers (by an inference probe).

    A probe that reaches a dead stub leaves that instance stuck in the server (measured with
    2.51: the old instance is never released after the reload, so its zombie stays and the
    server's shutdown waits its whole exit timeout); the watchdog's process check comes first."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from genrec_contract import protocol as P

    bad = []
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        for model in P.PYTHON_MODELS if models is None else models:
            if not client.is_model_ready(model):
                continue
            inputs, kwargs = probe_inputs(model, grpcclient)
            if inputs is None:
                inputs, kwargs = metadata_probe(client, model, grpcclient), {}
            try:
                client.infer(model, inputs, client_timeout=30, **kwargs)
            except InferenceServerException as e:
                if "not healthy" in (e.message() or ""):
                    bad.append(model)
    finally:
        client.close()
    return bad


def reload_model(client, model: str, admin_key: str | None = None, timeout_s: float = 300.0) -> None:
    """Replace every instance of `model` with a fresh one (same version, same config); the
    ensemble that uses it is reloaded with it. A reloaded history_encoder has lost its
    sessions: their next request gets a clear error."""
    # load_model of an unchanged model keeps the (dead) instance: its own config plus a fresh
    # parameter forces a new instance, which replaces the dead one
    config = client.get_model_config(model, as_json=True)["config"]
    config.setdefault("parameters", {})["reload_nonce"] = {"string_value": str(time.time_ns())}
    client.load_model(model, config=json.dumps(config), headers=admin_headers(admin_key), client_timeout=timeout_s)


def heal(grpc_url: str, admin_key: str | None = None, models=None) -> list:
    """Reload the given Python models, or every one whose stub no longer answers a probe (and
    the ensemble). Returns their names."""
    import tritonclient.grpc as grpcclient

    bad = unhealthy_models(grpc_url) if models is None else list(models)
    if bad:
        client = grpcclient.InferenceServerClient(grpc_url)
        try:
            for model in bad:
                reload_model(client, model, admin_key)
        finally:
            client.close()
    return bad
