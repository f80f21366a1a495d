"""The part of Triton's Python-backend API that this project's stages call, in plain Python, so a
test can drive a stage's model.py in one process (tests/test_encoder_stage.py) or check what the
adapter makes of a stage's answers (tests/test_stages.py). Requests and tensors hold numpy arrays;
metrics go nowhere."""
import numpy as np


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array

    def shape(self):
        return list(self._array.shape)


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message, code=UNKNOWN):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class InferenceRequest:
    """What Triton hands `execute`: the inputs, the sequence id and the sequence flags."""

    def __init__(self, inputs, correlation_id, flags=0):
        self._inputs, self._cid, self._flags = list(inputs), correlation_id, flags

    def inputs(self):
        return self._inputs

    def correlation_id(self):
        return self._cid

    def flags(self):
        return self._flags


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None):
        self._outputs, self._error = list(output_tensors), error

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error

    def output_tensors(self):
        return self._outputs


class Logger:
    @staticmethod
    def log_info(message):
        pass


class _Metric:
    def increment(self, n):
        pass

    def set(self, value):
        pass


class MetricFamily:
    COUNTER, GAUGE = 0, 1

    def __init__(self, name, description, kind):
        pass

    def Metric(self, labels=None):  # noqa: N802 - Triton's name
        return _Metric()
