"""The example: a small ALBERT-style masked language model on a corpus it generates (sahajBERT, scaled down).

DeDLOC trained ALBERT-large with volunteers (sahajBERT, Bengali Wikipedia
and OSCAR). The example keeps the shape and shrinks the sizes so a laptop CPU
runs it: transformers' ALBERT classes with a tiny config (shared layers,
factorized embeddings, as in the paper), a word-level tokenizer trained
locally with the tokenizers library, and a corpus that a seeded generator
writes (no download at run time). The generated language has structure a
model can learn (a noun decides which verbs and places fit it), so the
masked-token loss falls visibly within minutes: from ln(vocabulary) ~ 5 at
the start to well under 2.

The corpus and the tokenizer every peer shares are :mod:`training.corpus`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def load_tokenizer(path: Path) -> Any:
    """The tokenizer file as transformers' fast tokenizer (what its data collator wants)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(path), pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]")


def albert_config(vocab_size: int, *, hidden: int = 128, layers: int = 2, max_length: int = 32) -> Any:
    """A tiny ALBERT: factorized embeddings (64), shared layers, 2 heads."""
    from transformers import AlbertConfig

    return AlbertConfig(vocab_size=vocab_size, embedding_size=64, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=2, intermediate_size=2 * hidden, max_position_embeddings=max_length,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def build_model(tokenizer: Any, *, seed: int = 0, **config: Any) -> torch.nn.Module:
    """The model, its weights drawn from ``seed`` (every peer starts from the same ones)."""
    from transformers import AlbertForMaskedLM

    torch.manual_seed(seed)
    model: torch.nn.Module = AlbertForMaskedLM(albert_config(len(tokenizer), **config))
    return model


class MaskedBatches:
    """Texts to masked-LM batches: tokenized, padded, 15% of the tokens masked (BERT's 80/10/10)."""

    def __init__(self, tokenizer: Any, *, max_length: int = 32, mlm_probability: float = 0.15) -> None:
        from transformers import DataCollatorForLanguageModeling

        self.tokenizer = tokenizer
        self.max_length = max_length
        self.collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=mlm_probability,
                                                        return_tensors="pt")

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        encoded = self.tokenizer(texts, truncation=True, max_length=self.max_length)
        features = [{"input_ids": ids} for ids in encoded["input_ids"]]
        return dict(self.collator(features))
