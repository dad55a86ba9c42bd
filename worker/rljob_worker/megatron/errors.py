"""The error every megatron module raises for a setting it cannot use (own module: ``model_config``,
``moe`` and the engine all raise it without importing each other)."""


class MegatronConfigError(ValueError):
    """A parallel layout, recompute or ``overrideTransformerConfig`` setting megatron cannot use (names
    the spec key and the fix)."""
