"""The generative recommender: model, decoding, ops, training and serving."""

__version__ = "0.1.0"  # recorded in each published version's manifest

