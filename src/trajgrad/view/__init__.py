"""``trajgrad view RUN_DIR``: every token of a run, coloured by what the loss did with it.

One self-contained HTML page (no network: inline CSS, JS and SVG; the data embedded as JSON)
over a run directory: the episode table, one trajectory's tokens coloured by a chosen
channel, the learning curves and the exact objective. Modules: :mod:`.rundir` (reading the
run directory), :mod:`.text` (token ids to text), :mod:`.pagedata` (the page's data and its
caps), :mod:`.template` / :mod:`.script` (the page), :mod:`.server` (``--serve``, loopback
only). See ``docs/view.md``. :mod:`.plot` draws ``trajgrad plot``'s learning curves from the
same run directories.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

from .pagedata import CHANNELS, detail_lookup, page_data
from .plot import plot_run
from .rundir import RunFiles, read_run
from .server import serve
from .template import render_html

__all__ = ["CHANNELS", "RunFiles", "read_run", "page_data", "render_html", "build_page", "write_view", "serve_view", "plot_run"]

DEFAULT_MAX_EPISODES = 5000
DEFAULT_MAX_TOKENS = 300_000


def build_page(run_dir, *, max_episodes: int = DEFAULT_MAX_EPISODES, max_tokens: int = DEFAULT_MAX_TOKENS,
               serve: bool = False, environment: Optional[str] = None) -> Tuple[str, RunFiles]:
    """``(html, run)`` for a run directory (ValueError naming ``run_dir`` if it has no trajectories);
    ``environment``: only that environment's episodes (a run with several, ``tasks:``)."""
    run = read_run(run_dir, max_trajectories=max_episodes, environment=environment)
    return render_html(page_data(run, max_episodes=max_episodes, max_tokens=max_tokens, serve=serve)), run


def write_view(run_dir, out: Optional[Path] = None, *, max_episodes: int = DEFAULT_MAX_EPISODES,
               max_tokens: int = DEFAULT_MAX_TOKENS, environment: Optional[str] = None) -> Path:
    """Write the page (default ``RUN_DIR/view.html``) and return its path."""
    page, _ = build_page(run_dir, max_episodes=max_episodes, max_tokens=max_tokens, environment=environment)
    path = Path(out) if out is not None else Path(run_dir) / "view.html"
    if path.is_dir():
        raise ValueError(f"out: {str(path)!r} is a directory; give a file name such as view.html")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def serve_view(run_dir, *, port: int = 8765, max_episodes: int = DEFAULT_MAX_EPISODES,
               max_tokens: int = DEFAULT_MAX_TOKENS, max_requests: Optional[int] = None, console=print,
               environment: Optional[str] = None) -> None:
    """Serve the page on ``127.0.0.1:port`` until Ctrl-C; rows without embedded detail load on demand."""
    page, run = build_page(run_dir, max_episodes=max_episodes, max_tokens=max_tokens, serve=True,
                           environment=environment)
    serve(page, detail_lookup(run, max_episodes=max_episodes), port=port, max_requests=max_requests, console=console)
