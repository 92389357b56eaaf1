"""The models a multi-model server offers (server/models_manager.py loads them): every .gguf file
and HF directory of --models-dir, named by its file name (less .gguf) or directory name, and each
--model NAME=PATH; each with its settings.

Settings, per model, from DIR/models.json or DIR/models.yaml ({NAME: {...}}) and DIR/NAME.json
(which wins): any engine setting (EngineConfig's fields: dtype, quantization, max_model_len,
kv_cache_memory, runner, enable_lora, ...) and the per-model server settings SERVER_KEYS
(lora_modules, tool calling, keep_alive). The command line's engine flags are every model's
defaults. Also the durations and sizes the manager reads (Ollama's keep_alive, --max-memory).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.config import EngineConfig, parse_size
from pagedserve.server.config import ServerConfig

# ServerConfig fields a model's settings may set for that model alone (the rest are the server's).
SERVER_KEYS = ("lora_modules", "enable_auto_tool_choice", "tool_call_parser", "reasoning_parser", "keep_alive")
SETTINGS_FILES = ("models.json", "models.yaml", "models.yml")
_ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig) if f.init} - {"model"}


@dataclass
class ModelSpec:
    name: str                                   # what a request's `model` field says
    path: str                                   # a .gguf file, an HF directory, a Hub id or (dummy) a preset
    settings: dict[str, Any] = field(default_factory=dict)   # EngineConfig fields
    server: dict[str, Any] = field(default_factory=dict)     # SERVER_KEYS

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        """The command line's engine settings with this model's on top (ValueError if refused)."""
        return dataclasses.replace(base, model=self.path, **self.settings)

    def server_config(self, base: ServerConfig) -> ServerConfig:
        keys = {k: v for k, v in self.server.items() if k != "keep_alive"}
        return dataclasses.replace(base, served_model_name=[self.name], **keys)

    def weight_bytes(self) -> int:
        """The bytes of the weight files (0 where there are none here: a Hub id, a preset)."""
        p = Path(self.path)
        if p.is_file():
            return p.stat().st_size
        if p.is_dir():
            return sum(f.stat().st_size for f in p.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf"))
        return 0


def _check_settings(name: str, settings: Any, where: str) -> tuple[dict, dict]:
    if not isinstance(settings, dict):
        raise ValueError(f"{where}: the settings of model {name!r} must be an object, got {type(settings).__name__}")
    unknown = sorted(set(settings) - _ENGINE_KEYS - set(SERVER_KEYS))
    if unknown:
        raise ValueError(f"{where}: model {name!r}: unknown setting(s) {', '.join(unknown)} (engine settings as "
                         f"EngineConfig names them, or {', '.join(SERVER_KEYS)})")
    engine = {k: v for k, v in settings.items() if k in _ENGINE_KEYS}
    server = {k: v for k, v in settings.items() if k in SERVER_KEYS}
    if "keep_alive" in server:
        parse_duration(server["keep_alive"])
    return engine, server


def _read_settings(models_dir: Path) -> dict[str, tuple[dict, str]]:
    """name -> (settings, the file they came from): models.json / models.yaml, then NAME.json."""
    out: dict[str, tuple[dict, str]] = {}
    for fname in SETTINGS_FILES:
        f = models_dir / fname
        if not f.is_file():
            continue
        text = f.read_text()
        if f.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml
            data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{f}: expected an object of model name -> settings")
        out.update({str(k): (v, str(f)) for k, v in data.items()})
    for f in sorted(models_dir.glob("*.json")):
        if f.name not in SETTINGS_FILES:
            out[f.stem] = (json.loads(f.read_text()), str(f))
    return out


def _is_hf_dir(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file()


def scan_models_dir(models_dir: str) -> list[ModelSpec]:
    root = Path(models_dir).expanduser()
    if not root.is_dir():
        raise ValueError(f"--models-dir {models_dir!r} is not a directory")
    specs = []
    for p in sorted(root.iterdir()):
        if p.is_file() and p.suffix == ".gguf":
            specs.append(ModelSpec(p.stem, str(p)))
        elif _is_hf_dir(p):
            specs.append(ModelSpec(p.name, str(p)))
    return specs


def parse_named_model(text: str) -> ModelSpec:
    """--model NAME=PATH."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--model {text!r}: expected NAME=PATH (or one model path alone)")
    return ModelSpec(name, path)


def find_models(models_dir: str | None, named: list[str]) -> list[ModelSpec]:
    """The models of --models-dir and of each --model NAME=PATH (or a bare path, named by its
    file or directory name), with their settings; ValueError for a clash or a bad setting."""
    specs = scan_models_dir(models_dir) if models_dir else []
    for text in named:
        spec = parse_named_model(text) if "=" in text else ModelSpec(Path(text).name.removesuffix(".gguf"), text)
        specs.append(spec)
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"two models are named {s.name!r}: rename one (--model NAME=PATH)")
        seen.add(s.name)
    settings = _read_settings(Path(models_dir).expanduser()) if models_dir else {}
    names = {s.name for s in specs}
    for name, (_, where) in settings.items():
        if name not in names:
            raise ValueError(f"{where}: settings for {name!r}, which is not a model here ({', '.join(sorted(names))})")
    for s in specs:
        if s.name in settings:
            s.settings, s.server = _check_settings(s.name, *settings[s.name])
    return specs


# ---- durations and sizes ------------------------------------------------------------------------
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any) -> float:
    """Seconds from Ollama's keep_alive: a number of seconds or a Go duration ("5m", "1h30m",
    "10s"); negative: forever (math.inf); 0: at once."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"keep_alive must be a duration (5m, 30s, 0, -1), got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        try:
            seconds = float(text)
        except ValueError:
            m = re.fullmatch(r"(-?)((?:\d+(?:\.\d*)?(?:ns|us|µs|ms|s|m|h))+)", text)
            if m is None:
                raise ValueError(f"keep_alive must be a duration (5m, 30s, 1h, 0, -1), got {value!r}") from None
            seconds = sum(float(n) * _UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)", m[2]))
            seconds = -seconds if m[1] else seconds
    if seconds != seconds:
        raise ValueError(f"keep_alive must be a duration, got {value!r}")
    return math.inf if seconds < 0 else seconds


def total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_memory(value: str | None) -> int | None:
    """--max-memory: a size (8GiB, 8G, bytes) or a share of the machine's RAM (80%); None: no limit."""
    if value is None or str(value).strip() in ("", "0"):
        return None
    text = str(value).strip()
    if text.endswith("%"):
        share = float(text[:-1])
        if not 0 < share <= 100:
            raise ValueError(f"--max-memory {value!r}: a share must be in (0, 100]%")
        return int(total_memory() * share / 100)
    return parse_size(text)


def rss_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
