"""The tensor contract between the served models and their clients (numpy only).

The server's package, the config generator, every Triton model and the client library import
``genrec_contract.protocol``; the client distribution ships this package whole.
"""
