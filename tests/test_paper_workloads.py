"""The papers' workloads on small stand-ins of their data, through the real training loop on gloo
ranks: a folder of generated JPEGs in ImageNet's layout (ResNet-50, AlexNet, GoogLeNet; VGG-16's
step alone), CIFAR-10's tensor format with device-side augmentation, a PTB-layout corpus (the
LSTM language model), token ids by path and generated (BERT's masked LM). Each runs two SSGD
steps on two ranks; where the loss is a mean over equally many items per rank (the language
models), two ranks equal one rank with the same global batch. A run of the streamed loader with
two loader workers, stopped mid-epoch and resumed, equals an uninterrupted run with none."""

import math

import pytest
import torch

from commlab.testing import run_distributed
from looprun import replicas_equal as _assert_replicas_equal
from looprun import run as _run
from looprun import run_config
from looprun import runs as _runs

IMAGE_MODELS = [("resnet50", 64), ("alexnet", 64), ("googlenet", 32)]


def test_imagenet_models_on_a_streamed_image_folder(prepared, tmp_path):
    """Each model in turn on the same two ranks (torchvision is imported once per rank)."""
    configs = [run_config(prepared, tmp_path, model, "imagenet", model, 2, **{
        "task.image_size": size, "loader.workers": 0, "train.max_steps": 2, "train.eval_batch_size": 4,
        "train.lr": 0.01, "train.momentum": 0.0}) for model, size in IMAGE_MODELS]
    per_rank = run_distributed(_runs, 2, args=(configs,), timeout_s=300)
    for i, (model, _) in enumerate(IMAGE_MODELS):
        results = [per_rank[0][i], per_rank[1][i]]
        _assert_replicas_equal(results)
        final = results[0][0]
        assert final["step"] == 2 and 0 < final["train_loss"] < 3 * math.log(4), model
        fc = [v for k, v in results[0][1].items() if k.endswith("weight") and v.dim() == 2][-1]
        assert fc.shape[0] == 4, model  # the stand-in's four class folders
        assert final["test_accuracy"] in [100 * k / 8 for k in range(9)], model  # 8 validation images scored once


def test_vgg16_imagenet_step():
    """VGG-16 for ImageNet (fc6 of 102.8M elements) at 32 pixels: one forward and backward, on its
    own: a two-rank run would move 0.5 GB per step."""
    from commlab.models import build_model

    torch.manual_seed(0)
    model = build_model("vgg16_imagenet", 3, 4, 32)
    fc6 = model.classifier[0].weight
    assert fc6.shape == (4096, 25088) and fc6.numel() == 102_760_448
    loss = torch.nn.functional.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([0, 3]))
    loss.backward()
    assert math.isclose(loss.item(), math.log(4), rel_tol=0.2) and fc6.grad.abs().sum() > 0


def test_cifar_tensors_augmented_on_the_device(prepared, tmp_path):
    config = run_config(prepared, tmp_path, "cifar", "cifar10", "resnet20", 8, **{"train.max_steps": 2})
    results = run_distributed(_runs, 2, args=([config],), timeout_s=120)
    results = [r[0] for r in results]
    _assert_replicas_equal(results)
    assert results[0][0]["step"] == 2 and math.isfinite(results[0][0]["train_loss"])


@pytest.mark.parametrize("dataset,model,options", [
    ("ptb", "lstm_lm", {"model_options": "{dropout: 0.0}", "task.bptt": 5, "train.grad_clip": 0.25}),
    ("bert_tokens", "bert", {"model_options": "{layers: 2, hidden: 32, heads: 2, dropout: 0.0}", "task.seq_len": 16}),
], ids=["lstm_ptb", "bert_tokens"])
def test_language_models_two_ranks_equal_one(prepared, tmp_path, dataset, model, options):
    """Two SSGD ranks of batch 2 take the steps one rank of batch 4 takes (the losses are means
    over equally many tokens per rank), hidden state and masks included."""
    common = {"train.max_steps": 3, "train.momentum": 0.0, "train.eval_batch_size": 8, "train.test_subset": 64,
              **options}
    two = [r[0] for r in run_distributed(_runs, 2, args=([run_config(prepared, tmp_path, "two", dataset, model, 2,
                                                                  **common)],), timeout_s=120)]
    one = [r[0] for r in run_distributed(_runs, 1, args=([run_config(prepared, tmp_path, "one", dataset, model, 4,
                                                                  workers=1, **common)],), timeout_s=120)]
    _assert_replicas_equal(two)
    curve_two, curve_one = [p["train_loss"] for p in two[0][2]], [p["train_loss"] for p in one[0][2]]
    assert len(curve_one) == 3 and curve_one[-1] < curve_one[0]
    assert curve_two == pytest.approx(curve_one, rel=1e-5)
    for key, value in one[0][1].items():
        assert torch.allclose(two[0][1][key], value, atol=1e-6), key
    metric = "test_perplexity" if dataset == "ptb" else "test_mlm_accuracy"
    assert two[0][0][metric] == pytest.approx(one[0][0][metric], rel=1e-5)


def test_bert_on_generated_tokens(prepared, tmp_path):
    config = run_config(prepared, tmp_path, "synthetic", "synthetic_tokens", "bert", 2, **{
        "model_options": "{layers: 2, hidden: 32, heads: 2}", "task.seq_len": 16, "train.max_steps": 2,
        "train.test_subset": 8, "train.eval_batch_size": 4})
    results = [r[0] for r in run_distributed(_runs, 2, args=([config],), timeout_s=120)]
    _assert_replicas_equal(results)
    final = results[0][0]
    assert final["step"] == 2 and math.isclose(final["train_loss"], math.log(30522), rel_tol=0.1)
    assert 0 <= final["test_mlm_accuracy"] <= 100


def _stop_and_resume(rank, world, reference, config, stop_at):
    return _run(reference), _run(config, stop_at), _run(config)


def test_streamed_loader_resumes_mid_epoch_exactly(prepared, tmp_path):
    """Stopped after step 3 of an epoch's 6 and resumed (two loader workers), the run ends with
    the parameters and loss curve of one never stopped that read the files in the rank itself."""
    extra = {"task.image_size": 32}
    reference = run_config(prepared, tmp_path, "ref", "imagenet", "cnn", 2, **extra, **{"loader.workers": 0})
    config = run_config(prepared, tmp_path, "resumed", "imagenet", "cnn", 2, **extra, **{"loader.workers": 2})
    results = run_distributed(_stop_and_resume, 2, args=(reference, config, 3), timeout_s=300)
    for rank, (ref, stopped, resumed) in enumerate(results):
        assert stopped == (3, 3)  # mid-epoch: 3 of 6 steps
        assert resumed[0]["step"] == ref[0]["step"] == 6
        assert [p["train_loss"] for p in resumed[2]] == [p["train_loss"] for p in ref[2]]
        for key, value in ref[1].items():
            assert torch.equal(resumed[1][key], value), (rank, key)
        assert resumed[0]["test_accuracy"] == ref[0]["test_accuracy"]
