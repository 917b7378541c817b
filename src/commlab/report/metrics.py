"""Each task's headline test metric as the reports read it (docs/tasks.md, "How the loop calls a task").

A run logs the metric of its task: image classification ``test_accuracy`` (%), language modelling
``test_perplexity`` (lower is better), masked language modelling ``test_mlm_accuracy`` (% of the
masked tokens); each task class of :mod:`commlab.loop.tasks` names it as ``metric`` with
``higher_is_better``. Reports read MLflow only, so a run's task is told by which of these it
logged (a language model also logs ``test_loss``, an image classifier never a perplexity).

    run_metric(runs)             # per run: "test_accuracy", "test_perplexity" or "test_mlm_accuracy"
    metric = task_metric(runs)   # the TaskMetric of a group of runs compared together
    metric.margin_for(dense)     # how far from a reference still counts as "near" it

"Near the reference" is a point of accuracy (of masked tokens too: Ok-Topk's "similar accuracy",
RedSync's "correct accuracy"); for perplexity, where a point means less the higher the
perplexity, 2% of the reference's.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd


@dataclass(frozen=True)
class TaskMetric:
    """A task's headline test metric and how the claims and figures speak of it."""

    name: str  # as logged
    label: str  # an axis label
    quantity: str  # in a claim: "reaches {quantity} near dense SGD"
    measured: str  # before a number: "{measured} 91.2 ± 0.3"
    higher_is_better: bool
    margin: float  # "near": this many points, or with ``relative`` this fraction of the reference
    relative: bool = False
    unit: str = "points"  # of a gap between two values

    def margin_for(self, reference) -> float:
        """The margin of "near ``reference``" (a series of the reference's values over seeds)."""
        if not self.relative:
            return self.margin
        return self.margin * float(pd.Series(reference, dtype=float).mean())

    def within(self, margin: float) -> str:
        """'1 point', '2% (1.64)': the margin in words."""
        if self.relative:
            return f"{self.margin:.0%} ({margin:.3g})"
        return f"{margin:g} point" + ("s" if margin != 1 else "")

    @property
    def near(self) -> str:
        """'test accuracy within about a point': a claim's words for "as good as the reference"."""
        return f"{self.measured} within " + (f"{self.margin:.0%}" if self.relative else "about a point")


ACCURACY = TaskMetric("test_accuracy", "test accuracy (%)", "accuracy", "test accuracy", True, 1.0)
PERPLEXITY = TaskMetric("test_perplexity", "test perplexity (lower is better)", "perplexity", "test perplexity",
                        False, 0.02, relative=True, unit="perplexity")
MLM_ACCURACY = TaskMetric("test_mlm_accuracy", "masked-token accuracy (%)", "masked-token accuracy",
                          "masked-token accuracy", True, 1.0)
#: In the order a run's metric is looked for: the language tasks' own first, accuracy last.
TASK_METRICS = {m.name: m for m in (PERPLEXITY, MLM_ACCURACY, ACCURACY)}


def run_metric(runs: pd.DataFrame) -> pd.Series:
    """Per run (row), the name of its task's metric: the first of :data:`TASK_METRICS` it has a
    value of; ``test_accuracy`` for a run with none (not finished, or made before tasks)."""
    names = pd.Series(ACCURACY.name, index=runs.index, dtype=object)
    for name in reversed(list(TASK_METRICS)):
        if name in runs:
            names = names.mask(pd.to_numeric(runs[name], errors="coerce").notna(), name)
    return names


def task_metric(runs: pd.DataFrame) -> TaskMetric:
    """The metric of runs compared together: the one most of them logged (test accuracy for none)."""
    names = run_metric(runs) if len(runs) else pd.Series(dtype=object)
    return TASK_METRICS[names.value_counts().index[0]] if len(names) else ACCURACY


#: Names for a setting in a claim's note: "Fashion-MNIST CNN", "PTB LSTM".
DATASET_NAMES = {"fashion_mnist": "Fashion-MNIST", "cifar10": "CIFAR-10", "imagenet": "ImageNet", "ptb": "PTB",
                 "wikitext2": "WikiText-2", "bert_tokens": "tokenised corpus", "synthetic_tokens": "generated tokens",
                 "synthetic": "synthetic data"}
MODEL_NAMES = {"cnn": "CNN", "mlp": "MLP", "wide_mlp": "wide MLP", "resnet20": "ResNet-20", "resnet44": "ResNet-44",
               "resnet50": "ResNet-50", "vgg16": "VGG-16", "vgg16_fc": "VGG-16", "vgg16_imagenet": "VGG-16",
               "alexnet": "AlexNet", "googlenet": "GoogLeNet", "lstm_lm": "LSTM", "bert": "BERT"}


def setting(runs: pd.DataFrame) -> str:
    """'Fashion-MNIST CNN': the dataset and model of runs (each of several joined by '/')."""
    def names(column: str, known: dict) -> str:
        values = runs[column].dropna().astype(str).unique() if column in runs else []
        return "/".join(known.get(v, v) for v in sorted(values)) or "?"

    return f"{names('dataset', DATASET_NAMES)} {names('model', MODEL_NAMES)}"
