"""Serving helpers shared by the Triton models: request
validation, the per-session history store and the server launcher."""
