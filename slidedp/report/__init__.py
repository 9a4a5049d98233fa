"""Presentation of a Plan: Chrome / Perfetto trace JSON and a self-contained HTML report."""

from slidedp.report.chrome_trace import chrome_trace, to_chrome_trace
from slidedp.report.html import render_html, to_html

__all__ = ["chrome_trace", "render_html", "to_chrome_trace", "to_html"]
