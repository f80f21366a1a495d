"""A stage's requests and responses as plain data: named arrays, the sequence id and flags in; named
arrays or an error with its gRPC status out."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from backend_src.serving.validation import RequestError
from genrec_contract.protocol import preview

START, END = 1, 2  # bits of StageRequest.flags, as Triton's sequence flags
INTERNAL = "INTERNAL"  # the status of a failure that is not the request's fault
_MAX_DETAIL = 240  # characters of an exception's text an INTERNAL answer shows


@dataclass(slots=True)
class StageRequest:
    """One request. An input is a numpy array, or a tensor read only once its declared shape has passed
    its checks (Triton's: ``shape()`` and ``as_numpy()``; see validation.read_input)."""

    inputs: Mapping[str, Any]
    correlation_id: int | str = 0  # the sequence id (0 or "": none)
    flags: int = 0  # START | END, when no control input says so


@dataclass(slots=True)
class StageResponse:
    """One answer: its outputs, or an error message and the gRPC status name it is answered with."""

    outputs: dict | None = None
    error: str | None = None
    status: str | None = None

    @classmethod
    def failed(cls, exc: Exception, stage: str) -> "StageResponse":
        """A refused request (RequestError: its own message and status), or a failure of the stage (INTERNAL)."""
        if isinstance(exc, RequestError):
            return cls(error=exc.message, status=exc.status)
        return cls.internal(exc, stage)

    @classmethod
    def internal(cls, exc: Exception, stage: str) -> "StageResponse":
        """A failure of the stage's work on requests it accepted, whatever the exception."""
        detail = str(exc)
        if len(detail) > _MAX_DETAIL:  # an exception's text may quote the request
            detail = preview(detail, _MAX_DETAIL)
        return cls(error=f"{stage}: {type(exc).__name__}: {detail}", status=INTERNAL)


def as_array(tensor) -> np.ndarray:
    """An input's values: a numpy array as it is, a Triton tensor's as numpy."""
    return tensor if isinstance(tensor, np.ndarray) else tensor.as_numpy()
