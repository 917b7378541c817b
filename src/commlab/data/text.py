"""Word-level text corpora for language modelling: the ``text`` kind; PTB and WikiText-2 registered.

The corpus is read as pytorch/examples' word_language_model (data.py), which RedSync's released
LSTM script uses: every line split on white space plus an ``<eos>`` token, one vocabulary over
the train, valid and test files in order of first appearance (PTB: 10,000 words; WikiText-2:
33,278). Preparing writes the token ids (``train.pt``, ``valid.pt``, ``test.pt``: int64 vectors),
``vocab.txt`` and ``meta.json`` (counts, vocabulary size, content hash) into
``<data_dir>/<name>/``; a run keeps them in memory (a few megabytes).

A source folder holds the three files under one of the names :data:`LAYOUTS` lists (PTB's
``ptb.train.txt``..., WikiText-2's ``wiki.train.tokens``..., or ``train.txt``...).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from commlab.data.base import DatasetSpec, content_hash
from commlab.data.checks import DamagedDataError, read_meta
from commlab.registry import DATASETS

SPLITS = ("train", "valid", "test")
LAYOUTS = ("ptb.{}.txt", "wiki.{}.tokens", "{}.txt")
EOS = "<eos>"


def corpus_files(source: str | None, spec: DatasetSpec) -> dict[str, Path]:
    """The train/valid/test files of the folder ``source``, in the first layout it holds fully."""
    if not source:
        raise FileNotFoundError(f"no folder given for {spec.name}. {spec.how_to_get}")
    folder = Path(source)
    for layout in LAYOUTS:
        files = {s: folder / layout.format(s) for s in SPLITS}
        if all(f.is_file() for f in files.values()):
            return files
    names = " or ".join(", ".join(layout.format(s) for s in SPLITS) for layout in LAYOUTS)
    raise FileNotFoundError(f"{folder} does not hold a corpus ({names}). {spec.how_to_get}")


def tokenize(files: dict[str, Path]) -> tuple[list[str], dict[str, torch.Tensor]]:
    """word_language_model's Corpus: the vocabulary over all files and each file's token ids."""
    index: dict[str, int] = {}
    ids = {}
    for split, path in files.items():
        out = []
        with open(path, encoding="utf8") as f:
            for line in f:
                for word in line.split() + [EOS]:
                    out.append(index.setdefault(word, len(index)))
        ids[split] = torch.tensor(out, dtype=torch.int64)
    return list(index), ids


def prepare_text(out_dir: Path, spec: DatasetSpec, source: str | None) -> dict:
    files = corpus_files(source, spec)
    vocab, ids = tokenize(files)
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, t in ids.items():
        torch.save({"ids": t}, out_dir / f"{split}.pt")
    (out_dir / "vocab.txt").write_text("".join(w + "\n" for w in vocab))
    meta = {"name": spec.name, "kind": "text", "source": str(Path(source).resolve()), "vocab_size": len(vocab),
            **{f"{s}_shape": [len(ids[s])] for s in SPLITS},
            "content_hash": content_hash(*(ids[s] for s in SPLITS))}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


class TextData:
    """A prepared corpus: token ids per split and the vocabulary size."""

    def __init__(self, spec: DatasetSpec, meta: dict, ids: dict[str, torch.Tensor]):
        self.spec, self.meta, self.ids = spec, meta, ids
        self.vocab_size = int(meta["vocab_size"])


def load_text(folder: Path, spec: DatasetSpec, hint: str, verify: bool = False, source: str | None = None) -> TextData:
    meta = read_meta(folder / "meta.json", hint)
    ids = {}
    for split in SPLITS:
        path = folder / f"{split}.pt"
        try:
            t = torch.load(path, weights_only=True)["ids"]
        except Exception as err:  # noqa: BLE001 - any failure: the file cannot be used
            raise DamagedDataError(f"{path} is damaged (cannot be read: {type(err).__name__}); {hint}") from None
        if t.dtype != torch.int64 or t.dim() != 1 or [len(t)] != meta.get(f"{split}_shape"):
            raise DamagedDataError(f"{path} is damaged (ids {t.dtype} {list(t.shape)}, meta.json says "
                                   f"{meta.get(f'{split}_shape')}); {hint}")
        if len(t) and (int(t.min()) < 0 or int(t.max()) >= int(meta["vocab_size"])):
            raise DamagedDataError(f"{path} is damaged (token ids outside 0..{meta['vocab_size'] - 1}); {hint}")
        ids[split] = t
    if verify and content_hash(*(ids[s] for s in SPLITS)) != meta["content_hash"]:
        raise DamagedDataError(f"{folder}: content hash differs from meta.json's; {hint}")
    return TextData(spec, meta, ids)


def text_dataset(name: str, vocab_size: int, how_to_get: str) -> DatasetSpec:
    """Register a ``text`` corpus under ``name`` (``vocab_size``: the release's, for reference)."""
    spec: DatasetSpec

    def prepare(out_dir: Path, source: str | None = None, raw_dir: Path | None = None) -> dict:
        return prepare_text(out_dir, spec, source)

    spec = DatasetSpec(name=name, channels=0, image_size=0, num_classes=vocab_size, mean=(), std=(), prepare=prepare,
                       how_to_get=how_to_get, kind="text", task="language_model", load=load_text,
                       files=("meta.json", *(f"{s}.pt" for s in SPLITS)))
    return DATASETS.register(name)(spec)


PTB = text_dataset("ptb", 10_000, (
    "Set `data.ptb.source` in params.yaml to a folder holding ptb.train.txt, ptb.valid.txt and ptb.test.txt "
    "(Mikolov's Penn Treebank, as word_language_model uses it), then `dvc repro ptb`."))
WIKITEXT2 = text_dataset("wikitext2", 33_278, (
    "Set `data.wikitext2.source` in params.yaml to a folder holding wiki.train.tokens, wiki.valid.tokens and "
    "wiki.test.tokens (WikiText-2, Merity et al. 2016; or train.txt, valid.txt, test.txt), then "
    "`dvc repro wikitext2`."))
