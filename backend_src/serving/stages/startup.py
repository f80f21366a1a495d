"""The start every stage's Triton model makes, in its stub process.

A published version directory holds the stage's ``model.py`` beside its own copies of ``backend_src``
and ``genrec_contract``. ``model.py`` puts that directory first on ``sys.path`` before it imports
anything of the package (this module included), so the version serves the code published with it;
``start`` checks that both packages did come from there.
"""
from __future__ import annotations

import gc
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class StageStart:
    name: str  # the model's name
    version: str
    version_dir: Path  # the version's directory: its artifacts and its own copy of the package
    params: dict  # the config's parameters, name -> string


def config_params(model_config: str) -> dict:
    """The `parameters` of a model's config (Triton's JSON of it), name -> string value."""
    cfg = json.loads(model_config)
    return {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}


def check_own_copies(version_dir: Path) -> str:
    """Raise unless backend_src and genrec_contract were imported from `version_dir`; returns the
    package's version."""
    import backend_src
    import genrec_contract

    for package in (backend_src, genrec_contract):
        here = Path(package.__file__).resolve().parent
        if here != (Path(version_dir) / package.__name__).resolve():
            raise RuntimeError(f"{package.__name__} was imported from {here}, not from the version directory {version_dir}")
    return backend_src.__version__


def start(args: dict, log: Callable[[str], None] = print) -> StageStart:
    """What every stage does first with Triton's `args`: read its parameters, check that the version's
    own packages were imported, and run the model on the configured number of torch threads."""
    import torch

    version_dir = Path(args["model_repository"]) / args["model_version"]
    params = config_params(args["model_config"])
    log(f"{args['model_name']} v{args['model_version']}: backend_src {check_own_copies(version_dir)}")
    torch.set_num_threads(int(params.get("torch_threads", 1)))
    return StageStart(args["model_name"], args["model_version"], version_dir, params)


def loaded(rare_full_collections: bool = False) -> None:
    """Once the stage has loaded: what loading made is never garbage, so later collections skip it.
    With `rare_full_collections` (a stage that holds many long-lived objects and no reference cycles,
    the encoder's session cache: a full collection walks them all, about 0.1 s per 16,000 sessions)
    full collections are made rare."""
    gc.freeze()
    if rare_full_collections:
        gc.set_threshold(700, 10, 1000)
