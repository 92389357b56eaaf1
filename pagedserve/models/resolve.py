"""A model argument to a local path: a file or directory as given, or a Hugging Face Hub id
(org/name) through huggingface_hub, as vLLM does: its cache (HF_HOME, HF_HUB_CACHE), its
offline mode (HF_HUB_OFFLINE=1: the cache only) and its token (HF_TOKEN)."""
from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# The default model's Hub id (what the server reports for it): without the Hub and not in its
# cache, it is the bundled file (models/loader.py's default_model_path, a Q4_1 GGUF of it).
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

# What a model needs from a Hub repository (not other formats' weights, images, ...).
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model", "*.tiktoken"]


class ModelNotFoundError(FileNotFoundError):
    """The model (or tokenizer) argument names neither a local path nor a reachable Hub model:
    the message is one line saying which and why."""


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1


def resolve_model(name: str, revision: str | None = None) -> str:
    """A local path for `name`: the path itself if it exists, else the snapshot of the Hub
    model `name` (downloaded unless offline). Raises ModelNotFoundError otherwise."""
    path = Path(name).expanduser()
    if path.is_dir() and not (path / "config.json").exists() and not (path / "tokenizer_config.json").exists():
        raise ModelNotFoundError(f"model {name!r}: a directory without config.json (an HF model directory holds "
                                 f"config.json, *.safetensors and the tokenizer)")
    if path.exists():
        return str(path)
    if _looks_like_path(name):
        raise ModelNotFoundError(f"model {name!r}: no such file or directory (give an HF directory, a .gguf file "
                                 f"or a Hub id such as HuggingFaceTB/SmolLM2-135M-Instruct)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError)
    try:
        return snapshot_download(name, revision=revision, allow_patterns=HUB_FILES)
    except HFValidationError:
        raise ModelNotFoundError(f"model {name!r} is neither a local path nor a valid Hub id (org/name)") from None
    except GatedRepoError:
        raise ModelNotFoundError(f"model {name!r} is gated on the Hub: accept its terms and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"model {name!r}: not a local path, and no such model on the Hub (or it is "
                                 f"private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"model {name!r} has no revision {revision!r} on the Hub") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        if name == DEFAULT_HUB_ID and revision is None:
            from pagedserve.models.loader import default_model_path
            path = default_model_path()
            logger.warning("model %s is not in the Hugging Face cache and the Hub is not reachable: serving the "
                           "bundled copy of it, %s", name, path)
            return path
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        raise ModelNotFoundError(f"model {name!r}: not a local path, not in the Hugging Face cache "
                                 f"({constants.HF_HUB_CACHE}), and {why}") from None
