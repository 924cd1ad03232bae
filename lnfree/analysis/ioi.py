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
are a single, known token of the tokenizer in that form, so the same templates tokenise to the
same length for every choice of words; :func:`make_ioi_prompts` checks that (and that each slot
holds exactly its word's token) rather than assuming it.

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
        )  # fmt: skip


def _template_fields(template: str) -> list[str]:
    fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    unknown = sorted(set(fields) - set(_SLOTS))
    if unknown:
        raise ValueError(f"template {template!r} has unknown fields {unknown}; known: {list(_SLOTS)}")
    for needed in ("N1", "N2", "S2"):
        if fields.count(needed) != 1:
            raise ValueError(f"template {template!r} must contain {{{needed}}} exactly once")
    if template != template.rstrip():
        raise ValueError(f"template {template!r} must not end with a space (the answer's space is its token's)")
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

    Raises ``ValueError`` when fewer than two names (or no place/object) survive the single-token
    filter, when a clean prompt and its corruption tokenise to different lengths or differ
    elsewhere than at S2, when a slot does not hold exactly its word's token, or when the
    templates give prompts of different lengths (patching needs aligned positions).
    """
    if n_prompts < 1:
        raise ValueError("n_prompts must be >= 1")
    templates = tuple(templates)
    if not templates:
        raise ValueError("at least one template is needed")
    for template in templates:
        _template_fields(template)
    words = {
        "names": single_token_words(tokenizer, names),
        "places": single_token_words(tokenizer, places),
        "objects": single_token_words(tokenizer, objects),
    }
    if len(words["names"]) < 2:
        raise ValueError(f"fewer than two names are single tokens of this tokenizer: {words['names']}")
    if not words["places"] or not words["objects"]:
        raise ValueError("no place or no object is a single token of this tokenizer")
    bos: list[int] = []
    if prepend_bos:
        bos_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if bos_id is None:
            raise ValueError("prepend_bos=True but the tokenizer has neither a BOS nor an EOS token")
        bos = [int(bos_id)]

    rng = random.Random(seed)
    rows: list[dict] = []
    n_pairs = (n_prompts + 1) // 2
    for k in range(n_pairs):
        t = rng.randrange(len(templates))
        n1, n2 = rng.sample(words["names"], 2)
        place = words["places"][rng.randrange(len(words["places"]))]
        obj = words["objects"][rng.randrange(len(words["objects"]))]
        base = {"N1": n1, "N2": n2, "PLACE": place, "OBJECT": obj, "ART": _article(obj)}
        abba = {**base, "S2": n2}  # S = second name, IO = first
        baba = {**base, "S2": n1}  # S = first name, IO = second
        for order, clean, corrupt, io, s in (("ABBA", abba, baba, n1, n2), ("BABA", baba, abba, n2, n1)):
            rows.append({"pair": k, "template": t, "order": order, "clean": clean, "corrupt": corrupt,
                         "io": io, "s": s})  # fmt: skip
    rows = rows[:n_prompts]

    clean_ids, corrupt_ids, io_ids, s_ids, roles = [], [], [], [], []
    for row in rows:
        template = templates[row["template"]]
        c_ids, c_pos = _tokenise(tokenizer, template, row["clean"], bos)
        x_ids, x_pos = _tokenise(tokenizer, template, row["corrupt"], bos)
        text = template.format(**row["clean"])
        if len(c_ids) != len(x_ids):
            raise ValueError(f"clean and corrupted prompts tokenise to {len(c_ids)} and {len(x_ids)} tokens: {text!r}")
        for name in _WORD_SLOTS:
            expected = single_token_id(tokenizer, row["clean"][name])
            if c_pos.get(name) is None or c_pos[name] != x_pos[name] or c_ids[c_pos[name]] != expected:
                raise ValueError(f"slot {name} of {text!r} is not the single token of {row['clean'][name]!r}")
        differing = [i for i, (a, b) in enumerate(zip(c_ids, x_ids)) if a != b]
        if differing != [c_pos["S2"]]:
            raise ValueError(f"clean and corrupted prompts differ at {differing}, not only at S2: {text!r}")
        clean_ids.append(c_ids)
        corrupt_ids.append(x_ids)
        io_ids.append(single_token_id(tokenizer, row["io"]))
        s_ids.append(single_token_id(tokenizer, row["s"]))
        role = ["BOS"] * len(bos) + [None] * (len(c_ids) - len(bos))
        for name, pos in c_pos.items():
            role[pos] = name
        roles.append(role)

    lengths = sorted({len(ids) for ids in clean_ids})
    if len(lengths) != 1:
        raise ValueError(f"the templates give prompts of different token lengths {lengths}; patching needs "
                         "aligned positions: pass templates of one length")  # fmt: skip
    s2 = {role.index("S2") for role in roles}
    if len(s2) != 1:
        raise ValueError("the templates put S2 at different positions; pass templates with aligned slots")

    clean = torch.tensor(clean_ids, dtype=torch.long)
    labels = []
    for pos in range(clean.shape[1]):
        slot = {role[pos] for role in roles}
        tokens = set(clean[:, pos].tolist())
        if len(slot) == 1 and None not in slot:
            labels.append(slot.pop())
        elif len(tokens) == 1:
            labels.append(tokenizer.decode([tokens.pop()]).strip() or f"p{pos}")
        else:
            labels.append(f"p{pos}")
    return IOIPrompts(
        clean_ids=clean,
        corrupted_ids=torch.tensor(corrupt_ids, dtype=torch.long),
        io_ids=torch.tensor(io_ids, dtype=torch.long),
        s_ids=torch.tensor(s_ids, dtype=torch.long),
        clean_texts=[templates[r["template"]].format(**r["clean"]) for r in rows],
        corrupted_texts=[templates[r["template"]].format(**r["corrupt"]) for r in rows],
        io_names=[r["io"] for r in rows],
        s_names=[r["s"] for r in rows],
        orders=[r["order"] for r in rows],
        templates=[r["template"] for r in rows],
        template_texts=templates,
        pair=[r["pair"] for r in rows],
        position_labels=labels,
        s2_position=s2.pop(),
        seed=seed,
        prepend_bos=prepend_bos,
        words=words,
    )
