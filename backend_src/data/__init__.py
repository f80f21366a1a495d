"""Interaction data: loaders, the synthetic generator, leave-one-out splits and batches."""
from .loaders import (
    DataFormatError,
    build_sequence_data,
    data_dir,
    detect_format,
    load_amazon_json,
    load_amazon_sequential,
    load_csv,
    load_dataset,
    load_ml100k,
    load_movielens,
    load_path,
)
from .sequence_data import SequenceData
from .sequences import (
    Batch, eval_batches, item_popularity, length_bucketed, pad_histories, target_rows, train_batches,
)
from .synthetic import generate_synthetic

__all__ = [
    "Batch", "DataFormatError", "SequenceData", "build_sequence_data", "data_dir", "detect_format",
    "eval_batches", "generate_synthetic", "item_popularity", "length_bucketed", "load_amazon_json",
    "load_amazon_sequential", "load_csv", "load_dataset", "load_ml100k", "load_movielens",
    "load_path", "pad_histories", "target_rows", "train_batches",
]
