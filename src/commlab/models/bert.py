"""BERT for masked language modelling (Devlin et al. 2019), the workload of Ok-Topk's BERT runs
(Li & Hoefler 2022, section 6), built from a configuration: nothing is downloaded.

The defaults are BERT-base: 12 post-norm Transformer layers (torch's ``TransformerEncoderLayer``:
the same self-attention + feed-forward blocks, layer norms and GELU), hidden size 768, 12 heads,
feed-forward 3072, 512 positions, 2 token types, and the masked-LM head (dense + GELU + layer norm,
the decoder tied to the word embedding): 109,514,298 parameters, those of Hugging Face's
``BertForMaskedLM`` for bert-base-uncased. Weights start as BERT's: normal(0, 0.02), biases zero.
The next-sentence head is left out (the samples are single windows of a token stream).

Written in torch rather than taken from ``transformers``: the encoder is a few lines over torch's
own layers, and the package would add a large import and dependency tree for one model.

``model_options`` set a smaller configuration (``layers``, ``hidden``, ``heads``, ``intermediate``,
``dropout``). ``forward(ids)`` takes N x L token ids and returns N x L x vocabulary logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from commlab.registry import MODELS


@MODELS.register("bert")
class BertMaskedLM(nn.Module):
    task = "masked_lm"

    def __init__(self, vocab_size: int = 30522, max_len: int = 128, hidden: int = 768, layers: int = 12,
                 heads: int = 12, intermediate: int | None = None, dropout: float = 0.1, max_positions: int = 512,
                 type_vocab: int = 2):
        super().__init__()
        if max_len > max_positions:
            raise ValueError(f"task.seq_len {max_len} exceeds the model's {max_positions} positions")
        self.word = nn.Embedding(vocab_size, hidden)
        self.position = nn.Embedding(max_positions, hidden)
        self.token_type = nn.Embedding(type_vocab, hidden)
        self.embed_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.drop = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(hidden, heads, intermediate or 4 * hidden, dropout, activation="gelu",
                                           layer_norm_eps=1e-12, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, hidden)
        self.head_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.head_bias = nn.Parameter(torch.zeros(vocab_size))
        self.apply(_bert_init)  # after the encoder cloned its layer: every layer drawn on its own

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.word(ids) + self.position(pos)[None] + self.token_type.weight[0]
        x = self.encoder(self.drop(self.embed_norm(x)))
        x = self.head_norm(F.gelu(self.head(x)))
        return F.linear(x, self.word.weight, self.head_bias)


def _bert_init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, 0.0, 0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.MultiheadAttention):
        nn.init.normal_(module.in_proj_weight, 0.0, 0.02)
        nn.init.zeros_(module.in_proj_bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)
