"""Verifiable rewards for the RL loop, on the made-up words of the shipped Markov corpus (one token per word).

The corpus (``data/corpus/README.md``): 16 topics of 24 words; each word has 2-4 successors inside its topic with
Dirichlet(0.7) weights, and with probability 0.03 a step jumps to a random word. Three tasks, by name (``TASKS``,
the ``--task`` knob):

* ``letter`` (:class:`LetterTask`): distinct response words that start with a target letter, per response word.
  It climbs fast (about 0.6-0.7 in 60 default steps, bench/results/rl.md) and then flattens.
* ``edges`` (:class:`EdgeTask`): distinct *uncommon* corpus transitions in the response, per response transition.
  A transition ``a -> b`` is uncommon when the corpus has it at least ``min_count`` times (a real edge of the
  chain, not a random jump) and ``b`` is not ``a``'s most frequent successor. The policy must move mass off each
  word's dominant successor (one word at a time: hundreds of small things to learn), and, counting each
  transition once, it must keep visiting new words: a topic holds about 40 such transitions, so a long response
  (``max_tokens`` up to 256) can only keep scoring by leaving its topic, which the chain almost never does. The
  levels are many and the ceiling is far above the start: corpus windows of 16 words score about 0.27, a greedy
  walk over real edges 0.79 (0.57 at 64 words, 0.16 at 256 without leaving the topic). Measured
  (bench/results/tasks.md, 40 quick steps, one seed): GRPO rose from 0.28 to 0.53 and GSPO from 0.27 to 0.47,
  both still rising at step 40. Over hundreds of quick steps (lr 3e-3) it does not keep rising: a one-seed pilot of
  300 steps at int4 rose to about 0.67 and then fell (to 0.12 without replay around steps 125-175, to 0.27 with R3
  after step 200), both flagged by the collapse detector.
* ``ladder`` (:class:`LadderTask`): transitions onto the next letter of the first-letter cycle, per transition;
  a context-dependent target (each word's successors must move onto one letter class) for the long-horizon sweep
  (bench/bench_horizon.py's first sweep). It plateaus by step ~50: the policy's entropy falls to ~0 and a
  deterministic walk that hits about half its transitions is a fixed point of GRPO, whose groups then hold
  (nearly) identical samples and no gradient.
* ``chain`` (:class:`ChainTask`): the ladder's steps, each counted once per distinct word it lands on, per
  transition. A loop does not pay here (b d b d ... scores 1 / (len - 1)), so the reward only grows by extending
  the chain rung by rung: a full lap of the 14 letters is worth 14 / (len - 1), and past one lap (``max_tokens``
  above 15) every further point needs a second word per letter. The levels are many, each a new word-specific
  transition, and the ceiling (1.0) is far above the start (corpus windows of 32 words score about 0.05).
  Measured (bench/results/horizon_pilot.md: 32 tokens, quick sizes, int4, one seed, 300 steps): at lr 1e-3 it
  climbs to 0.55-0.63 (steps 150-200) and then mostly flattens as the entropy falls to ~0.05 (steps 150-200 to
  250-300: none +0.04, R2 +0.04, R3 -0.03); at lr 3e-4 it still climbs at step 300 without replay (none +0.14,
  R2 +0.11) while R3, the fastest climber, is flattening (+0.05, 0.57).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from r3lab.errors import ConfigError
from r3lab.paths import corpus_path
from r3lab.vocabulary import TASKS as TASK_REWARDS
from r3lab.vocabulary import TaskName

__all__ = ["Task", "LetterTask", "EdgeTask", "LadderTask", "ChainTask", "TASKS", "make_task"]


class Task(Protocol):
    """A verifiable reward on a sampled response (its token ids)."""

    def reward(self, response_ids: Sequence[int]) -> float: ...


class LetterTask:
    """Reward: distinct response words that start with ``letter``, per response word (special tokens miss).

    Counting each word once keeps the task from collapsing into one word repeated: the policy must find many
    different target words, which the corpus's sparse transitions make hard, so the reward keeps climbing.
    """

    def __init__(self, tokenizer: Any, letter: str):
        vocab = tokenizer.get_vocab()
        self.letter = letter
        self.hits = np.zeros(max(vocab.values()) + 1, dtype=bool)
        for word, i in vocab.items():
            self.hits[i] = word.startswith(letter) and not word.startswith("<")
        if not self.hits.any():
            raise ConfigError(f"no word of the vocabulary starts with {letter!r}")

    def reward(self, response_ids: Sequence[int]) -> float:
        ids = np.asarray(response_ids, dtype=np.int64)
        return float(np.unique(ids[self.hits[ids]]).size / ids.size) if ids.size else 0.0


class EdgeTask:
    """Reward: distinct uncommon corpus transitions in the response, per transition (``len - 1``; 0 below 2 tokens).

    ``targets[a, b]`` is True for the corpus transitions ``a -> b`` seen at least ``min_count`` times whose ``b`` is
    not ``a``'s most frequent successor (ties: the first in the corpus). Special tokens never score.
    """

    def __init__(self, tokenizer: Any, *, data: str | os.PathLike | None = None, min_count: int = 4):
        if min_count < 1:
            raise ConfigError(f"min_count must be >= 1, got {min_count}")
        vocab = tokenizer.get_vocab()
        size = max(vocab.values()) + 1
        counts = np.zeros((size, size), dtype=np.int64)
        path = corpus_path(data)
        for n, line in enumerate(path.read_text().splitlines()):
            words = line.split()
            missing = [w for w in words if w not in vocab]
            if missing:
                raise ConfigError(f"{path}:{n + 1}: words {missing[:3]} are not in the tokenizer's vocabulary "
                                  "(the corpus and the model must come from one build)")
            ids = np.array([vocab[w] for w in words], dtype=np.int64)
            np.add.at(counts, (ids[:-1], ids[1:]), 1)
        dominant = counts.argmax(axis=1)
        self.targets = counts >= min_count
        self.targets[np.arange(size), dominant] = False
        if not self.targets.any():
            raise ConfigError(f"no corpus transition is seen {min_count} times besides the dominant ones")
        self.size = size

    def reward(self, response_ids: Sequence[int]) -> float:
        ids = np.asarray(response_ids, dtype=np.int64)
        if ids.size < 2:
            return 0.0
        a, b = ids[:-1], ids[1:]
        hit = self.targets[a, b]
        return float(np.unique(a[hit] * self.size + b[hit]).size / (ids.size - 1))


class LadderTask:
    """Reward: response transitions ``a -> b`` whose ``b`` starts with the letter after ``a``'s first letter, per
    transition (``len - 1``; 0 below 2 tokens).

    The letters are the first letters of the vocabulary's words in alphabetical order, read as a cycle (the shipped
    vocabulary has 14: b d f g k l m n p r s t v z, so after z comes b). Special tokens (``<...>``) never score, on
    either side. Unlike ``letter`` (one global preference, learnt in tens of steps) the target depends on the
    previous word: every word's next-word distribution must move onto one letter class, which the corpus chain
    (2-4 successors inside a topic) almost never offers, so the start is low (about 1/14 of transitions by chance)
    and the ceiling (1.0: any walk down the letter cycle) far. Each transition scores on its own, so the reward is
    graded in steps of ``1 / (len - 1)``.
    """

    def __init__(self, tokenizer: Any):
        vocab = tokenizer.get_vocab()
        size = max(vocab.values()) + 1
        first = {w: w[0] for w in vocab if w and not w.startswith("<")}
        if not first:
            raise ConfigError("the vocabulary has no word to climb (every token is special)")
        self.letters = sorted(set(first.values()))
        if len(self.letters) < 2:
            raise ConfigError(f"the ladder needs two first letters at least, the vocabulary has {self.letters}")
        index = {c: i for i, c in enumerate(self.letters)}
        self.letter_of = np.full(size, -1, dtype=np.int64)  # token id -> its first letter's rung (-1: special)
        for w, c in first.items():
            self.letter_of[vocab[w]] = index[c]

    def reward(self, response_ids: Sequence[int]) -> float:
        ids = np.asarray(response_ids, dtype=np.int64)
        if ids.size < 2:
            return 0.0
        a, b = self.letter_of[ids[:-1]], self.letter_of[ids[1:]]
        hit = (a >= 0) & (b >= 0) & (b == (a + 1) % len(self.letters))
        return float(hit.sum() / (ids.size - 1))


class ChainTask(LadderTask):
    """Reward: distinct words ``b`` reached by a ladder step ``a -> b`` (``b`` starts with the letter after ``a``'s
    first letter, :class:`LadderTask`), per transition (``len - 1``; 0 below 2 tokens).

    The ladder counts every step, so a deterministic short loop is a local optimum it cannot leave; here a word
    reached twice scores once, so the reward climbs only by chaining new words: with ``n`` transitions the ceiling
    1.0 needs ``n`` distinct words on one walk down the cycle (``n > 14``: more than one word per letter).
    """

    def reward(self, response_ids: Sequence[int]) -> float:
        ids = np.asarray(response_ids, dtype=np.int64)
        if ids.size < 2:
            return 0.0
        a, b = self.letter_of[ids[:-1]], self.letter_of[ids[1:]]
        hit = (a >= 0) & (b >= 0) & (b == (a + 1) % len(self.letters))
        return float(np.unique(ids[1:][hit]).size / (ids.size - 1))


# the registry: task name -> its builder from (tokenizer, config); names and help texts live in r3lab.vocabulary.TASKS
TASKS: dict[str, Callable[[Any, Any], Task]] = {
    TaskName.LETTER: lambda tokenizer, config: LetterTask(tokenizer, config.target_letter),
    TaskName.EDGES: lambda tokenizer, config: EdgeTask(tokenizer, data=config.data),
    TaskName.LADDER: lambda tokenizer, config: LadderTask(tokenizer),
    TaskName.CHAIN: lambda tokenizer, config: ChainTask(tokenizer),
}
if set(TASKS) != set(TASK_REWARDS):
    raise ConfigError(f"the task registry {sorted(TASKS)} and r3lab.vocabulary.TASKS {sorted(TASK_REWARDS)} disagree")


def make_task(tokenizer: Any, config: Any) -> Task:
    """The task ``config.task`` of an :class:`~r3lab.config.RLConfig` on ``tokenizer``'s ids."""
    if config.task not in TASKS:
        raise ConfigError(f"unknown task {config.task!r}: the tasks are {sorted(TASKS)}")
    return TASKS[config.task](tokenizer, config)
