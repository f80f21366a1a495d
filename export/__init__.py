"""Exporters and publishing: training, semantic IDs, ONNX, configs, model versions."""
