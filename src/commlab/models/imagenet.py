"""The ImageNet networks of the papers, from torchvision's model registry by name, randomly
initialised (no weights are downloaded): ResNet-50 (He et al. 2016; K-step, RedSync, SSD-SGD),
VGG-16 (Simonyan & Zisserman 2015, configuration D without batch norm: RedSync's ImageNet VGG,
with its 25088x4096 fc6 of 102.8M elements), AlexNet (Krizhevsky et al. 2012) and GoogLeNet
(Szegedy et al. 2015, without the auxiliary classifiers, as MXNet's GoogLeNet that SSD-SGD runs).

``vgg16`` names the CIFAR VGG-16 of the CIFAR grids (:mod:`commlab.models.cifar`); the ImageNet
one is ``vgg16_imagenet``. Other input channels replace the first convolution. AlexNet's and
VGG-16's option ``fc_width`` narrows the two 4096-wide hidden layers of their classifier (for
tests: the layers keep their kind and initialisation, the convolutions are untouched).
"""

from __future__ import annotations

from torch import nn

from commlab.registry import MODELS

# registered name -> (torchvision name, extra arguments)
TORCHVISION = {
    "resnet50": ("resnet50", {}),
    "vgg16_imagenet": ("vgg16", {}),
    "alexnet": ("alexnet", {}),
    "googlenet": ("googlenet", {"aux_logits": False, "init_weights": True}),
}


def _first_conv(model: nn.Module, in_channels: int) -> None:
    """Replace the first convolution by one reading ``in_channels`` channels."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, name.rpartition(".")[2], nn.Conv2d(
                in_channels, module.out_channels, module.kernel_size, module.stride, module.padding,
                bias=module.bias is not None))
            return


def _narrow_classifier(classifier: nn.Sequential, width: int, init_normal: bool) -> None:
    """Replace the hidden widths of a classifier's Linear layers by ``width`` (input of the first
    and output of the last kept); VGG's initialisation (normal, std 0.01, zero bias) when asked."""
    linear = [i for i, m in enumerate(classifier) if isinstance(m, nn.Linear)]
    for i in linear:
        old = classifier[i]
        new = nn.Linear(old.in_features if i == linear[0] else width,
                        old.out_features if i == linear[-1] else width)
        if init_normal:
            nn.init.normal_(new.weight, 0, 0.01)
            nn.init.constant_(new.bias, 0)
        classifier[i] = new


def torchvision_model(name: str):
    """A factory of torchvision's ``name`` for ``num_classes`` classes."""
    tv_name, extra = TORCHVISION[name]

    def build(in_channels: int = 3, num_classes: int = 1000, image_size: int = 224, fc_width: int = 4096) -> nn.Module:
        from torchvision.models import get_model

        model = get_model(tv_name, weights=None, num_classes=num_classes, **extra)
        if in_channels != 3:
            _first_conv(model, in_channels)
        if fc_width != 4096:
            if tv_name not in ("alexnet", "vgg16"):
                raise ValueError(f"fc_width applies to alexnet and vgg16_imagenet, not {name}")
            _narrow_classifier(model.classifier, fc_width, init_normal=tv_name == "vgg16")
        return model

    build.__doc__ = f"torchvision's {tv_name} (randomly initialised)."
    return build


for _name in TORCHVISION:
    MODELS.register(_name)(torchvision_model(_name))
