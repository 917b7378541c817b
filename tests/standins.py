"""Small stand-ins of the papers' data formats, generated in a test's folder: a word corpus in
PTB's (and WikiText-2's) layout and token-id arrays for the masked LM (the image folder in
ImageNet's layout is :func:`commlab.bench.loader.generate_image_folder`), and all of them
prepared as their DVC stages prepare the real data (:func:`prepare_standins`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def ptb_corpus(folder: Path, vocab: int = 60, lines: tuple[int, int, int] = (400, 40, 40), seed: int = 0) -> Path:
    """ptb.{train,valid,test}.txt of Zipf-distributed words with a repeating grammar (a word's
    successor depends on it), so that a language model can learn something in a few steps."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(vocab)]
    successor = rng.permutation(vocab)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in zip(("train", "valid", "test"), lines, strict=True):
        out = []
        for _ in range(count):
            w = int(rng.zipf(1.3)) % vocab
            line = []
            for _ in range(int(rng.integers(3, 15))):
                line.append(words[w])
                w = int(successor[w]) if rng.random() < 0.8 else int(rng.integers(vocab))
            out.append(" " + " ".join(line) + " \n")
        (folder / f"ptb.{split}.txt").write_text("".join(out))
    return folder


def token_corpus(folder: Path, train_tokens: int = 4000, test_tokens: int = 1000, vocab: int = 120,
                 seed: int = 0) -> Path:
    """train.npy / test.npy token ids (uint16, as a tokenised corpus would store them) and
    tokens.json naming the vocabulary and the special ids."""
    import json

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", train_tokens), ("test", test_tokens)):
        np.save(folder / f"{name}.npy", rng.integers(4, vocab, n).astype(np.uint16))
    (folder / "tokens.json").write_text(json.dumps({"vocab_size": vocab, "cls_id": 1, "sep_id": 2, "mask_id": 3}))
    return folder


def prepare_standins(root: Path) -> Path:
    """A data_dir under ``root`` holding every paper-scale dataset's stand-in, prepared: imagenet
    (generated JPEGs), cifar10 (random uint8 images in its tensor format), ptb and wikitext2 (the
    same generated corpus in each layout), bert_tokens."""
    import torch

    from commlab.bench.loader import generate_image_folder
    from commlab.data.base import write_prepared
    from commlab.data.image_folder import IMAGENET, prepare_folder
    from commlab.data.text import PTB, WIKITEXT2, prepare_text
    from commlab.data.tokens import BERT_TOKENS, prepare_tokens
    from commlab.registry import DATASETS

    out = root / "prepared"
    prepare_folder(out / "imagenet", IMAGENET, str(generate_image_folder(root / "imagenet", sides=(40, 90))))
    ptb = ptb_corpus(root / "ptb")
    prepare_text(out / "ptb", PTB, str(ptb))
    wiki = root / "wikitext2"
    wiki.mkdir()
    for split in ("train", "valid", "test"):
        (wiki / f"wiki.{split}.tokens").write_text((ptb / f"ptb.{split}.txt").read_text())
    prepare_text(out / "wikitext2", WIKITEXT2, str(wiki))
    prepare_tokens(out / "bert_tokens", BERT_TOKENS, str(token_corpus(root / "tokens")))
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, generator=g)
    write_prepared(out / "cifar10", DATASETS.get("cifar10"), (x, torch.arange(64) % 10),
                   (x[:16], torch.arange(16) % 10), "generated", [str(i) for i in range(10)])
    return out
