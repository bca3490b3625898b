"""End-of-run plots from the files components wrote: ``reward.png``, ``throughput.png`` and,
for ``env`` workflows, ``success.png`` (training and held-out episode success).

Time is measured from the first trainer step of the run (RL start), so curves of different
runs line up. Uses matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from astraflow.launch.status import JsonlTail

__all__ = ["write_plots"]


def write_plots(run_dir: Path) -> list[Path]:
    """Write ``reward.png`` and ``throughput.png`` into ``run_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = {
        p.parent.name: JsonlTail(p).read() for p in sorted(run_dir.glob("trainers/*/metrics.jsonl"))
    }
    evals = {p.stem: JsonlTail(p).read() for p in sorted(run_dir.glob("eval/*.jsonl"))}
    starts = [r[0]["time"] for r in metrics.values() if r and "time" in r[0]]
    starts += [r[0]["created_at"] for r in evals.values() if r and r[0].get("created_at")]
    t0 = min(starts) if starts else 0.0

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for policy, recs in metrics.items():
        xs = [r["time"] - t0 for r in recs if r.get("reward_mean") is not None]
        ys = [r["reward_mean"] for r in recs if r.get("reward_mean") is not None]
        ax1.plot(xs, _smooth(ys), label=f"{policy} (sampled, smoothed)")
    ax1.set(xlabel="seconds since RL start", ylabel="mean reward", title="training reward")
    for policy, recs in evals.items():
        for key, label in _eval_series(recs).items():
            rows = [r for r in recs if r.get("created_at") and r.get(key) is not None]
            xs = [r["created_at"] - t0 for r in rows]
            ax2.plot(xs, [r[key] for r in rows], marker=".", label=f"{policy} {label}")
    ax2.set(xlabel="seconds since RL start (version published)", ylabel="accuracy / avg@k / pass@k",
            title="held-out evaluation", ylim=(0, 1.02))  # fmt: skip
    reward_png = _save(plt, fig, run_dir / "reward.png")

    reports = JsonlTail(run_dir / "report.jsonl").read()
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4))
    _timeline(ax3, metrics, t0)
    if reports:
        r0 = reports[0]["time"]
        xs = [r["time"] - r0 for r in reports]
        pools = sorted({p for r in reports for p in r.get("pools", {})})
        for pool in pools:
            ys = [r.get("pools", {}).get(pool, {}).get("samples_per_s", 0.0) for r in reports]
            ax1.plot(xs, ys, label=f"pool {pool} produced")
        trainers = sorted({t for r in reports for t in r.get("trainers", {})})
        for t in trainers:
            ys = [r.get("trainers", {}).get(t, {}).get("samples_per_s", 0.0) for r in reports]
            ax1.plot(xs, ys, linestyle="--", label=f"{t} consumed")
            ws = [r.get("trainers", {}).get(t, {}).get("waiting_fraction", 0.0) for r in reports]
            ax2.plot(xs, ws, label=t)
    ax1.set(xlabel="seconds", ylabel="samples/s", title="throughput (report window)")
    ax2.set(xlabel="seconds", ylabel="fraction", title="trainer time waiting for batches",
            ylim=(0, 1.02))  # fmt: skip
    throughput_png = _save(plt, fig, run_dir / "throughput.png")
    written = [reward_png, throughput_png]
    success_png = _success_plot(plt, run_dir / "success.png", metrics, evals, t0)
    if success_png is not None:
        written.append(success_png)
    return written


def _success_plot(
    plt: Any,
    path: Path,
    metrics: dict[str, list[dict[str, Any]]],
    evals: dict[str, list[dict[str, Any]]],
    t0: float,
) -> Path | None:
    """Episode success of ``env`` workflows: sampled (trainer batches) and held-out (eval)."""
    if not any(r.get("env/success") is not None for recs in metrics.values() for r in recs):
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, recs in metrics.items():
        rows = [r for r in recs if r.get("env/success") is not None]
        ys = [r["env/success"] for r in rows]
        ax.plot([r["time"] - t0 for r in rows], _smooth(ys), label=f"{policy} (training episodes)")
    for policy, recs in evals.items():
        rows = [r for r in recs if r.get("created_at") and "turns" in r]
        ax.plot([r["created_at"] - t0 for r in rows], [r["accuracy"] for r in rows],
                marker=".", label=f"{policy} (held-out episodes)")  # fmt: skip
    ax.set(xlabel="seconds since RL start", ylabel="success rate", title="episode success",
           ylim=(0, 1.02))  # fmt: skip
    return _save(plt, fig, path)


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Grid and legend (where something is labelled) on every axis; write ``path``; close."""
    for ax in fig.axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _eval_series(recs: list[dict[str, Any]]) -> dict[str, str]:
    """Record keys to plot, with their labels: per held-out set (``<set>/`` prefix) greedy
    accuracy, avg@k and the largest pass@k."""
    keys = {k for r in recs for k in r}
    out: dict[str, str] = {}
    for prefix in sorted({k.rsplit("/", 1)[0] + "/" if "/" in k else "" for k in keys}):
        names = {k.removeprefix(prefix) for k in keys if k.startswith(prefix)}
        names = {n for n in names if "/" not in n}
        where = f" {prefix.rstrip('/')}" if prefix else ""
        if "accuracy" in names:
            out[f"{prefix}accuracy"] = f"greedy{where}"
        for metric in ("avg@", "pass@"):
            ks = [
                int(n[len(metric) :])
                for n in names
                if n.startswith(metric) and n[len(metric) :].isdigit()
            ]
            if ks:
                out[f"{prefix}{metric}{max(ks)}"] = f"{metric}{max(ks)}{where}"
    return out


#: The trainer step's phases (metrics.jsonl keys): on the critical path, then in the background.
PHASES = (
    ("wait_s", "wait for batch"),
    ("compute_s", "compute"),
    ("publish_s", "publish (blocking)"),
    ("publish_write_s", "write (background)"),
    ("announce_s", "announce (background)"),
)


def _timeline(ax: Any, metrics: dict[str, list[dict[str, Any]]], t0: float) -> None:
    """Per-step seconds of each phase of every trainer (smoothed over 20 steps)."""
    for policy, recs in metrics.items():
        for key, label in PHASES:
            rows = [r for r in recs if r.get(key) is not None]
            if rows:
                xs = [r["time"] - t0 for r in rows]
                ax.plot(xs, _smooth([1000.0 * r[key] for r in rows]), label=f"{policy} {label}")
    ax.set(xlabel="seconds since RL start", ylabel="ms per step", title="trainer step timeline")


def _smooth(ys: list[float], window: int = 20) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out
