"""After-the-fact report of a run: per-communicator lateness heatmaps with the isolated
components marked, and the isolation timeline, as one self-contained HTML page."""

from sinks.report.html import LoopStep, write_report
from sinks.report.lateness import LatenessMap, lateness_maps

__all__ = ["LatenessMap", "LoopStep", "lateness_maps", "write_report"]
