"""A deterministic English-like corpus for examples/train_gpt.py: nothing is downloaded.

A seeded probabilistic grammar writes short paragraphs with structure at several ranges, so a
character-level model has something to learn at every stage of training:
- spelling of a fixed word list, capitals and punctuation (a few characters);
- agreement: "the fox runs" / "the foxes run", "a"/"an", "two birds", "does"/"do" (a word);
- tense held through a paragraph, and pronouns that match a name ("Anna ... she") (a sentence);
- names and objects introduced in a paragraph and referred to again later (in-context copying);
- small sums written out in words and digits ("three plus four is seven. 3 + 4 = 7.").
`corpus(n_chars, seed)` returns the same text for the same arguments on every machine (Python's
`random.Random` is stable across platforms and versions for `random()`, `choice` and `randrange`).
"""

from __future__ import annotations

import random

NAMES = {
    "Anna": "she", "Clara": "she", "Emma": "she", "Grace": "she", "Iris": "she", "Lena": "she",
    "Nora": "she", "Paula": "she", "Ben": "he", "David": "he", "Felix": "he", "Hugo": "he",
    "Jack": "he", "Max": "he", "Oscar": "he", "Sam": "he",
}  # fmt: skip
NOUNS = [
    ("cat", "cats"), ("dog", "dogs"), ("fox", "foxes"), ("bird", "birds"), ("child", "children"),
    ("mouse", "mice"), ("horse", "horses"), ("farmer", "farmers"), ("teacher", "teachers"),
    ("owl", "owls"), ("baker", "bakers"), ("sheep", "sheep"), ("wolf", "wolves"),
]  # fmt: skip
THINGS = ["ball", "box", "apple", "book", "hat", "key", "cup", "egg", "kite", "umbrella",
          "letter", "stone"]  # fmt: skip
THING_ADJS = ["small", "big", "old", "new", "red", "green", "blue", "orange", "heavy", "empty"]
PLACES = ["river", "house", "garden", "bridge", "market", "forest", "school", "hill", "barn"]
ADJS = ["small", "big", "old", "young", "red", "green", "quiet", "happy", "tired", "clever",
        "brown", "orange", "empty", "heavy"]  # fmt: skip
# (third person singular present, plural present / base, past)
VERBS_T = [
    ("sees", "see", "saw"), ("likes", "like", "liked"), ("chases", "chase", "chased"),
    ("finds", "find", "found"), ("watches", "watch", "watched"), ("follows", "follow", "followed"),
    ("helps", "help", "helped"), ("meets", "meet", "met"),
]  # fmt: skip
VERBS_I = [
    ("sleeps", "sleep", "slept"), ("runs", "run", "ran"), ("sings", "sing", "sang"),
    ("waits", "wait", "waited"), ("laughs", "laugh", "laughed"), ("hides", "hide", "hid"),
]  # fmt: skip
PREPS = ["near", "under", "behind", "in", "beside", "across"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
           "eighteen"]  # fmt: skip


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class _Writer:
    def __init__(self, rng: random.Random):
        self.r = rng

    def adj(self, p: float = 0.4, words: list[str] = ADJS) -> str:
        return self.r.choice(words) + " " if self.r.random() < p else ""

    def np(self, plural: bool, definite: bool | None = None, depth: int = 0) -> str:
        """A noun phrase over NOUNS, optionally with a place or a relative clause."""
        sing, plur = self.r.choice(NOUNS)
        word = self.adj() + (plur if plural else sing)
        if definite is None:
            definite = self.r.random() < 0.6
        if definite:
            head = "the " + word
        elif plural:
            head = self.r.choice(["two ", "three ", "four ", "some ", "many "]) + word
        else:
            head = _article(word) + " " + word
        x = self.r.random()
        if depth == 0 and x < 0.15:
            head += f" {self.r.choice(PREPS)} the {self.r.choice(PLACES)}"
        elif depth == 0 and x < 0.25:
            obj_plural = self.r.random() < 0.5
            verb = self.r.choice(VERBS_T)[1 if obj_plural else 0]
            head += f" that {self.np(obj_plural, True, depth + 1)} {verb}"
        return head

    def clause(self, past: bool) -> str:
        plural = self.r.random() < 0.4
        subj = self.np(plural)
        form = 2 if past else (1 if plural else 0)
        if self.r.random() < 0.6:
            verb = self.r.choice(VERBS_T)[form]
            return f"{subj} {verb} {self.np(self.r.random() < 0.4)}"
        verb = self.r.choice(VERBS_I)[form]
        if self.r.random() < 0.5:
            verb += f" {self.r.choice(PREPS)} the {self.r.choice(PLACES)}"
        return f"{subj} {verb}"

    def question(self) -> str:
        plural = self.r.random() < 0.4
        aux = self.r.choice(["did", "do" if plural else "does"])
        verb = self.r.choice(VERBS_T)[1]
        return f"{aux} {self.np(plural)} {verb} {self.np(self.r.random() < 0.4)}?"

    def story(self) -> list[str]:
        """Two people and a thing: names, pronouns and the thing recur; the tense is fixed.

        A pronoun stands for the subject of the previous sentence, so its gender must be read
        from a name earlier in the paragraph."""
        holder, other = self.r.sample(sorted(NAMES), 2)
        thing = self.adj(0.8, THING_ADJS) + self.r.choice(THINGS)
        place = self.r.choice(PLACES)
        past = self.r.random() < 0.5
        last = holder

        def v(present: str, past_form: str) -> str:
            return past_form if past else present

        def ref(person: str) -> str:
            return NAMES[person] if person == last else person

        out = [f"{holder} {v('has', 'had')} {_article(thing)} {thing}"]
        for _ in range(self.r.randrange(2, 5)):
            x = self.r.random()
            if x < 0.3:
                out.append(f"{ref(holder)} {v('gives', 'gave')} the {thing} to {other}")
                last, holder, other = holder, other, holder
            elif x < 0.5:
                out.append(f"{ref(holder)} {v('takes', 'took')} the {thing} to the {place}")
                last = holder
            elif x < 0.7:
                smiles = v("smiles", "smiled")
                out.append(f"{ref(other)} {v('sees', 'saw')} the {thing} and {smiles}")
                last = other
            elif x < 0.85:
                out.append(f"{ref(other)} {v('asks', 'asked')} {holder} for the {thing}")
                last = other
            else:
                state = self.r.choice(["here", "lost", "safe"])
                out.append(f"the {thing} {v('is', 'was')} {state}")
                last = ""
        return out

    def sums(self) -> list[str]:
        x, y = self.r.randrange(0, 10), self.r.randrange(0, 9)
        return [f"{NUMBERS[x]} plus {NUMBERS[y]} is {NUMBERS[x + y]}", f"{x} + {y} = {x + y}"]

    def paragraph(self) -> str:
        kind = self.r.random()
        if kind < 0.4:
            sentences = self.story()
        elif kind < 0.55:
            sentences = self.sums()
        else:
            past = self.r.random() < 0.5
            sentences = [self.clause(past) for _ in range(self.r.randrange(2, 5))]
            if self.r.random() < 0.3:
                sentences.append(self.question())
        return " ".join(s[0].upper() + s[1:] + ("" if s.endswith("?") else ".") for s in sentences)


def corpus(n_chars: int, seed: int = 0) -> str:
    """About `n_chars` characters (whole paragraphs, one per line) from the grammar."""
    w, lines, total = _Writer(random.Random(seed)), [], 0
    while total < n_chars:
        lines.append(w.paragraph())
        total += len(lines[-1]) + 1
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(corpus(2000))
