"""The prompts the served benches send, the same ones every run.

For bench_served.py's sections: short chats (a long story by topic) and one ~1,000-token prompt. For its speculation
comparison (`--speculation`), three sets, each giving as many distinct chats as asked, so no prompt repeats within one
server's life (a repeated prompt would let a drafter copy the earlier reply) and every mode answers the same prompts:

  open  open questions: little of the reply is in the prompt (speculation has little to find)
  copy  copy a paragraph with a spelling fix: the reply is nearly the prompt's paragraph
  code  a code edit that returns the whole function (a variable renamed): the reply is nearly the prompt's code
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

TOPICS = ["a lighthouse keeper", "a city under the sea", "a robot gardener", "the last train home", "a winter market",
          "a lost violin", "two rival bakers", "a map with no names", "a comet over the desert", "a library at night",
          "a ship in a bottle", "the mountain post office", "a clockmaker's apprentice", "a river that ran uphill",
          "a festival of lanterns", "an orchard in the fog"]
LONG_PARAGRAPH = (
    "Here are my notes from the meeting. We discussed the quarterly roadmap, the hiring plan for the platform team, "
    "the migration of the billing service to the new database cluster, and the incident from last Tuesday when the "
    "cache layer returned stale prices for about forty minutes. The action items were: write a postmortem, add an "
    "alert on cache age, review the rollout checklist, and schedule a load test before the holiday freeze. ")


def short_chat(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}]


def long_chat(meetings: int = 10) -> list[dict[str, str]]:
    """Meeting notes to summarise: ~100 tokens a meeting with either tokenizer (10: ~1,000)."""
    text = " ".join(f"Meeting {k + 1}. {LONG_PARAGRAPH}" for k in range(meetings))
    return [{"role": "user", "content": text + "Summarise these notes as a short list of decisions."}]


SUBJECTS = ["the sky", "the ocean", "a forest", "a city", "a desert", "the moon", "a river", "a mountain", "a garden",
            "a library", "a market", "a volcano", "a glacier", "an island", "a village", "a bridge", "a harbour",
            "a cave", "a meadow", "a lighthouse", "a railway", "a museum", "a castle", "a canyon"]
ASKS = ["Explain in detail how {s} changes through the seasons.", "What would a visitor notice first about {s}? "
        "Describe it.", "Write a short essay about why people are drawn to {s}.",
        "Describe a day in the life of someone who works near {s}."]

SENTENCES = [
    "The old lighthouse stood at the edge of the cliff for more than a century.",
    "Every night its keeper climbed the narrow stairs and lit the great lamp.",
    "Ships passing the rocks could see the light from many miles away.",
    "The village below was proud of the tower and kept it freshly painted.",
    "In winter the storms came in from the west and shook the windows.",
    "The market opened early on Saturdays and closed before the evening rain.",
    "Farmers brought apples, cheese and fresh bread from the valley.",
    "Children ran between the stalls while their parents bargained for fish.",
    "The baker on the corner sold out of his famous rolls by nine o'clock.",
    "A small band played old songs near the fountain in the square.",
    "The library was quiet except for the slow ticking of the clock.",
    "Students sat at the long tables with their books spread in front of them.",
    "The librarian knew where every book was, even the ones nobody had asked for.",
    "On the top floor there was a reading room with a view of the river.",
    "The train left the station at seven and followed the river to the coast.",
    "Passengers watched the fields and the small farms go by the windows.",
    "The conductor walked through the carriages and checked every ticket twice.",
    "At the last stop the sea appeared suddenly behind a row of houses.",
]


def typo(sentence: str, k: int) -> str:
    """The sentence with two letters of its k-th long word swapped (a spelling mistake to fix)."""
    words = sentence.split(" ")
    long = [i for i, w in enumerate(words) if len(w) >= 6 and w.isalpha()]
    i = long[k % len(long)]
    w = words[i]
    j = 2 + k % (len(w) - 3)
    words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2 :]
    return " ".join(words)


def open_chat(i: int) -> list[dict[str, str]]:
    ask = ASKS[i // len(SUBJECTS) % len(ASKS)]
    return [{"role": "user", "content": ask.format(s=SUBJECTS[i % len(SUBJECTS)])}]


COMBOS = list(itertools.combinations(range(len(SENTENCES)), 4))


def copy_chat(i: int) -> list[dict[str, str]]:
    n = len(SENTENCES)
    if i < 36:  # the first 36 as the served benchmark has always asked them
        picked = [SENTENCES[(i * 5 + k * (1 + i % 4)) % n] for k in range(4)]
    else:  # then other sets of four (bench_served.py --speculation --spec-paired asks for more)
        picked = [SENTENCES[j] for j in COMBOS[(i * 2654435761) % len(COMBOS)]]
    picked[i % 4] = typo(picked[i % 4], i)
    paragraph = " ".join(picked)
    return [{"role": "user", "content": "Fix the spelling mistake in this paragraph and write the whole corrected "
             f"paragraph:\n\n{paragraph}"}]


FUNCTIONS = [  # (code, a variable to rename): SmolLM2-135M asked to fix a bug rewrote the function shorter and
    # wrong; asked to rename a variable it returns the whole function (and a word on it), which is the case to measure
    ('def {name}(values):\n    """Return the average of the positive numbers in values."""\n    total = 0\n'
     "    count = 0\n    for v in values:\n        if v > 0:\n            total += v\n            count += 1\n"
     "    if count == 0:\n        return 0\n    return total / (count + {k})\n", "total"),
    ('def {name}(text):\n    """Count the words in text that start with a capital letter."""\n    count = 0\n'
     "    for word in text.split():\n        if word[0].isupper():\n            count += {k}\n    return count\n",
     "count"),
    ('def {name}(items, size):\n    """Split items into chunks of at most size items."""\n    chunks = []\n'
     "    for start in range(0, len(items), size * {k}):\n        chunks.append(items[start:start + size])\n"
     "    return chunks\n", "chunks"),
    ('def {name}(n):\n    """Return the n-th Fibonacci number, with {name}(0) == 0 and {name}(1) == 1."""\n'
     "    a, b = 0, {k}\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n", "b"),
    ('def {name}(grid):\n    """Return the sum of each row of grid as a list."""\n    sums = []\n'
     "    for row in grid:\n        total = {k} - 1\n        for cell in row:\n            total += cell\n"
     "        sums.append(total)\n    return sums\n", "sums"),
    ('def {name}(word):\n    """Return True when word reads the same backwards."""\n    left = 0\n'
     "    right = len(word) - {k}\n    while left < right:\n        if word[left] != word[right]:\n"
     "            return False\n        left += 1\n        right -= 1\n    return True\n", "left"),
]
NAMES = ["compute", "process", "handle", "evaluate", "measure", "collect"]
NEW_NAMES = ["result", "acc", "value", "out", "current", "index"]


def code_chat(i: int) -> list[dict[str, str]]:
    body, var = FUNCTIONS[i % len(FUNCTIONS)]
    name = f"{NAMES[i // len(FUNCTIONS) % len(NAMES)]}_{i}"
    code = body.format(name=name, k=1 + i // (len(FUNCTIONS) * len(NAMES)))
    new = NEW_NAMES[i % len(NEW_NAMES)]
    return [{"role": "user", "content": f"```python\n{code}```\n\nRename the variable `{var}` to `{new}` in this "
             "function. Reply with the complete function."}]


SETS: dict[str, Callable[[int], list[dict[str, str]]]] = {"open": open_chat, "copy": copy_chat, "code": code_chat}
