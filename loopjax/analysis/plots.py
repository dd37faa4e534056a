"""What every figure and table module shares: matplotlib without a display,
saving a figure, a markdown table, a sweep's report files."""

import io

import matplotlib
from etils import epath

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from loopjax import storage  # noqa: E402

__all__ = ["markdown", "plt", "save", "write_sweep_report"]


def save(fig, path: epath.Path, tight: bool = True) -> epath.Path:
  """Writes `fig` to `path` (its folder made if needed) and closes it; `tight`
  off for figures with a colorbar shared by several axes. Drawn in memory in
  the format the suffix names, then written whole (matplotlib cannot open a
  gs:// path)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  if tight:
    fig.tight_layout()
  buf = io.BytesIO()
  fig.savefig(buf, format=path.suffix.removeprefix("."), dpi=120)
  plt.close(fig)
  storage.write_whole(path, buf.getvalue())
  return path


def markdown(head: list[str], rows: list[list[str]]) -> str:
  """A markdown table."""
  out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def write_sweep_report(
  root: epath.Path, name: str, table: str, draw
) -> list[epath.Path]:
  """`root/<name>.md` (`table`) and `root/plots/<name>.png` (`draw(path)`)."""
  md = root / f"{name}.md"
  storage.write_whole(md, table)
  return [md, draw(root / "plots" / f"{name}.png")]
