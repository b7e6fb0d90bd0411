"""A few hundred varied English sentences (built from templates, deterministic), plus
texts that stress tokenization: punctuation, accents, numbers, CJK, long words."""

import itertools

_SUBJECTS = ["The cat", "A young engineer", "My grandmother", "The committee", "Our neighbour's dog",
             "The spacecraft", "A tired student", "The old river", "The central bank", "Every musician"]
_VERBS = ["quietly watched", "carefully repaired", "never understood", "happily painted", "slowly crossed",
          "suddenly rejected", "proudly presented", "accidentally deleted"]
_OBJECTS = ["the broken bicycle", "a report on climate change", "the last train to Paris",
            "three unanswered letters", "the quarterly budget", "a bowl of cold soup",
            "the mountain path at dawn", "an ancient map of the city"]
_TAILS = ["", " yesterday.", " before lunch!", ", or so they say.", " in 2024.", "?"]

SPECIAL_TEXTS = [
    "Hello, world!", "Don't stop believin' -- it's 3:45 p.m. (roughly).",
    "Résumé, naïve café and coöperate façade.", "Prices rose 12.5% to $1,299.99 on 03/04/2021.",
    "東京 is the capital of 日本; 北京 is China's.", "e-mail me at someone@example.org #urgent",
    "Supercalifragilisticexpialidocious" * 4, "   leading and trailing spaces   ",
    "line one\nline two\ttabbed", "UPPER CASE AND lower case", "emoji 🙂 and symbols ∑ ≠ ∞",
    "A", "?", "transformers tokenization unaffable",
]


def sentences(n: int = 300) -> list[str]:
    """n sentences: the special texts, then template combinations spread evenly over all of them."""
    combos = list(itertools.product(_SUBJECTS, _VERBS, _OBJECTS, _TAILS))
    need = max(n - len(SPECIAL_TEXTS), 0)
    picked = [combos[i * len(combos) // need] for i in range(need)] if need else []
    return (SPECIAL_TEXTS + [f"{s} {v} {o}{t}" for s, v, o, t in picked])[:n]
