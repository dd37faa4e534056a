"""What every figure and table module shares: matplotlib without a display,
saving a figure, a markdown table, a sweep's report files."""

import matplotlib
from etils import epath

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["markdown", "plt", "save", "write_sweep_report"]


def save(fig, path: epath.Path, tight: bool = True) -> epath.Path:
  """Writes `fig` to `path` (its folder made if needed) and closes it; `tight`
  off for figures with a colorbar shared by several axes. matplotlib writes
  to an open file, in the format the suffix names: it cannot open a gs:// path."""
  path.parent.mkdir(parents=True, exist_ok=True)
  if tight:
    fig.tight_layout()
  with path.open("wb") as f:
    fig.savefig(f, format=path.suffix.removeprefix("."), dpi=120)
  plt.close(fig)
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
  md.write_text(table)
  return [md, draw(root / "plots" / f"{name}.png")]
