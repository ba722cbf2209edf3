"""The example run's shared files: a corpus a seeded generator writes, and the word-level tokenizer
trained on it (the tokenizers library). No download at run time.

The generated language has structure a model can learn (a noun decides which verbs and places fit
it), so the masked-token loss of the example model (:mod:`training.mlm`) falls visibly within
minutes. Every peer of a run must use the same tokenizer (the same ids): the corpus and the
tokenizer are deterministic given the seed, and :func:`prepare` writes both once; the demo prepares
them and hands every peer the files. Apart from the model so that preparing them imports no torch
(the demo's own process does it, 4 s of CPU less).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
