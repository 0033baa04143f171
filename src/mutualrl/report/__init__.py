"""The compare report: runs' metrics in; PNG plots, ``report.md`` and ``report.json`` out.

``data`` turns finished runs into per-policy, per-strategy columns aggregated over seeds;
``plots`` draws them; ``markdown`` writes the report. Spread conventions: tables give mean ±
sample std over seeds; plot bands span min-max over seeds.
"""

from mutualrl.report.data import RunData, build_table, load_runs
from mutualrl.report.markdown import write_report
from mutualrl.report.plots import make_plots

__all__ = ["RunData", "build_table", "load_runs", "make_plots", "write_report"]
