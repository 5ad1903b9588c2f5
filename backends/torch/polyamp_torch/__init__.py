"""polyamp's PyTorch backend."""
