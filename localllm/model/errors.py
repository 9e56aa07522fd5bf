"""Errors of model loading, in a module of their own so that the loader and the checkpoint readers
it calls (localllm.model.quant_formats) both import them without importing each other."""


class ModelLoadError(ValueError):
    """A model file is missing, corrupt, truncated or unsupported."""
