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

Every peer of a run must use the same tokenizer (the same ids). The corpus
and the tokenizer are deterministic given the seed, and :func:`prepare`
writes both once; the demo prepares them and hands every peer the files.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: the generated language: each noun class has its verbs and places
_CLASSES = {
    "animal": (["cat", "dog", "horse", "bird", "goat", "tiger", "mouse", "sheep"],
               ["eats", "chases", "sniffs", "watches", "follows"], ["field", "forest", "barn", "river"]),
    "person": (["teacher", "farmer", "doctor", "child", "singer", "pilot", "baker", "judge"],
               ["reads", "writes", "builds", "carries", "paints"], ["school", "city", "house", "office"]),
    "machine": (["robot", "engine", "printer", "drone", "crane", "truck", "radio", "clock"],
                ["moves", "lifts", "prints", "scans", "powers"], ["factory", "garage", "lab", "port"]),
}
_OBJECTS = ["apple", "book", "stone", "letter", "box", "bread", "wheel", "song", "map", "rope", "coin", "lamp"]
_ADJECTIVES = ["big", "small", "old", "new", "red", "green", "quiet", "fast", "slow", "bright"]
_TIMES = ["today", "yesterday", "at night", "in the morning", "every day", "again"]

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def sentence(rng: random.Random) -> str:
    """One sentence of the generated language."""
    nouns, verbs, places = _CLASSES[rng.choice(sorted(_CLASSES))]
    noun, verb, place = rng.choice(nouns), rng.choice(verbs), rng.choice(places)
    obj = rng.choice(_OBJECTS)
    adj = rng.choice(_ADJECTIVES)
    if rng.random() < 0.5:
        return f"the {adj} {noun} {verb} the {obj} in the {place} {rng.choice(_TIMES)} ."
    return f"a {noun} {verb} a {adj} {obj} near the {place} ."


def generate_corpus(directory: Path, *, shards: int = 4, lines: int = 5000, seed: int = 0) -> list[Path]:
    """Write ``shards`` text shards of ``lines`` lines each (deterministic for a seed); their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths = []
    for s in range(shards):
        path = directory / f"shard-{s:03d}.txt"
        _write_atomically(path, "".join(sentence(rng) + "\n" for _ in range(lines)))
        paths.append(path)
    return paths


def train_tokenizer(files: list[Path], vocab_size: int = 1000) -> Any:
    """A word-level tokenizer trained on ``files`` (tokenizers' trainer: deterministic for the same files)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS)
    tokenizer.train([str(f) for f in sorted(files)], trainer)
    return tokenizer


def load_tokenizer(path: Path) -> Any:
    """The tokenizer file as transformers' fast tokenizer (what its data collator wants)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(path), pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]")


@dataclass(frozen=True)
class Prepared:
    """The files every peer of an example run shares."""

    corpus: list[Path]
    tokenizer: Path


def prepare(directory: Path, *, shards: int = 4, lines: int = 5000, seed: int = 0) -> Prepared:
    """Generate the corpus and train the tokenizer under ``directory`` (kept if already there)."""
    corpus_dir = directory / "corpus"
    corpus = sorted(corpus_dir.glob("shard-*.txt")) if corpus_dir.is_dir() else []
    if len(corpus) != shards:
        corpus = generate_corpus(corpus_dir, shards=shards, lines=lines, seed=seed)
    tokenizer = directory / "tokenizer.json"
    if not tokenizer.exists():
        _write_atomically(tokenizer, train_tokenizer(corpus).to_str())
    return Prepared(corpus, tokenizer)


def _write_atomically(path: Path, text: str) -> None:
    """Peers started together on one machine prepare the same directory at once: a file appears
    whole or not at all (a peer that read half a corpus trained another vocabulary, hence a model
    of other shapes, whose rounds never matched the others'). Every writer writes the same text."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
