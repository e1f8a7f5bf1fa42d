"""The prompts of a run: deterministic synthetic ones, or a JSON-lines dataset."""

from __future__ import annotations

import json
import random

from meshserve.benchmark.results import BenchConfig

_WORDS = (
    "the river city night morning garden machine letter window mountain story friend music "
    "winter market teacher engine voice forest harbor lantern journey bridge library painter "
    "quietly slowly carefully suddenly always never often bright old small distant warm strange "
    "walks finds builds remembers carries opens watches follows explains answers discovers"
).split()
_TOPICS = (
    "a lighthouse keeper", "the history of bread", "a robot learning to paint", "rain in a desert",
    "an old map", "the first day of school", "a train that never stops", "the life of a bee",
    "a city under the sea", "a letter from the future", "a chess match", "a forgotten song",
)


def synthetic_prompts(count: int, seed: int, words: tuple[int, int] = (16, 256)) -> list[str]:
    """Deterministic English-like prompts whose lengths vary across ``words``. Each opens with a
    distinct numbered request so that no two share a long prefix (prefix caching would
    otherwise flatter the server)."""
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        target = rng.randint(*words)
        text = [f"Request {index}: write about {rng.choice(_TOPICS)}."]
        length = len(text[0].split())
        while length < target:
            sentence = rng.sample(_WORDS, min(rng.randint(5, 12), target - length))
            text.append(" ".join(sentence).capitalize() + ".")
            length += len(sentence)
        prompts.append(" ".join(text))
    return prompts


def load_prompts(config: BenchConfig) -> list[str]:
    """The run's prompts: the dataset's lines in order (repeated if it is short), or synthetic."""
    if config.dataset is None:
        return synthetic_prompts(config.num_prompts, config.seed, config.prompt_words)
    with open(config.dataset, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    pool = [r["prompt"] for r in records
            if isinstance(r, dict) and isinstance(r.get("prompt"), str)]
    if not pool or len(pool) != len(records):
        raise ValueError(f"{config.dataset}: every line must be a JSON object with a string "
                         f"'prompt' ({len(pool)} of {len(records)} are)")
    return [pool[i % len(pool)] for i in range(config.num_prompts)]
