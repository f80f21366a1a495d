"""The history encoder's published model.py driven in one process (Triton's Python-backend API stood in by
tests/triton_stand_in), for what a real server cannot be made to do on demand: an encode that fails
after the log took the request's events. The published version runs in a fresh interpreter, which
imports the package copy published with it, as its stub does (the adapter's start-up checks that)."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from export import publish as pub
from export.triton_configs import ServingOptions
from serving_helpers import build_tiny_checkpoint

STAND_IN = Path(__file__).parent / "triton_stand_in"

DRIVER = textwrap.dedent(
    """
    import importlib.util, json, re, sys
    from pathlib import Path
    import numpy as np
    import triton_python_backend_utils as pb

    repo = Path(sys.argv[1])
    model_dir = repo / "history_encoder"
    config = (model_dir / "config.pbtxt").read_text()
    params = dict(re.findall(r'key: "([^"]+)"\\s*value: \\{ string_value: "([^"]*)" \\}', config))
    spec = importlib.util.spec_from_file_location("encoder_stage", model_dir / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in params.items()}}),
                      "model_repository": str(model_dir), "model_version": "1", "model_name": "history_encoder"})
    stage = model.stage  # the package's EncoderStage behind the adapter
    key, out = "i:7", {}

    def send(first, n, before, start=False):
        items = np.array([[f"i{first + j}".encode() for j in range(n)]], dtype=object)
        ts = np.arange(first, first + n, dtype=np.int64)[None]
        inputs = [pb.Tensor("ITEM_IDS", items), pb.Tensor("ACTIONS", np.ones((1, n), np.int64)),
                  pb.Tensor("TIMESTAMPS", ts), pb.Tensor("EVENTS_BEFORE", np.array([[before]], np.int64))]
        response = model.execute([pb.InferenceRequest(inputs, 7, 1 if start else 0)])[0]
        if response.has_error():
            return {"error": response.error().message()}
        got = {t.name(): t.as_numpy().reshape(-1)[0] for t in response.output_tensors()}
        return {"count": int(got["EVENT_COUNT"]), "restored": bool(got["RESTORED"])}

    def state():
        session = stage.store.get(key)
        return {"logged": stage.log.count(key), "cached": None if session is None else session.count}

    def encode_fails(*args, **kwargs):
        raise RuntimeError("encode failed")

    out["open"] = send(1, 20, 0, start=True)
    for name, first, n, before in (("long", 21, 20, 20), ("short", 41, 1, 40)):
        stage._run = encode_fails  # this request's encode fails ...
        out[name] = {"failed": send(first, n, before), **state()}
        del stage._run  # ... and its retry, with the same EVENTS_BEFORE, does not
        out[name]["retry"] = {**send(first, n, before), **state()}
    model.finalize()
    print(json.dumps(out))
    """
)


def test_an_encode_that_fails_after_the_log_took_the_events_is_answered_once_on_retry(tmp_path):
    ckpt = tmp_path / "model.pt"
    build_tiny_checkpoint(ckpt, [None] + [f"i{i}" for i in range(1, 61)], max_history=64, seed=0)
    repo = tmp_path / "model_repository"
    pub.publish(ckpt, repo, ServingOptions(ranker_backend="torch"), export_ranker=False)
    run = subprocess.run([sys.executable, "-c", DRIVER, str(repo)], capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(STAND_IN), "PATH": "/usr/bin:/bin", "OMP_WAIT_POLICY": "PASSIVE"})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["open"] == {"count": 20, "restored": False}
    # 20 events (written beside the encode): the log took them, the request failed, and the session left the cache;
    # the retry is answered from the log, the events applied once
    long = out["long"]
    assert "encode failed" in long["failed"]["error"]
    assert (long["logged"], long["cached"]) == (40, None)
    assert long["retry"] == {"count": 40, "restored": True, "logged": 40, "cached": 40}
    # one event (written after the encode): nothing was written and the cached session stands
    short = out["short"]
    assert "encode failed" in short["failed"]["error"]
    assert (short["logged"], short["cached"]) == (40, 40)
    assert short["retry"] == {"count": 41, "restored": False, "logged": 41, "cached": 41}
