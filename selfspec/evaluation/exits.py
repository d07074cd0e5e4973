"""The per-exit-layer table (`selfspec layers`): `selfspec.agreement.exit_layer_metrics` as Markdown."""

from __future__ import annotations


def format_exit_table(report: dict[int, dict[str, float]], num_layers: int | None = None,
                      baseline: dict[int, dict[str, float]] | None = None) -> str:
    """A Markdown table of `exit_layer_metrics` (with before/after columns when `baseline` is given)."""
    num_layers = num_layers or max(report)
    if baseline is None:
        lines = ["| exit layer | depth | loss | top-1 agreement | expected acceptance |",
                 "|---:|---:|---:|---:|---:|"]
        for layer, m in sorted(report.items()):
            lines.append(f"| {layer} | {layer / num_layers:.0%} | {m['loss']:.3f} "
                         f"| {m['top1_agreement']:.3f} | {m['expected_acceptance']:.3f} |")
    else:
        lines = ["| exit layer | depth | loss before | loss after | top-1 before | top-1 after "
                 "| exp. acc. before | exp. acc. after |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for layer, m in sorted(report.items()):
            b = baseline.get(layer)
            if b is None:
                continue
            lines.append(f"| {layer} | {layer / num_layers:.0%} | {b['loss']:.3f} | {m['loss']:.3f} "
                         f"| {b['top1_agreement']:.3f} | {m['top1_agreement']:.3f} "
                         f"| {b['expected_acceptance']:.3f} | {m['expected_acceptance']:.3f} |")
    return "\n".join(lines)
