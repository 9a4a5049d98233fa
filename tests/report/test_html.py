"""HTML report: self-contained, inline SVG swimlanes and memory curve, grouped decisions, notes."""
import json

import os
import re
import shutil
import subprocess
import struct
import zlib
from pathlib import Path

import pytest

from slidedp.report import to_chrome_trace, to_html
from slidedp.report.html import group_decisions, nice_step, render_html, time_axis
from slidedp.scheduler.plan import TimelineEvent

CHROMIUM = Path("/usr/bin/chromium")


def external_references(html: str) -> list[str]:
    """http(s) URLs outside XML namespace declarations, and any tag that would fetch something."""
    without_ns = re.sub(r'xmlns(:\w+)?="[^"]*"', "", html)
    urls = re.findall(r"https?://[^\s\"'<>)]*", without_ns)
    fetchers = re.findall(r"<(?:script|link|img|iframe|object|embed)\b[^>]*>|@import|url\(", without_ns, re.I)
    return urls + fetchers


def test_report_has_svgs_and_no_external_resources(make_plan, tmp_path):
    plan = make_plan(world_size=2)
    path = tmp_path / "report.html"
    to_html(plan, path)
    html = path.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>")
    assert external_references(html) == []
    assert html.count("<svg") == 2 and 'class="swimlanes"' in html and 'class="memory"' in html
    assert html.count('<rect class="op ') == len(plan.timeline)
    for kind in ("h2d", "fwd", "recompute", "bwd", "d2h", "update", "collective"):
        assert f'class="op k-{kind}' in html
    assert ">rank 0<" in html and ">rank 1<" in html and ">CPU update<" in html
    assert 'class="budget"' in html and "budget 1.17 GiB" in html  # the budget line of the memory chart
    assert "<title>fwd L1 — rank 0, compute — " in html  # hover titles with name and times
    # Header: workload, hardware, budget, predicted step, bottleneck, solver status and gap.
    assert "2 rank(s) × 2 micro-batch(es) × 4 × 2048 tokens, bf16" in html
    assert "h100-sxm" in html and "FEASIBLE" in html and "3.10% (relative_gap)" in html
    assert f"bottleneck: <span class=\"hot\">{plan.predicted['bottleneck']}</span>" in html
    assert "56.498 ms" in html  # predicted step
    assert "synthetic timeline for the report tests" in html  # notes


def test_time_axis_ticks_are_round_numbers():
    assert nice_step(0.0565, 10) == pytest.approx(0.005)
    assert nice_step(7.3, 8) == 1.0 and nice_step(2.4e-5, 5) == pytest.approx(5e-6)
    axis = time_axis(0.0565, 100, 1100)
    assert [t.label for t in axis.ticks][:3] == ["0 ms", "5 ms", "10 ms"]
    assert axis.ticks[0].x == 100 and axis.ticks[-1].x <= 1100


def test_decisions_are_grouped_by_consecutive_identical_layers(make_plan):
    rows = group_decisions(make_plan(blocks=6).decisions)
    assert [(r["label"], r["count"], r["activation"]) for r in rows] == [
        ("model.embed_tokens", 1, "resident"),
        ("model.layers.0 .. 3", 4, "recompute"),
        ("model.layers.4 .. 5", 2, "keep"),
        ("model.norm+lm_head", 1, "resident"),
    ]
    assert rows[1]["ids"] == "1–4" and rows[1]["params"] == f"{4 * 3_540_096:,}"


def test_plan_without_timeline_renders_with_a_clear_message(make_plan):
    html = render_html(make_plan(timeline=False))
    assert "<svg" not in html
    assert "This plan has no predicted timeline (solver: cp-sat, FEASIBLE)" in html
    assert "no predicted memory timeline" in html
    assert "model.layers.0 .. 3" in html and external_references(html) == []


def test_names_are_escaped_and_sub_tracks_are_drawn(make_plan):
    events = (TimelineEvent(0, "h2d", "<script>x</script>", 1, 0, 0.0, 0.002),
              TimelineEvent(0, "h2d", "h2d L2", 2, 0, 0.001, 0.003))
    html = render_html(make_plan(world_size=1).replace(timeline=events))
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert ">H2D (2)<" in html
    assert 'row-label">collective<' not in html  # one rank and no collective: the lane is left out
    assert ">collective</span>" not in html and ">h2d</span>" in html  # the legend lists the kinds drawn


def test_solved_plan_of_a_real_model_renders(tmp_path):
    import slidedp
    from tests.models import make_model

    plan = slidedp.plan(make_model("llama"), "1GiB", batch_size=2, seq_len=16, precision="fp32", device="cpu")
    to_html(plan, tmp_path / "r.html")
    to_chrome_trace(plan, tmp_path / "t.json")
    html = (tmp_path / "r.html").read_text(encoding="utf-8")
    assert plan.timeline, "the solver predicts a timeline"
    assert "no predicted timeline" not in html and "<svg" in html
    trace = json.loads((tmp_path / "t.json").read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])


def png_size_and_colours(path: Path) -> tuple[int, int, int]:
    """Width, height and the number of distinct byte values of the decoded rows (a blank page has ~2)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    pos, idat = 8, b""
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    return width, height, len(set(zlib.decompress(idat)))


@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
def test_report_renders_in_headless_chromium(make_plan, tmp_path):
    """Offline render to a PNG. SLIDEDP_REPORT_SCREENSHOT=docs/report_example.png keeps the screenshot."""
    html = tmp_path / "report.html"
    to_html(make_plan(world_size=2), html)
    png = tmp_path / "report.png"
    subprocess.run([
        str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", "--host-resolver-rules=MAP * ~NOTFOUND",
        "--hide-scrollbars", "--window-size=1220,1380", f"--screenshot={png}", html.as_uri(),
    ], check=True, timeout=120, capture_output=True)
    width, height, colours = png_size_and_colours(png)
    assert (width, height) == (1220, 1380)
    assert colours > 50
    keep = os.environ.get("SLIDEDP_REPORT_SCREENSHOT")
    if keep:
        shutil.copy(png, keep)


def test_report_explains_why_with_formatted_numbers_and_where_state_lives(tmp_path):
    """The "why these decisions" of the CLI, each alternative's reason; the solver card in ms/s, %,
    no raw dicts or float noise; device-resident and streamed layers named in the decisions table."""
    import html as html_lib
    import re

    import torch

    from slidedp.costmodel.hardware import PRESETS
    from slidedp.ir.build import build_layer_graph
    from slidedp.scheduler.decisions import SolverOptions
    from slidedp.scheduler.solve import solve_plan
    from tests.models import make_model

    graph = build_layer_graph(make_model("llama"), batch_size=2, seq_len=16, compute_dtype=torch.float32)
    plan = solve_plan(graph, budget_bytes=2**30, hardware=PRESETS["cpu"], precision="fp32", micro_batches=2,
                      streamed_updates=True, options=SolverOptions(streamed_layers=1))
    assert plan.alternatives and plan.streamed_updates
    to_html(plan, tmp_path / "r.html")
    text = html_lib.unescape((tmp_path / "r.html").read_text(encoding="utf-8"))
    assert "Why these decisions" in text
    for a in plan.alternatives:
        assert a.reason in text and a.decision in text
    assert "streamed (updated on the device)" in text and "host (CPU AdamW)" in text
    card = text[text.index("<h3>Solver"):text.index("<h2>Predicted timeline")]
    assert "{" not in card and "'" not in card  # no raw dicts
    assert not re.search(r"\.\d{8,}", card)  # no float noise
