"""Generate every config.pbtxt of the model repository from the tensor contract
(genrec_contract/protocol.py), the model's ModelConfig and the serving options.

Configs name no path (each version runs the code published into it, export/publish.py) and
are written by this tool only (atomically), never edited by hand:

    python -m export.triton_configs --checkpoint ckpt.pt --repository model_repository
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from backend_src.config import RANKER_MICROBATCH, DecodeOptions, ModelConfig
from genrec_contract import protocol as P
from backend_src.serving.session_store import DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_BYTES, DEFAULT_PREFAULT_BYTES


@dataclass
class ServingOptions:
    # instances (each a process of its own)
    encoder_instances: int = 1
    decoder_instances: int = 1
    ranker_instances: int = 1
    # sessions: a visit (one Triton sequence) holds a slot only while it lasts; the cache of
    # encoded sessions outlives it (bounded, LRU); the event log holds every accepted event
    max_history: int | None = None  # None = the model's max_seq_len
    session_max_bytes: int = DEFAULT_MAX_BYTES  # the session cache's bound, per encoder instance
    cache_idle_s: float = DEFAULT_IDLE_TIMEOUT_S  # a cached session not used for this long is dropped
    session_prefault_bytes: int = DEFAULT_PREFAULT_BYTES  # heap touched at load for the first sessions (CPU)
    visit_idle_s: float = 10.0  # a sequence with no request for this long ends (its slot frees)
    max_candidate_sequences: int = 4096  # visits open at once per encoder instance
    event_log: str = ""  # sqlite path or redis:// URL; "" = a SQLite file beside the repository
    log_retain_events: int = 4096  # most recent events kept per user (at least max history)
    log_ttl_s: float = 0.0  # a user's log is deleted this long after its last event; 0 = kept
    log_durability: str = "full"  # sqlite: "full" survives power loss, "normal" a process crash
    encoder_max_batch_size: int = 8  # requests of different sessions handled in one call
    # batching of the stateless stages
    decoder_max_batch_size: int = 16
    ranker_max_batch_size: int = 16
    # 0: a stage takes what has queued while it was busy and never waits for more; at concurrency 1
    # any delay is added to every request at every stage (perf/results/served_ml1m_queue_delay_1000us.json)
    max_queue_delay_us: int = 0
    # request defaults and limits
    decode: DecodeOptions = field(default_factory=DecodeOptions)  # the PFA paper's: pfa, beam 100, k 256, r 0.5, s 1
    top_k: int = 10
    max_top_k: int = 256
    max_beam_width: int = 1024
    max_request_events: int = 100_000
    ranker_microbatch: int = RANKER_MICROBATCH
    rank_by: str = "fused"  # order of the top-K: "fused" (M-FALCON logit + retrieval log-prob) or "ranker" (logit)
    ranker_backend: str = "auto"  # auto (TensorRT on a GPU, else ONNX Runtime or torch by history length) | torch | onnx | tensorrt
    torch_threads: int = 1
    # the living catalog (model/catalog.py): rows reserved at load for added items, and how often a
    # stage looks for new changes between requests (a request naming a newer version applies it at once)
    catalog_capacity: int = 100_000
    catalog_poll_s: float = 0.5

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["decode"] = dataclasses.asdict(self.decode)
        return d


# --------------------------------------------------------------------------------------------
# pbtxt pieces
# --------------------------------------------------------------------------------------------
def _dims(dims: tuple) -> str:
    return "[ " + ", ".join(str(d) for d in dims) + " ]"


def _tensor(spec: P.TensorSpec, sizes: dict, io: str, ragged: bool = False, optional: bool = False) -> str:
    lines = [f'    name: "{spec.name}"', f"    data_type: {spec.config_type}", f"    dims: {_dims(spec.resolve(sizes))}"]
    if io == "input" and ragged:
        lines.append("    allow_ragged_batch: true")
    if io == "input" and optional:
        lines.append("    optional: true")
    return "  {\n" + "\n".join(lines) + "\n  }"


def _io(contract: P.ModelContract, sizes: dict, ensemble: bool = False) -> str:
    ins = ",\n".join(
        _tensor(t, sizes, "input", ragged=(not ensemble and t.name in contract.ragged), optional=t.optional) for t in contract.inputs
    )
    outs = ",\n".join(_tensor(t, sizes, "output") for t in contract.outputs)
    return f"input [\n{ins}\n]\noutput [\n{outs}\n]\n"


def _parameters(params: dict) -> str:
    items = ",\n".join(f'  {{\n    key: "{k}"\n    value: {{ string_value: "{v}" }}\n  }}' for k, v in params.items())
    return f"parameters [\n{items}\n]\n"


def _header(name: str, max_batch_size: int, instances: int | None) -> str:
    s = f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch_size}\n'
    s += "version_policy: { latest { num_versions: 1 } }\n"
    if instances:
        s += f"instance_group [\n  {{\n    count: {instances}\n    kind: KIND_CPU\n  }}\n]\n"
    return s


def _common_params(cfg: ModelConfig, opt: ServingOptions) -> dict:
    d = opt.decode
    return {
        "max_history": opt.max_history or cfg.max_seq_len,
        "top_k": opt.top_k,
        "max_top_k": opt.max_top_k,
        "max_beam_width": opt.max_beam_width,
        "max_request_events": opt.max_request_events,
        "decode_mode": d.mode,
        "beam_width": d.beam_width,
        "pfa_k": d.k,
        "pfa_r": d.r,
        "selection_step": d.selection_step,
        "torch_threads": opt.torch_threads,
        # every stage follows the catalog's changes in the event log's store
        "event_log": opt.event_log,
        "catalog_capacity": opt.catalog_capacity,
        "catalog_poll_s": opt.catalog_poll_s,
    }


# --------------------------------------------------------------------------------------------
# One config per model
# --------------------------------------------------------------------------------------------
def encoder_config(cfg: ModelConfig, opt: ServingOptions) -> str:
    sizes = P.model_sizes(cfg)
    idle_us = int(opt.visit_idle_s * 1e6)
    controls = ",\n".join(
        f'    {{\n      name: "{name}"\n      control [ {{ kind: {kind} int32_false_true: [ 0, 1 ] }} ]\n    }}'
        for name, kind in (
            (P.CONTROL_START, "CONTROL_SEQUENCE_START"),
            (P.CONTROL_END, "CONTROL_SEQUENCE_END"),
            (P.CONTROL_READY, "CONTROL_SEQUENCE_READY"),
        )
    )
    seq = (
        "sequence_batching {\n"
        f"  max_sequence_idle_microseconds: {idle_us}\n"
        "  oldest {\n"
        f"    max_candidate_sequences: {opt.max_candidate_sequences}\n"
        f"    max_queue_delay_microseconds: {opt.max_queue_delay_us}\n"
        "  }\n"
        f"  control_input [\n{controls}\n  ]\n"
        "}\n"
    )
    params = _common_params(cfg, opt) | {
        "session_max_bytes": opt.session_max_bytes,
        "cache_idle_s": opt.cache_idle_s,
        "session_prefault_bytes": opt.session_prefault_bytes,
        "log_retain_events": opt.log_retain_events,
        "log_ttl_s": opt.log_ttl_s,
        "log_durability": opt.log_durability,
    }
    return (
        _header(P.ENCODER, opt.encoder_max_batch_size, opt.encoder_instances)
        + _io(P.ENCODER_CONTRACT, sizes)
        + seq
        + _parameters(params)
    )


def decoder_config(cfg: ModelConfig, opt: ServingOptions) -> str:
    sizes = P.model_sizes(cfg)
    return (
        _header(P.DECODER, opt.decoder_max_batch_size, opt.decoder_instances)
        + _io(P.DECODER_CONTRACT, sizes)
        + f"dynamic_batching {{\n  max_queue_delay_microseconds: {opt.max_queue_delay_us}\n}}\n"
        + _parameters(_common_params(cfg, opt))
    )


def ranker_config(cfg: ModelConfig, opt: ServingOptions, contract: P.ModelContract = P.RANKER_CONTRACT) -> str:
    sizes = P.model_sizes(cfg)
    params = _common_params(cfg, opt) | {"ranker_microbatch": opt.ranker_microbatch, "ranker_backend": opt.ranker_backend,
                                           "rank_by": opt.rank_by}
    return (
        _header(contract.name, opt.ranker_max_batch_size, opt.ranker_instances)
        + _io(contract, sizes)
        + f"dynamic_batching {{\n  max_queue_delay_microseconds: {opt.max_queue_delay_us}\n}}\n"
        + _parameters(params)
    )


def catalog_config(cfg: ModelConfig, opt: ServingOptions) -> str:
    """The catalog's management model: one instance, one request at a time (changes are few and
    serialised by the store)."""
    return (
        _header(P.CATALOG, 1, 1)
        + _io(P.CATALOG_CONTRACT, P.model_sizes(cfg))
        + _parameters({"event_log": opt.event_log, "catalog_capacity": opt.catalog_capacity,
                       "torch_threads": opt.torch_threads})
    )


def ensemble_config(cfg: ModelConfig, opt: ServingOptions, name: str = P.ENSEMBLE, wiring: tuple = P.ENSEMBLE_STEPS) -> str:
    """The ensemble `name` over `wiring`: (model, its inputs, its outputs) per step, tensors named alike throughout."""
    sizes = P.model_sizes(cfg)
    steps = []
    for model, ins, outs in wiring:
        imap = "\n".join(f'      input_map {{ key: "{n}" value: "{n}" }}' for n in ins)
        omap = "\n".join(f'      output_map {{ key: "{n}" value: "{n}" }}' for n in outs)
        steps.append(f'    {{\n      model_name: "{model}"\n      model_version: -1\n{imap}\n{omap}\n    }}')
    return (
        f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: 1\n'
        + _io(P.ENSEMBLE_CONTRACT, sizes, ensemble=True)
        + "ensemble_scheduling {\n  step [\n" + ",\n".join(steps) + "\n  ]\n}\n"
    )


def render(cfg: ModelConfig, opt: ServingOptions | None = None) -> dict:
    """Model name -> config.pbtxt text."""
    opt = opt or ServingOptions()
    if opt.max_history is not None and not 1 <= opt.max_history <= cfg.max_seq_len:
        raise ValueError(f"max_history must be in [1, {cfg.max_seq_len}] (the model's max_seq_len), got {opt.max_history}")
    header = "# Generated by export/triton_configs.py from the tensor contract; do not edit.\n"
    return {
        P.ENCODER: header + encoder_config(cfg, opt),
        P.DECODER: header + decoder_config(cfg, opt),
        P.RANKER: header + ranker_config(cfg, opt),
        P.CATALOG: header + catalog_config(cfg, opt),
        P.ENSEMBLE: header + ensemble_config(cfg, opt),
    }


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def write_configs(repository, cfg: ModelConfig, opt: ServingOptions | None = None) -> dict:
    """(Re)write <repository>/<model>/config.pbtxt for every model. Returns the paths."""
    repository = Path(repository)
    paths = {}
    for name, text in render(cfg, opt).items():
        paths[name] = repository / name / "config.pbtxt"
        atomic_write(paths[name], text)
    return paths


def config_from_checkpoint(path) -> ModelConfig:
    import torch

    blob = torch.load(path, map_location="cpu", weights_only=False)
    return ModelConfig.from_dict(blob["config"])


def add_serving_arguments(ap: argparse.ArgumentParser) -> None:
    d = ServingOptions()
    ap.add_argument("--encoder-instances", type=int, default=d.encoder_instances)
    ap.add_argument("--decoder-instances", type=int, default=d.decoder_instances)
    ap.add_argument("--ranker-instances", type=int, default=d.ranker_instances)
    ap.add_argument("--max-history", type=int, default=None)
    ap.add_argument("--session-max-bytes", type=int, default=d.session_max_bytes)
    ap.add_argument("--cache-idle-s", type=float, default=d.cache_idle_s)
    ap.add_argument("--session-prefault-bytes", type=int, default=d.session_prefault_bytes)
    ap.add_argument("--visit-idle-s", type=float, default=d.visit_idle_s)
    ap.add_argument("--max-candidate-sequences", type=int, default=d.max_candidate_sequences)
    ap.add_argument("--event-log", default=d.event_log, help="sqlite path or redis://host:port/db ('' = SQLite beside the repository)")
    ap.add_argument("--log-retain-events", type=int, default=d.log_retain_events)
    ap.add_argument("--log-ttl-s", type=float, default=d.log_ttl_s)
    ap.add_argument("--log-durability", default=d.log_durability, choices=["full", "normal"])
    ap.add_argument("--decoder-max-batch-size", type=int, default=d.decoder_max_batch_size)
    ap.add_argument("--ranker-max-batch-size", type=int, default=d.ranker_max_batch_size)
    ap.add_argument("--max-queue-delay-us", type=int, default=d.max_queue_delay_us)
    ap.add_argument("--decode-mode", default=d.decode.mode)
    ap.add_argument("--beam-width", type=int, default=d.decode.beam_width)
    ap.add_argument("--pfa-k", type=int, default=d.decode.k)
    ap.add_argument("--pfa-r", type=float, default=d.decode.r)
    ap.add_argument("--selection-step", type=int, default=d.decode.selection_step)
    ap.add_argument("--top-k", type=int, default=d.top_k)
    ap.add_argument("--ranker-backend", default=d.ranker_backend, choices=["auto", "torch", "onnx", "tensorrt"])
    ap.add_argument("--rank-by", default=d.rank_by, choices=["ranker", "fused"])
    ap.add_argument("--torch-threads", type=int, default=d.torch_threads)


def serving_options_from_args(a: argparse.Namespace) -> ServingOptions:
    return ServingOptions(
        encoder_instances=a.encoder_instances,
        decoder_instances=a.decoder_instances,
        ranker_instances=a.ranker_instances,
        max_history=a.max_history,
        session_max_bytes=a.session_max_bytes,
        cache_idle_s=a.cache_idle_s,
        session_prefault_bytes=a.session_prefault_bytes,
        visit_idle_s=a.visit_idle_s,
        max_candidate_sequences=a.max_candidate_sequences,
        event_log=a.event_log,
        log_retain_events=a.log_retain_events,
        log_ttl_s=a.log_ttl_s,
        log_durability=a.log_durability,
        decoder_max_batch_size=a.decoder_max_batch_size,
        ranker_max_batch_size=a.ranker_max_batch_size,
        max_queue_delay_us=a.max_queue_delay_us,
        decode=DecodeOptions(mode=a.decode_mode, beam_width=a.beam_width, k=a.pfa_k, r=a.pfa_r, selection_step=a.selection_step),
        top_k=a.top_k,
        ranker_backend=a.ranker_backend,
        rank_by=a.rank_by,
        torch_threads=a.torch_threads,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m export.triton_configs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="model checkpoint (its ModelConfig sets the tensor dims)")
    ap.add_argument("--repository", default="model_repository")
    add_serving_arguments(ap)
    a = ap.parse_args(argv)
    for name, path in write_configs(a.repository, config_from_checkpoint(a.checkpoint), serving_options_from_args(a)).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
