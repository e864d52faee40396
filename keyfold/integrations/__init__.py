"""Bridges to libraries users already reach attention through (each imports its library lazily).

- :mod:`keyfold.integrations.transformers`: ``attn_implementation="keyfold"`` for Hugging Face models.
"""
