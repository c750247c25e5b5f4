"""Regenerate docs/gallery.md: every figure of every notebook at its CI parameters, as a PNG under docs/gallery/.

    python scripts/make_gallery.py            # all notebooks/*.ipynb
    python scripts/make_gallery.py 01 03      # only notebooks whose name starts with these

Each notebook runs top to bottom with papermill (``metadata["r3lab"]["ci_parameters"]``, runs and exported files in
a temporary folder, cells tagged ``live`` left out); each plotly figure it displays is drawn by kaleido at the
notebook's output width (968 px: JupyterLab at 1400x1000 with the file browser open) and its own height, scale 1,
so the PNGs stay small and a visual regression shows as a changed file in a diff. Starts vLLM engines: run it
alone (``flock /tmp/r3lab-heavy.lock python scripts/make_gallery.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_WIDTH = 968  # px: JupyterLab's output area at 1400x1000 with the file browser open
PLOTLY = "application/vnd.plotly.v1+json"


def _run(path: Path, tmp: Path) -> list[dict]:
    """The notebook executed at its CI parameters; the plotly figures it displayed, in order."""
    import nbformat
    import papermill
    from papermill.iorw import load_notebook_node

    nb = load_notebook_node(str(path))
    nb.cells = [c for c in nb.cells if "live" not in c.metadata.get("tags", [])]
    source = next(c.source for c in nb.cells if c.cell_type == "code")
    params = {**nb.metadata["r3lab"]["ci_parameters"], "out_dir": str(tmp / "out"), "export": False}
    if "\nruns_dir =" in "\n" + source:
        params["runs_dir"] = str(tmp / "runs")
    params = {k: v for k, v in params.items() if f"\n{k} =" in "\n" + source}
    src = tmp / path.name
    nbformat.write(nb, src)
    done = tmp / f"done-{path.name}"
    papermill.execute_notebook(str(src), str(done), parameters=params, kernel_name="r3lab", cwd=str(tmp),
                               execution_timeout=900, progress_bar=False)
    executed = nbformat.read(done, as_version=4)
    return [o["data"][PLOTLY] for c in executed.cells if c.cell_type == "code" for o in c.outputs
            if PLOTLY in o.get("data", {})]


def main(argv: list[str] | None = None) -> int:
    import plotly.graph_objects as go

    from r3lab.viz import export

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("only", nargs="*", help="notebook name prefixes (default: every notebook)")
    ap.add_argument("--out", default=str(ROOT / "docs"), help="the folder of gallery.md and gallery/ (default: docs)")
    args = ap.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    notebooks = [p for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
                 if not args.only or any(p.name.startswith(o) for o in args.only)]
    if not notebooks:
        print(f"no notebook matches {args.only}", file=sys.stderr)
        return 2
    out = Path(args.out)
    pngs = out / "gallery"
    pngs.mkdir(parents=True, exist_ok=True)
    sections = {}
    for path in notebooks:
        with tempfile.TemporaryDirectory(prefix="r3lab-gallery-") as tmp:
            figures = _run(path, Path(tmp))
        for old in pngs.glob(f"{path.stem}-*.png"):
            old.unlink()
        rows = []
        for i, spec in enumerate(figures):
            spec = {k: v for k, v in spec.items() if k in ("data", "layout", "frames")}
            fig = go.Figure(spec)
            fig.update_layout(width=NOTEBOOK_WIDTH)
            name = f"{path.stem}-{i:02d}"
            export(fig, pngs / name, formats=("png",), scale=1)
            title = (fig.layout.title.text or name).replace("<br>", " ")
            rows.append(f"### {title}\n\n![{name}](gallery/{name}.png)\n")
            print(f"{name}.png  {title}", file=sys.stderr)
        sections[path.stem] = rows
    md = out / "gallery.md"
    kept = {}
    if md.exists() and args.only:  # a partial run keeps the other notebooks' sections
        current = None
        for line in md.read_text().splitlines(keepends=True):
            if line.startswith("## notebooks/"):
                current = line.removeprefix("## notebooks/").removesuffix(".ipynb\n").strip()
                kept[current] = []
            elif current:
                kept[current].append(line)
    lines = ["# Gallery: the notebooks' figures at CI sizes\n\n",
             "Every figure each notebook draws when run with its CI parameters (`metadata.r3lab.ci_parameters`), "
             f"drawn at the notebook's output width ({NOTEBOOK_WIDTH} px). Regenerate with "
             "`flock /tmp/r3lab-heavy.lock python scripts/make_gallery.py` and commit docs/gallery.md with "
             "docs/gallery/: a changed figure shows as a changed PNG in the diff. The numbers are from tiny "
             "models and a few tokens: the figures' layout is the point, not their values.\n\n"]
    for stem in sorted(set(kept) | set(sections)):
        lines.append(f"## notebooks/{stem}.ipynb\n\n")
        lines += [r + "\n" for r in sections[stem]] if stem in sections else kept[stem]
    md.write_text("".join(lines).rstrip() + "\n")
    total = sum(p.stat().st_size for p in pngs.glob("*.png"))
    print(f"wrote {md} and {len(list(pngs.glob('*.png')))} PNGs ({total / 1e6:.1f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
