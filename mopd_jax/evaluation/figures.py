"""Matplotlib figures of the experiments, rendered without a display."""

from __future__ import annotations

import io


def pyplot():
  """``matplotlib.pyplot`` on the Agg backend (works on headless hosts)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def png_bytes(fig, dpi: int = 100) -> bytes:
  """``fig`` as PNG bytes; the figure is closed."""
  plt = pyplot()
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=dpi)
  plt.close(fig)
  return buf.getvalue()
