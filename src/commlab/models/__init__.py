"""Models by name (:data:`commlab.registry.MODELS`): ``build_model(name, in_channels, ...)``."""

from commlab.registry import MODELS


def build_model(name: str, in_channels: int, num_classes: int, image_size: int):
    """Build a registered model for inputs of ``in_channels`` x ``image_size``^2."""
    return MODELS.get(name)(in_channels=in_channels, num_classes=num_classes, image_size=image_size)


__all__ = ["build_model"]
