"""The tasks' batches and scores, on one process: a step's samples do not depend on the world
size, the language model carries its hidden state between steps (detached) and resets it at an
epoch's start, its test perplexity is the same for any world size, and BERT's masking keeps its
counts and proportions."""

import math

import pytest
import torch

from commlab.config import load_config
from commlab.core.runtime import Runtime
from commlab.data.base import PreparedData
from commlab.data.text import PTB, load_text, prepare_text
from commlab.data.tokens import BERT_VOCAB
from commlab.loop.tasks import ImageClassification, LanguageModel, mask_tokens
from commlab.models import build_model
from commlab.registry import DATASETS
from standins import ptb_corpus


def _rt(rank, world):
    return Runtime(rank, world, rank, "gloo", torch.device("cpu"))


def _config(**train):
    return load_config(None, [f"train.{k}={v}" for k, v in train.items()] + ["dataset=synthetic", "model=mlp"])


def _cifar_like(n=96):
    g = torch.Generator().manual_seed(0)
    spec = DATASETS.get("cifar10")
    x = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)
    return PreparedData(spec, x, torch.arange(n) % 10, x[:20], torch.arange(20) % 10, {"content_hash": "t"})


def test_a_steps_images_do_not_depend_on_the_world_size():
    data = _cifar_like()
    config = _config(batch_size=8)
    steps = {}
    for world in (1, 2, 4):
        batch = 8 * 4 // world  # the same global batch
        config["train"]["batch_size"] = batch
        tasks = [ImageClassification(config, _rt(r, world), data) for r in range(world)]
        per_rank = [list(t.batches(epoch=1, start=0)) for t in tasks]
        steps[world] = [torch.cat([per_rank[r][s][0] for r in range(world)]) for s in range(tasks[0].steps_per_epoch)]
        # resuming at step 2 gives the epoch's remaining batches
        assert all(torch.equal(a[0], b[0]) for a, b in zip(per_rank[0][2:], tasks[0].batches(1, 2), strict=True))
    assert len(steps[1]) == 3
    for world in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(steps[1], steps[world], strict=True))
    # augmented: the crops differ from the stored images, and from epoch to epoch
    t = ImageClassification(config, _rt(0, 1), data)
    assert not torch.equal(next(t.batches(0, 0))[0], next(t.batches(1, 0))[0])


@pytest.fixture
def ptb(tmp_path):
    prepare_text(tmp_path / "prepared" / "ptb", PTB, str(ptb_corpus(tmp_path / "raw")))
    return load_text(tmp_path / "prepared" / "ptb", PTB, "")


def test_the_corpus_is_read_as_word_language_model_reads_it(ptb, tmp_path):
    words = {}
    for split in ("train", "valid", "test"):  # one vocabulary, in order of first appearance, <eos> per line
        for line in (tmp_path / "raw" / f"ptb.{split}.txt").read_text().splitlines():
            for w in line.split() + ["<eos>"]:
                words.setdefault(w, len(words))
    assert ptb.vocab_size == len(words)
    first = (tmp_path / "raw" / "ptb.train.txt").read_text().splitlines()[0].split() + ["<eos>"]
    assert ptb.ids["train"][: len(first)].tolist() == [words[w] for w in first]
    assert (tmp_path / "prepared" / "ptb" / "vocab.txt").read_text().split() == list(words)


def test_language_model_columns_state_and_world_size(ptb):
    config = _config(batch_size=3)
    config["task"]["bptt"] = 7
    single = LanguageModel({**config, "train": {**config["train"], "batch_size": 6}}, _rt(0, 1), ptb)
    ranks = [LanguageModel(config, _rt(r, 2), ptb) for r in range(2)]
    assert single.steps_per_epoch == ranks[0].steps_per_epoch > 3
    # rank r reads columns 3r..3r+2 of the stream cut into 6 columns: the global batch of a step
    for s, (x, y) in enumerate(single.batches(0, 0)):
        assert torch.equal(torch.cat([list(t.batches(0, 0))[s][0] for t in ranks], dim=1), x)
        assert torch.equal(x[1:], y[:-1])  # targets: the next token
    # hidden state: carried (detached) between steps, reset at an epoch's start, kept over a resume
    torch.manual_seed(0)
    model = build_model("lstm_lm", vocab_size=ptb.vocab_size, dropout=0.0)
    task = ranks[0]
    batches = task.batches(0, 0)
    task.loss(model, next(batches)).backward()
    carried = task.hidden
    assert carried[0].shape == (2, 3, 150) and not carried[0].requires_grad and carried[0].abs().sum() > 0
    x, y = next(batches)
    expected, _ = model(x, carried)
    loss = task.loss(model, (x, y))
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(expected.reshape(-1, ptb.vocab_size), y.reshape(-1)))
    state = task.state_dict()
    resumed = LanguageModel(config, _rt(0, 2), ptb)
    resumed.load_state_dict(state)
    next(resumed.batches(0, 2))
    assert resumed.hidden is state["hidden"]
    task.batches(1, 0)
    assert task.hidden is None

    # the test perplexity: the same on one rank and summed over three (columns dealt out)
    from commlab.loop.evaluation import evaluate_on_main

    class Algo:
        eval_model = model

    ppl = evaluate_on_main(Algo(), single, _rt(0, 1))
    parts = [t.eval_part(model.eval(), r, 3) for r, t in enumerate([single] * 3)]
    combined = sum(m["test_loss"] * n for m, n in parts) / sum(n for _, n in parts)
    assert math.isclose(ppl["test_loss"], combined, rel_tol=1e-6)
    assert math.isclose(ppl["test_perplexity"], math.exp(ppl["test_loss"]))
    assert ppl["test_perplexity"] > 0.5 * ptb.vocab_size  # untrained: about as perplexed as a uniform guess
    assert sum(n for _, n in parts) == (len(ptb.ids["test"]) // 10 - 1) * 10


def test_masking_counts_proportions_and_keys():
    vocab = dict(BERT_VOCAB)
    ids = torch.randint(1000, 2000, (4000, 32))
    ids[:, 0], ids[:, -1] = vocab["cls_id"], vocab["sep_id"]
    index = torch.arange(4000)
    inputs, labels = mask_tokens(ids, index, 5, 0, 0.15, vocab)
    chosen = labels != -100
    assert (chosen.sum(1) == round(30 * 0.15)).all()  # an exact count per sample
    assert not chosen[:, 0].any() and not chosen[:, -1].any()
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(inputs[~chosen], ids[~chosen])
    masked = (inputs[chosen] == vocab["mask_id"]).float().mean().item()
    kept = (inputs[chosen] == ids[chosen]).float().mean().item()
    assert abs(masked - 0.8) < 0.02 and abs(kept - 0.1) < 0.015  # and about 10% random tokens
    # keyed by (seed, epoch, sample): the same sample in another batch is masked alike; other epochs differ
    again, _ = mask_tokens(ids[17:19], index[17:19], 5, 0, 0.15, vocab)
    assert torch.equal(again, inputs[17:19])
    other, _ = mask_tokens(ids, index, 5, 1, 0.15, vocab)
    assert not torch.equal(other, inputs)
