"""Serving helpers shared by the Triton models: the tensor contract (protocol), request
validation, the per-session history store and the server launcher."""
