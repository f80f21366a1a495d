"""The generative recommender: model, decoding, ops, training and serving."""

__version__ = "0.1.0"  # recorded in each published version's manifest


def require_copy_in(directory) -> str:
    """Raise unless this package was imported from ``directory``/backend_src: a published version
    serves the code published with it, never another copy found first on the path. Returns the
    package's version."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    if here != (Path(directory) / "backend_src").resolve():
        raise RuntimeError(f"backend_src was imported from {here}, not from the version directory {directory}")
    return __version__
