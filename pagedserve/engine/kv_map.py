"""A run's KV cache, step by step, as one self-contained HTML file (`pagedserve generate --kv-map run.html`).

`KVMapRecorder` watches an `LLMEngine`: after every step it captures the cache
(engine/kv_view.py) and keeps what changed; `write_html` puts those frames into the
dashboard's page (pagedserve/dashboard/, inlined: no server, no network) which replays
them with a slider.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedserve.engine.kv_view import KVView, capture

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

PAGE = Path(__file__).resolve().parent.parent / "dashboard"
DEFAULT_MAX_FRAMES = 20_000


class KVMapRecorder:
    def __init__(self, engine: LLMEngine, max_frames: int = DEFAULT_MAX_FRAMES) -> None:
        self.engine = engine
        self.max_frames = max_frames
        self.view = KVView(engine.decode_tokens)
        self.frames: list[dict[str, Any]] = [self.view.full(capture(engine))]
        self.truncated = False
        engine.step_observers.append(self.record)

    def record(self) -> None:
        """One frame: the changes since the last one (none if nothing changed)."""
        if len(self.frames) >= self.max_frames:
            if not self.truncated:
                logger.warning("kv map: %d frames recorded; later steps are left out", self.max_frames)
                self.truncated = True
            return
        update = self.view.update(capture(self.engine))
        if update is not None:
            self.frames.append(update)

    def close(self) -> None:
        if self.record in self.engine.step_observers:
            self.engine.step_observers.remove(self.record)

    def write_html(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(replay_html(self.frames), encoding="utf-8")
        return path


def replay_html(frames: list[dict[str, Any]]) -> str:
    """The dashboard page with its CSS, its script and the frames inlined."""
    html = (PAGE / "index.html").read_text(encoding="utf-8")
    css = (PAGE / "dashboard.css").read_text(encoding="utf-8")
    js = (PAGE / "dashboard.js").read_text(encoding="utf-8")
    data = json.dumps({"frames": frames}, separators=(",", ":")).replace("</", "<\\/")   # no </script> inside
    html = html.replace('<link rel="stylesheet" href="/dashboard/dashboard.css">', f"<style>\n{css}</style>")
    html = html.replace('<script src="/dashboard/dashboard.js"></script>',
                        f"<script>window.PAGEDSERVE_REPLAY = {data};</script>\n<script>\n{js}</script>")
    assert "/dashboard/" not in html, "the replay must not load anything from a server"
    return html
