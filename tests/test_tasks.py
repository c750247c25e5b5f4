"""The RL tasks (r3lab.experiments.tasks) on hand-made responses, checked against the corpus counted independently."""

import collections

import pytest
from transformers import AutoTokenizer

from r3lab.config import TASKS as TASK_NAMES
from r3lab.config import RLConfig
from r3lab.errors import ConfigError
from r3lab.experiments.tasks import TASKS, ChainTask, EdgeTask, LadderTask, LetterTask, make_task
from r3lab.paths import corpus_path, model_dir


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(model_dir("tiny-qwen3-moe"))


@pytest.fixture(scope="module")
def successors():
    succ = collections.defaultdict(collections.Counter)
    for line in corpus_path().read_text().splitlines():
        w = line.split()
        for a, b in zip(w, w[1:], strict=False):
            succ[a][b] += 1
    return succ


def _ids(tokenizer, words):
    vocab = tokenizer.get_vocab()
    return [vocab[w] for w in words]


def test_edge_task_counts_distinct_uncommon_transitions(tokenizer, successors):
    task = EdgeTask(tokenizer)
    # kupi's successors in the corpus: tali (its most frequent), kobire, mamefu, reti, and random jumps seen once
    top, second = (w for w, _ in successors["kupi"].most_common(2))
    rare = [w for w, n in successors["kupi"].items() if n < 4][0]
    assert successors["kupi"][second] >= 4
    words = ["kupi", second, "kupi", second, "kupi", top, "kupi", rare]  # 7 transitions
    # kupi -> second scores once (repeated); kupi -> top never (dominant); kupi -> rare never (a jump); the
    # transitions back into kupi score when they are uncommon edges of their own source word
    back = {a for a in (second, top, rare) if successors[a]["kupi"] >= 4
            and successors[a].most_common(1)[0][0] != "kupi"}
    want = (1 + len(back)) / 7
    assert task.reward(_ids(tokenizer, words)) == pytest.approx(want)
    assert task.reward(_ids(tokenizer, ["kupi"])) == 0.0 and task.reward([]) == 0.0
    assert task.reward(_ids(tokenizer, ["kupi", top] * 4)) <= 1 / 7 + 1e-12  # a loop on dominant edges scores ~0
    # as many targets as the corpus has uncommon edges (no special token among them)
    n = sum(1 for a, c in successors.items() for b, k in c.items() if k >= 4 and b != c.most_common(1)[0][0])
    assert int(task.targets.sum()) == n
    assert not task.targets[:4].any() and not task.targets[:, :4].any()


def test_a_walk_of_distinct_uncommon_edges_scores_one(tokenizer, successors):
    """The ceiling is reachable: a walk whose every transition is a new uncommon edge earns 1.0 (found greedily)."""
    task = EdgeTask(tokenizer)
    walk, used = ["kupi"], set()
    while len(walk) < 8:
        a = walk[-1]
        c = successors[a]
        nxt = [b for b, k in c.items() if k >= 4 and b != c.most_common(1)[0][0] and (a, b) not in used]
        if not nxt:
            break
        used.add((a, nxt[0]))
        walk.append(nxt[0])
    assert len(walk) >= 4, walk
    assert task.reward(_ids(tokenizer, walk)) == pytest.approx(1.0)


def test_letter_task_rewards_the_words_starting_with_its_letter(tokenizer):
    task = LetterTask(tokenizer, "m")
    words = ["mime", "kupi", "mime", "mamefu", "tali"]
    assert task.reward(_ids(tokenizer, words)) == pytest.approx(2 / 5)  # mime once, mamefu once, over 5 words


def test_the_registry_builds_every_task_by_name(tokenizer):
    assert set(TASKS) == set(TASK_NAMES)
    assert isinstance(make_task(tokenizer, RLConfig(task="edges")), EdgeTask)
    assert isinstance(make_task(tokenizer, RLConfig()), LetterTask)
    assert isinstance(make_task(tokenizer, RLConfig(task="ladder")), LadderTask)
    assert isinstance(make_task(tokenizer, RLConfig(task="chain")), ChainTask)
    with pytest.raises(ConfigError, match="--task"):
        RLConfig(task="chess")
    with pytest.raises(ConfigError, match="--loss"):
        RLConfig(loss="ppo")


def test_ladder_task_scores_steps_down_the_letter_cycle_by_hand(tokenizer):
    """Hand-computed cases: the shipped vocabulary's first letters are b d f g k l m n p r s t v z (a cycle)."""
    task = LadderTask(tokenizer)
    assert "".join(task.letters) == "bdfgklmnprstvz"
    vocab = tokenizer.get_vocab()

    def word(c):  # any word of the vocabulary that starts with c (the task reads the first letter only)
        return next(w for w in sorted(vocab) if w.startswith(c))

    def r(letters):
        return task.reward([vocab[word(c)] if c != "<" else vocab["<|unk|>"] for c in letters])

    assert r("bdfg") == pytest.approx(1.0)  # 3 transitions, each onto the next letter
    assert r("zbd") == pytest.approx(1.0)  # z -> b wraps around the cycle
    assert r("bdb") == pytest.approx(1 / 2)  # b -> d scores, d -> b goes back
    assert r("bbbb") == 0.0  # staying on one letter never scores
    assert r("bfd") == 0.0  # skipping a rung (b -> f) and going back (f -> d) do not score
    assert r("bfdf") == pytest.approx(1 / 3)  # ... and then d -> f does
    assert r("bd<df") == pytest.approx(2 / 4)  # b -> d and d -> f score; a special token breaks both its sides
    assert r("b") == 0.0 and task.reward([]) == 0.0
    # graded: one step in 15 transitions of a 16-word response is worth 1/15
    assert r("b" * 15 + "d") == pytest.approx(1 / 15)
    # repeats count every time (unlike edges): a walk round the cycle twice scores 1.0
    assert r("bdfgklmnprstvz" * 2) == pytest.approx(1.0)


def test_ladder_task_on_corpus_text_scores_near_chance(tokenizer):
    """The start is low: corpus windows of 16 words score about the chance rate (an independent count)."""
    task = LadderTask(tokenizer)
    vocab = tokenizer.get_vocab()
    order = "bdfgklmnprstvz"
    lines = corpus_path().read_text().splitlines()[:200]
    rewards, hits, total = [], 0, 0
    for line in lines:
        w = line.split()[:16]
        h = sum(order[(order.index(a[0]) + 1) % 14] == b[0] for a, b in zip(w, w[1:], strict=False))
        hits, total = hits + h, total + len(w) - 1
        rewards.append(task.reward([vocab[x] for x in w]))
        assert rewards[-1] == pytest.approx(h / (len(w) - 1))
    assert 0.0 < hits / total < 0.2


def test_chain_task_scores_distinct_words_reached_down_the_letter_cycle_by_hand(tokenizer):
    """Hand-computed cases: a ladder step (onto the next first letter of b d f ... z) scores once per word it
    lands on, per transition; loops that the ladder pays for every time pay once here."""
    task = ChainTask(tokenizer)
    vocab = tokenizer.get_vocab()
    by_letter = {c: [w for w in sorted(vocab) if w.startswith(c)] for c in "bdfgklmnprstvz"}
    assert all(len(ws) >= 2 for ws in by_letter.values())  # two words per letter at least (the second lap)

    def r(spec):  # "b0 d1 <": the i-th word (alphabetical) starting with the letter, "<" the unknown token
        return task.reward([vocab["<|unk|>"] if s == "<" else vocab[by_letter[s[0]][int(s[1:] or 0)]]
                            for s in spec.split()])

    assert r("b0 d0 f0 g0") == pytest.approx(1.0)  # 3 steps, 3 distinct words reached
    assert r("b0 d0 b0 d0") == pytest.approx(1 / 3)  # d0 reached twice counts once; d -> b is no step
    assert LadderTask(tokenizer).reward([vocab[by_letter[c][0]] for c in "bdbd"]) == pytest.approx(2 / 3)
    assert r("b0 d0 b1 d1") == pytest.approx(2 / 3)  # two different d words: both count
    assert r("z0 b0 d0") == pytest.approx(1.0)  # z -> b wraps around the cycle
    assert r("b0 f0 d0") == 0.0  # skipping a rung and going back never score
    assert r("b0 d0 < d0 f0") == pytest.approx(2 / 4)  # a special token breaks both its sides
    assert r("b0") == 0.0 and task.reward([]) == 0.0
    # one lap of the cycle reaches 14 distinct words (the first word is reached by no step): 13 of 14 transitions
    lap = " ".join(c + "0" for c in "bdfgklmnprstvz")
    assert r(lap) == pytest.approx(13 / 13)
    # a second lap on the same words adds only z0 -> b0, whose b0 is new as a landing (the first b0 was a start)
    assert r(lap + " " + lap) == pytest.approx(14 / 27)
    # ... and on new words it keeps paying: 27 distinct landings of 27
    assert r(lap + " " + " ".join(c + "1" for c in "bdfgklmnprstvz")) == pytest.approx(27 / 27)


def test_chain_task_on_corpus_text_matches_an_independent_count(tokenizer):
    """Corpus windows of 32 words: the reward is the distinct words landed on by a ladder step, counted here from
    the words' letters, and the start is low (below the ladder's own chance rate)."""
    task, ladder = ChainTask(tokenizer), LadderTask(tokenizer)
    vocab = tokenizer.get_vocab()
    order = "bdfgklmnprstvz"
    rewards, ladders = [], []
    for line in corpus_path().read_text().splitlines()[:200]:
        w = line.split()[:32]
        landed = {b for a, b in zip(w, w[1:], strict=False) if order[(order.index(a[0]) + 1) % 14] == b[0]}
        rewards.append(task.reward([vocab[x] for x in w]))
        ladders.append(ladder.reward([vocab[x] for x in w]))
        assert rewards[-1] == pytest.approx(len(landed) / (len(w) - 1))
        assert rewards[-1] <= ladders[-1]
    assert 0.0 < sum(rewards) / len(rewards) < 0.2
