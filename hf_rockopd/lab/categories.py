"""Rock categories of decoded token strings (whitespace, digits, punctuation/markup, discourse words, content), and
token strings made visible for tables and plots.

Example:
```python
>>> from hf_rockopd.lab import token_category
>>> token_category(" So"), token_category(" 8")
('discourse words', 'digits')
```
"""

from __future__ import annotations

import re

import pandas as pd


__all__ = ["DISCOURSE_WORDS", "ROCK_CATEGORIES", "category_table", "token_category", "token_label"]

ROCK_CATEGORIES = ("whitespace", "punctuation/markup", "digits", "discourse words", "content")

# The paper's sentence-initial discourse words (So, Let, We, But, Now, Wait) and their kin, plus the closed-class
# English function words (articles, pronouns, auxiliaries, prepositions, conjunctions): words that structure a
# solution rather than carry its content. A fixed list keeps the classification reproducible and reviewable.
DISCOURSE_WORDS = frozenset(
    """
    so let we but now wait then first next finally therefore thus hence however also since because well okay ok
    alright actually instead meanwhile moreover furthermore otherwise again still yet note recall suppose assume
    consider given remember here there this that these those it its i you he she they them their our us me my your
    his her the a an and or nor if of to in on at by for from with as into onto over under about after before
    between through during without within than is are was were be been being am do does did done has have had
    can could will would shall should may might must not no yes which who whom whose what when where why how
    all each every both either neither some any many much more most such only just very too
    """.split()
)

_LATEX_COMMAND = re.compile(r"^\\[A-Za-z]+$")
_NUMBER_PIECE = re.compile(r"^[\d.,]*\d[\d.,]*$")
_SPECIAL_TOKEN = re.compile(r"^<\|?[^<>\s]+\|?>$")


def token_category(token: str) -> str:
    """The rock category of a decoded token string, by fixed rules applied in this order.

    1. `whitespace`: nothing but spaces, tabs and newlines (`" "`, `"\\n\\n"`).
    2. `digits`: digits, possibly with `.` and `,` separators, after stripping surrounding space (`" 8"`, `"1,2"`).
    3. `punctuation/markup`: no letter and no digit (`","`, `" ="`, `"**"`, `"$"`), a LaTeX command (`"\\frac"`),
       or a special token (`"<|im_end|>"`).
    4. `discourse words`: a word of `DISCOURSE_WORDS`, case-insensitive (`" So"`, `"the"`, `" is"`).
    5. `content`: everything else (`" balls"`, `"total"`, `"'s"`).

    Example:
    ```python
    >>> from hf_rockopd.lab import token_category
    >>> [token_category(t) for t in ["\\n", " 8", " =", "\\\\frac", " So", " apples"]]
    ['whitespace', 'digits', 'punctuation/markup', 'punctuation/markup', 'discourse words', 'content']
    ```
    """
    stripped = token.strip()
    if not stripped:
        return "whitespace"
    if _NUMBER_PIECE.match(stripped):
        return "digits"
    if not any(c.isalnum() for c in stripped) or _LATEX_COMMAND.match(stripped) or _SPECIAL_TOKEN.match(stripped):
        return "punctuation/markup"
    if stripped.lower() in DISCOURSE_WORDS:
        return "discourse words"
    return "content"


def token_label(token: str) -> str:
    """A token string made visible for a table or a plot: control characters escaped, a leading space as `␣`.

    Example:
    ```python
    >>> from hf_rockopd.lab import token_label
    >>> token_label(" So"), token_label("\\n\\n")
    ('␣So', '\\\\n\\\\n')
    ```
    """
    escapes = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
    # Other control characters (byte-fallback tokens) have no glyph: show their code point instead.
    label = "".join(escapes.get(c, c if c.isprintable() else f"\\x{ord(c):02x}") for c in token)
    stripped = label.lstrip(" ")
    return "␣" * (len(label) - len(stripped)) + stripped if stripped else "␣" * len(label)


def category_table(scores: pd.DataFrame, k: int) -> pd.DataFrame:
    """Per category: how many of the top `k` eligible types (rocks) and of the next `k` (controls) fall in it.

    `scores` is `ScoreResult.scores`. Columns: `category`, `rock_types`, `rock_share`, `rock_score_share`,
    `control_types`, `control_share`, `examples` (up to six rock strings).

    Example:
    ```python
    >>> import pandas as pd
    >>> scores = pd.DataFrame({"token": [" So", "\\n", " 7", " apples"], "eligible": [True] * 4, "rank": [1, 2, 3, 4],
    ...                        "rock_score": [4.0, 3.0, 2.0, 1.0]})
    >>> category_table(scores, k=2).set_index("category")["rock_types"].to_dict()["discourse words"]
    1
    ```
    """
    ranked = scores[scores["eligible"]].sort_values("rank")
    rocks, controls = ranked.head(k), ranked.iloc[k : 2 * k]
    rows = []
    for category in ROCK_CATEGORIES:
        in_rocks = rocks[rocks["token"].map(token_category) == category]
        in_controls = controls[controls["token"].map(token_category) == category]
        rows.append(
            {
                "category": category,
                "rock_types": len(in_rocks),
                "rock_share": len(in_rocks) / max(len(rocks), 1),
                "rock_score_share": float(in_rocks["rock_score"].sum() / max(rocks["rock_score"].sum(), 1e-300)),
                "control_types": len(in_controls),
                "control_share": len(in_controls) / max(len(controls), 1),
                "examples": [str(t) for t in in_rocks["token"].head(6)],
            }
        )
    return pd.DataFrame(rows)
