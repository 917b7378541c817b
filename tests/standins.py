"""Small stand-ins of the papers' data formats, generated in a test's folder: a word corpus in
PTB's layout and token-id arrays for the masked LM (the image folder in ImageNet's layout is
:func:`commlab.bench.loader.generate_image_folder`)."""

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
