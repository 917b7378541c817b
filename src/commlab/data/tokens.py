"""Token-id corpora for masked language modelling: the ``tokens`` kind.

* ``bert_tokens``: a corpus tokenised beforehand (BERT's WordPiece, for instance the AzureML-BERT
  preparation of Wikipedia that Ok-Topk's release uses), by path: a folder with ``train.npy`` and
  ``test.npy``, one-dimensional integer arrays of token ids (documents concatenated), and
  optionally ``tokens.json`` with ``vocab_size``, ``cls_id``, ``sep_id`` and ``mask_id`` (default:
  bert-base-uncased's 30522, 101, 102, 103). Preparing records where the files are and a manifest
  (sizes, times, hash): the arrays are memory-mapped where they are, never copied.
* ``synthetic_tokens``: generated token ids (uniform over bert-base's vocabulary), computed from
  the sample's index on the run's device: any number of samples, no memory. Throughput runs use
  it: the speed of a BERT step does not depend on which tokens it reads.

A sample is ``[CLS]`` + ``seq_len - 2`` consecutive tokens of the stream + ``[SEP]`` (sample i
reads the i-th such window), as BERT's pre-training inputs without the sentence-pair task.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from commlab.data.base import DatasetSpec
from commlab.data.checks import DamagedDataError, read_meta, source_folder
from commlab.data.keyed import keyed_int
from commlab.registry import DATASETS

BERT_VOCAB = {"vocab_size": 30522, "cls_id": 101, "sep_id": 102, "mask_id": 103}  # bert-base-uncased
SPLIT_FILES = {"train": "train.npy", "test": "test.npy"}


@dataclass
class TokenSplit:
    """One split's token stream: a memory-mapped array, or None for generated ids."""

    stream: np.ndarray | None
    samples: int  # windows of seq_len - 2 tokens (generated: a fixed count)
    seed: int = 0  # generated ids: the data's seed

    def windows(self, seq_len: int) -> int:
        return self.samples if self.stream is None else len(self.stream) // (seq_len - 2)

    def batch(self, index: torch.Tensor, seq_len: int, vocab: dict, device: torch.device) -> torch.Tensor:
        """The samples ``index`` as int64 ids (len(index) x seq_len) on ``device``."""
        body = seq_len - 2
        if self.stream is None:
            pos = torch.arange(body, device=device)
            ids = keyed_int(self.seed, 0, index.to(device)[:, None] * body + pos, 0, vocab["vocab_size"])
        else:  # one fancy index over the memory map: the windows are read, nothing else
            starts = index.numpy()[:, None] * body + np.arange(body)
            ids = torch.from_numpy(np.asarray(self.stream[starts], dtype=np.int64)).to(device)
        cls = torch.full((len(index), 1), vocab["cls_id"], dtype=torch.int64, device=device)
        sep = torch.full((len(index), 1), vocab["sep_id"], dtype=torch.int64, device=device)
        return torch.cat([cls, ids, sep], dim=1)


@dataclass
class TokenData:
    spec: DatasetSpec
    meta: dict
    train: TokenSplit
    test: TokenSplit
    vocab: dict = field(default_factory=lambda: dict(BERT_VOCAB))

    @property
    def vocab_size(self) -> int:
        return int(self.vocab["vocab_size"])


def _file_manifest(folder: Path) -> list[dict]:
    return [{"file": name, "size": (folder / name).stat().st_size, "mtime_ns": (folder / name).stat().st_mtime_ns}
            for name in SPLIT_FILES.values()]


def prepare_tokens(out_dir: Path, spec: DatasetSpec, source: str | None) -> dict:
    folder = source_folder(spec, source, list(SPLIT_FILES.values()), kind="file")
    described = folder / "tokens.json"
    vocab = {**BERT_VOCAB, **(json.loads(described.read_text()) if described.exists() else {})}
    shapes = {}
    for split, name in SPLIT_FILES.items():
        arr = np.load(folder / name, mmap_mode="r")
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"{folder / name} must be a one-dimensional integer array, got {arr.dtype} {arr.shape}")
        shapes[f"{split}_shape"] = [int(arr.shape[0])]
    manifest = _file_manifest(folder)
    meta = {"name": spec.name, "kind": "tokens", "source": str(folder), "vocab": vocab, **shapes, "files": manifest,
            "content_hash": hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_tokens(folder: Path, spec: DatasetSpec, hint: str, verify: bool = False,
                source: str | None = None) -> TokenData:
    meta = read_meta(folder / "meta.json", hint)
    root = Path(source or meta["source"])
    splits = {}
    for split, name in SPLIT_FILES.items():
        path = root / name
        if not path.is_file():
            raise FileNotFoundError(f"the token ids of {spec.name!r} are not at {path}; set `data_source` in the run "
                                    f"config to their folder, or prepare again. {spec.how_to_get}")
        arr = np.load(path, mmap_mode="r")
        if [int(arr.shape[0])] != meta[f"{split}_shape"] or arr.ndim != 1:
            raise DamagedDataError(f"{path} has shape {list(arr.shape)} but {folder}/meta.json says "
                                   f"{meta[f'{split}_shape']}; {hint}")
        splits[split] = TokenSplit(arr, 0)
    if verify and _file_manifest(root) != meta["files"]:
        raise DamagedDataError(f"the files in {root} differ from the manifest in {folder}/meta.json; {hint}")
    vocab = {**BERT_VOCAB, **meta.get("vocab", {})}
    for split in splits.values() if verify else ():  # reads every id: only when asked
        top = int(split.stream.max()) if len(split.stream) else 0
        if top >= vocab["vocab_size"]:
            raise DamagedDataError(f"token id {top} in {root} is outside the vocabulary of "
                                   f"{vocab['vocab_size']}; {hint}")
    return TokenData(spec, meta, splits["train"], splits["test"], vocab)


def _prepare_bert(out_dir: Path, source: str | None = None, raw_dir: Path | None = None) -> dict:
    return prepare_tokens(out_dir, BERT_TOKENS, source)


BERT_TOKENS = DATASETS.register("bert_tokens")(DatasetSpec(
    name="bert_tokens", channels=0, image_size=0, num_classes=BERT_VOCAB["vocab_size"], mean=(), std=(),
    prepare=_prepare_bert, kind="tokens", task="masked_lm", load=load_tokens, files=("meta.json",),
    how_to_get=("Set `data.bert_tokens.source` in params.yaml to a folder holding train.npy and test.npy "
                "(1-D integer arrays of WordPiece ids, documents concatenated; optional tokens.json with "
                "vocab_size, cls_id, sep_id, mask_id), then `dvc repro bert_tokens`; "
                "or use the generated `synthetic_tokens` for throughput runs."),
))

SYNTHETIC_TRAIN, SYNTHETIC_TEST = 1 << 21, 1024  # samples per split: 1024 steps of 256 x 8 (Ok-Topk's BERT runs)


def generate_tokens(seed: int = 0) -> TokenData:
    meta = {"name": "synthetic_tokens", "kind": "tokens", "content_hash": "synthetic-tokens",
            "train_shape": [SYNTHETIC_TRAIN], "test_shape": [SYNTHETIC_TEST], "vocab": dict(BERT_VOCAB)}
    # The test split is keyed apart from the training split (another data seed).
    return TokenData(SYNTHETIC_SPEC, meta, TokenSplit(None, SYNTHETIC_TRAIN, 1), TokenSplit(None, SYNTHETIC_TEST, 2))


SYNTHETIC_SPEC = DATASETS.register("synthetic_tokens")(DatasetSpec(
    name="synthetic_tokens", channels=0, image_size=0, num_classes=BERT_VOCAB["vocab_size"], mean=(), std=(),
    prepare=generate_tokens, generated=True, kind="tokens", task="masked_lm",
))


