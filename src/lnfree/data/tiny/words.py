"""The word lists of the tiny corpus (`lnfree.data.tiny.corpus`): names, places, objects, verbs in their
three forms, and the pool the induction spans are drawn from. Their order is part of the corpus: the
generator draws from these tuples by index, so reordering one changes every document.
"""

from __future__ import annotations

FEMALE_NAMES: tuple[str, ...] = (
    "Mary", "Anna", "Emma", "Sarah", "Lucy", "Kate", "Laura", "Alice", "Julia", "Clara",
    "Sophie", "Ella", "Nora", "Lily", "Amy", "Helen", "Jane", "Eva", "Maria", "Rachel",
)  # fmt: skip
MALE_NAMES: tuple[str, ...] = (
    "John", "Tom", "James", "David", "Paul", "Michael", "Peter", "Daniel", "Sam", "Jack",
    "Henry", "Leo", "Robert", "Ben", "Oscar", "Adam", "Oliver", "Lucas", "Victor", "Hugo",
)  # fmt: skip
#: All character names (40). Each is a single token of the bundled tokenizer.
NAMES: tuple[str, ...] = FEMALE_NAMES + MALE_NAMES

#: Places (20), used as ``the <place>``.
PLACES: tuple[str, ...] = (
    "store", "park", "school", "garden", "market", "library", "beach", "river", "forest",
    "station", "kitchen", "office", "hospital", "farm", "museum", "bakery", "lake", "hill",
    "village", "restaurant",
)  # fmt: skip

#: Objects (30), used as ``a <object>`` / ``the <object>``.
OBJECTS: tuple[str, ...] = (
    "drink", "ball", "book", "key", "apple", "letter", "ring", "hat", "cup", "bag", "pen",
    "box", "kite", "basket", "lamp", "coin", "map", "flower", "cake", "bottle", "bell",
    "candle", "rope", "shoe", "clock", "toy", "stone", "card", "bowl", "blanket",
)  # fmt: skip

PLURAL_OVERRIDES = {"box": "boxes", "fox": "foxes", "sheep": "sheep", "mouse": "mice"}

ANIMALS: tuple[str, ...] = (
    "cat", "dog", "bird", "fish", "horse", "cow", "duck", "rabbit", "mouse", "frog", "bear",
    "fox", "owl", "goat", "sheep",
)  # fmt: skip
COLORS: tuple[str, ...] = (
    "red", "blue", "green", "yellow", "white", "black", "brown", "pink", "purple", "orange",
)  # fmt: skip
NUMBERS: tuple[str, ...] = (
    "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
)  # fmt: skip
OBJECT_ADJECTIVES: tuple[str, ...] = (
    "big", "small", "old", "new", "shiny", "heavy", "soft", "warm", "cold", "bright", "dark",
    "tiny", "round", "strange", "beautiful", "little", "wooden", "broken", "clean", "dirty",
    "lovely", "golden", "funny", "special", "empty", "secret", "famous", "useful",
) + COLORS  # fmt: skip
PLACE_ADJECTIVES: tuple[str, ...] = (
    "quiet", "busy", "big", "small", "warm", "cold", "dark", "bright", "beautiful", "crowded",
    "empty", "old", "new", "noisy", "peaceful", "clean", "sunny", "huge",
)  # fmt: skip
FEELINGS: tuple[str, ...] = (
    "happy", "sad", "tired", "excited", "angry", "scared", "proud", "surprised", "calm",
    "curious", "hungry", "worried", "lonely", "bored", "glad", "nervous",
)  # fmt: skip
WEATHER: tuple[str, ...] = ("sunny", "rainy", "cold", "windy", "warm", "cloudy", "snowy", "hot")
ROLES_F: tuple[str, ...] = ("girl", "woman", "queen", "princess", "lady")
ROLES_M: tuple[str, ...] = ("boy", "man", "king", "prince", "farmer")
ROLES_N: tuple[str, ...] = (
    "child", "teacher", "baker", "doctor", "painter", "sailor", "student", "cook", "pilot",
    "nurse", "singer", "writer",
)  # fmt: skip
RELATIONS_F: tuple[str, ...] = ("sister", "mother", "aunt", "friend", "neighbor", "cousin")
RELATIONS_M: tuple[str, ...] = ("brother", "father", "uncle", "friend", "neighbor", "cousin")
TIMES: tuple[str, ...] = (
    "One day", "In the morning", "Later", "After lunch", "That evening", "The next day",
    "On Sunday", "Soon", "At night", "After a while", "Before dinner", "Every morning",
    "In the afternoon", "After school", "On Monday",
)  # fmt: skip
PREPOSITIONS: tuple[str, ...] = ("near", "under", "behind", "inside", "next to", "on top of")

# Verbs as (base, third person singular present, past).
Verb = tuple[str, str, str]
MOTION_VERBS: tuple[Verb, ...] = (
    ("go", "goes", "went"), ("walk", "walks", "walked"), ("run", "runs", "ran"),
    ("hurry", "hurries", "hurried"), ("drive", "drives", "drove"),
    ("travel", "travels", "traveled"), ("come", "comes", "came"),
)  # fmt: skip
GIVE_VERBS: tuple[Verb, ...] = (
    ("give", "gives", "gave"), ("hand", "hands", "handed"), ("pass", "passes", "passed"),
    ("bring", "brings", "brought"), ("throw", "throws", "threw"), ("send", "sends", "sent"),
    ("show", "shows", "showed"), ("sell", "sells", "sold"), ("offer", "offers", "offered"),
)  # fmt: skip
OBJECT_VERBS: tuple[Verb, ...] = (
    ("find", "finds", "found"), ("take", "takes", "took"), ("buy", "buys", "bought"),
    ("lose", "loses", "lost"), ("carry", "carries", "carried"), ("clean", "cleans", "cleaned"),
    ("drop", "drops", "dropped"), ("hold", "holds", "held"), ("paint", "paints", "painted"),
    ("fix", "fixes", "fixed"), ("open", "opens", "opened"), ("hide", "hides", "hid"),
    ("keep", "keeps", "kept"), ("want", "wants", "wanted"), ("see", "sees", "saw"),
    ("like", "likes", "liked"), ("love", "loves", "loved"), ("make", "makes", "made"),
    ("wash", "washes", "washed"), ("need", "needs", "needed"),
)  # fmt: skip
INTRANSITIVE_VERBS: tuple[Verb, ...] = (
    ("sleep", "sleeps", "slept"), ("laugh", "laughs", "laughed"), ("smile", "smiles", "smiled"),
    ("sing", "sings", "sang"), ("wait", "waits", "waited"), ("play", "plays", "played"),
    ("dance", "dances", "danced"), ("rest", "rests", "rested"), ("cry", "cries", "cried"),
    ("jump", "jumps", "jumped"), ("sit", "sits", "sat"), ("read", "reads", "read"),
    ("work", "works", "worked"), ("eat", "eats", "ate"), ("swim", "swims", "swam"),
)  # fmt: skip
SAY_VERBS: tuple[Verb, ...] = (
    ("say", "says", "said"), ("shout", "shouts", "shouted"),
    ("whisper", "whispers", "whispered"), ("reply", "replies", "replied"),
    ("explain", "explains", "explained"),
)  # fmt: skip
SOCIAL_VERBS: tuple[Verb, ...] = (
    ("help", "helps", "helped"), ("call", "calls", "called"), ("visit", "visits", "visited"),
    ("hug", "hugs", "hugged"), ("thank", "thanks", "thanked"), ("meet", "meets", "met"),
    ("follow", "follows", "followed"), ("watch", "watches", "watched"),
    ("miss", "misses", "missed"), ("tease", "teases", "teased"),
)  # fmt: skip
BE: Verb = ("are", "is", "was")
HAVE: Verb = ("have", "has", "had")
FEEL: Verb = ("feel", "feels", "felt")
WANT: Verb = ("want", "wants", "wanted")

# Pool for the random spans that reward induction (said once, repeated verbatim later).
# Deliberately broad (~300 words, including verb forms) so that copying, not the frame, is what
# predicts the repeat.
SPAN_POOL: tuple[str, ...] = tuple(
    dict.fromkeys(
        NAMES + OBJECTS + ANIMALS + COLORS + NUMBERS + PLACES + FEELINGS + OBJECT_ADJECTIVES
        + PLACE_ADJECTIVES + WEATHER + ROLES_F + ROLES_M + ROLES_N
        + tuple(v[0] for v in MOTION_VERBS + OBJECT_VERBS + INTRANSITIVE_VERBS + SOCIAL_VERBS)
        + tuple(v[2] for v in OBJECT_VERBS + INTRANSITIVE_VERBS)
    )
)  # fmt: skip

PUNCT = (".", ",", "!", "?")
VOWELS = ("a", "e", "i", "o", "u")
