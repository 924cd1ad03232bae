"""A seedable generator of indirect-object-identification (IOI) prompts for any GPT-2-style tokenizer.

An IOI prompt names two people, then repeats one of them (the subject, S) as the giver; the model
should complete it with the other one (the indirect object, IO)::

    Then, Mary and John went to the store. John gave a drink to   ->  Mary   (ABBA: S is the 2nd name)
    Then, Mary and John went to the store. Mary gave a drink to   ->  John   (BABA: S is the 1st name)

Prompts come in *partner pairs*: the two prompts above share every word except the repeated name
(S2), and each one's corrupted prompt is its partner. So every pair contributes one ABBA and one
BABA prompt, and a clean prompt and its corruption differ in exactly one token, at the S2 position.

Surface forms follow the tokenizer: every slot word (names, place, object) is preceded by a space
in the templates, which is how GPT-2's byte-level BPE sees a word inside a sentence (``" Mary"``)
and is equally right for the bundled tiny model's word-level tokenizer (which splits on spaces and
isolates punctuation). Word lists are filtered with :func:`single_token_words` to the words that
are a single, known token of the tokenizer in that form (objects also need their article ``a``/
``an`` to be one), so a template tokenises to the same positions for every choice of words.

Patching compares prompts position by position, so every prompt must share one layout (token
length and slot positions). A template's literal words may tokenise differently in a model's own
tokenizer (``" walked"`` is one GPT-2 token and five of a small BPE trained on other text), so
:func:`make_ioi_prompts` tokenises each template, keeps the largest group of templates that share
a layout and records why it dropped the others; every drawn prompt is checked against that
layout (a draw that does not fit is redrawn). A tokenizer that cannot express the task (fewer
than two single-token names, say) raises :class:`lnfree.analysis.common.NotApplicable`.

The default word lists (:data:`GPT2_NAMES`, :data:`GPT2_PLACES`, :data:`GPT2_OBJECTS`) are single
GPT-2 tokens with a leading space (checked against GPT-2's vocabulary); the bundled tiny model's
tokenizer knows most of them. The default templates use only words of the tiny model's training
stories (its ``Then, A and B went to the P. S gave a O to IO.`` sentences).
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lnfree.errors import UsageError
from lnfree.analysis.common import NotApplicable

__all__ = [
    "DEFAULT_TEMPLATES",
    "GPT2_NAMES",
    "GPT2_OBJECTS",
    "GPT2_PLACES",
    "IOIPrompts",
    "make_ioi_prompts",
    "single_token_id",
    "single_token_words",
]

#: First names that are one GPT-2 token with a leading space (" Mary" -> 5335).
GPT2_NAMES: tuple[str, ...] = (
    "Mary", "John", "Tom", "James", "David", "Paul", "Michael", "Peter", "Daniel", "Sam",
    "Jack", "Henry", "Leo", "Robert", "Ben", "Oscar", "Adam", "Oliver", "Lucas", "Victor",
    "Hugo", "Anna", "Emma", "Sarah", "Lucy", "Kate", "Laura", "Alice", "Julia", "Clara",
    "Sophie", "Nora", "Lily", "Amy", "Helen", "Jane", "Eva", "Maria", "Rachel", "Mark",
    "Steven", "Richard", "Thomas", "Andrew", "Eric", "Kevin", "Brian", "George", "Edward",
    "Kelly", "Lisa", "Susan", "Karen", "Linda", "Nancy", "Emily", "Jessica", "Martin", "Chris",
    "Jason", "Ryan", "Scott", "Tim", "Mike", "Joe", "Alex", "Anne", "Ruth", "Ian", "Carl",
    "Simon", "Fred", "Louis", "Dan", "Bob", "Tony", "Steve",
)  # fmt: skip

#: Places (used as "the PLACE") that are one GPT-2 token with a leading space.
GPT2_PLACES: tuple[str, ...] = (
    "store", "park", "school", "garden", "market", "library", "beach", "river", "forest",
    "station", "kitchen", "office", "hospital", "farm", "museum", "bakery", "lake", "hill",
    "village", "restaurant", "church", "hotel", "house",
)  # fmt: skip

#: Objects (used as "a OBJECT" / "an OBJECT") that are one GPT-2 token with a leading space.
GPT2_OBJECTS: tuple[str, ...] = (
    "drink", "ball", "book", "key", "apple", "letter", "ring", "hat", "cup", "bag", "pen", "box",
    "basket", "lamp", "coin", "map", "flower", "cake", "bottle", "bell", "candle", "rope", "shoe",
    "clock", "toy", "stone", "card", "bowl", "blanket", "bone", "computer", "snack", "necklace",
)  # fmt: skip

#: Templates: ``{N1}``/``{N2}`` the two names in order of mention, ``{S2}`` the repeated subject,
#: ``{PLACE}``, ``{OBJECT}`` and ``{ART}`` (``a``/``an``, agreeing with the object). All four have
#: the same token length (for single-token slot words), so prompts from all of them stack.
DEFAULT_TEMPLATES: tuple[str, ...] = (
    "Then, {N1} and {N2} went to the {PLACE}. {S2} gave {ART} {OBJECT} to",
    "Then, {N1} and {N2} walked to the {PLACE}. {S2} handed {ART} {OBJECT} to",
    "Then, {N1} and {N2} ran to the {PLACE}. {S2} passed {ART} {OBJECT} to",
    "Then, {N1} and {N2} came to the {PLACE}. {S2} brought {ART} {OBJECT} to",
)

_SLOTS = ("N1", "N2", "S2", "PLACE", "OBJECT", "ART")
_WORD_SLOTS = ("N1", "N2", "S2", "PLACE", "OBJECT")


def single_token_id(tokenizer, word: str) -> int | None:
    """The id of ``" " + word`` when that is exactly one known (non-unknown) token, else None."""
    ids = tokenizer(" " + word, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        return None
    if tokenizer.unk_token_id is not None and ids[0] == tokenizer.unk_token_id:
        return None
    return int(ids[0])


def single_token_words(tokenizer, words: Sequence[str]) -> tuple[str, ...]:
    """The words (order kept, duplicates and id collisions dropped) that are one token after a space."""
    kept: list[str] = []
    seen: set[int] = set()
    for word in words:
        token = single_token_id(tokenizer, word)
        if token is not None and token not in seen:
            seen.add(token)
            kept.append(word)
    return tuple(kept)


def _article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


@dataclass
class IOIPrompts:
    """A batch of clean IOI prompts and their corruptions (the partner prompts), tokenised.

    Row ``i`` of ``clean_ids`` and ``corrupted_ids`` differ only at ``s2_position``; the metric is
    ``logit(io_ids[i]) - logit(s_ids[i])`` at the last position (the clean prompt's IO and S).
    Prompts ``2k`` and ``2k + 1`` are partners (``pair[i] == k``): each is the other's corruption.
    """

    clean_ids: torch.Tensor  # [n_prompts, n_positions] long
    corrupted_ids: torch.Tensor  # [n_prompts, n_positions] long
    io_ids: torch.Tensor  # [n_prompts] long: the correct answer of the clean prompt
    s_ids: torch.Tensor  # [n_prompts] long: the repeated subject of the clean prompt
    clean_texts: list[str]
    corrupted_texts: list[str]
    io_names: list[str]
    s_names: list[str]
    orders: list[str]  # "ABBA" (S is the second name) or "BABA" (S is the first name)
    templates: list[int]  # index into `template_texts`
    template_texts: tuple[str, ...]
    pair: list[int]
    position_labels: list[str]  # one per position, e.g. "BOS", "Then", ",", "N1", ..., "S2", ..., "to"
    s2_position: int
    seed: int
    prepend_bos: bool
    words: dict[str, tuple[str, ...]] = field(default_factory=dict)  # the filtered lists used
    dropped_templates: dict[str, str] = field(default_factory=dict)  # template -> why it does not align

    def __len__(self) -> int:
        return int(self.clean_ids.shape[0])

    @property
    def n_positions(self) -> int:
        return int(self.clean_ids.shape[1])

    def subset(self, index: Sequence[int]) -> IOIPrompts:
        """The prompts at ``index`` (pair ids kept as they are)."""
        idx = list(index)
        pick = lambda seq: [seq[i] for i in idx]  # noqa: E731
        return IOIPrompts(
            self.clean_ids[idx], self.corrupted_ids[idx], self.io_ids[idx], self.s_ids[idx],
            pick(self.clean_texts), pick(self.corrupted_texts), pick(self.io_names), pick(self.s_names),
            pick(self.orders), pick(self.templates), self.template_texts, pick(self.pair),
            list(self.position_labels), self.s2_position, self.seed, self.prepend_bos, dict(self.words),
            dict(self.dropped_templates),
        )  # fmt: skip


def _template_fields(template: str) -> list[str]:
    fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    unknown = sorted(set(fields) - set(_SLOTS))
    if unknown:
        raise UsageError(f"template {template!r} has unknown fields {unknown}; known: {list(_SLOTS)}")
    for needed in ("N1", "N2", "S2"):
        if fields.count(needed) != 1:
            raise UsageError(f"template {template!r} must contain {{{needed}}} exactly once")
    if template != template.rstrip():
        raise UsageError(f"template {template!r} must not end with a space (the answer's space is its token's)")
    return fields


def _tokenise(tokenizer, template: str, values: dict[str, str], bos: list[int]) -> tuple[list[int], dict[str, int]]:
    """Token ids of ``template`` filled with ``values`` and the (last) token position of each slot.

    Slots are located by tokenising the prefix that ends with each slot word (tokenizers that
    split on spaces tokenise a prefix ending at a word boundary as the full text does), and
    checked against the full tokenisation.
    """
    text = template.format(**values)
    ids = bos + tokenizer(text, add_special_tokens=False)["input_ids"]
    positions: dict[str, int] = {}
    for literal_end, name in _slot_ends(template):
        prefix = template[:literal_end].format(**values) + values[name]
        n = len(bos) + len(tokenizer(prefix, add_special_tokens=False)["input_ids"])
        positions[name] = n - 1
    return ids, positions


def _slot_ends(template: str) -> list[tuple[int, str]]:
    """(index in ``template`` where each ``{FIELD}`` starts, FIELD) in order."""
    out = []
    start = 0
    while True:
        i = template.find("{", start)
        if i < 0:
            return out
        j = template.index("}", i)
        out.append((i, template[i + 1 : j]))
        start = j + 1


def make_ioi_prompts(
    tokenizer,
    n_prompts: int,
    *,
    seed: int = 0,
    templates: Sequence[str] = DEFAULT_TEMPLATES,
    names: Sequence[str] = GPT2_NAMES,
    places: Sequence[str] = GPT2_PLACES,
    objects: Sequence[str] = GPT2_OBJECTS,
    prepend_bos: bool = True,
) -> IOIPrompts:
    """``n_prompts`` IOI prompts (ABBA/BABA partner pairs) and their corruptions, for ``tokenizer``.

    Deterministic in ``seed`` (a private ``random.Random``; word lists are filtered in their given
    order). Each pair draws a template, two distinct names, a place and an object; the pair's
    ABBA prompt (S2 = second name) comes first, then its BABA partner. An odd ``n_prompts`` drops
    the last partner. ``prepend_bos`` puts the tokenizer's BOS (or EOS) token first, as GPT-2's
    training documents begin after an end-of-text token.

    Only the largest group of ``templates`` with one layout (token length and slot positions) is
    used; ``dropped_templates`` of the result says why each other one was left out. Raises
    :class:`lnfree.analysis.common.NotApplicable` (a ``ValueError``) when the tokenizer cannot
    give aligned prompts: fewer than two names, or no place or object, survive the single-token
    filter, no template keeps its slot words single tokens, or too many draws do not fit.
    """
    if n_prompts < 1:
        raise UsageError("n_prompts must be >= 1")
    templates = tuple(templates)
    if not templates:
        raise UsageError("at least one template is needed")
    for template in templates:
        _template_fields(template)
    words = _single_token_lists(tokenizer, names, places, objects)
    bos = _bos_ids(tokenizer, prepend_bos)
    kept, layout, dropped = _kept_templates(tokenizer, templates, words, bos)
    rows = _draw_rows(tokenizer, kept, layout, words, bos, n_prompts, seed)
    clean = torch.tensor([row["clean_ids"] for row in rows], dtype=torch.long)
    return IOIPrompts(
        clean_ids=clean,
        corrupted_ids=torch.tensor([row["corrupt_ids"] for row in rows], dtype=torch.long),
        io_ids=torch.tensor([single_token_id(tokenizer, row["io"]) for row in rows], dtype=torch.long),
        s_ids=torch.tensor([single_token_id(tokenizer, row["s"]) for row in rows], dtype=torch.long),
        clean_texts=[kept[r["template"]].format(**r["clean"]) for r in rows],
        corrupted_texts=[kept[r["template"]].format(**r["corrupt"]) for r in rows],
        io_names=[r["io"] for r in rows],
        s_names=[r["s"] for r in rows],
        orders=[r["order"] for r in rows],
        templates=[r["template"] for r in rows],
        template_texts=kept,
        pair=[r["pair"] for r in rows],
        position_labels=_position_labels(tokenizer, clean, layout, len(bos)),
        s2_position=dict(layout[1])["S2"],
        seed=seed,
        prepend_bos=prepend_bos,
        words=words,
        dropped_templates=dropped,
    )


def _single_token_lists(tokenizer, names: Sequence[str], places: Sequence[str],
                        objects: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The word lists filtered to single tokens (objects also need a single-token article); NotApplicable if too few."""
    words = {
        "names": single_token_words(tokenizer, names),
        "places": single_token_words(tokenizer, places),
        "objects": tuple(o for o in single_token_words(tokenizer, objects)
                         if single_token_id(tokenizer, _article(o)) is not None),
    }  # fmt: skip
    if len(words["names"]) < 2:
        raise NotApplicable(f"IOI prompts need two names that are single tokens (after a space) of the model's "
                            f"tokenizer; of {len(names)} candidates it has {list(words['names']) or 'none'}")
    if not words["places"] or not words["objects"]:
        raise NotApplicable("IOI prompts need a place and an object that are single tokens (after a space) of the "
                            "model's tokenizer; it has none of the candidates for "
                            + " and ".join(k for k in ("places", "objects") if not words[k]))
    return words


def _bos_ids(tokenizer, prepend_bos: bool) -> list[int]:
    """``[BOS id]`` (the EOS id when there is no BOS) with ``prepend_bos``, else ``[]``."""
    if not prepend_bos:
        return []
    bos_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if bos_id is None:
        raise UsageError("prepend_bos=True but the tokenizer has neither a BOS nor an EOS token")
    return [int(bos_id)]


def _kept_templates(tokenizer, templates: tuple[str, ...], words: dict[str, tuple[str, ...]],
                    bos: list[int]) -> tuple[tuple[str, ...], tuple, dict[str, str]]:
    """Each template probed with the first word of each list, then :func:`_aligned_templates` of their layouts."""
    probe = {"N1": words["names"][0], "N2": words["names"][1], "PLACE": words["places"][0],
             "OBJECT": words["objects"][0], "ART": _article(words["objects"][0])}  # fmt: skip
    probed = [_tokenise_pair(tokenizer, template, probe, bos) for template in templates]
    return _aligned_templates(templates, [None if p is None else p[2] for p in probed])


def _draw_rows(tokenizer, kept: tuple[str, ...], layout: tuple, words: dict[str, tuple[str, ...]], bos: list[int],
               n_prompts: int, seed: int) -> list[dict]:
    """``n_prompts`` prompt rows, pair by pair (ABBA, then its BABA partner), drawn by ``random.Random(seed)``.

    A draw whose prompts do not have ``layout`` is redrawn; too many such draws raise NotApplicable.
    """
    rng = random.Random(seed)
    rows: list[dict] = []
    n_pairs = (n_prompts + 1) // 2
    rejected, max_rejected = 0, max(100, 10 * n_pairs)
    while len(rows) < 2 * n_pairs:
        t, base = _draw_words(rng, len(kept), words)
        pair = _tokenise_pair(tokenizer, kept[t], base, bos)
        if pair is None or pair[2] != layout:
            # Only tokenizers that merge across word boundaries get here: draw another pair.
            rejected += 1
            if rejected > max_rejected:
                raise NotApplicable(f"IOI prompts: {rejected} drawn word combinations did not tokenise to prompts "
                                    "aligned with the template's (one token per name, place and object)")
            continue
        rows += _partner_rows(len(rows) // 2, t, base, pair[0], pair[1])
    return rows[:n_prompts]


def _draw_words(rng: random.Random, n_templates: int, words: dict[str, tuple[str, ...]]) -> tuple[int, dict[str, str]]:
    """One draw: a template index and its slot words (two distinct names, a place, an object and its article)."""
    t = rng.randrange(n_templates)
    n1, n2 = rng.sample(words["names"], 2)
    place = words["places"][rng.randrange(len(words["places"]))]
    obj = words["objects"][rng.randrange(len(words["objects"]))]
    return t, {"N1": n1, "N2": n2, "PLACE": place, "OBJECT": obj, "ART": _article(obj)}


def _partner_rows(k: int, t: int, base: dict[str, str], abba_ids: list[int], baba_ids: list[int]) -> list[dict]:
    """Pair ``k``'s two rows: the ABBA prompt, then its BABA partner; each one's corruption is the other."""
    n1, n2 = base["N1"], base["N2"]
    abba = {**base, "S2": n2}  # S = second name, IO = first
    baba = {**base, "S2": n1}  # S = first name, IO = second
    return [
        {"pair": k, "template": t, "order": "ABBA", "clean": abba, "corrupt": baba, "io": n1, "s": n2,
         "clean_ids": abba_ids, "corrupt_ids": baba_ids},
        {"pair": k, "template": t, "order": "BABA", "clean": baba, "corrupt": abba, "io": n2, "s": n1,
         "clean_ids": baba_ids, "corrupt_ids": abba_ids},
    ]  # fmt: skip


def _position_labels(tokenizer, clean: torch.Tensor, layout: tuple, n_bos: int) -> list[str]:
    """One label per position: "BOS", a slot's name, the token every prompt has there, or ``p{pos}``."""
    length, positions = layout
    role: list[str | None] = ["BOS"] * n_bos + [None] * (length - n_bos)
    for name, pos in positions:
        role[pos] = name
    labels = []
    for pos in range(length):
        tokens = set(clean[:, pos].tolist())
        if role[pos] is not None:
            labels.append(role[pos])
        elif len(tokens) == 1:
            labels.append(tokenizer.decode([tokens.pop()]).strip() or f"p{pos}")
        else:
            labels.append(f"p{pos}")
    return labels


def _tokenise_pair(tokenizer, template: str, base: dict[str, str], bos: list[int]):
    """The ABBA and BABA prompts of one draw of words, tokenised, and their layout (length, slot positions).

    None unless both prompts have the same layout, every word slot holds exactly its word's
    single token, and the two differ only at S2.
    """
    abba, baba = {**base, "S2": base["N2"]}, {**base, "S2": base["N1"]}
    a_ids, a_pos = _tokenise(tokenizer, template, abba, bos)
    b_ids, b_pos = _tokenise(tokenizer, template, baba, bos)
    if len(a_ids) != len(b_ids) or a_pos != b_pos or max(a_pos.values()) >= len(a_ids):
        return None
    for values, ids in ((abba, a_ids), (baba, b_ids)):
        if any(ids[a_pos[name]] != single_token_id(tokenizer, values[name]) for name in _WORD_SLOTS):
            return None
    if [i for i, (x, y) in enumerate(zip(a_ids, b_ids)) if x != y] != [a_pos["S2"]]:
        return None
    return a_ids, b_ids, (len(a_ids), tuple(sorted(a_pos.items(), key=lambda item: item[1])))


def _aligned_templates(templates: tuple[str, ...], layouts: list) -> tuple[tuple[str, ...], tuple, dict[str, str]]:
    """The largest group of templates sharing a layout (ties: the earliest), the layout, and why others were dropped."""
    groups: dict[tuple, list[str]] = {}
    for template, layout in zip(templates, layouts):
        if layout is not None:
            groups.setdefault(layout, []).append(template)
    if not groups:
        raise NotApplicable("IOI prompts: in none of the templates do the names, place and object stay single tokens "
                            "of the model's tokenizer")  # fmt: skip
    layout = max(groups, key=lambda key: len(groups[key]))  # the first of equal groups
    s2 = dict(layout[1])["S2"]
    dropped = {}
    for template, other in zip(templates, layouts):
        if other is None:
            dropped[template] = "its slot words do not stay single tokens in it"
        elif other != layout:
            dropped[template] = (f"{other[0]} tokens with S2 at position {dict(other[1])['S2']}, the kept templates "
                                 f"{layout[0]} tokens with S2 at {s2}")  # fmt: skip
    return tuple(groups[layout]), layout, dropped
