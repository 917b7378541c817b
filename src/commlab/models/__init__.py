"""Models by name (:data:`commlab.registry.MODELS`): ``build_model(name, **inputs, **options)``.

A model's factory takes what its task's data provides (image models: ``in_channels``,
``num_classes``, ``image_size``; language models: ``vocab_size``, and ``max_len`` for BERT) and
its own options (a run config's ``model_options``). The task a factory serves is its ``task``
attribute (:func:`model_task`; image classification when it has none).
"""

from commlab.registry import MODELS


def model_task(name: str) -> str:
    """The task the registered model ``name`` is built for."""
    return getattr(MODELS.get(name), "task", "image_classification")


def build_model(name: str, *args, **kwargs):
    """Build a registered model (image models also positionally: in_channels, num_classes, image_size)."""
    factory = MODELS.get(name)
    try:
        return factory(*args, **kwargs)
    except TypeError as err:  # an option the factory does not take: name it
        raise ValueError(f"model {name!r} cannot be built with {sorted(kwargs)}: {err}") from None


__all__ = ["build_model", "model_task"]
