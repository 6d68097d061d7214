"""The rock-token report: one Markdown and one HTML page with PNG figures, built from the lab's plain files.

`build_report` scores a token table (or takes a `ScoreResult`), and writes into one directory:

- `report.md` and `report.html`: the same content: a headline table (corpus size, observed types, K, the share of
  generated tokens that are rocks, the divergence they carry, the top rocks) beside the paper's figures, the rock
  categories, the gradient geometry, and, when given, the early-vs-late comparison and the knockout verdicts;
- `report.json`: the headline numbers, for scripts;
- `figures/*.png`: frequency vs mean divergence (rocks highlighted, log x), the divergence histogram (rocks vs
  others), rock categories, gradient geometry, early-vs-late scatter and the knockout forest plot.

Figures use matplotlib's object API (`matplotlib.figure.Figure`), so building a report never changes the pyplot
backend of the calling program.

Example:
```python
from hf_rockopd.lab import build_report, load_token_table

report = build_report(load_token_table("tables/early"), "report/", top_k=100, knockout="knockout.csv")
print(report.markdown_path, report.headline["rock_token_share"])
```
"""

from __future__ import annotations

import html
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from transformers.utils import logging

from .categories import category_table, token_category, token_label
from .figures import (
    figure_categories,
    figure_early_late,
    figure_frequency,
    figure_gradients,
    figure_histogram,
    figure_knockout,
)
from .gradients import gradient_geometry
from .selection import (
    ScoreResult,
    compare_token_tables,
    comparison_groups,
    score_token_table,
)
from .table import TokenTable, load_token_table


logger = logging.get_logger(__name__)

__all__ = ["ReportResult", "build_report"]



@dataclass
class ReportResult:
    """The files `build_report` wrote and the headline numbers it put in them.

    Attributes:
        markdown_path: `report.md`.
        html_path: `report.html` (same content).
        json_path: `report.json` (the headline numbers).
        figures: PNG paths, in the order the report shows them.
        headline: the headline numbers (see `build_report`).
    """

    markdown_path: str
    html_path: str
    json_path: str
    figures: list[str] = field(default_factory=list)
    headline: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------------------------
# Report content: a list of blocks rendered twice, to Markdown and to HTML
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class _Table:
    header: list[str]
    rows: list[list[str]]


@dataclass
class _Figure:
    path: str  # relative to the report directory
    caption: str


def _markdown_cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def _render_markdown(blocks: Sequence[Any]) -> str:
    lines: list[str] = []
    for block in blocks:
        if isinstance(block, tuple):  # (level, heading)
            lines += ["#" * block[0] + " " + block[1], ""]
        elif isinstance(block, _Table):
            lines.append("| " + " | ".join(_markdown_cell(h) for h in block.header) + " |")
            lines.append("|" + "---|" * len(block.header))
            lines += ["| " + " | ".join(_markdown_cell(c) for c in row) + " |" for row in block.rows]
            lines.append("")
        elif isinstance(block, _Figure):
            lines += [f"![{block.caption}]({block.path})", "", f"*{block.caption}*", ""]
        else:
            lines += [str(block), ""]
    return "\n".join(lines)


def _inline_html(text: str) -> str:
    # The Markdown the report itself writes uses only `code` and **bold**; render those two, escape the rest.
    parts = re.split(r"(`[^`]*`)", str(text))
    out = []
    for part in parts:
        if part.startswith("`") and part.endswith("`") and len(part) >= 2:
            out.append(f"<code>{html.escape(part[1:-1])}</code>")
        else:
            out.append(re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", html.escape(part)))
    return "".join(out)


def _render_html(blocks: Sequence[Any], title: str) -> str:
    body: list[str] = []
    for block in blocks:
        if isinstance(block, tuple):
            body.append(f"<h{block[0]}>{_inline_html(block[1])}</h{block[0]}>")
        elif isinstance(block, _Table):
            head = "".join(f"<th>{_inline_html(h)}</th>" for h in block.header)
            rows = "".join("<tr>" + "".join(f"<td>{_inline_html(c)}</td>" for c in row) + "</tr>" for row in block.rows)
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif isinstance(block, _Figure):
            body.append(
                f'<figure><img src="{html.escape(block.path)}" alt="{html.escape(block.caption)}">'
                f"<figcaption>{_inline_html(block.caption)}</figcaption></figure>"
            )
        else:
            body.append(f"<p>{_inline_html(block)}</p>")
    style = (
        "body{font-family:sans-serif;max-width:60em;margin:2em auto;line-height:1.4}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left}"
        "img{max-width:100%}code{background:#f4f4f4}"
    )
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{style}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _code(token: str) -> str:
    label = token_label(token)
    return f"`{label}`" if "`" not in label else label


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _num(x: float, digits: int = 3) -> str:
    return "—" if x is None or (isinstance(x, float) and not np.isfinite(x)) else f"{x:.{digits}g}"


# ---------------------------------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------------------------------

_KNOCKOUT_COLUMNS = ("token_id", "token", "accuracy", "delta", "ci_low", "ci_high", "p_value", "q_value", "verdict")


def _load_knockout(knockout: pd.DataFrame | str | os.PathLike) -> pd.DataFrame:
    frame = knockout.copy() if isinstance(knockout, pd.DataFrame) else pd.read_csv(knockout, keep_default_na=False)
    missing = [c for c in _KNOCKOUT_COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(
            f"Knockout results lack columns {missing}; give the CSV written by `hf-rockopd analyze knockout --out`."
        )
    if len(frame) == 0:
        raise ValueError("Knockout results are empty; run `hf-rockopd analyze knockout` on at least one token.")
    frame["token"] = frame["token"].astype(str)
    return frame


def build_report(
    table: TokenTable | str | os.PathLike,
    output_dir: str | os.PathLike,
    score: ScoreResult | None = None,
    top_k: int | None = 100,
    coverage: float | None = None,
    min_count: int = 2,
    exclude_top_frequent: int = 5,
    late_table: TokenTable | str | os.PathLike | None = None,
    knockout: pd.DataFrame | str | os.PathLike | None = None,
    top_n: int = 20,
    seed: int = 0,
    title: str = "Rock-token report",
    notes: Sequence[str] = (),
) -> ReportResult:
    """Write `report.md`, `report.html`, `report.json` and `figures/*.png` into `output_dir`.

    The rocks are `score` if given, else `score_token_table(table, top_k, min_count, exclude_top_frequent, coverage)`;
    the headline numbers are exactly that result's. Sections: headline (with the paper's figures beside ours), top
    rocks, categories (`token_category`, with the next K eligible types as a content control, as the paper's ranks
    101-200), frequency and divergence figures, gradient geometry (when the table has `logit_grad_norm`; the cosine
    with G_balanced when it has `grad_cosine`), early vs late (when `late_table` is given, tested by
    `compare_token_tables`) and knockout (when `knockout`, a `knockout` frame or its CSV, is given).

    `report.json`'s headline keys: `prompts`, `generated_tokens`, `observed_types`, `eligible_types`, `k`,
    `rock_token_share`, `divergence_coverage`, `vocabulary_share` (K / observed types), `mean_divergence_rocks`,
    `mean_divergence_others`, `top_rocks` (strings), and `baseline_accuracy` with a knockout.

    Raises `ValueError` for a `late_table` from another tokenizer, knockout results without the knockout columns, and
    every selection error of `score_token_table`.

    Example:
    ```python
    report = build_report("tables/early", "report/", top_k=100, late_table="tables/late", knockout="knockout.csv")
    ```
    """
    if top_n < 1:
        raise ValueError(f"top_n must be >= 1, got {top_n}.")
    table = table if isinstance(table, TokenTable) else load_token_table(table)
    if score is None:
        score = score_token_table(table, top_k=top_k, min_count=min_count,
                                  exclude_top_frequent=exclude_top_frequent, coverage=coverage)
    late = None
    if late_table is not None:
        late = late_table if isinstance(late_table, TokenTable) else load_token_table(late_table)
    knockout_frame = _load_knockout(knockout) if knockout is not None else None

    output_dir = os.fspath(output_dir)
    figure_dir = os.path.join(output_dir, "figures")
    os.makedirs(figure_dir, exist_ok=True)
    figures: list[str] = []
    blocks: list[Any] = [(1, title)]

    def figure(name: str, caption: str, draw) -> None:
        path = os.path.join(figure_dir, name)
        draw(path)
        figures.append(path)
        blocks.append(_Figure(f"figures/{name}", caption))

    frame, scores, k = table.frame, score.scores, len(score.rock_ids)
    counts = table.counts()
    is_rock = np.isin(frame["token_id"].to_numpy(), score.rock_ids)
    rocks = scores[scores["is_rock"]].sort_values("rank")
    headline = {
        "prompts": int(frame["prompt_index"].nunique()),
        "generated_tokens": int(counts.sum()),
        "observed_types": int(score.settings["observed_types"]),
        "eligible_types": int(score.settings["eligible_types"]),
        "k": k,
        "rock_token_share": float(score.rock_token_share),
        "divergence_coverage": float(score.divergence_coverage),
        "vocabulary_share": k / max(int(score.settings["observed_types"]), 1),
        "mean_divergence_rocks": float(frame["divergence"][is_rock].mean()) if is_rock.any() else float("nan"),
        "mean_divergence_others": float(frame["divergence"][~is_rock].mean()) if (~is_rock).any() else float("nan"),
        "top_rocks": [str(t) for t in rocks["token"].head(top_n)],
        "selection": dict(score.settings),
        "tokenizer": score.tokenizer,
    }

    blocks.append(
        f"Corpus: {table.source}, {headline['generated_tokens']:,} generated tokens from {headline['prompts']} "
        f"prompts (divergence: `beta={table.meta.get('beta', '?')}`, temperature {table.meta.get('temperature', '?')}, "
        f"{'sampled' if table.meta.get('do_sample') else 'greedy'} rollouts). Selection: types seen fewer than "
        f"{score.settings['min_count']} times and the {score.settings['exclude_top_frequent']} most frequent types "
        f"are ineligible; "
        + (f"K is the smallest reaching {score.settings['coverage']:.0%} of the divergence."
           if score.settings.get("coverage") is not None else f"the top K = {k} by Rock Score are rocks.")
    )
    blocks += list(notes)
    blocks.append((2, "Headline"))
    blocks.append(
        _Table(
            ["measure", "this corpus", "paper (arXiv 2605.09253, 500 MATH-500 prompts)"],
            [
                ["corpus size", f"{headline['generated_tokens']:,} tokens, {headline['prompts']} prompts", "500 prompts"],
                ["observed types", f"{headline['observed_types']:,}", "—"],
                ["eligible types", f"{headline['eligible_types']:,}", "—"],
                ["K (rock types)", str(k), "100"],
                ["K / observed types", _pct(headline["vocabulary_share"]), "≈ 2.5 %"],
                ["share of generated tokens that are rocks", _pct(headline["rock_token_share"]), "up to 18 %"],
                ["share of the divergence carried by rocks", _pct(headline["divergence_coverage"]), "≈ 60 %"],
                ["mean divergence: rocks / others",
                 f"{_num(headline['mean_divergence_rocks'])} / {_num(headline['mean_divergence_others'])}", "—"],
                ["top rocks", " ".join(_code(t) for t in headline["top_rocks"][:12]),
                 "markup, whitespace, discourse words, digits"],
            ],
        )
    )

    blocks.append((2, f"Top {min(top_n, k)} rocks"))
    blocks.append(
        _Table(
            ["rank", "token", "id", "category", "count", "mean divergence", "R(v)"],
            [
                [str(int(r["rank"])), _code(r["token"]), str(int(r["token_id"])), token_category(r["token"]),
                 str(int(r["count"])), f"{r['mean_divergence']:.3f}", f"{r['rock_score']:.2f}"]
                for _, r in rocks.head(top_n).iterrows()
            ],
        )
    )

    categories = category_table(scores, k)
    blocks.append((2, "Rock categories"))
    blocks.append(
        "Rule-based on the decoded string (`hf_rockopd.lab.token_category`): whitespace; digits; "
        "punctuation/markup (no letter or digit, a LaTeX command or a special token); discourse words (a fixed list "
        "of discourse markers and function words); content (the rest). Controls: the next "
        f"{int(categories['control_types'].sum())} eligible types by Rock Score (ranks {k + 1}-{2 * k})."
    )
    blocks.append(
        _Table(
            ["category", "rock types", "share of rock types", "share of rock R(v)", "control types", "examples"],
            [
                [r["category"], str(r["rock_types"]), _pct(r["rock_share"]), _pct(r["rock_score_share"]),
                 str(r["control_types"]), " ".join(_code(t) for t in r["examples"])]
                for _, r in categories.iterrows()
            ],
        )
    )
    figure("categories.png", "Rock categories: share of the rock types vs the next-ranked types", lambda p:
           figure_categories(categories, p))

    blocks.append((2, "Frequency and divergence"))
    figure("frequency_divergence.png", "Occurrences (log) vs mean divergence per type; rocks in red",
           lambda p: figure_frequency(scores, p))
    figure("divergence_histogram.png", "Per-occurrence divergence, rocks vs the other tokens",
           lambda p: figure_histogram(frame, score.rock_ids, p))

    if "logit_grad_norm" in frame.columns:
        geometry = gradient_geometry(table, score.rock_ids, seed=seed)
        groups = comparison_groups(table, score.rock_ids, None, seed)
        headline["gradient_geometry"] = geometry.to_dict(orient="records")
        blocks.append((2, "Gradient geometry"))
        blocks.append(
            "Per-occurrence logit gradient of the divergence (closed form); groups: rocks, the same number of rare "
            "high-divergence types, and a random control matched to the rocks' frequency bins. p-values: two-sided "
            "Mann-Whitney U against the rocks. Paper: median norm ≈ 0.016 (rocks) vs ≈ 0.54 (rare); median cosine "
            "with G_balanced ≈ 0.040 (rocks), 0.025 (rare), 0.006 (random)."
        )
        header = ["group", "occurrences", "median norm", "p (norm) vs rocks"]
        has_cosine = "median_cosine" in geometry.columns
        if has_cosine:
            header += ["median cosine", "p (cosine) vs rocks"]
        rows = []
        for _, r in geometry.iterrows():
            row = [str(r["group"]), str(int(r["occurrences"])), _num(r["median_grad_norm"]), _num(r["p_value_vs_rock"])]
            if has_cosine:
                row += [_num(r["median_cosine"]), _num(r["p_value_cosine_vs_rock"])]
            rows.append(row)
        blocks.append(_Table(header, rows))
        figure("gradient_geometry.png", "Per-occurrence gradient geometry by group (boxes without outliers)",
               lambda p: figure_gradients(table, groups, p))

    if late is not None:
        comparison = compare_token_tables(table, late, score.rock_ids, seed=seed)
        headline["comparison"] = comparison.to_dict(orient="records")
        blocks.append((2, "Early vs late"))
        blocks.append(
            f"Second table: {late.source}. Per-type mean divergence of the types seen in both tables; groups defined on "
            "the first table; two-sided Wilcoxon signed-rank test per group. Paper: rocks 0.21 → 0.19 (no change), "
            "rare high-divergence types 2.02 → 0.85."
        )
        blocks.append(
            _Table(
                ["group", "types", "median first", "median second", "median shift", "p"],
                [[str(r["group"]), str(int(r["types"])), _num(r["median_early"]), _num(r["median_late"]),
                  _num(r["median_shift"]), _num(r["p_value"])] for _, r in comparison.iterrows()],
            )
        )
        groups = comparison_groups(table, score.rock_ids, None, seed)
        figure("early_late.png", "Per-type mean divergence in the two tables (diagonal: no change)",
               lambda p: figure_early_late(table, late, groups, p))

    if knockout_frame is not None:
        # Every row's accuracy minus its change is the unbanned accuracy, so the CSV alone gives the baseline.
        baselines = (knockout_frame["accuracy"] - knockout_frame["delta"]).to_numpy(np.float64)
        baseline = float(np.round(np.median(baselines), 6))
        headline["baseline_accuracy"] = baseline
        verdicts = knockout_frame["verdict"].value_counts()
        headline["verdicts"] = {v: int(verdicts.get(v, 0)) for v in ("Pillar", "Neutral", "Stumbling")}
        blocks.append((2, "Knockout"))
        blocks.append(
            f"Each token banned at inference (logit −inf at every greedy step); unbanned accuracy **{baseline:.3f}**. "
            "Paired bootstrap (95 % interval), Benjamini-Hochberg q-values; Pillar: Δ ≤ −0.01 and q < 0.05, "
            "Stumbling: Δ ≥ +0.01 and q < 0.05, else Neutral. Verdicts: "
            + ", ".join(f"{v} {n}" for v, n in headline["verdicts"].items())
            + ". Paper: 96.5 % Neutral."
        )
        if baseline < 0.05:
            blocks.append(
                "**The unbanned accuracy is below 5 %: a ban can hardly lower it, so these verdicts say little.**"
            )
        blocks.append(
            _Table(
                ["token", "id", "accuracy", "Δ", "95 % interval", "p", "q", "verdict"],
                [[_code(r["token"]), str(int(r["token_id"])), f"{r['accuracy']:.3f}", f"{r['delta']:+.3f}",
                  f"[{r['ci_low']:+.3f}, {r['ci_high']:+.3f}]", _num(r["p_value"]), _num(r["q_value"]),
                  str(r["verdict"])] for _, r in knockout_frame.iterrows()],
            )
        )
        figure("knockout.png", "Accuracy change per banned token", lambda p: figure_knockout(knockout_frame, p))

    markdown_path = os.path.join(output_dir, "report.md")
    html_path = os.path.join(output_dir, "report.html")
    json_path = os.path.join(output_dir, "report.json")
    with open(markdown_path, "w", encoding="utf-8") as f:
        f.write(_render_markdown(blocks))
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(_render_html(blocks, title))
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(_finite_or_none(headline), f, indent=2, ensure_ascii=False, allow_nan=False, default=_json_default)
    logger.info("wrote %s, %s and %d figures", markdown_path, html_path, len(figures))
    return ReportResult(markdown_path, html_path, json_path, figures, headline)


def _finite_or_none(value: Any) -> Any:
    """NaN (a test not run, e.g. a group against itself) becomes `null`, so `report.json` is strict JSON."""
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite_or_none(v) for v in value]
    if isinstance(value, (float, np.floating)) and not np.isfinite(value):
        return None
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")
