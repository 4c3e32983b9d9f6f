"""Presenting an evaluation (``classify.evaluate``): terminal summary, report.md and PNG plots.

Everything here reads the ``metrics`` dict that also goes to metrics.json, so the three
views cannot disagree. Plots need matplotlib (``pip install classify[plots]``); without it
the report says so and is written without them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from .engine.files import atomic_path, write_text

ROWS = [  # (key in a system's metrics, label); accuracy is shown with its CI separately
    ("precision_macro", "macro precision"), ("recall_macro", "macro recall"), ("f1_macro", "macro F1"),
    ("roc_auc", "ROC-AUC"), ("log_loss", "log-loss"), ("ece", "ECE"),
]


def _accuracy(metrics: dict[str, Any]) -> str:
    lo, hi = metrics["accuracy_ci95"]
    return f"{metrics['accuracy']:.4f} ({lo:.4f}-{hi:.4f})"


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


# ------------------------------------------------------------------------- terminal
def print_summary(console: Console, metrics: dict[str, Any]) -> None:
    systems = metrics["systems"]
    table = Table(title=Text(f"{metrics['model']} on {metrics['data']} ({metrics['split']} split), "
                             f"{metrics['examples']} reviews"))
    table.add_column("metric")
    for name in systems:
        table.add_column(name, justify="right")
    table.add_row("accuracy (95% CI)", *(_accuracy(m) for m in systems.values()))
    for key, label in ROWS:
        table.add_row(label, *(_number(m[key]) for m in systems.values()))
    for name in metrics["labels"]:
        table.add_row(f"F1 {escape(name)}", *(_number(m["per_class"][name]["f1"]) for m in systems.values()))
    console.print(table)
    for kind, baseline in metrics.get("baselines", {}).items():
        lo, hi = baseline["difference_ci95"]
        console.print(f"model - {kind} accuracy: {baseline['model_minus_baseline']:+.4f} "
                      f"(95% CI {lo:+.4f} to {hi:+.4f})")
    names = list(metrics["behaviour"]["systems"])
    table = Table(title=Text(f"Short texts: accuracy by length, behavioural failure rates "
                             f"({metrics['behaviour']['cases']} sentences)"))
    table.add_column("")
    for name in names:
        table.add_column(name, justify="right")
    for row, cells in _short_text_rows(metrics):
        table.add_row(row, *cells)
    console.print(table)


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _short_text_rows(metrics: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """The rows that say how the systems read short texts: accuracy by length, then the behavioural suite's failure
    rates (overall and per capability), then the held-out counterfactual revisions; one cell per system of the
    behavioural suite (``systems`` of metrics["behaviour"])."""
    behaviour = metrics["behaviour"]["systems"]
    names = list(behaviour)
    rows = [(f"accuracy, {s['tokens']} tokens ({s['examples']})", [_percent(s["accuracy"].get(n)) for n in names])
            for s in metrics["length_slices"]]
    rows.append(("behaviour: failures, all", [_percent(behaviour[n]["failure_rate"]["all"]) for n in names]))
    for capability, first in behaviour[names[0]]["capabilities"].items():
        rows.append((f"  {capability} ({first['kind']}, {first['cases']})",
                     [_percent(behaviour[n]["capabilities"][capability]["failure_rate"]) for n in names]))
    if "counterfactual" in metrics:
        c = metrics["counterfactual"]
        for key in ("original", "revised", "both"):
            rows.append((f"counterfactual {key}, accuracy ({c['pairs']} pairs)",
                         [_percent(c["systems"][n][key]) for n in names]))
    return rows


# ------------------------------------------------------------------------- markdown
_MD_INLINE = re.compile(r"([\\`*_\[\]<>&|~])")
_MD_BLOCK_START = re.compile(r"^(\d*)([#+\-=>]|(?<=\d)[.)])")  # heading, list, quote, "1." markers


def md(text: str) -> str:
    """Plain text safe inside a markdown paragraph or table cell: no markup, HTML or entities survive
    (CommonMark backslash escapes)."""
    return _MD_BLOCK_START.sub(r"\1\\\2", _MD_INLINE.sub(r"\\\1", text))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows), ""]


def write_markdown(path: Path, metrics: dict[str, Any]) -> None:
    systems, labels = metrics["systems"], metrics["labels"]
    names = list(systems)
    lines = [f"# Evaluation of {md(Path(metrics['model']).name)}", "",
             f"Model `{metrics['model']}`, data `{metrics['data']}` split `{metrics['split']}`: "
             f"{metrics['examples']} reviews" + (f" (a seeded sample, --limit {metrics['limit']})"
                                                 if metrics.get("limit") else "") + ".", ""]
    for kind, baseline in metrics.get("baselines", {}).items():
        lines += [f"Baseline {kind}: {baseline['description']} ({baseline['training_examples']} reviews).", ""]
    lines += ["## Metrics", ""]
    rows = [["accuracy (95% bootstrap CI)", *(_accuracy(m) for m in systems.values())]]
    rows += [[label, *(_number(m[key]) for m in systems.values())] for key, label in ROWS]
    lines += _table(["metric", *names], rows)
    for kind, baseline in metrics.get("baselines", {}).items():
        lo, hi = baseline["difference_ci95"]
        lines += [f"Accuracy difference, model - {kind}: {baseline['model_minus_baseline']:+.4f} "
                  f"(paired bootstrap 95% CI {lo:+.4f} to {hi:+.4f}).", ""]
    lines += [f"ECE: top-label expected calibration error over {metrics['bins']} equal-width confidence bins. "
              f"CIs: {metrics['bootstrap_resamples']} bootstrap resamples, seed {metrics['seed']}.", ""]

    lines += ["## Short texts, negation and edits", "",
              "Accuracy by length in the tokens the model reads (512+: truncated); failure rates of the behavioural "
              "suite (`classify.behaviour`: mft = a labelled sentence answered wrong, inv = an answer changed by a "
              "perturbation that should not change it); with `--counterfactual`, accuracy on the held-out edited "
              "reviews whose label flipped (`classify.text.counterfactual`).", ""]
    lines += _table(["", *metrics["behaviour"]["systems"]], [[md(r), *cells] for r, cells in _short_text_rows(metrics)])
    for name, system in metrics["behaviour"]["systems"].items():
        failing = [(c, e) for c, s in system["capabilities"].items() for e in s["examples"][:1]]
        if failing:
            lines += [f"Failing cases, {md(name)} (one per capability):", ""]
            lines += [f"- {md(c)}: " + md(e["text"] + (f" / {e['perturbed']}" if "perturbed" in e else "")
                                          + f" -> {metrics['labels'][e['predicted']]}") for c, e in failing] + [""]

    lines += ["## Per class", ""]
    lines += _table(["system", "class", "precision", "recall", "F1", "support"],
                    [[name, md(label), *(f"{m['per_class'][label][k]:.4f}" for k in ("precision", "recall", "f1")),
                      str(m["per_class"][label]["support"])] for name, m in systems.items() for label in labels])

    lines += ["## Confusion matrices", "", "Rows: true class; columns: predicted class.", ""]
    for name, m in systems.items():
        lines += [f"**{name}**", ""]
        lines += _table(["true \\\\ predicted", *map(md, labels)],
                        [[md(label), *map(str, row)] for label, row in zip(labels, m["confusion_matrix"])])

    if any(m["reliability"] for m in systems.values()):
        lines += ["## Calibration", "", "Reliability curve (scikit-learn `calibration_curve`): mean predicted "
                  "probability of the positive class against the fraction of positives, per non-empty bin.", ""]
        for name, m in systems.items():
            if m["reliability"]:
                r = m["reliability"]
                lines += [f"**{name}** (P({md(r['class'])}))", ""]
                lines += _table(["mean predicted", "fraction positive"],
                                [[f"{a:.3f}", f"{b:.3f}"] for a, b in zip(r["mean_predicted"], r["fraction_positive"])])

    if metrics["training"]:
        t = metrics["training"]
        lines += ["## Training", "", f"{t['evaluations']} validations up to step {t['last_step']}; best validation "
                  f"accuracy {t['best_val_accuracy']:.4f} at step {t['best_step']}.", ""]

    lines += ["## Plots", ""]
    if metrics["plots"]:
        lines += [f"![{Path(p).stem.replace('_', ' ')}]({p})" for p in metrics["plots"]] + [""]
    else:
        lines += ["No plots (matplotlib is not installed: `pip install classify[plots]`).", ""]

    for title, mistakes in (("model", metrics["mistakes"]), *metrics.get("baseline_mistakes", {}).items()):
        lines += [f"## Most confident mistakes ({title})", ""]
        if not mistakes:
            lines += ["None.", ""]
        for n, m in enumerate(mistakes, 1):
            lines += [f"{n}. row {m['row']}: true **{md(m['label'])}**, predicted **{md(m['predicted'])}** "
                      f"with p = {m['probability']:.4f}", "", f"   > {md(m['text'])}", ""]
    write_text(path, "\n".join(lines))


# ---------------------------------------------------------------------------- plots
def write_plots(folder: Path, y: np.ndarray, probabilities: dict[str, np.ndarray], metrics: dict[str, Any],
                history: list[dict[str, Any]], console: Console) -> list[str]:
    """Confusion matrices, ROC curves, reliability diagram, training curves: PNGs in ``folder``.
    Returns their file names (empty without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        console.print("[yellow]note:[/] matplotlib is not installed: no plots (pip install classify[plots])")
        return []
    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt
    from sklearn.metrics import ConfusionMatrixDisplay, RocCurveDisplay

    labels, systems = metrics["labels"], metrics["systems"]
    written: list[str] = []

    def save(fig, name: str) -> None:
        with atomic_path(folder / name) as tmp:
            fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(name)

    fig, axes = plt.subplots(1, len(systems), figsize=(4.2 * len(systems), 3.8), squeeze=False)
    for ax, (name, m) in zip(axes[0], systems.items()):
        ConfusionMatrixDisplay(np.asarray(m["confusion_matrix"]), display_labels=labels).plot(
            ax=ax, colorbar=False, cmap="Blues", values_format="d")
        ax.set_title(name)
    save(fig, "confusion_matrix.png")

    if all(m["roc_auc"] is not None for m in systems.values()):
        fig, ax = plt.subplots(figsize=(4.8, 4.4))
        for name, probs in probabilities.items():
            RocCurveDisplay.from_predictions(y, probs[:, 1], name=name, ax=ax)
        ax.plot([0, 1], [0, 1], ls=":", color="grey")
        ax.set_title(f"ROC ({labels[1]} = positive class)")
        save(fig, "roc_curve.png")

    if any(m["reliability"] for m in systems.values()):
        fig, ax = plt.subplots(figsize=(4.8, 4.4))
        ax.plot([0, 1], [0, 1], ls=":", color="grey", label="perfectly calibrated")
        for name, m in systems.items():
            if m["reliability"]:
                r = m["reliability"]
                ax.plot(r["mean_predicted"], r["fraction_positive"], marker="o", label=f"{name} (ECE {m['ece']:.3f})")
        ax.set_xlabel(f"mean predicted P({labels[1]})")
        ax.set_ylabel(f"fraction {labels[1]}")
        ax.set_title("Reliability diagram")
        ax.legend(loc="upper left")
        save(fig, "reliability.png")

    valid = [r for r in history if "val_accuracy" in r]
    if valid:
        steps = [r["step"] for r in valid]
        fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(9.5, 3.6))
        for key, ax in (("loss", loss_ax), ("accuracy", acc_ax)):
            for split in ("train", "val"):
                values = [r.get(f"{split}_{key}") for r in valid]
                if all(v is not None for v in values):
                    ax.plot(steps, values, marker=".", label=split)
            ax.set_xlabel("step")
            ax.set_title(key)
            ax.legend()
        save(fig, "training_curves.png")
    return written
