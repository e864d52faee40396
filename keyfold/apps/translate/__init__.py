"""Models built only on keyfold's attention: the Transformer of "Attention Is All You Need"."""
