"""RedSync's LSTM language model (Fang et al. 2019, section 6; its released main_lstm.py): the
word_language_model network of pytorch/examples, a word embedding, a 2-layer LSTM and a decoder
tied to the embedding (Press & Wolf 2017), with dropout on the embedding, between the layers and
on the output. The release's sizes are the defaults: 150 units, dropout 0.65; gradient clipping
(0.25) is the run config's ``train.grad_clip``.

``forward(tokens, hidden)`` takes time-major ids (T x B) and the state carried from the previous
window (None: zeros) and returns the logits (T x B x vocabulary) and the new state."""

from __future__ import annotations

import torch
from torch import nn

from commlab.registry import MODELS


@MODELS.register("lstm_lm")
class LSTMLanguageModel(nn.Module):
    task = "language_model"

    def __init__(self, vocab_size: int, embed: int = 150, hidden: int = 150, layers: int = 2,
                 dropout: float = 0.65, tied: bool = True):
        super().__init__()
        if tied and embed != hidden:
            raise ValueError(f"tied weights need embed == hidden, got model_options embed={embed}, hidden={hidden}")
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab_size, embed)
        self.rnn = nn.LSTM(embed, hidden, layers, dropout=dropout)
        self.decoder = nn.Linear(hidden, vocab_size)
        if tied:
            self.decoder.weight = self.encoder.weight
        # word_language_model's initialisation
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        if not tied:
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, tokens: torch.Tensor, hidden=None):
        out, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return self.decoder(self.drop(out)), hidden
