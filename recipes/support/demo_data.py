"""The embedded demo data, generated (nothing downloaded): an English-like corpus and a small chat set.

python recipes/support/demo_data.py recipes/data/demo_chat.jsonl    # regenerates the shipped chat file
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

__all__ = ["FACTS", "demo_chat", "demo_corpus", "write_demo_chat"]

_SUBJECTS = [
    "the cat",
    "a dog",
    "the old man",
    "my sister",
    "the robot",
    "a small bird",
    "the teacher",
    "our neighbour",
]
_VERBS = ["sees", "likes", "follows", "paints", "finds", "carries", "visits", "remembers"]
_OBJECTS = [
    "the red ball",
    "a quiet garden",
    "the long river",
    "an open door",
    "the blue house",
    "a warm loaf of bread",
]
_PLACES = ["in the morning", "after the rain", "near the station", "every sunday", "before dinner", "under the bridge"]


def demo_corpus(n_documents: int = 2000, seed: int = 0) -> list[str]:
    """A generated English-like corpus with real structure (grammar, agreement, repetition).

    A byte-level model learns spelling within a few hundred steps and the sentence pattern soon
    after, so the loss falls visibly on a CPU in a minute: the point of the demo.
    """
    rng = random.Random(seed)
    docs = []
    for _ in range(n_documents):
        sentences = []
        for _ in range(rng.randint(2, 5)):
            s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."
            sentences.append(s[0].upper() + s[1:])
        docs.append(" ".join(sentences))
    return docs


# The chat set's world: a few animals and three facts each, asked in several phrasings, in one- and
# two-question conversations, sometimes behind a system prompt. A ~1M-parameter model learns it
# in a minute of fine-tuning on a CPU, so the demo's generated answer is visibly right.
FACTS = {
    "cat": {"sleeps": "under the bridge", "eats": "warm bread", "colour": "grey"},
    "dog": {"sleeps": "near the station", "eats": "red apples", "colour": "brown"},
    "robot": {"sleeps": "in the garden", "eats": "blue stones", "colour": "silver"},
    "bird": {"sleeps": "on the roof", "eats": "small seeds", "colour": "yellow"},
    "fox": {"sleeps": "by the river", "eats": "sweet honey", "colour": "orange"},
    "horse": {"sleeps": "in the barn", "eats": "fresh hay", "colour": "white"},
}
_ASK = {
    "sleeps": ["Where does the {a} sleep?", "Where does the {a} sleep at night?", "Tell me where the {a} sleeps."],
    "eats": ["What does the {a} eat?", "What food does the {a} like?", "Tell me what the {a} eats."],
    "colour": ["What colour is the {a}?", "Which colour is the {a}?", "Tell me the colour of the {a}."],
}
_SAY = {"sleeps": "The {a} sleeps {v}.", "eats": "The {a} eats {v}.", "colour": "The {a} is {v}."}
_SYSTEM = ["You answer in one short sentence.", "You know every animal in the village."]


def demo_chat(n_records: int = 400, seed: int = 0) -> list[dict]:
    """Chat records ``{"messages": [{"role", "content"}, ...]}`` about the FACTS world."""
    rng = random.Random(seed)

    def qa():
        a = rng.choice(sorted(FACTS))
        k = rng.choice(sorted(_ASK))
        return [
            {"role": "user", "content": rng.choice(_ASK[k]).format(a=a)},
            {"role": "assistant", "content": _SAY[k].format(a=a, v=FACTS[a][k])},
        ]

    records = []
    for _ in range(n_records):
        messages = [{"role": "system", "content": rng.choice(_SYSTEM)}] if rng.random() < 0.3 else []
        for _ in range(rng.choice([1, 1, 2])):
            messages += qa()
        records.append({"messages": messages})
    return records


def write_demo_chat(path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in demo_chat()))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python recipes/support/demo_data.py OUT.jsonl")
    write_demo_chat(sys.argv[1])
