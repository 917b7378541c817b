"""Tasks: what the loop trains on and how it scores it, chosen by the dataset (docs/tasks.md).

The loop asks a task for five things and knows nothing else about inputs or losses; methods see
only the model and its gradients, and know nothing of tasks at all:

* ``steps_per_epoch``, ``total_steps``, ``batch_size`` (samples per rank and step) and
  ``model_inputs()`` (what the model's factory needs: image channels and classes, a vocabulary);
* ``batches(epoch, start)``: this rank's batches of ``epoch`` from step ``start`` on, on the
  run's device (an iterator; the loop closes it when it stops early);
* ``loss(model, batch)``: the forward pass and the mean loss to back-propagate;
* ``eval_part(model, rank, world_size)``: this rank's share of the test set scored, as
  ``({metric: mean}, count)`` (the loop weights the means by the counts over ranks), and
  ``eval_metrics(means)``: the logged metrics from the combined means;
* ``state_dict()`` / ``load_state_dict()``: what a step carries to the next (the language
  model's hidden state), saved in every checkpoint.

Three tasks:

* :class:`ImageClassification` (``tensors`` and ``image_folder`` datasets): cross-entropy,
  ``test_loss`` and ``test_accuracy`` (%).
* :class:`LanguageModel` (``text``): word_language_model's truncated BPTT (pytorch/examples, as
  RedSync's release runs it): the training stream in ``workers x batch_size`` columns, rank r
  reading columns ``r*B .. r*B+B-1``, ``task.bptt`` tokens per step, the LSTM's hidden state
  carried from step to step (detached), reset at each epoch's start; ``test_loss`` per token and
  ``test_perplexity``. The test stream is cut into ``task.eval_columns`` columns (independent
  streams, so the score does not depend on the world size), dealt out to the ranks.
* :class:`MaskedLM` (``tokens``): BERT's masked-token objective (Devlin et al. 2019, section 3.1):
  15% (``task.mask_prob``) of the positions of each ``task.seq_len``-token sample, an exact count
  as in BERT's data preparation, of which 80% become ``[MASK]``, 10% a random token, 10% stay;
  cross-entropy on those positions; ``test_loss`` and ``test_mlm_accuracy`` (%) on fixed masks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from commlab.data import load_dataset, shard_indices
from commlab.data.keyed import keyed_bits, keyed_int, keyed_uniform
from commlab.loop.batches import ResidentImages, StreamedImages, image_rows
from commlab.registry import DATASETS

EVAL_EPOCH = 0xFFFFFFFF  # the epoch key of evaluation masks: the same at every evaluation


class Task:
    """The common part: step counts from ``n_steps_per_epoch`` and ``train.epochs / max_steps``."""

    metric = "test_loss"  # the headline test metric (reports read it)
    higher_is_better = False

    def __init__(self, config: dict, rt, steps_per_epoch: int, meta: dict, spec):
        train = config["train"]
        self.rt, self.seed, self.meta, self.spec = rt, config["seed"], meta, spec
        self.batch_size, self.eval_batch = train["batch_size"], train["eval_batch_size"]
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = steps_per_epoch * train["epochs"]
        if train.get("max_steps"):
            self.total_steps = min(self.total_steps, train["max_steps"])

    def eval_metrics(self, means: dict[str, float]) -> dict[str, float]:
        return dict(means)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _steps_or_fail(steps: int, what: str, config: dict, world_size: int) -> int:
    if steps < 1:  # before anything is recorded: more workers than samples
        raise ValueError(f"{what} of {config['dataset']!r} cannot fill one step of {world_size} workers x batch "
                         f"{config['train']['batch_size']}; lower workers or train.batch_size")
    return steps


class ImageClassification(Task):
    metric, higher_is_better = "test_accuracy", True

    def __init__(self, config: dict, rt, data):
        source = StreamedImages(data, config, config["seed"], rt.device) if data.spec.kind == "image_folder" \
            else ResidentImages(data, config["train"], config["seed"], rt.device)
        steps = source.n_train // (rt.world_size * config["train"]["batch_size"])
        super().__init__(config, rt, _steps_or_fail(steps, f"{source.n_train} training samples", config, rt.world_size),
                         data.meta, data.spec)
        self.source = source

    @property
    def test_samples(self) -> int:
        """How many test images an evaluation scores (logged as the run's ``test_images``)."""
        return self.source.n_test

    def model_inputs(self) -> dict:
        size = getattr(self.source, "size", self.spec.image_size)
        return {"in_channels": self.spec.channels, "num_classes": self.source.num_classes, "image_size": size}

    def batches(self, epoch: int, start: int) -> Iterator:
        rows = image_rows(self.source, epoch, self.rt.rank, self.rt.world_size, self.batch_size, self.seed, start)
        return self.source.train_batches(rows, epoch)

    def loss(self, model, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def eval_part(self, model, rank: int, world_size: int) -> tuple[dict[str, float], int]:
        loss_sum, correct, n = 0.0, 0, 0
        for x, y in self.source.eval_batches(rank, world_size, self.eval_batch):
            out = model(x)
            loss_sum += F.cross_entropy(out, y, reduction="sum").item()
            correct += (out.argmax(1) == y).sum().item()
            n += len(y)
        return {"test_loss": loss_sum / max(n, 1), "test_accuracy": 100.0 * correct / max(n, 1)}, n


def _columns(ids: torch.Tensor, columns: int) -> torch.Tensor:
    """word_language_model's batchify: the stream as ``columns`` contiguous columns (rows: time)."""
    rows = len(ids) // columns
    return ids[: rows * columns].view(columns, rows).t().contiguous()


def _detach(hidden):
    return tuple(h.detach() for h in hidden) if isinstance(hidden, tuple) else hidden.detach()


class LanguageModel(Task):
    metric = "test_perplexity"

    def __init__(self, config: dict, rt, data):
        opts, train = config["task"], config["train"]
        self.bptt, self.eval_columns = opts["bptt"], opts["eval_columns"]
        ids = data.ids["train"][: train.get("train_subset")]
        global_columns = rt.world_size * train["batch_size"]
        rows = len(ids) // global_columns
        steps = math.ceil((rows - 1) / self.bptt) if rows > 1 else 0
        super().__init__(config, rt, _steps_or_fail(steps, f"{len(ids)} training tokens", config, rt.world_size),
                         data.meta, data.spec)
        b = train["batch_size"]
        self.train = _columns(ids, global_columns)[:, rt.rank * b:(rt.rank + 1) * b].contiguous().to(rt.device)
        self.test = data.ids["test"][: train.get("test_subset")]
        self.vocab_size = data.vocab_size
        self.hidden = None

    def model_inputs(self) -> dict:
        return {"vocab_size": self.vocab_size}

    def _windows(self, source: torch.Tensor, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(start * self.bptt, len(source) - 1, self.bptt):
            n = min(self.bptt, len(source) - 1 - i)
            yield source[i:i + n], source[i + 1:i + 1 + n]

    def batches(self, epoch: int, start: int) -> Iterator:
        if start == 0:  # a new epoch starts from a zero state (a resumed one from its checkpoint's)
            self.hidden = None
        return self._windows(self.train, start)

    def loss(self, model, batch) -> torch.Tensor:
        x, y = batch
        out, hidden = model(x, self.hidden)
        self.hidden = _detach(hidden)  # truncated BPTT: the next step starts from here, no gradient through
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    @torch.no_grad()
    def eval_part(self, model, rank: int, world_size: int) -> tuple[dict[str, float], int]:
        cols = _columns(self.test, self.eval_columns)[:, rank::world_size].to(self.rt.device)
        loss_sum, n, hidden = 0.0, 0, None
        if cols.shape[1]:
            for x, y in self._windows(cols, 0):
                out, hidden = model(x, hidden)
                loss_sum += F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum").item()
                n += y.numel()
        return {"test_loss": loss_sum / max(n, 1)}, n

    def eval_metrics(self, means: dict[str, float]) -> dict[str, float]:
        return {**means, "test_perplexity": math.exp(min(means["test_loss"], 700.0))}

    def state_dict(self) -> dict:
        return {"hidden": self.hidden}

    def load_state_dict(self, state: dict) -> None:
        self.hidden = state.get("hidden")


def mask_tokens(ids: torch.Tensor, index: torch.Tensor, seed: int, epoch: int, prob: float,
                vocab: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking of the samples ``ids`` (N x L, [CLS] first, [SEP] last), keyed by (seed,
    epoch, sample): ``max(1, round((L-2) * prob))`` positions per sample, 80% [MASK], 10% a random
    token, 10% unchanged. Returns the inputs and the labels (-100 where nothing is predicted)."""
    n, length = ids.shape
    key = index.to(ids.device)[:, None] * length + torch.arange(length, device=ids.device)
    count = max(1, round((length - 2) * prob))
    score = keyed_bits(seed, epoch, key, 0)
    score[:, 0] = score[:, -1] = -1  # [CLS] and [SEP] are never chosen
    chosen = torch.zeros_like(ids, dtype=torch.bool).scatter_(1, score.topk(count, dim=1).indices, True)
    action = keyed_uniform(seed, epoch, key, 1)
    inputs = torch.where(chosen & (action < 0.8), vocab["mask_id"], ids)
    random_ids = keyed_int(seed, epoch, key, 2, vocab["vocab_size"])
    inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), random_ids, inputs)
    return inputs, torch.where(chosen, ids, -100)


class MaskedLM(Task):
    metric, higher_is_better = "test_mlm_accuracy", True

    def __init__(self, config: dict, rt, data):
        opts, train = config["task"], config["train"]
        self.seq_len, self.mask_prob, self.vocab = opts["seq_len"], opts["mask_prob"], data.vocab
        if self.seq_len < 3:
            raise ValueError(f"config key task.seq_len: {self.seq_len} leaves no token between [CLS] and [SEP]")
        self.train, self.test = data.train, data.test
        self.n_train = min(self.train.windows(self.seq_len), train.get("train_subset") or 2**62)
        self.n_test = min(self.test.windows(self.seq_len), train.get("test_subset") or 2**62)
        steps = self.n_train // (rt.world_size * train["batch_size"])
        super().__init__(config, rt, _steps_or_fail(steps, f"{self.n_train} training sequences", config, rt.world_size),
                         data.meta, data.spec)

    def model_inputs(self) -> dict:
        return {"vocab_size": int(self.vocab["vocab_size"]), "max_len": self.seq_len}

    def _batch(self, split, index: torch.Tensor, seed: int, epoch: int):
        ids = split.batch(index, self.seq_len, self.vocab, self.rt.device)
        return mask_tokens(ids, index, seed, epoch, self.mask_prob, self.vocab)

    def batches(self, epoch: int, start: int) -> Iterator:
        rows = shard_indices(self.n_train, self.rt.world_size, self.rt.rank, self.batch_size, epoch, self.seed)
        return (self._batch(self.train, row, self.seed, epoch) for row in rows[start:])

    def loss(self, model, batch) -> torch.Tensor:
        inputs, labels = batch
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)

    @torch.no_grad()
    def eval_part(self, model, rank: int, world_size: int) -> tuple[dict[str, float], int]:
        part = torch.arange(rank, self.n_test, world_size)  # host-side: sample numbers, keyed on the host
        loss_sum, correct, n = 0.0, 0, 0
        for i in range(0, len(part), self.eval_batch):
            # Fixed masks: seed 0 and the evaluation epoch key, whatever the run's seed.
            inputs, labels = self._batch(self.test, part[i:i + self.eval_batch], 0, EVAL_EPOCH)
            logits = model(inputs)
            chosen = labels != -100
            loss_sum += F.cross_entropy(logits[chosen], labels[chosen], reduction="sum").item()
            correct += (logits[chosen].argmax(-1) == labels[chosen]).sum().item()
            n += int(chosen.sum().item())
        return {"test_loss": loss_sum / max(n, 1), "test_mlm_accuracy": 100.0 * correct / max(n, 1)}, n


TASKS = {"image_classification": ImageClassification, "language_model": LanguageModel, "masked_lm": MaskedLM}


def build_task(config: dict, rt) -> Task:
    """The task of the run's dataset, with its data loaded (a clear error when it is missing)."""
    spec = DATASETS.get(config["dataset"])
    data = load_dataset(config["dataset"], config["data_dir"], verify=config.get("verify_data", False),
                        source=config.get("data_source"))
    return TASKS[spec.task](config, rt, data)
