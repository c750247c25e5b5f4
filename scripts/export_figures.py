"""Export the README's figures from committed benchmark results (needs kaleido and a Chromium binary).

Run: ``BROWSER_PATH=/usr/bin/chromium python scripts/export_figures.py`` (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import orjson

from r3lab.runs import list_runs
from r3lab.viz import rl_curves_figure, transport_figure

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "figures"


def main() -> None:
    if "BROWSER_PATH" not in os.environ:
        found = shutil.which("chromium") or shutil.which("chromium-browser")
        if found:
            os.environ["BROWSER_PATH"] = found
    OUT.mkdir(parents=True, exist_ok=True)
    records = orjson.loads((ROOT / "bench" / "results" / "transport.json").read_bytes())
    path = OUT / "transport.png"
    transport_figure(records, popularity="uniform").write_image(path, scale=1)
    print(f"wrote {path}")
    runs = [r for _, r in list_runs(ROOT / "bench" / "results" / "rl") if r.name.startswith("tiny-glm4-moe-default-")]
    path = OUT / "rl_k3_glm4.png"
    rl_curves_figure(runs, title="tiny-glm4-moe: train-inference k3 KL per RL step").write_image(path, scale=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
