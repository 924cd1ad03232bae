"""Deterministic generator of a small synthetic English-like corpus of short stories.

The corpus is the training data of the bundled tiny GPT-2. It is designed so that a ~1M parameter
model trained for a few minutes on CPU learns a few circuits that interpretability work on real
GPT-2 cares about:

* **Indirect object identification (IOI)**: sentences such as
  ``When Mary and John went to the store, John gave a drink to Mary.`` (both ABBA and BABA
  orders, several templates, past and present tense), where the final name is predictable only by
  noticing which of the two names was *not* repeated.
* **Induction**: a random-looking span of words (a "secret code", a list of guests, a song) is
  said once and then repeated verbatim later in the same document, so the second occurrence is
  predictable only by copying.

Everything else (narration, dialogue, descriptions) gives the model ordinary grammar to learn:
subject/verb agreement, tense consistency within a document, articles (``a``/``an``), pronouns
that agree with the gender of the character, plurals.

Determinism: :func:`generate_documents` only uses a private ``random.Random(seed)`` and iterates
over tuples (never sets or dicts whose order could depend on hashing), so the same ``(n, seed)``
gives byte-identical output everywhere. Documents are generated one after the other from the same
generator, so ``generate_documents(k, seed)`` is a prefix of ``generate_documents(n, seed)`` for
``k <= n``.

Text format: one line per document, words separated by single spaces, punctuation limited to
``. , ! ?`` and attached to the preceding word (``store, John``). No apostrophes, quotes or
digits, so a word-level tokenizer that isolates punctuation covers the corpus exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from lnfree.data.tiny.words import (
    FEMALE_NAMES, PLURAL_OVERRIDES, ANIMALS, NUMBERS, OBJECT_ADJECTIVES, PLACE_ADJECTIVES, FEELINGS, WEATHER, ROLES_F,
    ROLES_M, ROLES_N, RELATIONS_F, RELATIONS_M, TIMES, PREPOSITIONS, Verb, MOTION_VERBS, GIVE_VERBS,
    OBJECT_VERBS, INTRANSITIVE_VERBS, SAY_VERBS, SOCIAL_VERBS, HAVE, FEEL, SPAN_POOL, PUNCT, VOWELS, NAMES,
    OBJECTS, PLACES,
)
from lnfree.errors import UsageError

__all__ = [
    "generate_documents",
    "generate_document",
]


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _article(word: str) -> str:
    return "an" if word[0] in VOWELS and not word.startswith("use") else "a"


def _plural(noun: str) -> str:
    if noun in PLURAL_OVERRIDES:
        return PLURAL_OVERRIDES[noun]
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    return noun + "s"


def _cap(word: str) -> str:
    return word[0].upper() + word[1:]


def _render(tokens: list[str]) -> str:
    """Join tokens with spaces, attach punctuation to the previous word, capitalise the start."""
    words: list[str] = []
    for tok in tokens:
        for part in tok.split(" "):
            if part in PUNCT and words:
                words[-1] += part
            else:
                words.append(part)
    words[0] = _cap(words[0])
    return " ".join(words)


@dataclass
class _Story:
    rng: random.Random
    past: bool
    cast: list[str]
    places: list[str]
    things: list[str]
    sentences: list[str] = field(default_factory=list)
    n_words: int = 0
    pending_repeats: list[tuple[int, list[str], str]] = field(default_factory=list)

    # --- random choices -----------------------------------------------------------------
    def pick(self, seq):
        return seq[self.rng.randrange(len(seq))]

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def person(self) -> str:
        return self.pick(self.cast)

    def two_people(self) -> tuple[str, str]:
        a, b = self.rng.sample(self.cast, 2)
        return a, b

    def place(self) -> str:
        # Mostly the story's own places, sometimes any place.
        return self.pick(self.places) if self.chance(0.7) else self.pick(PLACES)

    def thing(self) -> str:
        return self.pick(self.things) if self.chance(0.6) else self.pick(OBJECTS)

    def time(self) -> str:
        return self.pick(TIMES)

    # --- grammar --------------------------------------------------------------------------
    def verb(self, v: Verb, plural: bool = False) -> str:
        if self.past:
            return v[2]
        return v[0] if plural else v[1]

    def be(self, plural: bool = False) -> str:
        if self.past:
            return "were" if plural else "was"
        return "are" if plural else "is"

    @staticmethod
    def female(name: str) -> bool:
        return name in FEMALE_NAMES

    def he(self, name: str) -> str:
        return "she" if self.female(name) else "he"

    def him(self, name: str) -> str:
        return "her" if self.female(name) else "him"

    def his(self, name: str) -> str:
        return "her" if self.female(name) else "his"

    def a_noun(self, noun: str, adj_p: float = 0.35) -> list[str]:
        """``a ball`` / ``an old ball`` (optionally with an adjective)."""
        if self.chance(adj_p):
            adj = self.pick(OBJECT_ADJECTIVES)
            return [_article(adj), adj, noun]
        return [_article(noun), noun]

    def the_noun(self, noun: str, adj_p: float = 0.2) -> list[str]:
        if self.chance(adj_p):
            return ["the", self.pick(OBJECT_ADJECTIVES), noun]
        return ["the", noun]

    def add(self, tokens: list[str]) -> None:
        self.sentences.append(_render(tokens))
        self.n_words += sum(1 for t in tokens for w in t.split(" ") if w not in PUNCT)


# --------------------------------------------------------------------------------------------
# Sentence templates. Each takes the story and appends one or more sentences.
# --------------------------------------------------------------------------------------------


def _intro(s: _Story) -> None:
    a = s.cast[0]
    roles = (ROLES_F if s.female(a) else ROLES_M) + ROLES_N
    role = s.pick(roles)
    r = s.rng.randrange(4)
    if r == 0:
        adj = s.pick(("kind", "young", "clever", "brave", "little", "funny", "quiet", "happy"))
        s.add(["once upon a time", ",", "there was", _article(adj), adj, role, "named", a, "."])
    elif r == 1:
        s.add([a, s.be(), _article(role), role, "who", s.verb(("live", "lives", "lived")),
               "near the", s.places[0], "."])  # fmt: skip
    elif r == 2:
        s.add(["this", "is" if not s.past else "was", "a story about", a, "and", s.cast[1], "."])
    else:
        s.add([s.time(), ",", a, s.verb(s.pick(MOTION_VERBS)), "to the", s.places[0], "."])
    if len(s.cast) > 1 and s.chance(0.7):
        b = s.cast[1]
        rel = s.pick(RELATIONS_F if s.female(b) else RELATIONS_M)
        if s.chance(0.5):
            s.add([a, "and", b, s.be(plural=True), "good friends", "."])
        else:
            s.add([b, s.be(), s.his(a), rel, "."])


def _ioi(s: _Story) -> None:
    """IOI sentences: two names introduced, one repeated as subject, the other is the receiver."""
    a, b = s.two_people()  # a, b in order of first mention
    subj, io = (b, a) if s.chance(0.5) else (a, b)  # ABBA or BABA
    pl = s.place()
    obj = s.thing()
    give = s.verb(s.pick(GIVE_VERBS))
    motion = s.verb(s.pick(MOTION_VERBS), plural=True)
    r = s.rng.randrange(7)
    if r == 0:
        s.add(["when", a, "and", b, motion, "to the", pl, ",", subj, give, *s.a_noun(obj), "to",
               io, "."])  # fmt: skip
    elif r == 1:
        s.add(["then", ",", a, "and", b, motion, "to the", pl, "."])
        s.add([subj, give, *s.a_noun(obj), "to", io, "."])
    elif r == 2:
        s.add(["while", a, "and", b, s.be(plural=True), "at the", pl, ",", subj, give,
               *s.the_noun(obj), "to", io, "."])  # fmt: skip
    elif r == 3:
        s.add(["after", a, "and", b, motion, "to the", pl, ",", subj, give, *s.a_noun(obj),
               "to", io, "."])  # fmt: skip
    elif r == 4:
        s.add([a, "and", b, s.verb(("find", "find", "found"), plural=True), *s.a_noun(obj),
               "at the", pl, "."])  # fmt: skip
        s.add(["then", ",", subj, give, "it to", io, "."])
    elif r == 5:
        s.add(["the", "next day", ",", a, "and", b, s.verb(("meet", "meet", "met"), plural=True),
               "at the", pl, ".", subj, give, *s.a_noun(obj), "to", io, "."])  # fmt: skip
    else:
        say = s.verb(s.pick(SAY_VERBS[:2]))
        s.add(["when", a, "and", b, motion, "to the", pl, ",", subj, say, "hello to", io, "."])


def _induction_start(s: _Story) -> None:
    """Say a random span once; schedule its verbatim repetition later in the document.

    One time in five the span is instead chanted by a parrot two or three times in a row, with no
    separator, which rewards copying without any surrounding frame.
    """
    n = s.rng.randrange(3, 11)
    span = [s.pick(SPAN_POOL) for _ in range(n)]
    a = s.person()
    r = s.rng.randrange(5)
    if r == 4:
        s.add(["the parrot", s.verb(("say", "says", "said")), ",", *(span * s.rng.randrange(2, 4)),
               "!"])  # fmt: skip
        return
    if r == 0:
        s.add([a, s.verb(("write", "writes", "wrote")), "down a secret code", ",", *span, "."])
        repeat_intro = [s.pick(s.cast), s.verb(("read", "reads", "read")), "the code again",
                        ","]  # fmt: skip
    elif r == 1:
        s.add(["the song", s.verb(("go", "goes", "went")), *span, "."])
        repeat_intro = [s.pick(s.cast), s.verb(("sing", "sings", "sang")), "it again", ","]
    elif r == 2:
        s.add([a, s.verb(s.pick(SAY_VERBS[:3])), "the magic words", ",", *span, "."])
        repeat_intro = ["later", ",", s.pick(s.cast), s.verb(("say", "says", "said")),
                        "the magic words", ","]  # fmt: skip
    else:
        s.add([a, s.verb(HAVE), "a list", ",", *span, "."])
        repeat_intro = [s.pick(s.cast), s.verb(("remember", "remembers", "remembered")),
                        "the list", ","]  # fmt: skip
    # Sometimes an immediate repeat, and always a later one.
    if s.chance(0.25):
        s.add(["again", ",", *span, "!"])
    delay = s.rng.randrange(1, 5)
    s.pending_repeats.append((len(s.sentences) + delay, span, " ".join(repeat_intro)))


def _flush_repeats(s: _Story, force: bool = False) -> None:
    keep = []
    for due, span, intro in s.pending_repeats:
        if force or len(s.sentences) >= due:
            s.add([intro, *span, "."])
        else:
            keep.append((due, span, intro))
    s.pending_repeats = keep


def _motion(s: _Story) -> None:
    a = s.person()
    if s.chance(0.3) and len(s.cast) > 1:
        x, y = s.two_people()
        s.add([s.time(), ",", x, "and", y, s.verb(s.pick(MOTION_VERBS), plural=True), "to the",
               s.place(), "."])  # fmt: skip
    elif s.chance(0.5):
        s.add([s.time(), ",", a, s.verb(s.pick(MOTION_VERBS)), "to the", s.place(), "."])
    else:
        s.add([a, s.verb(s.pick(MOTION_VERBS)), "to the", s.place(), "with", s.his(a),
               s.pick(RELATIONS_F + RELATIONS_M), "."])  # fmt: skip


def _object_action(s: _Story) -> None:
    a = s.person()
    obj = s.thing()
    r = s.rng.randrange(4)
    if r == 0:
        s.add([a, s.verb(s.pick(OBJECT_VERBS)), *s.a_noun(obj), s.pick(PREPOSITIONS), "the",
               s.place(), "."])  # fmt: skip
    elif r == 1:
        s.add([a, s.verb(s.pick(OBJECT_VERBS)), *s.the_noun(obj), ",", "and then", s.he(a),
               s.verb(s.pick(INTRANSITIVE_VERBS)), "."])  # fmt: skip
    elif r == 2:
        s.add(["the", obj, s.be(), s.pick(OBJECT_ADJECTIVES), ",", "so", a,
               s.verb(s.pick(OBJECT_VERBS)), "it", "."])  # fmt: skip
    else:
        s.add([a, s.verb(s.pick(OBJECT_VERBS)), s.his(a), obj, "."])


def _dialogue(s: _Story) -> None:
    if len(s.cast) < 2:
        return _object_action(s)
    a, b = s.two_people()
    obj = s.thing()
    r = s.rng.randrange(5)
    if r == 0:
        s.add([a, s.verb(("ask", "asks", "asked")), b, ",", "where is the", obj, "?"])
        s.add([b, s.verb(s.pick(SAY_VERBS)), ",", "the", obj, "is", s.pick(PREPOSITIONS),
               "the", s.place(), "!"])  # fmt: skip
    elif r == 1:
        s.add([a, s.verb(("shout", "shouts", "shouted")), ",", "I found", *s.a_noun(obj), "!"])
    elif r == 2:
        s.add(["can you help me", ",", b, "?", s.verb(("ask", "asks", "asked")), a, "."])
        s.add([b, s.verb(s.pick(SAY_VERBS)), ",", "yes", ",", "of course", "!"])
    elif r == 3:
        s.add([a, s.verb(s.pick(SAY_VERBS)), "to", b, ",", "I", "like your", obj, "."])
        s.add([b, s.verb(("smile", "smiles", "smiled")), "and", s.verb(("say", "says", "said")),
               ",", "thank you", "!"])  # fmt: skip
    else:
        s.add(["why", "is" if not s.past else "was", a, "so", s.pick(FEELINGS), "?"])
        s.add(["nobody", s.verb(("know", "knows", "knew")), "."])


def _feeling(s: _Story) -> None:
    a = s.person()
    r = s.rng.randrange(3)
    if r == 0:
        s.add([a, s.verb(FEEL), "very", s.pick(FEELINGS), "because", s.he(a),
               s.verb(s.pick(OBJECT_VERBS)), s.his(a), s.thing(), "."])  # fmt: skip
    elif r == 1:
        s.add([a, s.be(), s.pick(FEELINGS), "."])
    else:
        neg = "did not" if s.past else "does not"
        s.add([a, neg, "want to", s.pick(INTRANSITIVE_VERBS)[0], "at the", s.place(), "."])


def _social(s: _Story) -> None:
    if len(s.cast) < 2:
        return _feeling(s)
    a, b = s.two_people()
    r = s.rng.randrange(3)
    if r == 0:
        s.add([a, s.verb(s.pick(SOCIAL_VERBS)), b, "at the", s.place(), "."])
    elif r == 1:
        s.add([a, s.verb(s.pick(SOCIAL_VERBS)), b, ",", "and", s.he(b),
               s.verb(("smile", "smiles", "smiled")), "."])  # fmt: skip
    else:
        # Double-object give: the receiver comes right after the verb.
        s.add([a, s.verb(s.pick(GIVE_VERBS[:4])), b, *s.a_noun(s.thing()), "."])


def _description(s: _Story) -> None:
    r = s.rng.randrange(4)
    if r == 0:
        s.add(["the", s.place(), s.be(), s.pick(PLACE_ADJECTIVES), "and",
               s.pick(PLACE_ADJECTIVES), "."])  # fmt: skip
    elif r == 1:
        s.add(["it", s.be(), _article(w := s.pick(WEATHER)), w, "day", "."])
    elif r == 2:
        n = s.pick(NUMBERS)
        s.add([s.person(), s.verb(HAVE), n, _plural(s.pick(OBJECTS + ANIMALS)), "."])
    else:
        animal = s.pick(ANIMALS)
        s.add(["there", s.be(), _article(animal), animal, "at the", s.place(), "."])
        s.add(["the", animal, s.verb(s.pick(INTRANSITIVE_VERBS[:8])), "."])


def _ending(s: _Story) -> None:
    r = s.rng.randrange(4)
    if r == 0 and len(s.cast) > 1:
        s.add(["in the end", ",", s.cast[0], "and", s.cast[1], s.be(plural=True), "very happy",
               "."])  # fmt: skip
    elif r == 1:
        s.add(["they", s.verb(("go", "go", "went"), plural=True), "home and",
               s.verb(("sleep", "sleep", "slept"), plural=True), "."])  # fmt: skip
    elif r == 2:
        s.add(["the end", "."])
    else:
        s.add([s.cast[0], s.verb(("smile", "smiles", "smiled")), "."])


_BODY: tuple[tuple[object, float], ...] = (
    (_ioi, 0.22),
    (_induction_start, 0.16),
    (_motion, 0.11),
    (_object_action, 0.14),
    (_dialogue, 0.13),
    (_feeling, 0.09),
    (_social, 0.12),
    (_description, 0.12),
)
_BODY_FNS = tuple(f for f, _ in _BODY)
_BODY_CUM: tuple[float, ...] = tuple(sum(w for _, w in _BODY[: i + 1]) for i in range(len(_BODY)))


def _pick_body(rng: random.Random):
    x = rng.random() * _BODY_CUM[-1]
    for fn, c in zip(_BODY_FNS, _BODY_CUM):
        if x < c:
            return fn
    return _BODY_FNS[-1]


def generate_document(rng: random.Random) -> str:
    """Generate one story (roughly 60-250 words, at most ~280) using ``rng``."""
    n_cast = rng.choice((2, 2, 3, 3, 4))
    s = _Story(
        rng=rng,
        past=rng.random() < 0.75,
        cast=rng.sample(NAMES, n_cast),
        places=rng.sample(PLACES, 3),
        things=rng.sample(OBJECTS, 4),
    )
    target = rng.randrange(55, 231)
    _intro(s)
    while s.n_words < target:
        _pick_body(rng)(s)
        _flush_repeats(s)
    _flush_repeats(s, force=True)
    _ending(s)
    return " ".join(s.sentences)


def generate_documents(n_documents: int, seed: int) -> list[str]:
    """Return ``n_documents`` stories generated deterministically from ``seed``.

    The same ``(n_documents, seed)`` gives byte-identical output on every machine, and the result
    for a smaller ``n_documents`` is a prefix of the result for a larger one.
    """
    if n_documents < 0:
        raise UsageError("n_documents must be >= 0")
    rng = random.Random(seed)
    return [generate_document(rng) for _ in range(n_documents)]
