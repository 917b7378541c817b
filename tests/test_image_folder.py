"""The image-folder kind: preparing writes a manifest (nothing copied) that follows the files,
ImageFolder's labels, the checks a run makes, and batches independent of the loader workers."""

import os
import subprocess
import sys

import pytest
import torch

from commlab.bench.loader import generate_image_folder
from commlab.data import DamagedDataError, load_dataset
from commlab.data.image_folder import IMAGENET, prepare_folder
from commlab.loop.batches import StreamedImages


@pytest.fixture
def folder(tmp_path):
    return generate_image_folder(tmp_path / "imagenet", classes=3, per_class=4, val_per_class=2)


def test_manifest_labels_and_hash(folder, tmp_path):
    from torchvision.datasets import ImageFolder

    out = tmp_path / "prepared" / "imagenet"
    meta = prepare_folder(out, IMAGENET, str(folder))
    assert meta["train_shape"] == [12] and meta["test_shape"] == [6] and meta["source"] == str(folder)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.tsv", "val.tsv"]  # no image copied
    data = load_dataset("imagenet", tmp_path / "prepared")
    reference = ImageFolder(str(folder / "train"))  # the same files, order and labels as torchvision's
    assert [data.train.path(i) for i in range(12)] == [p for p, _ in reference.samples]
    assert data.train.labels.tolist() == [y for _, y in reference.samples]
    assert data.meta["classes"] == reference.classes and data.num_classes == 3
    # a changed file changes the manifest's hash; verify_data finds it without preparing again
    victim = folder / "train" / reference.classes[1] / os.path.basename(reference.samples[5][0])
    victim.write_bytes(victim.read_bytes() + b"\0")
    with pytest.raises(DamagedDataError, match="differs from the manifest"):
        load_dataset("imagenet", tmp_path / "prepared", verify=True)
    assert prepare_folder(tmp_path / "again", IMAGENET, str(folder))["content_hash"] != meta["content_hash"]


def test_missing_images_and_damaged_manifest(folder, tmp_path):
    with pytest.raises(FileNotFoundError, match="data.imagenet.source"):
        prepare_folder(tmp_path / "p", IMAGENET, "")
    with pytest.raises(FileNotFoundError, match="val/"):
        prepare_folder(tmp_path / "p", IMAGENET, str(folder / "train"))
    out = tmp_path / "prepared" / "imagenet"
    prepare_folder(out, IMAGENET, str(folder))
    with pytest.raises(FileNotFoundError, match="data_source"):
        load_dataset("imagenet", tmp_path / "prepared", source=str(tmp_path / "elsewhere"))
    (out / "val.tsv").write_text("broken\n")
    with pytest.raises(DamagedDataError, match="val.tsv"):
        load_dataset("imagenet", tmp_path / "prepared")


def test_batches_do_not_depend_on_loader_workers(folder, tmp_path):
    prepare_folder(tmp_path / "prepared" / "imagenet", IMAGENET, str(folder))
    data = load_dataset("imagenet", tmp_path / "prepared")
    rows = torch.arange(12).view(3, 4)
    batches = {}
    for workers in (0, 2):
        config = {"task": {"image_size": 24}, "loader": {"workers": workers}, "train": {}}
        source = StreamedImages(data, config, 5, torch.device("cpu"))
        batches[workers] = list(source.train_batches(rows, 2))
        evaluated = list(source.eval_batches(1, 2, 2))
        assert [len(y) for _, y in evaluated] == [2, 1] and evaluated[0][0].shape == (2, 3, 24, 24)
    for (x0, y0), (x2, y2) in zip(batches[0], batches[2], strict=True):
        assert torch.equal(x0, x2) and torch.equal(y0, y2)
    assert batches[0][0][0].shape == (4, 3, 24, 24) and batches[0][0][0].dtype == torch.float32
    assert torch.equal(batches[0][0][1], data.train.labels[:4])
    assert abs(batches[0][1][0].mean().item()) < 3  # normalised


_DECODE_IMPORTS = """
import sys, torch
from commlab.data import load_dataset
from commlab.data.image_folder import TrainImages
from commlab.loop.batches import StreamedImages
data = load_dataset("imagenet", sys.argv[1])
config = {"task": {"image_size": 24}, "loader": {"workers": 2}, "train": {}}
source = StreamedImages(data, config, 5, torch.device("cpu"))
before = set(sys.modules)
TrainImages(data.train, 24, 5)[(0, 0)]
print(sorted(set(sys.modules) - before))
"""


def test_a_loader_worker_decodes_without_importing(folder, tmp_path):
    """Every module decoding needs (PIL's format plugins included) is loaded by the rank before it
    forks its workers: a fresh interpreter imports nothing new on its first decode."""
    prepare_folder(tmp_path / "prepared" / "imagenet", IMAGENET, str(folder))
    out = subprocess.run([sys.executable, "-c", _DECODE_IMPORTS, str(tmp_path / "prepared")], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_dataset_read_by_path_names_what_its_folder_lacks(tmp_path):
    from commlab.data.base import DatasetSpec
    from commlab.data.checks import source_folder

    spec = DatasetSpec("imagenet", 3, 224, 1000, (0.5,), (0.5,), how_to_get="Point data.imagenet.source at it.")
    with pytest.raises(FileNotFoundError, match="no folder given for imagenet. Point data.imagenet.source"):
        source_folder(spec, None, ["train", "val"])
    (tmp_path / "train").mkdir()
    with pytest.raises(FileNotFoundError, match=r"lacks val/\. Point"):
        source_folder(spec, str(tmp_path), ["train", "val"])
    assert source_folder(spec, str(tmp_path / "train" / ".."), ["train"]) == tmp_path.resolve()
    (tmp_path / "train.npy").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"lacks test\.npy\."):
        source_folder(spec, str(tmp_path), ["train.npy", "test.npy"], kind="file")
