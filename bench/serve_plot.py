"""The benchmark's picture: output tokens/s and median TTFT against concurrent clients, one line per server."""
import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.ticker import ScalarFormatter  # noqa: E402

from .serve_metrics import RunMetrics  # noqa: E402


def plot_sweeps(sweeps: dict[str, list[tuple[int, RunMetrics]]], path: str, subtitle: str = "") -> None:
    """`sweeps`: {server label: [(clients, metrics), ...]}; writes a PNG of two panels side by side."""
    figure, (throughput_axes, ttft_axes) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    for label, points in sweeps.items():
        points = sorted(points, key=lambda point: point[0])
        clients = [c for c, _ in points]
        throughput_axes.plot(clients, [m.output_throughput for _, m in points], marker="o", label=label)
        ttft = [(c, m.ttft.median_ms) for c, m in points if m.ttft is not None]
        if ttft:
            ttft_axes.plot([c for c, _ in ttft], [t for _, t in ttft], marker="o", label=label)
    throughput_axes.set(title="Output tokens/s (higher is better)", xlabel="concurrent clients", ylabel="tokens/s")
    ttft_axes.set(title="Median time to first token (lower is better)", xlabel="concurrent clients",
                  ylabel="ms (log scale)", yscale="log")
    throughput_axes.set_ylim(bottom=0)
    ttft_axes.yaxis.set_major_formatter(ScalarFormatter())
    for axes in (throughput_axes, ttft_axes):
        axes.grid(True, alpha=0.3)
        axes.set_xticks(sorted({c for points in sweeps.values() for c, _ in points}))
    throughput_axes.legend(fontsize="small")
    if subtitle:
        figure.suptitle(subtitle)
    figure.savefig(path, dpi=110)
    plt.close(figure)
